"""StopStringMatcher: matches across pieces, never leaks a fragment, cuts at the earliest stop."""
import pytest

from pegainfer.text.stop import StopStringMatcher


def run(stops, pieces, include_stop=False):
    m = StopStringMatcher(stops, include_stop)
    out, matched = [], False
    for p in pieces:
        safe, matched = m.push(p)
        out.append(safe)
        if matched:
            break
    if not matched:
        out.append(m.flush())
    return out, matched, m


def test_stop_split_across_pieces_is_never_sent():
    out, matched, m = run(["END"], ["Hello E", "N", "D and more"])
    assert matched and m.matched == "END"
    assert "".join(out) == "Hello "
    assert out == ["Hello ", "", ""]  # "E" and "N" were held back, never sent


def test_false_start_is_released():
    out, matched, _ = run(["END"], ["Hello E", "N", "X then"])
    assert not matched
    assert out == ["Hello ", "", "ENX then", ""]


def test_held_text_released_by_flush_at_end():
    out, matched, _ = run(["</answer>"], ["42 </ans"])
    assert not matched and out == ["42 ", "</ans"]


def test_earliest_stop_wins_and_cut_text_after_match_is_dropped():
    out, matched, m = run(["world", "lo"], ["hello world"])
    assert matched and m.matched == "lo" and out == ["hel"]
    assert m.push("more") == ("", True) and m.flush() == ""


def test_stop_at_start_and_repeated_prefixes():
    assert run(["ab"], ["ab"])[0] == [""]
    # "aab": the held "a" must be re-examined as "aa" → "a" keeps being a possible start
    out, matched, _ = run(["ab"], ["a", "a", "b"])
    assert matched and "".join(out) == "a"
    out, matched, _ = run(["aab"], ["a", "a", "a", "b"])
    assert matched and "".join(out) == "a"


@pytest.mark.parametrize("stops", [[], [""]])
def test_no_stops_passes_text_through(stops):
    out, matched, _ = run(stops, ["abc", "def"])
    assert not matched and "".join(out) == "abcdef" and out[0] == "abc"


def test_random_splits_agree_with_one_shot(rng):
    text = "the cat sat on the mat; STOP here, STOP again" * 3
    stops = ["STOP", "mat;", "cat sat on the X"]
    expected = text[:text.index("mat;")]
    for _ in range(200):
        cuts = sorted(set(int(c) for c in rng.integers(0, len(text), size=int(rng.integers(1, 12)))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        out, matched, _ = run(stops, pieces)
        assert matched and "".join(out) == expected
        sent = ""
        for piece in out:  # no prefix of what was sent ever ends with a fragment that later became a stop
            sent += piece
            assert "mat;" not in sent and "STOP" not in sent


def test_include_stop_keeps_the_earliest_stop_string_and_nothing_after_it(rng):
    """``include_stop`` (vLLM's include_stop_str_in_output): the text ends with the stop string that matched first,
    over random splits; a stop split across pieces still never leaks early (its held part comes out with the
    match)."""
    out, matched, m = run(["END"], ["Hello E", "N", "D and more"], include_stop=True)
    assert matched and out == ["Hello ", "", "END"]
    text = "the cat sat on the mat; STOP here"
    for _ in range(50):
        cuts = sorted(set(int(c) for c in rng.integers(0, len(text), size=int(rng.integers(1, 8)))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        out, matched, _ = run(["STOP", "mat;"], pieces, include_stop=True)
        assert matched and "".join(out) == "the cat sat on the mat;"
