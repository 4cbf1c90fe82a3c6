"""Hugging Face oracle: tiny random Qwen3 models written by transformers (CPU torch); pegainfer loads the same
folder and must give the same logits (every prompt position and 8 greedy decode steps) and the same greedy tokens.

The tiny config sets every field the loader reads to a value other than its default (``rope_theta``,
``rms_norm_eps``, ``head_dim`` ≠ hidden / heads, an eos list, tied and untied heads) and the norms random weights,
so code that ignored a configured value would not match.  The oracles are HF's bf16 forward (whose rounding points
pegainfer follows) and HF's float32 forward of the same bf16 weights: at every position pegainfer must be at most
``RATIO`` times as far from float32 as HF's own bf16 is (and the first position, which attention does not mix, bit
for bit equal to HF bf16).  Batching, padding, mixed steps and the launch contract are checked on the tied model
only: tied and untied differ in which weight the LM head reads, not in those paths (the same kernels launch)."""
import shutil

import numpy as np
import pytest
import torch
import transformers

from tests.util import assert_pdl_contract, greedy_decode, launches_during, rel_l2

PROMPT_LEN = 13               # + 8 decode steps crosses the 16-token KV page boundary
DECODE_STEPS = 8
RATIO = 1.5                   # per position; measured ≤ 1.25 (ours vs f32 over HF bf16 vs f32)
MEAN_RATIO = 1.15             # over all positions; measured ≈ 1.0
VOCAB = 576


def _write_tiny_qwen3(folder, tie: bool, seed: int = 0):
    from pegainfer.demo import ensure_demo_model

    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=1e6,
        tie_word_embeddings=tie, initializer_range=0.1, bos_token_id=None, eos_token_id=[0, 5])
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:           # random (not all-ones) norm weights so the norms are really checked
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(folder)
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, folder / name)
    f32 = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    bf16 = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    return bf16, f32


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """``tiny_models(tie)``: the HF references (bf16, f32) and pegainfer's engine of the tied or untied tiny model,
    each built once for the module."""
    from pegainfer.engine.engine import Engine

    built = {}

    def get(tie: bool):
        if tie not in built:
            folder = tmp_path_factory.mktemp(f"qwen3_{tie}")
            bf16, f32 = _write_tiny_qwen3(folder, tie=tie)
            engine = Engine.from_folder(str(folder), max_model_len=64, max_batch=2, use_cuda_graph=False)
            built[tie] = (bf16, f32), engine
        return built[tie]
    return get


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def tiny(request, tiny_models):
    """Both heads: for the loader and the logits, where tied and untied differ (which weight the LM head reads)."""
    return tiny_models(request.param)


@pytest.fixture
def tied(tiny_models):
    """The tied model alone: for batching, padding, mixed steps and the launch contract, which do not depend on
    which weight the LM head reads (the same kernels launch for both heads; the logits tests hold both to HF)."""
    return tiny_models(True)


def _prompt(seed=7):
    return np.random.default_rng(seed).integers(0, VOCAB, size=PROMPT_LEN).tolist()


_rng = np.random.default_rng(1)
ALONE_PROMPTS = {15: _rng.integers(0, VOCAB, size=15).tolist(),      # 15 and 16 tokens: in 3 steps both decode
                 16: _rng.integers(0, VOCAB, size=16).tolist()}      # past position 16 (a second KV page)
ALONE_STEPS = 3


@pytest.fixture(scope="module")
def alone(tiny_models):
    """The greedy tokens of each ``ALONE_PROMPTS`` prompt decoded by itself on the tied model, computed once for the
    tests that compare sequences run together against their one-sequence runs."""
    _, engine = tiny_models(True)
    return {n: greedy_decode(engine, p, ALONE_STEPS, f"alone-{n}")[0] for n, p in ALONE_PROMPTS.items()}


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _assert_close_to_hf(ours, ids, refs, first_row_exact: bool):
    """Every row of ``ours`` (logits of ``ids``' positions) within ``RATIO`` of HF bf16's own distance to float32."""
    bf16, f32 = (_hf_logits(m, ids) for m in refs)
    ours_err = np.array([rel_l2(ours[t], f32[t]) for t in range(len(ours))])
    hf_err = np.array([rel_l2(bf16[t], f32[t]) for t in range(len(ours))])
    assert (ours_err <= RATIO * hf_err + 1e-4).all(), list(zip(ours_err.round(4), hf_err.round(4)))
    assert ours_err.mean() <= MEAN_RATIO * hf_err.mean() + 1e-4, (ours_err.mean(), hf_err.mean())
    if first_row_exact:
        assert np.array_equal(ours[0], bf16[0]), "position 0 (no attention mixing) differs from HF bf16"


