"""The offline Python API (``pegainfer/llm.py``) on the demo model, as a user calls it: a batch gives each prompt what
it gives alone (transformers' greedy tokens for one), n choices seeded seed + i, structured output, chat through the
template with the thinking split, logprobs against the engine's own scoring, one-line errors, and an interrupted
call that leaves the engine ready."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from pegainfer import LLM, SamplingParams
from pegainfer.errors import PegainferError

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_batch=4)


def idle(llm) -> bool:
    s = llm.engine.stats()
    return not llm.engine.has_unfinished() and s["kv_pages_used"] == 0 and s["slots_used"] == 0


def test_a_batch_gives_each_prompt_what_it_gives_alone(llm):
    from tests.test_cli import greedy_text_of_transformers
    prompts = ["Hello", "The capital of France is", [5, 6, 7, 8, 9], "def fib(n):"]
    batch = llm.generate(prompts, GREEDY)
    assert [g.prompt for g in batch] == ["Hello", "The capital of France is", None, "def fib(n):"]
    assert batch[0].prompt_token_ids == llm.tokenizer.encode("Hello") and batch[2].prompt_token_ids == [5, 6, 7, 8, 9]
    for p, g in zip(prompts, batch):
        alone, = llm.generate(p, GREEDY)
        assert g.outputs[0].token_ids == alone.outputs[0].token_ids and len(alone.outputs[0].token_ids) == 4, p
        assert g.text == alone.text == llm.tokenizer.decode(g.outputs[0].token_ids)
        assert g.outputs[0].finish_reason == "length"
    _, text = greedy_text_of_transformers(llm.engine.folder, "Hello", 4)
    assert batch[0].text == text
    assert idle(llm)


def test_n_choices_are_seeded_seed_plus_i(llm):
    params = SamplingParams(max_tokens=4, temperature=2.0, seed=5, ignore_eos=True)   # (flat enough to differ)
    g, = llm.generate("Hello", params, n=2)
    assert [c.index for c in g.outputs] == [0, 1]
    for i, c in enumerate(g.outputs):
        alone, = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=2.0, seed=5 + i, ignore_eos=True))
        assert c.token_ids == alone.outputs[0].token_ids
    assert g.outputs[0].token_ids != g.outputs[1].token_ids


def test_structured_output_holds_every_prompt(llm):
    out = llm.generate(["Hello", "Numbers:"], SamplingParams(max_tokens=8, temperature=1.0, seed=3), regex="[0-9]{3}")
    for g in out:
        assert len(g.text) == 3 and g.text.isdigit() and g.outputs[0].finish_reason == "stop", g.outputs
    g, = llm.generate("Pick:", SamplingParams(max_tokens=8, temperature=1.0, seed=4), choice=["yes", "no"])
    assert g.text in ("yes", "no") and g.outputs[0].finish_reason == "stop"
    with pytest.raises(PegainferError, match="give one of json_schema, regex, choice and grammar, not regex and "
                                             "choice"):
        llm.generate("x", regex="a", choice=["b"])
    with pytest.raises(PegainferError, match="json_schema cannot be followed"):
        llm.generate("x", json_schema={"type": "no such type"})


def test_chat_renders_the_template_and_splits_the_thinking(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    template = llm.engine.chat_template
    off, = llm.chat(messages, GREEDY, chat_template_kwargs={"enable_thinking": False})
    want = template.render(messages, add_generation_prompt=True, enable_thinking=False)
    assert off.prompt == want and off.prompt_token_ids == llm.tokenizer.encode(want)
    assert want.rstrip().endswith("</think>")                     # the template closed the think block
    c = off.outputs[0]
    assert (c.reasoning_content, c.content) == ("", c.text) and c.text
    first, second = llm.chat([messages, [{"role": "user", "content": "Again"}]], GREEDY)
    assert first.prompt == template.render(messages, add_generation_prompt=True)
    assert second.prompt == template.render([{"role": "user", "content": "Again"}], add_generation_prompt=True)
    for g in (first, second):      # the output may open a think block; this model's do not: all content
        c = g.outputs[0]
        assert not c.text.lstrip().startswith("<think>") and (c.reasoning_content, c.content) == ("", c.text), c



def test_chat_with_a_template_that_opens_the_thinking():
    """A generation prompt that ends in ``<think>`` (Qwen3.5's): the output is reasoning until ``</think>``, so 4
    tokens are all reasoning and the content is empty."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    llm = LLM(max_batch=2, chat_template=template)
    g, = llm.chat([{"role": "user", "content": "Hi"}], GREEDY)
    c = g.outputs[0]
    assert g.prompt.endswith("<think>\n") and c.content == "" and c.reasoning_content == c.text.strip("\n"), c


def test_chat_with_tools_returns_the_calls(llm, monkeypatch):
    """``tools`` reach the template, and a call in the answer (forced here by a regex) comes back parsed: its name
    and JSON arguments in ``tool_calls``, no content left (without tools a chat's text is all content: above)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                         "properties": {"a": {"type": "integer"}}}}}]
    call = '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>'
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    template, given = llm.engine.chat_template, []
    render = template.render
    monkeypatch.setattr(template, "render", lambda *a, **kw: given.append(kw.get("tools")) or render(*a, **kw))
    g, = llm.chat(messages, params, tools=tools, regex=re.escape(call),
                  chat_template_kwargs={"enable_thinking": False})
    assert given == [tools]                     # the template was given the tools (the demo's does not show them)
    c = g.outputs[0]
    assert c.text == call and c.content is None, c
    assert [(t.name, json.loads(t.arguments)) for t in c.tool_calls] == [("f", {"a": 1})]
    with pytest.raises(PegainferError, match="each tool must be"):
        llm.chat(messages, params, tools=[{"name": "x"}])


def test_logprobs_and_prompt_logprobs_match_the_engines_scoring(llm):
    g, = llm.generate("Hello there", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2,
                                                     prompt_logprobs=1))
    c = g.outputs[0]
    assert [lp.token_id for lp in c.logprobs] == c.token_ids and all(len(lp.top) == 2 for lp in c.logprobs)
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))
    ids = g.prompt_token_ids
    assert len(g.prompt_logprobs) == len(ids) and g.prompt_logprobs[0] is None
    logits = llm.engine.score(ids + c.token_ids).astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    for i in range(1, len(ids)):
        assert g.prompt_logprobs[i].token_id == ids[i]
        assert g.prompt_logprobs[i].logprob == pytest.approx(logp[i - 1, ids[i]], abs=2e-2)
    for k, lp in enumerate(c.logprobs):
        assert lp.logprob == pytest.approx(logp[len(ids) - 1 + k, lp.token_id], abs=2e-2)


def test_errors_are_one_line_and_leave_the_engine_idle(llm):
    too_long = [1] * llm.engine.max_model_len
    with pytest.raises(PegainferError, match="the prompt has .* tokens but the context holds"):
        llm.generate(["Hello", too_long], GREEDY)      # the first was added, then aborted
    assert idle(llm)
    with pytest.raises(PegainferError, match="n must be at least 1"):
        llm.generate("Hello", GREEDY, n=0)
    with pytest.raises(PegainferError, match="2 sampling params for 1 prompts"):
        llm.generate("Hello", [GREEDY, GREEDY])
    assert llm.generate([], GREEDY) == []


def test_an_interrupted_call_aborts_its_requests_and_the_next_call_works(llm, monkeypatch):
    step, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()
    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hello", "World"], GREEDY)
    monkeypatch.undo()
    assert idle(llm)
    g, = llm.generate("Hello", GREEDY)
    assert len(g.outputs[0].token_ids) == 4


def test_a_progress_bar_counts_the_requests_on_stderr(llm, capsys):
    llm.generate(["Hello", "World"], GREEDY, n=2)
    err = capsys.readouterr().err
    assert "Completions" in err and "4/4" in err and "tok/s" in err, err      # 2 prompts × n = 2
    llm.generate(["Hello"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_defaults_come_from_the_generation_config(llm):
    d = llm.default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.max_tokens) == (0.6, 20, 0.95, 16)   # the demo's generation_config


def test_import_pegainfer_stays_light():
    """``import pegainfer`` (the command line's first import) does not load numba; ``from pegainfer import LLM``
    does."""
    code = "import sys, pegainfer; assert 'numba' not in sys.modules; from pegainfer import LLM; print(LLM.__name__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "LLM", r.stderr
