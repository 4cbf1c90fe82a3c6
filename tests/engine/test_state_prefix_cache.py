"""The prefix cache of a hybrid model (Qwen3.5): cached pages are reused only up to a boundary where a copy of the
recurrent state was kept (``kv_cache.StateSnapshots``), through the real engine over ``tiny_model.TinyRecurrentModel``
(its next token depends on a per-slot state every token is folded into, in order), so a hit that skips tokens
without the state after them, a wrong snapshot, or one taken at another point shows as a wrong token."""
from __future__ import annotations

from pegainfer.engine.kv_cache import StateSnapshots
from tests.engine.test_scheduler import drain, greedy, recording
from tests.engine.tiny_model import tiny_engine


def _engine(prefix_caching=True, snapshots=4, max_num_batched_tokens=64):
    return recording(tiny_engine(True, max_batch=3, max_model_len=128, prefix_caching=prefix_caching,
                                 state_snapshots=snapshots, max_num_batched_tokens=max_num_batched_tokens))


def _run_in_turn(engine, requests):
    """Each request alone, one after the other: {id: (tokens, cached_tokens)} and the (id, start, length) of every
    chunk scheduled."""
    got = {}
    for rid, prompt, params in requests:
        got[rid] = drain(engine, [(rid, prompt, params)])[rid]
    return got


PREFIX = list(range(20, 60))                    # 40 tokens: two full pages and half a third


def test_a_follow_up_prompt_restores_the_state_at_the_last_full_page():
    """The first prompt's prefill stops at its last full page (32 tokens), where its state is kept; a second prompt
    with the same first 32 tokens starts there (32 cached tokens, its first chunk at 32), and both streams equal
    those of an engine without the cache."""
    first, second = PREFIX + [1], PREFIX + [3, 4]
    requests = [("first", first, greedy(6)), ("second", second, greedy(6))]
    on, off = _engine(), _engine(prefix_caching=False)
    got_on = _run_in_turn(on, requests)
    assert got_on == _run_in_turn(off, requests)
    chunks = [c for _, _, cs, _, _ in on.steps for c in cs]
    assert chunks[:2] == [("first", 0, 32), ("first", 32, 9)], chunks       # stopped at the boundary, kept there
    assert [c for c in chunks if c[0] == "second"] == [("second", 32, 10)], chunks
    assert on.stats()["prefix_cache_hits"] == 32
    assert (on.stats()["prefix_state_snapshots"], on.stats()["prefix_state_snapshots_total"]) == (1, 4)
    assert [c for _, _, cs, _, _ in off.steps for c in cs] == [("first", 0, 41), ("second", 0, 42)]


def test_a_shared_prefix_gets_a_snapshot_where_the_cached_pages_end():
    """The second prompt shares two pages with the first but no kept state there (the first's is at its own last
    page, 64): it recomputes from 0 and keeps its state at 32, where the shared pages end, and at its last page; a
    third prompt sharing the same two pages then starts at 32 (and stops at its own last page, 48)."""
    first, second, third = PREFIX + [1] * 30, PREFIX + [2] * 20, PREFIX + [3] * 9
    requests = [("first", first, greedy(4)), ("second", second, greedy(4)), ("third", third, greedy(4))]
    on, off = _engine(), _engine(prefix_caching=False)
    assert _run_in_turn(on, requests) == _run_in_turn(off, requests)
    chunks = [c for _, _, cs, _, _ in on.steps for c in cs]
    assert [c[1:] for c in chunks if c[0] == "second"] == [(0, 32), (32, 16), (48, 12)], chunks
    # stopped at its own last page (48): its last prompt token then rides as a decode row
    assert [c[1:] for c in chunks if c[0] == "third"] == [(32, 16)], chunks


