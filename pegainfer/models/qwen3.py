"""Qwen3 (dense, GQA) forward pass as a sequence of kernel launches over preallocated buffers.

One forward call processes a flat batch of T tokens (vLLM style): a prefill chunk of one sequence, or one decode
token for each of B sequences. Token t has id ``ids[t]``, position ``positions[t]`` and belongs to slot
``token_slots[t]``; the KV cache is paged (see ``engine/kv_cache.py``). Per decoder layer::

    residual = residual + delta ; qkv = rms_norm(residual) @ W_qkv^T      [T, (nq + 2 nkv) D]   (q, k, v fused)
    q, K, V  = rope(rms_norm_head(q)), rope(rms_norm_head(k)), v → K/V written into the paged cache
    attn     = softmax(q K^T / sqrt(D)) V                [T, nq, D]    (causal via positions, GQA)
    delta    = attn @ W_o^T
    residual = residual + delta ; act = silu(n W_gate^T) * (n W_up^T), n = rms_norm(residual)
    delta    = act @ W_down^T

(the first layer has no delta to add) and finally ``logits = rms_norm(residual + delta)[logit_rows] @ W_lm^T``.
Every intermediate is bf16 (uint16 bits), rounded where Hugging Face's bf16 forward rounds, so logits line up with
``transformers``.

Each "residual add, RMSNorm, projection" is one ``linear.linear_add_rms_norm`` call: for one token (batch-1
decode) a single GEMV launch whose blocks compute the add and the norm while staging their input, otherwise an
add + norm launch into ``normed`` and the projection.  It reads the residual stream from one buffer and writes the
updated stream to the other, so the two residual buffers swap roles at every norm.
"""
from __future__ import annotations

import math

from pegainfer.kernels import attention, embedding, linear, norm, rope
from pegainfer.kernels.policy import DEFAULT_POLICY
from pegainfer.models.common import DecoderModel, upload_stacked