def test_loader_reads_the_non_default_config(tiny):
    """Catches a loader that falls back to library defaults: the oracle config sets none of them."""
    _, engine = tiny
    cfg = engine.model.cfg
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.head_dim) == (1e6, 1e-5, 32)
    assert set(engine.eos_token_ids) == {0, 5}


def test_prompt_logits_match_hf(tiny):
    """Catches a wrong rounding point, norm, RoPE or attention detail in the prompt path (every position)."""
    refs, engine = tiny
    ids = _prompt()
    ours = engine.score(ids)
    assert ours.shape == (len(ids), VOCAB)
    _assert_close_to_hf(ours, ids, refs, first_row_exact=True)


def test_greedy_decode_matches_hf(tiny):
    """Catches a decode path (one token, paged KV across a page boundary) that drifts from the prompt path."""
    refs, engine = tiny
    ids = _prompt()
    tokens, step_logits = greedy_decode(engine, ids, DECODE_STEPS, "oracle")
    assert len(tokens) == DECODE_STEPS
    with torch.no_grad():
        hf_tokens = refs[0].generate(torch.tensor([ids]), max_new_tokens=DECODE_STEPS, do_sample=False,
                                     min_new_tokens=DECODE_STEPS)[0, len(ids):].tolist()
    assert tokens == hf_tokens
    full = ids + tokens[:-1]
    bf16, f32 = (_hf_logits(m, full)[len(ids) - 1:] for m in refs)
    ours_err = [rel_l2(step_logits[i], f32[i]) for i in range(DECODE_STEPS)]
    hf_err = [rel_l2(bf16[i], f32[i]) for i in range(DECODE_STEPS)]
    assert all(o <= RATIO * h + 1e-4 for o, h in zip(ours_err, hf_err)), list(zip(ours_err, hf_err))
    assert engine.stats()["kv_pages_used"] == 0 and engine.stats()["slots_used"] == 0


def test_batched_decode_matches_each_sequence_alone(tied, alone):
    """Catches a batched (B = 2) decode step that mixes rows, slots or positions: two prompts of different lengths
    decoded together, each across the 16-token page boundary, give each one's tokens of the one-sequence run (rows
    are independent, so exactly; the one-sequence run is held to HF by ``test_greedy_decode_matches_hf``).  Tied
    head only: how rows are batched does not depend on which weight the LM head reads."""
    from pegainfer.engine.types import SamplingParams

    _, engine = tied
    for n, p in ALONE_PROMPTS.items():
        engine.add_request(str(n), p, SamplingParams(max_tokens=ALONE_STEPS, temperature=0.0, ignore_eos=True))
    together = {n: [] for n in ALONE_PROMPTS}
    most_running = 0
    while engine.has_unfinished():
        most_running = max(most_running, len(engine.scheduler.running))
        for out in engine.step():
            together[int(out.request_id)].extend(out.new_token_ids)
    assert most_running == 2, "the two sequences never decoded in one step"
    assert together == alone
    assert engine.stats()["kv_pages_used"] == 0


def test_prompt_prefilled_beside_a_decode_matches_each_alone(tied, alone):
    """Catches a mixed step (one sequence's decode and another's prompt chunk in one forward pass) that mixes
    slots, positions or the attention of the two kinds of token: each stream equals its one-sequence run (the
    15-token prompt arrives once the 16-token one has its first token).  Tied head only: the mixed step does not
    depend on which weight the LM head reads."""
    from tests.util import streams_with_a_late_arrival

    _, engine = tied
    together, kinds = streams_with_a_late_arrival(engine, ALONE_PROMPTS[16], ALONE_PROMPTS[15], ALONE_STEPS, after=1)
    assert "mixed" in kinds, kinds
    assert together == {"first": alone[16], "second": alone[15]}
    assert engine.stats()["kv_pages_used"] == 0


