"""config.json / generation_config.json parsing: architecture detection, field defaults, bad-input messages."""
import json

import numpy as np
import pytest

import pegainfer  # noqa: F401  (before numba)
from pegainfer.config import load_generation_config, load_model_config
from pegainfer.errors import ModelFolderError, PegainferError, UnsupportedModelError

# Qwen3-4B's config.json as published (transformers 4.51 era)
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
    "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}

# Qwen3.5-4B-like text config (newer rope_parameters form, layer_types written out)
QWEN3_5_TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 2560, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "rms_norm_eps": 1e-6,
    "vocab_size": 248320, "max_position_embeddings": 262144, "hidden_act": "silu",
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "attn_output_gate": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "eos_token_id": 248044, "dtype": "bfloat16", "tie_word_embeddings": True,
}


def write(folder, name, obj):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return folder


def write_embedding(folder, prefix):
    """A one-tensor safetensors file, so the weight-prefix detection has names to look at."""
    from safetensors.numpy import save_file
    save_file({prefix + "embed_tokens.weight": np.zeros((4, 2), np.float32)}, str(folder / "model.safetensors"))


# --------------------------------------------------------------------------------------------------- qwen3
def test_qwen3_4b(tmp_path):
    cfg = load_model_config(write(tmp_path, "config.json", QWEN3_4B))
    assert (cfg.arch, cfg.architecture) == ("qwen3", "Qwen3ForCausalLM")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2560, 36, 32, 8)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (128, 9728, 151936)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.rotary_dim == 128
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 40960 and cfg.dtype == "bfloat16"
    assert cfg.bos_token_id == 151643 and cfg.eos_token_ids == (151645,)
    assert cfg.layer_types == ("full_attention",) * 36 and cfg.linear_attention_layers == ()
    assert cfg.q_size == 4096 and cfg.kv_size == 1024 and not cfg.attn_output_gate
    assert cfg.weight_prefix == "model."  # no weights on disk: guessed from the architecture


def test_qwen3_defaults_follow_transformers(tmp_path):
    """Fields left out get transformers' Qwen3Config defaults."""
    from transformers import AutoConfig
    minimal = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
               "num_hidden_layers": 2, "num_attention_heads": 64, "intermediate_size": 512, "vocab_size": 1000}
    folder = write(tmp_path, "config.json", minimal)
    ours, hf = load_model_config(folder), AutoConfig.from_pretrained(folder)
    assert ours.head_dim == hf.head_dim == 128
    assert ours.num_key_value_heads == hf.num_key_value_heads == 32  # absent: 32, as in Qwen3Config
    write(tmp_path, "config.json", {**minimal, "num_key_value_heads": None})
    ours, hf = load_model_config(folder), AutoConfig.from_pretrained(folder)
    assert ours.num_key_value_heads == hf.num_key_value_heads == 64  # null: one KV head per query head
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == hf.rms_norm_eps and ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.eos_token_ids == () and ours.bos_token_id is None


@pytest.mark.parametrize("form", ["old", "new"])
def test_rope_scaling_both_forms(tmp_path, form):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cfg = dict(QWEN3_4B)
    if form == "old":
        cfg.update(rope_theta=5e6, rope_scaling=yarn)
    else:
        del cfg["rope_theta"], cfg["rope_scaling"]
        cfg["rope_parameters"] = {**yarn, "rope_theta": 5e6}
    ours = load_model_config(write(tmp_path, "config.json", cfg))
    assert ours.rope_theta == 5e6
    assert ours.rope_scaling == yarn


# --------------------------------------------------------------------------------------------------- qwen3.5
def test_qwen3_5_causal_lm_layout(tmp_path):
    folder = write(tmp_path, "config.json", {**QWEN3_5_TEXT, "architectures": ["Qwen3_5ForCausalLM"]})
    write_embedding(folder, "model.")
    cfg = load_model_config(folder)
    assert cfg.arch == "qwen3_5" and cfg.weight_prefix == "model."
    assert cfg.head_dim == 256 and cfg.partial_rotary_factor == 0.25 and cfg.rotary_dim == 64
    assert cfg.rope_theta == 1e7 and cfg.rope_scaling is None  # mrope_section dropped: plain RoPE for text
    assert cfg.full_attention_layers == (3, 7) and cfg.linear_attention_layers == (0, 1, 2, 4, 5, 6)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (16, 32)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (128, 128, 4)
    assert cfg.attn_output_gate and cfg.eos_token_ids == (248044,) and cfg.tie_word_embeddings


