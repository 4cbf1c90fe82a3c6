import pytest

from tests.benchmarks.scripts import BENCHMARKS


@pytest.fixture
def bench_modules(monkeypatch):
    """``benchmarks/`` on ``sys.path``, so its scripts import as modules."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
