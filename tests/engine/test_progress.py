"""Start-up progress (``pegainfer.engine.progress``): a status line only on a terminal, kernel launches counted
through the launch wrapper, kernel compilations counted from numba-cuda's compiler events (a cache load, which
runs no compiler pass, is not counted), and the two log lines of a first start."""
import io
import logging

import numpy as np
import pytest

import pegainfer  # noqa: F401  (before numba)
from numba import cuda
from numba.cuda.core import event

from pegainfer.engine import progress
from pegainfer.kernels.launch import launch, traced


class Terminal(io.StringIO):
    def isatty(self):
        return True


@cuda.jit
def add_one(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] += 1


def test_status_line_draws_only_on_a_terminal():
    pipe = io.StringIO()
    line = progress.StatusLine(pipe, show_after_s=0)
    line.show("working")
    line.clear()
    assert pipe.getvalue() == ""
    term = Terminal()
    line = progress.StatusLine(term, show_after_s=0)
    line.show("working: 3 kernels")
    assert term.getvalue() == "\r[pegainfer] working: 3 kernels\033[K"
    line.clear()
    assert term.getvalue().endswith("\r\033[K") and not line.shown
    late = progress.StatusLine(Terminal(), show_after_s=60)   # a short wait prints nothing
    late.show("quick")
    assert late.stream.getvalue() == ""


def test_launch_counter_counts_launches_until_closed():
    x = cuda.to_device(np.zeros(8, np.float32))
    seen = []
    with progress.LaunchCounter() as counter:
        counter.on_launch = lambda: seen.append(counter.count)
        for _ in range(3):
            launch(add_one, 1, 8, x)
        names = []
        with traced(lambda name: names.append(name) or progress._OneLaunch(progress.LaunchCounter())):
            launch(add_one, 1, 8, x, name="inner")     # another tracer in between: not counted here
        launch(add_one, 1, 8, x)
    launch(add_one, 1, 8, x)                             # closed: not counted
    assert counter.count == 4 and seen == [1, 2, 3, 4] and names == ["inner"]
    np.testing.assert_array_equal(x.copy_to_host(), np.full(8, 6, np.float32))


def _compile(passes: bool, nested: bool = False):
    """The events numba-cuda fires for one kernel: its compiler lock held, with passes when it compiles (device
    functions compiled inside take the lock again), without when the kernel comes from the disk cache."""
    event.start_event("numba-cuda:compiler_lock")
    if nested:
        event.start_event("numba-cuda:compiler_lock")
        event.start_event("numba-cuda:run_pass", data={"name": "device function"})
        event.end_event("numba-cuda:run_pass")
        event.end_event("numba-cuda:compiler_lock")
    if passes:
        event.start_event("numba-cuda:run_pass", data={"name": "kernel"})
        event.end_event("numba-cuda:run_pass")
    event.end_event("numba-cuda:compiler_lock")


def test_compile_counter_counts_compiled_kernels_not_cache_loads():
    firsts = []
    with progress.CompileCounter(on_first=lambda: firsts.append(1)) as counter:
        _compile(passes=False)               # loaded from the cache
        assert counter.compiled == 0 and not firsts
        _compile(passes=True, nested=True)   # one kernel with a device function
        _compile(passes=True)
    _compile(passes=True)                    # after the counter is gone
    assert counter.compiled == 2 and firsts == [1]


def test_warmup_progress_on_a_first_start(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    term = Terminal()
    with caplog.at_level(logging.INFO, logger="pegainfer.engine"):
        with progress.WarmupProgress(2, stream=term) as warm:
            warm.line.show_after_s = 0
            warm.phase("a 2-token prompt")
            with warm.step():
                _compile(passes=True)
                _compile(passes=True)
            warm.line._last_draw = 0
            warm.phase("capturing the CUDA graphs")
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2, logged
    assert logged[0].startswith("compiling the GPU kernels (first start only") and str(tmp_path) in logged[0]
    assert "NUMBA_CACHE_DIR" in logged[0]
    assert logged[1].startswith("compiled 2 kernels (warm-up took")
    assert warm.step_launches == [0]
    assert "warming up (2/2: capturing the CUDA graphs): 0 kernel launches, 2 kernels compiled" in term.getvalue()
    assert term.getvalue().endswith("\r\033[K")          # the line is erased at the end


def test_warmup_progress_is_silent_when_nothing_compiles(caplog):
    pipe = io.StringIO()
    with caplog.at_level(logging.INFO, logger="pegainfer.engine"):
        with progress.WarmupProgress(1, stream=pipe) as warm:
            warm.phase("a 2-token prompt")
            _compile(passes=False)
    assert not caplog.records and pipe.getvalue() == ""


@pytest.mark.parametrize("tty", [True, False])
def test_prefill_progress_counts_against_the_warmup_prefill(tty):
    stream = Terminal() if tty else io.StringIO()
    x = cuda.to_device(np.zeros(4, np.float32))
    with progress.PrefillProgress(7, total_launches=3, stream=stream) as prefill:
        prefill.line.show_after_s = 0
        for _ in range(2):
            prefill.line._last_draw = 0
            launch(add_one, 1, 4, x)
        prefill.close()                   # the first token
        launch(add_one, 1, 4, x)
    if tty:
        assert "prefill of 7 tokens: kernel 2/3" in stream.getvalue() and prefill.launches.count == 2
        assert stream.getvalue().endswith("\r\033[K")
    else:
        assert stream.getvalue() == "" and prefill.launches.count == 0   # not even counted


def test_kernel_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert progress.kernel_cache_folder() == str(tmp_path)
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    assert "pycache" in progress.kernel_cache_folder() or ".cache" in progress.kernel_cache_folder()
