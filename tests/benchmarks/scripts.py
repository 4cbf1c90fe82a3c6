"""Running the benchmark scripts as a user does: ``python benchmarks/NAME.py ARGS`` from the repository root."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def run_script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME ARGS`` from the repository root; its completed process (text output)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The single line a script printed on stderr for a user error (asserting it is one line, no traceback)."""
    lines = [line for line in r.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.lstrip().startswith("warn")]
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    return lines[0]
