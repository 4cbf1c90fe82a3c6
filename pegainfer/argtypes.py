"""argparse ``type=`` functions for the command line: every value is checked while the arguments are parsed, so a
bad one stops the CLI with argparse's one-line ``error: argument --flag: ...`` before anything loads.

Each function takes the flag's text and returns the value, or raises ``argparse.ArgumentTypeError`` with a message
that says what is allowed."""
from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Optional


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_in(lo: Optional[int] = None, hi: Optional[int] = None, note: str = "") -> Callable[[str], int]:
    """A whole number in ``[lo, hi]`` (either end open when None); ``note`` is added to the message, e.g. "(0 = off)"."""
    def check(text: str) -> int:
        value = _int(text)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            if hi is None:
                allowed = f"at least {lo}"
            elif lo is None:
                allowed = f"at most {hi}"
            else:
                allowed = f"between {lo} and {hi}"
            raise argparse.ArgumentTypeError(f"must be {allowed}{' ' + note if note else ''}, got {value}")
        return value
    return check


def temperature(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy), got {text}")
    return value


def top_p(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 = off), got {text}")
    return value


def min_p(text: str) -> float:
    value = _float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1] (0 = off), got {text}")
    return value


def penalty(text: str) -> float:
    """A presence or frequency penalty: OpenAI's range."""
    value = _float(text)
    if not -2 <= value <= 2:
        raise argparse.ArgumentTypeError(f"must be in [-2, 2] (0 = off), got {text}")
    return value


def repetition_penalty(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 10:
        raise argparse.ArgumentTypeError(f"must be in (0, 10] (1 = off), got {text}")
    return value


def memory_fraction(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (a fraction of the GPU's memory), got {text}")
    return value


def output_file(text: str) -> str:
    """A file the command writes when it is done: its folder must exist and be writable (checked now, not after a
    run of minutes)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file name")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder} does not exist: create it first")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder {folder} is not writable")
    return text


def output_folder(text: str) -> str:
    """A folder the command writes into when it is done (created if missing): it must not be a file, and the
    nearest folder that exists must be writable."""
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a file: give a folder")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise argparse.ArgumentTypeError(f"cannot create a folder under the file {existing}")
    if not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder {existing} is not writable")
    return text


positive = int_in(1)
top_k = int_in(0, note="(0 = off)")
seed = int_in(-(1 << 63), (1 << 64) - 1)          # the sampler takes any seed mod 2^64
port = int_in(0, 65535, note="(0 = any free port)")
max_model_len = int_in(2, note="(the prompt and at least one generated token)")
max_waiting = int_in(0)


def request_rate(text: str) -> float:
    """Requests per second: a number > 0, or ``inf`` (every request at once)."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, or inf (every request at once), got {text}")
    return value


def request_rates(text: str) -> tuple[float, ...]:
    """One request rate (``request_rate``) or several, comma-separated, each once."""
    rates = tuple(request_rate(part) for part in text.split(","))
    if len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"a rate is given twice in {text}")
    return rates


def range_ratio(text: str) -> float:
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (0 = fixed lengths), got {text}")
    return value


def positive_seconds(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def positive_milliseconds(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds > 0, got {text}")
    return value


non_negative = int_in(0)


def launch_policy(text: str) -> dict:
    """``FIELD=VALUE[,FIELD=VALUE...]``: ``LaunchPolicy`` fields to change (``kernels/policy_text.py``)."""
    from pegainfer.kernels.policy_text import PolicyTextError, parse_fields
    try:
        fields = parse_fields(text)
    except PolicyTextError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not fields:
        raise argparse.ArgumentTypeError("expected FIELD=VALUE[,FIELD=VALUE...]")
    return fields


def chat_template(text: str) -> str:
    """``--chat-template``: the text of a chat template, read from a file (a Jinja file, or a JSON file with a
    ``chat_template`` string as model folders keep it), or given as the template's text itself (as vLLM takes it)."""
    path = os.path.expanduser(text)
    if os.path.isfile(path):
        source = text_file(path)
        if path.endswith(".json"):
            import json
            try:
                source = json.loads(source)["chat_template"]
            except (ValueError, KeyError, TypeError):
                raise argparse.ArgumentTypeError(f"{path} is not a JSON object with a 'chat_template' string") \
                    from None
            if not isinstance(source, str):
                raise argparse.ArgumentTypeError(f"{path}: 'chat_template' must be a string")
    elif "{{" in text or "{%" in text:
        source = text
    else:
        raise argparse.ArgumentTypeError(f"{text!r} is no file and no Jinja template (no '{{{{' or '{{%'): give the "
                                         f"path of a .jinja file or the template's text")
    from pegainfer.errors import PegainferError
    from pegainfer.text.chat import ChatTemplate
    try:
        ChatTemplate(source, origin="it")     # compiled now: a syntax error stops the command before anything loads
    except PegainferError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return source


def add_chat_template_argument(p: argparse.ArgumentParser, kwargs: bool = False) -> None:
    """``--chat-template`` on an ``argparse`` parser, for every command that renders chat messages; with
    ``kwargs``, ``--chat-template-kwargs`` too (commands that render the messages they read themselves)."""
    p.add_argument("--chat-template", type=chat_template, default=None, metavar="FILE_OR_TEXT",
                   help="a chat template that replaces the model folder's: the path of a Jinja file (or of a JSON "
                        "file with a 'chat_template' string), or the template's text")
    if kwargs:
        p.add_argument("--chat-template-kwargs", type=json_object, default={}, metavar="JSON",
                       help="more variables for the chat template, as a JSON object (e.g. "
                            "'{\"enable_thinking\": false}': Qwen3 answers without thinking first)")


def add_hub_arguments(p: argparse.ArgumentParser) -> None:
    """``--revision`` / ``--download-dir``: how a ``--model-path`` that is a Hub id is fetched (``hub.py``)."""
    p.add_argument("--revision", default=None,
                   help="with a Hub id: the branch, tag or commit to fetch (default: main)")
    p.add_argument("--download-dir", default=None, metavar="DIR",
                   help="with a Hub id: the Hugging Face cache to fetch into and read from (default: HF_HUB_CACHE, "
                        "~/.cache/huggingface/hub)")


def json_object(text: str) -> dict:
    """``--chat-template-kwargs``: a JSON object, e.g. ``'{"enable_thinking": false}'``."""
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def text_file(path: str) -> str:
    """``--prompt-file``: the UTF-8 text of a file, or of stdin for ``-``, read while the flags are read."""
    import sys
    try:
        if path == "-":
            return sys.stdin.read()
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file") from None
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path} ({e.strerror})") from None


def origins(text: str) -> list[str]:
    """``--allowed-origins`` and the like: a JSON list of strings (vLLM's form, ``'["https://a.example"]'``) or
    comma-separated values (``*`` for any)."""
    text = text.strip()
    if text.startswith("["):
        import json
        try:
            values = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list ({e})") from None
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return values
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values
