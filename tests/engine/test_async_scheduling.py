"""Async scheduling (a decode step launched before the previous step's tokens are read) must not change anything a
client sees: the same tokens, text, logprobs and finish reasons as the synchronous engine, for concurrent requests
of different lengths, greedy and seeded, with max_tokens, EOS / stop token ids / stop strings, min_tokens,
aborts, arrivals mid-decode and logprobs; and every page and slot comes back. The engine is the real one (scheduler,
page pool, runner, sampler, detokenizer, stop rules) over ``tiny_model.TinyHistoryModel``, whose next token
depends on every cached id of the sequence (read through the block table)."""
from __future__ import annotations

import pytest

from pegainfer.engine.types import SamplingParams
from tests.engine.tiny_model import tiny_engine


def counting(engine):
    """Count the decode steps the runner launches ahead (ids taken from the device), those of them over other rows
    than the step before's (ids gathered from its rows), the mixed steps launched ahead (new prompts beside the
    sequences going on), the tokens discarded (computed ahead for a sequence that had finished meanwhile) and the
    steps not launched ahead for want of pages (no page for a sequence's token in the step ahead)."""
    engine.ahead_launches = 0
    engine.remapped_launches = 0
    launch = engine.runner.launch_decode

    def launch_decode(seqs, ahead=0, force_eager=False, rows_before=None):
        engine.ahead_launches += ahead
        engine.remapped_launches += rows_before is not None
        return launch(seqs, ahead=ahead, force_eager=force_eager, rows_before=rows_before)
    engine.runner.launch_decode = launch_decode
    engine.mixed_ahead = 0
    launch_mixed = engine.runner.launch_mixed

    def counted_mixed(decodes, chunks, force_eager=False, rows_before=None):
        engine.mixed_ahead += rows_before is not None
        return launch_mixed(decodes, chunks, force_eager=force_eager, rows_before=rows_before)
    engine.runner.launch_mixed = counted_mixed
    engine.discarded = 0
    read = engine._read

    def _read(pending):
        engine.discarded += sum(seq.finish_reason is not None for seq in pending.seqs)
        return read(pending)
    engine._read = _read
    engine.short_of_pages = 0
    next_ahead, ensure_capacity = engine._next_ahead, engine.pool.ensure_capacity

    def _next_ahead(seqs, prefilling):
        refused = []
        engine.pool.ensure_capacity = lambda slot, n: ensure_capacity(slot, n) or refused.append(slot)
        try:
            return next_ahead(seqs, prefilling)
        finally:
            del engine.pool.ensure_capacity
            engine.short_of_pages += bool(refused)
    engine._next_ahead = _next_ahead
    return engine


def run(async_scheduling, requests, events=(), **engine_kw):
    """Add ``requests`` [(id, prompt, params)], step until done; ``events`` [(request id, after n tokens, action)]
    with action ("abort",) or ("add", id, prompt, params) fire once that request has received n tokens. Returns
    ({id: (token ids, text, finish reason, logprobs)}, engine)."""
    engine = counting(tiny_engine(async_scheduling, **engine_kw))
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    got, prompts = {}, {}
    pending = list(events)
    while engine.has_unfinished():
        for out in engine.step():
            ids, text, reason, lps = got.setdefault(out.request_id, ([], [], [None], []))
            assert reason[0] is None, f"{out.request_id}: output after it finished"
            ids += out.new_token_ids
            text.append(out.delta_text)
            lps += [(lp.token_id, round(lp.logprob, 6), lp.top) for lp in (out.logprobs or [])]
            if out.finished:
                reason[0] = out.finish_reason
                prompts[out.request_id] = (out.prompt_tokens, out.cached_tokens)
        for ev in list(pending):
            rid, n, action = ev
            if len(got.get(rid, ([],))[0]) >= n:
                pending.remove(ev)
                if action[0] == "abort":
                    engine.abort(rid)
                else:
                    engine.add_request(*action[1:])
    assert not pending, pending
    assert engine._inflight is None
    s = engine.stats()
    assert (s["waiting"], s["running"], s["kv_pages_used"], s["slots_used"]) == (0, 0, 0, 0), s
    # the counters of the stats log: every token a client got, every prompt token not found in the prefix cache
    assert s["generation_tokens"] == sum(len(ids) for ids, _, _, _ in got.values()), s
    fresh = sum(n - cached for n, cached in prompts.values())
    assert s["prompt_tokens_computed"] == fresh if s["num_preemptions"] == 0 else \
        s["prompt_tokens_computed"] > fresh, (s, prompts)      # (a preempted sequence is computed again)
    return {k: (ids, "".join(t), r[0], lps) for k, (ids, t, r, lps) in got.items()}, engine


