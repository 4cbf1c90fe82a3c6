"""Mixed steps (decodes plus prompt chunks) replayed from CUDA graphs (``engine/cuda_graph.py``): the padded shape
that names a step's graph, and the lazily captured graphs' cap and capture failures.  The simulator cannot capture,
so capture and replay are stood in for here; ``tests/gpu/test_graphs.py`` compares real graphs with eager steps
(Qwen3 and Qwen3.5), ``tests/models/test_qwen3_oracle.py`` and ``test_qwen35_oracle.py`` the padded step with the
unpadded one (the latter also through emulated graphs: ``tests.util.emulated_graphs``)."""
from types import SimpleNamespace

from pegainfer.engine.cuda_graph import (MIXED_GRAPHS_MAX, StepGraphs, decode_graph_sizes, mixed_shape,
                                         mixed_warmup_shapes)

MAX_TOKENS, MAX_ROWS = 2048, 256


def _key(decodes: int, chunk_lengths) -> tuple:
    """The graph key of a mixed step of ``decodes`` decodes and chunks of ``chunk_lengths`` tokens (max_batch 256)."""
    sizes = decode_graph_sizes(256)
    Dp = next(s for s in sizes if s >= decodes) if decodes else 0
    return ("mixed", *mixed_shape(Dp, sum(chunk_lengths), len(chunk_lengths), MAX_TOKENS, MAX_ROWS))


def test_steps_differing_only_within_their_buckets_share_a_graph():
    """Catches a key that depends on exact lengths (every step would capture a graph of its own): 57..64 decodes
    beside one or two chunks of 65..128 tokens in all are one graph; a step past a bucket is another."""
    key = _key(64, [128])
    assert key == ("mixed", 64, 128, 1)
    assert {_key(d, [n]) for d in range(57, 65) for n in (65, 100, 128)} == {key}
    assert {_key(d, [a, b]) for d in (57, 64) for a, b in ((1, 64), (30, 98), (64, 64))} == {("mixed", 64, 128, 2)}
    assert _key(65, [128]) == ("mixed", 80, 128, 1)
    assert _key(64, [129]) == ("mixed", 64, 256, 1)
    assert _key(64, [8, 8, 8]) == ("mixed", 64, 32, 4)         # three chunks' rows: four, one a padding row
    assert _key(0, [100, 100]) == ("mixed", 0, 256, 2)         # chunks only: no decode rows


def test_a_step_that_fills_the_token_budget_pads_to_the_tokens_left():
    """Catches a padded step larger than the token buffers: 16 decodes beside 2032 chunk tokens (a budget-full
    step) run as 16 + 2032, not 16 + the 2048 bucket; chunks past the graphs' limit or with more rows than the
    buffers hold run unpadded."""
    assert mixed_shape(16, 2032, 15, MAX_TOKENS, MAX_ROWS) == (16, 2032, 16)
    assert mixed_shape(16, 1500, 3, MAX_TOKENS, MAX_ROWS) == (16, 1536, 4)
    assert mixed_shape(64, 2000, 1, MAX_TOKENS, MAX_ROWS) is None          # 64 + 2000 > 2048 tokens
    assert mixed_shape(256, 100, 1, 4096, MAX_ROWS) is None                # no row left for the chunk
    assert mixed_shape(250, 100, 5, 4096, 256) == (250, 128, 6)            # 8 rows capped at the 6 left
    assert mixed_shape(0, 3000, 1, 8192, MAX_ROWS) is None                 # past PREFILL_GRAPH_MAX: eager
    for Dp, Cp, Rp in mixed_warmup_shapes(64, MAX_TOKENS, MAX_ROWS):
        assert Dp == 64 and Cp in (128, 256) and Rp in (1, 2)


class _Graphs(StepGraphs):
    """StepGraphs whose capture and replay only record (the simulator has no graphs)."""

    def __init__(self, fail=()):
        super().__init__(SimpleNamespace(model=SimpleNamespace(max_tokens=MAX_TOKENS, pads_prefill=True)))
        self.fail, self.captured, self.replayed = set(fail), [], []

    def capture_fn(self, key, run):
        if key in self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured.append(key)
        self.execs[key] = object()

    def replay(self, *key):
        self.replayed.append(key)


def test_mixed_graphs_are_captured_at_second_sight_up_to_the_cap():
    """Catches graphs captured without bound (each holds a step's launches) or at a shape's first step (whose
    kernel variants may still compile): a shape runs eagerly once, then is captured and replayed; past
    MIXED_GRAPHS_MAX graphs new shapes stay eager, while the captured ones keep replaying."""
    graphs = _Graphs()
    keys = [("mixed", 64, 16 * (i + 1), 1) for i in range(MIXED_GRAPHS_MAX + 5)]
    for key in keys:
        assert graphs.replay_or_capture(key, None) is False        # first sight: eager
    for key in keys:
        graphs.replay_or_capture(key, None)
    assert graphs.captured == keys[:MIXED_GRAPHS_MAX]
    assert len(graphs.execs) == MIXED_GRAPHS_MAX
    assert graphs.replay_or_capture(keys[-1], None) is False       # over the cap: eager, never captured
    assert graphs.replay_or_capture(keys[0], None) is True
    assert graphs.replayed.count(keys[0]) == 2 and keys[-1] not in graphs.replayed


def test_a_failed_capture_leaves_its_shape_eager(caplog):
    """Catches a capture failure that crashes the server or is retried (and logged) at every step: the step runs
    eagerly, the failure is logged once, other shapes still get graphs."""
    bad, good = ("mixed", 8, 16, 1), ("mixed", 8, 32, 1)
    graphs = _Graphs(fail={bad})
    with caplog.at_level("WARNING", logger="pegainfer.engine"):
        results = [graphs.replay_or_capture(bad, None) for _ in range(5)]
    assert results == [False] * 5
    assert sum("capture" in r.getMessage() for r in caplog.records) == 1
    assert [graphs.replay_or_capture(good, None) for _ in range(2)] == [False, True]
    assert graphs.captured == [good] and not graphs.has(*bad)
