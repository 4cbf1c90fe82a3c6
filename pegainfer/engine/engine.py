"""The engine: owns the model, the page pool, the scheduler and the runner, and advances every request by one
step per ``step()`` call. It is single-threaded by design; ``async_engine.AsyncEngine`` drives it from a background
thread for the server, and the CLI calls it directly.

Async scheduling (``async_scheduling=True``, the default) hides the host's per-step work — scheduling, building
and uploading the step inputs, launching the graph, reading the ids back, ``_append`` with detokenisation and stop
checks — behind the GPU's work. While decode step N runs, step N+1 of the same batch is launched before N's tokens
reach the host: its input ids are N's ``out_ids``, which N's sampler wrote in place on the device (stream order
makes that correct), its positions and sampling counters one further, its pages reserved beforehand. Then the host
reads and processes N::

    host:  launch N │ launch N+1 │ wait N, append N │ launch N+2 │ wait N+1, append N+1 │ ...
    GPU:   ═══ N ═══════════════╪═══ N+1 ═════════════════╪═══ N+2 ══════════════════════ ...
                                 (no idle gap: N+1 was queued before the host began on N's tokens)

    step() call k:  [step N in flight]  → launch N+1 (ahead) → read + append N → return N's outputs
                                          └ unless N+1 must wait for N's tokens, otherwise:
                    [step N in flight]  → read + append N → return (the next call schedules normally)

Step N+1 is launched ahead whenever only sequences leaving and prompts joining change the batch: no pending
abort, every running sequence gets a token from N or is a prompt in chunks, no recurrent state is to be kept after
N, and pages for position +1 are available (when a sequence wants logprobs, N+1 first copies N's logits, which it
overwrites).  N+1 leaves out the sequences N surely finishes (max_tokens, context full) and those already finished
(at N-1, read after N was launched); the next chunks of prompts and of waiting requests join it (a mixed step).
Its decode rows take their ids on the device from their rows of N (``runner.launch_decode`` / ``launch_mixed``'s
``rows_before``: a copy of N's sampled ids, the row map uploaded as the ids, a gather), so neither a finishing
stream nor an arriving one makes the GPU wait for the host; a mixed step is itself launched without waiting for
it.  When a sequence follows a grammar, N+1's mask depends on N's token: then only N+1's forward pass goes ahead
(for N's very batch, nobody joining), and its masks and sampler are launched once N's tokens are read
(``runner.py``).  A sequence that turns out to stop at N (EOS, stop string, ...) is finished as usual; its N+1
token is discarded when read (a token for a finished sequence is never emitted), and N+2 leaves it out.  Every
other token is the token the synchronous engine would produce: a greedy or seeded draw depends only on the
sequence's history and its counter -- provided the model's per-row results do not depend on which other rows share
the batch (step N+1 may still carry a row for a sequence that stopped at N, and a request that arrives after N+1
was launched joins N+2).
Pinned buffers: the runner alternates two output buffers and rewrites its input mirrors (and the pool its block
table) only after the previous upload from them has executed.

A request for its prompt's logprobs (``SamplingParams.prompt_logprobs``: ``echo`` with ``logprobs``) waits outside
the scheduler until no step is in flight and a slot and its pages are free (no step is launched ahead, and no
waiting request admitted, meanwhile); then ``_score_prompt`` prefills it alone, in chunks whose every row keeps its
logits, and it decodes like any other request from there."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Optional

from pegainfer import hub
from pegainfer.engine import heap
from pegainfer.engine.cuda_graph import MIXED_MIN_ROWS, MIXED_SPARE_ROWS
from pegainfer.engine.kv_cache import PagePool, StateSnapshots
from pegainfer.engine.runner import ModelRunner, PendingStep
from pegainfer.engine.scheduler import Scheduler
from pegainfer.engine.sequence import Sequence, Status
from pegainfer.engine.stopping import text_and_finish_reason
from pegainfer.engine.types import RequestOutput, SamplingParams, TokenLogprob
from pegainfer.device import SIMULATOR, require_supported_gpu
from pegainfer.errors import PegainferError, RequestError
from pegainfer.kernels.launch import traced
from pegainfer.kernels.penalties import penalty_state_bytes
from pegainfer.kernels.policy import LaunchPolicy

log = logging.getLogger("pegainfer.engine")

SCHEDULING_POLICIES = ("fcfs", "priority")
"""How waiting requests are ordered (and which running one a short pool preempts): by arrival, or by
``SamplingParams.priority`` then arrival (``scheduler.py``)."""

PAGE_SIZE = 16
SCORE_ROWS = 16   # logits rows per step: ≥ the decode batch, and the chunk size of score()
PREFIX_STATE_SNAPSHOTS = 16
"""A hybrid model's copies of its recurrent state kept for the prefix cache (``kv_cache.StateSnapshots``): each a
sequence's state, ~50 MB for Qwen3.5-4B, so 16 take ~0.8 GB from the KV cache."""


GPU_RESERVE_BYTES = 1 << 30   # kept out of the KV cache for the CUDA context, graphs and kernel workspaces


def engine_policy(fields: dict | None = None) -> LaunchPolicy:
    """The launch policy an engine starts with: the defaults with ``fields`` (``{field: value}``, the command line's
    ``--launch-policy``, e.g. ``tuning=FILE`` for a tuning file of measured geometries) replaced."""
    from pegainfer.kernels.policy_text import policy_with
    policy = LaunchPolicy.from_options()
    return policy_with(policy, fields) if fields else policy


