"""``benchmarks/graph_capture.py``: the shapes it captures beyond the warm-up's, and its one-line refusal without a
GPU (the simulator has no CUDA graphs)."""
import os
from types import SimpleNamespace

import pytest

from tests.benchmarks.scripts import one_line_error, run_script

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def test_extra_shapes_are_new_and_fit_the_buffers(bench_modules):
    """Catches shapes the warm-up already holds (the timing would measure nothing) or shapes past the model's rows:
    the chunk-row variants 8 / 16 / 32 beside decode sizes up to max_batch, minus the captured ones."""
    import graph_capture
    from pegainfer.engine.cuda_graph import mixed_warmup_shapes
    max_batch = 64
    model = SimpleNamespace(max_tokens=2048 + max_batch, max_rows=max_batch + 32)
    warm = {("mixed", *s) for s in mixed_warmup_shapes(max_batch, model.max_tokens, model.max_rows)}
    runner = SimpleNamespace(model=model, graphs=SimpleNamespace(execs=dict.fromkeys(warm)))
    shapes = graph_capture.extra_shapes(runner, max_batch, 100)
    assert shapes and len(shapes) == len(set(shapes))
    assert not {("mixed", *s) for s in shapes} & warm
    assert {s[2] for s in shapes} == {8, 32}                     # 16 rows: the warm-up's own
    assert all(Dp + Rp <= model.max_rows and Dp + Cp <= model.max_tokens for Dp, Cp, Rp in shapes)
    assert graph_capture.extra_shapes(runner, max_batch, 5) == shapes[:5]


@pytest.mark.skipif(not SIMULATOR, reason="checks the message without a GPU")
def test_it_says_it_needs_a_gpu():
    r = run_script("graph_capture.py", "--model-path", "unused")
    assert r.returncode == 2
    assert one_line_error(r).startswith("error: graph_capture.py needs a GPU (")
