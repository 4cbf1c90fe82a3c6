"""The engine: owns the model, the page pool, the scheduler and the runner, and advances every request by one
step per ``step()`` call. It is synchronous and single-threaded by design; ``async_engine.AsyncEngine`` drives it
from a background thread for the server, and the CLI calls it directly."""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Optional

from pegainfer.engine.kv_cache import PagePool
from pegainfer.engine.runner import ModelRunner
from pegainfer.engine.scheduler import Scheduler
from pegainfer.engine.sequence import Sequence
from pegainfer.engine.stopping import text_and_finish_reason
from pegainfer.engine.types import RequestOutput, SamplingParams, TokenLogprob
from pegainfer.errors import PegainferError, RequestError
from pegainfer.kernels.launch import traced

log = logging.getLogger("pegainfer.engine")

PAGE_SIZE = 16
SCORE_ROWS = 16   # logits rows per step: ≥ the decode batch, and the chunk size of score()


def _free_gpu_bytes() -> int:
    from pegainfer.device import SIMULATOR
    if SIMULATOR:
        return 1 << 40
    from numba import cuda
    free, _total = cuda.current_context().get_memory_info()
    return int(free)


class Engine:
    def __init__(self, folder: Path, model, cfg, gen, tokenizer, chat_template, max_model_len: int,
                 max_batch: int, max_prefill_tokens: int, num_pages: int, use_cuda_graph: bool):
        self.folder = folder
        self.model = model
        self.model_config = cfg
        self.generation_defaults = gen
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.model_name = folder.name
        self.eos_token_ids = list(gen.eos_token_ids or cfg.eos_token_ids or [])
        self.pool = PagePool(num_pages, PAGE_SIZE, max_batch, max_model_len)
        self.scheduler = Scheduler(self.pool, max_batch, max_prefill_tokens)
        self.runner = ModelRunner(model, self.pool, max_batch, use_cuda_graph)
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[str] = []
        self.is_demo = bool(cfg.raw.get("pegainfer_demo", False))
        self.tracer = None                     # a pegainfer.trace.ChromeTracer while tracing
        self._kernel_traced: set[str] = set()  # step kinds already traced kernel by kernel

    # ------------------------------------------------------------------------------------------------ build
    @classmethod
    def from_folder(cls, model_path: Optional[str] = None, max_model_len: Optional[int] = None,
                    max_batch: int = 1, max_prefill_tokens: int = 2048, use_cuda_graph: bool = True,
                    verbose: bool = False) -> "Engine":
        from pegainfer.config import load_generation_config, load_model_config
        from pegainfer.models import model_class
        from pegainfer.text.chat import ChatTemplate
        from pegainfer.text.tokenizer import Tokenizer
        from pegainfer.weights import Progress, WeightReader, check_gpu_memory

        if model_path is None:
            from pegainfer.demo import ensure_demo_model
            folder = Path(ensure_demo_model())
        else:
            folder = Path(model_path).expanduser()
        cfg = load_model_config(folder)
        gen = load_generation_config(folder)
        tokenizer = Tokenizer.from_folder(folder)
        chat_template = ChatTemplate.from_folder(folder)

        limit = int(cfg.max_position_embeddings)
        if max_model_len is not None and max_model_len > limit:
            raise PegainferError(f"--max-model-len {max_model_len} is beyond the model's limit of {limit} tokens "
                                 f"(max_position_embeddings): use a value ≤ {limit}")
        if max_model_len is not None and max_model_len < 2:
            raise PegainferError("--max-model-len must be at least 2")
        Model = model_class(cfg.arch)

        def plan(mml: int):
            m = Model(cfg, mml, max_tokens=min(max_prefill_tokens, mml), max_rows=max(max_batch, SCORE_ROWS))
            pages = max_batch * -(-mml // PAGE_SIZE)
            need = m.weight_bytes() + m.scratch_bytes() + pages * PAGE_SIZE * m.kv_bytes_per_token()
            need += getattr(m, "state_bytes", lambda n: 0)(max_batch)
            return m, pages, need

        mml = max_model_len or limit
        model, pages, need = plan(mml)
        if max_model_len is None:
            free = _free_gpu_bytes() - (1 << 30)  # keep 1 GiB for the CUDA context and graphs
            while need > free and mml > 1024:
                mml = max(1024, mml // 2)
                model, pages, need = plan(mml)
        check_gpu_memory(need, f"{folder.name} (weights, KV cache for {max_batch} × {mml} tokens, buffers)")

        progress = Progress(total_bytes=model.weight_bytes(), verbose=verbose)
        t_load = time.perf_counter()
        with WeightReader(folder, progress=progress) as reader:
            model.load_weights(reader)
        progress.finish()
        weights_s = time.perf_counter() - t_load
        model.allocate(pages, PAGE_SIZE)
        eng = cls(folder, model, cfg, gen, tokenizer, chat_template, mml, max_batch, min(max_prefill_tokens, mml),
                  pages, use_cuda_graph)
        eng.weights_load_s = weights_s
        t_warm = time.perf_counter()
        eng.warmup()
        eng.warmup_s = time.perf_counter() - t_warm
        return eng

    def warmup(self) -> None:
        """Compile every kernel variant a request can hit (GEMV and GEMM projections, decode and tiled-prefill
        attention, the sampler) and capture the decode graphs, so the first real request pays no compile time.
        In the simulator nothing compiles: one tiny request checks the path end to end."""
        from pegainfer.device import SIMULATOR
        lengths = [2] if SIMULATOR else sorted({2, 16, min(160, self.max_model_len - 4)})
        for i, n in enumerate(lengths):
            params = SamplingParams(max_tokens=2, temperature=0.0 if i % 2 == 0 else 0.7, ignore_eos=True)
            self.add_request(f"__warmup{i}__", [i % 2] * n, params)
            while self.has_unfinished():
                self.step()
        if self.runner.graphs is not None:
            self.runner.graphs.capture_all()

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
        seq = Sequence(request_id, prompt_token_ids, params,
                       IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
                       StopStringMatcher(params.stop) if params.stop else None)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its slot and pages are freed at the start of the next step."""
        if request_id in self._seqs:
            self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def stats(self) -> dict:
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "kv_pages_used": self.pool.pages_used, "kv_pages_total": self.pool.num_pages,
                "slots_used": self.pool.slots_used}

    def score(self, token_ids: list[int]):
        """Logits ``[T, V]`` (float32, host) at every position of ``token_ids`` (teacher forcing), computed through
        the normal prefill path in chunks of up to SCORE_ROWS tokens. Used by the Hugging Face oracle tests."""
        import numpy as np
        if self.has_unfinished():
            raise RuntimeError("score() needs an idle engine")
        from pegainfer.engine.sequence import Sequence
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
        outputs: list[RequestOutput] = []
        for rid in self._aborted:
            seq = self._seqs.get(rid)
            if seq is not None:
                outputs.append(self._finish(seq, "abort"))
        self._aborted.clear()

        sched = self.scheduler.schedule()
        if sched is None:
            return outputs
        tracer = self.tracer
        t_step = time.perf_counter()
        trace_kernels = tracer is not None and sched.kind not in self._kernel_traced
        with (traced(tracer.kernel) if trace_kernels else contextlib.nullcontext()):
            if sched.kind == "prefill":
                seq = sched.seqs[0]
                if seq.scheduled_time is None:
                    seq.scheduled_time = t_step
                if sched.start == 0:
                    self.model.reset_slot(seq.slot)   # e.g. zero Qwen3.5's recurrent state for a new sequence
                token, _ = self.runner.prefill(seq, sched.start, sched.length, force_eager=trace_kernels)
                if token is not None:
                    outputs.append(self._append(seq, token, 0))
            else:
                tokens = self.runner.decode(sched.seqs, force_eager=trace_kernels)
                for row, (seq, token) in enumerate(zip(sched.seqs, tokens)):
                    outputs.append(self._append(seq, token, row))
        if tracer is not None:
            if trace_kernels:
                tracer.flush_kernels(sched.kind)
                self._kernel_traced.add(sched.kind)
            label = (f"prefill {sched.seqs[0].request_id} ({sched.length} tokens)" if sched.kind == "prefill"
                     else f"decode batch {len(sched.seqs)}")
            tracer.span(label, t_step, time.perf_counter(), "engine steps")
        return outputs

    def _append(self, seq: Sequence, token: int, row: int) -> RequestOutput:
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_ids.append(token)
        p = seq.params
        n_out = len(seq.output_ids)
        logprobs = None
        if p.logprobs is not None:
            logprobs = [self._logprob(row, token, p.logprobs)]

        text, reason = text_and_finish_reason(token, p, n_out, seq.num_tokens, self.max_model_len,
                                              self.eos_token_ids, seq.detokenizer, seq.stop_matcher)
        if reason is not None:
            out = self._finish(seq, reason, text)
            out.new_token_ids = [token]
            out.logprobs = logprobs
            return out
        return RequestOutput(seq.request_id, [token], text, logprobs, False, None,
                             len(seq.prompt_ids), n_out)

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

    def _finish(self, seq: Sequence, reason: str, text: str = "") -> RequestOutput:
        seq.finish_reason = reason
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
        return RequestOutput(seq.request_id, [], text, None, True, reason, len(seq.prompt_ids),
                             len(seq.output_ids))
