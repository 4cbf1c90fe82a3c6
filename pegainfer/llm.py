"""The Python API for offline inference: many prompts in, their completions out, batched by the engine.

::

    from pegainfer import LLM, SamplingParams

    llm = LLM("Qwen/Qwen3-4B")                       # a model folder or a Hub id; LLM() is the demo model
    for g in llm.generate(["The capital of France is", "def fib(n):"], SamplingParams(max_tokens=32)):
        print(g.prompt, g.text)
    g, = llm.chat([{"role": "user", "content": "Write a haiku"}], SamplingParams(temperature=0.7, max_tokens=256),
                  chat_template_kwargs={"enable_thinking": False})
    print(g.outputs[0].content)

Every prompt goes to the engine at once; its scheduler runs them as the server's would (continuous batching,
prompt chunks beside decodes, the prefix cache, preemption when pages run out), so a list of prompts runs at the
batched throughput, and the results come back in the prompts' order.  vLLM's ``LLM`` is the model of the API:
``generate`` / ``chat`` return one ``Generation`` a prompt, each with ``n`` ``Completion``s (choice ``i`` seeded
``seed + i`` when a seed is given, the server's rule); ``SamplingParams`` is the engine's own (``engine/types.py``).
Structured output: ``json_schema=`` / ``regex=`` / ``choice=`` / ``grammar=`` (a Lark grammar), for every prompt
of the call.  Chat: the model's chat template (or ``chat_template=`` at construction), ``tools`` and
``chat_template_kwargs`` passed to it; a template that thinks gets ``reasoning_content`` and ``content`` split as
the server splits them.  One ``LLM`` serves one thread at a time.  Ctrl-C aborts the call's requests and leaves the
engine ready for the next call.

``AsyncLLM`` is the same model for asyncio programs: the engine on a thread of its own (``engine/async_engine.py``,
the server's), ``generate`` / ``chat`` async iterators of one request's ``StreamDelta``s, concurrent requests
batched.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from pegainfer.engine.types import SamplingParams, TokenLogprob
from pegainfer.errors import PegainferError
from pegainfer.text.tool_calls import ToolCall

Prompt = Union[str, Sequence[int]]
Messages = list[dict[str, Any]]


@dataclass
class Completion:
    """One choice of a prompt's completion."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]                     # "stop", "length", "abort" or "error"
    logprobs: Optional[list[TokenLogprob]] = None    # one per token, with ``SamplingParams.logprobs``
    reasoning_content: Optional[str] = None          # chat with a thinking template: the text inside <think>
    content: Optional[str] = None                    # chat: the answer after it (less any tool calls)
    tool_calls: Optional[list[ToolCall]] = None      # chat with tools: the calls the answer makes
    error: Optional[str] = None                      # why it ended with "error"

    @property
    def cumulative_logprob(self) -> Optional[float]:
        """The sum of the chosen tokens' logprobs (with ``SamplingParams.logprobs``)."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class Generation:
    """What one prompt gave: its ``n`` completions."""

    prompt: Optional[str]                            # the text (for a chat: as the template rendered it)
    prompt_token_ids: list[int]
    outputs: list[Completion] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None   # with ``SamplingParams.prompt_logprobs``
    num_cached_tokens: int = 0                       # prompt tokens found in the prefix cache (first choice)

    @property
    def text(self) -> str:
        """The first completion's text."""
        return self.outputs[0].text


