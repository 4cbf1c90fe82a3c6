"""Mixed steps (decodes plus prompt chunks) replayed from CUDA graphs (``engine/cuda_graph.py``): the padded shape
that names a step's graph, and the lazily captured graphs' cap and capture failures.  The simulator cannot capture,
so capture and replay are stood in for here; ``tests/gpu/test_graphs.py`` compares real graphs with eager steps
(Qwen3 and Qwen3.5), ``tests/models/test_qwen3_oracle.py`` and ``test_qwen35_oracle.py`` the padded step with the
unpadded one (the latter also through emulated graphs: ``tests.util.emulated_graphs``)."""
import time
from types import SimpleNamespace

from pegainfer.engine.cuda_graph import (MIXED_GRAPHS_MAX, MIXED_MIN_ROWS, MIXED_SPARE_ROWS, PREFILL_GRAPH_MAX,
                                         StepGraphs, mixed_decode_rows, mixed_shape, mixed_warmup_shapes)

MAX_TOKENS, MAX_ROWS = 2048, 256


def _key(decodes: int, chunk_lengths, max_tokens: int = MAX_TOKENS) -> tuple:
    """The graph key of a mixed step of ``decodes`` decodes and chunks of ``chunk_lengths`` tokens (max_batch 256)."""
    Dp = mixed_decode_rows(decodes, 256)
    return ("mixed", *mixed_shape(Dp, sum(chunk_lengths), len(chunk_lengths), max_tokens, MAX_ROWS))


def test_mixed_decode_rows_are_powers_of_two_then_half_steps():
    """Catches decode padding finer than the shapes a load can afford to capture (every size its own graphs) or
    coarser than 1.5x from 32 on: sizes 1 2 4 8 16 32 48 64 96 128 192 256, capped at max_batch."""
    assert sorted({mixed_decode_rows(d, 256) for d in range(1, 257)}) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128,
                                                                           192, 256]
    assert mixed_decode_rows(0, 256) == 0 and mixed_decode_rows(33, 256) == 48 and mixed_decode_rows(49, 256) == 64
    assert mixed_decode_rows(97, 100) == 100                  # never past the batch the buffers hold
    assert all(d <= mixed_decode_rows(d, 256) < max(2 * d, 1.5 * d + 1) for d in range(1, 257))


def test_steps_differing_only_within_their_buckets_share_a_graph():
    """Catches a key that depends on exact lengths or counts (every step would capture a graph of its own): 49..64
    decodes beside one to sixteen chunks of 65..128 tokens in all are one graph; a step past a bucket is another."""
    key = _key(64, [128])
    assert key == ("mixed", 64, 128, 16)
    assert {_key(d, [n]) for d in range(49, 65) for n in (65, 100, 128)} == {key}
    assert {_key(d, [a, b]) for d in (49, 64) for a, b in ((1, 64), (30, 98), (64, 64))} == {key}
    assert _key(64, [16] * 8) == key
    assert _key(65, [128]) == ("mixed", 96, 128, 16)
    assert _key(64, [129]) == ("mixed", 64, 256, 16)
    assert _key(64, [8] * 16) == key
    assert _key(64, [4] * 17) == ("mixed", 64, 128, 32)       # seventeen chunks' rows: thirty-two
    assert _key(0, [100, 100]) == ("mixed", 0, 256, 16)       # chunks only: no decode rows


def test_a_steady_load_meets_few_shapes():
    """Catches a key space that multiplies with the load's detail: every step of up to 64 decodes beside one to
    sixteen 128-token prompt chunks (a budget of 2048 tokens, the engine's 256 spare tokens) is one of at most
    9 decode sizes × 7 chunk buckets (128 .. 2048; sixteen chunks share one row count)."""
    keys = {_key(d, [128] * n, MAX_TOKENS + 256) for d in range(0, 65) for n in range(1, 17) if d + 128 * n <= 2048}
    assert len(keys) <= 9 * 7 and {k[3] for k in keys} == {16}, sorted(keys)


