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


def test_launch_bounds_are_part_of_the_disk_cache_key(tmp_path):
    """numba keys its on-disk kernel cache on bytecode and closure only: two kernels that differ only in their
    launch bounds would load each other's binary.  ``launch_bounded`` adds the bounds to the key (numba's real CUDA
    target, which builds dispatchers without a GPU)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PEGAINFER_DEVICE="gpu")
    code = (
        "from types import SimpleNamespace\n"
        "from pegainfer.kernels.primitives.launch_shape import launch_bounded\n"
        "def body(a):\n"
        "    a[0] = 1\n"
        "codegen = SimpleNamespace(magic_tuple=lambda: ('sm_90',))\n"
        "keys = [launch_bounded(128, b)(body)._cache._index_key((), codegen) for b in (1, 3, 3)]\n"
        "assert keys[0] != keys[1] and keys[1] == keys[2], keys\n"
        "print('ok')\n")
    script = tmp_path / "bounded.py"          # numba caches only functions defined in a file
    script.write_text(code)
    env["PYTHONPATH"] = os.pathsep.join([str(MODULE.parents[2]), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stderr.strip().splitlines() or [r.stdout])[-1]
