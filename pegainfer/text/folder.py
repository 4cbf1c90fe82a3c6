"""The tokenizer-side files of a model folder: ``tokenizer_config.json`` (special tokens, the chat template) and
``chat_template.jinja`` / ``chat_template.json``.  Read by ``tokenizer.py`` and ``chat.py``; every bad-file message
names the file and the fix."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from pegainfer.errors import ModelFolderError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def read_json_object(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFolderError(f"{what} {path} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}): "
                               f"fix or re-download the file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"cannot read {what} {path} ({e}): check the file and its permissions") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"{what} {path} must hold a JSON object, found {type(data).__name__}: "
                               f"fix or re-download the file")
    return data


def token_content(value) -> Optional[str]:
    """``tokenizer_config.json`` writes a special token as a string or as ``{"content": "...", ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_tokenizer_config(folder: Path) -> dict:
    """``folder/tokenizer_config.json`` as a dict (empty when the folder has none)."""
    path = Path(folder) / "tokenizer_config.json"
    return read_json_object(path, "tokenizer config") if path.is_file() else {}


def special_tokens(tokenizer_config: dict) -> dict[str, str]:
    """The special-token strings a tokenizer config names (``bos_token``, ``eos_token``, ...)."""
    found = {k: token_content(tokenizer_config.get(k)) for k in SPECIAL_TOKEN_KEYS}
    return {k: v for k, v in found.items() if v is not None}


def _pick_template(value, where: str) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        if isinstance(chosen, str):
            return chosen
    raise ModelFolderError(f"chat_template in {where} must be a string or a list of {{name, template}} objects: "
                           f"fix or re-download the file")


def read_chat_template_source(folder: Union[str, Path], tokenizer_config: Optional[dict] = None) -> Optional[str]:
    """The chat template text of a model folder, or None when it has none."""
    folder = Path(folder)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFolderError(f"cannot read {jinja_file} ({e}): check the file") from None
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        try:
            data = json.loads(json_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFolderError(f"cannot read {json_file} ({e}): fix or re-download the file") from None
        if isinstance(data, dict) and "chat_template" in data:
            return _pick_template(data["chat_template"], str(json_file))
    if tokenizer_config is None:
        cfg_file = folder / "tokenizer_config.json"
        if not cfg_file.is_file():
            return None
        tokenizer_config = read_json_object(cfg_file, "tokenizer config")
    return _pick_template(tokenizer_config.get("chat_template"), str(folder / "tokenizer_config.json"))