def test_a_step_that_fills_the_token_budget_pads_to_the_tokens_left():
    """Catches a padded step larger than the token buffers: 16 decodes beside 2032 chunk tokens (a budget-full
    step) run as 16 + 2032, not 16 + the 2048 bucket; chunks past the graphs' limit or with more rows than the
    buffers hold run unpadded; with the engine's spare tokens (max_batch more than the budget) no budget-full step
    of any decode count runs unpadded."""
    assert mixed_shape(16, 2032, 15, MAX_TOKENS, MAX_ROWS) == (16, 2032, 16)
    assert mixed_shape(16, 1500, 3, MAX_TOKENS, MAX_ROWS) == (16, 1536, 16)
    assert mixed_shape(64, 2000, 1, MAX_TOKENS, MAX_ROWS) is None          # 64 + 2000 > 2048 tokens
    assert mixed_shape(256, 100, 1, 4096, MAX_ROWS) is None                # no row left for the chunk
    assert mixed_shape(250, 100, 5, 4096, 256) == (250, 128, 6)            # 8 rows capped at the 6 left
    assert mixed_shape(0, 3000, 1, 8192, MAX_ROWS) is None                 # past PREFILL_GRAPH_MAX: eager
    for d in range(1, 257):
        shape = mixed_shape(mixed_decode_rows(d, 256), PREFILL_GRAPH_MAX - d, 1, PREFILL_GRAPH_MAX + 256, 256 + 32)
        assert shape is not None and shape[1] <= PREFILL_GRAPH_MAX, (d, shape)


def test_the_warm_up_captures_every_shape_a_load_of_many_streams_meets():
    """Catches a warm-up that leaves a serving load's shapes to be captured while it runs (every stream waits ~0.2 s
    per capture: the worst gaps and the run-to-run spread of a 64-stream load; on the H200 a second run of the same
    prompts, their prefixes cached, met 8 new shapes of 16-token chunks): every step of 0..max_batch decodes beside
    one to sixteen chunks (the most the engine's scheduler puts in a step) of 1..2048 tokens in all (its 2048-token
    budget plus its max_batch spare tokens) has its graph among the warm-up's shapes, and the grid stays bounded
    (each shape is a capture at start)."""
    for max_batch in (8, 64, 256):
        tokens, rows = 2048 + max_batch, max_batch + 32
        grid = mixed_warmup_shapes(max_batch, tokens, rows)
        sizes = {mixed_decode_rows(d, max_batch) for d in range(max_batch + 1)}
        assert len(grid) == len(set(grid)) <= 10 * len(sizes)
        met = set()
        for d in range(max_batch + 1):
            Dp = mixed_decode_rows(d, max_batch)
            for n in range(1 if d else 2, MIXED_MIN_ROWS + 1):
                for L in range(n, 2049 - d, 13):
                    shape = mixed_shape(Dp, L, n, tokens, rows)
                    if shape is not None:
                        met.add(shape)
        assert met and met <= set(grid), (max_batch, sorted(met - set(grid))[:5])
    assert len(mixed_warmup_shapes(64, 2048 + 64, 96)) == 90
    assert len(mixed_warmup_shapes(256, 2048 + 256, 288)) == 130


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


def test_mixed_graphs_are_captured_at_first_sight_up_to_the_cap():
    """Catches graphs captured without bound (each holds a step's launches) or a shape's first steps run eagerly
    (~500 launches of host time each, at every new shape a load meets): a shape is captured and replayed at once;
    past MIXED_GRAPHS_MAX graphs new shapes stay eager, while the captured ones keep replaying."""
    graphs = _Graphs()
    keys = [("mixed", 64, 16 * (i + 1), 8) for i in range(MIXED_GRAPHS_MAX + 5)]
    assert [graphs.replay_or_capture(key, None) for key in keys] == [True] * MIXED_GRAPHS_MAX + [False] * 5
    assert graphs.captured == keys[:MIXED_GRAPHS_MAX] == graphs.replayed
    assert len(graphs.execs) == MIXED_GRAPHS_MAX
    assert graphs.replay_or_capture(keys[-1], None) is False       # over the cap: eager, never captured
    assert graphs.replay_or_capture(keys[0], None) is True
    assert graphs.replayed.count(keys[0]) == 2 and keys[-1] not in graphs.replayed