def same_both_ways(requests, events=(), **engine_kw):
    sync, e_sync = run(False, requests, events, **engine_kw)
    overlap, e_async = run(True, requests, events, **engine_kw)
    assert overlap == sync
    assert e_sync.ahead_launches == 0 and e_async.ahead_launches > 0
    return sync, e_async


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def seeded(n, seed, **kw):
    return SamplingParams(max_tokens=n, temperature=0.9, top_k=20, top_p=0.95, seed=seed, **kw)


MIXED = [("a", [1, 2, 3], greedy(12, ignore_eos=True)),
         ("b", [9, 8], seeded(7, 11, ignore_eos=True)),
         ("c", [4, 4, 4, 4, 7], greedy(9, ignore_eos=True)),
         ("d", [3], seeded(14, 5, ignore_eos=True))]


def test_concurrent_greedy_and_seeded_same_streams():
    out, engine = same_both_ways(MIXED)   # max_batch 3: "d" waits for a free slot, then joins mid-decode
    assert {k: len(v[0]) for k, v in out.items()} == {"a": 12, "b": 7, "c": 9, "d": 14}
    assert all(v[2] == "length" for v in out.values())


def test_single_request_overlaps_every_decode_step():
    out, engine = same_both_ways([("a", [1, 2], greedy(10, ignore_eos=True))])
    # prefill gives token 1, decode steps tokens 2..10: all but the first are launched ahead, and no step past the
    # 10th token (max_tokens is known to end the request before it would be launched)
    assert engine.ahead_launches == 8


def test_stop_token_mid_stream_discards_the_step_launched_ahead():
    ref, _ = run(False, [("a", [1, 2, 3], greedy(12, ignore_eos=True))])
    stop = ref["a"][0][5]            # a token from the middle of the free-running stream
    first = ref["a"][0].index(stop)
    reqs = [("a", [1, 2, 3], greedy(12, ignore_eos=True, stop_token_ids=[stop])),
            ("b", [9, 8], seeded(10, 11, ignore_eos=True)),
            ("c", [4, 7], greedy(11, ignore_eos=True))]
    out, engine = same_both_ways(reqs)
    assert engine.discarded == 1      # "a"'s token after its stop token was computed, and never emitted
    assert out["a"][0] == ref["a"][0][:first + 1] and out["a"][2] == "stop"
    assert len(out["b"][0]) == 10 and len(out["c"][0]) == 11


def test_streams_that_finish_leave_the_step_launched_ahead():
    """Catches a row map that feeds a sequence another's token: streams that end (max_tokens, a stop token) while
    others keep going leave the next step launched ahead, and prompts that end in a mixed step join it, whose rows
    then take their ids from their rows of the step before (gathered on the device), with the same tokens as the
    synchronous engine and nothing waited for."""
    ref, _ = run(False, [("b", [9, 8], greedy(12, ignore_eos=True))])
    stop = ref["b"][0][4]
    reqs = [("a", [1, 2, 3], greedy(12, ignore_eos=True)),
            ("b", [9, 8], greedy(12, ignore_eos=True, stop_token_ids=[stop])),
            ("c", [4, 7], seeded(7, 3, ignore_eos=True))]
    out, engine = same_both_ways(reqs)
    assert out["b"][2] == "stop" and len(out["c"][0]) == 7 and len(out["a"][0]) == 12
    # the three prompts run in one mixed step, launched without waiting; every decode step after it is launched
    # ahead (a's 11), two of them with their rows moved: the first (ids from the mixed step's chunk rows) and the
    # one that leaves out "b" (the middle row) after its stop; "c", the last row, leaves the others in place
    assert engine.ahead_launches == 11, engine.ahead_launches
    assert engine.remapped_launches == 2, engine.remapped_launches


