"""A model named by its Hugging Face Hub id (``Qwen/Qwen3-4B``) where a folder is asked for.

``--model-path`` (and ``Engine.from_folder``) takes a local folder, or a Hub id that names no local folder: the
model's files are then fetched into the Hugging Face cache (``huggingface_hub.snapshot_download``, the library
``tokenizers`` already installs; ``HF_HOME`` / ``HF_HUB_CACHE`` / ``HF_TOKEN`` / ``HF_HUB_OFFLINE`` /
``HF_ENDPOINT`` as everywhere else) and read from there.  A second run finds them cached and, offline, uses the
cache.  Only what pegainfer reads is fetched: the JSON files (config, generation config, tokenizer, weight index),
the ``*.safetensors`` weights and a ``*.jinja`` chat template; other weight formats in the repository are skipped.

The served name of a model read from the cache is its Hub id (``model_name``), as vLLM names it, not the snapshot
folder's commit hash.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from pegainfer.errors import ModelFolderError

# owner/name, each of letters, digits, '-', '_', '.' (the Hub's rule), not a relative path like ./x or ../x
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja"]
NETWORK_MODULES = ("huggingface_hub", "httpx", "httpx2", "httpcore", "requests", "urllib3")   # their errors: no bug


def is_repo_id(text: str) -> bool:
    """Whether ``text`` has the form of a Hub id (``owner/name``)."""
    return REPO_ID.fullmatch(text) is not None and ".." not in text


def local_folder(model_path: str | Path, revision: Optional[str] = None,
                 download_dir: Optional[str | Path] = None) -> Path:
    """The local folder of ``model_path``: the path itself when it exists (or is no Hub id: the folder checks then
    say what is wrong), else the Hub id's snapshot in the Hugging Face cache (``download_dir`` in place of the
    default cache), fetched first when it is not there.  ``revision``: a branch, tag or commit (default ``main``).
    Errors are one-line ``ModelFolderError``s that name the fix."""
    path = Path(model_path).expanduser()
    text = str(model_path)
    if path.exists() or not is_repo_id(text):
        if revision is not None and not path.exists():
            raise ModelFolderError(f"--revision {revision} names a revision on the Hugging Face Hub, but {text!r} "
                                   f"is neither a folder nor a Hub id (owner/name)")
        return path
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:  # pragma: no cover - tokenizers depends on it
        raise ModelFolderError(f"no folder {text} here, and huggingface_hub (to fetch it from the Hub) is not "
                               f"installed: pip install huggingface_hub, or pass a local folder") from None
    where = f" ({download_dir})" if download_dir is not None else ""
    fetch = f"hf download {text}" + (f" --revision {revision}" if revision else "") + \
        (f" --cache-dir {download_dir}" if download_dir is not None else "")
    try:
        return Path(snapshot_download(repo_id=text, revision=revision, cache_dir=download_dir,
                                      allow_patterns=MODEL_FILES))
    except GatedRepoError:
        raise ModelFolderError(f"{text} is gated on the Hugging Face Hub: accept its terms on https://huggingface.co/"
                               f"{text} and log in (`hf auth login`, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelFolderError(f"no folder {text} here and no model {text} on the Hugging Face Hub (a private one "
                               f"needs a login: `hf auth login`, or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelFolderError(f"{text} has no revision {revision!r} on the Hugging Face Hub: pass a branch, tag "
                               f"or commit it has (--revision)") from None
    except LocalEntryNotFoundError:
        raise ModelFolderError(f"no folder {text} here, and {text}{' at ' + revision if revision else ''} is not "
                               f"in the Hugging Face cache{where} while the Hub cannot be reached (offline, or "
                               f"HF_HUB_OFFLINE=1): fetch it where there is a network (`{fetch}`) "
                               f"or pass a local folder") from None
    except HFValidationError as e:
        raise ModelFolderError(f"no folder {text} here, and it is no valid Hugging Face Hub id ({e})") from None
    except Exception as e:  # noqa: BLE001 - the network's and the disk's errors, whatever the HTTP library's class
        if not (isinstance(e, OSError) or type(e).__module__.split(".")[0] in NETWORK_MODULES):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFolderError(f"could not fetch {text} from the Hugging Face Hub into the cache{where} ({first}): "
                               f"check the network and the disk, or pass a local folder") from None


def model_name(folder: Path) -> str:
    """The name a model is served under: the Hub id of a snapshot in the Hugging Face cache
    (``.../models--Qwen--Qwen3-4B/snapshots/<commit>`` → ``Qwen/Qwen3-4B``), else the folder's name."""
    folder = Path(folder)
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--") and repo.count("--") >= 2:
        return repo[len("models--"):].replace("--", "/", 1)
    return folder.name
