"""The priority scheduling policy through the real engine over the tiny history model: waiting requests are
admitted by (priority, arrival), a short pool preempts the running request of the highest priority value (not
the newest), every stream keeps the tokens computed by hand, and without the policy a priority is refused."""
from __future__ import annotations

import pytest

from pegainfer.engine.types import SamplingParams
from pegainfer.errors import RequestError
from tests.engine.test_async_scheduling import expected_greedy_stream
from tests.engine.tiny_model import tiny_engine


def greedy(n, priority=0):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, priority=priority)


def run(engine, requests, after_first_step=()):
    """Add ``requests`` [(id, prompt, params)], step once, add ``after_first_step``, and step until idle; returns
    ({id: tokens}, ids in order of their first token)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    got, first = {}, []
    pending = list(after_first_step)
    while engine.has_unfinished() or pending:
        for out in engine.step():
            if out.new_token_ids and out.request_id not in got:
                first.append(out.request_id)
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        for rid, prompt, params in pending:
            engine.add_request(rid, prompt, params)
        pending = []
    assert engine.stats()["kv_pages_used"] == 0
    return got, first


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_waiting_requests_start_by_priority_then_arrival(async_scheduling):
    engine = tiny_engine(async_scheduling, max_batch=1, max_model_len=64, scheduling_policy="priority")
    busy = [("busy", [3, 4], greedy(6))]
    later = [("late-5", [5, 6], greedy(3, 5)), ("urgent", [7, 8], greedy(3, -2)), ("late-5b", [9, 10], greedy(3, 5)),
             ("normal", [11, 12], greedy(3))]
    got, first = run(engine, busy, later)
    assert first == ["busy", "urgent", "normal", "late-5", "late-5b"]
    for rid, prompt, params in busy + later:
        assert got[rid] == expected_greedy_stream(prompt, params.max_tokens), rid


def test_a_short_pool_preempts_the_highest_priority_value_not_the_newest():
    """With pages for barely two of three growing sequences, the oldest one (priority value 9) is preempted, never
    the newer, more urgent ones; every stream is the one computed by hand."""
    engine = tiny_engine(False, max_batch=3, max_model_len=64, num_pages=6, scheduling_policy="priority")
    requests = [("low", [2] * 5, greedy(30, 9)), ("high", [3] * 8, greedy(30, 0)), ("mid", [4] * 11, greedy(30, 1))]
    seqs = {}
    add = engine.add_request

    def keep(rid, prompt, params):
        add(rid, prompt, params)
        seqs[rid] = engine._seqs[rid]
    engine.add_request = keep
    got, _ = run(engine, requests)
    assert seqs["low"].preemptions > 0 and seqs["high"].preemptions == 0
    for rid, prompt, params in requests:
        assert got[rid] == expected_greedy_stream(prompt, params.max_tokens), rid


def test_priority_without_the_policy_is_refused():
    engine = tiny_engine(False)
    with pytest.raises(RequestError, match="--scheduling-policy priority"):
        engine.add_request("x", [1, 2], greedy(2, 3))
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="scheduling_policy"):
        tiny_engine(False, scheduling_policy="lottery")


def test_a_finished_request_says_when_it_was_first_scheduled():
    """The finishing output carries the time of the request's first step (the server's queue-time metric): after
    its arrival, and for a request that waited behind another, after that one's first token."""
    import time
    engine = tiny_engine(False, max_batch=1, max_model_len=64)
    t0 = time.perf_counter()
    engine.add_request("a", [3, 4], greedy(4))
    engine.add_request("b", [5, 6], greedy(2))
    ends, first_a = {}, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "a" and out.new_token_ids and first_a is None:
                first_a = time.perf_counter()
            if out.finished:
                ends[out.request_id] = out.scheduled_time
    assert t0 <= ends["a"] <= first_a <= ends["b"] <= time.perf_counter()
