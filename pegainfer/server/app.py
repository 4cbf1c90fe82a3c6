"""The Starlette app: OpenAI-compatible routes over an ``AsyncEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (``responses.py``),
``GET /v1/models`` (and ``/v1/models/{id}``),
``POST /tokenize`` and ``POST /detokenize`` (vLLM's),
``GET /health`` (200 once the model is loaded and warmed up; 503 before, and for good once a step of the engine
failed), ``GET /version``, ``GET /metrics`` (Prometheus, ``metrics.py``).  The API key guards ``/v1/*``,
``/tokenize`` and ``/detokenize``.

A request's way through a handler: API key → body (size limit, JSON) → ``protocol.parse_*`` → prompt text → token
ids (a short prompt is tokenized on the event loop; a long one, and the chat template of a long conversation, in
a worker thread, so it never blocks the loop) → context checks and ``SamplingParams`` → ``AsyncEngine.submit``
(the engine accepts or refuses it before any response byte is sent, so refusals are proper HTTP errors) → the
answer, whole or as server-sent events.

A client that goes away cancels its request at once: from the moment the request is submitted one
``ClientWatch`` task listens for ``http.disconnect`` and cancels the request's stream, which aborts it in the engine
(its pages and slot are freed at the next step) and ends whatever waits on it.  One log line per request goes to
the ``pegainfer.server`` logger; every line logged while serving a request starts with its ``x-request-id``
(``request_context.py``), and the engine's request id is ``cmpl-<x-request-id>`` / ``chatcmpl-<x-request-id>``
(the response's ``id``), with a random suffix while that id is still in use.  A request for ``n`` > 1 choices is
``n`` engine requests, ``<id>-0`` .. ``<id>-<n-1>`` (a log line each), whose streams one response merges.

Latency (what the HTTP layer adds to time-to-first-token and time-per-output-token; ``benchmarks/bench_server.py
--fake-gpu`` measures it without a GPU): each streamed token costs the event loop one wake-up (one
hand-off per engine step for all requests), a pre-serialized chunk template filled with the token's text, and
one socket write; the last token, the usage chunk and ``[DONE]`` leave in one write.  A request costs one
background task (the disconnect watch), no thread hop for short prompts, and no anyio task group.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from typing import AsyncIterator, Callable, Optional

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import pegainfer
from pegainfer.engine.async_engine import AsyncEngine, EngineNotReadyError, EngineStepError, QueueFullError
from pegainfer.engine.types import RequestOutput, SamplingParams
from pegainfer.errors import PegainferError, RequestError
from pegainfer.server import protocol as P
from pegainfer.server import responses as R
from pegainfer.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from pegainfer.server.protocol import APIError
from pegainfer.server.request_context import RequestIdMiddleware, RequestLog, install_log_filter, request_id_from
from pegainfer.server.sse import SSE_DONE, ChunkTemplate, ClientDisconnected, ClientWatch, EventStreamResponse, sse
from pegainfer.text.chat_output import ChatDelta, ChatOutputParser
from pegainfer.text.reasoning import REASONING_PARSERS, ReasoningParser, reasoning_start
from pegainfer.text.structured import grammar_after_think
from pegainfer.text.tool_calls import ToolCallParser

log = logging.getLogger("pegainfer.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20   # 8 MiB: ~2M characters of prompt, far beyond any context
RETRY_AFTER_S = "1"
INLINE_TEXT_CHARS = 1024            # prompts up to this many characters are tokenized on the event loop
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _api_error(e: BaseException) -> APIError:
    """Map an exception from validation or the engine to an HTTP error."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), None, "queue_full", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(e, EngineNotReadyError):
        return APIError(503, str(e), None, "model_not_ready", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(e, RequestError):
        return APIError(400, str(e), None, "invalid_request")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), None, "engine_error")
    if isinstance(e, PegainferError):
        return APIError(500, str(e), None, "server_error")
    return APIError(500, f"internal server error ({type(e).__name__}): see the server log", None, "server_error")


