"""A stand-in for ``pegainfer.engine.engine.Engine`` with the same interface and the same text handling (the real
tokenizer, IncrementalDetokenizer and StopStringMatcher over a tiny Qwen3-like folder), whose "model" replies with
scripted text.  It keeps the same accounting as the real engine (waiting / running / kv pages / slots), so server
tests can assert that cancelled requests give their resources back, and it can be paused or made to fail on
purpose.  Tests that need the real kernels use the demo model instead (slow in the simulator)."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from pegainfer.engine.types import RequestOutput, SamplingParams, TokenLogprob
from pegainfer.errors import RequestError
from pegainfer.text.chat import ChatTemplate
from pegainfer.text.detokenizer import IncrementalDetokenizer
from pegainfer.text.stop import StopStringMatcher
from pegainfer.text.tokenizer import Tokenizer
from pegainfer.engine.stopping import text_and_finish_reason

DEFAULT_REPLY = "Hello world! The quick brown fox jumps over the lazy dog. 你好 🦊 done"  # 🦊: 4 byte tokens


@dataclass
class _Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    script: list[int]
    detok: IncrementalDetokenizer
    stop: Optional[StopStringMatcher]
    out_ids: list[int] = field(default_factory=list)
    pages: int = 0


class FakeEngine:
    def __init__(self, folder, reply: Callable[[str], str] | str = DEFAULT_REPLY, max_model_len: int = 256,
                 max_batch: int = 2, page_size: int = 4, step_delay: float = 0.0, script_prefix=(),
                 record: bool = True, chat_template: Optional[str] = None):
        self.tokenizer = Tokenizer.from_folder(folder)
        self.chat_template = ChatTemplate.from_folder(folder, chat_template)
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.eos_token_ids = [self.tokenizer.eos_token_id]
        self.vocab_size = self.tokenizer.vocab_size + 32  # like Qwen3: the embedding has more rows than the tokenizer
        self.generation_defaults = None
        self.is_demo = False
        self.reply = reply
        self._reply_ids: Optional[list[int]] = None
        self.script_prefix = list(script_prefix)  # raw ids emitted before the reply (e.g. ids the tokenizer lacks)
        self.max_batch = max_batch
        self.page_size = page_size
        self.step_delay = step_delay
        self.gate = threading.Event()       # clear it to pause the engine inside its next step
        self.gate.set()
        self.in_step = threading.Event()    # set while a step waits at the gate
        self.fail_next_step = False
        self._reqs: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._to_abort: list[str] = []
        # what happened, for assertions (``record=False``: nothing kept past a request's end, as a real engine
        # keeps nothing; a long soak measures the server's memory, not these records)
        self.record = record
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.aborted: list[str] = []
        self.finished: dict[str, str] = {}
        self.generated: dict[str, int] = {}  # tokens generated per request
        self.max_running_seen = 0
        self.prompt_tokens_computed = self.generation_tokens = 0   # Engine.stats' cumulative counters

    # ------------------------------------------------------------------------------------------------ interface
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty: send at least one token")
        if n >= self.max_model_len:
            raise RequestError(f"the prompt has {n} tokens but the context holds {self.max_model_len}")
        if request_id in self._reqs:
            raise RequestError(f"request id {request_id!r} is already running")
        if any(t < 0 or t >= self.vocab_size for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if callable(self.reply):
            reply_ids = self.tokenizer.encode(self.reply(self.tokenizer.decode(prompt_token_ids,
                                                                              skip_special_tokens=False)))
        else:  # encoded once: a fixed reply costs a request no more host time than a real engine's add_request
            if self._reply_ids is None:
                self._reply_ids = self.tokenizer.encode(self.reply)
            reply_ids = self._reply_ids
        req = _Req(request_id, list(prompt_token_ids), params, self.script_prefix + reply_ids,
                   IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                   StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None)
        self._reqs[request_id] = req
        self._waiting.append(req)
        if self.record:
            self.prompts[request_id] = list(prompt_token_ids)
            self.params[request_id] = params

    def abort(self, request_id: str) -> None:
        if request_id in self._reqs:
            self._to_abort.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def stats(self) -> dict:
        return {"waiting": len(self._waiting), "running": len(self._running),
                "kv_pages_used": sum(r.pages for r in self._running), "slots_used": len(self._running),
                "prompt_tokens_computed": self.prompt_tokens_computed, "generation_tokens": self.generation_tokens}

    def step(self) -> list[RequestOutput]:
        self.in_step.set()
        self.gate.wait()
        self.in_step.clear()
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        outputs = []
        for rid in self._to_abort:
            if rid in self._reqs:
                if self.record:
                    self.aborted.append(rid)
                outputs.append(self._finish(self._reqs[rid], "abort", ""))
        self._to_abort.clear()
        while self._waiting and len(self._running) < self.max_batch:
            self._running.append(self._waiting.popleft())
            self._running[-1].scheduled = time.perf_counter()
            self.prompt_tokens_computed += len(self._running[-1].prompt_ids)
        self.max_running_seen = max(self.max_running_seen, len(self._running))
        for req in list(self._running):
            req.pages = -(-(len(req.prompt_ids) + len(req.out_ids) + 1) // self.page_size)
            i = len(req.out_ids)
            token = req.script[i] if i < len(req.script) else self.tokenizer.eos_token_id
            outputs.append(self._append(req, token))
        return outputs

    # ------------------------------------------------------------------------------------------------ internals
    def _append(self, req: _Req, token: int) -> RequestOutput:
        """The same stop / detokenization rules as ``Engine._append``."""
        req.out_ids.append(token)
        self.generation_tokens += 1
        if self.record:
            self.generated[req.rid] = len(req.out_ids)
        p = req.params
        n_out = len(req.out_ids)
        logprobs = None
        if p.logprobs is not None:
            top = [((token + k) % self.tokenizer.vocab_size, -0.25 - k) for k in range(p.logprobs)]
            logprobs = [TokenLogprob(token, -0.25, top)]
        text, reason = text_and_finish_reason(token, p, n_out, len(req.prompt_ids) + n_out, self.max_model_len,
                                              self.eos_token_ids, req.detok, req.stop)
        if reason is not None:
            out = self._finish(req, reason, text)
            out.new_token_ids = [token]
            out.logprobs = logprobs
            return out
        return RequestOutput(req.rid, [token], text, logprobs, False, None, len(req.prompt_ids), n_out)

    def _finish(self, req: _Req, reason: str, text: str) -> RequestOutput:
        self._reqs.pop(req.rid, None)
        if req in self._running:
            self._running.remove(req)
        if req in self._waiting:
            self._waiting.remove(req)
        req.pages = 0
        if self.record:
            self.finished[req.rid] = reason
        out = RequestOutput(req.rid, [], text, None, True, reason, len(req.prompt_ids), len(req.out_ids))
        out.scheduled_time = getattr(req, "scheduled", None)
        return out