@pytest.mark.parametrize("seed,cache", [(0, None), (1, None), (2, "prefix"), (3, "prefix+state")])
def test_a_random_load_of_arrivals_stops_and_aborts_matches_the_synchronous_engine(seed, cache):
    """Catches a step launched ahead over the wrong rows in any mix of batch changes: streams arriving while others
    decode (some sharing a cached prefix), ending by max_tokens, stop tokens or a full context (one at least, its
    prompt longer than a step's budget), aborted, greedy and seeded, more of them than the slots; with the prefix
    cache (and a hybrid model's kept states); every stream equals the synchronous engine's, and steps were launched
    ahead across the changes."""
    import random
    rnd = random.Random(seed)
    shared = [rnd.randrange(1, 96) for _ in range(40)]
    budget, max_model_len = 24, 64

    def params(max_tokens=None):
        kw = dict(ignore_eos=True)
        if max_tokens is None and rnd.random() < 0.3:
            kw["stop_token_ids"] = [rnd.randrange(96)]
        n = max_tokens or rnd.randint(1, 14)
        return greedy(n, **kw) if rnd.random() < 0.5 else seeded(n, rnd.randrange(100), **kw)

    def prompt(tail=None):
        head = shared[:rnd.choice([0, 16, 17, 32])] if cache else []
        return head + [rnd.randrange(1, 96) for _ in range(tail or rnd.choice([1, 3, 6, 20]))]
    reqs = [("r0", prompt(budget + 2), params(max_model_len))]     # runs until its context is full
    reqs += [(f"r{i}", prompt(), params()) for i in range(1, 4)]
    events = [(f"r{rnd.randrange(4)}", 1, ("add", f"late{i}", prompt(), params())) for i in range(8)]
    events.append((f"late{rnd.randrange(8)}", 1, ("abort",)))     # every stream gets a token: each event fires
    kw = dict(prefix_caching=True, state_snapshots=4 if cache == "prefix+state" else 0) if cache else {}
    out, engine = same_both_ways(reqs, events, max_batch=3, max_model_len=max_model_len,
                                 max_num_batched_tokens=budget, **kw)
    assert engine.mixed_ahead + engine.remapped_launches > 0
    added = [action[1:] for _, _, action in events if action[0] == "add"]
    asked = {rid: (prompt_ids, sp) for rid, prompt_ids, sp in reqs + added}
    assert any(len(prompt_ids) > budget for prompt_ids, _ in asked.values())
    full_context = [rid for rid, (ids, _, reason, _) in out.items() if reason == "length"
                    and len(asked[rid][0]) + len(ids) == max_model_len and len(ids) < asked[rid][1].max_tokens]
    assert "r0" in full_context, {rid: (len(asked[rid][0]), len(v[0]), v[2]) for rid, v in out.items()}


