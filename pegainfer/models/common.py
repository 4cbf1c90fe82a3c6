"""What the served models share: the config's dimensions and the weights every decoder has (embedding, final norm,
LM head, MLPs, RoPE tables), loaded in the layouts the kernels expect.  ``Qwen3Model`` and ``Qwen35Model`` build on
``DecoderModel``; their attention blocks, buffers and forward passes are their own."""
from __future__ import annotations

import numpy as np
from numba import cuda

from pegainfer.kernels import attention, embedding, linear, rope
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy

BF16 = np.uint16


def upload_stacked(reader, parts, cols: int):
    """One device array ``[Σ rows, cols]`` (bf16 bits) holding the checkpoint tensors ``parts`` = ``((name, rows),
    ...)`` one after another: the fused projections (q|k|v, gate|up, ...) that one GEMM multiplies at once."""
    stacked = cuda.device_array((sum(rows for _, rows in parts), cols), dtype=BF16)
    row = 0
    for name, rows in parts:
        reader.upload(name, (rows, cols), dest=stacked[row:row + rows])
        row += rows
    return stacked


class DecoderModel:
    """The dimensions of a decoder-only model and the loading of the weights every such model has."""

    has_recurrent_state = False   # state per sequence besides its KV pages (a hybrid model's linear attention)

    def __init__(self, cfg, max_model_len: int, max_tokens: int, max_rows: int,
                 policy: LaunchPolicy = DEFAULT_POLICY):
        self.cfg = cfg
        self.policy = policy                  # how the kernels launch (``kernels/policy.py``), passed to each
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens          # most tokens in one step (prefill chunk)
        self.max_rows = max_rows              # most logits rows in one step (sequences in a decode batch)
        self.nq = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.D = cfg.head_dim
        self.H = cfg.hidden_size
        self.I = cfg.intermediate_size
        self.V = cfg.vocab_size
        self.L = cfg.num_hidden_layers

    def _allocate_decoder(self, num_pages: int, page_size: int, attention_layers: int) -> None:
        """What every decoder allocates: the paged KV cache of its ``attention_layers`` attention layers and the
        activation buffers of one step (the residual stream in two buffers that swap roles at every fused norm,
        the norm output, the layer output ``delta``, qkv, q, attention output, the MLP activation, the rows that
        get logits and the logits; the split-K attention workspace)."""
        self.page_size = page_size
        shape = (num_pages, page_size, self.nkv, self.D)
        self.k_cache = [cuda.device_array(shape, dtype=BF16) for _ in range(attention_layers)]
        self.v_cache = [cuda.device_array(shape, dtype=BF16) for _ in range(attention_layers)]
        T, H = self.max_tokens, self.H
        e = lambda *s: cuda.device_array(s, dtype=BF16)  # noqa: E731
        self.residuals = (e(T, H), e(T, H))  # the residual stream, read from one and written to the other
        self.normed, self.delta = e(T, H), e(T, H)
        self.qkv = e(T, self.qkv_rows)
        self.q = e(T, self.nq, self.D)
        self.attn = e(T, self.nq, self.D)
        self.act = e(T, self.I)
        self.last_hidden = e(self.max_rows, H)
        self.logits = e(self.max_rows, self.V)
        ws = attention.attention_workspace_size(T, self.nq, self.D, self.max_model_len, nkv=self.nkv)
        self.attn_workspace = cuda.device_array(max(int(ws), 1), dtype=np.float32)
        self.linear_workspace = cuda.device_array(self.linear_workspace_size(), dtype=np.float32)

    def projection_shapes(self) -> list[tuple[int, int, bool]]:
        """Every weight projection of a step as ``(rows, K, gated)`` (``linear.linear_workspace_size``)."""
        raise NotImplementedError

    def linear_workspace_size(self) -> int:
        """f32 elements of the tensor-core GEMM's split-K scratch for every projection of a step of up to
        ``max_tokens`` tokens (computed once)."""
        if getattr(self, "_linear_workspace_size", None) is None:
            self._linear_workspace_size = int(linear.linear_workspace_size(self.max_tokens, self.projection_shapes(),
                                                                           self.policy))
        return self._linear_workspace_size

    def _load_embeddings(self, reader) -> None:
        """``embed`` ``[V, H]``, ``final_norm`` ``[H]`` and ``lm_head`` ``[V, H]`` (the embedding itself when tied, or
        when the checkpoint has no separate head)."""
        p, H = reader.prefix, self.H
        self.embed = reader.upload(f"{p}embed_tokens.weight", (self.V, H))
        self.final_norm = reader.upload(f"{p}norm.weight", (H,))
        if self.cfg.tie_word_embeddings or not reader.has("lm_head.weight"):
            self.lm_head = self.embed
        else:
            self.lm_head = reader.upload("lm_head.weight", (self.V, H))

    def lm_head_argmax(self, T: int, B: int) -> bool:
        """Whether ``forward(T, B, head=...)`` writes row 0's greedy token in its LM head launch: one token and one
        logits row, where the LM head is the fused one-token GEMV (``linear.linear_add_rms_norm(head=)``)."""
        return self.policy.head_argmax and T == 1 and B == 1 and linear.fuses_add_rms_norm(1, self.lm_head, policy=self.policy)

    def _embed(self, ids, residual, first_w):
        """The token embeddings as the first layer's residual input: ``(residual_in, row_ids)`` for its
        ``linear.linear_add_rms_norm``.  For one token the lookup rides in that projection's launch (the table and
        ``ids``: its prologue reads the row); otherwise the embedding kernel writes ``residual`` (and None)."""
        if ids.shape[0] == 1 and linear.fuses_add_rms_norm(1, first_w, policy=self.policy):
            return self.embed, ids
        embedding.embedding(ids, self.embed, residual, policy=self.policy)
        return residual, None

    def _load_mlp(self, reader, layer_prefix: str) -> dict:
        """The layer's MLP: ``gate_up`` ``[2I, H]`` (gate rows then up rows, the layout of
        ``linear.linear_silu_mul``) and ``down`` ``[H, I]``."""
        a, H, I = layer_prefix + "mlp.", self.H, self.I
        return {"gate_up": upload_stacked(reader, ((a + "gate_proj.weight", I), (a + "up_proj.weight", I)), H),
                "down": reader.upload(a + "down_proj.weight", (H, I))}

    def _load_rope_tables(self) -> None:
        """``rope_cos`` / ``rope_sin`` ``[max_model_len, rotary_dim / 2]`` on the device (``rope.rope_tables``)."""
        cos, sin = rope.rope_tables(self.max_model_len, self.rotary_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        self.rope_cos = cuda.to_device(cos)
        self.rope_sin = cuda.to_device(sin)