def test_padded_decode_batch_gives_the_unpadded_tokens(tied):
    """Catches padding rows (slot -1) of a decode batch run at a captured graph's size that write K/V, read pages
    or shift the real rows: two sequences decoded as a batch of 4 give the tokens of the unpadded batch of 2.  Tied
    head only: padding does not depend on which weight the LM head reads."""
    from pegainfer.engine.types import SamplingParams

    _, engine = tied
    rng = np.random.default_rng(5)
    prompts = {"a": rng.integers(0, VOCAB, size=3).tolist(), "b": rng.integers(0, VOCAB, size=4).tolist()}
    runner, runs, decodes = engine.runner, [], []
    forward_and_sample = runner.forward_and_sample

    def recording(T, B, decode=False, num_decode=0, mixed=False):
        if decode:
            decodes[-1].append((T, B))
        return forward_and_sample(T, B, decode=decode, num_decode=num_decode, mixed=mixed)
    for sizes in (None, [1, 4]):
        runner.decode_sizes, runner.forward_and_sample = sizes, recording
        decodes.append([])
        try:
            for k, p in prompts.items():
                engine.add_request(k, p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            got = {k: [] for k in prompts}
            while engine.has_unfinished():
                for out in engine.step():
                    got[out.request_id].extend(out.new_token_ids)
        finally:
            runner.decode_sizes = None
            del runner.forward_and_sample
        runs.append(got)
    assert (2, 2) in decodes[0] and (4, 4) not in decodes[0], decodes[0]    # unpadded: the batch of two as it is
    assert (4, 4) in decodes[1] and (2, 2) not in decodes[1], decodes[1]    # padded: the same steps as 4 rows
    assert runs[0] == runs[1] and all(len(t) == 3 for t in runs[0].values())
    assert engine.stats()["kv_pages_used"] == 0


def test_every_step_launch_keeps_the_pdl_contract(tied):
    """Catches a kernel launched outside the PDL contract, or one that never waits for its inputs (it would race
    with the kernel before it on a GPU): prefill and decode.  Tied head only: the untied model launches the same
    kernels in the same order (one LM-head GEMV reading another weight)."""
    _, engine = tied
    assert_pdl_contract(launches_during(lambda: greedy_decode(engine, _prompt(), 2, "pdl")))


def _mixed_streams(engine, prompts, steps):
    """Greedy streams (``steps`` tokens each, with the chosen token's logprob and top 3) of ``prompts``, each added
    one step after the one before, so later prompts are prefilled beside earlier ones' decodes.  Returns
    ({name: [(token, logprob, top), ...]}, the kinds of the steps run)."""
    from pegainfer.engine.types import SamplingParams

    kinds, schedule = [], engine.scheduler.schedule

    def recording():
        sched = schedule()
        if sched is not None:
            kinds.append(sched.kind)
        return sched
    engine.scheduler.schedule = recording
    got = {k: [] for k in prompts}
    try:
        for k, p in prompts.items():
            engine.add_request(k, p, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=3))
            for out in engine.step():
                got[out.request_id] += [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
    finally:
        engine.scheduler.schedule = schedule
    return got, kinds


def test_padded_mixed_step_gives_the_unpadded_tokens_and_logits(tied):
    """Catches padding of a mixed step (decode rows, chunk tokens and chunk rows with slot -1, as its CUDA graph
    replays it) that writes K/V, shifts the real rows or mixes up which logits row is whose: a decode padded from 1
    to 4 rows beside a 6-token chunk padded to 16 tokens and its row to the 12 rows left (of 16) gives the unpadded
    step's tokens and logprobs (top 3).
    Tied head only: padding does not depend on which weight the LM head reads."""
    _, engine = tied
    rng = np.random.default_rng(3)
    prompts = {"first": rng.integers(0, VOCAB, size=5).tolist(), "second": rng.integers(0, VOCAB, size=6).tolist()}
    runner, runs, shapes = engine.runner, [], []
    forward_and_sample = runner.forward_and_sample

    def recording(T, B, decode=False, num_decode=0, mixed=False):
        shapes.append((T, B, num_decode))
        return forward_and_sample(T, B, decode=decode, num_decode=num_decode, mixed=mixed)
    for pad in (False, True):
        runner.pad_mixed, runner.decode_sizes, runner.forward_and_sample = pad, [4] if pad else None, recording
        runner.mixed_decode_rows = lambda decodes: 4 if pad else decodes
        try:
            runs.append(_mixed_streams(engine, prompts, 3))
        finally:
            runner.pad_mixed, runner.decode_sizes = False, None
            del runner.forward_and_sample, runner.mixed_decode_rows
    (plain, kinds), (padded, padded_kinds) = runs
    assert "mixed" in kinds and kinds == padded_kinds, (kinds, padded_kinds)
    assert (1 + 6, 2, 1) in shapes and (4 + 16, 4 + 12, 4) in shapes, shapes   # the mixed step, unpadded and padded
    assert all(len(t) == 3 for t in plain.values())
    for k in prompts:
        assert [t for t, _, _ in padded[k]] == [t for t, _, _ in plain[k]], k
        for (_, lp, top), (_, lp0, top0) in zip(padded[k], plain[k]):
            assert [i for i, _ in top] == [i for i, _ in top0] and abs(lp - lp0) < 1e-2, (k, top, top0)
            assert np.allclose([v for _, v in top], [v for _, v in top0], atol=1e-2), (k, top, top0)
    assert engine.stats()["kv_pages_used"] == 0