def _gpu_memory() -> tuple[int, int]:
    """(free, total) bytes of the GPU."""
    from numba import cuda
    free, total = cuda.current_context().get_memory_info()
    return int(free), int(total)


class Engine:
    def __init__(self, folder: Path, model, cfg, gen, tokenizer, chat_template, max_model_len: int,
                 max_batch: int, max_num_batched_tokens: int, num_pages: int, use_cuda_graph: bool,
                 async_scheduling: bool = True, prefix_caching: bool = False, state_snapshots: int = 0,
                 scheduling_policy: str = "fcfs"):
        self.folder = folder
        self.model = model
        self.model_config = cfg
        self.generation_defaults = gen
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.model_name = hub.model_name(folder)   # the Hub id of a cached snapshot, else the folder's name
        self.eos_token_ids = list(gen.eos_token_ids or cfg.eos_token_ids or [])
        self.pool = PagePool(num_pages, PAGE_SIZE, max_batch, max_model_len, prefix_caching=prefix_caching)
        # a hybrid model's state copies at page boundaries live in its state rows after the max_batch slots
        snapshots = StateSnapshots(state_snapshots, max_batch) if prefix_caching and state_snapshots else None
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
        self.scheduling_policy = scheduling_policy
        self.scheduler = Scheduler(self.pool, max_batch, max_num_batched_tokens, max_chunks=MIXED_MIN_ROWS,
                                   snapshots=snapshots, priority=scheduling_policy == "priority")
        self.runner = ModelRunner(model, self.pool, max_batch, use_cuda_graph)
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[str] = []
        # requests that want their prompt's logprobs, prefilled one by one outside mixed steps (``_score_prompt``)
        self._scoring: collections.deque[Sequence] = collections.deque()
        self.is_demo = bool(cfg.raw.get("pegainfer_demo", False))
        self.tracer = None                     # a pegainfer.trace.ChromeTracer while tracing
        self._kernel_traced: set[str] = set()  # step kinds already traced kernel by kernel
        self.async_scheduling = async_scheduling
        self._inflight: Optional[PendingStep] = None   # a launched decode step whose tokens the host has not read
        self.prefill_launches: Optional[int] = None     # kernel launches of a one-chunk prefill (set by warmup)
        self.gc_pauses: Optional[heap.GcPauses] = None  # the process's collection timer (set by load)
        self.prompt_tokens_computed = 0        # prompt tokens prefilled (cached ones not; recomputed ones again)
        self.generation_tokens = 0             # tokens sampled
        self._grammar_compiler = None

    @property
    def grammar_compiler(self):
        """The grammars of structured output for this model's tokenizer (``text/structured.py``; built at first
        use)."""
        if self._grammar_compiler is None:
            from pegainfer.text.structured import GrammarCompiler
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model.V, self.eos_token_ids)
        return self._grammar_compiler

    @property
    def before_gpu_wait(self):
        """A callable run on the engine thread once a step is enqueued, right before the host waits for the GPU (with
        the GIL released); ``AsyncEngine`` sets it. None: nothing."""
        return self.runner.before_wait

    @before_gpu_wait.setter
    def before_gpu_wait(self, fn) -> None:
        self.runner.before_wait = fn

    # ------------------------------------------------------------------------------------------------ build
    @classmethod
    def from_folder(cls, model_path: Optional[str] = None, max_model_len: Optional[int] = None,
                    max_batch: int = 1, max_num_batched_tokens: int = 2048, use_cuda_graph: bool = True,
                    verbose: bool = False, async_scheduling: bool = True,
                    policy: "LaunchPolicy | None" = None, gpu_memory_utilization: float = 0.9,
                    enable_prefix_caching: Optional[bool] = None, num_pages: Optional[int] = None,
                    prefix_state_snapshots: Optional[int] = None, scheduling_policy: str = "fcfs",
                    chat_template: Optional[str] = None, revision: Optional[str] = None,
                    download_dir: Optional[str] = None, mamba_ssm_cache_dtype: str = "auto") -> "Engine":
        """Load a model folder (the demo model when ``model_path`` is None) and build the engine around it.

        ``max_batch``: most sequences running at once (slots); ``max_num_batched_tokens``: most tokens in one step
        (decodes plus prompt chunks; at least ``max_batch``).  The KV page pool takes what
        ``gpu_memory_utilization`` of the GPU's memory leaves after weights, buffers and recurrent state (in the
        simulator, or with ``num_pages``: that many pages, else ``max_batch`` full-length sequences).
        ``enable_prefix_caching``: None = on for Qwen3, off for Qwen3.5 (on, it keeps ``prefix_state_snapshots``
        copies of the recurrent state at page boundaries, default ``PREFIX_STATE_SNAPSHOTS``: ``scheduler``'s
        docstring says which).
        ``policy``: how the kernels launch (``kernels/policy.py``); None: the defaults (``engine_policy()``).
        ``chat_template``: the text of a chat template that replaces the folder's (``--chat-template``).
        ``model_path`` may be a Hugging Face Hub id (``Qwen/Qwen3-4B``), fetched into the Hugging Face cache (or
        ``download_dir``) at ``revision`` unless there already (``hub.py``).
        ``mamba_ssm_cache_dtype`` (vLLM's name): a hybrid model's Gated DeltaNet state in memory, ``"auto"`` (the
        folder's ``mamba_ssm_dtype``: float32 for Qwen3.5), ``"float32"`` or ``"bfloat16"`` (half the state bytes
        a decode step moves; rounded as stored); no effect on other models."""
        from pegainfer.config import load_generation_config, load_model_config, ssm_state_dtype
        from pegainfer.models import model_class
        from pegainfer.text.chat import ChatTemplate
        from pegainfer.text.tokenizer import Tokenizer
        from pegainfer.weights import Progress, WeightReader, check_gpu_memory

        require_supported_gpu()
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise PegainferError(f"--gpu-memory-utilization {gpu_memory_utilization} must be in (0, 1]")
        if policy is None:
            policy = engine_policy()
        if model_path is None:
            from pegainfer.demo import ensure_demo_model
            folder = Path(ensure_demo_model())
        else:
            folder = hub.local_folder(model_path, revision, download_dir)
        cfg = load_model_config(folder)
        if mamba_ssm_cache_dtype != "auto":
            cfg = dataclasses.replace(cfg, ssm_state_dtype=ssm_state_dtype(mamba_ssm_cache_dtype,
                                                                           "--mamba-ssm-cache-dtype"))
        gen = load_generation_config(folder)
        tokenizer = Tokenizer.from_folder(folder)
        chat_template = ChatTemplate.from_folder(folder, chat_template)

        limit = int(cfg.max_position_embeddings)
        if max_model_len is not None and max_model_len > limit:
            raise PegainferError(f"--max-model-len {max_model_len} is beyond the model's limit of {limit} tokens "
                                 f"(max_position_embeddings): use a value ≤ {limit}")
        if max_model_len is not None and max_model_len < 2:
            raise PegainferError("--max-model-len must be at least 2")
        Model = model_class(cfg.arch)
        hybrid = bool(getattr(Model, "has_recurrent_state", False))
        prefix_caching = (not hybrid) if enable_prefix_caching is None else bool(enable_prefix_caching)
        if prefix_state_snapshots is not None and prefix_state_snapshots < 1:
            raise PegainferError(f"--prefix-state-snapshots {prefix_state_snapshots} must be at least 1")
        snapshots = (prefix_state_snapshots or PREFIX_STATE_SNAPSHOTS) if prefix_caching and hybrid else 0
        step_tokens = max(max_num_batched_tokens, max_batch)
        # a padded mixed step (``cuda_graph.mixed_shape``) holds up to max_batch decode rows (padding included) beside
        # its chunks' prefill bucket, and rows for the chunks beside a full decode batch
        pads_mixed = getattr(Model, "pads_mixed", False) and not SIMULATOR
        spare_tokens = max_batch if pads_mixed else 0
        spare_rows = MIXED_SPARE_ROWS if pads_mixed else 0

        def plan(mml: int):
            """The model for context ``mml``, its KV pages and the bytes it needs besides them."""
            m = Model(cfg, mml, max_tokens=step_tokens + spare_tokens, max_rows=max(max_batch + spare_rows, SCORE_ROWS),
                      policy=policy)
            state_bytes = getattr(m, "state_bytes", lambda n: 0)(max_batch + snapshots)
            fixed = m.weight_bytes() + m.scratch_bytes() + state_bytes + penalty_state_bytes(max_batch, m.V)
            page_bytes = PAGE_SIZE * m.kv_bytes_per_token()
            one_seq = -(-mml // PAGE_SIZE)
            if num_pages is not None:
                pages = num_pages
            elif SIMULATOR:
                pages = max_batch * one_seq
            else:
                free, total = _gpu_memory()
                usable = free - (1.0 - gpu_memory_utilization) * total - GPU_RESERVE_BYTES
                pages = min(int((usable - fixed) // page_bytes), max_batch * one_seq)
            return m, pages, fixed + one_seq * page_bytes, one_seq

        mml = max_model_len or limit
        model, pages, need, one_seq = plan(mml)
        if max_model_len is None:
            while pages < one_seq and mml > 1024:
                mml = max(1024, mml // 2)
                model, pages, need, one_seq = plan(mml)
        check_gpu_memory(need, f"{folder.name} (weights, buffers and the KV cache of one {mml}-token sequence)")
        if pages < one_seq:
            raise PegainferError(f"the KV cache fits {pages * PAGE_SIZE} tokens, less than one {mml}-token "
                                 f"sequence: lower --max-model-len or raise --gpu-memory-utilization")

        progress = Progress(total_bytes=model.weight_bytes(), verbose=verbose)
        t_load = time.perf_counter()
        with WeightReader(folder, progress=progress) as reader:
            model.load_weights(reader)
        progress.finish()
        weights_s = time.perf_counter() - t_load
        model.allocate(pages, PAGE_SIZE, num_slots=max_batch, **({"num_snapshots": snapshots} if snapshots else {}))
        eng = cls(folder, model, cfg, gen, tokenizer, chat_template, mml, max_batch, step_tokens, pages,
                  use_cuda_graph, async_scheduling, prefix_caching, snapshots, scheduling_policy)
        log.info("KV cache: %d pages of %d tokens (%d tokens, %.2f GiB); prefix caching %s%s", pages, PAGE_SIZE,
                 pages * PAGE_SIZE, pages * PAGE_SIZE * model.kv_bytes_per_token() / 2 ** 30,
                 "on" if prefix_caching else "off",
                 f"; Gated DeltaNet state in {cfg.ssm_state_dtype}" if hybrid else "")
        eng.weights_load_s = weights_s
        t_warm = time.perf_counter()
        eng.warmup()
        eng.warmup_s = time.perf_counter() - t_warm
        frozen = heap.freeze()      # the start-up heap out of every later collection's way (heap.py)
        eng.gc_pauses = heap.GcPauses.install()     # from here on, every collection is a pause of serving
        log.info("froze %d Python objects after warm-up (a full garbage collection over them took %.0f ms; with "
                 "them frozen %.1f ms)", frozen["objects"], frozen["full_collect_s"] * 1e3, frozen["after_s"] * 1e3)
        return eng

    def warmup(self) -> None:
        """Compile every kernel variant a request can hit (GEMV and GEMM projections, decode and tiled-prefill
        attention, the sampler) and capture the decode graphs, so the first real request pays no compile time.
        In the simulator nothing compiles: one tiny request checks the path end to end.

        Shows its progress on a terminal (``progress.WarmupProgress``) and keeps the kernel launches of the last
        warm-up prefill in ``prefill_launches`` (the CLI's prefill progress counts against it)."""
        from pegainfer.device import SIMULATOR
        from pegainfer.engine.progress import WarmupProgress
        # GPU: the projection kernels of every size class (one token, skinny, tiled GEMM, the large tiles of a full
        # step) and both attention paths compile here, not in the first request that needs them
        top = min(self.scheduler.max_num_batched_tokens, self.max_model_len - 4)
        lengths = [2] if SIMULATOR else sorted({2, 16, *(n for n in (32, 64, 128, 160, 256) if n < top), top})
        graphs = self.runner.graphs
        mixed = not SIMULATOR and self.scheduler.max_batch >= 2 and self.max_model_len > 40
        with WarmupProgress(len(lengths) + mixed + (graphs is not None)) as progress:
            for i, n in enumerate(lengths):
                progress.phase(f"a {n}-token prompt")
                params = SamplingParams(max_tokens=2, temperature=0.0 if i % 2 == 0 else 0.7, ignore_eos=True)
                self.add_request(f"__warmup{i}__", [i % 2] * n, params)
                first_step = len(progress.step_launches)
                while self.has_unfinished():
                    with progress.step():
                        self.step()
                self.prefill_launches = progress.step_launches[first_step]   # its first step is the prefill
            if mixed:   # a prompt arriving while another sequence decodes: the mixed step's kernels
                progress.phase("a prompt beside a decode")
                greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
                self.add_request("__warmup_a__", [2] * 8, greedy)
                with progress.step():
                    self.step()
                self.add_request("__warmup_b__", [3] * 32, greedy)
                while self.has_unfinished():
                    with progress.step():
                        self.step()
            self.pool.prefix_queries = self.pool.prefix_hits = 0
            self.prompt_tokens_computed = self.generation_tokens = 0   # the counters count what serving computes
            if graphs is not None:
                progress.phase("capturing the CUDA graphs")
                if mixed and self.runner.pad_mixed:   # every decode-row size beside every chunk bucket
                    from pegainfer.engine.cuda_graph import mixed_warmup_shapes
                    graphs.mixed_shapes = mixed_warmup_shapes(self.scheduler.max_batch, self.model.max_tokens,
                                                              self.model.max_rows)
                graphs.capture_all()
                graphs.capture_seconds, graphs.eager_steps = 0.0, 0   # /metrics counts what serving meets

    # ------------------------------------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from pegainfer.text.detokenizer import IncrementalDetokenizer
        from pegainfer.text.stop import StopStringMatcher

        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty: send at least one token")
        if n >= self.max_model_len:
            raise RequestError(f"the prompt has {n} tokens but the context holds {self.max_model_len} "
                               f"(--max-model-len): shorten the prompt")
        if request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already running")
        vocab = self.model.V
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        check_penalties(params, vocab)
        if params.priority != 0 and self.scheduling_policy != "priority":
            raise RequestError(f"priority {params.priority}: requests are served first come, first served; start "
                               f"the server with --scheduling-policy priority to order them by priority")
        seq = Sequence(request_id, prompt_token_ids, params,
                       IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                       StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None)
        if params.grammar is not None:
            try:
                seq.constraint = self.grammar_compiler.constraint(params.grammar, params.grammar_after_think)
            except ValueError as e:
                raise RequestError(f"the output grammar cannot be followed: {e}") from None
        if params.bad_words:
            if params.grammar is not None:
                raise RequestError("bad_words cannot be combined with an output grammar (structured output, forced "
                                   "tool calls, allowed_token_ids): drop one of them")
            from pegainfer.text.bad_words import BadWordsConstraint, word_token_sequences
            seq.constraint = BadWordsConstraint(word_token_sequences(self.tokenizer, params.bad_words), self.model.V)
        self._seqs[request_id] = seq
        if params.prompt_logprobs is not None:
            self._scoring.append(seq)
        else:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its slot and pages are freed at the start of the next step."""
        if request_id in self._seqs:
            self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def stats(self) -> dict:
        """Gauges and counters for ``/metrics``: ``waiting`` / ``running`` requests, ``kv_pages_used`` /
        ``kv_pages_total``, ``slots_used``; cumulative ``num_preemptions``, ``prefix_cache_queries`` (prompt tokens
        looked up in the prefix cache) and ``prefix_cache_hits`` (of those, tokens found); ``prefix_state_snapshots``
        (a hybrid model's kept recurrent states, of ``prefix_state_snapshots_total``); ``cuda_graphs``
        (instantiated step graphs), cumulative ``eager_mixed_steps`` (mixed steps no graph replayed) and
        ``cuda_graph_capture_seconds`` (host time spent capturing graphs of shapes met while serving);
        ``gc_pause_seconds`` / ``gc_full_collections`` / ``gc_longest_pause_seconds``: the process's
        garbage-collection pauses since warm-up (``heap.py``); cumulative ``prompt_tokens_computed`` (prefilled:
        cached tokens not counted, a preempted sequence's again) and ``generation_tokens`` (sampled)."""
        graphs, snaps = self.runner.graphs, self.scheduler.snapshots
        return {"waiting": len(self.scheduler.waiting) + len(self._scoring), "running": len(self.scheduler.running),
                "kv_pages_used": self.pool.pages_used, "kv_pages_total": self.pool.num_pages,
                "slots_used": self.pool.slots_used, "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_queries": self.pool.prefix_queries, "prefix_cache_hits": self.pool.prefix_hits,
                "prefix_state_snapshots": len(snaps) if snaps is not None else 0,
                "prefix_state_snapshots_total": snaps.count if snaps is not None else 0,
                "cuda_graphs": len(graphs.execs) if graphs is not None else 0,
                "eager_mixed_steps": graphs.eager_steps if graphs is not None else 0,
                "cuda_graph_capture_seconds": graphs.capture_seconds if graphs is not None else 0.0,
                "prompt_tokens_computed": self.prompt_tokens_computed, "generation_tokens": self.generation_tokens,
                **heap.pause_stats(self.gc_pauses)}

    def score(self, token_ids: list[int]):
        """Logits ``[T, V]`` (float32, host) at every position of ``token_ids`` (teacher forcing), computed through
        the normal prefill path in chunks of up to SCORE_ROWS tokens. Used by the Hugging Face oracle tests."""
        import numpy as np
        if self.has_unfinished() or self._inflight is not None:
            raise RuntimeError("score() needs an idle engine")
        seq = Sequence("__score__", token_ids, SamplingParams(temperature=0.0), None, None)
        self.pool.ensure_capacity(slot := self.pool.acquire_slot(), len(token_ids))
        seq.slot = slot
        self.model.reset_slot(slot)
        rows = []
        try:
            step = min(self.model.max_rows, self.model.max_tokens)
            for start in range(0, len(token_ids), step):
                n = min(step, len(token_ids) - start)
                self.runner.prefill(seq, start, n, want_logits=True)
                rows.append(self.runner.logits_host(n))
        finally:
            self.pool.release(slot)
        return np.concatenate(rows, axis=0)

    # ------------------------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        if self._inflight is not None:
            return self._step_inflight()
        outputs = self._finish_aborted()
        if self._scoring and self._can_score(self._scoring[0]):
            return outputs + self._score_prompt(self._scoring.popleft())
        self.scheduler.hold_admissions = bool(self._scoring)    # its room comes from sequences that finish
        sched = self.scheduler.schedule()
        if sched is None:
            return outputs
        tracer = self.tracer
        t_step = time.perf_counter()
        trace_kernels = tracer is not None and sched.kind not in self._kernel_traced
        with (traced(tracer.kernel) if trace_kernels else contextlib.nullcontext()):
            self._before_chunks(sched.chunks, t_step)
            if sched.kind == "prefill":
                seq, start, length = sched.chunks[0]
                token, _ = self.runner.prefill(seq, start, length, force_eager=trace_kernels)
                self._chunk_computed(seq, start, length)
                if token is not None:
                    outputs.append(self._append(seq, token, 0))
            elif sched.kind == "mixed" and self.async_scheduling and not trace_kernels:
                pending = self.runner.launch_mixed(sched.decodes, sched.chunks)
                self._computed_chunks(sched.chunks)
                self._keep_states()
                outputs += self._read_launching_ahead(pending)
            elif sched.kind == "mixed":
                outputs += self._mixed(sched, trace_kernels)
            elif self.async_scheduling and not trace_kernels:
                outputs += self._read_launching_ahead(self.runner.launch_decode(sched.decodes))
            else:
                tokens = self.runner.decode(sched.decodes, force_eager=trace_kernels)
                for row, (seq, token) in enumerate(zip(sched.decodes, tokens)):
                    self._decode_computed(seq)
                    outputs.append(self._append(seq, token, row))
            self._keep_states()
        if tracer is not None:
            if trace_kernels:
                tracer.flush_kernels(sched.kind)
                self._kernel_traced.add(sched.kind)
            tracer.span(_step_label(sched), t_step, time.perf_counter(), "engine steps")
        return outputs

    def _keep_states(self) -> None:
        """Copy the states the steps just read reached a kept boundary with into their snapshot rows (a hybrid
        model's prefix cache): after those steps, before the next one, in stream order."""
        for slot, row in self.scheduler.take_snapshot_copies():
            self.model.copy_state(slot, row)

    def _mixed(self, sched, trace_kernels: bool = False) -> list[RequestOutput]:
        """Run a step of decodes and prompt chunks; append the token of every sequence whose tokens it finished."""
        tokens = self.runner.mixed(sched.decodes, sched.chunks, force_eager=trace_kernels)
        outputs = []
        for row, seq in enumerate(sched.decodes):
            self._decode_computed(seq)
            outputs.append(self._append(seq, tokens[row], row))
        for j, (seq, start, length) in enumerate(sched.chunks):
            row = len(sched.decodes) + j
            self._chunk_computed(seq, start, length)
            if start + length >= seq.num_tokens:
                outputs.append(self._append(seq, tokens[row], row))
        return outputs

    def _finish_aborted(self) -> list[RequestOutput]:
        outputs = []
        for rid in self._aborted:
            seq = self._seqs.get(rid)
            if seq is not None:
                outputs.append(self._finish(seq, "abort"))
        self._aborted.clear()
        return outputs

    # ------------------------------------------------------------------------------------------------ async steps
    def _step_inflight(self) -> list[RequestOutput]:
        """A step() call while a decode step launched ahead is in flight: abort first (an aborted sequence's token
        in that step is discarded, as the synchronous engine would never have computed it), then read that step,
        launching the next one ahead of the read when the batch stays the same."""
        pending, self._inflight = self._inflight, None
        t_step = time.perf_counter()
        outputs = self._finish_aborted()
        outputs += self._read_launching_ahead(pending)
        self._keep_states()                     # none when a step was launched ahead (``_next_ahead``)
        if self.tracer is not None:
            self.tracer.span(f"decode batch {pending.B} (launched ahead)", t_step, time.perf_counter(),
                             "engine steps")
        return outputs

    def _read_launching_ahead(self, pending: PendingStep) -> list[RequestOutput]:
        """Launch the step after ``pending`` if only sequences leaving and prompts joining change its batch (its
        sequences, less those that finished or surely finish with it, ids from the device; beside them the next
        chunks of prompts being prefilled and of waiting requests, a mixed step), then read and append
        ``pending``'s tokens.  With grammar-constrained rows (and the very same batch, nobody joining) the step
        ahead is launched in two parts: its forward pass before the read, its masks and sampler after it
        (``runner.launch_forward_ahead``)."""
        prefilling = self.scheduler.prefilling()
        seqs = self._next_ahead(pending.seqs, prefilling)
        rows = None
        if seqs is not None:
            row_of = {id(seq): pending.row(i) for i, seq in enumerate(pending.seqs)}
            rows = [row_of[id(seq)] for seq in seqs]
        constrained = seqs is not None and any(seq.constraint is not None for seq in seqs)
        # logprobs of ``pending``'s tokens read the logits the step ahead overwrites: it keeps a copy first
        logprobs = any(seq.params.logprobs is not None and seq.status is Status.RUNNING for seq in pending.seqs)
        if constrained and logprobs:
            seqs = None                 # (the two-part launch keeps no copy)
        self.runner.keep_logits_next = logprobs
        joining = bool(prefilling) or self.scheduler.can_admit_waiting()
        if seqs is not None and not constrained and joining:
            return self._launch_mixed_ahead(pending, seqs, rows)
        if rows == list(range(len(seqs or ()))) and pending.rows is None:
            rows = None                 # the very rows of the step before: its ids are in place
        if seqs is None or (constrained and (rows is not None or joining)):
            self._inflight, self.runner.keep_logits_next = None, False
            return self._read(pending)
        if constrained:
            forward = self.runner.launch_forward_ahead(seqs)
            outputs = self._read(pending)
            live = any(seq.status is not Status.FINISHED for seq in forward.seqs)
            self._inflight = self.runner.launch_sample(forward) if live else None
            return outputs
        ahead = self.runner.launch_decode(seqs, ahead=1, rows_before=rows)
        outputs = self._read(pending)
        if all(seq.status is Status.FINISHED for seq in ahead.seqs):
            self._read(ahead)           # nobody left to use its tokens: drain now, so an idle engine is idle
            ahead = None
        self._inflight = ahead
        return outputs

    def _launch_mixed_ahead(self, pending: PendingStep, decodes: list[Sequence], rows: list[int]):
        """Beside ``decodes`` (``pending``'s sequences going on, at ``rows`` of it), the next chunks of the prompts
        being prefilled and of admitted waiting requests: launch that mixed step before reading ``pending``
        (``runner.launch_mixed``'s ``rows_before``); then read."""
        chunks = self.scheduler.chunks_beside(len(decodes))
        self._before_chunks(chunks, time.perf_counter())
        if chunks:
            ahead = self.runner.launch_mixed(decodes, chunks, rows_before=rows)
        else:                           # no page for a chunk yet: the decodes alone
            in_place = rows == list(range(len(decodes))) and pending.rows is None
            ahead = self.runner.launch_decode(decodes, ahead=1, rows_before=None if in_place else rows)
        self._computed_chunks(chunks)
        self._keep_states()
        outputs = self._read(pending)
        self._inflight = ahead
        return outputs

    def _before_chunks(self, chunks, now: float) -> None:
        """What a step's prompt chunks need before it (in stream order): the states that admitted sequences of a
        hybrid model restore where their cached pages end, a new sequence's state zeroed (e.g. Qwen3.5's recurrent
        state); and each sequence's first scheduling time."""
        for row, slot in self.scheduler.take_restores():
            self.model.copy_state(row, slot)
        for seq, start, _ in chunks:
            if seq.scheduled_time is None:
                seq.scheduled_time = now
            if start == 0:
                self.model.reset_slot(seq.slot)

    def _computed_chunks(self, chunks) -> None:
        """A launched step's chunks: their tokens are computed (in stream order: what a later step reads, or a
        state kept after this one, follows it), before the step is read."""
        for seq, start, length in chunks:
            self._chunk_computed(seq, start, length)

    def _decode_computed(self, seq: Sequence) -> None:
        """A step computed ``seq``'s last token (a decode row; or a chunk's last row, already counted): the
        scheduler's account, and ``prompt_tokens_computed`` when a decode row computed the prompt's last token."""
        if seq.num_cached < seq.num_tokens and not seq.output_ids:
            self.prompt_tokens_computed += 1
        self.scheduler.computed(seq, seq.num_tokens)

    def _chunk_computed(self, seq: Sequence, start: int, length: int) -> None:
        """Prompt tokens ``start .. start + length`` of ``seq`` are computed (the scheduler's account; counted in
        ``prompt_tokens_computed``)."""
        self.scheduler.computed(seq, start + length)
        self.prompt_tokens_computed += length

    def _next_ahead(self, seqs: list[Sequence], prefilling: list[Sequence]) -> list[Sequence] | None:
        """The sequences the step after the in-flight step of ``seqs`` (those it gives a token) decodes when it can
        be launched now, before that step's tokens are read (with the pages it needs reserved): those of ``seqs``
        still running, less those the in-flight step surely finishes (max_tokens, a full context: no token past
        their end), in their order.  None when the batch may change otherwise (a pending abort, a running sequence
        not in ``seqs`` but for ``prefilling``, the scheduler's prompts in chunks) or the step must wait (a state to
        keep).  Prompt chunks (of those prompts, and of waiting requests) may join the step
        (``_launch_mixed_ahead``)."""
        live = [seq for seq in seqs if seq.status is Status.RUNNING]
        chunked = {id(seq) for seq in prefilling}
        if self._scoring:
            return None         # a prompt to score waits for the engine to be idle between two steps
        if self._aborted or [seq for seq in self.scheduler.running if id(seq) not in chunked] != live:
            return None
        nxt = []
        for seq in live:
            p = seq.params
            if seq.snapshot_points and seq.snapshot_points[0] == seq.num_tokens:
                return None    # its state after the in-flight step is kept: copied before the next step runs
            if len(seq.output_ids) + 1 < p.max_tokens and seq.num_tokens + 1 < self.max_model_len:
                nxt.append(seq)
        # the in-flight step writes position num_tokens - 1; the one ahead writes num_tokens (+1 spare, as schedule)
        if not nxt or not all(self.pool.ensure_capacity(seq.slot, seq.num_tokens + 2) for seq in nxt):
            return None
        return nxt

    def _read(self, pending: PendingStep) -> list[RequestOutput]:
        """Wait for a launched decode step's tokens and append them; a sequence that finished (or was aborted)
        after the step was launched gets none: that token is discarded."""
        tokens = self.runner.wait(pending)
        outputs = []
        for i, seq in enumerate(pending.seqs):
            if seq.status is Status.FINISHED:
                continue
            self._decode_computed(seq)
            logit_row = i if pending.logit_rows is None else pending.logit_rows[i]
            outputs.append(self._append(seq, tokens[pending.row(i)], logit_row))
        return outputs

    def _append(self, seq: Sequence, token: int, row: int) -> RequestOutput:
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.append_token(token)
        self.generation_tokens += 1
        p = seq.params
        n_out = len(seq.output_ids)
        logprobs = None
        if p.logprobs is not None:
            logprobs = [self._logprob(row, token, p.logprobs)]

        text, reason = text_and_finish_reason(token, p, n_out, seq.num_tokens, self.max_model_len,
                                              self.eos_token_ids, seq.detokenizer, seq.stop_matcher)
        if seq.constraint is not None and reason in (None, "length"):
            if not seq.constraint.accept(token):
                out = self._finish(seq, "error", text)
                out.new_token_ids, out.logprobs = [token], logprobs
                out.error = f"the output grammar rejected token {token}: {seq.constraint.error}"
                return out
            if seq.constraint.finished:        # complete: only EOS may follow
                if reason is None:
                    text += self._flush_text(seq)
                reason = "stop"
        if reason is not None:
            out = self._finish(seq, reason, text)
            out.new_token_ids = [token]
            out.logprobs = logprobs
            return out
        return RequestOutput(seq.request_id, [token], text, logprobs, False, None,
                             len(seq.prompt_ids), n_out, seq.cached_tokens)

    @staticmethod
    def _flush_text(seq: Sequence) -> str:
        """The text a sequence still holds back, for an end that ``text_and_finish_reason`` did not see."""
        tail = seq.detokenizer.flush()
        if seq.stop_matcher is not None:
            tail, matched = seq.stop_matcher.push(tail)
            if not matched:
                tail += seq.stop_matcher.flush()
        return tail

    def _logprob(self, row: int, token: int, n: int) -> TokenLogprob:
        import numpy as np
        logits = self.runner.logits_host(row + 1)[row].astype(np.float64)
        m = logits.max()
        lse = m + np.log(np.exp(logits - m).sum())
        lp = logits - lse
        top = []
        if n > 0:
            idx = np.argpartition(-lp, n - 1)[:n]
            idx = idx[np.argsort(-lp[idx], kind="stable")]
            top = [(int(i), float(lp[i])) for i in idx]
        return TokenLogprob(token, float(lp[token]), top)

    # ------------------------------------------------------------------------------------------------ prompt logprobs
    def _can_score(self, seq: Sequence) -> bool:
        """Whether ``seq`` (a request for its prompt's logprobs) can be prefilled now: a slot, and pages for its
        prompt and first token beyond the scheduler's reserve (no reserve when nothing runs: a pool of one
        full-length sequence then still takes a full-length prompt)."""
        reserve = self.scheduler.reserve_pages if self.scheduler.running else 0
        return (len(self.scheduler.running) < self.scheduler.max_batch and self.pool.has_free_slot and
                self.pool.pages_needed(seq.num_tokens + 1) + reserve <= self.pool.pages_available)

    def _score_prompt(self, seq: Sequence) -> list[RequestOutput]:
        """Prefill ``seq``'s prompt in chunks whose every row keeps its logits (``runner.prefill(want_logits)``; the
        engine is idle between two steps: no step in flight), each prompt token's logprob computed from the row
        before it; then the sequence decodes like any other.  Other streams wait for it (a prompt-logprob request,
        as an evaluation harness sends, is not prefilled beside decodes); the prefix cache is not used for it (every
        position's logits are wanted)."""
        import numpy as np
        self.scheduler.admit_without_cache(seq)
        self.pool.ensure_capacity(seq.slot, seq.num_tokens + 1)
        self.model.reset_slot(seq.slot)
        seq.scheduled_time = time.perf_counter()
        n, top_n = len(seq.prompt_ids), seq.params.prompt_logprobs
        prompt = np.asarray(seq.prompt_ids)
        entries: list[Optional[TokenLogprob]] = [None]
        step = min(self.model.max_rows, self.model.max_tokens)
        token = None
        for start in range(0, n, step):
            length = min(step, n - start)
            token, _ = self.runner.prefill(seq, start, length, want_logits=True)
            self._chunk_computed(seq, start, length)
            rows = min(length, n - 1 - start)     # rows that predict a prompt token
            if rows > 0:
                logits = self.runner.logits_host(length)[:rows]
                entries += token_logprobs(logits, prompt[start + 1:start + 1 + rows], top_n)
        out = self._append(seq, token, length - 1)
        out.prompt_logprobs = entries
        return [out]

    def _finish(self, seq: Sequence, reason: str, text: str = "") -> RequestOutput:
        seq.finish_reason = reason
        if seq in self._scoring:
            self._scoring.remove(seq)
        if self.tracer is not None:
            now = time.perf_counter()
            rid = seq.request_id
            start = seq.scheduled_time or now
            self.tracer.span(f"{rid}: queue", seq.arrival, start, "requests")
            if seq.first_token_time is not None:
                self.tracer.span(f"{rid}: prefill", start, seq.first_token_time, "requests")
                self.tracer.span(f"{rid}: decode ({len(seq.output_ids)} tokens, {reason})", seq.first_token_time,
                                 now, "requests")
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
        out = RequestOutput(seq.request_id, [], text, None, True, reason, len(seq.prompt_ids), len(seq.output_ids),
                            seq.cached_tokens)
        out.scheduled_time = seq.scheduled_time
        return out


def _step_label(sched) -> str:
    """How a step shows in a trace."""
    if sched.kind == "prefill":
        seq, _, length = sched.chunks[0]
        return f"prefill {seq.request_id} ({length} tokens)"
    if sched.kind == "mixed":
        return f"mixed: {len(sched.decodes)} decodes + {len(sched.chunks)} chunks ({sched.num_tokens} tokens)"
    return f"decode batch {len(sched.decodes)}"


def token_logprobs(logits, tokens, top_n: int) -> list[TokenLogprob]:
    """Per row of host ``logits`` ``[rows, V]``: the logprob of ``tokens[row]`` under that row's softmax, its rank
    and the ``top_n`` most likely tokens (in float64, as ``Engine._logprob``)."""
    import numpy as np
    x = np.asarray(logits, np.float64)
    m = x.max(axis=1, keepdims=True)
    lp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
    rows = np.arange(x.shape[0])
    chosen = lp[rows, np.asarray(tokens)]
    out = []
    for r in rows:
        top = []
        if top_n > 0:
            idx = np.argpartition(-lp[r], top_n - 1)[:top_n]
            idx = idx[np.argsort(-lp[r, idx], kind="stable")]
            top = [(int(i), float(lp[r, i])) for i in idx]
        out.append(TokenLogprob(int(tokens[r]), float(chosen[r]), top, int((lp[r] > chosen[r]).sum()) + 1))
    return out


def check_penalties(params: SamplingParams, vocab: int) -> None:
    """A ``RequestError`` naming the first penalty or logit bias outside what ``kernels/penalties.py`` applies."""
    import math

    from pegainfer.kernels.penalties import MAX_LOGIT_BIAS
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        raise RequestError(f"repetition_penalty must be a finite number > 0 (1 = off), got {params.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(params, name)
        if not (math.isfinite(v) and -2.0 <= v <= 2.0):
            raise RequestError(f"{name} must be in [-2, 2] (0 = off), got {v}")
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(params.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are accepted")
    for t, b in params.logit_bias.items():
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise RequestError(f"logit_bias token id {t!r} is outside the vocabulary [0, {vocab})")
        if not (math.isfinite(b) and -100.0 <= b <= 100.0):
            raise RequestError(f"logit_bias of token {t} must be in [-100, 100], got {b}")
