"""AsyncEngine on its own: outputs arrive in order, closing a stream aborts, admission control, shutdown,
and an engine whose step fails is taken out of service (tests/server/test_engine_failure.py has the rest)."""
from __future__ import annotations

import asyncio
import time

import pytest

from pegainfer.engine.async_engine import AsyncEngine, EngineNotReadyError, EngineStepError, QueueFullError
from pegainfer.engine.types import SamplingParams
from pegainfer.errors import RequestError
from tests.server.conftest import idle, wait_until
from tests.server.fake_engine import DEFAULT_REPLY, FakeEngine


@pytest.fixture
def engine(model_folder):
    return FakeEngine(model_folder, max_batch=1)


def run(coro):
    return asyncio.run(coro)


def test_generate_streams_every_output_in_order(engine):
    ae = AsyncEngine(engine).start()
    try:
        async def main():
            outs = [o async for o in ae.generate("r1", engine.tokenizer.encode("Hi"), SamplingParams(max_tokens=100))]
            return outs
        outs = run(main())
        assert "".join(o.delta_text for o in outs) == DEFAULT_REPLY
        assert outs[-1].finished and outs[-1].finish_reason == "stop"
        assert [o.completion_tokens for o in outs] == list(range(1, len(outs) + 1))
        wait_until(lambda: idle(ae))
    finally:
        ae.shutdown()


def test_closing_a_stream_aborts_and_refusals_raise(engine):
    engine.step_delay = 0.02   # "a" must still be running (200 tokens ≈ 4 s) while the refusals are checked
    ae = AsyncEngine(engine, max_waiting=1).start()
    try:
        async def main():
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            a = await ae.add("a", [5, 6], long)
            first = await a.__anext__()
            assert first.new_token_ids
            with pytest.raises(RequestError, match="already in use"):
                await ae.add("a", [5], long)
            with pytest.raises(RequestError, match="empty"):  # refused by the engine itself
                await ae.add("empty", [], long)
            engine.gate.clear()                         # hold the engine so "b" stays queued
            wait_until(engine.in_step.is_set)
            b_task = asyncio.ensure_future(ae.add("b", [7], long))
            await asyncio.sleep(0)
            with pytest.raises(QueueFullError, match="max-waiting 1"):
                await ae.add("c", [8], long)
            engine.gate.set()
            b = await b_task
            await a.aclose()                            # client went away
            async with b:                               # leaving the block early aborts too
                await b.__anext__()
        run(main())
        wait_until(lambda: idle(ae), what="both aborted requests to be freed")
        assert sorted(engine.aborted) == ["a", "b"] and "c" not in engine.prompts
    finally:
        engine.gate.set()
        ae.shutdown()


def test_cancel_before_the_engine_accepted(engine):
    ae = AsyncEngine(engine).start()
    try:
        engine.gate.clear()

        async def main():
            blocker = await ae.add("blocker", [1], SamplingParams(max_tokens=50, ignore_eos=True))
            wait_until(engine.in_step.is_set)
            task = asyncio.ensure_future(ae.add("late", [2], SamplingParams(max_tokens=5)))
            await asyncio.sleep(0.01)
            task.cancel()  # e.g. the HTTP client disconnected while the request was still queued
            with pytest.raises(asyncio.CancelledError):
                await task
            await blocker.aclose()
        run(main())
        engine.gate.set()
        wait_until(lambda: idle(ae))
        assert "late" not in engine.prompts  # it never reached the engine
    finally:
        engine.gate.set()
        ae.shutdown()


def test_not_ready_and_shutdown(model_folder):
    ae = AsyncEngine(engine_factory=lambda: FakeEngine(model_folder, step_delay=0.01))

    async def too_early():
        await ae.add("x", [1], SamplingParams())
    with pytest.raises(EngineNotReadyError, match="still loading"):
        run(too_early())
    ae.start()
    assert ae.wait_ready(10)

    async def cut_off():
        s = await ae.add("x", [1], SamplingParams(max_tokens=200, ignore_eos=True))
        await s.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, ae.shutdown)
        with pytest.raises(EngineNotReadyError, match="shut down"):
            async for _ in s:
                pass
    run(cut_off())
    assert ae.state == "stopped"


def test_a_failing_step_takes_the_engine_out_of_service(engine):
    ae = AsyncEngine(engine).start()
    try:
        engine.step = lambda: (_ for _ in ()).throw(RuntimeError("GPU fell off the bus"))

        async def main():
            s = await ae.add("x", [1], SamplingParams(max_tokens=5))
            with pytest.raises(EngineStepError, match="GPU fell off the bus"):
                await s.__anext__()
        run(main())
        wait_until(lambda: ae.state == "failed")
        with pytest.raises(EngineNotReadyError, match="GPU fell off the bus"):
            run(ae.add("y", [1], SamplingParams()))
    finally:
        ae.shutdown()