class OpenAIServer:
    """The route handlers and the state they share."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: Optional[str] = None,
                 api_key: Optional[str] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 reasoning_parser: str = "auto"):
        if reasoning_parser not in ("auto", "none", *REASONING_PARSERS):
            raise PegainferError(f"--reasoning-parser must be auto, none or one of {', '.join(REASONING_PARSERS)}; "
                                 f"got {reasoning_parser!r}")
        self.reasoning_parser = reasoning_parser
        self.async_engine = async_engine
        self.served_model_name = served_model_name
        self.api_key = api_key or None
        self.max_body_bytes = int(max_body_bytes)
        self.created = P.now()
        self._engine_model_name: Optional[str] = None
        self.metrics = ServerMetrics(async_engine, self.model_name, self.known_model_name)
        self.responses_store = R.ResponseStore()     # /v1/responses' conversations, for previous_response_id

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def engine(self):
        if not self.async_engine.ready:
            raise EngineNotReadyError(self.async_engine._not_ready_message())
        return self.async_engine.engine

    def known_model_name(self) -> Optional[str]:
        """``--served-model-name``, else the engine's model once it has loaded (kept after an engine failure, so
        its 500s count under the model that served); None while it loads."""
        if self.served_model_name:
            return self.served_model_name
        if self.async_engine.ready:
            self._engine_model_name = (getattr(self.async_engine.engine, "model_name", None)
                                       or self._engine_model_name or "pegainfer")
        return self._engine_model_name

    def model_name(self) -> str:
        """The name the server answers and counts under: ``known_model_name``, "pegainfer" while the model loads."""
        return self.known_model_name() or "pegainfer"

    def reasoning_parser_for(self, engine) -> Optional[str]:
        """The reasoning parser chat answers go through: "auto" picks ``qwen3`` for a folder whose chat template
        writes ``<think>`` blocks (Qwen3, Qwen3.5), none otherwise."""
        if self.reasoning_parser == "auto":
            template = engine.chat_template
            return "qwen3" if template is not None and template.writes_thinking else None
        return None if self.reasoning_parser == "none" else self.reasoning_parser

    def request_log(self, request: Request, prefix: str, route: str, n: int = 1) -> RequestLog:
        """The request's log (timed from its arrival) under its engine request id: ``<prefix>-<x-request-id>``, with
        a random suffix while a request with that id (or, for ``n`` > 1 choices, one of ``<id>-<i>``) is still in
        the engine (a client reusing its id)."""
        state = request.scope.get("state", {})
        rid = f"{prefix}-{state.get('request_id') or request_id_from(request.headers.get('x-request-id'))}"
        note = ""
        if self.async_engine.in_use(rid) or (n > 1 and any(self.async_engine.in_use(f"{rid}-{i}") for i in range(n))):
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
            note = f" id={rid}"
        return RequestLog(rid, route, state.get("arrival") or time.perf_counter(), self.metrics, note)

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the key given to --api-key as "
                                "'Authorization: Bearer <key>'", None, "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name():
            raise APIError(404, f"The model '{model}' does not exist: this server serves '{self.model_name()}' "
                                f"(or omit 'model')", "model", "model_not_found")

    async def read_json(self, request: Request) -> dict:
        content_type = request.headers.get("content-type")
        if content_type is not None:   # a body without a type is read as JSON; one typed as anything else: 415
            media = content_type.partition(";")[0].strip().lower()
            if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
                raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json', "
                                    f"got '{content_type}'", None, "unsupported_media_type")
        limit = self.max_body_bytes
        too_big = APIError(413, f"the request body is larger than the limit of {limit} bytes", None,
                           "request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            raise P.bad("the request body is empty: send a JSON object", None, "invalid_json")
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise P.bad("the request body is not UTF-8 text", None, "invalid_json") from None
        except json.JSONDecodeError as e:
            raise P.bad(f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})", None,
                        "invalid_json") from None
        if not isinstance(body, dict):
            raise P.bad(f"the request body must be a JSON object, got {P._type_name(body)}", None, "invalid_json")
        return body

    def sampling_params(self, s: P.Sampling, n_prompt: int, default_max_tokens: Optional[int],
                        prompt_param: str) -> SamplingParams:
        engine = self.engine
        limit = int(engine.max_model_len)
        if n_prompt >= limit:
            raise P.bad(f"This model's maximum context length is {limit} tokens, but the prompt has {n_prompt} "
                        f"tokens: shorten it (the context must also hold at least one generated token)",
                        prompt_param, "context_length_exceeded")
        room = limit - n_prompt
        if s.max_tokens is None:
            max_tokens = min(default_max_tokens or room, room)
        elif s.max_tokens > room:
            raise P.bad(f"This model's maximum context length is {limit} tokens. However, you requested "
                        f"{n_prompt + s.max_tokens} tokens ({n_prompt} in the prompt, {s.max_tokens} for the "
                        f"completion): ask for at most {room} tokens or shorten the prompt", "max_tokens",
                        "context_length_exceeded")
        else:
            max_tokens = s.max_tokens
        if s.min_tokens > max_tokens:
            raise P.bad(f"'min_tokens' ({s.min_tokens}) exceeds the {max_tokens} tokens this request may generate",
                        "min_tokens")
        vocab = int(getattr(engine, "vocab_size", 0) or engine.tokenizer.vocab_size)
        for name, ids in (("stop_token_ids", s.stop_token_ids), ("logit_bias", s.logit_bias),
                          ("allowed_token_ids", s.allowed_token_ids)):
            bad_ids = [t for t in ids if t >= vocab]
            if bad_ids:
                raise P.bad(f"'{name}' holds ids outside the vocabulary [0, {vocab}): {bad_ids[:5]}", name)
        d = getattr(engine, "generation_defaults", None)
        pick = lambda v, name, fallback: v if v is not None else getattr(d, name, fallback)  # noqa: E731
        return SamplingParams(max_tokens=max_tokens, temperature=pick(s.temperature, "temperature", 1.0),
                              top_p=pick(s.top_p, "top_p", 1.0), top_k=pick(s.top_k, "top_k", 0),
                              min_p=pick(s.min_p, "min_p", 0.0), seed=s.seed, stop=list(s.stop),
                              stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                              min_tokens=s.min_tokens, logprobs=s.logprobs,
                              repetition_penalty=pick(s.repetition_penalty, "repetition_penalty", 1.0),
                              frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                              logit_bias=dict(s.logit_bias), prompt_logprobs=s.prompt_logprobs,
                              skip_special_tokens=s.skip_special_tokens,
                              include_stop_str_in_output=s.include_stop_str_in_output, priority=s.priority,
                              bad_words=list(s.bad_words))

    async def output_grammar(self, engine, fmt: Optional[P.ResponseFormat], tools: Optional[list] = None,
                             tool_choice="none", parallel_tool_calls: bool = True,
                             allowed: Optional[list[int]] = None) -> Optional[str]:
        """The llguidance grammar a request's output must follow (None: free text): ``tool_choice`` "required" or a
        named function forces calls with arguments valid for the tool's schema (in the form the chat template
        teaches); ``fmt`` asks for JSON (valid for
        its schema), text matching a regex, one of a list of choices, or a Lark grammar -- or, for JSON, calls
        when ``tool_choice`` is "auto"; ``allowed``: only these token ids (vLLM's ``allowed_token_ids``).  What the grammar engine cannot follow is a 400 naming the field.
        Compiled in a worker thread (the first use builds the tokenizer's view)."""
        forced = tool_choice == "required" or isinstance(tool_choice, dict)
        if not forced and fmt is None and not allowed:
            return None
        compiler = getattr(engine, "grammar_compiler", None)
        if compiler is None:
            raise P.unsupported("tool_choice" if forced else fmt.param if fmt is not None else "allowed_token_ids",
                                "this engine cannot constrain decoding (structured output)")
        if allowed:
            if forced or fmt is not None:
                raise P.bad("'allowed_token_ids' cannot be combined with an output format or a forced tool call",
                            "allowed_token_ids")
            return await run_in_threadpool(compiler.allowed_tokens, allowed)
        call_tools = None
        if forced or (tools and tool_choice == "auto"):
            only = tool_choice["name"] if isinstance(tool_choice, dict) else None
            call_tools = {i: t["function"] for i, t in enumerate(tools) if only in (None, t["function"]["name"])}
        parallel = parallel_tool_calls and tool_choice == "required"
        # calls in the form the chat template teaches: Qwen3.5's XML elements, else Qwen3's JSON
        xml = engine.chat_template is not None and "<function=" in engine.chat_template.source

        def checked(make, *args) -> Optional[str]:
            """Why the grammar ``make(*args)`` cannot be followed, or None."""
            try:
                return compiler.check(make(*args))
            except ValueError as e:       # llguidance refuses what it cannot read at all
                return str(e)

        def compile_grammar() -> str:
            for i, fn in (call_tools or {}).items():
                error = checked(compiler.json_schema, fn.get("parameters") or {"type": "object"})
                if error:
                    raise P.bad(f"tools[{i}].function.parameters is not a JSON schema the output can be held to: "
                                f"{error}", f"tools[{i}].function.parameters", "invalid_schema")
            schemas = {fn["name"]: fn.get("parameters") for fn in (call_tools or {}).values()}
            if forced:
                return compiler.tool_calls(schemas, parallel, xml)
            if fmt.kind in ("json_schema", "json_object"):
                schema = fmt.schema if fmt.kind == "json_schema" else {"type": "object"}
                error = checked(compiler.json_schema, schema)
                if error:
                    raise P.bad(f"{fmt.param} is not a JSON schema the output can be held to: {error}", fmt.param,
                                "invalid_schema")
                return compiler.json_or_tool_calls(schema, schemas, parallel_tool_calls, xml) if call_tools else \
                    compiler.json_schema(schema)
            if call_tools:
                raise P.unsupported(fmt.param, f"{fmt.param} beside tools with tool_choice \"auto\" is not offered "
                                               f"(JSON is): set tool_choice \"none\" or ask for JSON")
            make, arg = {"regex": (compiler.regex, fmt.pattern), "choice": (compiler.choice, fmt.choices),
                         "grammar": (compiler.lark, fmt.grammar)}[fmt.kind]
            error = checked(make, arg)
            if error:
                raise P.bad(f"{fmt.param} cannot be followed: {error}", fmt.param, "invalid_grammar")
            return make(arg)

        return await run_in_threadpool(compile_grammar)

    async def off_loop_if_long(self, size: int, fn, *args):
        """``fn(*args)`` on the event loop when ``size`` (characters of prompt) is small — a worker-thread hop costs
        more than tokenizing a short prompt — else in a worker thread, so a long prompt never blocks the loop."""
        if size <= INLINE_TEXT_CHARS:
            return fn(*args)
        return await run_in_threadpool(fn, *args)

    # ------------------------------------------------------------------------------------------------ routes
    async def health(self, request: Request) -> Response:
        ae = self.async_engine
        if ae.ready:
            return JSONResponse({"status": "ok"})
        body = {"status": ae.state if ae.state != "created" else "loading"}
        if ae.load_error is not None:
            body["error"] = str(ae.load_error)
        return JSONResponse(body, status_code=503, headers={"Retry-After": RETRY_AFTER_S})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": pegainfer.__version__})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self) -> dict:
        card = {"id": self.model_name(), "object": "model", "created": self.created, "owned_by": "pegainfer"}
        if self.async_engine.ready:
            card["max_model_len"] = int(self.async_engine.engine.max_model_len)
        return card

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self.check_auth(request)
        self.check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        self.check_auth(request)
        req = P.parse_completion_request(await self.read_json(request))
        engine = self.engine
        self.check_model(req.model)
        tok = engine.tokenizer
        jobs, echoes = [], []
        for text, ids in req.prompts:
            if ids is None:
                ids = await self.off_loop_if_long(len(text), tok.encode, text, True)
            if not ids:
                raise P.bad("the prompt is empty after tokenization", "prompt", "empty_prompt")
            keep = req.sampling.truncate_prompt_tokens
            if keep is not None and len(ids) > keep:
                ids, text = ids[-keep:], None           # (an echo shows what was kept)
            jobs.append((ids, self.sampling_params(req.sampling, len(ids), DEFAULT_COMPLETION_MAX_TOKENS, "prompt")))
            if req.echo:
                echoes.append(text if text is not None else await run_in_threadpool(tok.decode, ids, False))
        grammar = await self.output_grammar(engine, req.response_format, allowed=req.sampling.allowed_token_ids)
        for _, params in jobs:
            params.grammar = grammar
        rid, choices, watch = await self._submit(request, "cmpl", "completions", jobs, req.n)
        name = self.model_name()
        echo = [echoes[c.prompt] if req.echo else "" for c in choices]    # each choice's echoed prompt
        # with logprobs the echoed prompt's tokens come first in them (from the first output: prompt_logprobs)
        scored = req.echo and req.sampling.logprobs is not None
        lps = [P.CompletionLogprobs(tok, 0 if scored else len(echo[k])) if c.params.logprobs is not None else None
               for k, c in enumerate(choices)]

        def logprobs_part(i, out):
            """Choice ``i``'s logprobs of ``out``: its prompt's first (the first output of an echo), then its
            tokens'."""
            part = lps[i].add_prompt(out.prompt_logprobs, jobs[choices[i].prompt][0]) \
                if scored and out.prompt_logprobs else None
            more = lps[i].add(out.logprobs)
            if part is None:
                return more
            return {key: part[key] + more[key] for key in part}

        def choice(index, text, logprobs, finish):
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

        if not req.stream:
            texts = [[e] for e in echo]
            prompt_lps: list = [None] * len(choices)

            def taker(i):
                def take(out):
                    texts[i].append(out.delta_text)
                    if out.prompt_logprobs is not None:
                        prompt_lps[i] = P.prompt_logprobs_json(tok, out.prompt_logprobs)
                    if lps[i] is not None:
                        logprobs_part(i, out)
                return take

            finishes = await self._collect(choices, watch, [taker(i) for i in range(len(choices))])
            body = {"id": rid, "object": "text_completion", "created": P.now(), "model": name,
                    "choices": [choice(i, "".join(texts[i]), lps[i].to_json() if lps[i] else None, finishes[i])
                                for i in range(len(choices))],
                    "usage": self._usage(choices), "system_fingerprint": None}
            if req.sampling.return_prompt_logprobs:
                for c, entries in zip(body["choices"], prompt_lps):
                    c["prompt_logprobs"] = entries
            return JSONResponse(body)

        created = P.now()

        def chunk(index, text, logprobs, finish):
            c = {"id": rid, "object": "text_completion", "created": created, "model": name,
                 "choices": [choice(index, text, logprobs, finish)]}
            if req.include_usage:
                c["usage"] = self._usage(choices) if req.continuous_usage else None
            return c

        # the chunk of almost every token, one per choice (built per token when each carries the usage so far)
        text_chunks = [(ChunkTemplate if not req.continuous_usage else _Rebuilt)(
            lambda text, i=i: chunk(i, text, None, None)) for i in range(len(choices))]

        async def events():
            tail, running = [], len(choices)
            pending_echo = list(echo) if scored else [""] * len(choices)   # sent with the prompt's logprobs
            try:
                if not scored:
                    for i, e in enumerate(echo):
                        if e:
                            yield text_chunks[i].fill(e)
                async for c, out in self._outputs(choices):
                    i, rlog = c.index, c.rlog
                    rlog.saw(out)
                    part = logprobs_part(i, out) if lps[i] is not None else None
                    text, pending_echo[i] = pending_echo[i] + out.delta_text, ""
                    if out.finished:
                        rlog.finish = self._finish_reason(out)
                        running -= 1
                        event = sse(chunk(i, text, part, rlog.finish))
                        if running:
                            yield event
                        else:
                            tail.append(event)
                    elif part:
                        yield sse(chunk(i, text, part, None))
                    elif text:
                        yield text_chunks[i].fill(text)
                if req.include_usage and not running:
                    tail.append(sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                                     "choices": [], "usage": self._usage(choices)}))
            except Exception as e:  # noqa: BLE001 - reported in the stream: the status line is already sent
                err = _api_error(e)
                for c in choices:
                    c.rlog.finish = c.rlog.finish or f"error:{err.status}"
                tail.append(sse(err.body()))
            tail.append(SSE_DONE)
            yield "".join(tail)   # the last token, the usage and [DONE]: one write

        return self._event_stream(events(), choices, watch)

    async def chat_completions(self, request: Request) -> Response:
        self.check_auth(request)
        return await self._chat(request, await self.read_json(request))

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API over the chat route (``responses.py``): the request translated into a chat
        request, the answer (or its stream of chunks) translated back."""
        self.check_auth(request)
        body = await self.read_json(request)
        try:
            chat = R.to_chat_body(body, self.responses_store)
            answer = await self._chat(request, R.strip_marks(chat), prefix="resp", route="responses")
        except APIError as e:
            e.param = R.rename_param(e.param, body)
            raise
        keep = body.get("store", True) is not False

        def stored(response: dict) -> dict:
            if keep and response["status"] in ("completed", "incomplete"):
                self.responses_store.put(response["id"], R.conversation(chat, response["output"]))
            return response

        if not chat.get("stream"):
            return JSONResponse(stored(R.response_body(body, chat, json.loads(answer.body))))
        translator = R.StreamTranslator(body, {**chat, "model": self.model_name()}, P.now())
        chunks = answer.events

        async def events():
            for event in translator.start():
                yield event
            async for text in chunks:
                for line in text.split("\n\n"):
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for event in translator.chunk(json.loads(line[6:])):
                            yield event
            end = translator.end()
            stored(translator.response)
            yield "".join(end)

        return EventStreamResponse(events(), answer.watch, on_close=answer.on_close)

    async def _chat(self, request: Request, body: dict, prefix: str = "chatcmpl", route: str = "chat") -> Response:
        """A chat request's answer (``prefix`` / ``route``: its engine id's prefix and its log line's route)."""
        req = P.parse_chat_request(body)
        engine = self.engine
        self.check_model(req.model)
        if engine.chat_template is None:
            raise P.bad("this model folder has no chat template (tokenizer_config.json chat_template or "
                        "chat_template.jinja): use /v1/completions", "messages", "no_chat_template")
        tok = engine.tokenizer
        tools = req.tools if req.tool_choice != "none" else None   # "none": the model is not told about them

        def render_and_encode():
            text = engine.chat_template.render(req.messages, add_generation_prompt=req.add_generation_prompt,
                                               tools=tools, continue_final_message=req.continue_final_message,
                                               **req.template_kwargs)
            return text, tok.encode(text, False)

        size = sum(len(m["content"]) for m in req.messages) + (len(json.dumps(tools)) if tools else 0)
        prompt_text, ids = await self.off_loop_if_long(size, render_and_encode)
        keep = req.sampling.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
        if not ids:
            raise P.bad("the chat template rendered these messages as an empty prompt", "messages", "empty_prompt")
        params = self.sampling_params(req.sampling, len(ids), None, "messages")
        thinking = self.reasoning_parser_for(engine)
        grammar = await self.output_grammar(engine, req.response_format, req.tools, req.tool_choice,
                                            req.parallel_tool_calls, req.sampling.allowed_token_ids)
        if grammar is not None:
            params.grammar = grammar
            start = reasoning_start(prompt_text) if thinking else "content"
            params.grammar_after_think = grammar_after_think(start)
        top_n = params.logprobs or 0
        rid, choices, watch = await self._submit(request, prefix, route, [(ids, params)], req.n)
        name = self.model_name()
        parsers = [ChatOutputParser(ReasoningParser(reasoning_start(prompt_text)) if thinking else None,
                                    ToolCallParser(req.tool_schemas()) if tools else None) for _ in choices]

        def finish_reason(i: int, finish: str) -> str:
            return "tool_calls" if parsers[i].calls and finish == "stop" else finish

        if not req.stream:
            answers, content_lps = [ChatDelta() for _ in choices], [[] for _ in choices]

            prompt_lps = []

            def taker(i):
                def take(out):
                    answers[i].add(parsers[i].push(out.delta_text))
                    if params.logprobs is not None:
                        content_lps[i].extend(P.chat_logprobs(tok, out.logprobs, top_n))
                    if i == 0 and out.prompt_logprobs is not None:
                        prompt_lps.extend(P.prompt_logprobs_json(tok, out.prompt_logprobs))
                return take

            finishes = await self._collect(choices, watch, [taker(i) for i in range(len(choices))])

            def message(i):
                answer = answers[i]
                answer.add(parsers[i].flush())
                m = {"role": "assistant", "content": answer.content}
                if thinking:
                    m["reasoning_content"] = answer.reasoning if parsers[i].reasoning.thought else None
                if answer.tool_calls:
                    m["content"] = answer.content or None
                    m["tool_calls"] = [c.to_openai() for c in answer.tool_calls]
                return m

            body = {"id": rid, "object": "chat.completion", "created": P.now(), "model": name,
                    "choices": [{"index": i, "message": message(i),
                                 "logprobs": ({"content": content_lps[i], "refusal": None}
                                              if params.logprobs is not None else None),
                                 "finish_reason": finish_reason(i, finishes[i])} for i in range(len(choices))],
                    "usage": self._usage(choices), "system_fingerprint": None}
            if req.sampling.return_prompt_logprobs:
                body["prompt_logprobs"] = prompt_lps
            return JSONResponse(body)

        created = P.now()

        def chunk(index, delta, logprobs, finish):
            c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                 "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if req.include_usage:
                c["usage"] = self._usage(choices) if req.continuous_usage else None
            return c

        text_chunks = [(ChunkTemplate if not req.continuous_usage else _Rebuilt)(
            lambda text, i=i: chunk(i, {"content": text}, None, None)) for i in range(len(choices))]
        n_calls = [0] * len(choices)

        def deltas(i: int, d: ChatDelta) -> list[dict]:
            """The stream deltas of what one output of choice ``i`` settled; a call as OpenAI streams one: its id,
            type and name with empty arguments, then the arguments."""
            out = [{"reasoning_content": d.reasoning}] if d.reasoning else []
            if d.content:
                out.append({"content": d.content})
            for call in d.tool_calls:
                head = {"index": n_calls[i], "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}}
                out += [{"tool_calls": [head]},
                        {"tool_calls": [{"index": n_calls[i], "function": {"arguments": call.arguments}}]}]
                n_calls[i] += 1
            return out

        async def events():
            tail, running = [], len(choices)
            try:
                # with tools the answer may be calls only, whose content is null (as OpenAI streams them)
                for i in range(len(choices)):
                    yield sse(chunk(i, {"role": "assistant", "content": None if tools else ""}, None, None))
                async for c, out in self._outputs(choices):
                    i, rlog = c.index, c.rlog
                    rlog.saw(out)
                    lps = None
                    if params.logprobs is not None and out.logprobs:
                        lps = {"content": P.chat_logprobs(tok, out.logprobs, top_n), "refusal": None}
                    finish = self._finish_reason(out) if out.finished else None
                    d = parsers[i].push(out.delta_text)
                    if finish:
                        d.add(parsers[i].flush())
                        running -= 1
                    last = finish and not running        # the events of the last output go out with [DONE]
                    parts = deltas(i, d)
                    if lps is not None and not parts:
                        parts = [{"content": ""}]
                    for k, part in enumerate(parts):
                        if k == 0 and lps is None and len(part) == 1 and "content" in part:
                            event = text_chunks[i].fill(part["content"])
                        else:
                            event = sse(chunk(i, part, lps if k == 0 else None, None))
                        if last:
                            tail.append(event)
                        else:
                            yield event
                    if finish:
                        rlog.finish = finish_reason(i, finish)
                        event = sse(chunk(i, {}, None, rlog.finish))
                        if last:
                            tail.append(event)
                        else:
                            yield event
                if req.include_usage and not running:
                    tail.append(sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                     "model": name, "choices": [], "usage": self._usage(choices)}))
            except Exception as e:  # noqa: BLE001 - reported in the stream: the status line is already sent
                err = _api_error(e)
                for c in choices:
                    c.rlog.finish = c.rlog.finish or f"error:{err.status}"
                tail.append(sse(err.body()))
            tail.append(SSE_DONE)
            yield "".join(tail)   # the last token, the finish and usage chunks and [DONE]: one write

        return self._event_stream(events(), choices, watch)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: the token ids a prompt (as /v1/completions encodes it) or a chat (rendered as
        /v1/chat/completions renders it) becomes, their count and the context limit."""
        self.check_auth(request)
        req = P.parse_tokenize_request(await self.read_json(request))
        engine = self.engine
        self.check_model(req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            if engine.chat_template is None:
                raise P.bad("this model folder has no chat template: tokenize a 'prompt' instead", "messages",
                            "no_chat_template")

            def render_and_encode():
                text = engine.chat_template.render(req.messages, add_generation_prompt=req.add_generation_prompt,
                                                   tools=req.tools, **req.template_kwargs)
                return tok.encode(text, req.add_special_tokens)

            ids = await self.off_loop_if_long(sum(len(m["content"]) for m in req.messages), render_and_encode)
        else:
            ids = await self.off_loop_if_long(len(req.prompt), tok.encode, req.prompt, req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": int(engine.max_model_len), "tokens": ids,
                "token_strs": [tok.token_str(t) for t in ids] if req.return_token_strs else None}
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: the text of token ids (special tokens kept, as they would be in a prompt)."""
        self.check_auth(request)
        model, ids = P.parse_detokenize_request(await self.read_json(request))
        engine = self.engine
        self.check_model(model)
        vocab = int(getattr(engine, "vocab_size", 0) or engine.tokenizer.vocab_size)
        bad_ids = [t for t in ids if t >= vocab]
        if bad_ids:
            raise P.bad(f"'tokens' holds ids outside the vocabulary [0, {vocab}): {bad_ids[:5]}", "tokens")
        text = await self.off_loop_if_long(len(ids), engine.tokenizer.decode, ids, False)
        return JSONResponse({"prompt": text})

    # ------------------------------------------------------------------------------------------------ plumbing
    @staticmethod
    def _finish_reason(out: RequestOutput) -> str:
        if out.finish_reason in ("stop", "length"):
            return out.finish_reason
        if out.finish_reason == "error":
            raise APIError(500, f"generation failed: {out.error or 'engine error'}", None, "engine_error")
        raise APIError(503, "the request was aborted by the server (shutting down?): retry", None, "aborted",
                       headers={"Retry-After": RETRY_AFTER_S})

    @staticmethod
    def _usage(choices: list["Choice"]) -> dict:
        """The request's usage: each prompt once, the completions of every choice."""
        firsts = [c.rlog for c in choices if c.first_of_prompt]
        return P.usage(sum(r.prompt_tokens for r in firsts), sum(c.rlog.completion_tokens for c in choices),
                       sum(r.cached_tokens for r in firsts))

    async def _submit(self, request: Request, prefix: str, route: str, jobs: list[tuple[list[int], SamplingParams]],
                      n: int) -> tuple[str, list["Choice"], ClientWatch]:
        """Hand the request's choices to the engine -- ``n`` for each (prompt ids, params) of ``jobs``, choice ``k``
        the ``k % n``-th of prompt ``k // n`` -- and wait until all are accepted; from here on one ClientWatch cancels
        them all when the client goes away.  Each choice is an engine request: ``<id>`` when it is the only one,
        else ``<id>-<k>``; with a seed, the ``i``-th choice of a prompt draws with the seed plus ``i`` (vLLM's
        rule).  Returns (the response id, the choices, the watch); the caller's response closes the watch."""
        total = len(jobs) * n
        base = self.request_log(request, prefix, route, total)
        rid = base.request_id
        choices = []
        try:
            for k in range(total):
                ids, params = jobs[k // n]
                i = k % n
                rlog = base if total == 1 else RequestLog(f"{rid}-{k}", route, base.t0, self.metrics, f" id={rid}-{k}")
                rlog.prompt_tokens = len(ids)
                p = params if i == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + i)
                choices.append(Choice(k, self.async_engine.submit(rlog.request_id, ids, p), rlog, k // n, p, i == 0))
        except BaseException:
            for c in choices:
                c.stream.cancel()
            raise
        watch = ClientWatch(request.receive)
        for c in choices:
            watch.on_disconnect(c.stream.cancel)
        try:
            for c in choices:
                await c.stream.accepted()
        except BaseException as e:
            watch.close()
            for c in choices:
                c.stream.cancel()
            if isinstance(e, asyncio.CancelledError):
                if not watch.disconnected:
                    raise
                for c in choices:
                    c.rlog.write("cancelled")
                raise ClientDisconnected() from None
            if isinstance(e, Exception) and _api_error(e).status >= 500:   # (a refusal, 4xx, is not counted)
                for c in choices:
                    c.rlog.write(f"error:{_api_error(e).status}")
            raise
        return rid, choices, watch

    async def _collect(self, choices: list["Choice"], watch: ClientWatch, takes: list[Callable]) -> list[str]:
        """Feed every output of each choice of a non-streamed request to its ``take``; return their finish
        reasons.  Logs each choice either way; raises ClientDisconnected when the client left first (every choice
        is then aborted, as on any error)."""

        async def collect(c: Choice, take: Callable) -> str:
            async with c.stream:   # leaving early (an error, a cancelled sibling) aborts the request
                async for out in c.stream:
                    c.rlog.saw(out)
                    take(out)
                    if out.finished:
                        finish = self._finish_reason(out)
                        c.rlog.write(finish)
                        return finish
            if watch.disconnected:
                raise ClientDisconnected()
            raise APIError(500, "the request ended without a result", None, "engine_error")

        try:
            if len(choices) == 1:
                return [await collect(choices[0], takes[0])]
            tasks = [asyncio.ensure_future(collect(c, take)) for c, take in zip(choices, takes)]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        except ClientDisconnected:
            for c in choices:
                c.rlog.write("cancelled")
            raise
        except Exception as e:
            for c in choices:
                c.rlog.write(f"error:{_api_error(e).status}")
            raise
        finally:
            watch.close()

    @staticmethod
    async def _outputs(choices: list["Choice"]) -> AsyncIterator[tuple["Choice", RequestOutput]]:
        """(choice, output) as each choice's stream gives them; one choice's stream is read directly, several
        through a queue that one reader task per stream fills (their tasks are cancelled when this ends)."""
        if len(choices) == 1:
            c = choices[0]
            async for out in c.stream:
                yield c, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def read(c: Choice) -> None:
            try:
                async for out in c.stream:
                    queue.put_nowait((c, out, None))
                queue.put_nowait((c, None, None))
            except Exception as e:  # noqa: BLE001 - handed to the reader of the queue
                queue.put_nowait((c, None, e))

        tasks = [asyncio.ensure_future(read(c)) for c in choices]
        try:
            running = len(tasks)
            while running:
                c, out, err = await queue.get()
                if err is not None:
                    raise err
                if out is None:
                    running -= 1
                else:
                    yield c, out
        finally:
            for t in tasks:
                t.cancel()

    @staticmethod
    def _event_stream(events: AsyncIterator[str], choices: list["Choice"], watch: ClientWatch) -> EventStreamResponse:
        def on_close():
            for c in choices:
                c.stream.cancel()  # a no-op when the request finished; aborts it when the client left early
                c.rlog.write()     # finish reason, or "cancelled" when the stream was cut short
        return EventStreamResponse(events, watch, on_close=on_close)


class _Rebuilt:
    """``ChunkTemplate``'s interface for chunks that change beyond their text (the usage so far in each): the
    chunk built and serialized for every token."""

    def __init__(self, make_chunk: Callable[[str], dict]):
        self.make_chunk = make_chunk

    def fill(self, text: str) -> str:
        return sse(self.make_chunk(text))


@dataclasses.dataclass
class Choice:
    """One choice of a request: its index in the response, its engine request's stream and log, the prompt it
    continues (its index in the request) and its sampling parameters."""
    index: int
    stream: object
    rlog: RequestLog
    prompt: int
    params: SamplingParams
    first_of_prompt: bool       # the prompt's first choice (usage counts each prompt once)


def build_app(async_engine: AsyncEngine, served_model_name: Optional[str] = None, api_key: Optional[str] = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, reasoning_parser: str = "auto",
              cors: Optional[dict] = None) -> Starlette:
    """The ASGI app.  ``served_model_name`` None → the engine's ``model_name``; ``api_key`` guards ``/v1/*``;
    ``reasoning_parser``: "auto" (``qwen3`` for templates with ``<think>`` blocks), "none", or a parser name;
    ``cors``: Starlette ``CORSMiddleware``'s arguments (``allow_origins``, ...) to let browser pages of other
    origins call the API, outermost, so that a preflight ``OPTIONS`` is answered before the API key is asked for."""
    server = OpenAIServer(async_engine, served_model_name, api_key, max_body_bytes, reasoning_parser)

    def endpoint(handler):
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientDisconnected:
                return Response(status_code=499)  # nobody is listening any more
            except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI error body; the server keeps going
                err = _api_error(e)
                if err.status >= 500 and not isinstance(e, (APIError, PegainferError)):
                    log.exception("unexpected error on %s %s", request.method, request.url.path)
                else:
                    log.info("%s %s -> %d %s", request.method, request.url.path, err.status, err.message)
                return _error_response(err)
        return run

    async def http_error(request: Request, exc: HTTPException) -> Response:
        messages = {404: f"no route {request.method} {request.url.path}: see /v1/completions, "
                         f"/v1/chat/completions, /v1/responses, /v1/models, /tokenize, /detokenize, /health, /version, "
                         f"/metrics",
                    405: f"method {request.method} is not allowed on {request.url.path}"}
        err = APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail)), None,
                       {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code),
                       headers=dict(exc.headers or {}))
        return _error_response(err)

    routes = [
        Route("/v1/completions", endpoint(server.completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(server.chat_completions), methods=["POST"]),
        Route("/v1/responses", endpoint(server.responses), methods=["POST"]),
        Route("/v1/models", endpoint(server.models), methods=["GET"]),
        Route("/tokenize", endpoint(server.tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(server.detokenize), methods=["POST"]),
        Route("/v1/models/{model:path}", endpoint(server.model), methods=["GET"]),
        Route("/health", endpoint(server.health), methods=["GET"]),
        Route("/version", endpoint(server.version), methods=["GET"]),
        Route("/metrics", endpoint(server.prometheus), methods=["GET"]),
    ]
    middleware = [Middleware(CORSMiddleware, **cors)] if cors else []
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error},
                    middleware=middleware + [Middleware(RequestIdMiddleware)])
    app.state.server = server
    install_log_filter(log)
    return app