class LLM:
    """A model loaded for offline inference (module docstring).  ``model``: a model folder, a Hugging Face Hub id
    (fetched into the cache at ``revision``, into ``download_dir``), or None for the built-in demo model (random
    weights).  The rest are the server's settings: ``max_batch`` sequences at once (graphs captured for them),
    ``max_num_batched_tokens`` a step, the KV cache from ``gpu_memory_utilization`` of the GPU's memory,
    ``enable_prefix_caching`` (None: the model's default), ``launch_policy`` fields as ``--launch-policy`` takes
    them (a dict), ``mamba_ssm_cache_dtype`` Qwen3.5's state in memory (``Engine.from_folder``)."""

    def __init__(self, model: Optional[str] = None, *, max_model_len: Optional[int] = None, max_batch: int = 256,
                 max_num_batched_tokens: int = 2048, gpu_memory_utilization: float = 0.9,
                 enable_prefix_caching: Optional[bool] = None, cuda_graph: bool = True, async_scheduling: bool = True,
                 chat_template: Optional[str] = None, revision: Optional[str] = None,
                 download_dir: Optional[str] = None, scheduling_policy: str = "fcfs",
                 launch_policy: Optional[dict] = None, mamba_ssm_cache_dtype: str = "auto"):
        from pegainfer.engine.engine import Engine, engine_policy
        self.engine = Engine.from_folder(model, max_model_len, max_batch=max_batch,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         gpu_memory_utilization=gpu_memory_utilization,
                                         enable_prefix_caching=enable_prefix_caching, use_cuda_graph=cuda_graph,
                                         async_scheduling=async_scheduling, chat_template=chat_template,
                                         revision=revision, download_dir=download_dir,
                                         scheduling_policy=scheduling_policy, policy=engine_policy(launch_policy),
                                         mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model folder's ``generation_config.json`` sampling defaults (temperature,
        top-p, top-k, min-p, repetition penalty) where it sets them: what ``generate`` uses when given none."""
        d = self.engine.generation_defaults
        changes = {name: getattr(d, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                   if getattr(d, name, None) is not None}
        return dataclasses.replace(SamplingParams(), **changes)

    # ------------------------------------------------------------------------------------------------ API
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *, n: int = 1,
                 json_schema: Optional[dict] = None, regex: Optional[str] = None,
                 choice: Optional[Sequence[str]] = None, grammar: Optional[str] = None,
                 use_tqdm: bool = True) -> list[Generation]:
        """Complete each prompt (a text, or token ids; or a list of them) as written, no chat template.  One
        ``sampling_params`` for all or one a prompt (None: ``default_sampling_params()``); ``n`` choices a
        prompt; at most one of the structured-output arguments; ``use_tqdm``: a progress bar on stderr (completions
        done, output tokens a second)."""
        texts, ids = self._prompt_inputs(prompts)
        return self._run(texts, ids, self._params(sampling_params, len(ids)), n,
                         self._grammar(json_schema, regex, choice, grammar), chat=False, use_tqdm=use_tqdm)

    def chat(self, messages: Union[Messages, Sequence[Messages]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *, n: int = 1,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Optional[list[dict]] = None, chat_template_kwargs: Optional[dict] = None,
             json_schema: Optional[dict] = None, regex: Optional[str] = None,
             choice: Optional[Sequence[str]] = None, grammar: Optional[str] = None,
             use_tqdm: bool = True) -> list[Generation]:
        """Answer a conversation (a list of ``{"role", "content"}`` messages) or a list of them through the chat
        template; the rest as ``generate``.  Structured output applies to the answer after any thinking.  ``tools``
        (OpenAI's form, ``{"type": "function", "function": {"name", "description", "parameters"}}``) go to the
        template, and the calls the answer makes come back in ``Completion.tool_calls``."""
        texts, ids, schemas = self._chat_inputs(messages, add_generation_prompt, continue_final_message, tools,
                                                chat_template_kwargs)
        return self._run(texts, ids, self._params(sampling_params, len(ids)), n,
                         self._grammar(json_schema, regex, choice, grammar), chat=True, use_tqdm=use_tqdm,
                         tools=schemas)

    # ------------------------------------------------------------------------------------------------ internals
    def _prompt_inputs(self, prompts) -> tuple[list[Optional[str]], list[list[int]]]:
        """(texts, token ids) of a prompt (text or ids) or a list of them."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return texts, [self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]

    def _chat_inputs(self, messages, add_generation_prompt: bool, continue_final_message: bool,
                     tools: Optional[list[dict]], chat_template_kwargs: Optional[dict]):
        """(rendered texts, token ids, the tools' schemas by name or None) of a conversation or a list of them."""
        template = self.engine.chat_template
        if template is None:
            raise PegainferError("this model folder has no chat template: use generate(), or pass chat_template= "
                                 "to LLM()")
        schemas = None
        if tools:
            try:
                schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
            except (TypeError, KeyError):
                raise PegainferError('each tool must be {"type": "function", "function": {"name": ..., '
                                     '"parameters": {...}}}') from None
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [template.render(list(c), add_generation_prompt=add_generation_prompt, tools=tools,
                                 continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
                 for c in conversations]
        return texts, [self.tokenizer.encode(t) for t in texts], schemas

    def _thinks(self, chat: bool) -> bool:
        """Whether a chat's output may start with thinking (the template writes ``<think>``)."""
        return chat and self.engine.chat_template.writes_thinking

    def _request(self, p: SamplingParams, j: int, grammar: Optional[str], start: Optional[str]) -> SamplingParams:
        """Choice ``j``'s parameters: seed ``seed + j``; the output grammar, after the thinking when the output
        starts thinking (``start``: ``reasoning_start`` of the prompt, None without a thinking template)."""
        pj = dataclasses.replace(p, seed=None if p.seed is None else p.seed + j)
        if grammar is not None:
            pj.grammar = grammar
            if start is not None:
                from pegainfer.text.structured import grammar_after_think
                pj.grammar_after_think = grammar_after_think(start)
        return pj

    @staticmethod
    def _chat_parser(start: Optional[str], tools: Optional[dict[str, dict]]):
        """The parser that splits a chat answer into thinking, content and tool calls (the server's)."""
        from pegainfer.text.chat_output import ChatOutputParser
        from pegainfer.text.reasoning import ReasoningParser
        from pegainfer.text.tool_calls import ToolCallParser
        return ChatOutputParser(ReasoningParser(start) if start is not None else None,
                                ToolCallParser(tools) if tools else None)

    def _params(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise PegainferError(f"{len(params)} sampling params for {count} prompts: give one, or one a prompt")
        return params

    def _grammar(self, json_schema, regex, choice, grammar) -> Optional[str]:
        given = [(name, value) for name, value in (("json_schema", json_schema), ("regex", regex),
                                                   ("choice", choice), ("grammar", grammar)) if value is not None]
        if not given:
            return None
        if len(given) > 1:
            raise PegainferError(f"give one of json_schema, regex, choice and grammar, not {given[0][0]} and "
                                 f"{given[1][0]}")
        compiler = self.engine.grammar_compiler
        name, value = given[0]
        make = {"json_schema": compiler.json_schema, "regex": compiler.regex,
                "choice": lambda v: compiler.choice(list(v)), "grammar": compiler.lark}[name]
        return compiler.followable(name, lambda: make(value))

    def _run(self, texts: list[Optional[str]], ids: list[list[int]], params: list[SamplingParams], n: int,
             grammar: Optional[str], chat: bool, use_tqdm: bool = False,
             tools: Optional[dict[str, dict]] = None) -> list[Generation]:
        from pegainfer.text.chat_output import ChatOutputParser
        from pegainfer.text.reasoning import reasoning_start

        if n < 1:
            raise PegainferError(f"n must be at least 1, got {n}")
        thinks = self._thinks(chat)
        call = next(self._ids)
        results = [Generation(t, i) for t, i in zip(texts, ids)]
        state: dict[str, tuple[int, Completion, Optional[ChatOutputParser], list[str]]] = {}
        try:
            for k, (text, prompt_ids, p) in enumerate(zip(texts, ids, params)):
                start = reasoning_start(text) if thinks else None
                for j in range(n):
                    rid = f"llm-{call}-{k}-{j}"
                    self.engine.add_request(rid, prompt_ids, self._request(p, j, grammar, start))
                    choice = Completion(j, "", [], None, [] if p.logprobs is not None else None)
                    results[k].outputs.append(choice)
                    state[rid] = (k, choice, self._chat_parser(start, tools) if chat else None, [])
            self._drain(state, results, use_tqdm, bool(tools))
        except BaseException:
            for rid in state:
                self.engine.abort(rid)
            while self.engine.has_unfinished():   # the aborts take effect; the engine is ready for the next call
                self.engine.step()
            raise
        return results

    def _drain(self, state, results: list[Generation], use_tqdm: bool, chat_tools: bool) -> None:
        """Step the engine until every request of ``state`` finished, collecting its outputs."""
        import time

        from tqdm import tqdm
        pending, generated, t0 = set(state), 0, time.perf_counter()
        with tqdm(total=len(state), desc="Completions", unit="seq", dynamic_ncols=True,
                  disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    entry = state.get(out.request_id)
                    if entry is None:
                        continue
                    k, choice, parser, pieces = entry
                    choice.token_ids += out.new_token_ids
                    generated += len(out.new_token_ids)
                    pieces.append(out.delta_text)
                    if out.logprobs and choice.logprobs is not None:
                        choice.logprobs += out.logprobs
                    if out.prompt_logprobs is not None and choice.index == 0:
                        results[k].prompt_logprobs = out.prompt_logprobs
                    if not out.finished:
                        continue
                    pending.discard(out.request_id)
                    bar.update(1)
                    bar.set_postfix_str(f"output {generated / max(time.perf_counter() - t0, 1e-9):.1f} tok/s",
                                        refresh=False)
                    choice.text, choice.finish_reason, choice.error = "".join(pieces), out.finish_reason, out.error
                    if choice.index == 0:
                        results[k].num_cached_tokens = out.cached_tokens
                    if parser is not None:      # a chat: the thinking, the answer and its calls apart
                        answer = parser.push(choice.text)
                        answer.add(parser.flush())
                        choice.reasoning_content = answer.reasoning if parser.reasoning is not None else None
                        choice.content = answer.content
                        if chat_tools:
                            choice.tool_calls = answer.tool_calls
                            choice.content = (answer.content or None) if answer.tool_calls else answer.content


@dataclass
class StreamDelta:
    """What one engine step added to a streamed request (``AsyncLLM``)."""

    text: str                                        # the new text (whole UTF-8 characters; stop strings held back)
    token_ids: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None              # with the last delta
    logprobs: Optional[list[TokenLogprob]] = None    # one per new token, with ``SamplingParams.logprobs``
    reasoning_content: Optional[str] = None          # chat with a thinking template: new thinking text
    content: Optional[str] = None                    # chat: new answer text
    tool_calls: Optional[list[ToolCall]] = None      # chat with tools: calls this delta completed
    error: Optional[str] = None                      # why it ended with "error"


class AsyncLLM:
    """The engine on a thread of its own, for asyncio programs (a web app, a bot): ``generate`` and ``chat`` are
    async iterators of one request's ``StreamDelta``s as its tokens come, and requests started concurrently (tasks,
    ``asyncio.gather``) run batched, as the server runs them (``engine/async_engine.py``, without HTTP).  Leaving an
    iteration early, or cancelling its task, aborts the request.  Built like ``LLM`` (the model loads on the calling
    thread); ``close()`` (or ``async with``) stops the thread.  Errors: ``PegainferError`` for a bad request, as
    ``LLM``'s; an engine failure ends every stream with ``EngineStepError``."""

    def __init__(self, model: Optional[str] = None, **options):
        from pegainfer.engine.async_engine import AsyncEngine
        self._llm = LLM(model, **options)
        self.engine = self._llm.engine
        self._async = AsyncEngine(self.engine).start()
        self._async.wait_ready()
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        return self._llm.default_sampling_params()

    async def generate(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None, *,
                       json_schema: Optional[dict] = None, regex: Optional[str] = None,
                       choice: Optional[Sequence[str]] = None, grammar: Optional[str] = None):
        """Stream the completion of one prompt (a text or token ids), as ``LLM.generate``."""
        texts, ids = self._llm._prompt_inputs(prompt)
        if len(ids) != 1:
            raise PegainferError("AsyncLLM.generate takes one prompt: start a task a prompt to run several at once")
        p = self._llm._params(sampling_params, 1)[0]
        request = self._llm._request(p, 0, self._llm._grammar(json_schema, regex, choice, grammar), None)
        async for delta in self._stream(ids[0], request, None):
            yield delta

    async def chat(self, messages: Messages, sampling_params: Optional[SamplingParams] = None, *,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   tools: Optional[list[dict]] = None, chat_template_kwargs: Optional[dict] = None,
                   json_schema: Optional[dict] = None, regex: Optional[str] = None,
                   choice: Optional[Sequence[str]] = None, grammar: Optional[str] = None):
        """Stream the answer to one conversation, as ``LLM.chat``: each delta's new text also split into
        ``reasoning_content`` and ``content``, and the tool calls it completed."""
        from pegainfer.text.reasoning import reasoning_start
        texts, ids, schemas = self._llm._chat_inputs(messages, add_generation_prompt, continue_final_message, tools,
                                                     chat_template_kwargs)
        if len(ids) != 1:
            raise PegainferError("AsyncLLM.chat takes one conversation: start a task a conversation to run several")
        start = reasoning_start(texts[0]) if self._llm._thinks(True) else None
        p = self._llm._params(sampling_params, 1)[0]
        request = self._llm._request(p, 0, self._llm._grammar(json_schema, regex, choice, grammar), start)
        async for delta in self._stream(ids[0], request, self._llm._chat_parser(start, schemas)):
            yield delta

    async def _stream(self, prompt_ids: list[int], params: SamplingParams, parser):
        async for out in self._async.generate(f"async-{next(self._ids)}", prompt_ids, params):
            delta = StreamDelta(out.delta_text, list(out.new_token_ids), out.finished, out.finish_reason,
                                out.logprobs, error=out.error)
            if parser is not None:
                chunk = parser.push(out.delta_text)
                if out.finished:
                    chunk.add(parser.flush())
                delta.content = chunk.content
                if parser.reasoning is not None:
                    delta.reasoning_content = chunk.reasoning
                if parser.tool_parser is not None:
                    delta.tool_calls = chunk.tool_calls
            yield delta

    def close(self) -> None:
        """Stop the engine thread (requests still running are dropped)."""
        self._async.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
