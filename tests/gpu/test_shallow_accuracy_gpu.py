"""Full-width, shallow accuracy on the GPU: Qwen3-4B's and Qwen3.5-4B's widths, heads and vocabularies with 3 and 2
layers (random weights and norm weights, made by transformers on the GPU), held position by position to HF bf16
and HF fp32 (bounds: ``shallow_models.check_against_hf``).  The prompt is scored in one 256-row prefill step, so
every projection and the LM head run their tensor-core GEMM paths; the decode steps replay the CUDA graphs.
Skipped without a GPU."""
import pytest

from tests.gpu.shallow_models import (SHALLOW_QWEN35_4B, SHALLOW_QWEN3_4B, check_against_hf, make_shallow_qwen3,
                                      make_shallow_qwen35, models_root)

pytestmark = pytest.mark.gpu

PROMPT_LEN = 256
DECODE_STEPS = 8


def test_shallow_qwen3_4b_width_matches_hf_per_position(tmp_path_factory):
    """Catches an error of ~0.6 % of the logits' norm on average over the positions, or one position further from
    the exact model than HF's bf16 forward (a wrong GEMM tile, rounding point or attention row at full width),
    that the 36-layer tests' mean bound over HF's own backend spread lets through."""
    import transformers
    folder = make_shallow_qwen3(models_root(tmp_path_factory) / "qwen3-4b-width-3-layers", SHALLOW_QWEN3_4B)
    check_against_hf(transformers.Qwen3ForCausalLM, folder, PROMPT_LEN, DECODE_STEPS, "qwen3-4b-width-3-layers")


def test_shallow_qwen35_4b_width_matches_hf_per_position(tmp_path_factory):
    """The same for Qwen3.5 (one Gated DeltaNet and one gated full-attention layer; the prompt is four chunks of
    the chunked delta rule): catches a per-position error in the recurrent or attention path at full width."""
    import transformers
    folder = make_shallow_qwen35(models_root(tmp_path_factory) / "qwen3.5-4b-width-2-layers", SHALLOW_QWEN35_4B)
    check_against_hf(transformers.Qwen3_5ForCausalLM, folder, PROMPT_LEN, DECODE_STEPS, "qwen3.5-4b-width-2-layers")