def test_the_least_recently_used_snapshot_makes_room():
    """With one snapshot row, the second prompt's state replaces the first's: a prompt like the first then finds
    none and recomputes from 0 (and the same tokens come out)."""
    a, b = PREFIX + [1], [7] * 40 + [2]
    requests = [("a", a, greedy(3)), ("b", b, greedy(3)), ("a2", a[:-1] + [5], greedy(3))]
    on, off = _engine(snapshots=1), _engine(prefix_caching=False)
    assert _run_in_turn(on, requests) == _run_in_turn(off, requests)
    chunks = [c for _, _, cs, _, _ in on.steps for c in cs]
    assert [c[1] for c in chunks if c[0] == "a2"][0] == 0, chunks


def test_concurrent_streams_with_and_without_the_cache_are_the_same():
    """Shared and unshared prefixes arriving while others decode or prefill (chunks cut at boundaries beside
    decodes, snapshots taken in mixed steps, a tight token budget): the same streams with the cache on and off, and
    the cache hits."""
    base = list(range(30, 75))
    requests = [("a", base + [1], greedy(12)), ("b", [5, 6, 7], greedy(9))]
    arrivals = [(3, "c", base + [2, 3], greedy(8)), (5, "d", base[:20], greedy(10)), (8, "e", base + [1, 9],
                                                                                      greedy(5)),
                (12, "f", base + [1] * 17, greedy(6))]
    on = _engine(max_num_batched_tokens=24)
    off = _engine(prefix_caching=False, max_num_batched_tokens=24)
    assert drain(on, requests, arrivals) == drain(off, requests, arrivals)
    assert on.stats()["prefix_cache_hits"] > 0


def test_snapshot_index():
    """``StateSnapshots``: the longest boundary with a snapshot among the first pages, a key stored once, rows
    reused least recently used first."""
    snaps = StateSnapshots(2, first_row=5)
    keys = [b"k0", b"k1", b"k2"]
    assert snaps.longest(keys, 3) == (0, None)
    assert snaps.store(b"k0") == 5 and snaps.store(b"k2") == 6 and snaps.store(b"k0") is None
    assert snaps.longest(keys, 3) == (3, 6) and snaps.longest(keys, 2) == (1, 5)   # k0 now the most recent
    assert snaps.store(b"x") == 6 and len(snaps) == 2                               # k2's row reused
    assert snaps.longest(keys, 3) == (1, 5)


def test_preemption_with_state_snapshots_gives_the_roomy_streams():
    """Pages for barely two of four growing sequences that share a prefix, the cache on: the newest are preempted
    (their slots freed, state and all) and recomputed, finding their own and each other's kept states on the way
    back; every stream equals that of an engine with pages to spare and the cache off."""
    shared = list(range(40, 60))
    requests = [(f"r{i}", shared + [2 + i] * (3 + 5 * i), greedy(26 + i)) for i in range(4)]
    tight = recording(tiny_engine(True, max_batch=4, max_model_len=96, num_pages=9, prefix_caching=True,
                                  state_snapshots=4, max_num_batched_tokens=48))
    roomy = tiny_engine(True, max_batch=4, max_model_len=96, state_snapshots=4, max_num_batched_tokens=48)
    assert drain(tight, requests) == drain(roomy, requests)
    s = tight.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0, s


def test_an_abort_in_the_middle_of_a_cut_prefill_leaves_nothing_behind():
    """A prompt aborted after its first chunk (cut at its last full page, its state kept): its slot and pages come
    back, and the next prompt with the same pages starts from the kept state with the right tokens."""
    prompt = PREFIX + [1, 2]
    on, off = _engine(), _engine(prefix_caching=False)
    on.add_request("gone", prompt, greedy(5))
    on.step()                                          # the chunk up to 32, its state kept after the step
    on.abort("gone")
    got = drain(on, [("again", prompt, greedy(5))])
    assert got["again"] == drain(off, [("again", prompt, greedy(5))])["again"]
    assert [c for _, _, cs, _, _ in on.steps for c in cs][-1] == ("again", 32, 10)