class Qwen3Model(DecoderModel):
    """Qwen3ForCausalLM: weights, KV cache and activation buffers on the device, and the forward pass."""

    arch = "qwen3"
    pads_prefill = True    # every kernel skips tokens with slot -1, so prefill chunks can be padded to graph sizes
    # ... wherever they are in the step, and a step's launches depend only on its token and row counts, so mixed
    # steps can be padded too: decode rows and chunk tokens with slot -1 (``cuda_graph.mixed_shape``)
    pads_mixed = True

    def __init__(self, cfg, max_model_len: int, max_tokens: int, max_rows: int, policy=DEFAULT_POLICY):
        super().__init__(cfg, max_model_len, max_tokens, max_rows, policy)
        self.qkv_rows = (self.nq + 2 * self.nkv) * self.D
        self.rotary_dim = self.D

    # ------------------------------------------------------------------------------------------------ sizes
    def weight_bytes(self) -> int:
        """Bytes of bf16 weights on the device (what a decode step must read)."""
        H, I, V, D = self.H, self.I, self.V, self.D
        per_layer = self.qkv_rows * H + H * self.nq * D + 2 * I * H + H * I + 2 * H + 2 * D
        lm = 0 if self.cfg.tie_word_embeddings else V * H
        return 2 * (V * H + self.L * per_layer + H + lm)

    def projection_shapes(self) -> list[tuple[int, int, bool]]:
        H = self.H
        return [(self.qkv_rows, H, False), (H, self.nq * self.D, False), (2 * self.I, H, True), (H, self.I, False),
                (self.V, H, False)]

    def kv_bytes_per_token(self) -> int:
        return 2 * self.L * 2 * self.nkv * self.D

    def scratch_bytes(self) -> int:
        T, H = self.max_tokens, self.H
        elems = T * (4 * H + self.qkv_rows + 2 * self.nq * self.D + 2 * self.I) + self.max_rows * (H + self.V)
        return 2 * elems + 4 * attention.attention_workspace_size(T, self.nq, self.D, self.max_model_len, nkv=self.nkv) + \
            4 * self.linear_workspace_size()

    # ------------------------------------------------------------------------------------------------ weights
    def load_weights(self, reader, progress=None) -> None:
        H, D, p = self.H, self.D, reader.prefix
        self._load_embeddings(reader)
        self.layers = []
        for i in range(self.L):
            a = f"{p}layers.{i}."
            s = a + "self_attn."
            q_rows, kv_rows = self.nq * D, self.nkv * D
            lw = {"input_ln": reader.upload(a + "input_layernorm.weight", (H,)),
                  "post_ln": reader.upload(a + "post_attention_layernorm.weight", (H,)),
                  "qkv": upload_stacked(reader, ((s + "q_proj.weight", q_rows), (s + "k_proj.weight", kv_rows),
                                                 (s + "v_proj.weight", kv_rows)), H),
                  "q_norm": reader.upload(s + "q_norm.weight", (D,)),
                  "k_norm": reader.upload(s + "k_norm.weight", (D,)),
                  "o": reader.upload(s + "o_proj.weight", (H, self.nq * D))}
            lw.update(self._load_mlp(reader, a))
            self.layers.append(lw)
        self._load_rope_tables()

    # ------------------------------------------------------------------------------------------------ buffers
    def allocate(self, num_pages: int, page_size: int, num_slots: int | None = None) -> None:
        """KV cache pages and activation scratch; called once after the memory check (``num_slots``: Qwen3 keeps
        nothing per slot)."""
        self._allocate_decoder(num_pages, page_size, self.L)

    def reset_slot(self, slot: int) -> None:
        """A new sequence takes ``slot`` (no per-slot state besides KV pages for Qwen3)."""

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, step, block_tables, T: int, B: int, decode: bool = False, head=None, num_decode: int = 0,
                mixed: bool = False):
        """Run T tokens through the model; return the device logits view ``[B, V]`` for ``step.logit_rows[:B]``.

        ``step`` holds the step's device inputs (``engine.step_inputs.StepInputs``): int32 ``ids``, ``positions``,
        ``token_slots`` (first T entries used) and ``logit_rows`` (first B: which token rows produce logits).
        ``decode``: every token is its sequence's newest (a decode step, not a prompt chunk), which lets attention
        read the older keys before the kernel storing the new one has finished (``attention.paged_attention``).
        ``head`` (``sampling.HeadArgmax``, only where ``lm_head_argmax(T, B)``): the LM head also writes the row's
        greedy token there.  ``num_decode``: a mixed step whose first ``num_decode`` tokens are decodes and the rest
        prompt chunks (``engine/scheduler.py``): attention takes the two kinds in separate launches.  ``mixed``: the
        step is a mixed step (decodes and prompt chunks, or several chunks; padded or not): Qwen3 launches the same
        kernels either way (Qwen3.5's Gated DeltaNet layers then take their chunked form)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        ids, pos, slots = step.ids[:T], step.positions[:T], step.token_slots[:T]
        residual, spare = self.residuals[0][:T], self.residuals[1][:T]
        normed, delta = self.normed[:T], self.delta[:T]
        qkv, q, attn, act = self.qkv[:T], self.q[:T], self.attn[:T], self.act[:T]
        attn_flat = self.attn.reshape(self.max_tokens, self.nq * self.D)[:T]
        scale = 1.0 / math.sqrt(self.D)

        policy, ws = self.policy, self.linear_workspace    # ws: the tensor-core GEMM's split-K scratch
        stream_in, row_ids = self._embed(ids, residual, self.layers[0]["qkv"])
        for i, lw in enumerate(self.layers):
            linear.linear_add_rms_norm(stream_in if i == 0 else residual, delta if i > 0 else None, lw["input_ln"],
                                       eps, spare, lw["qkv"], qkv, normed_out=normed,
                                       row_ids=row_ids if i == 0 else None,
                                       residual_ready=i > 0 and policy.residual_ready("down", decode),
                                       workspace=ws, policy=policy)
            residual, spare = spare, residual
            rope.qk_norm_rope_store(qkv, lw["q_norm"], lw["k_norm"], self.rope_cos, self.rope_sin, pos, slots,
                                    block_tables, self.k_cache[i], self.v_cache[i], q, eps, self.rotary_dim,
                                    q_head_stride=self.D, decode=decode, policy=policy)
            attention.paged_attention(q, self.k_cache[i], self.v_cache[i], block_tables, slots, pos, attn,
                                      scale, self.attn_workspace, decode=decode, num_decode=num_decode,
                                      policy=policy)
            linear.linear_preloaded(attn_flat, lw["o"], delta,   # its weights copied in while attention ends
                                    busy_sms=self.nkv, workspace=ws, policy=policy)
            linear.linear_add_rms_norm(residual, delta, lw["post_ln"], eps, spare, lw["gate_up"], act, gated=True,
                                       normed_out=normed, residual_ready=policy.residual_ready("mixer", decode),
                                       workspace=ws, policy=policy)
            residual, spare = spare, residual
            linear.linear(act, lw["down"], delta, workspace=ws, policy=policy)
        logits = self.logits[:B]
        if T == 1 and B == 1:
            # one row, which is the logits row: the final norm is the LM head's prologue
            linear.linear_add_rms_norm(residual, delta, self.final_norm, eps, spare, self.lm_head, logits,
                                       normed_out=normed, head=head,
                                       residual_ready=policy.residual_ready("down", decode), workspace=ws,
                                       policy=policy)
        else:
            assert head is None, "the LM head's argmax is for one token (lm_head_argmax)"
            norm.add_rms_norm(residual, delta, self.final_norm, normed, eps, policy=policy)
            last = self.last_hidden[:B]
            embedding.embedding(step.logit_rows[:B], normed, last, policy=policy)   # the rows that need logits
            linear.linear(last, self.lm_head, logits, workspace=ws, policy=policy)
        return logits
