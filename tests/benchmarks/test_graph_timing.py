"""``benchmarks/graph_timing.py``: ``kernel_name`` finds a name in a kernel package or, when the package does not
re-export it, in one of its modules."""
import sys

import pytest


def test_kernel_name_looks_in_the_package_then_its_modules(bench_modules, tmp_path, monkeypatch):
    import graph_timing
    pkg = tmp_path / "fakekernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from fakekernels.gemv import linear\n")
    (pkg / "gemv.py").write_text("def linear(): return 'gemv'\ndef _geometry(): return 'private'\n")
    (pkg / "skinny.py").write_text("def geometry(): return 'public'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert graph_timing.kernel_name("fakekernels", "linear")() == "gemv"
        assert graph_timing.kernel_name("fakekernels", "geometry", "_geometry")() == "public"
        assert graph_timing.kernel_name("fakekernels", "_geometry")() == "private"
        with pytest.raises(AttributeError, match="fakekernels has none of nothing"):
            graph_timing.kernel_name("fakekernels", "nothing")
    finally:
        for name in [m for m in sys.modules if m == "fakekernels" or m.startswith("fakekernels.")]:
            del sys.modules[name]
