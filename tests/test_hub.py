"""``--model-path`` as a Hugging Face Hub id (``pegainfer/hub.py``): read from the Hugging Face cache when the Hub is
out of reach, served under the id, and every failure one line that names the fix.  No test reaches the network: the
cache is built here, the Hub is turned off (``HF_HUB_OFFLINE``) or pointed at a closed port, and the Hub's own
answers (not found, gated, no such revision) are raised by a stand-in for ``snapshot_download``."""
import json
import os
import shutil
import subprocess
import sys

import pytest

huggingface_hub = pytest.importorskip("huggingface_hub")
from huggingface_hub import constants as hf_constants  # noqa: E402

from pegainfer import hub  # noqa: E402
from pegainfer.demo import ensure_demo_model  # noqa: E402
from pegainfer.errors import ModelFolderError  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path):
    """A Hugging Face cache holding the demo model as ``org/tiny`` at ``main`` = ``COMMIT`` (the layout
    ``snapshot_download`` writes: ``models--org--tiny/refs/main``, ``snapshots/<commit>/``)."""
    root = tmp_path / "hf-cache"
    repo = root / "models--org--tiny"
    shutil.copytree(ensure_demo_model(), repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root


def test_hub_ids_are_told_from_paths():
    for text in ("Qwen/Qwen3-4B", "org/tiny", "a.b/c_d-1.5"):
        assert hub.is_repo_id(text), text
    for text in ("./models/x", "../x", "~/models/x", "/abs/x", "x", "a/b/c", "org/..", "has space/x", "a/"):
        assert not hub.is_repo_id(text), text


def test_an_existing_folder_is_read_as_it_is(tmp_path, monkeypatch):
    """A local folder named like an id (``org/name`` under the working directory) wins over the Hub."""
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("fetched a local folder"))
    assert hub.local_folder("org/name") == hub.Path("org/name")
    assert hub.local_folder(tmp_path / "org" / "name") == tmp_path / "org" / "name"


def test_a_cached_snapshot_is_found_offline_and_with_the_hub_unreachable(cache, monkeypatch):
    snapshot = cache / "models--org--tiny" / "snapshots" / COMMIT
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert hub.local_folder("org/tiny", download_dir=cache) == snapshot
    assert hub.local_folder("org/tiny", revision=COMMIT, download_dir=cache) == snapshot
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "ENDPOINT", "http://127.0.0.1:9")    # nothing listens there
    assert hub.local_folder("org/tiny", download_dir=cache) == snapshot
    with pytest.raises(ModelFolderError) as e:
        hub.local_folder("org/absent", download_dir=cache)
    assert "not in the Hugging Face cache" in str(e.value) and "hf download org/absent --cache-dir" in str(e.value)


def test_a_snapshot_is_served_under_its_hub_id(cache):
    assert hub.model_name(cache / "models--org--tiny" / "snapshots" / COMMIT) == "org/tiny"
    assert hub.model_name(cache / "models--Qwen--Qwen3-4B" / "snapshots" / COMMIT) == "Qwen/Qwen3-4B"
    assert hub.model_name(cache.parent / "Qwen3-4B") == "Qwen3-4B"
    assert hub.model_name(cache / "somewhere" / "snapshots" / COMMIT) == COMMIT    # not a cache's layout


def _http_error(cls, status, **kw):
    import httpx2
    response = httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/x"))
    return cls(f"{status} Client Error", response=response, **kw)


@pytest.mark.parametrize("error, says", [
    ("RepositoryNotFoundError", "no model org/x on the Hugging Face Hub (a private one needs a login"),
    ("GatedRepoError", "org/x is gated on the Hugging Face Hub: accept its terms on https://huggingface.co/org/x"),
    ("RevisionNotFoundError", "org/x has no revision 'v9' on the Hugging Face Hub"),
    ("HfHubHTTPError", "could not fetch org/x from the Hugging Face Hub into the cache (500 Client Error)"),
    ("OSError", "could not fetch org/x from the Hugging Face Hub into the cache ([Errno 28] No space left on device)"),
])
def test_the_hubs_answers_are_one_line_that_names_the_fix(error, says, monkeypatch):
    from huggingface_hub import errors

    def refuse(*a, **k):
        if error == "OSError":
            raise OSError(28, "No space left on device")
        raise _http_error(getattr(errors, error), 500 if error == "HfHubHTTPError" else 404)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelFolderError) as e:
        hub.local_folder("org/x", revision="v9")
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: {}["no such key"])
    with pytest.raises(KeyError):
        hub.local_folder("org/x")


def test_revision_without_a_hub_id_is_refused(tmp_path):
    with pytest.raises(ModelFolderError, match="neither a folder nor a Hub id"):
        hub.local_folder(tmp_path / "absent", revision="main")


def _cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "pegainfer", *args], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **env))


def test_the_command_line_runs_a_cached_hub_id_offline_under_its_name(cache, tmp_path):
    """What a user types: ``--model-path org/tiny`` with the model in the cache and no network; ``bench`` reports
    the engine's model name, the Hub id (not the snapshot's commit)."""
    out = tmp_path / "bench.json"
    r = _cli("bench", "--model-path", "org/tiny", "--download-dir", str(cache), "--prompt-len", "4",
             "--output-len", "2", "--runs", "1", "--max-model-len", "32", "--json", str(out), HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(out.read_text())["model"] == "org/tiny"


def test_the_command_line_says_in_one_line_what_is_missing_offline(tmp_path):
    r = _cli("generate", "--model-path", "org/absent", "--download-dir", str(tmp_path), "--revision", "v2",
             HF_HUB_OFFLINE="1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    line, = r.stderr.strip().splitlines()
    assert line.startswith("error: no folder org/absent here, and org/absent at v2 is not in the Hugging Face "
                           "cache"), line
    assert f"hf download org/absent --revision v2 --cache-dir {tmp_path}" in line
