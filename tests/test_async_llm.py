"""``AsyncLLM`` (``pegainfer/llm.py``) on the demo model, as an asyncio program uses it: a stream's deltas add up
to what ``LLM`` gives for the same prompt, concurrent streams run batched and each gets its own tokens, leaving a
stream early aborts its request (every page back), a chat's deltas carry the thinking and the answer apart, and a
bad request is a one-line error."""
import asyncio

import pytest

from pegainfer import AsyncLLM, LLM, SamplingParams
from pegainfer.errors import PegainferError

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models():
    reference = LLM(max_batch=4)
    streaming = AsyncLLM(max_batch=4)
    yield reference, streaming
    streaming.close()


async def collect(stream):
    return [d async for d in stream]


def idle(llm) -> bool:
    s = llm._async.stats()
    return s["running"] == 0 and s["waiting"] == 0 and s["kv_pages_used"] == 0


def test_concurrent_streams_add_up_to_what_llm_gives(models):
    reference, llm = models
    prompts = ["Hello", "The capital of France is", [5, 6, 7, 8]]

    running = []

    async def run():
        tasks = [asyncio.ensure_future(collect(llm.generate(p, GREEDY))) for p in prompts]
        while not all(t.done() for t in tasks):      # how many the engine runs at once
            running.append(llm._async.stats().get("running", 0))
            await asyncio.sleep(0.01)
        return [t.result() for t in tasks]
    streams = asyncio.run(run())
    assert max(running) == 3, running                  # batched: all three in one step
    want = reference.generate(prompts, GREEDY, use_tqdm=False)
    for deltas, g in zip(streams, want):
        assert [t for d in deltas for t in d.token_ids] == g.outputs[0].token_ids
        assert "".join(d.text for d in deltas) == g.text
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].finish_reason == "length" and all(d.content is None for d in deltas)
    assert idle(llm)


def test_leaving_a_stream_early_aborts_its_request(models):
    _, llm = models

    async def run():
        got = []
        async for delta in llm.generate("Hello", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)):
            got.append(delta)
            if len(got) == 2:
                break
        for _ in range(200):          # the abort takes effect at the engine's next step
            if idle(llm):
                break
            await asyncio.sleep(0.05)
        return got
    got = asyncio.run(run())
    assert len(got) == 2 and not got[-1].finished and idle(llm)


def test_a_chat_stream_splits_the_answer(models):
    reference, llm = models
    messages = [{"role": "user", "content": "Hi"}]
    kwargs = {"enable_thinking": False}
    deltas = asyncio.run(collect(llm.chat(messages, GREEDY, chat_template_kwargs=kwargs)))
    want, = reference.chat(messages, GREEDY, chat_template_kwargs=kwargs, use_tqdm=False)
    assert "".join(d.content for d in deltas) == want.outputs[0].content == want.text
    assert "".join(d.reasoning_content for d in deltas) == ""          # the prompt closed the think block
    assert all(d.tool_calls is None for d in deltas)


def test_bad_requests_are_one_line_errors(models):
    _, llm = models
    with pytest.raises(PegainferError, match="the prompt has .* tokens but the context holds"):
        asyncio.run(collect(llm.generate([1] * llm.engine.max_model_len, GREEDY)))
    with pytest.raises(PegainferError, match="takes one prompt"):
        asyncio.run(collect(llm.generate(["a", "b"], GREEDY)))
    with pytest.raises(PegainferError, match="regex cannot be followed"):
        asyncio.run(collect(llm.generate("a", GREEDY, regex="(")))
    assert idle(llm)
