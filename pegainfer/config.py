"""Read a Hugging Face model folder's ``config.json`` and ``generation_config.json``.

Supported architectures (dense, text-only decoding):

* ``"qwen3"``   — ``Qwen3ForCausalLM`` / ``model_type: qwen3`` (Qwen3-0.6B … 32B dense).
* ``"qwen3_5"`` — ``Qwen3_5ForCausalLM`` (``model_type: qwen3_5_text``, fields at the top level, weights under
  ``model.``) and ``Qwen3_5ForConditionalGeneration`` (``model_type: qwen3_5``, the text fields nested under
  ``text_config``, text weights under ``model.language_model.``; the vision tower is ignored).

Names and defaults follow transformers' ``Qwen3Config`` / ``Qwen3_5TextConfig``, including both ways RoPE is
written: the older top-level ``rope_theta`` + ``rope_scaling``, and the newer ``rope_parameters`` dict
(``rope_theta``, ``rope_type``, ``factor``, ``partial_rotary_factor`` inside it).  Qwen3.5's ``mrope_section`` is
dropped: for text-only input all three M-RoPE position streams are equal, which is plain 1-D RoPE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from pegainfer.errors import ModelFolderError, UnsupportedModelError
from pegainfer.jsonfile import read_json

SUPPORTED = ("Qwen3ForCausalLM (qwen3), Qwen3_5ForCausalLM and Qwen3_5ForConditionalGeneration (qwen3_5); "
             "dense models only")

_QWEN3_ARCHS = {"Qwen3ForCausalLM"}
_QWEN3_5_ARCHS = {"Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"}
_QWEN3_TYPES = {"qwen3"}
_QWEN3_5_TYPES = {"qwen3_5", "qwen3_5_text"}
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape and numerics, read from ``config.json`` (the text part for multimodal checkpoints)."""

    folder: Path
    arch: str                        # "qwen3" or "qwen3_5"
    architecture: str                # the HF class name from config.json, for messages
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int         # query heads of full-attention layers
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None        # None for plain RoPE, else {"rope_type": "yarn", "factor": 4.0, ...}
    partial_rotary_factor: float     # fraction of head_dim that is rotated (qwen3: 1.0, qwen3_5: 0.25)
    vocab_size: int                  # rows of the embedding / lm_head (may exceed the tokenizer's vocabulary)
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str                       # torch_dtype of the checkpoint, e.g. "bfloat16" (pegainfer computes in bf16)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    layer_types: tuple[str, ...]     # per layer: "full_attention" or "linear_attention" (qwen3: all full)
    weight_prefix: str               # where the decoder's tensors live: "model." or "model.language_model."
    # Qwen3.5 linear-attention (Gated DeltaNet) layers; 0 for qwen3
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attn_output_gate: bool = False   # qwen3_5 full attention: q_proj also yields a sigmoid gate on the output
    ssm_state_dtype: str = "float32"  # the Gated DeltaNet state in memory: config.json's mamba_ssm_dtype, or
    #                                   "bfloat16" (``Engine.from_folder(mamba_ssm_cache_dtype=)``)
    raw: dict = field(default_factory=dict, repr=False, compare=False)  # the (text) config dict as read

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head RoPE rotates: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults from ``generation_config.json`` (used when a request does not set them).

    ``temperature == 0`` means greedy (the file said ``do_sample: false``).  ``top_k == 0`` and ``top_p == 1``
    and ``min_p == 0`` disable those filters; ``repetition_penalty == 1`` is off.  Other fields are ignored.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    max_new_tokens: int | None = None


# ------------------------------------------------------------------------------------------------ file helpers
def _check_folder(folder) -> Path:
    path = Path(folder).expanduser()
    if not path.exists():
        hint = ""
        text = str(folder)
        if text.count("/") == 1 and not text.startswith((".", "/", "~")):
            hint = (f" (a Hugging Face Hub id is fetched by --model-path and Engine.from_folder, not by the "
                    f"config reader: pass {text} there)")
        raise ModelFolderError(f"model folder {path} does not exist{hint}")
    if not path.is_dir():
        raise ModelFolderError(f"{path} is not a directory: pass the folder that holds config.json and the "
                               f"*.safetensors files")
    return path


