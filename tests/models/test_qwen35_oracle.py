"""Hugging Face oracle for Qwen3.5: tiny random ``Qwen3_5ForCausalLM`` (Gated DeltaNet, gated full attention,
Gated DeltaNet layers) written by transformers on CPU; pegainfer loads the same folder and must give the same logits at
every prompt position and over 8 greedy decode steps (relative L2 < 2e-2) and the same greedy tokens, for prompts
shorter and longer than one chunk of the chunked delta rule, with two sequences decoding in one batch.

The model is driven directly (``StepBuffers`` + ``PagePool`` + ``forward``, greedy argmax on the host), the way the
engine's runner drives it: a prompt is prefilled as one step with one logits row (the chunked form), scored with a
logits row per token (the token-by-token form), then decoded one token per sequence per step.
"""
import json

import numpy as np
import pytest

from tests.util import rel_l2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DECODE_STEPS = 8
CHUNK = 8                     # the chunked form's chunk for these tests (the model's default is 64)
PROMPT_LENGTHS = (5, 13)      # shorter than one chunk; longer than one (a full chunk and a partial one)
VOCAB = 320
PAGE_SIZE = 16


def _write_tiny_qwen35(folder, multimodal: bool, seed: int = 10):
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],  # both kinds, two state layers
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=not multimodal, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None)  # no eos: HF's generate would mask it (min_new_tokens) where our argmax would not
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):   # plain weight (init ones): random around one
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:                            # (1 + w) norms (init zeros): random offsets
                p.copy_(0.2 * torch.randn_like(p))
    model.to(torch.bfloat16)
    if multimodal:
        _save_as_conditional_generation(model, cfg, folder)
    else:
        model.save_pretrained(folder)
    # The oracle is HF's bf16 forward, whose rounding points pegainfer follows (it agrees to ~0.3% here).  Not
    # float32: this random tiny model amplifies bf16 rounding, so HF's own bf16 and f32 logits differ by up to ~8%.
    return model.eval()


def _save_as_conditional_generation(model, text_cfg, folder):
    """The Qwen3_5ForConditionalGeneration layout: text config nested under ``text_config``, decoder tensors under
    ``model.language_model.``, a (here: dummy) vision tower that pegainfer must ignore."""
    from safetensors.torch import save_file

    tensors = {}
    for name, t in model.state_dict().items():
        key = "model.language_model." + name[len("model."):] if name.startswith("model.") else name
        tensors[key] = t.contiguous()
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2, 2, dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    text = text_cfg.to_dict()
    text["model_type"] = "qwen3_5_text"
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": text, "vision_config": {"depth": 1, "hidden_size": 8},
              "tie_word_embeddings": text_cfg.tie_word_embeddings, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))


class Driver:
    """Loads the folder into a ``Qwen35Model`` and runs steps the way the engine's runner does."""

    def __init__(self, folder, max_model_len=64, max_tokens=32, max_rows=16, num_slots=3):
        from pegainfer.config import load_model_config
        from pegainfer.engine.kv_cache import PagePool
        from pegainfer.models.qwen3 import StepBuffers
        from pegainfer.models.qwen35 import Qwen35Model
        from pegainfer.weights import WeightReader

        cfg = load_model_config(folder)
        assert cfg.arch == "qwen3_5"
        model = Qwen35Model(cfg, max_model_len, max_tokens=max_tokens, max_rows=max_rows)
        model.chunk_size = CHUNK
        with WeightReader(folder) as reader:
            model.load_weights(reader)
        pages = num_slots * -(-max_model_len // PAGE_SIZE)
        model.allocate(pages, PAGE_SIZE)
        assert model.num_slots == num_slots
        self.model, self.cfg = model, cfg
        self.pool = PagePool(pages, PAGE_SIZE, num_slots, max_model_len)
        self.step = StepBuffers.allocate(max_tokens, max_rows)

    def new_sequence(self, length):
        slot = self.pool.acquire_slot()
        assert self.pool.ensure_capacity(slot, length)
        self.model.reset_slot(slot)
        return slot

    def run(self, ids, positions, slots, rows):
        """One forward step; returns the logits rows as float32 on the host."""
        from pegainfer.kernels.primitives import from_bf16_bits

        T, B = len(ids), len(rows)
        self.pool.sync()
        self.step.ids[:T].copy_to_device(np.asarray(ids, np.int32))
        self.step.positions[:T].copy_to_device(np.asarray(positions, np.int32))
        self.step.token_slots[:T].copy_to_device(np.asarray(slots, np.int32))
        self.step.logit_rows[:B].copy_to_device(np.asarray(rows, np.int32))
        logits = self.model.forward(self.step, self.pool.block_tables, T, B)
        return from_bf16_bits(logits.copy_to_host())

    def prefill(self, slot, ids, start=0):
        """A prompt chunk as the engine prefills it: one logits row (its last token) → the chunked form."""
        n = len(ids)
        return self.run(ids, range(start, start + n), [slot] * n, [n - 1])[0]

    def score(self, slot, ids, start=0):
        """A logits row for every token (T == B) → the token-by-token form."""
        n = len(ids)
        return self.run(ids, range(start, start + n), [slot] * n, range(n))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35_causal_lm")
    return _write_tiny_qwen35(folder, multimodal=False), Driver(folder)


def _prompt(n, seed=7):
    return np.random.default_rng(seed + n).integers(0, VOCAB, size=n).tolist()


def _hf_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


def _hf_greedy(ref, ids, steps=DECODE_STEPS):
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(ids):].tolist()