def test_qwen3_5_state_dtype_comes_from_mamba_ssm_dtype(tmp_path):
    """``mamba_ssm_dtype`` (Qwen3.5's config says float32) sets the Gated DeltaNet state's dtype; bf16 is the other
    one the kernels keep; anything else is a one-line error naming the field."""
    for value, want in ((None, "float32"), ("float32", "float32"), ("bfloat16", "bfloat16"), ("BF16", "bfloat16")):
        extra = {} if value is None else {"mamba_ssm_dtype": value}
        folder = write(tmp_path / str(value), "config.json",
                       {**QWEN3_5_TEXT, "architectures": ["Qwen3_5ForCausalLM"], **extra})
        write_embedding(folder, "model.")
        assert load_model_config(folder).ssm_state_dtype == want, value
    folder = write(tmp_path / "f16", "config.json",
                   {**QWEN3_5_TEXT, "architectures": ["Qwen3_5ForCausalLM"], "mamba_ssm_dtype": "float16"})
    write_embedding(folder, "model.")
    with pytest.raises(ModelFolderError, match="mamba_ssm_dtype is 'float16': the Gated DeltaNet state is kept in "
                                               "float32 or bfloat16"):
        load_model_config(folder)


def test_qwen3_5_multimodal_layout(tmp_path):
    text = {k: v for k, v in QWEN3_5_TEXT.items() if k not in ("layer_types", "tie_word_embeddings")}
    text["full_attention_interval"] = 4
    top = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
           "vision_config": {"depth": 2, "hidden_size": 64}, "tie_word_embeddings": True,
           "image_token_id": 248056}
    folder = write(tmp_path, "config.json", top)
    write_embedding(folder, "model.language_model.")
    cfg = load_model_config(folder)
    assert cfg.arch == "qwen3_5" and cfg.architecture == "Qwen3_5ForConditionalGeneration"
    assert cfg.weight_prefix == "model.language_model."
    assert cfg.hidden_size == 2560 and cfg.vocab_size == 248320 and cfg.tie_word_embeddings
    # derived from full_attention_interval: layer i is full attention when (i + 1) % 4 == 0
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + \
        ("full_attention",)


def test_rope_parameters_per_layer_type(tmp_path):
    text = {**QWEN3_5_TEXT, "architectures": ["Qwen3_5ForCausalLM"],
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e6,
                                                   "partial_rotary_factor": 0.5}}}
    cfg = load_model_config(write(tmp_path, "config.json", text))
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rotary_dim, cfg.rope_scaling) == (5e6, 0.5, 128, None)


def test_qwen3_5_matches_transformers(tmp_path):
    """Defaults for fields left out (head_dim, linear heads, partial rotary, layer pattern) agree with HF."""
    from transformers import AutoConfig
    minimal = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 128,
               "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 500,
               "full_attention_interval": 3}
    folder = write(tmp_path, "config.json", minimal)
    ours, hf = load_model_config(folder), AutoConfig.from_pretrained(folder)
    assert ours.layer_types == tuple(hf.layer_types)
    assert ours.head_dim == hf.head_dim and ours.num_key_value_heads == hf.num_key_value_heads
    assert ours.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    for f in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim"):
        assert getattr(ours, f) == getattr(hf, f), f


# --------------------------------------------------------------------------------------------------- refused
@pytest.mark.parametrize("archs,model_type,named", [
    (["Qwen3MoeForCausalLM"], "qwen3_moe", "Qwen3MoeForCausalLM"),
    (["Qwen3_5MoeForConditionalGeneration"], "qwen3_5_moe", "qwen3_5_moe"),
    (["LlamaForCausalLM"], "llama", "LlamaForCausalLM"),
    (["Qwen3ForCausalLM"], "qwen3_moe", "qwen3_moe"),          # name and type disagree: do not guess
    (None, None, "neither"),
])
def test_unsupported_architectures(tmp_path, archs, model_type, named):
    cfg = {k: v for k, v in QWEN3_4B.items() if k not in ("architectures", "model_type")}
    if archs:
        cfg["architectures"] = archs
    if model_type:
        cfg["model_type"] = model_type
    with pytest.raises(UnsupportedModelError) as e:
        load_model_config(write(tmp_path, "config.json", cfg))
    msg = str(e.value)
    assert named in msg and "Qwen3ForCausalLM" in msg and "Qwen3_5ForConditionalGeneration" in msg
    assert "\n" not in msg


def test_unsupported_features(tmp_path):
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        load_model_config(write(tmp_path / "a", "config.json", {**QWEN3_4B, "use_sliding_window": True}))
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        load_model_config(write(tmp_path / "b", "config.json", {**QWEN3_4B, "hidden_act": "gelu"}))
    moe_text = {**QWEN3_5_TEXT, "model_type": "qwen3_5_moe_text"}
    top = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": moe_text}
    with pytest.raises(UnsupportedModelError, match="qwen3_5_moe_text"):
        load_model_config(write(tmp_path / "c", "config.json", top))


# --------------------------------------------------------------------------------------------------- bad input
def test_missing_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(ModelFolderError, match="fetched by --model-path and Engine.from_folder"):
        load_model_config("Qwen/Qwen3-4B")