class _Fields:
    """Typed access to a config dict; errors name the file and the field."""

    def __init__(self, d: dict, where: str):
        self.d, self.where = d, where

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def _bad(self, key, want):
        return ModelFolderError(f"{self.where}: field {key!r} must be {want}, got {self.d.get(key)!r}")

    def int(self, key: str, default=..., minimum: int | None = 1) -> int:
        v = self.d.get(key)
        if v is None:
            if default is ...:
                raise ModelFolderError(f"{self.where} is missing the required field {key!r}")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
            raise self._bad(key, "an integer")
        if minimum is not None and v < minimum:
            raise self._bad(key, f"an integer >= {minimum}")
        return int(v)

    def float(self, key: str, default=..., positive: bool = True) -> float:
        v = self.d.get(key)
        if v is None:
            if default is ...:
                raise ModelFolderError(f"{self.where} is missing the required field {key!r}")
            return float(default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self._bad(key, "a number")
        if positive and v <= 0:
            raise self._bad(key, "a positive number")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._bad(key, "true or false")
        return v

    def token_ids(self, key: str) -> tuple[int, ...]:
        v = self.d.get(key)
        if v is None:
            return ()
        items = v if isinstance(v, list) else [v]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
            raise self._bad(key, "a token id or a list of token ids")
        return tuple(items)


def _dedupe(ids) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


# ------------------------------------------------------------------------------------------ architecture detection
def detect_arch(cfg: dict, where: str = "config.json") -> str:
    """``"qwen3"`` or ``"qwen3_5"`` from ``architectures`` / ``model_type``; else ``UnsupportedModelError``.

    Both fields must point at the same supported family when both are present (a known class name over a MoE
    ``model_type`` is refused rather than guessed)."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):
        raise ModelFolderError(f"{where}: field 'architectures' must be a list of class names, got {archs!r}")
    model_type = cfg.get("model_type")
    found = ", ".join([*map(str, archs)] + ([f"model_type {model_type!r}"] if model_type else [])) or \
        "neither 'architectures' nor 'model_type'"
    kinds = set()
    for a in archs:
        kinds.add("qwen3" if a in _QWEN3_ARCHS else "qwen3_5" if a in _QWEN3_5_ARCHS else None)
    if model_type is not None or not archs:
        kinds.add("qwen3" if model_type in _QWEN3_TYPES else "qwen3_5" if model_type in _QWEN3_5_TYPES else None)
    if len(kinds) != 1 or None in kinds:
        raise UnsupportedModelError(f"unsupported model ({found} in {where}): pegainfer runs {SUPPORTED}")
    return kinds.pop()


def _rope(f: _Fields, arch: str) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from either config form."""
    params = f.d.get("rope_parameters")
    scaling = f.d.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise f._bad("rope_parameters", "an object")
    if scaling is not None and not isinstance(scaling, dict):
        raise f._bad("rope_scaling", "an object or null")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per-layer-type form: only full-attention layers use RoPE here
    merged: dict = {}
    merged.update(scaling or {})
    merged.update(params or {})
    if "type" in merged and "rope_type" not in merged:  # very old spelling
        merged["rope_type"] = merged.pop("type")
    g = _Fields(merged, f"{f.where} (rope_parameters)")
    theta = g.float("rope_theta", default=f.float("rope_theta", default=10_000.0))
    default_partial = 0.25 if arch == "qwen3_5" else 1.0
    partial = g.float("partial_rotary_factor", default=f.float("partial_rotary_factor", default=default_partial))
    if partial > 1.0:
        raise ModelFolderError(f"{f.where}: partial_rotary_factor must be in (0, 1], got {partial}")
    rope_type = merged.get("rope_type", "default")
    if rope_type in (None, "default"):
        return theta, None, partial
    extra = {k: v for k, v in merged.items()
             if k not in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved", "type")}
    return theta, extra, partial


def _layer_types(f: _Fields, arch: str, layers: int) -> tuple[str, ...]:
    if arch == "qwen3":
        if f.bool("use_sliding_window", False):
            raise UnsupportedModelError(f"{f.where} sets use_sliding_window: true; pegainfer implements full "
                                        f"attention only for qwen3")
        return ("full_attention",) * layers
    given = f.d.get("layer_types")
    if given is None:
        interval = f.int("full_attention_interval", default=4)
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))
    if not isinstance(given, list) or not all(t in LAYER_TYPES for t in given):
        raise f._bad("layer_types", 'a list of "linear_attention" / "full_attention"')
    if len(given) != layers:
        raise ModelFolderError(f"{f.where}: layer_types has {len(given)} entries but num_hidden_layers is {layers}")
    return tuple(given)


