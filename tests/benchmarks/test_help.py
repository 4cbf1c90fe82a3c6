"""Every benchmark script answers ``--help`` at once, and its description opens with the question it answers."""
import pytest

from tests.benchmarks.scripts import BENCHMARKS, run_script

QUESTIONS = {
    "ab_policy.py": "Which launch policy makes a decode step faster on this GPU?",
    "step_profile.py": "Where does a decode step's time go",
    "bench_gemv.py": "How close do pegainfer's weight projections come to the GPU's read bandwidth",
    "bench_gemm.py": "How fast are pegainfer's projection GEMMs at every token count",
    "bench_attention.py": "How fast is pegainfer's paged attention",
    "bench_gated_delta.py": "How fast is one Gated DeltaNet layer's chunked delta rule on a prompt",
    "constrained_decode.py": "Does grammar-constrained decoding (structured output) slow a batch down?",
    "bench_sampling.py": "How long does token selection take on this GPU?",
    "launch_cost.py": "How much host time does one eager kernel launch take?",
    "bench_server.py": "What does the OpenAI HTTP server add to time-to-first-token and time-per-output-token?",
    "accuracy_floor.py": "How far apart are two *valid* bf16 implementations of the same model",
    "prefix_cache_ttft.py": "How much sooner does the first token of a prompt come when an earlier request computed "
                            "its prefix (prefix caching)?",
    "soak.py": "Does the server stay healthy under a long mixed load?",
    "bench_mixed_step.py": "How long does a mixed step take",
    "bench_row_kernels.py": "How fast are the kernels between a prompt chunk's projections",
    "graph_capture.py": "What does capturing a mixed step's CUDA graph cost",
}
STEP_PROFILE_MODES = {
    "timeline": "Where does the time between a decode step's kernels go",
    "ablation": "What does each kernel family cost",
    "gaps": "How much of a decode token's time is spent outside its CUDA graph?",
    "kernels": "How long does each kernel of the decode step run",
    "trace": "How much GPU time does each kernel take",
}


def _one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("script", sorted(QUESTIONS))
def test_help_states_the_question(script):
    r = run_script(script, "--help", timeout=60)
    assert r.returncode == 0, r.stderr
    assert QUESTIONS[script] in _one_line(r.stdout)


@pytest.mark.parametrize("mode", sorted(STEP_PROFILE_MODES))
def test_step_profile_modes_state_their_question(mode):
    r = run_script("step_profile.py", mode, "--help", timeout=60)
    assert r.returncode == 0, r.stderr
    assert STEP_PROFILE_MODES[mode] in _one_line(r.stdout)


def test_every_script_is_covered():
    """A new script in benchmarks/ gets its question checked here too (graph_timing.py is the shared helper)."""
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - {"graph_timing.py"}
    assert scripts == set(QUESTIONS)

