"""The scheduler and page pool through the real engine over ``tiny_model.TinyHistoryModel`` (whose next token
depends on every cached id of the sequence, read through the block table): mixed steps under the token budget,
decodes never skipped for a prompt, KV pages on demand with preemption and recomputation, prefix caching, and every
page back when the engine is idle.  Expected streams come from ``expected_greedy_stream`` (the model in plain
Python), so a wrong page, position or shared page shows as a wrong token."""
from __future__ import annotations

import pytest

from pegainfer.engine.kv_cache import PagePool
from pegainfer.engine.types import SamplingParams
from tests.engine.test_async_scheduling import expected_greedy_stream
from tests.engine.tiny_model import tiny_engine


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def recording(engine):
    """Record every step the engine schedules: (kind, decode request ids, [(id, start, length)], tokens, running
    decoding request ids before the step).  A mixed step the engine launches ahead of the step before's read (its
    decodes that step's sequences going on, beside prompt chunks) counts those sequences as decoding."""
    engine.steps = []
    schedule, launch_mixed_ahead = engine.scheduler.schedule, engine._launch_mixed_ahead

    def mixed_ahead(pending, decodes, rows):
        admit, chunks = engine.scheduler.chunks_beside, []
        engine.scheduler.chunks_beside = lambda n: chunks.extend(admit(n)) or chunks
        going_on = {s.request_id for s in pending.seqs
                    if s.status.value == "running" and len(s.output_ids) + 1 < s.params.max_tokens}
        try:
            return launch_mixed_ahead(pending, decodes, rows)
        finally:
            del engine.scheduler.chunks_beside
            engine.steps.append(("mixed", [s.request_id for s in decodes],
                                 [(s.request_id, a, n) for s, a, n in chunks],
                                 len(decodes) + sum(n for _, _, n in chunks), going_on))
    engine._launch_mixed_ahead = mixed_ahead

    def wrapped():
        decoding = {s.request_id for s in engine.scheduler.running if s.num_uncomputed == 1}
        sched = schedule()
        if sched is not None:
            engine.steps.append((sched.kind, [s.request_id for s in sched.decodes],
                                 [(s.request_id, a, n) for s, a, n in sched.chunks], sched.num_tokens, decoding))
        return sched
    engine.scheduler.schedule = wrapped
    return engine


