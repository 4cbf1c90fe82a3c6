"""ChatTemplate renders Qwen3's real template exactly like transformers' apply_chat_template does."""
import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from pegainfer.errors import ModelFolderError, RequestError
from pegainfer.text.chat import ChatTemplate
from tests.text.fixtures import QWEN3_TEMPLATE, make_model_folder

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city — «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    "multi_turn_with_reasoning": [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "<think>\nblue is common\n</think>\n\nBlue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Red.", "reasoning_content": "pick red"},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"sky\": \"clear\"}"},
    ],
    "unicode": [{"role": "user", "content": "héllo 你好 😀 <tag> & \"quotes\""}],
}


def hf_render(messages, **kw):
    rendered, _ = render_jinja_template([messages], chat_template=QWEN3_TEMPLATE, **kw)
    return rendered[0]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(name, kwargs, add_generation_prompt):
    messages = CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if name == "tool_round_trip" else None
    ours = ChatTemplate(QWEN3_TEMPLATE).render(messages, add_generation_prompt=add_generation_prompt,
                                               tools=tools, **kwargs)
    assert ours == hf_render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)


def test_enable_thinking_false_exact_text():
    t = ChatTemplate(QWEN3_TEMPLATE)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert t.render(msgs) == head
    assert t.render(msgs, enable_thinking=False) == head + "<think>\n\n</think>\n\n"
    assert t.render(msgs, add_generation_prompt=False) == head[:-len("<|im_start|>assistant\n")]


def test_tojson_does_not_escape_html_or_unicode():
    out = ChatTemplate(QWEN3_TEMPLATE).render([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in out


def test_from_folder_reads_config_or_jinja_file_and_special_tokens(tmp_path):
    t = ChatTemplate.from_folder(make_model_folder(tmp_path / "a"))
    assert t.render([{"role": "user", "content": "Hi"}]).endswith("<|im_start|>assistant\n")
    b = make_model_folder(tmp_path / "b", chat_template="{{ eos_token }}|{{ messages[0].content }}",
                          template_in_jinja_file=True)
    assert ChatTemplate.from_folder(b).render([{"role": "user", "content": "Hi"}]) == "<|im_end|>|Hi"
    assert ChatTemplate.from_folder(make_model_folder(tmp_path / "c", chat_template=None)) is None


def test_named_template_list_picks_default(tmp_path):
    folder = make_model_folder(tmp_path, chat_template=None)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "PLAIN"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ChatTemplate.from_folder(folder).render([]) == "PLAIN"


def test_template_errors():
    with pytest.raises(ModelFolderError, match="does not compile"):
        ChatTemplate("{% if %}")
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}"
                          "{% endif %}ok")
    assert strict.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(RequestError, match="first message must be from the user"):
        strict.render([{"role": "assistant", "content": "x"}])
    with pytest.raises(RequestError):
        ChatTemplate(QWEN3_TEMPLATE).render([])  # messages[0] of an empty list
    with pytest.raises(RequestError, match="unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])
    loopy = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}")
    assert loopy.render([{"content": "a"}, {"content": "b"}]) == "a"
