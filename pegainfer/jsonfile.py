"""Reading a model folder's JSON files with one-line errors (``config.json``, ``generation_config.json``, the
safetensors index).  Used by the loader (``config.py``, ``weights.py``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pegainfer.errors import ModelFolderError


def read_json(path: Path, what: str = "") -> Any:
    """Parse a JSON file, turning every failure into a one-line ``ModelFolderError`` that names the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelFolderError(f"{path.name} not found in {path.parent}{what}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"cannot read {path}: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFolderError(f"{path.name} in {path.parent} is not valid JSON (line {e.lineno} column {e.colno}: "
                               f"{e.msg}): fix or re-download the file") from None
