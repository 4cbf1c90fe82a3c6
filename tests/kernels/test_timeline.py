"""``timeline``: the per-block stamps of the instrumented decode kernels (what ``benchmarks/step_timeline.py``
reads on a GPU).  In the simulator the clock is the host's, so only the records' shape and order are checked."""
import numpy as np
import pytest

from tests.util import bf16_randn, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels import linear as lin
from pegainfer.kernels import timeline
from pegainfer.kernels.policy import LaunchPolicy
from pegainfer.kernels.primitives import threads

STAMPING = LaunchPolicy(timeline=True)


@pytest.fixture
def fresh_records():
    timeline.reset()
    yield
    timeline.reset()


def _one_token_gemv(rng, n_out=40, k=64, policy=STAMPING):
    xb, x = bf16_randn((1, k), rng)
    wb, w = bf16_randn((n_out, k), rng, scale=0.1)
    out = cuda.to_device(np.zeros((1, n_out), np.uint16))
    lin.linear(cuda.to_device(xb), cuda.to_device(wb), out, policy=policy)
    return from_bf16_bits(out.copy_to_host()).astype(np.float64), x @ w.T


def test_gemv_blocks_append_ordered_records(fresh_records, rng):
    got, expected = _one_token_gemv(rng)
    assert rel_l2(got, expected) < 1e-2, "stamping must not change the result"
    rec = timeline.records()
    assert len(rec) > 0
    grid = int(rec["grid"][0])
    assert sorted(rec["block"].tolist()) == list(range(grid)), "one record per block"
    assert set(rec["kind"].tolist()) == {1} and set(rec["extra"].tolist()) == {40}
    assert np.all(rec["t_entry"] <= rec["t_wait"]) and np.all(rec["t_wait"] <= rec["t_ready"])
    assert np.all(rec["t_ready"] <= rec["t_end"])


def test_preloaded_gemv_records_its_kind(fresh_records, rng):
    K = 2 * threads(gpu=lin.PRELOAD_THREADS, sim=32)
    xb, x = bf16_randn((1, K), rng)
    wb, w = bf16_randn((40, K), rng, scale=0.1)
    out = cuda.to_device(np.zeros((1, 40), np.uint16))
    lin.linear_preloaded(cuda.to_device(xb), cuda.to_device(wb), out, policy=STAMPING)
    assert rel_l2(from_bf16_bits(out.copy_to_host()), x @ w.T) < 1e-2
    rec = timeline.records()
    assert set(rec["kind"].tolist()) == {3} and len(rec) == int(rec["grid"][0])
    assert np.all(rec["t_entry"] <= rec["t_end"])


def test_nothing_recorded_when_off(fresh_records, rng):
    _one_token_gemv(rng, policy=LaunchPolicy())
    assert len(timeline.records()) == 0


def _records(rows):
    """Timeline records from ``(t_entry, t_wait, t_ready, t_end, kind, block, grid, extra)`` tuples (ns)."""
    dtype = [("t_entry", np.int64), ("t_wait", np.int64), ("t_ready", np.int64), ("t_end", np.int64),
             ("kind", np.int32), ("block", np.int32), ("grid", np.int32), ("sm", np.int32), ("extra", np.int64)]
    return np.array([(e, w, r, d, k, b, g, 0, x) for e, w, r, d, k, b, g, x in rows], dtype=dtype)


def test_step_timeline_moments_from_saved_records(tmp_path, monkeypatch, capsys):
    """``benchmarks/step_timeline.py``: each kernel's moments after the previous kernel's last block end (medians
    over its launches), its walls, and ``--load`` printing both tables from saved records without a GPU."""
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    import step_timeline
    base = 10**18                       # globaltimer-sized values: differences must stay exact
    rows = []
    for layer in range(2):
        t = base + layer * 100_000
        rows += [(t, t + 100, t + 200, t + 1_000, 1, b, 2, 64) for b in range(2)]             # a GEMV ends at +1 µs
        rows += [(t + 500, t + 1_700, t + 2_000, t + 3_000 + 500 * b, 5, b, 2, 0) for b in range(2)]  # attention
    rec = _records(rows)
    table = step_timeline.moments(rec)
    att = table["attentionx2"]
    assert (att["enter"], att["wait"], att["ready"]) == (-0.5, 0.7, 1.0)
    assert (att["end_first"], att["end"], att["end_last"]) == (2.0, 2.25, 2.5)
    walls = [r["wall"] for r in step_timeline.summarize(rec) if r["label"] == "attentionx2"]
    assert walls == [2.5, 2.5]
    path = tmp_path / "t.npy"
    np.save(path, rec)
    assert step_timeline.main(["--load", str(path)]) == 0
    out = capsys.readouterr().out
    assert "attentionx2" in out and "end_last" in out


def test_gated_delta_decode_step_records(rng):
    """The Gated DeltaNet decode step under a policy with ``timeline`` (kind ``gdn_step``): one record per block,
    ordered stamps, the same bits as without stamping."""
    from pegainfer.kernels.policy import LaunchPolicy
    from tests.kernels.gated_delta_helpers import (assert_fused_equals_three_kernels, decode_inputs,
                                                   make_decode_layer, table_of)
    layer = make_decode_layer(rng)
    num_slots, taps = 3, 4
    conv_dim = layer["conv_w"].shape[0]
    ring = bf16_randn((num_slots, conv_dim, taps), rng)[0]
    state = (rng.standard_normal((num_slots, layer["num_v_heads"], 16, 16)) * 0.3).astype(np.float32)
    slots = [2, 0]
    positions = cuda.to_device(np.array([5, 1], np.int32))
    timeline.reset()
    try:
        assert_fused_equals_three_kernels(layer, ring, state, decode_inputs(rng, layer, 2), table_of(slots, 2),
                                          positions, decode_slots=slots, policy=LaunchPolicy(timeline=True))
        rec = timeline.records()
    finally:
        timeline.reset()
    rec = rec[rec["kind"] == 6]
    assert len(rec) == int(rec["grid"][0]) > 0, "one record per block of the decode step"
    assert sorted(rec["block"].tolist()) == list(range(len(rec)))
    assert np.all(rec["t_entry"] <= rec["t_wait"]) and np.all(rec["t_wait"] <= rec["t_ready"])
    assert np.all(rec["t_ready"] <= rec["t_end"])