def test_not_a_directory(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ModelFolderError, match="is not a directory"):
        load_model_config(f)


def test_no_config_json(tmp_path):
    with pytest.raises(ModelFolderError, match="config.json not found"):
        load_model_config(tmp_path)


def test_invalid_json_names_the_file(tmp_path):
    write(tmp_path, "config.json", '{"hidden_size": 64,\n "oops" }')
    with pytest.raises(ModelFolderError, match=r"config.json .*not valid JSON \(line 2"):
        load_model_config(tmp_path)
    write(tmp_path, "config.json", "[1, 2]")
    with pytest.raises(ModelFolderError, match="JSON object"):
        load_model_config(tmp_path)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                   "vocab_size"])
def test_missing_required_field_is_named(tmp_path, field):
    cfg = {k: v for k, v in QWEN3_4B.items() if k != field}
    with pytest.raises(ModelFolderError, match=f"missing the required field '{field}'"):
        load_model_config(write(tmp_path, "config.json", cfg))


def test_missing_field_inside_text_config(tmp_path):
    text = {k: v for k, v in QWEN3_5_TEXT.items() if k != "vocab_size"}
    top = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text}
    with pytest.raises(ModelFolderError, match=r"\(text_config\) is missing the required field 'vocab_size'"):
        load_model_config(write(tmp_path, "config.json", top))


@pytest.mark.parametrize("patch,match", [
    ({"hidden_size": "2560"}, "'hidden_size' must be an integer"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be an integer >= 1"),
    ({"rms_norm_eps": -1}, "'rms_norm_eps' must be a positive number"),
    ({"num_key_value_heads": 5}, "must be a multiple of num_key_value_heads"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    ({"eos_token_id": "</s>"}, "'eos_token_id' must be a token id"),
])
def test_bad_field_values(tmp_path, patch, match):
    with pytest.raises(ModelFolderError, match=match):
        load_model_config(write(tmp_path, "config.json", {**QWEN3_4B, **patch}))


def test_layer_types_must_match_layers(tmp_path):
    bad = {**QWEN3_5_TEXT, "architectures": ["Qwen3_5ForCausalLM"], "layer_types": ["full_attention"] * 3}
    with pytest.raises(ModelFolderError, match="layer_types has 3 entries but num_hidden_layers is 8"):
        load_model_config(write(tmp_path, "config.json", bad))
    bad["layer_types"] = ["sliding_attention"] * 8
    with pytest.raises(ModelFolderError, match="layer_types"):
        load_model_config(write(tmp_path, "config.json", bad))


def test_errors_are_one_line_pegainfer_errors(tmp_path):
    write(tmp_path, "config.json", "{\n\n")
    with pytest.raises(PegainferError) as e:
        load_model_config(tmp_path)
    assert "\n" not in str(e.value) and e.value.__cause__ is None


# --------------------------------------------------------------------------------------------------- generation
def test_generation_config_merges_eos(tmp_path):
    write(tmp_path, "config.json", QWEN3_4B)
    write(tmp_path, "generation_config.json", {"bos_token_id": 151643, "do_sample": True,
                                               "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                                               "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                               "repetition_penalty": 1.05})
    g = load_generation_config(tmp_path)
    assert (g.temperature, g.top_p, g.top_k, g.min_p, g.repetition_penalty) == (0.6, 0.95, 20, 0.0, 1.05)
    assert g.eos_token_ids == (151645, 151643)  # config.json's 151645 deduplicated, order kept


def test_generation_config_eos_from_both_files_in_order(tmp_path):
    write(tmp_path, "config.json", {**QWEN3_4B, "eos_token_id": [7, 151645]})
    write(tmp_path, "generation_config.json", {"eos_token_id": 151645})
    assert load_generation_config(tmp_path).eos_token_ids == (151645, 7)


def test_generation_config_missing_gives_defaults(tmp_path):
    write(tmp_path, "config.json", QWEN3_4B)
    g = load_generation_config(tmp_path)
    assert (g.temperature, g.top_p, g.top_k, g.min_p, g.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    assert g.eos_token_ids == (151645,)


def test_generation_config_greedy_and_errors(tmp_path):
    write(tmp_path, "config.json", QWEN3_4B)
    write(tmp_path, "generation_config.json", {"do_sample": False, "temperature": 0.7})
    assert load_generation_config(tmp_path).temperature == 0.0
    write(tmp_path, "generation_config.json", "{temperature: 1}")
    with pytest.raises(ModelFolderError, match="generation_config.json .*not valid JSON"):
        load_generation_config(tmp_path)
    write(tmp_path, "generation_config.json", {"top_p": 1.5})
    with pytest.raises(ModelFolderError, match="top_p"):
        load_generation_config(tmp_path)
    write(tmp_path, "generation_config.json", {"repetition_penalty": 11})
    with pytest.raises(ModelFolderError, match="repetition_penalty"):
        load_generation_config(tmp_path)
