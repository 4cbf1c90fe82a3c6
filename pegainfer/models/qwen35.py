"""Qwen3.5 (hybrid: Gated DeltaNet linear attention + gated full attention) forward pass over preallocated buffers.

Same shape as ``qwen3.py`` (the engine drives either through ``load_weights`` / ``allocate`` / ``reset_slot`` /
``forward``): one forward call processes a flat batch of T tokens — a prefill chunk of one sequence, or one decode
token for each of B sequences — with ``ids``, ``positions`` and ``token_slots`` per token in device buffers.

Three of every four layers (``cfg.layer_types``) are **linear attention** (HF ``Qwen3_5GatedDeltaNet``)::

    proj   = normed @ [W_qkv; W_z; W_b; W_a]^T         one fused projection  [T, conv_dim + Hv·Dv + 2·Hv]
    mixed  = silu(causal_conv1d(proj.qkv))            conv state per slot   (gated_delta.causal_conv1d_silu)
    core   = gated delta rule(mixed, a, b)            recurrent state per slot: token by token for decode,
                                                      chunked on tensor cores for prompts (gated_delta.gated_delta_*)
    core   = RMSNormGated(core, silu(proj.z))         per value head
    delta  = core @ W_out^T

(token by token, conv, rule and gated norm are one launch: ``gated_delta.gated_delta_decode_step``);

the others are **full attention** (HF ``Qwen3_5Attention``) with a sigmoid output gate and partial RoPE::

    qkv    = normed @ [W_q (q and gate interleaved per head); W_k; W_v]^T
    q, K, V= rope(rms_norm_head(q)), rope(rms_norm_head(k)), v → paged KV cache (rope.qk_norm_rope_store)
    attn   = softmax(q K^T / sqrt(D)) V · sigmoid(gate)      (attention; the split-K kernel gates as it writes)
    delta  = attn @ W_o^T

and every layer ends with the SwiGLU MLP.  All RMSNorms except the gated one are Qwen3.5's ``x·r·(1 + w)`` form.

**Recurrent state.**  Each linear-attention layer keeps, per engine slot, the conv window ``[conv_dim, K]``
(bf16, a ring indexed by position: ``gated_delta.conv``'s docstring) and the delta-rule state ``[Hv, Dk, Dv]`` (f32).
``reset_slot`` zeroes a slot for a new sequence; a prompt prefilled in several chunks continues from the state the
previous chunk left.

**Sequences in a step.**  The Gated DeltaNet kernels take a per-sequence table (``seq_slots``, ``seq_offsets``),
built on the device from ``token_slots`` (``gated_delta.sequence_table``: one sequence per run of equal slots).  The
number of its runs is at most B (every sequence of a step asks for at least one logits row, and so does each
padding decode row).  When ``T == B`` outside a mixed step (decode, or a prompt scored row by row) the
token-by-token form runs; otherwise (a prompt chunk, a mixed step) the chunked form, in which a decode is a one-token
chunk.  Both are exact for any table; which one runs is fixed by the kind of step, not its padded sizes, so a
padded step runs the form its unpadded step runs.  A decode step (``forward(decode=True)``: one token per sequence)
builds no table: the fused Gated DeltaNet step then takes sequence ``b`` = token ``b`` and its slot from
``token_slots`` (``gated_delta_decode_step``'s decode mode).

**Padding.**  Tokens with slot -1 -- after a prefill chunk's real tokens (padded to a CUDA-graph bucket), a mixed
step's decode rows padded to a graph batch (between the decodes and the chunks) and its chunk tokens padded to a
bucket (after them) -- belong to no sequence: trailing ones end the table, the padding decode rows form a padding
sequence of slot -1 in it, and every Gated DeltaNet kernel skips both (no conv window or delta-rule state read or
written, zero rule outputs), as the full-attention kernels skip them (no K/V written, zero outputs).  So padding
changes no real row: a padded step gives the unpadded step's states and logits, bit for bit where the projections
take the same kernel path at both token counts (``tests/models/test_qwen35_oracle.py``; on the GPU a larger T may
switch a projection to a tensor-core path, whose f32 sums can differ in the last bit: ``linear/reference.py``).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from pegainfer.kernels import attention, embedding, gated_delta, linear, norm, rope
from pegainfer.kernels.primitives import from_bf16_bits
from pegainfer.kernels.policy import DEFAULT_POLICY
from pegainfer.models.common import BF16, DecoderModel, upload_stacked

QWEN35_NORM = dict(weight_offset=1.0, round_before_weight=False)  # HF Qwen3_5RMSNorm: bf16(x·r·(1 + w))
PREFILL_CONV_TOKENS_PER_THREAD = 8


class Qwen35Model(DecoderModel):
    """Qwen3_5ForCausalLM / the language model of Qwen3_5ForConditionalGeneration: weights, KV cache, recurrent
    state slots and activation buffers on the device, and the forward pass."""

    arch = "qwen3_5"
    # Tokens with slot -1 touch no state wherever they are (module docstring, "Padding"): no K/V written, attention
    # output zeros, no sequence of the Gated DeltaNet table (gated_delta.sequence_table), so the conv and delta-rule
    # states are those of the unpadded step.  So prefill chunks can be padded to CUDA-graph buckets, and mixed steps
    # to ``cuda_graph.mixed_shape`` (their Gated DeltaNet layers take the chunked form, padded or not).
    pads_prefill = True
    pads_mixed = True
    has_recurrent_state = True   # per-slot conv windows and delta-rule states (prefix cache: state snapshots)
    chunk_size = gated_delta.MAX_CHUNK  # tokens per chunk of the chunked delta rule (tests may lower it)

    def __init__(self, cfg, max_model_len: int, max_tokens: int, max_rows: int, policy=DEFAULT_POLICY):
        super().__init__(cfg, max_model_len, max_tokens, max_rows, policy)
        self.rotary_dim = cfg.rotary_dim
        self.full_layers = list(cfg.full_attention_layers)
        self.linear_layers = list(cfg.linear_attention_layers)
        # full attention: q_proj yields q and gate (2·D per head), then k and v
        self.qkv_rows = (2 * self.nq + 2 * self.nkv) * self.D
        # linear attention
        self.Hk = cfg.linear_num_key_heads
        self.Hv = cfg.linear_num_value_heads
        self.Dk = cfg.linear_key_head_dim
        self.Dv = cfg.linear_value_head_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        # the delta-rule state in memory: f32, or bf16 bits (half the bytes; kernels/gated_delta/common.py)
        self.ssm_dtype = np.uint16 if cfg.ssm_state_dtype == "bfloat16" else np.float32
        self.key_dim = self.Hk * self.Dk
        self.value_dim = self.Hv * self.Dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.proj_rows = self.conv_dim + self.value_dim + 2 * self.Hv   # qkv | z | b | a
        if self.Dk > gated_delta.MAX_KEY_DIM:
            raise ValueError(f"linear_key_head_dim {self.Dk} > {gated_delta.MAX_KEY_DIM} (gated_delta.MAX_KEY_DIM)")

    # ------------------------------------------------------------------------------------------------ sizes
    def weight_bytes(self) -> int:
        """Bytes of weights on the device (what a decode step must read)."""
        H, I, V, D = self.H, self.I, self.V, self.D
        mlp_norms = 3 * I * H + 2 * H
        full = self.qkv_rows * H + H * self.nq * D + 2 * D
        lin = self.proj_rows * H + self.conv_dim * self.conv_kernel + self.Dv + H * self.value_dim
        lin_f32 = 2 * self.Hv  # A_log, dt_bias (f32: 2 bf16-sized units each)
        per_layer_total = (len(self.full_layers) * full + len(self.linear_layers) * (lin + lin_f32)
                           + self.L * mlp_norms)
        lm = 0 if self.cfg.tie_word_embeddings else V * H
        return 2 * (V * H + per_layer_total + H + lm)

    def kv_bytes_per_token(self) -> int:
        return 2 * len(self.full_layers) * 2 * self.nkv * self.D

    def state_bytes(self, num_slots: int) -> int:
        """Bytes of recurrent state (conv window + delta-rule state of every linear-attention layer) for
        ``num_slots`` sequences."""
        ssm = self.Hv * self.Dk * self.Dv * np.dtype(self.ssm_dtype).itemsize
        per_slot = self.conv_dim * self.conv_kernel * 2 + ssm
        return len(self.linear_layers) * num_slots * per_slot

    def scratch_bytes(self) -> int:
        T, H, R = self.max_tokens, self.H, self.max_rows
        elems = T * (3 * H + self.qkv_rows + 2 * self.nq * self.D + self.I + self.proj_rows + self.conv_dim
                     + self.value_dim) + R * (H + self.V)
        chunk = T * gated_delta.ChunkScratch.bytes_per_token(self.Hk, self.Hv, self.chunk_size)
        ws = attention.attention_workspace_size(T, self.nq, self.D, self.max_model_len, nkv=self.nkv)
        return 2 * elems + chunk + 4 * (ws + self.linear_workspace_size())

    def projection_shapes(self) -> list[tuple[int, int, bool]]:
        H = self.H
        return [(self.proj_rows, H, False), (self.qkv_rows, H, False), (H, self.nq * self.D, False),
                (H, self.value_dim, False), (2 * self.I, H, True), (H, self.I, False), (self.V, H, False)]

    # ------------------------------------------------------------------------------------------------ weights
    def load_weights(self, reader, progress=None) -> None:
        cfg, H, p = self.cfg, self.H, reader.prefix
        self._load_embeddings(reader)
        self.layers = []
        for i in range(self.L):
            a = f"{p}layers.{i}."
            lw = {"input_ln": reader.upload(a + "input_layernorm.weight", (H,)),
                  "post_ln": reader.upload(a + "post_attention_layernorm.weight", (H,))}
            if cfg.layer_types[i] == "full_attention":
                lw.update(self._load_full_attention(reader, a + "self_attn."))
            else:
                lw.update(self._load_linear_attention(reader, a + "linear_attn."))
            lw.update(self._load_mlp(reader, a))
            self.layers.append(lw)
        self._load_rope_tables()

    def _load_full_attention(self, reader, a: str) -> dict:
        H, D = self.H, self.D
        q_rows, kv_rows = 2 * self.nq * D, self.nkv * D   # q_proj: q and gate
        qkv = upload_stacked(reader, ((a + "q_proj.weight", q_rows), (a + "k_proj.weight", kv_rows),
                                      (a + "v_proj.weight", kv_rows)), H)
        return {"qkv": qkv,
                "q_norm": reader.upload(a + "q_norm.weight", (D,)),
                "k_norm": reader.upload(a + "k_norm.weight", (D,)),
                "o": reader.upload(a + "o_proj.weight", (H, self.nq * D))}

    def _load_linear_attention(self, reader, a: str) -> dict:
        H, cd, vd, hv = self.H, self.conv_dim, self.value_dim, self.Hv
        proj = upload_stacked(reader, ((a + "in_proj_qkv.weight", cd), (a + "in_proj_z.weight", vd),
                                       (a + "in_proj_b.weight", hv), (a + "in_proj_a.weight", hv)), H)
        conv = reader.host_bf16(a + "conv1d.weight", (cd, 1, self.conv_kernel)).reshape(cd, self.conv_kernel)

        def f32_param(name):
            # HF's bf16 model holds A_log and dt_bias in bf16 and widens them to f32 in the forward pass
            return cuda.to_device(from_bf16_bits(reader.host_bf16(a + name, (hv,))).astype(np.float32))

        return {"in_proj": proj,
                "conv_w": cuda.to_device(np.ascontiguousarray(conv)),
                "A_log": f32_param("A_log"),
                "dt_bias": f32_param("dt_bias"),
                "norm": reader.upload(a + "norm.weight", (self.Dv,)),
                "out_proj": reader.upload(a + "out_proj.weight", (H, vd))}

    # ------------------------------------------------------------------------------------------------ buffers
    def allocate(self, num_pages: int, page_size: int, num_slots: int | None = None, num_snapshots: int = 0) -> None:
        """KV cache pages (full-attention layers), recurrent-state slots (linear-attention layers) and activation
        scratch; called once after the memory check.  ``num_slots`` defaults to what the engine's page pool holds:
        ``num_pages`` pages are ``max_batch`` sequences of ``max_model_len`` tokens.  ``num_snapshots`` more state
        rows after the slots hold the prefix cache's copies of states (``engine.kv_cache.StateSnapshots``)."""
        self._allocate_decoder(num_pages, page_size, len(self.full_layers))
        if num_slots is None:
            num_slots = max(1, num_pages // -(-self.max_model_len // page_size))
        num_slots += num_snapshots                # state rows: the sequences' slots, then the snapshots
        self.num_slots = num_slots
        n_lin = len(self.linear_layers)
        self.conv_state = cuda.device_array((n_lin, num_slots, self.conv_dim, self.conv_kernel), BF16)  # a ring
        self.ssm_state = cuda.device_array((n_lin, num_slots, self.Hv, self.Dk, self.Dv), self.ssm_dtype)
        if n_lin:
            every_slot = cuda.to_device(np.arange(n_lin * num_slots, dtype=np.int32))
            gated_delta.clear_state_slots(*self._states_by_layer_slot(), every_slot, policy=self.policy)
        self._src_rows = cuda.to_device(np.zeros(max(1, n_lin), np.int32))   # rows a state launch reads / clears
        self._dst_rows = cuda.to_device(np.zeros(max(1, n_lin), np.int32))   # rows a copy writes

        T = self.max_tokens
        e = lambda *s: cuda.device_array(s, dtype=BF16)  # noqa: E731
        self.proj = e(T, self.proj_rows)      # and the linear-attention layers' own activations
        self.mixed = e(T, self.conv_dim)
        self.core = e(T, self.value_dim)
        self.chunk_scratch = gated_delta.allocate_chunk_scratch(T, self.Hk, self.Hv, self.chunk_size)
        self.seq_slots = cuda.to_device(np.zeros(self.max_rows, np.int32))
        self.seq_offsets = cuda.to_device(np.zeros(self.max_rows + 1, np.int32))

    def reset_slot(self, slot: int) -> None:
        """A new sequence takes ``slot``: zero its conv windows and delta-rule states in every linear layer."""
        if self.linear_layers:
            rows = self._layer_rows(self._src_rows, slot)
            gated_delta.clear_state_slots(*self._states_by_layer_slot(), rows, policy=self.policy)

    def copy_state(self, src: int, dst: int) -> None:
        """Copy state row ``src``'s conv windows and delta-rule states to row ``dst`` in every linear layer (a slot's
        state into a prefix-cache snapshot after the step that computed it, or a snapshot into a new sequence's
        slot), in stream order with the steps."""
        if self.linear_layers:
            gated_delta.copy_state_slots(*self._states_by_layer_slot(), self._layer_rows(self._src_rows, src),
                                         self._layer_rows(self._dst_rows, dst), policy=self.policy)

    def _layer_rows(self, buf, slot: int):
        """``buf`` (a device int32 ``[linear layers]``) set to slot ``slot``'s row of every linear layer in the
        ``_states_by_layer_slot`` view."""
        buf.copy_to_device((np.arange(len(self.linear_layers), dtype=np.int32) * self.num_slots + slot)
                           .astype(np.int32))
        return buf

    def _states_by_layer_slot(self):
        """Both state arrays viewed as ``[layers·slots, ...]``: row ``j·slots + s`` is linear layer j, slot s."""
        rows = len(self.linear_layers) * self.num_slots
        return (self.conv_state.reshape(rows, self.conv_dim, self.conv_kernel),
                self.ssm_state.reshape(rows, self.Hv, self.Dk, self.Dv))

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, step, block_tables, T: int, B: int, decode: bool = False, head=None, num_decode: int = 0,
                mixed: bool = False):
        """Run T tokens through the model; return the device logits view ``[B, V]`` for ``step.logit_rows[:B]``.
        ``step``: the step's device inputs (``engine.step_inputs.StepInputs``, as in ``Qwen3Model.forward``);
        ``decode``, ``head``, ``num_decode`` and ``mixed`` as there.  A mixed step's Gated DeltaNet layers take its
        first ``num_decode`` rows (the decodes and their padding rows) through the fused decode step, as in a decode
        step, and only the prompt chunks' rows through the chunked path (every row chunked, a decode as a one-token
        chunk, made a 64-decode + 128-token step 2.2x slower: docs/perf/gated_delta.md)."""
        eps, policy, ws = self.cfg.rms_norm_eps, self.policy, self.linear_workspace   # ws: split-K scratch
        ids, pos, slots = step.ids[:T], step.positions[:T], step.token_slots[:T]
        residual, spare = self.residuals[0][:T], self.residuals[1][:T]
        normed, delta, act = self.normed[:T], self.delta[:T], self.act[:T]
        fused_rows = num_decode if mixed else 0   # a mixed step's decode rows: the fused decode step
        fused_slots = slots[:fused_rows] if fused_rows else None
        decode_slots = slots if decode else None
        seq_slots, seq_offsets = self.seq_slots[:B - fused_rows], self.seq_offsets[:B - fused_rows + 1]
        if self.linear_layers and not decode:   # a decode step's Gated DeltaNet reads the token slots instead
            gated_delta.sequence_table(slots[fused_rows:], seq_slots, seq_offsets, policy=policy)
        token_by_token = T == B and not mixed

        first = self.layers[0]
        stream_in, row_ids = self._embed(ids, residual, first["qkv"] if 0 in self.full_layers else first["in_proj"])
        full_index = {layer: j for j, layer in enumerate(self.full_layers)}
        linear_index = {layer: j for j, layer in enumerate(self.linear_layers)}
        for i, lw in enumerate(self.layers):
            # residual add + input norm + the layer's first projection: one launch for one token
            first_w, first_out = (lw["qkv"], self.qkv[:T]) if i in full_index else (lw["in_proj"], self.proj[:T])
            linear.linear_add_rms_norm(stream_in if i == 0 else residual, delta if i > 0 else None, lw["input_ln"],
                                       eps, spare, first_w, first_out, normed_out=normed,
                                       row_ids=row_ids if i == 0 else None,
                                       residual_ready=i > 0 and policy.residual_ready("down", decode),
                                       workspace=ws, policy=policy, **QWEN35_NORM)
            residual, spare = spare, residual
            if i in full_index:
                self._full_attention(full_index[i], lw, delta, T, pos, slots, block_tables, decode, num_decode)
            else:
                self._linear_attention(linear_index[i], lw, delta, T, pos, seq_slots, seq_offsets, token_by_token,
                                       decode_slots, fused_slots)
            linear.linear_add_rms_norm(residual, delta, lw["post_ln"], eps, spare, lw["gate_up"], act, gated=True,
                                       normed_out=normed, residual_ready=policy.residual_ready("mixer", decode),
                                       workspace=ws, policy=policy, **QWEN35_NORM)
            residual, spare = spare, residual
            linear.linear(act, lw["down"], delta, workspace=ws, policy=policy)
        logits = self.logits[:B]
        if T == 1 and B == 1:
            linear.linear_add_rms_norm(residual, delta, self.final_norm, eps, spare, self.lm_head, logits,
                                       normed_out=normed, head=head,
                                       residual_ready=policy.residual_ready("down", decode), workspace=ws,
                                       policy=policy, **QWEN35_NORM)
        else:
            assert head is None, "the LM head's argmax is for one token (lm_head_argmax)"
            norm.add_rms_norm(residual, delta, self.final_norm, normed, eps, policy=policy, **QWEN35_NORM)
            last = self.last_hidden[:B]
            embedding.embedding(step.logit_rows[:B], normed, last, policy=policy)   # the rows that need logits
            linear.linear(last, self.lm_head, logits, workspace=ws, policy=policy)
        return logits

    def _full_attention(self, j, lw, delta, T, pos, slots, block_tables, decode: bool = False,
                        num_decode: int = 0) -> None:
        """Gated full attention of one layer (its q/gate, k, v projection already in ``self.qkv``):
        ``delta = (attention · sigmoid(gate)) @ W_o^T``."""
        qkv, q, attn = self.qkv[:T], self.q[:T], self.attn[:T]
        rope.qk_norm_rope_store(qkv, lw["q_norm"], lw["k_norm"], self.rope_cos, self.rope_sin, pos, slots,
                                block_tables, self.k_cache[j], self.v_cache[j], q, self.cfg.rms_norm_eps,
                                self.rotary_dim, q_head_stride=2 * self.D, decode=decode, policy=self.policy,
                                **QWEN35_NORM)
        attention.paged_attention(q, self.k_cache[j], self.v_cache[j], block_tables, slots, pos, attn,
                                  1.0 / math.sqrt(self.D), self.attn_workspace, decode=decode,
                                  num_decode=num_decode, gate=qkv, policy=self.policy)
        attn_flat = self.attn.reshape(self.max_tokens, self.nq * self.D)[:T]
        linear.linear_preloaded(attn_flat, lw["o"], delta,   # its weights copied in while attention ends
                                busy_sms=self.nkv, workspace=self.linear_workspace, policy=self.policy)

    def _linear_attention(self, j, lw, delta, T, pos, seq_slots, seq_offsets, token_by_token,
                          decode_slots=None, fused_slots=None) -> None:
        """Gated DeltaNet of one layer (its fused qkv/z/b/a projection already in ``self.proj``):
        ``delta = RMSNormGated(rule(silu(conv(qkv))), z) @ W_out^T``.  Token by token (decode, or a prompt scored
        row by row): conv, rule and gated norm in one launch (``gated_delta_decode_step``); prompt chunks: the
        conv, the chunked rule and the gated norm.  ``decode_slots``: the step's token slots when it is a decode step
        (the fused step then reads its state before waiting for the projection).  ``fused_slots``: the slots of a
        mixed step's first rows, its decodes, which then take the fused step as in a decode step, the rest (the
        table ``seq_slots`` / ``seq_offsets``) the chunked form."""
        cd, vd, hv = self.conv_dim, self.value_dim, self.Hv
        proj, mixed, core = self.proj[:T], self.mixed[:T], self.core[:T]
        qkv_in, z = proj[:, :cd], proj[:, cd:cd + vd]
        b, a = proj[:, cd + vd:cd + vd + hv], proj[:, cd + vd + hv:]
        eps = self.cfg.rms_norm_eps
        core_all = core
        if fused_slots is not None:
            d = fused_slots.shape[0]
            gated_delta.gated_delta_decode_step(qkv_in[:d], lw["conv_w"], self.conv_state[j], z[:d], a[:d], b[:d],
                                                lw["A_log"], lw["dt_bias"], lw["norm"], eps, self.ssm_state[j],
                                                fused_slots, self.seq_offsets[:d + 1], pos[:d], core[:d],
                                                decode_token_slots=fused_slots, policy=self.policy)
            qkv_in, z, a, b, pos, mixed, core = (v[d:] for v in (qkv_in, z, a, b, pos, mixed, core))
            T -= d
        if token_by_token:
            gated_delta.gated_delta_decode_step(qkv_in, lw["conv_w"], self.conv_state[j], z, a, b, lw["A_log"],
                                                lw["dt_bias"], lw["norm"], eps, self.ssm_state[j], seq_slots,
                                                seq_offsets, pos, core, decode_token_slots=decode_slots,
                                                policy=self.policy)
        else:
            gated_delta.causal_conv1d_silu(qkv_in, lw["conv_w"], self.conv_state[j], seq_slots, seq_offsets, pos,
                                           mixed, max_seq_tokens=T, tokens_per_thread=PREFILL_CONV_TOKENS_PER_THREAD,
                                           policy=self.policy)
            gated_delta.gated_delta_chunked(mixed, a, b, lw["A_log"], lw["dt_bias"], self.ssm_state[j], seq_slots,
                                            seq_offsets, core, self.chunk_scratch, max_seq_tokens=T,
                                            policy=self.policy)
            gated_delta.gated_rms_norm(core, z, lw["norm"], core, eps, policy=self.policy)
        linear.linear_preloaded(core_all, lw["out_proj"], delta,   # copied in while the step runs (released early)
                                workspace=self.linear_workspace, policy=self.policy)
