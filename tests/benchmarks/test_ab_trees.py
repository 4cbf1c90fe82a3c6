"""``benchmarks/ab_trees.sh``: a command runs in a commit's tree and in the working tree, each importing its own
``pegainfer`` (the working tree's ahead on PYTHONPATH must not leak into the base runs)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ab_trees.sh"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_each_tree_imports_its_own_pegainfer(tmp_path):
    env = {**os.environ, "AB_BASE": str(tmp_path / "base"), "OUT": str(tmp_path / "out"),
           "PYTHONPATH": f"{tmp_path / 'wheels'}:{ROOT}"}   # a wheel folder, then the working tree: as on the GPU
    (tmp_path / "wheels").mkdir()
    subprocess.run(["bash", str(SCRIPT), "prepare", "HEAD"], check=True, env=env, capture_output=True)
    assert (tmp_path / "base" / "pegainfer" / "__init__.py").exists()
    probe = "import os, pegainfer, sys; print(os.path.dirname(os.path.dirname(pegainfer.__file__))); print(sys.argv[1])"
    run = subprocess.run(["bash", str(SCRIPT), "run", "2", "--", sys.executable, "-c", probe, "{out}.json"],
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    for tree, root in (("base", tmp_path / "base"), ("work", ROOT)):
        for r in (1, 2):
            lines = (tmp_path / "out" / f"ab_{tree}_{r}.log").read_text().split()
            assert lines == [str(root), str(tmp_path / "out" / f"ab_{tree}_{r}.json")], (tree, r, lines)


def test_run_without_a_prepared_base_says_what_to_do(tmp_path):
    env = {**os.environ, "AB_BASE": str(tmp_path / "none"), "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", str(SCRIPT), "run", "1", "--", "true"], env=env, capture_output=True, text=True)
    assert run.returncode == 2 and "prepare REV" in run.stderr