def _guess_prefix(folder: Path, architecture: str) -> str:
    """The decoder's tensor prefix, from the tensor names on disk (architecture-based guess if none are found)."""
    from pegainfer.errors import WeightError
    from pegainfer.weights import list_tensor_names, prefix_for

    try:
        return prefix_for(list_tensor_names(folder))
    except WeightError:
        return "model.language_model." if architecture.endswith("ForConditionalGeneration") else "model."


# ------------------------------------------------------------------------------------------------- public API
SSM_STATE_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def ssm_state_dtype(value, what: str) -> str:
    """``float32`` or ``bfloat16`` for a state dtype name (the two the Gated DeltaNet kernels keep their state in),
    or a one-line error naming ``what``."""
    if isinstance(value, str) and value.lower() in SSM_STATE_DTYPES:
        return SSM_STATE_DTYPES[value.lower()]
    raise ModelFolderError(f"{what} is {value!r}: the Gated DeltaNet state is kept in float32 or bfloat16")


def load_model_config(folder) -> ModelConfig:
    """Read and validate ``folder/config.json``.  Raises ``ModelFolderError`` / ``UnsupportedModelError``."""
    path = _check_folder(folder)
    top = read_json(path / "config.json", ": this does not look like a Hugging Face model folder")
    if not isinstance(top, dict):
        raise ModelFolderError(f"config.json in {path} must hold a JSON object")
    arch = detect_arch(top, f"{path / 'config.json'}")
    architecture = (top.get("architectures") or [top.get("model_type")])[0]

    text = top
    where = f"{path / 'config.json'}"
    if arch == "qwen3_5" and "text_config" in top:
        text = top["text_config"]
        where += " (text_config)"
        if not isinstance(text, dict):
            raise ModelFolderError(f"{where} must be an object")
        if text.get("model_type") not in (None, "qwen3_5_text"):
            raise UnsupportedModelError(f"unsupported model (text_config model_type {text.get('model_type')!r} in "
                                        f"{path / 'config.json'}): pegainfer runs {SUPPORTED}")
    f = _Fields(text, where)
    outer = _Fields(top, f"{path / 'config.json'}")

    if arch == "qwen3_5" and (f.has("num_experts") and f.int("num_experts", minimum=0) > 0):
        raise UnsupportedModelError(f"{where} describes a mixture-of-experts model: pegainfer runs {SUPPORTED}")
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {act!r} is not supported (only silu)")
    if f.bool("attention_bias", False):
        raise UnsupportedModelError(f"{where}: attention_bias: true is not supported")

    hidden = f.int("hidden_size")
    layers = f.int("num_hidden_layers")
    heads = f.int("num_attention_heads")
    # transformers' defaults: Qwen3Config has 32 when the key is absent and num_attention_heads when it is null;
    # Qwen3_5TextConfig has 4
    kv_default = (heads if "num_key_value_heads" in text else 32) if arch == "qwen3" else 4
    kv_heads = f.int("num_key_value_heads", default=kv_default)
    head_dim = f.int("head_dim", default=128 if arch == "qwen3" else 256)  # transformers' defaults
    if heads % kv_heads:
        raise ModelFolderError(f"{where}: num_attention_heads ({heads}) must be a multiple of "
                               f"num_key_value_heads ({kv_heads})")
    rope_theta, rope_scaling, partial = _rope(f, arch)

    # tie_word_embeddings: the class that owns lm_head reads it, i.e. the top-level config for the multimodal
    # checkpoint (Qwen3_5ForConditionalGeneration) and the text config otherwise.
    tie = outer.bool("tie_word_embeddings", f.bool("tie_word_embeddings", False)) if text is not top \
        else f.bool("tie_word_embeddings", False)
    dtype = text.get("torch_dtype") or text.get("dtype") or top.get("torch_dtype") or top.get("dtype") or "bfloat16"
    bos = text.get("bos_token_id", top.get("bos_token_id"))
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
        raise f._bad("bos_token_id", "a token id")
    eos = _dedupe(f.token_ids("eos_token_id") + (outer.token_ids("eos_token_id") if text is not top else ()))

    kwargs: dict = {}
    if arch == "qwen3_5":
        kwargs = dict(
            linear_num_key_heads=f.int("linear_num_key_heads", default=16),
            linear_num_value_heads=f.int("linear_num_value_heads", default=32),
            linear_key_head_dim=f.int("linear_key_head_dim", default=128),
            linear_value_head_dim=f.int("linear_value_head_dim", default=128),
            linear_conv_kernel_dim=f.int("linear_conv_kernel_dim", default=4),
            attn_output_gate=f.bool("attn_output_gate", True),  # Qwen3.5 always gates full attention
            ssm_state_dtype=ssm_state_dtype(text.get("mamba_ssm_dtype", "float32"), f"{where}: mamba_ssm_dtype"),
        )
        if kwargs["linear_num_value_heads"] % kwargs["linear_num_key_heads"]:
            raise ModelFolderError(f"{where}: linear_num_value_heads must be a multiple of linear_num_key_heads")

    return ModelConfig(
        folder=path, arch=arch, architecture=str(architecture),
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=f.int("intermediate_size"),
        rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
        rope_theta=rope_theta, rope_scaling=rope_scaling, partial_rotary_factor=partial,
        vocab_size=f.int("vocab_size"), tie_word_embeddings=tie,
        max_position_embeddings=f.int("max_position_embeddings", default=32768),
        dtype=str(dtype), bos_token_id=bos, eos_token_ids=eos,
        layer_types=_layer_types(f, arch, layers), weight_prefix=_guess_prefix(path, str(architecture)),
        raw=text, **kwargs)


