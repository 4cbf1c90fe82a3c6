"""``benchmarks/bench_mixed_step.py`` on the demo model (in the simulator on CI), run in-process through its
``main`` (``test_help.py`` runs it as a script)."""
import json


def test_mixed_step_benchmark_times_the_three_kinds(bench_modules, tmp_path, monkeypatch):
    """Catches a benchmark that times some other step than the one it names: every timed (and warm-up) mixed step
    carries the 2 decodes and both new prompts, every prompts-alone step both prompts and nothing else; each kind
    is timed ``--runs`` times, the excess their difference."""
    import bench_mixed_step
    from pegainfer.engine.scheduler import Scheduler

    steps, schedule = [], Scheduler.schedule

    def recording(self):
        step = schedule(self)
        if step is not None:
            steps.append((len(step.decodes), sorted(n for _, _, n in step.chunks)))
        return step
    monkeypatch.setattr(Scheduler, "schedule", recording)
    out = tmp_path / "mixed.json"
    assert bench_mixed_step.main(["--batch", "2", "--prompts", "2", "--prompt-len", "4", "--context", "5",
                                  "--runs", "1", "--json", str(out)]) == 0
    assert steps.count((2, [4, 4])) == 2 and steps.count((0, [4, 4])) == 2, steps
    got = json.loads(out.read_text())
    assert {k: len(v) for k, v in got["step_s"].items()} == {"decode": 1, "prompts": 1, "mixed": 1}
    p50 = got["p50_ms"]
    assert all(v > 0 for v in p50.values())
    assert abs(got["excess_ms"] - (p50["mixed"] - p50["decode"] - p50["prompts"])) < 1e-9
    assert got["max_num_batched_tokens"] == 2 + 2 * 4


def test_policy_fields_reach_the_engine(bench_modules, tmp_path, monkeypatch):
    """``--policy``: the engine is built with the default policy changed by those fields (as ab_policy.py's
    variants); a field it does not have is refused in one line."""
    import pytest

    import bench_mixed_step
    from pegainfer.engine.engine import Engine

    seen, real = [], Engine.from_folder.__func__

    def recording(cls, *a, **kw):
        seen.append(kw.get("policy"))
        return real(cls, *a, **kw)
    monkeypatch.setattr(Engine, "from_folder", classmethod(recording))
    out = tmp_path / "mixed.json"
    assert bench_mixed_step.main(["--batch", "1", "--prompts", "1", "--prompt-len", "2", "--context", "3",
                                  "--runs", "1", "--policy", "head_argmax=false", "--json", str(out)]) == 0
    assert not seen[0].head_argmax and json.loads(out.read_text())["policy"] == "head_argmax=false"
    with pytest.raises(SystemExit):
        bench_mixed_step.main(["--policy", "nope=1"])


def test_profile_needs_a_gpu_and_reports_what_the_mixed_step_adds(bench_modules, capsys):
    """``--profile`` is refused in one line without a GPU (before any engine is built); its table lists kernels by
    the GPU time the mixed step adds to the decode step's, a kernel only the mixed step runs included."""
    import pytest

    import bench_mixed_step
    with pytest.raises(SystemExit) as e:
        bench_mixed_step.main(["--profile"])
    assert e.value.code == 2 and "needs a GPU" in capsys.readouterr().err
    bench_mixed_step.report_profile({"decode": {"gemm 132x128": [4, 40.0], "attention 64x128": [2, 10.0]},
                                     "mixed": {"gemm 132x128": [4, 55.0], "attention 64x128": [2, 11.0],
                                               "chunk_scan 64x128": [3, 30.0]}})
    lines = capsys.readouterr().out.splitlines()
    assert "decode 50.0 us, mixed 96.0 us" in lines[1]
    rows = [line.split()[0] for line in lines[3:]]
    assert rows == ["chunk_scan", "gemm", "attention"], lines
    assert lines[3].split()[-1] == "+30.0" and lines[5].split()[-1] == "+1.0"
