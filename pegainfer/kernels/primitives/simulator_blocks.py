"""Simulator blocks on persistent threads, with a barrier the last thread to arrive releases (``patch_block_runner``).

Numba's simulator runs each CUDA thread of a block as a new Python thread and releases ``syncthreads`` from a
manager loop that polls every thread.  Starting 32 threads costs ~6 ms a block and a barrier round ~18 ms for one warp (the poller waits for the
GIL and the threads wait for the poller), and our emulated warp shuffles are two barriers each.  Here a block of n
threads runs on n threads kept from the block before of the same size, and a barrier is a condition the last
arriving thread releases: ~0.7 ms a block and ~0.4 ms a barrier round.

What a kernel computes is unchanged: every CUDA thread is still its own Python thread (``threading.current_thread()``
gives its ``threadIdx``, ``blockIdx`` and ``thread_id``), blocks run one after another, ``syncthreads`` (and its
``_count`` / ``_and`` / ``_or`` forms, which call it) waits for every thread of the block that has not returned, and
an exception in one thread aborts the others at their next barrier and is what the launch raises."""
from __future__ import annotations

import sys
import threading

import numpy as np


def patch_block_runner() -> None:
    """Replace ``BlockManager.run`` and ``BlockThread.syncthreads`` of Numba's simulator.  Idempotent."""
    from numba.cuda.simulator import kernel as simulated
    from numba.cuda.simulator.kernelapi import Dim3

    if getattr(simulated.BlockManager.run, "persistent_threads", False):
        return

    class Block:
        """One block's barrier: threads still running, threads waiting, rounds released, the first to fail."""

        def __init__(self, num_threads: int):
            self.cv = threading.Condition()
            self.live = num_threads
            self.waiting = 0
            self.rounds = 0
            self.failed = None

        def release(self) -> None:
            self.waiting = 0
            self.rounds += 1
            self.cv.notify_all()

    class Worker(simulated.BlockThread):
        """A thread that runs one CUDA thread of each block its crew is given."""

        def __init__(self, crew):          # not BlockThread.__init__: that one wants a block to start with
            threading.Thread.__init__(self, daemon=True)
            self.crew, self.exception, self.abort, self.debug = crew, None, False, False
            self.syncthreads_blocked = False

        def run(self):
            crew, seen = self.crew, 0
            while True:
                with crew.cv:
                    while crew.job == seen:
                        crew.cv.wait()
                    seen = crew.job
                block = self.block
                try:
                    self.fn()
                except BaseException as e:  # as upstream: the error names the thread and the block
                    where = "tid=%s ctaid=%s" % (list(self.threadIdx), list(self.blockIdx))
                    self.exception = (type(e)(f"{where}: {e}" if str(e) else where), sys.exc_info()[2])
                    with block.cv:
                        if block.failed is None:
                            block.failed = self
                            for other in crew.workers:
                                other.abort = True
                            block.cv.notify_all()
                finally:
                    with block.cv:
                        block.live -= 1
                        if block.live and block.waiting == block.live:
                            block.release()
                    with crew.cv:
                        crew.done += 1
                        if crew.done == len(crew.workers):
                            crew.cv.notify_all()

    class Crew:
        """``n`` workers and the job counter that starts them on a block."""

        def __init__(self, n: int):
            self.cv = threading.Condition()
            self.job = self.done = 0
            self.workers = [Worker(self) for _ in range(n)]
            for w in self.workers:
                w.start()

    crews: dict[int, Crew] = {}

    def syncthreads(self):
        block = self.block
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        with block.cv:
            round_ = block.rounds
            block.waiting += 1
            if block.waiting == block.live:
                block.release()
            else:
                while block.rounds == round_ and not self.abort:
                    block.cv.wait()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def run(self, grid_point, *args):
        points = list(np.ndindex(*self._block_dim))
        crew = crews.get(len(points)) or crews.setdefault(len(points), Crew(len(points)))
        block, dim, kernel = Block(len(points)), Dim3(*self._block_dim), self._f

        def fn():
            kernel(*args)
        for w, p in zip(crew.workers, points):
            w.block, w.fn, w._manager, w.exception, w.abort = block, fn, self, None, False
            w.blockIdx, w.threadIdx = Dim3(*grid_point), Dim3(*p)
            w.thread_id = p[0] + dim.x * (p[1] + dim.y * p[2])
        with crew.cv:
            crew.done = 0
            crew.job += 1
            crew.cv.notify_all()
            while crew.done < len(points):
                if block.failed is not None:       # the others stop at their next barrier; give them a moment
                    crew.cv.wait_for(lambda: crew.done == len(points), timeout=2.0)
                    break
                crew.cv.wait(0.1)
        if block.failed is not None:
            if crew.done < len(points):            # a thread still runs (it never reached a barrier): a new crew
                crews.pop(len(points), None)
            raise block.failed.exception[0].with_traceback(block.failed.exception[1])
        for w in crew.workers:                     # hold no launch's arrays until the next block of this size
            w.fn = w._manager = None

    run.persistent_threads = True
    simulated.BlockThread.syncthreads = syncthreads
    simulated.BlockManager.run = run