def test_eos_min_tokens_and_stop_strings():
    """EOS and stop token ids end a request ("stop", its last token the one that ended it) once it has min_tokens
    tokens, not before; a stop string ends it ("stop") with its text cut where the string starts; the same with
    async scheduling."""
    ref, _ = run(False, MIXED)
    eos_c = ref["c"][0][4]
    early_eos_a, late_eos_a = ref["a"][0][1], ref["a"][0][4]     # an EOS inside a's min_tokens, one past it
    text_b = ref["b"][1]
    stop_str = text_b[len(text_b) // 2: len(text_b) // 2 + 2]
    stop_d = ref["d"][0][2]
    reqs = [("a", [1, 2, 3], greedy(12, min_tokens=3)),
            ("b", [9, 8], seeded(7, 11, ignore_eos=True, stop=[stop_str])),
            ("c", [4, 4, 4, 4, 7], greedy(9)),
            ("d", [3], seeded(14, 5, stop_token_ids=[stop_d], min_tokens=4))]
    out, _ = same_both_ways(reqs, eos_token_ids=(eos_c, early_eos_a, late_eos_a))
    assert out["a"][0] == ref["a"][0][:5] and out["a"][2] == "stop"
    assert len(stop_str) == 2 and out["b"][2] == "stop" and len(out["b"][0]) < len(ref["b"][0])
    assert out["b"][1] == text_b[:text_b.index(stop_str)] and stop_str not in out["b"][1]
    assert out["c"][0] == ref["c"][0][:5] and out["c"][0][-1] == eos_c and out["c"][2] == "stop"
    assert out["d"][0] == ref["d"][0] and out["d"][0].index(stop_d) < 3 and out["d"][2] == "length"


def test_abort_mid_generation():
    events = [("b", 3, ("abort",)), ("c", 1, ("abort",))]
    out, engine = same_both_ways(MIXED, events)
    assert engine.discarded >= 1      # the step in flight when an abort arrived had a token for it
    assert out["b"][2] == "abort" and len(out["b"][0]) == 3
    assert out["c"][2] == "abort" and len(out["c"][0]) == 1
    assert len(out["a"][0]) == 12 and len(out["d"][0]) == 14


def test_request_arriving_mid_decode():
    reqs = [("a", [1, 2, 3], greedy(12, ignore_eos=True)), ("b", [9, 8], seeded(9, 11, ignore_eos=True))]
    events = [("a", 4, ("add", "late", [6, 5, 4], seeded(6, 2, ignore_eos=True))),
              ("b", 6, ("add", "later", [2], greedy(5, ignore_eos=True)))]
    out, engine = same_both_ways(reqs, events)
    assert len(out["late"][0]) == 6 and len(out["later"][0]) == 5
    # each arrival's prompt rides in a mixed step launched ahead of the read of the decode step before it
    assert engine.mixed_ahead == 2, engine.mixed_ahead


def test_logprobs_requests_launch_ahead_and_match():
    """Catches logprobs read from the logits of the step launched ahead (which overwrote those of the step whose
    tokens they describe): beside and after requests that want logprobs, steps are still launched ahead, and every
    logprob and top list equals the synchronous engine's."""
    reqs = [("a", [1, 2, 3], greedy(8, ignore_eos=True, logprobs=3)),
            ("b", [9, 8], seeded(12, 11, ignore_eos=True)),
            ("c", [5], seeded(16, 4, ignore_eos=True))]
    events = [("b", 10, ("add", "late", [7, 7], greedy(4, ignore_eos=True, logprobs=1)))]
    out, engine = same_both_ways(reqs, events)
    assert len(out["a"][3]) == 8 and len(out["late"][3]) == 4 and out["b"][3] == out["c"][3] == []
    assert engine.mixed_ahead == 1      # "late" joined ahead of a read whose tokens had logprobs


def test_logprobs_alone_launch_ahead():
    out, engine = same_both_ways([("a", [1, 2], greedy(6, ignore_eos=True, logprobs=2))])
    # the prefill's token, then 5 decode steps: all but the first launched ahead
    assert engine.ahead_launches == 4 and len(out["a"][3]) == 6


def test_short_of_pages_falls_back_and_frees_everything():
    """5 pages of 16 tokens for 3 sequences of up to 40 tokens: the async engine finds no page for a step it would
    launch ahead and falls back to a step scheduled after the read, where the scheduler preempts a sequence; the
    streams are the synchronous engine's and those computed by hand, and every page comes back."""
    reqs = [(f"r{i}", [1 + i] * (3 + i), greedy(24 + i, ignore_eos=True)) for i in range(3)]
    out, engine = same_both_ways(reqs, num_pages=5)
    s = engine.stats()
    assert engine.short_of_pages > 0 and s["num_preemptions"] > 0, (engine.short_of_pages, s)
    assert s["kv_pages_used"] == 0 and s["kv_pages_total"] == 5
    for rid, prompt, params in reqs:
        assert out[rid][0] == expected_greedy_stream(prompt, params.max_tokens) and out[rid][2] == "length", rid


def test_context_full_finishes_with_length():
    out, _ = same_both_ways([("a", [1, 2, 3], greedy(100, ignore_eos=True)),
                             ("b", [4] * 20, seeded(100, 8, ignore_eos=True))], max_model_len=32)
    assert len(out["a"][0]) == 32 - 3 and len(out["b"][0]) == 32 - 20
    assert out["a"][2] == out["b"][2] == "length"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_is_idle_after_the_last_request(async_scheduling):
    """No step stays in flight once every request is finished (score() and warmup need an idle engine)."""
    ref, _ = run(False, [("a", [1, 2, 3], greedy(12, ignore_eos=True))])
    stop = ref["a"][0][6]
    _, engine = run(async_scheduling, [("a", [1, 2, 3], greedy(12, ignore_eos=True, stop_token_ids=[stop]))])
    assert engine._inflight is None and not engine.has_unfinished()
    assert engine.score([1, 2, 3]).shape == (3, engine.model.V)


def test_logits_host_gives_the_returned_steps_logits():
    """After each step(), runner.logits_host holds the logits of the step whose tokens step() just returned, also
    while the next step (launched ahead) has already overwritten the model's logits buffer."""
    import numpy as np

    def logits_per_token(async_scheduling):
        engine = counting(tiny_engine(async_scheduling))
        engine.runner.keep_logits = True
        engine.add_request("a", [1, 2, 3], greedy(9, ignore_eos=True))
        engine.add_request("b", [4], seeded(6, 3, ignore_eos=True))
        rows = []
        while engine.has_unfinished():
            outs = [o for o in engine.step() if o.new_token_ids]
            if outs:
                rows.append(engine.runner.logits_host(len(outs)))
        return rows, engine
    sync, _ = logits_per_token(False)
    overlap, engine = logits_per_token(True)
    assert engine.ahead_launches > 0 and len(sync) == len(overlap)
    for x, y in zip(sync, overlap):
        np.testing.assert_array_equal(x, y)


def test_logits_host_refuses_logits_a_step_ahead_overwrote():
    """Without ``keep_logits`` a step launched ahead takes no copy of the logits it overwrites (nothing in the
    engine reads them: a request that wants logprobs is never decoded ahead), so logits_host says so rather than
    returning the newer step's rows."""
    import pytest
    engine = counting(tiny_engine(True))
    engine.add_request("a", [1, 2, 3], greedy(6, ignore_eos=True))
    while engine.ahead_launches == 0 and engine.has_unfinished():
        engine.step()
    assert engine.ahead_launches > 0 and engine._inflight is not None
    with pytest.raises(RuntimeError, match="keep_logits"):
        engine.runner.logits_host(1)
    while engine.has_unfinished():
        engine.step()


def expected_greedy_stream(prompt, n, vocab=96, hash_mod=1000003):
    """The tiny model's greedy tokens computed in plain Python from its definition (``tiny_model``'s docstring),
    with no engine, page table or kernel involved: the next token is the first argmax over ``v`` of
    ``((h + 1)(2v + 1) · 40503) mod 64``, ``h`` the hash of every id so far."""
    ids = list(prompt)
    for _ in range(n):
        h = 17
        for tok in ids:
            h = (h * 31 + tok + 7) % hash_mod
        scores = [((h + 1) * (2 * v + 1) * 40503) % 64 for v in range(vocab)]
        ids.append(scores.index(max(scores)))
    return ids[len(prompt):]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_streams_match_the_model_computed_by_hand(async_scheduling):
    """Catches a bug that sync and async scheduling share (a wrong page, position, slot or input id, a token
    appended twice): each concurrent greedy stream equals the one computed in plain Python."""
    requests = [(rid, prompt, params) for rid, prompt, params in MIXED if params.temperature == 0.0]
    requests.append(("e", list(range(5, 22)), greedy(6, ignore_eos=True)))   # a prompt across a page boundary
    out, _ = run(async_scheduling, requests)
    for rid, prompt, params in requests:
        assert out[rid][0] == expected_greedy_stream(prompt, params.max_tokens), rid
