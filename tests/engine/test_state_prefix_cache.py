"""The prefix cache of a hybrid model (Qwen3.5): cached pages are reused only up to a boundary where a copy of the
recurrent state was kept (``kv_cache.StateSnapshots``), through the real engine over ``tiny_model.TinyRecurrentModel``
(its next token depends on a per-slot state every token is folded into, in order), so a hit that skips tokens
without the state after them, a wrong snapshot, or one taken at another point shows as a wrong token."""
from __future__ import annotations

import pytest

from pegainfer.engine.kv_cache import StateSnapshots
from tests.engine.test_scheduler import drain, greedy, recording
from tests.engine.tiny_model import tiny_engine


def _engine(prefix_caching=True, snapshots=4, max_num_batched_tokens=64, async_scheduling=True):
    return recording(tiny_engine(async_scheduling, max_batch=3, max_model_len=128, prefix_caching=prefix_caching,
                                 state_snapshots=snapshots, max_num_batched_tokens=max_num_batched_tokens))


def _run_in_turn(engine, requests):
    """Each request alone, one after the other: {id: its tokens} (the engine records the chunks: ``recording``)."""
    got = {}
    for rid, prompt, params in requests:
        got[rid] = drain(engine, [(rid, prompt, params)])[rid]
    return got


PREFIX = list(range(20, 60))                    # 40 tokens: two full pages and half a third


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_next_turn_restores_the_state_at_the_first_page_boundary_the_turn_before_reached(async_scheduling):
    """A first request (41 prompt tokens, 10 out) keeps its state when its tokens reach 48, seven decode steps in,
    with no change to its prefill (with async scheduling the decode step after the one that reaches 48 is not
    launched ahead of it); the next chat turn (its prompt, its answer and two more tokens) starts there: 48 cached
    tokens, one chunk of 5.  Every stream equals that of an engine without the cache."""
    first = PREFIX + [1]
    on, off = _engine(async_scheduling=async_scheduling), _engine(prefix_caching=False)
    answer = _run_in_turn(on, [("first", first, greedy(10))])["first"]
    assert answer == _run_in_turn(off, [("first", first, greedy(10))])["first"]
    turn = first + answer + [3, 4]
    on.add_request("turn", turn, greedy(6))
    outs = [out for _ in range(40) if on.has_unfinished() for out in on.step()]
    assert not on.has_unfinished() and outs[-1].finished and outs[-1].cached_tokens == 48   # reported in usage
    assert [t for out in outs for t in out.new_token_ids] == _run_in_turn(off, [("turn", turn, greedy(6))])["turn"]
    chunks = [c for _, _, cs, _, _ in on.steps for c in cs]
    assert chunks == [("first", 0, 41), ("turn", 48, 5)], chunks
    s = on.stats()
    assert s["prefix_cache_hits"] == 48 and (s["prefix_state_snapshots"], s["prefix_state_snapshots_total"]) == (1, 4)


def test_a_shared_prefix_gets_a_snapshot_where_the_cached_pages_end():
    """The second prompt shares two pages with the first but no kept state there (the first kept none: it never
    reached a page boundary past its prompt): it recomputes from 0, its prefill cut at 32, where the shared pages
    end, so its state there is kept; a third prompt sharing the same two pages then starts at 32."""
    first, second, third = PREFIX + [1] * 30, PREFIX + [2] * 20, PREFIX + [3] * 9
    requests = [("first", first, greedy(4)), ("second", second, greedy(4)), ("third", third, greedy(4))]
    on, off = _engine(), _engine(prefix_caching=False)
    assert _run_in_turn(on, requests) == _run_in_turn(off, requests)
    chunks = [c for _, _, cs, _, _ in on.steps for c in cs]
    assert [c[1:] for c in chunks if c[0] == "second"] == [(0, 32), (32, 28)], chunks
    assert [c[1:] for c in chunks if c[0] == "third"] == [(32, 17)], chunks
    assert on.stats()["prefix_cache_hits"] == 32


def test_the_least_recently_used_snapshot_makes_room():
    """Prompts of whole pages keep their state at the end of their prefill.  With two snapshot rows, "a" then "b"
    keep theirs, a prompt extending "a" starts from a's state (making it the more recently used), and "c"'s state
    takes b's row: a later prompt extending "a" starts from its state (48 cached), one extending "b" recomputes from
    0; the same tokens as without the cache."""
    a, b, c = PREFIX + [1] * 8, [7] * 48, [8] * 48
    requests = [("a", a, greedy(3)), ("b", b, greedy(3)), ("a1", a + [5], greedy(3)), ("c", c, greedy(3)),
                ("a2", a + [5, 6, 7], greedy(3)), ("b2", b + [5, 6, 7], greedy(3))]
    on = _engine(snapshots=2)
    assert _run_in_turn(on, requests) == _run_in_turn(_engine(prefix_caching=False), requests)
    chunks = [chunk for _, _, cs, _, _ in on.steps for chunk in cs]
    starts = {rid: [start for r, start, _ in chunks if r == rid][0] for rid, _, _ in requests}
    assert starts == {"a": 0, "b": 0, "a1": 48, "c": 0, "a2": 48, "b2": 0}, chunks
    assert on.stats()["prefix_state_snapshots"] == 2


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


def test_an_abort_after_the_prefill_leaves_its_kept_state_usable():
    """A prompt of whole pages aborted after its prefill (its state kept at its end): its slot and pages come back,
    and the next prompt extending it starts from the kept state with the right tokens."""
    prompt = PREFIX + [1] * 8
    on, off = _engine(), _engine(prefix_caching=False)
    on.add_request("gone", prompt, greedy(5))
    on.step()                                          # the whole prompt; its state kept after the step
    on.abort("gone")
    again = prompt + [2, 3, 4]
    got = drain(on, [("again", again, greedy(5))])
    assert got["again"] == drain(off, [("again", again, greedy(5))])["again"]
    assert [c for _, _, cs, _, _ in on.steps for c in cs][-1] == ("again", 48, 3)