def test_capture_time_is_counted_and_replays_add_none():
    """Catches captures taken while serving that go unseen (``/metrics``' ``pegainfer:cuda_graph_capture_seconds``:
    every stream waits during one): the host time of each first-sight capture adds up, a replay adds nothing."""
    graphs = _Graphs()
    graphs.capture_fn = (lambda capture: lambda key, run: (time.sleep(0.02), capture(key, run)))(graphs.capture_fn)
    keys = [("mixed", 8, 16, 8), ("mixed", 8, 32, 8)]
    for key in keys:
        graphs.replay_or_capture(key, None)
    spent = graphs.capture_seconds
    assert 0.04 <= spent < 1.0
    for key in keys * 3:
        graphs.replay_or_capture(key, None)
    assert graphs.capture_seconds == spent


def test_a_failed_capture_leaves_its_shape_eager(caplog):
    """Catches a capture failure that crashes the server or is retried (and logged) at every step: the step runs
    eagerly, the capture is tried once more at the shape's next step (an eager step compiles what it needs) and
    then never again, the failure is logged once, other shapes still get graphs."""
    bad, good = ("mixed", 8, 16, 8), ("mixed", 8, 32, 8)
    graphs = _Graphs(fail={bad})
    attempts = []
    graphs.capture_fn = (lambda capture: lambda key, run: (attempts.append(key), capture(key, run)))(graphs.capture_fn)
    with caplog.at_level("WARNING", logger="pegainfer.engine"):
        results = [graphs.replay_or_capture(bad, None) for _ in range(5)]
    assert results == [False] * 5 and attempts == [bad, bad]
    assert sum("capture" in r.getMessage() for r in caplog.records) == 1
    assert [graphs.replay_or_capture(good, None) for _ in range(2)] == [True, True]
    assert graphs.captured == [good] and not graphs.has(*bad)


def test_a_quiet_first_try_at_warm_up_neither_logs_nor_counts(caplog):
    """Catches the warm-up's first, direct capture of a shape (``ModelRunner.warm_mixed``: an eager run and a second
    try only when it fails) counting against the shape or logging a failure the second try may undo: a quiet
    failure returns False with nothing logged, and the shape still gets its two counted tries afterwards."""
    key = ("mixed", 8, 16, 16)
    graphs = _Graphs(fail={key})
    with caplog.at_level("WARNING", logger="pegainfer.engine"):
        assert graphs.try_capture(key, None, quiet=True) is False
        assert not caplog.records and key not in graphs._failed
        assert [graphs.replay_or_capture(key, None) for _ in range(3)] == [False] * 3
    assert graphs._failed[key] == 2 and len(caplog.records) == 1
    graphs.fail.clear()
    assert graphs.try_capture(("mixed", 8, 32, 16), None, quiet=True) is True


def test_steps_no_graph_holds_run_eagerly_and_are_counted():
    """Catches eager mixed steps that go unseen (``/metrics``' ``pegainfer:eager_mixed_steps``): a step without a
    graph shape, and one past the cap, run their launches once each and are counted; a replayed one is not."""
    graphs = _Graphs()
    graphs.max_lazy = 1
    ran = []
    graphs.replay_or_run(("mixed", 8, 16, 8), lambda: ran.append("captured"))    # captured (not run: emulated)
    graphs.replay_or_run(None, lambda: ran.append("unpadded"))
    graphs.replay_or_run(("mixed", 8, 32, 8), lambda: ran.append("past the cap"))
    graphs.replay_or_run(("mixed", 8, 16, 8), lambda: ran.append("replayed"))
    assert ran == ["unpadded", "past the cap"] and graphs.eager_steps == 2
    assert graphs.replayed == [("mixed", 8, 16, 8)] * 2


