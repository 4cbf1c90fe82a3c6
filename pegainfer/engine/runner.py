"""Model runner: turns a scheduled step into device inputs, runs the forward pass and the sampler, and brings the
sampled token ids back to the host.

Decode steps of a given batch size can be captured once into a CUDA graph and replayed (``CudaGraphs``); the
per-step values (token ids, positions, slots, sampling parameters) live in device buffers that are refreshed
before each replay, so the graph itself never changes.  So do prompt chunks padded to a bucket and, for models
whose kernels skip padding wherever it sits (``pads_mixed``: Qwen3, and Qwen3.5, whose Gated DeltaNet kernels skip
a padding run between the decodes and the chunks), mixed steps padded to a (decode batch, prompt bucket, rows)
shape (``mixed``); eager steps are padded the same way, so both paths run the very same kernels.

Decode steps can also be *launched* without being waited for (``launch_decode`` → ``PendingStep``, read later by
``wait``), which is what the engine's async scheduling builds on: a step launched with ``ahead=1`` takes its input
token ids from the device -- the sampler writes the ids it draws over its step's input ids (``step.ids``), which
the forward pass has consumed by then, and the step ahead uploads all its other inputs but not those -- and its
positions and sampling counters one further than the host knows.  So between two decode steps the stream holds
one upload and the ids' copy to the host, nothing else (``keep_logits`` adds a copy of the logits), and a token
costs what its graph does (``docs/perf/launch.md``; ``benchmarks/step_profile.py gaps``).  Two pinned output buffers alternate between launches, so the result of the step being read is never overwritten by
the copy of the step launched after it; the pinned input mirrors are only rewritten once the previous upload
from them has completed (``_wait_inputs_free``; the grammar flags and bitmasks have a fence of their own,
as the two parts of a constrained step upload them at different times).

Structured output: before a step that samples a constrained sequence's next token, the host fills that row's
grammar bitmask (``text/structured.py``, llguidance) and flags the row; the step uploads the flagged rows' masks
with its inputs, and ``kernels/token_mask.py`` sets the logits of disallowed tokens to -inf on the device right
before the sampler.  The mask launch is part of every step (and of its graph): an unconstrained step's blocks read
a flag and leave.  A constrained row's mask depends on the token drawn the step before, so a decode step with such
rows is launched ahead in two parts: its forward pass (``launch_forward_ahead``, whose ids are already on the
device) before the host reads the previous step's tokens, and its mask + sampler (``launch_sample``) once the host
has them and has filled the masks -- the GPU computes the forward pass while the grammar engine works::

    host:  launch fwd N+1 │ wait N, append N, fill masks N+1 │ launch mask+sample N+1 │ launch fwd N+2 │ ...
    GPU:   ═ mask+sample N ╪═══════════ fwd N+1 ══════════════╪═ mask+sample N+1 ═════╪═ fwd N+2 ══ ...

The forward pass uploads every input but the ids and the grammar flags, the sampler the flags and masks: the host
stages fwd N+2 as soon as fwd N+1's upload has run, not after fwd N+1 itself (which would leave the GPU idle while
the host stages the next step).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.engine.cuda_graph import mixed_decode_rows, mixed_shape, prefill_bucket
from pegainfer.kernels import sampling
from pegainfer.kernels.launch import on_stream
from pegainfer.kernels.next_ids import gather_next_ids
from pegainfer.kernels.penalties import PenaltyState, initialize_slot
from pegainfer.kernels.token_mask import MASKED, PENALIZED, PenaltyInputs, apply_token_mask
from pegainfer.engine.step_inputs import StepInputs, TokenMasks, UploadFence, wait_event


@dataclass
class PendingForward:
    """A decode step whose forward pass is launched and whose mask + sampler are not (``launch_forward_ahead``)."""
    seqs: list
    B: int
    Bp: int          # its padded batch (``padded_batch``)


@dataclass
class PendingStep:
    """A launched step whose sampled ids are still on their way to pinned host buffer ``buffer``: the B rows of a
    decode step (``seqs[r]`` at row r), or of a mixed step (``rows[i]``: the row of ``seqs[i]``, a sequence that
    gets a token; ``logit_rows[i]``: its row in ``logits_host``'s order)."""
    seqs: list
    B: int
    buffer: int
    ahead: int       # 1: launched before the host had the previous step's tokens (its ids came from the device)
    rows: list | None = None
    logit_rows: list | None = None
    padded_decodes: int = 0     # a mixed step's decode rows (its chunks' rows follow)

    def row(self, i: int) -> int:
        """The sampled row of ``seqs[i]``."""
        return i if self.rows is None else self.rows[i]


class ModelRunner:
    def __init__(self, model, pool, max_batch: int, use_cuda_graph: bool = True):
        self.model = model
        self.pool = pool
        self.max_batch = max_batch
        self.stream = cuda.stream() if not SIMULATOR else 0
        T, R = model.max_tokens, model.max_rows
        self.step = StepInputs(T, R)
        self.h_ids, self.h_pos, self.h_slots, self.h_rows = (self.step.h_ids, self.step.h_pos, self.step.h_slots,
                                                             self.step.h_rows)
        self.sampling = self.step.sampling
        # Grammar bitmasks of the constrained rows (structured output), applied on the device before the sampler;
        # uploaded only for steps that have such rows (``_fill_masks``).
        self.masks = TokenMasks(R, model.V)
        self._mask_rows = 0             # rows of masks to upload with this step's inputs
        # Penalties and logit bias (``kernels/penalties.py``): a state per slot on the device, applied with the
        # masks; ``_penalty_owner[slot]``: the sequence whose state the slot holds (set up by ``_start_penalties``).
        self.penalties = PenaltyInputs(PenaltyState(pool.num_slots, model.V), self.sampling.step, self.step.ids,
                                       self.step.logit_rows, self.step.token_slots)
        self._penalty_owner: dict = {}
        self._mask_executor = None      # llguidance's thread pool, for steps with several constrained rows
        self.out_ids = self.step.ids[:R]    # the sampled ids (over the consumed input ids: ``forward_and_sample``)
        # a step's sampled ids kept for a step launched ahead over fewer rows, and that step's ids gathered from them
        self.prev_ids, self.next_ids = cuda.device_array(R, np.int32), cuda.device_array(R, np.int32)
        # Two pinned output buffers (and their copy-done events), used alternately by successive launches: the
        # host may read step N's ids while step N+1's ids are being copied into the other buffer.
        self.h_outs = [_pinned(R), _pinned(R)]
        self.out_done = [cuda.event(timing=False), cuda.event(timing=False)] if not SIMULATOR else [None, None]
        self._next_buffer = 0
        # Recorded after each upload from the pinned mirrors: a mirror may only be rewritten once the last copy from
        # it has executed, since an asynchronous copy reads pinned memory when it executes.  The step's inputs
        # (StepInputs but its grammar flags, SamplingBuffers) and the grammar flags with the bitmasks (TokenMasks)
        # have a fence each: a constrained step launched ahead uploads them in its two parts.
        self.inputs_uploaded = UploadFence()
        self.masks_uploaded = UploadFence()
        # A step launched ahead overwrites the model's logits before the host has read the previous step's tokens.
        # With ``keep_logits`` (tests, tools), or ``keep_logits_next`` for the next launch only (the engine, when a
        # sequence of the step before wants logprobs), the previous step's logits rows are first copied (on the
        # device, in stream order) here, and logits_host reads them while that ahead step is unread.  Allocated at
        # the first such copy.
        self.keep_logits = False
        self.keep_logits_next = False
        self.prev_logits = None
        self._prev_logits_kept = False
        self._unread_ahead: "PendingStep | None" = None
        self._launched_rows = 0         # sampled rows of the last decode or mixed step launched
        self.sample_workspace = sampling.allocate_sample_workspace(R, model.V)
        # one-sequence steps: the LM head picks a greedy row's token itself (``LaunchPolicy.head_argmax``)
        self.head_argmax = (sampling.HeadArgmax(self.out_ids, self.sample_workspace) if model.policy.head_argmax
                            else None)
        # Called once a step's ids are on their way to the host, right before the host waits for them (the GIL is
        # free during that wait): AsyncEngine hands the previous step's outputs to the server's event loop there.
        self.before_wait = None
        self.graphs = None
        # mixed steps run padded to ``cuda_graph.mixed_shape`` (model kernels that skip slot -1 tokens and rows
        # throughout, ``pads_mixed``); ``_row_order``: the padded step's rows of its sequences, for logits_host
        self.pad_mixed = bool(getattr(model, "pads_mixed", False)) and not SIMULATOR
        self._row_order = None
        self._prev_row_order = None     # the row order of the step before one launched ahead (``logits_host``)
        # decode batch sizes (``padded_batch``): those that get a graph; eager steps are padded the same way, so
        # both paths run the very same kernels
        self.decode_sizes = None
        if not SIMULATOR:
            from pegainfer.engine.cuda_graph import StepGraphs, decode_graph_sizes
            self.decode_sizes = decode_graph_sizes(max_batch)
            if use_cuda_graph:
                self.graphs = StepGraphs(self)

    # -------------------------------------------------------------------------------------------- inputs
    def padded_batch(self, B: int) -> int:
        """The batch a decode step of B sequences runs as: the smallest of ``decode_sizes`` (the captured graphs'
        sizes) that holds B, padded with empty rows; B itself when there are no sizes."""
        if self.decode_sizes is None:
            return B
        return next((size for size in self.decode_sizes if size >= B), B)

    def mixed_decode_rows(self, decodes: int) -> int:
        """The decode rows a padded mixed step of ``decodes`` decodes runs with (``cuda_graph.mixed_decode_rows``)."""
        return mixed_decode_rows(decodes, self.max_batch)

    def _wait_inputs_free(self) -> None:
        """Block until the last upload from the pinned input mirrors has executed (at once in synchronous use)."""
        self.inputs_uploaded.wait()

    def _upload(self, with_ids: bool = True, with_flags: bool = True) -> None:
        """Upload the staged step (one copy, with the sampling parameters) and, ``with_flags``, its grammar flags
        and the constrained rows' bitmasks."""
        s = self.stream
        self.pool.sync(s)
        self.step.upload(s, with_ids, with_flags)
        self.inputs_uploaded.record(s)
        if with_flags:
            if self._mask_rows:
                self.masks.upload(self._mask_rows, s)
            self.masks_uploaded.record(s)

    def _fill_masks(self, rows, B: int) -> None:
        """Flag the step's rows ``(seq, row)`` that sample: ``PENALIZED`` for a sequence with penalties or a logit
        bias (its slot's state set up first, ``_start_penalties``), ``MASKED`` with its grammar bitmask filled for
        one whose next token a grammar constrains; clear the flags of the step's other rows.  The mask depends on
        every token so far, so a step launched ahead gets its masks after its forward pass is launched
        (``launch_sample``); the penalties count the newest token on the device and need no such wait."""
        from pegainfer.text.structured import fill_masks
        self.masks_uploaded.wait()
        self.step.h_masked[:B] = 0
        for seq, row in rows:
            if seq.params.penalized:
                self._start_penalties(seq)
                self.step.h_masked[row] = PENALIZED
        todo = [(seq.constraint, row) for seq, row in rows if seq.constraint is not None and seq.constraint.masks]
        self._mask_rows = max(row for _, row in todo) + 1 if todo else 0
        if not todo:
            return
        if len(todo) > 1 and self._mask_executor is None:
            import llguidance
            self._mask_executor = llguidance.LLExecutor()
        fill_masks(todo, self.masks.host, self._mask_executor)
        for _, row in todo:
            self.step.h_masked[row] |= MASKED

    def _start_penalties(self, seq) -> None:
        """Set up ``seq``'s penalty state in its slot (on the stream, before the step that needs it) unless the slot
        holds it already: at its first sampled step, and after a preemption if another penalized sequence used
        the slot meanwhile (then from its prompt and output so far)."""
        if self._penalty_owner.get(seq.slot) is seq:
            return
        for slot in [slot for slot, owner in self._penalty_owner.items() if owner is seq]:
            del self._penalty_owner[slot]       # its state in a slot it left is stale
        p = seq.params
        with on_stream(self.stream):
            initialize_slot(self.penalties.state, seq.slot, seq.prompt_ids, seq.output_ids, p.repetition_penalty,
                            p.frequency_penalty, p.presence_penalty, p.logit_bias, policy=self.model.policy)
        self._penalty_owner[seq.slot] = seq

    def _set_sampling(self, row: int, seq, ahead: int = 0) -> None:
        p = seq.params
        self.sampling.set_row(row, p.temperature, p.top_k, p.top_p, p.min_p, seq.seed, len(seq.output_ids) + ahead)

    def forward_and_sample(self, T: int, B: int, decode: bool = False, num_decode: int = 0, mixed: bool = False):
        """Run the model on the uploaded step and sample B tokens (device) into ``out_ids`` -- the step's first B
        input ids, which the forward pass has consumed (so a decode step launched next on the device finds its
        ids in place); returns the logits view.  ``decode``: T = B sequences, one newest token each (the model's
        ``forward``); ``num_decode``: a mixed step's leading decode tokens; ``mixed``: one of ``mixed``'s steps, padded
        or not (the model's kernels must not depend on the padding: ``models/qwen35.py``)."""
        head = self.head_argmax if self.head_argmax is not None and self.model.lm_head_argmax(T, B) else None
        logits = self.model.forward(self.step, self.pool.block_tables, T, B, decode=decode, head=head,
                                    num_decode=num_decode, mixed=mixed)
        apply_token_mask(logits, self.masks.device, self.step.masked_rows, self.sampling.temperature, head=head,
                         penalties=self.penalties, policy=self.model.policy)
        sampling.sample(logits, self.sampling, self.out_ids[:B], self.sample_workspace, head=head,
                        policy=self.model.policy)
        return logits

    def _copy_out(self, B: int) -> int:
        """Enqueue the copy of the B sampled ids into the next pinned output buffer; returns the buffer's index."""
        i = self._next_buffer
        self._next_buffer = 1 - i
        self.out_ids[:B].copy_to_host(self.h_outs[i][:B], stream=self.stream)
        if self.out_done[i] is not None:
            self.out_done[i].record(self.stream)
        return i

    def _read_out(self, buffer: int, B: int) -> np.ndarray:
        """Wait for the ids copied into ``buffer`` (``before_wait`` first, if set)."""
        if self.before_wait is not None:
            self.before_wait()
        if self.out_done[buffer] is not None:
            wait_event(self.out_done[buffer])
        return np.array(self.h_outs[buffer][:B])

    def _finish(self, B: int) -> np.ndarray:
        """Copy the B sampled ids to pinned host memory and wait for them."""
        return self._read_out(self._copy_out(B), B)

    # -------------------------------------------------------------------------------------------- steps
    def prefill(self, seq, start: int, length: int, want_logits: bool = False, force_eager: bool = False):
        """Run tokens [start, start+length) of one sequence (its prompt, or after a preemption its prompt and
        output). Returns the sampled next token when this chunk ends the sequence's tokens (else None), and the
        logits rows if ``want_logits`` (all rows of the chunk).

        Without ``want_logits`` a chunk of at most PREFILL_GRAPH_MAX tokens is padded to its bucket (padding tokens
        have slot -1: no K/V written, output ignored) and replayed from the bucket's CUDA graph when captured."""
        T = length
        ids = seq.token_ids[start:start + length]
        last = start + length >= seq.num_tokens
        self._wait_inputs_free()
        self._row_order = None
        self.h_ids[:T] = ids
        self.h_pos[:T] = np.arange(start, start + length, dtype=np.int32)
        self.h_slots[:T] = seq.slot
        bucket = None
        if want_logits:
            assert T <= self.model.max_rows, "want_logits prefill needs max_rows >= chunk length"
            B = T
            self.h_rows[:B] = np.arange(T, dtype=np.int32)
            for r in range(B):
                self._set_sampling(r, seq)
            self._fill_masks([(seq, B - 1)] if last else (), B)
        else:
            B = 1
            self.h_rows[0] = T - 1
            self._set_sampling(0, seq)
            self._fill_masks([(seq, 0)] if last else (), 1)
            # Pad to a fixed bucket whether or not graphs are on, so both paths run the very same kernels.
            pads = getattr(self.model, "pads_prefill", False)   # model kernels skip tokens whose slot is -1
            bucket = prefill_bucket(T, self.model.max_tokens) if pads and not SIMULATOR else None
            if bucket is not None:
                self.h_ids[T:bucket] = 0
                self.h_pos[T:bucket] = 0
                self.h_slots[T:bucket] = -1
        with on_stream(self.stream):
            if bucket is not None:
                self._upload()
                if self.graphs is not None and not force_eager and self.graphs.has(bucket, B):
                    self.graphs.replay(bucket, B)
                    logits = self.model.logits[:B]
                else:
                    logits = self.forward_and_sample(bucket, B)
            else:
                self._upload()
                logits = self.forward_and_sample(T, B)
        out = self._finish(B)
        token = int(out[B - 1]) if last else None
        return token, (logits if want_logits else None)

    def decode(self, seqs, force_eager: bool = False):
        """One token for each sequence in ``seqs`` (their last token goes in; the sampled next token comes out)."""
        return self.wait(self.launch_decode(seqs, force_eager=force_eager))

    def mixed(self, decodes, chunks, force_eager: bool = False) -> list[int]:
        """One step of decodes and prompt chunks (``scheduler.ScheduledStep``), waited for: the sampled token of
        every row, decodes then chunks (meaningful for the rows whose chunk ends its sequence's tokens);
        ``logits_host`` gives the rows in that order.  ``launch_mixed`` without the wait."""
        pending = self.launch_mixed(decodes, chunks, force_eager)
        out = self._read_out(pending.buffer, pending.B)
        return [int(out[r]) for r in mixed_row_order(len(decodes), pending.padded_decodes, len(chunks))]

    def launch_mixed(self, decodes, chunks, force_eager: bool = False, rows_before=None) -> PendingStep:
        """Enqueue one step of decodes and prompt chunks (``scheduler.ScheduledStep``: the decode tokens first, then
        each chunk's tokens; one logits row per sequence, a decode's token or a chunk's last token) without waiting
        for it: a ``PendingStep`` of the sequences that get a token (the decodes, the chunks that end their
        sequence's tokens), read with ``wait``.  ``rows_before``: the decodes' rows in the step last launched, which
        the host has not read: the step is launched ahead (``launch_decode``'s ``ahead=1``: their ids gathered on the
        device, positions and sampling counters one further); the chunks' tokens come from the host.

        With ``pad_mixed`` the step runs padded to ``cuda_graph.mixed_shape`` (Dp, Cp, Rp): decode rows up to Dp
        (slot -1, as ``_stage_decode`` pads), chunk tokens up to Cp (slot -1, as ``prefill`` pads), chunk rows up
        to Rp (greedy rows of a real token, their draws ignored).  Its launches are then fixed by the shape, so it
        replays the shape's CUDA graph (``StepGraphs.replay_or_capture``) or, eagerly, the very same kernels."""
        nd, nc = len(decodes), len(chunks)
        L = sum(n for _, _, n in chunks)
        shape = None
        if self.pad_mixed:
            Dp = self.mixed_decode_rows(nd)
            shape = mixed_shape(Dp, L, nc, self.model.max_tokens, self.model.max_rows)
        Dp, Cp, Rp = shape if shape is not None else (nd, L, nc)
        B = Dp + Rp
        ahead = int(rows_before is not None)
        assert not ahead or (len(rows_before) == nd and nd and all(seq.constraint is None for seq in decodes))
        self._prev_row_order = self._row_order
        self._wait_inputs_free()
        sampled = []
        for r, seq in enumerate(decodes):
            self.h_ids[r] = rows_before[r] if ahead else seq.last_token()
            self.h_pos[r] = seq.num_tokens - 1 + ahead
            self.h_slots[r] = seq.slot
            self.h_rows[r] = r
            self._set_sampling(r, seq, ahead)
            sampled.append((seq, r))
        self._pad_rows(nd, Dp)
        t = Dp
        for j, (seq, start, n) in enumerate(chunks):
            r = Dp + j
            self.h_ids[t:t + n] = seq.token_ids[start:start + n]
            self.h_pos[t:t + n] = np.arange(start, start + n, dtype=np.int32)
            self.h_slots[t:t + n] = seq.slot
            self.h_rows[r] = t + n - 1
            self._set_sampling(r, seq)
            if start + n >= seq.num_tokens:
                sampled.append((seq, r))
            t += n
        T = Dp + Cp
        self.h_ids[t:T] = 0            # padding tokens: slot -1, no K/V written, outputs ignored
        self.h_pos[t:T] = 0
        self.h_slots[t:T] = -1
        for r in range(Dp + nc, B):    # padding rows: a greedy draw from the last real token, ignored
            self.h_rows[r] = t - 1
            self.sampling.set_row(r, 0.0, 0, 1.0, 0.0, 0, 0)
        self._fill_masks(sampled, B)
        self._row_order = mixed_row_order(nd, Dp, nc) if shape is not None else None
        with on_stream(self.stream):
            self._upload_ahead(ahead, rows_before, nd)
            run = lambda: self.forward_and_sample(T, B, num_decode=Dp, mixed=True)   # noqa: E731
            if self.graphs is None or force_eager:
                run()
            else:
                self.graphs.replay_or_run(("mixed", Dp, Cp, Rp) if shape is not None else None, run)
            buffer = self._copy_out(B)
        self._launched_rows = B
        seqs, rows = [seq for seq, _ in sampled], [r for _, r in sampled]
        pending = PendingStep(seqs, B, buffer, ahead, rows=rows,
                              logit_rows=[r if r < nd else nd + r - Dp for r in rows], padded_decodes=Dp)
        self._unread_ahead = pending if ahead else None
        return pending

    def _pad_rows(self, first: int, end: int) -> None:
        """Decode padding rows ``first .. end``: slot -1 (no K/V written, nothing read), a greedy draw ignored."""
        for r in range(first, end):
            self.h_ids[r] = 0
            self.h_pos[r] = 0
            self.h_slots[r] = -1
            self.h_rows[r] = r
            self.sampling.set_row(r, 0.0, 0, 1.0, 0.0, 0, 0)

    def warm_mixed(self, Dp: int, Cp: int, Rp: int) -> None:
        """Capture the graph of mixed shape (Dp, Cp, Rp) at warm-up, a step whose every token is padding (touching
        no sequence): captured at once, as a shape met while serving is; only when that fails, one eager run
        (compiling what the shape needs) and the capture again."""
        T, B = Dp + Cp, Dp + Rp
        self._wait_inputs_free()
        self.h_ids[:T] = 0
        self.h_pos[:T] = 0
        self.h_slots[:T] = -1
        for r in range(B):
            self.h_rows[r] = 0
            self.sampling.set_row(r, 0.0, 0, 1.0, 0.0, 0, 0)
        self._fill_masks((), B)
        self._row_order = None
        run = lambda: self.forward_and_sample(T, B, num_decode=Dp, mixed=True)   # noqa: E731
        with on_stream(self.stream):
            self._upload()
            if not self.graphs.try_capture(("mixed", Dp, Cp, Rp), run, quiet=True):
                run()
                self.graphs.try_capture(("mixed", Dp, Cp, Rp), run)

    def launch_decode(self, seqs, ahead: int = 0, force_eager: bool = False, rows_before=None) -> PendingStep:
        """Enqueue one decode step for ``seqs`` (uploads, forward + sample, the copy of the ids to a pinned buffer)
        without waiting for it; ``wait`` reads its ids.

        ``ahead=0``: each sequence's last host token goes in at position ``num_tokens - 1``.
        ``ahead=1``: the step right after the one last launched, launched before the host has read that step's
        tokens, positions and sampling counters one further.  For the very same ``seqs`` in the same order
        (``rows_before`` None) the input ids are that step's ``out_ids``, already in place on the device (its
        sampler wrote them over its input ids; this step's upload leaves them alone).  For some of them
        (``rows_before[r]``: the row ``seqs[r]`` had in that step; sequences that finished, or finish with it, left
        out) the step first copies those ids aside (``prev_ids``), uploads each row's ``rows_before`` entry as its
        id, and gathers (``kernels/next_ids.py``).  The caller must have reserved pages for position
        ``num_tokens``."""
        assert not ahead or all(seq.constraint is None for seq in seqs), \
            "a constrained step launches ahead in two parts (launch_forward_ahead)"
        assert rows_before is None or (ahead and len(rows_before) == len(seqs))
        self._prev_row_order = self._row_order
        B, Bp = self._stage_decode(seqs, ahead, rows_before)
        self._fill_masks(list(zip(seqs, range(B))), Bp)
        with on_stream(self.stream):
            self._upload_ahead(ahead, rows_before, B)
            if self.graphs is not None and not force_eager and self.graphs.has(Bp, Bp):
                self.graphs.replay(Bp, Bp)
            else:
                self.forward_and_sample(Bp, Bp, decode=True)
            buffer = self._copy_out(B)
        pending = PendingStep(list(seqs), B, buffer, ahead)
        self._unread_ahead = pending if ahead else None
        self._launched_rows = B
        return pending

    def _upload_ahead(self, ahead: int, rows_before, n: int) -> None:
        """Upload the staged step (on the current stream).  Launched ahead (``ahead``), first keep the logits of the
        step before if asked (``keep_logits``); with ``rows_before`` (its first ``n`` rows' rows in the step before,
        staged as their ids), copy that step's sampled ids aside before the upload overwrites them, and gather
        those rows' ids from them after it (``kernels/next_ids.py``, then a copy over the ids)."""
        n_before = self._launched_rows if ahead else n      # the sampled rows of the step before
        assert rows_before is None or max(rows_before) < n_before
        self._keep_logits_before(ahead, n_before)
        if rows_before is not None:
            self.prev_ids[:n_before].copy_to_device(self.out_ids[:n_before], stream=self.stream)
        self._upload(with_ids=not ahead or rows_before is not None)
        if rows_before is not None:
            gather_next_ids(self.next_ids, self.step.ids, self.prev_ids, n)
            self.step.ids[:n].copy_to_device(self.next_ids[:n], stream=self.stream)

    def _stage_decode(self, seqs, ahead: int, rows_before=None) -> tuple[int, int]:
        """Write a decode step's inputs for ``seqs`` into the pinned mirrors (``launch_decode``'s ``ahead`` and
        ``rows_before``), padding rows up to ``padded_batch``; returns (B, padded B)."""
        B = len(seqs)
        Bp = self.padded_batch(B)
        self._wait_inputs_free()
        for r, seq in enumerate(seqs):
            if ahead == 0:
                self.h_ids[r] = seq.last_token()
            elif rows_before is not None:
                self.h_ids[r] = rows_before[r]      # gathered into the id on the device (``launch_decode``)
            self.h_pos[r] = seq.num_tokens - 1 + ahead
            self.h_slots[r] = seq.slot
            self.h_rows[r] = r
            self._set_sampling(r, seq, ahead)
        self._pad_rows(B, Bp)
        self._row_order = None
        return B, Bp

    def _keep_logits_before(self, ahead: int, B: int) -> None:
        """With ``keep_logits`` (or ``keep_logits_next``, then cleared), copy the logits of the step about to be
        overwritten by one launched ahead."""
        self._prev_logits_kept = bool(ahead and (self.keep_logits or self.keep_logits_next))
        self.keep_logits_next = False
        if self._prev_logits_kept:
            if self.prev_logits is None:
                self.prev_logits = cuda.device_array(self.model.logits.shape, self.model.logits.dtype)
            self.prev_logits[:B].copy_to_device(self.model.logits[:B], stream=self.stream)

    def launch_forward_ahead(self, seqs) -> "PendingForward":
        """The forward pass of the decode step after the one last launched (``launch_decode(ahead=1)``'s inputs),
        without its mask and sampler: for steps with grammar-constrained rows, whose masks need the tokens of the
        step in flight.  ``launch_sample`` finishes it."""
        self._prev_row_order = self._row_order
        B, Bp = self._stage_decode(seqs, ahead=1)
        with on_stream(self.stream):
            self._keep_logits_before(1, self._launched_rows)
            self._upload(with_ids=False, with_flags=False)
            self._replay_or_run(("forward", Bp), lambda: self.forward_only(Bp))
        return PendingForward(list(seqs), B, Bp)

    def launch_sample(self, fwd: "PendingForward") -> PendingStep:
        """The grammar masks and the sampler of a step whose forward pass ``launch_forward_ahead`` launched: fill the
        masks of its still-running constrained rows (their previous tokens are now on the host), upload them with
        the rows' flags, sample, and start the ids' copy to the host."""
        from pegainfer.engine.sequence import Status
        live = [(seq, r) for r, seq in enumerate(fwd.seqs) if seq.status is not Status.FINISHED]
        self._fill_masks(live, fwd.Bp)
        with on_stream(self.stream):
            self.step.upload_flags(fwd.Bp, self.stream)
            if self._mask_rows:
                self.masks.upload(self._mask_rows, self.stream)
            self.masks_uploaded.record(self.stream)
            self._replay_or_run(("sample", fwd.Bp), lambda: self.sample_only(fwd.Bp))
            buffer = self._copy_out(fwd.B)
        pending = PendingStep(fwd.seqs, fwd.B, buffer, 1)
        self._unread_ahead = pending
        self._launched_rows = fwd.B
        return pending

    def forward_only(self, B: int) -> None:
        """A decode step's forward pass for B rows (the logits in ``model.logits[:B]``), no mask or sampler."""
        self.model.forward(self.step, self.pool.block_tables, B, B, decode=True)

    def sample_only(self, B: int) -> None:
        """The grammar mask and the sampler over ``model.logits[:B]`` (``forward_only``'s output)."""
        logits = self.model.logits[:B]
        apply_token_mask(logits, self.masks.device, self.step.masked_rows, self.sampling.temperature,
                         penalties=self.penalties, policy=self.model.policy)
        sampling.sample(logits, self.sampling, self.out_ids[:B], self.sample_workspace, policy=self.model.policy)

    def _replay_or_run(self, key, run) -> None:
        """Replay the graph of ``key`` (captured at first use when graphs are on), else launch ``run`` eagerly."""
        if self.graphs is None:
            run()
            return
        if not self.graphs.has(*key):
            self.graphs.capture_fn(key, run)
        self.graphs.replay(*key)

    def wait(self, pending: PendingStep) -> list[int]:
        """The ids sampled by a launched decode step (blocks until they are on the host)."""
        if pending is self._unread_ahead:
            self._unread_ahead = None
        return [int(x) for x in self._read_out(pending.buffer, pending.B)]

    def logits_host(self, B: int) -> np.ndarray:
        """The logits rows of the last step whose ids were read, as float32 on the host (for logprobs and tests);
        while a step launched ahead is unread, these are the copy taken before it overwrote the model's logits.
        After a padded mixed step, row i is its i-th sequence's (decodes, then chunks: ``mixed``'s order)."""
        from pegainfer.kernels.primitives import from_bf16_bits
        logits, order = self.model.logits, self._row_order
        if self._unread_ahead is not None:
            if not self._prev_logits_kept:
                raise RuntimeError("the step whose logits were asked for was overwritten by a step launched ahead: "
                                   "set runner.keep_logits = True before decoding")
            logits, order = self.prev_logits, self._prev_row_order
            self._wait_inputs_free()    # the copy into prev_logits precedes the ahead step's upload on the stream
        if order is not None:           # a padded mixed step: its sequences' rows, in step order
            return from_bf16_bits(logits[:order[B - 1] + 1].copy_to_host()[order[:B]])
        return from_bf16_bits(logits[:B].copy_to_host())


def mixed_row_order(nd: int, padded_decodes: int, nc: int) -> list[int]:
    """The sampled rows of a mixed step's ``nd`` decodes and ``nc`` chunks, in that order (the chunks' rows follow
    the ``padded_decodes`` decode rows)."""
    return list(range(nd)) + list(range(padded_decodes, padded_decodes + nc))


def _pinned(n: int) -> np.ndarray:
    if SIMULATOR:
        return np.zeros(n, dtype=np.int32)
    return cuda.pinned_array(n, dtype=np.int32)
