"""Every overlapped (PDL) launch of the engine's steps waits before its first global write and reads before its wait
only what its kernel declares (``reads_before_wait``): ``tools/pdl_early_reads.py`` over the sm_90a code of the
kernels the real steps launch (Qwen3-4B and Qwen3.5-4B shapes, the latter also with its state in bf16; the default
launch policy).

The tool compiles with NVVM (``numba-cuda[cu13]``, in the ``test`` extra) and stands a fake H200 in for numba's GPU,
so it runs in a process of its own (this one runs the simulator): about 45 s on one core.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pegainfer.kernels.policy import PDL_DEFAULT
from pegainfer.kernels.primitives import kernel, reads_before_wait

ROOT = Path(__file__).resolve().parents[2]


def compiler_missing() -> str | None:
    """Why numba cannot compile PTX here (it needs the NVVM and NVRTC libraries), or None."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return "cuda.pathfinder is not installed"
    for lib in ("nvvm", "nvrtc"):
        try:
            load_nvidia_dynamic_lib(lib)
        except Exception:       # DynamicLibNotFoundError, or a library that does not load
            return f"lib{lib} not found"
    return None


@pytest.fixture(scope="module")
def overlapped() -> list[dict]:
    """The tool's ``--json`` result: one record per kernel variant an overlapped launch runs."""
    missing = compiler_missing()
    if missing:
        reason = f"compiling to PTX needs NVVM and NVRTC, {missing}: pip install 'numba-cuda[cu13]' (the test extra)"
        if os.environ.get("CI"):                # CI installs the test extra: a missing compiler is a broken install
            pytest.fail(reason)
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PEGAINFER_DEVICE"] = "gpu"
    run = subprocess.run([sys.executable, "tools/pdl_early_reads.py", "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode in (0, 1) and run.stdout.startswith("["), run.stderr[-4000:]
    return json.loads(run.stdout)


def where(o: dict) -> str:
    """The launch name, the kernel function and the steps that launch this variant of it."""
    return f"{o['label']} ({o['kernel'].split('.')[-1]}; {', '.join(o['cases'])})"


def test_every_overlapped_launch_is_analyzed(overlapped):
    """Catches a recording that no longer sees the overlapped launches (a launch renamed, or the recorder out of step
    with ``launch.py``), which would leave the checks below nothing to check."""
    assert {o["label"] for o in overlapped} == PDL_DEFAULT


def test_every_overlapped_kernel_waits(overlapped):
    """Catches an overlapped kernel whose ``grid_dependency_wait`` was deleted: all of it would run alongside the
    kernel before it."""
    bad = [where(o) for o in overlapped if not o["waits"]]
    if bad:
        pytest.fail("no griddepcontrol.wait:\n" + "\n".join(bad), pytrace=False)


def test_no_global_write_before_the_wait(overlapped):
    """Catches a global write that can run before the wait on some path of the compiled code (one moved above the
    wait, or a branch that skips it): the kernel before may still read or write that memory."""
    bad = [f"{where(o)}: {len(o['writes'])}, e.g. {o['writes'][:3]}" for o in overlapped if o["writes"]]
    if bad:
        pytest.fail("global writes before griddepcontrol.wait:\n" + "\n".join(bad), pytrace=False)


def test_reads_before_the_wait_are_declared(overlapped):
    """Catches a read moved before the wait of a buffer the kernel before may still be writing (an activation, or
    the residual of a launch that is not ``residual_ready``), or a kernel whose ``reads_before_wait`` no longer says
    what its code reads."""
    bad = [f"{where(o)}: reads {sorted(set(o['reads']) - set(o['declared']))}, declares {o['declared']}"
           for o in overlapped if set(o["reads"]) - set(o["declared"])]
    if bad:
        pytest.fail("read before griddepcontrol.wait, not declared (reads_before_wait):\n" + "\n".join(bad),
                    pytrace=False)


def test_declaring_an_argument_the_kernel_lacks_fails_at_once():
    """Catches a ``reads_before_wait`` that names no argument of its kernel (a typo, a parameter renamed since): it
    must fail where it is written, not only where NVVM can compile the kernel."""
    def copy(src, dst):
        dst[0] = src[0]

    assert reads_before_wait("src")(kernel(copy)).pdl_early_reads == {"src"}
    with pytest.raises(TypeError, match=r"copy has no argument \['w32'\]"):
        reads_before_wait("src", "w32")(kernel(copy))