def _serve_load(lengths, concurrency: int, max_batch: int, repeat: int = 1, prefix_caching: bool = True):
    """Drive the engine's real ``Scheduler`` and ``PagePool`` (no model) through a closed loop of ``concurrency``
    streams over requests of ``lengths`` [(prompt, output)] -- ``repeat`` times the same prompts, so later passes
    find their prefixes cached -- as ``Engine.step`` does: a new request arrives as soon as one ends.  Returns the
    graph key of every mixed step (None: a step no graph holds)."""
    import numpy as np

    from pegainfer.engine.kv_cache import PagePool
    from pegainfer.engine.scheduler import Scheduler
    from pegainfer.engine.sequence import Sequence
    from pegainfer.engine.types import SamplingParams
    budget, tokens, rows = 2048, 2048 + max_batch, max_batch + MIXED_SPARE_ROWS
    pool = PagePool(max_batch * 2 * 2048 // 16, 16, max_batch, 4096, prefix_caching=prefix_caching)
    scheduler = Scheduler(pool, max_batch, budget, max_chunks=MIXED_MIN_ROWS)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50_000, size=n).tolist() for n, _ in lengths]
    queue = [(p, out) for _ in range(repeat) for p, (_, out) in zip(prompts, lengths)]
    live, keys = 0, []
    while queue or scheduler.has_work():
        while queue and live < concurrency:
            prompt, out = queue.pop(0)
            scheduler.add(Sequence(f"r{len(queue)}", prompt, SamplingParams(max_tokens=out), None, None))
            live += 1
        step = scheduler.schedule()
        if step.kind == "mixed":
            L = sum(n for _, _, n in step.chunks)
            shape = mixed_shape(mixed_decode_rows(len(step.decodes), max_batch), L, len(step.chunks), tokens, rows)
            keys.append(None if shape is None else shape)
        done = list(step.decodes) + [s for s, a, n in step.chunks if a + n == s.num_tokens]
        for seq, start, n in step.chunks:
            scheduler.computed(seq, start + n)
        for seq in step.decodes:
            scheduler.computed(seq, seq.num_tokens)
        for seq in done:
            seq.append_token(7)
            if len(seq.output_ids) >= seq.params.max_tokens:
                scheduler.remove(seq)
                live -= 1
    assert pool.pages_available == pool.num_pages or prefix_caching
    return keys


def test_serving_loads_meet_only_the_shapes_the_warm_up_captures():
    """Catches a load that still meets a mixed shape outside the warm-up's (a capture while serving: ~0.2 s with
    every stream waiting; on the H200 a second run of the same prompts met 5-8 shapes of 32-64 chunk rows): the
    scheduler driven through 64 and 256 streams of 128 in / 64 out, the same prompts again (their prefixes
    cached: 1-16-token chunks, many at once), and a ShareGPT-like mix of lengths, meets mixed steps whose every
    shape the warm-up captures."""
    import numpy as np

    from pegainfer.serving_bench.workload import request_lengths
    for concurrency, max_batch in ((64, 256), (256, 256), (64, 64)):
        grid = set(mixed_warmup_shapes(max_batch, 2048 + max_batch, max_batch + MIXED_SPARE_ROWS))
        loads = {"fixed": _serve_load([(128, 64)] * (2 * concurrency), concurrency, max_batch, repeat=2),
                 "sharegpt": _serve_load([(i, min(o, 128)) for i, o in request_lengths(
                     "sharegpt", 3 * concurrency, 0, 0, 0.0, np.random.default_rng(1))], concurrency, max_batch)}
        for name, keys in loads.items():
            assert len(keys) > 10, (name, concurrency)
            assert set(keys) <= grid, (name, concurrency, sorted(set(keys) - grid, key=str)[:5])