class GpuWaitEngine(FakeEngine):
    """A FakeEngine with the ``before_gpu_wait`` slot, called in the middle of each step like a real GPU wait;
    it records what the event loop had received by then and when each step began."""

    def __init__(self, folder, **kw):
        super().__init__(folder, **kw)
        self.before_gpu_wait = None
        self.step_started: list[float] = []

    def step(self):
        self.step_started.append(time.perf_counter())
        if self.before_gpu_wait is not None and self.has_unfinished():
            self.before_gpu_wait()
        time.sleep(0.002)  # "the GPU"
        return super().step()


def test_outputs_reach_the_loop_at_the_next_gpu_wait(model_folder):
    engine = GpuWaitEngine(model_folder, max_batch=2)
    ae = AsyncEngine(engine, first_token_handoff_s=0).start()
    try:
        held = []                       # (step number, outputs the engine thread still held at its GPU wait)
        release = ae._release_held

        def spy():
            held.append((len(engine.step_started), [(s.request_id, m, getattr(a, "completion_tokens", None))
                                                    for s, m, a in ae._held]))
            release()
        engine.before_gpu_wait = spy

        async def main():
            params = SamplingParams(max_tokens=6, ignore_eos=True)
            a, b = await ae.add("a", [5, 6], params), await ae.add("b", [7], SamplingParams(max_tokens=3))
            outs_a = [o async for o in a]
            outs_b = [o async for o in b]
            return outs_a, outs_b
        outs_a, outs_b = run(main())
        # nothing lost or reordered, the last output arrives although no GPU wait follows it
        assert [o.completion_tokens for o in outs_a] == [1, 2, 3, 4, 5, 6] and outs_a[-1].finished
        assert [o.completion_tokens for o in outs_b] == [1, 2, 3] and outs_b[-1].finished
        # the acceptance waited for the first step's GPU wait, and a's output of step k (its k-th token) for the
        # GPU wait of step k + 1; its last output went out at once (no step followed)
        assert held[0] == (1, [("a", "_accept", None)])
        a_puts = [(step, n) for step, items in held for rid, m, n in items if rid == "a" and m == "_put"]
        assert a_puts == [(k + 1, k) for k in range(1, 6)]
        wait_until(lambda: idle(ae))
    finally:
        ae.shutdown()


def test_engine_waits_until_the_first_output_is_taken(model_folder):
    engine = GpuWaitEngine(model_folder, max_batch=1)
    ae = AsyncEngine(engine, first_token_handoff_s=10.0).start()   # wait as long as it takes
    try:
        async def main():
            s = await ae.add("a", [5], SamplingParams(max_tokens=4, ignore_eos=True))
            first = await s.__anext__()
            await asyncio.sleep(0.05)   # the server is slow to write the first chunk
            came_back = time.perf_counter()
            rest = [o async for o in s]
            return first, came_back, rest
        first, came_back, rest = run(main())
        assert first.completion_tokens == 1 and [o.completion_tokens for o in rest] == [2, 3, 4]
        # step 1 made the first token; step 2 began only once the consumer came back for more
        assert engine.step_started[1] >= came_back
        wait_until(lambda: idle(ae))
    finally:
        ae.shutdown()


def test_cancelling_the_stream_wakes_a_waiting_reader_and_accept(engine):
    ae = AsyncEngine(engine).start()
    try:
        async def main():
            blocker = await ae.add("blocker", [1], SamplingParams(max_tokens=50, ignore_eos=True))
            engine.gate.clear()
            await asyncio.get_running_loop().run_in_executor(None, wait_until, engine.in_step.is_set)
            late = ae.submit("late", [2], SamplingParams(max_tokens=5))   # queued behind the paused step
            asyncio.get_running_loop().call_later(0.02, late.cancel)       # e.g. its client went away
            with pytest.raises(asyncio.CancelledError):
                await late.accepted()
            async def next_output():
                reader = asyncio.ensure_future(blocker.__anext__())
                await asyncio.sleep(0.02)
                return reader
            reader = await next_output()
            while reader.done():   # outputs made before the pause
                reader = await next_output()
            blocker.cancel()       # the reader waits for an output that the paused engine will not make
            with pytest.raises(StopAsyncIteration):
                await reader
            engine.gate.set()
        run(main())
        wait_until(lambda: idle(ae))
        assert "late" not in engine.prompts and "blocker" in engine.aborted
    finally:
        engine.gate.set()
        ae.shutdown()