def load_generation_config(folder) -> GenerationDefaults:
    """Sampling defaults from ``generation_config.json`` (absent → plain defaults) with eos ids merged from
    ``generation_config.json`` first, then ``config.json`` (deduplicated, order kept)."""
    path = _check_folder(folder)
    eos: tuple[int, ...] = ()
    gen: dict = {}
    gen_path = path / "generation_config.json"
    if gen_path.exists():
        gen = read_json(gen_path)
        if not isinstance(gen, dict):
            raise ModelFolderError(f"generation_config.json in {path} must hold a JSON object")
    g = _Fields(gen, str(gen_path))
    eos += g.token_ids("eos_token_id")
    cfg_path = path / "config.json"
    if cfg_path.exists():
        cfg = read_json(cfg_path)
        if isinstance(cfg, dict):
            for d in (cfg.get("text_config"), cfg):
                if isinstance(d, dict):
                    eos += _Fields(d, str(cfg_path)).token_ids("eos_token_id")

    temperature = g.float("temperature", default=1.0, positive=False)
    if gen.get("do_sample") is False:
        temperature = 0.0
    top_p = g.float("top_p", default=1.0)
    min_p = g.float("min_p", default=0.0, positive=False)
    repetition_penalty = g.float("repetition_penalty", default=1.0)
    if temperature < 0 or not 0 < top_p <= 1 or not 0 <= min_p <= 1 or not 0 < repetition_penalty <= 10:
        raise ModelFolderError(f"{gen_path}: temperature must be >= 0, top_p in (0, 1], min_p in [0, 1], "
                               f"repetition_penalty in (0, 10]")
    return GenerationDefaults(
        temperature=temperature, top_p=top_p, top_k=g.int("top_k", default=0, minimum=0), min_p=min_p,
        repetition_penalty=repetition_penalty,
        eos_token_ids=_dedupe(eos),
        max_new_tokens=g.int("max_new_tokens", default=None) if gen.get("max_new_tokens") is not None else None)
