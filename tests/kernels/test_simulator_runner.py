"""The simulator's faster block runner and device calls (``pegainfer/kernels/primitives/simulator*.py``) keep the
simulator's semantics: every CUDA thread its own thread, ``syncthreads`` waiting for every thread of the block still
running, an exception in one thread raised by the launch (naming the thread) and the next launch unaffected, device
functions seeing the launch's fake ``cuda`` module.  Simulator only: on a GPU nothing here is patched."""
import threading

import numpy as np
import pytest

from pegainfer import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="the simulator's block runner (kernels run on the GPU here)")

if SIMULATOR:
    from numba import cuda

    import pegainfer.kernels.primitives  # noqa: F401  (applies the patches under test)

    @cuda.jit(device=True)
    def _lane_times_two(out, i):
        out[i] = 2 * cuda.threadIdx.x             # a device function reading the launch's thread index

    @cuda.jit
    def _shift_through_shared(out, early):
        """Each thread writes its index to shared memory, waits at a barrier, reads its right neighbour's; threads
        below ``early`` return before the barrier (the barrier must not wait for them)."""
        buf = cuda.shared.array(64, dtype=np.int32)
        t = cuda.threadIdx.x
        if t < early:
            out[cuda.blockIdx.x, t] = -1
            return
        buf[t] = t + 100 * cuda.blockIdx.x
        cuda.syncthreads()
        out[cuda.blockIdx.x, t] = buf[(t + 1) % cuda.blockDim.x] if (t + 1) % cuda.blockDim.x >= early else -2

    @cuda.jit
    def _fail_in_one_thread(out, bad):
        t = cuda.threadIdx.x
        if t == bad:
            raise ValueError("planted")
        cuda.syncthreads()
        out[t] = t

    @cuda.jit
    def _device_call(out):
        _lane_times_two(out, cuda.threadIdx.x)

    @cuda.jit
    def _thread_ids(out):
        out[cuda.threadIdx.x] = threading.get_ident()


def test_the_patches_are_applied():
    """Catches kernels simulated by upstream's runner after all (the speed-ups silently gone)."""
    from numba.cuda.simulator import kernel as simulated
    assert getattr(simulated.BlockManager.run, "persistent_threads", False)
    assert getattr(simulated.FakeCUDAKernel.__call__, "cheap_device_calls", False)


def test_barrier_waits_for_every_running_thread_and_skips_returned_ones():
    """Catches a barrier that releases before every running thread arrived (a neighbour's value not yet written),
    or waits for threads that returned (a hang): 3 blocks of 32 threads, the first 4 returning early."""
    out = cuda.to_device(np.zeros((3, 32), np.int32))
    _shift_through_shared[3, 32](out, 4)
    got = out.copy_to_host()
    want = np.array([[-1] * 4 + [(t + 1) % 32 + 100 * b if (t + 1) % 32 >= 4 else -2 for t in range(4, 32)]
                     for b in range(3)])
    np.testing.assert_array_equal(got, want)


def test_an_exception_in_one_thread_is_raised_and_the_next_launch_runs():
    """Catches a failing thread whose error is lost or hangs the block at its barrier, or a runner left broken for
    the next launch of the same block size."""
    out = cuda.to_device(np.zeros(32, np.int32))
    with pytest.raises(ValueError, match=r"tid=\[5, 0, 0\].*planted"):
        _fail_in_one_thread[1, 32](out, 5)
    _fail_in_one_thread[1, 32](out, -1)
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(32))


def test_device_functions_see_the_launch_and_threads_are_distinct():
    """Catches device calls that read another launch's (or no) thread index, and CUDA threads sharing one Python
    thread (which would make warp-level emulation wrong)."""
    out = cuda.to_device(np.zeros(16, np.int32))
    _device_call[1, 16](out)
    np.testing.assert_array_equal(out.copy_to_host(), 2 * np.arange(16))
    ids = cuda.to_device(np.zeros(16, np.int64))
    _thread_ids[1, 16](ids)
    assert len(set(ids.copy_to_host().tolist())) == 16
