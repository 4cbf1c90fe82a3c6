"""The Python heap of a running engine (``engine/heap.py``): frozen after warm-up so that full collections skip it,
every collection timed into the engine's stats, a long pause logged."""
from __future__ import annotations

import gc
import logging

import pytest

from pegainfer.engine import heap


@pytest.fixture
def unfrozen():
    """Leave the process's heap as the test found it."""
    yield
    gc.unfreeze()


class Cycle:
    def __init__(self):
        self.me = self


def test_freeze_moves_the_live_objects_out_of_collections(unfrozen):
    kept = [Cycle() for _ in range(1000)]
    done = heap.freeze()
    assert done["objects"] == gc.get_freeze_count() >= 1000
    assert not any(o is kept[0] for o in gc.get_objects())      # frozen objects are no generation's
    later = Cycle()
    assert any(o is later for o in gc.get_objects())            # objects made afterwards still are
    assert done["full_collect_s"] >= 0 and done["after_s"] >= 0


def test_every_collection_is_timed_and_a_long_one_logged(caplog):
    now = [0.0]
    pauses = heap.GcPauses(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="pegainfer.engine"):
        pauses.callback("start", {"generation": 0})
        now[0] += 0.001
        pauses.callback("stop", {"generation": 0, "collected": 3})
        pauses.callback("start", {"generation": 2})
        now[0] += 0.5
        pauses.callback("stop", {"generation": 2, "collected": 40})
    assert pauses.seconds == pytest.approx(0.501) and pauses.longest_s == pytest.approx(0.5)
    assert pauses.full_collections == 1
    slow = [r.getMessage() for r in caplog.records]
    assert len(slow) == 1 and "generation 2" in slow[0] and "500 ms" in slow[0] and "40 objects" in slow[0]


def test_a_loaded_engine_froze_its_heap_and_counts_full_collections(unfrozen):
    from pegainfer.demo import ensure_demo_model
    from pegainfer.engine.engine import Engine
    engine = Engine.from_folder(str(ensure_demo_model()), max_model_len=64, max_batch=2, use_cuda_graph=False)
    assert gc.get_freeze_count() > 0
    assert engine.gc_pauses is heap.GcPauses.install()
    before = engine.stats()
    gc.collect()
    after = engine.stats()
    assert after["gc_full_collections"] == before["gc_full_collections"] + 1
    assert after["gc_pause_seconds"] > before["gc_pause_seconds"]
    assert 0 < after["gc_longest_pause_seconds"] <= after["gc_pause_seconds"]
