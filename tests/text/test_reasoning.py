"""The qwen3 reasoning parser on hand-written model text: the think block split from the answer, tags split across
pieces at every position, no closing tag, tags inside code fences, where the output starts (from the prompt)."""
import pytest

from pegainfer.text.reasoning import ReasoningParser, reasoning_start, split_reasoning


def streamed(pieces, start="detect"):
    parser = ReasoningParser(start)
    reasoning, content = [], []
    for p in pieces:
        r, c = parser.push(p)
        reasoning.append(r)
        content.append(c)
    r, c = parser.flush()
    return "".join(reasoning) + r, "".join(content) + c, parser.thought


CASES = [   # (output, start, reasoning or None, content)
    ("<think>\nThe user wants a color.\n</think>\n\nBlue.", "detect", "The user wants a color.", "Blue."),
    ("  \n<think>a\n\nb</think>Blue.", "detect", "a\n\nb", "Blue."),
    ("Blue, no thinking.", "detect", None, "Blue, no thinking."),
    ("<thinking> is not the tag", "detect", None, "<thinking> is not the tag"),
    ("<think></think>", "detect", "", ""),
    # no closing tag (max_tokens or a stop string ended the output): all reasoning
    ("<think>\nStill thinking about", "detect", "Still thinking about", ""),
    ("Still thinking\n", "reasoning", "Still thinking", ""),
    # the prompt opened the block (Qwen3.5's generation prompt ends in <think>)
    ("hmm\n</think>\n\nAnswer.\n", "reasoning", "hmm", "Answer.\n"),
    # the prompt closed the block (enable_thinking false): everything is content, tags included
    ("<think>x</think>y", "content", None, "<think>x</think>y"),
    # a quoted </think> inside a code fence of the reasoning does not end it
    ("<think>Tags look like\n```\n</think>\n```\nok.</think>Done.", "detect", "Tags look like\n```\n</think>\n```\nok.",
     "Done."),
    # after the block, tags are content: in code or not
    ("<think>r</think>\n\nUse ```<think>``` then </think> and <think>.", "detect", "r",
     "Use ```<think>``` then </think> and <think>."),
    ("Answer first.\n<think>late</think>", "detect", None, "Answer first.\n<think>late</think>"),
]


@pytest.mark.parametrize("output,start,reasoning,content", CASES)
def test_split(output, start, reasoning, content):
    assert split_reasoning(output, start) == (reasoning, content)


@pytest.mark.parametrize("output,start,reasoning,content", CASES)
def test_tags_split_across_pieces_at_every_position(output, start, reasoning, content):
    want = (reasoning or "", content, reasoning is not None)
    assert streamed(list(output), start) == want                      # one character at a time
    for cut in range(1, len(output)):                                  # two pieces, cut anywhere
        assert streamed([output[:cut], output[cut:]], start) == want, cut


def test_nothing_is_released_while_a_tag_may_be_forming():
    p = ReasoningParser()
    assert p.push("  <thi") == ("", "")
    assert p.push("nk>\nI think") == ("I think", "")
    assert p.push("\n\n") == ("", "")               # maybe the newlines before </think>: held
    assert p.push("more</th") == ("\n\nmore", "")
    assert p.push("ink>\n\nHi") == ("", "Hi")
    assert p.flush() == ("", "")


def test_reasoning_start_reads_the_prompt_tail():
    assert reasoning_start("<|im_start|>assistant\n") == "detect"
    assert reasoning_start("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"
    assert reasoning_start("<|im_start|>assistant\n<think>\n") == "reasoning"
    with pytest.raises(ValueError):
        ReasoningParser("sometimes")
