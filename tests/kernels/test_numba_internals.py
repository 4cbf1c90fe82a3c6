"""The numba-cuda internals the launch wrapper uses still exist (``pegainfer/kernels/numba_internals.py``)."""
import os
import subprocess
import sys
from pathlib import Path

MODULE = Path(__file__).resolve().parents[2] / "pegainfer" / "kernels" / "numba_internals.py"


def test_numba_cuda_has_the_internals_pegainfer_launches_through():
    """Catches a numba-cuda upgrade that renames or removes ``_compile_for_args``, ``_prepare_args``,
    ``_Kernel.library`` or ``_to_core_stream``: the check runs with numba's real CUDA target (not the simulator,
    which has none of them), which imports without a GPU."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    code = f"import runpy; m = runpy.run_path({str(MODULE)!r}); print(m['missing']()); m['check']()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.stdout
    assert r.stdout.strip() == "[]"