def _assert_rows_close(ours, theirs):
    errs = [rel_l2(ours[t], theirs[t]) for t in range(len(theirs))]
    assert max(errs) < 2e-2, errs


def test_prompt_logits_match_hf(tiny):
    """Every prompt position, scored in pieces of up to 8 tokens that continue the recurrent state."""
    ref, drv = tiny
    ids = _prompt(13)
    slot = drv.new_sequence(len(ids))
    try:
        ours = np.concatenate([drv.score(slot, ids[s:s + 8], start=s) for s in range(0, len(ids), 8)])
    finally:
        drv.pool.release(slot)
    _assert_rows_close(ours, _hf_logits(ref, ids))


def test_greedy_decode_matches_hf(tiny):
    """Two sequences in different slots: a 5-token prompt (shorter than a chunk) prefilled in one step, a 13-token
    prompt (longer than a chunk) prefilled in two steps of 9 and 4 tokens (the second continues the first's
    recurrent state), both through the chunked form; then 8 greedy tokens each, decoded together one step per
    token.  Each must follow its own HF greedy continuation, with HF's logits at every step."""
    ref, drv = tiny
    prompts = [_prompt(PROMPT_LENGTHS[0], seed=1), _prompt(PROMPT_LENGTHS[1], seed=2)]
    slots = [drv.new_sequence(len(p) + DECODE_STEPS) for p in prompts]
    try:
        first = [drv.prefill(slots[0], prompts[0])]
        drv.prefill(slots[1], prompts[1][:9])
        first.append(drv.prefill(slots[1], prompts[1][9:], start=9))
        logits = [[row] for row in first]
        tokens = [[int(np.argmax(row))] for row in first]
        for i in range(DECODE_STEPS - 1):
            rows = drv.run([t[-1] for t in tokens], [len(p) + i for p in prompts], slots, [0, 1])
            for s in range(2):
                logits[s].append(rows[s])
                tokens[s].append(int(np.argmax(rows[s])))
    finally:
        for slot in slots:
            drv.pool.release(slot)
    for s in range(2):
        hf_tokens = _hf_greedy(ref, prompts[s])
        theirs = _hf_logits(ref, prompts[s] + hf_tokens[:-1])[len(prompts[s]) - 1:]
        # Equal greedy tokens are a fair demand only without near-ties in HF's own logits (random tiny models have
        # bf16 ties): the model's seed is chosen so that the top two differ by > 1% at every step.
        top2 = np.sort(theirs, axis=1)[:, -2:]
        assert np.all(top2[:, 1] - top2[:, 0] > 0.01 * np.abs(top2[:, 1])), "near-tie in HF's logits: change seed"
        assert tokens[s] == hf_tokens, s
        _assert_rows_close(logits[s], theirs)


def test_conditional_generation_layout(tmp_path):
    """The multimodal checkpoint layout (text config under ``text_config``, weights under
    ``model.language_model.``, a vision tower to ignore, untied lm_head) loads and gives HF's logits."""
    ref = _write_tiny_qwen35(tmp_path / "qwen35_vl", multimodal=True, seed=1)
    drv = Driver(tmp_path / "qwen35_vl")
    assert drv.cfg.weight_prefix == "model.language_model." and not drv.cfg.tie_word_embeddings
    ids = _prompt(6)
    slot = drv.new_sequence(len(ids))
    _assert_rows_close(drv.score(slot, ids), _hf_logits(ref, ids))
