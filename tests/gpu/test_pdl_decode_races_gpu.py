"""Races of programmatic dependent launch inside the real decode graph, on a GPU: the shallow Qwen3-4B-width model
(``shallow_models``) decodes 200 steps at batch 1 and at batch 8 through its CUDA graphs, once with the default
launch policy (``PDL_DEFAULT``: weights and the slot/position/block-table reads issued before each kernel's wait,
the release points of ``docs/perf/launch.md``) and once with every launch serialized, and every step's logits must
be the same bits.  A kernel that reads a buffer the kernel before it writes ahead of its ``griddepcontrol.wait``, or
a release point that lets a reader in before its input is written, gives different bits in some step (a race need
not show in one step: hence 200, each after a real writer).  Skipped without a GPU.

The serialized policy keeps PDL on for ``gemv_preloaded`` alone: the preloaded o projection exists only as an
overlapping launch (``linear.linear_preloaded`` falls back to another GEMV without it), so with it both runs launch
the very same kernels and only their overlap differs; every other launch waits for the one before to complete."""
import dataclasses

import numpy as np
import pytest

from tests.gpu.shallow_models import SHALLOW_QWEN3_4B, make_shallow_qwen3, models_root

pytestmark = pytest.mark.gpu

STEPS = 200
BATCH_8_PROMPTS = (5, 17, 40, 64, 100, 300, 513, 1000)   # decode attention of one to several splits


def _serialized_policy():
    from pegainfer.kernels.policy import LaunchPolicy
    return dataclasses.replace(LaunchPolicy.from_options(pdl=False), pdl=frozenset({"gemv_preloaded"}))


def _engine(folder, policy):
    from pegainfer.engine.engine import Engine

    engine = Engine.from_folder(str(folder), max_model_len=1536, max_batch=8, max_num_batched_tokens=512,
                                policy=policy, use_cuda_graph=True)
    assert engine.runner.graphs is not None
    engine.runner.keep_logits = True        # logits_host reads a step's rows also while the next one runs ahead
    return engine


def _run(engine, prompts):
    """Decode ``STEPS`` tokens for each prompt at once (greedy and seeded sampling alternating), through the engine
    with async scheduling and CUDA graphs: per ``step()`` call, (the tokens it returned, its logits rows as bf16
    bits)."""
    from pegainfer.engine.types import SamplingParams
    from pegainfer.kernels.primitives import to_bf16_bits

    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.8,
                                top_p=0.95, seed=i)
        engine.add_request(f"r{i}", p, params)
    record = []
    while engine.has_unfinished():
        outs = [(o.request_id, tuple(o.new_token_ids)) for o in engine.step() if o.new_token_ids]
        if outs:
            record.append((outs, to_bf16_bits(engine.runner.logits_host(len(outs)))))
    assert sum(len(t) for outs, _ in record for _, t in outs) == STEPS * len(prompts)
    assert engine.stats()["kv_pages_used"] == 0
    return record


def _first_difference(a, b):
    """None when both runs gave the same tokens and logits bits at every step, else what differs first."""
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} steps"
    for k, ((outs_a, bits_a), (outs_b, bits_b)) in enumerate(zip(a, b)):
        if outs_a != outs_b:
            return f"step {k}: tokens {outs_a} vs {outs_b}"
        if not np.array_equal(bits_a, bits_b):
            from tests.util import from_bf16_bits
            diff = np.abs(from_bf16_bits(bits_a).astype(np.float64) - from_bf16_bits(bits_b))
            return (f"step {k}: {int(np.sum(bits_a != bits_b))} of {bits_a.size} logits differ "
                    f"(max |diff| {diff.max():.4g}, rows {sorted(set(np.nonzero(bits_a != bits_b)[0].tolist()))})")
    return None


PROMPTS = {1: (300,), 8: BATCH_8_PROMPTS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(policy, batch): the run's record}: one engine per policy, running the batch-1 then the batch-8 prompts."""
    from pegainfer.kernels.launch import can_overlap
    from pegainfer.kernels.policy import LaunchPolicy

    if not can_overlap():
        pytest.skip("PDL needs sm_90")
    folder = make_shallow_qwen3(models_root(tmp_path_factory) / "qwen3-4b-width-3-layers", SHALLOW_QWEN3_4B)
    out = {}
    for name, policy in (("overlapped", LaunchPolicy.from_options()), ("serialized", _serialized_policy())):
        engine = _engine(folder, policy)
        for batch, lengths in PROMPTS.items():
            prompts = [np.random.default_rng(100 + i).integers(0, 150000, size=n).tolist()
                       for i, n in enumerate(lengths)]
            out[name, batch] = _run(engine, prompts)
        del engine
    return out


@pytest.mark.parametrize("batch", [1, 8])
def test_pdl_decode_graph_gives_the_bits_of_serialized_launches(runs, batch):
    """Catches an early read before ``griddepcontrol.wait`` of a buffer the previous kernel writes, or a release
    point too early, in any kernel of the decode graph (batch 1: the GEMVs, the preloaded o, decode attention of one
    split; batch 8: the multi-token GEMVs / skinny GEMMs, split-K attention) over 200 steps with a real writer
    before every kernel."""
    overlapped, serialized = runs["overlapped", batch], runs["serialized", batch]
    steps = len(overlapped)
    print(f"batch {batch}: {steps} engine steps, {sum(b.size for _, b in overlapped)} logits compared bit for bit")
    difference = _first_difference(overlapped, serialized)
    assert difference is None, f"batch {batch}, PDL (default policy) vs serialized launches: {difference}"