def drain(engine, requests, arrivals=()):
    """Add ``requests`` [(id, prompt, params)], then step until idle, adding ``arrivals`` [(after step k, id,
    prompt, params)] on the way; returns {id: token ids} and checks that nothing is left in use."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    got, k, pending = {}, 0, sorted(arrivals, key=lambda a: a[0])
    while engine.has_unfinished() or pending:
        while pending and pending[0][0] <= k:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        k += 1
    s = engine.stats()
    assert (s["waiting"], s["running"], s["kv_pages_used"], s["slots_used"]) == (0, 0, 0, 0), s
    return got


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_long_prompt_never_pauses_the_running_decodes(async_scheduling):
    """Catches a prefill that runs instead of the decode step (every stream freezing while a prompt is computed)
    and a step over the token budget: while a 70-token prompt arrives in chunks, every decoding sequence gets a
    token in every step, and no step carries more than the budget."""
    engine = recording(tiny_engine(async_scheduling, max_batch=4, max_model_len=128, max_num_batched_tokens=16))
    requests = [("a", [1, 2, 3], greedy(30)), ("b", [7, 8], greedy(30))]
    late = [(3, "long", list(range(10, 80)), greedy(4))]
    got = drain(engine, requests, late)
    for rid, prompt, params in requests + [r[1:] for r in late]:
        assert got[rid] == expected_greedy_stream(prompt, params.max_tokens), rid
    chunked = [s for s in engine.steps if any(rid == "long" for rid, _, _ in s[2])]
    assert len(chunked) >= 5, engine.steps                    # 70 tokens under a budget of 16 with 2 decodes
    for kind, decodes, chunks, tokens, decoding in engine.steps:
        assert tokens <= 16, (kind, decodes, chunks)
        assert set(decodes) == decoding, (decodes, decoding)  # nobody that was decoding is left out


def test_several_prompts_share_one_step():
    """Catches a scheduler that admits one prompt per step: three short prompts arriving together are prefilled
    in the same step, and their streams are right."""
    engine = recording(tiny_engine(False, max_batch=4, max_model_len=64, max_num_batched_tokens=32))
    requests = [(f"r{i}", [3 + i] * (4 + i), greedy(5)) for i in range(3)]
    got = drain(engine, requests)
    assert [rid for rid, _, _ in engine.steps[0][2]] == ["r0", "r1", "r2"]
    for rid, prompt, params in requests:
        assert got[rid] == expected_greedy_stream(prompt, params.max_tokens), rid


def test_a_burst_of_short_prompts_spreads_over_steps_of_at_most_sixteen_chunks():
    """Catches a step with more prompt chunks than the mixed-step graphs captured at warm-up hold (MIXED_MIN_ROWS
    rows: a step of more would be captured while every stream waits, ~0.2 s on the H200): twenty 3-token prompts
    arriving at once are prefilled sixteen, then four beside the sixteen decodes, and every stream is right."""
    from pegainfer.engine.cuda_graph import MIXED_MIN_ROWS
    engine = recording(tiny_engine(False, max_batch=20, max_model_len=32, max_num_batched_tokens=128))
    assert engine.scheduler.max_chunks == MIXED_MIN_ROWS == 16
    requests = [(f"r{i}", [3 + i, 4, 5], greedy(2)) for i in range(20)]
    got = drain(engine, requests)
    assert [len(chunks) for _, _, chunks, _, _ in engine.steps[:2]] == [16, 4], engine.steps[:2]
    assert len(engine.steps[1][1]) == 16                                    # beside the first sixteen's decodes
    assert all(len(chunks) <= 16 for _, _, chunks, _, _ in engine.steps)
    for rid, prompt, params in requests:
        assert got[rid] == expected_greedy_stream(prompt, params.max_tokens), rid


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_recomputes_and_gives_the_same_tokens(async_scheduling):
    """Catches a preempted sequence that loses or repeats tokens, or resumes from the wrong K/V: with pages for
    barely two of four growing sequences, the newest are preempted and recomputed, and every greedy stream is the
    one computed by hand (the same as with pages to spare)."""
    requests = [(f"r{i}", [2 + i] * (5 + 3 * i), greedy(30 + i)) for i in range(4)]
    engine = tiny_engine(async_scheduling, max_batch=4, max_model_len=64, num_pages=6, max_num_batched_tokens=32)
    got = drain(engine, requests)
    assert engine.stats()["num_preemptions"] > 0
    for rid, prompt, params in requests:
        assert got[rid] == expected_greedy_stream(prompt, params.max_tokens), rid


def test_seeded_sampling_is_the_same_with_and_without_preemption():
    """Catches a preempted sequence that redraws with a different counter: seeded draws are the same whether the
    pool forces preemptions or not."""
    requests = [(f"r{i}", [2 + i] * (5 + 3 * i), SamplingParams(max_tokens=28, temperature=0.8, seed=40 + i,
                                                                   ignore_eos=True)) for i in range(4)]
    tight = tiny_engine(False, max_batch=4, max_model_len=64, num_pages=6)
    roomy = tiny_engine(False, max_batch=4, max_model_len=64)
    assert drain(tight, requests) == drain(roomy, requests)
    assert tight.stats()["num_preemptions"] > 0 and roomy.stats()["num_preemptions"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_cache_hit_skips_the_shared_pages_and_gives_the_same_tokens(async_scheduling):
    """Catches a cache hit on the wrong pages, a shared page written over, or a hit that is not reported: a second
    request sharing a 40-token prefix gets its first two full pages from the cache (32 cached tokens in its usage,
    only the rest prefilled), and both streams equal those computed by hand."""
    engine = recording(tiny_engine(async_scheduling, max_batch=2, max_model_len=96, prefix_caching=True))
    prefix = list(range(20, 60))
    first, second = prefix + [1, 2], prefix + [3]
    got, finals = {}, {}
    for rid, prompt in (("first", first), ("second", second)):
        engine.add_request(rid, prompt, greedy(6))
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    finals[out.request_id] = out
    assert got["first"] == expected_greedy_stream(first, 6)
    assert got["second"] == expected_greedy_stream(second, 6)
    assert finals["first"].cached_tokens == 0 and finals["second"].cached_tokens == 32
    chunks = [c for _, _, cs, _, _ in engine.steps for c in cs if c[0] == "second"]
    assert chunks[0][1] == 32, chunks                          # its prefill starts after the cached pages
    s = engine.stats()
    assert s["prefix_cache_hits"] == 32 and s["prefix_cache_queries"] == len(first) + len(second)
    assert s["kv_pages_used"] == 0


def test_prefix_cache_on_and_off_give_the_same_streams():
    """Catches prefix caching changing any token: concurrent requests with shared and unshared prefixes, some
    arriving while others decode, give the same streams with the cache on and off."""
    base = list(range(30, 66))
    requests = [("a", base + [1], greedy(12)), ("b", [5, 6, 7], greedy(9))]
    arrivals = [(4, "c", base + [2, 3], greedy(8)), (6, "d", base[:20], greedy(10)), (9, "e", base + [1], greedy(5))]
    on = drain(tiny_engine(True, max_batch=3, max_model_len=96, prefix_caching=True), requests, arrivals)
    off = drain(tiny_engine(True, max_batch=3, max_model_len=96), requests, arrivals)
    assert on == off
    for rid, prompt, params in requests + [a[1:] for a in arrivals]:
        assert on[rid] == expected_greedy_stream(prompt, params.max_tokens), rid


def test_cached_pages_are_evicted_least_recently_used_first():
    """Catches a pool that runs dry while cached pages sit unused, evicts a page someone holds, or evicts in another
    order than least recently used: cached pages are handed out again when the free list is empty; of two, the one
    used less recently goes first (the one cached first but taken back since stays), and held pages never go."""
    pool = PagePool(num_pages=4, page_size=2, num_slots=3, max_model_len=8, prefix_caching=True)
    for tokens in ([1, 2], [3, 4]):                     # a page each, cached in this order
        slot = pool.acquire_slot()
        assert pool.ensure_capacity(slot, 2)
        assert pool.cache_full_pages(slot, tokens, 2, [], 0) == 1
        pool.release(slot)
    assert pool.pages_used == 0 and pool.pages_available == 4
    page_12, page_34 = pool.match_prefix([1, 2, 9], []), pool.match_prefix([3, 4, 9], [])
    assert len(page_12) == len(page_34) == 1 and page_12 != page_34
    b = pool.acquire_slot()
    pool.attach(b, page_12)                             # [1, 2]'s page used again: now the more recently used
    pool.release(b)
    c = pool.acquire_slot()
    assert pool.ensure_capacity(c, 6)                   # 3 pages: 2 free + the least recently used cached page
    assert pool.pages_used == 3 and page_34[0] in pool.block_tables_host[c, :3]
    assert pool.match_prefix([3, 4, 9], []) == [] and pool.match_prefix([1, 2, 9], []) == page_12
    held = pool.acquire_slot()
    pool.attach(held, page_12)                          # hold the last cached page
    assert not pool.ensure_capacity(c, 8)               # nothing left to take
    assert pool.match_prefix([1, 2, 9], []) == page_12
    pool.release(held)
    pool.release(c)
    assert pool.pages_used == 0
