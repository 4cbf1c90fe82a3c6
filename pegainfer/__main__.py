"""Command line: ``python -m pegainfer {generate,serve,bench,bench-serve}``. Run with ``--help`` for everything.

Every flag's value is checked while the arguments are parsed (``argtypes``), so a bad one ends the command with
one ``error:`` line before anything loads."""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from typing import Optional

import pegainfer

if getattr(pegainfer, "__file__", None) is None:
    # ``python -m pegainfer`` run from the folder that holds the clone: Python took the clone's folder (also named
    # pegainfer, without an __init__.py) for a namespace package, and only this module came from the real one.
    sys.exit(f"error: 'pegainfer' here is the folder {list(pegainfer.__path__)[0]}, not the installed package: "
             f"run python -m pegainfer from another folder (e.g. cd into the clone)")

from pegainfer import argtypes  # noqa: E402
from pegainfer.argtypes import add_chat_template_argument, add_hub_arguments  # noqa: E402

LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", "--model", default=None,
                   help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json), or a Hub id "
                        "(Qwen/Qwen3-4B) fetched into the Hugging Face cache on first use. "
                        "Default: a built-in tiny demo Qwen3 with RANDOM weights (gibberish output), made on first use")
    add_hub_arguments(p)
    p.add_argument("--max-model-len", type=argtypes.max_model_len, default=None,
                   help="context length (prompt + output) to reserve KV cache for; default: the model's limit, "
                        "halved until it fits in GPU memory")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch the next decode step before reading this one's tokens, so host work overlaps the "
                        "GPU (default on; --no-async-scheduling waits for every step)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="capture the decode step in a CUDA graph (default on; --no-cuda-graph launches kernels "
                        "one by one, for debugging — same tokens)")
    p.add_argument("--trace-output-path", type=argtypes.output_folder, default=None,
                   help="write a Chrome trace (open in https://ui.perfetto.dev) of per-kernel GPU times and "
                        "per-request spans into this folder")
    p.add_argument("--mamba-ssm-cache-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="Qwen3.5: the Gated DeltaNet state in memory (vLLM's flag). auto: the folder's "
                        "mamba_ssm_dtype (float32); bfloat16 halves the state a decode step reads and writes, "
                        "rounding it as stored (slightly different tokens). No effect on Qwen3")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="least severe log messages shown on stderr (default info)")
    p.add_argument("--launch-policy", type=argtypes.launch_policy, default=None, metavar="FIELD=VALUE,...",
                   help="change how the kernels launch, for measuring variants (fields of LaunchPolicy, "
                        "pegainfer/kernels/policy.py; e.g. pdl=none, preload_o=false, or tuning=FILE: projection "
                        "geometries measured on this GPU by benchmarks/bench_gemm.py --sweep --tuning-out FILE); "
                        "same tokens up to rounding")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=argtypes.positive, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=argtypes.temperature, default=None,
                   help=">= 0, 0 = greedy; default: the model folder's generation_config.json, else 1.0")
    p.add_argument("--top-p", type=argtypes.top_p, default=None,
                   help="nucleus sampling mass in (0, 1], 1 = off; default: generation_config.json, else 1")
    p.add_argument("--top-k", type=argtypes.top_k, default=None,
                   help="keep the k most likely tokens, 0 = off; default: generation_config.json, else 0")
    p.add_argument("--min-p", type=argtypes.min_p, default=None,
                   help="drop tokens below min_p × the top probability, in [0, 1], 0 = off; default: "
                        "generation_config.json, else 0")
    p.add_argument("--repetition-penalty", type=argtypes.repetition_penalty, default=None,
                   help="divide the positive logits of tokens already in the prompt or output by this (multiply the "
                        "negative ones), in (0, 10], 1 = off; default: generation_config.json, else 1")
    p.add_argument("--frequency-penalty", type=argtypes.penalty, default=0.0,
                   help="subtract this from a token's logit per time it is in the output, in [-2, 2] (default 0)")
    p.add_argument("--presence-penalty", type=argtypes.penalty, default=0.0,
                   help="subtract this from the logit of every token already in the output, in [-2, 2] (default 0; "
                        "Qwen3's model card suggests up to 1.5 against endless repetition)")
    p.add_argument("--seed", type=argtypes.seed, default=None,
                   help="random seed: the same seed gives the same tokens (default: a fresh one per run)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pegainfer",
        description="pegainfer: Qwen3 / Qwen3.5 inference with readable Numba-CUDA kernels. Without a GPU every "
                    "kernel runs in Numba's CUDA simulator (slow: only the tiny demo model is practical).")
    parser.add_argument("--version", action="version", version=f"pegainfer {pegainfer.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{generate,chat,serve,run-batch,bench,bench-serve,env}")

    g = sub.add_parser("generate", help="stream a completion of one prompt to stdout",
                       description="Stream a completion of --prompt to stdout, then print one summary line "
                                   "(prompt tokens, generated tokens, TTFT ms, TPOT ms, tok/s) on stderr.")
    _add_model_args(g)
    source = g.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="Hello, my name is",
                        help="the prompt text (raw, no chat template; default: %(default)r)")
    source.add_argument("--prompt-file", type=argtypes.text_file, default=None, metavar="FILE",
                        help="read the prompt from FILE (UTF-8; - for stdin) instead of --prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message with the chat template")
    add_chat_template_argument(g, kwargs=True)
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="FILE", default=None,
                     help="hold the output to the JSON schema in FILE (structured output: it stops when complete)")
    fmt.add_argument("--regex", default=None, help="hold the output to match this regular expression")
    fmt.add_argument("--choice", default=None, help="the output is one of these comma-separated strings")
    _add_sampling_args(g)

    c = sub.add_parser("chat", help="an interactive conversation on the terminal (the chat template, multi-turn)",
                       description="Read messages from stdin, one per line, and stream each answer through the "
                                   "model's chat template with the conversation so far (the oldest turns are left "
                                   "out when the context is full). " + CHAT_HELP + ".")
    _add_model_args(c)
    c.add_argument("--system", default=None, help="a system message at the start of every conversation")
    add_chat_template_argument(c, kwargs=True)
    _add_sampling_args(c)

    rb = sub.add_parser("run-batch", help="answer a JSONL file of requests (OpenAI's Batch API format) offline",
                        description="Read requests from --input-file (one JSON object a line: custom_id, method POST, "
                                    "url /v1/chat/completions, /v1/completions or /v1/responses, body) and write "
                                    "their answers, in order, to --output-file (OpenAI's batch output format). The "
                                    "server's routes answer them in this process, all in flight at once.")
    _add_model_args(rb)
    from pegainfer.batch import add_batch_arguments
    add_batch_arguments(rb)
    add_chat_template_argument(rb)

    try:
        from pegainfer.server import add_serve_arguments
    except ImportError:  # pragma: no cover - server package missing
        add_serve_arguments = None
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                       description="Serve the model over HTTP with the OpenAI API: POST /v1/completions, "
                                   "POST /v1/chat/completions (SSE streaming with \"stream\": true), GET /v1/models, "
                                   "GET /health (503 while the model loads, 200 when ready), GET /version. The port is "
                                   "bound before the model loads; Ctrl-C stops the server.")
    s.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="the model folder or Hub id, as `vllm serve MODEL` takes it (the same as --model-path)")
    _add_model_args(s)
    if add_serve_arguments is not None:
        add_serve_arguments(s)

    b = sub.add_parser("bench", help="measure TTFT / TPOT percentiles (or --batch B decode steps) and the "
                                     "memory-bandwidth floor",
                       description="Time --runs greedy generations of --output-len tokens from a --prompt-len prompt "
                                   "of random token ids (after one warm-up run): TTFT and TPOT percentiles, tok/s, "
                                   "and the memory-bandwidth floor of a decode step (the bytes it must read / the read "
                                   "bandwidth measured in the same run). --hf times Hugging Face transformers too. "
                                   "--batch B times decode steps of B sequences at a context of --prompt-len "
                                   "instead: p50 / p90 step time, tokens/s and the floor of a B-sequence step.")
    _add_model_args(b)
    from pegainfer.bench import add_bench_arguments
    add_bench_arguments(b)

    bs = sub.add_parser("bench-serve", help="serving benchmark: many streamed requests against a server "
                                            "(throughput, TTFT / TPOT / inter-token latency percentiles)",
                        description="Send --num-prompts streamed /v1/completions requests (exactly --output-len "
                                    "tokens each, ignore_eos) to the server at --base-url, or to `python -m pegainfer "
                                    "serve` started here on a free port (stopped at the end), at a fixed "
                                    "--max-concurrency or as a Poisson --request-rate, and report requests/s, "
                                    "output and total tok/s, TTFT / TPOT / ITL mean, p50, p90, p99 and max, the "
                                    "worst gap between two tokens of one stream, and failed requests (the figures "
                                    "and JSON names of `vllm bench serve`). --hf runs the same requests through "
                                    "Hugging Face transformers' continuous batching for a side-by-side.")
    from pegainfer.bench_serve import add_bench_serve_arguments
    add_bench_serve_arguments(bs)

    e = sub.add_parser("env", help="what this machine has, for a bug report (no model is loaded)",
                       description="Print pegainfer's and Python's versions, where kernels run (the GPU or the "
                                   "simulator) and why, the GPU, its memory and which projection kernels it takes, "
                                   "whether the CUDA compiler libraries load, the packages' versions and the caches.")
    e.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    return parser


def _sampling_params(args, engine):
    from pegainfer.engine.types import SamplingParams
    d = engine.generation_defaults
    pick = lambda v, dv, fallback: v if v is not None else (dv if dv is not None else fallback)  # noqa: E731
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=pick(args.temperature, getattr(d, "temperature", None), 1.0),
        top_p=pick(args.top_p, getattr(d, "top_p", None), 1.0),
        top_k=pick(args.top_k, getattr(d, "top_k", None), 0),
        min_p=pick(args.min_p, getattr(d, "min_p", None), 0.0),
        repetition_penalty=pick(args.repetition_penalty, getattr(d, "repetition_penalty", None), 1.0),
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
        seed=args.seed, ignore_eos=args.ignore_eos)


def _load_engine(args):
    """The engine of ``--model-path`` for one stream, with the load lines on stderr."""
    from pegainfer.engine.engine import Engine, engine_policy

    print(f"[pegainfer] {pegainfer.device.describe()}", file=sys.stderr)
    t0 = time.perf_counter()
    engine = Engine.from_folder(args.model_path, args.max_model_len, max_batch=1,
                                use_cuda_graph=args.cuda_graph, async_scheduling=args.async_scheduling,
                                verbose=True, policy=engine_policy(args.launch_policy),
                                chat_template=getattr(args, "chat_template", None),
                                mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", "auto"))
    if engine.is_demo:
        print("[pegainfer] using the built-in demo model (tiny Qwen3 with RANDOM weights: the text is gibberish); "
              "pass --model-path DIR for a real model", file=sys.stderr)
    print(f"[pegainfer] loaded {engine.model_name} in {time.perf_counter() - t0:.1f} s "
          f"(max model len {engine.max_model_len})", file=sys.stderr)
    return engine


DIM, RESET = "\x1b[2m", "\x1b[0m"


class _Writer:
    """Writes a chat answer to stdout as it comes: on a terminal, given how the output starts (``reasoning_start``
    of the prompt), the model's thinking dimmed and its tags dropped (``text/reasoning.py``); else the text as is."""

    def __init__(self, thinking: Optional[str]):
        from pegainfer.text.reasoning import ReasoningParser
        self.parser = ReasoningParser(thinking) if thinking is not None and sys.stdout.isatty() else None

    def _out(self, reasoning: str, content: str) -> None:
        if reasoning:
            sys.stdout.write(DIM + reasoning + RESET)
        sys.stdout.write(content)
        sys.stdout.flush()

    def write(self, text: str) -> None:
        if self.parser is None:
            self._out("", text)
        else:
            self._out(*self.parser.push(text))

    def close(self) -> None:
        if self.parser is not None:
            self._out(*self.parser.flush())


def _stream(engine, ids, params, request_id: str = "cli", thinking: Optional[str] = None) -> str:
    """Generate from ``ids``, writing the text to stdout as it comes (``thinking``: see ``_Writer``), then the
    summary line on stderr; returns the text."""
    from pegainfer.engine.progress import PrefillProgress

    # in the simulator a prefill takes seconds: show it kernel by kernel on a terminal until the first token
    progress = PrefillProgress(len(ids), engine.prefill_launches) if pegainfer.SIMULATOR else contextlib.nullcontext()
    text, writer = [], _Writer(thinking)
    with progress as prefill:
        t_start = time.perf_counter()
        engine.add_request(request_id, ids, params)
        t_first = None
        n_out = 0
        reason = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and t_first is None:
                    t_first = time.perf_counter()
                    if prefill is not None:
                        prefill.close()
                n_out = out.completion_tokens or n_out
                if out.delta_text:
                    text.append(out.delta_text)
                    writer.write(out.delta_text)
                if out.finished:
                    reason = out.finish_reason
        t_end = time.perf_counter()
    writer.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    ttft = ((t_first or t_end) - t_start) * 1e3
    tpot = (t_end - t_first) * 1e3 / (n_out - 1) if n_out > 1 and t_first else float("nan")
    tps = (n_out - 1) / (t_end - t_first) if n_out > 1 and t_first else float("nan")
    print(f"[pegainfer] prompt tokens {len(ids)}, generated tokens {n_out} ({reason}), TTFT {ttft:.1f} ms, "
          f"TPOT {tpot:.2f} ms, {tps:.1f} tok/s", file=sys.stderr)
    return "".join(text)


def cmd_generate(args) -> int:
    from pegainfer.errors import PegainferError
    from pegainfer.trace import maybe_trace

    engine = _load_engine(args)
    params = _sampling_params(args, engine)
    prompt = args.prompt if args.prompt_file is None else args.prompt_file
    if args.chat:
        if engine.chat_template is None:
            raise PegainferError("--chat: this model folder has no chat template")
        prompt = engine.chat_template.render([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             **args.chat_template_kwargs)
    params.grammar = _output_grammar(args, engine)
    thinking = _thinking(engine, prompt) if args.chat else None
    if params.grammar is not None and thinking is not None:    # the grammar applies after the thinking
        from pegainfer.text.structured import grammar_after_think
        params.grammar_after_think = grammar_after_think(thinking)
    ids = engine.tokenizer.encode(prompt)
    if not ids:
        raise PegainferError("the prompt is empty after tokenization: pass some text with --prompt")
    with maybe_trace(args.trace_output_path, engine):
        _stream(engine, ids, params, thinking=thinking)
    return 0


def _thinking(engine, prompt_text: str) -> Optional[str]:
    """How a chat answer to ``prompt_text`` starts (``reasoning_start``) when the template thinks, else None."""
    from pegainfer.text.reasoning import reasoning_start
    if engine.chat_template is None or not engine.chat_template.writes_thinking:
        return None
    return reasoning_start(prompt_text)


def _output_grammar(args, engine):
    """The grammar of ``--json-schema`` / ``--regex`` / ``--choice`` (None without), with a one-line error for one
    the grammar engine cannot follow."""
    from pegainfer.errors import PegainferError
    compiler = engine.grammar_compiler
    if args.json_schema is not None:
        from pathlib import Path

        from pegainfer.jsonfile import read_json
        schema = read_json(Path(args.json_schema).expanduser())      # a one-line error naming the file
        if not isinstance(schema, dict):
            raise PegainferError(f"--json-schema {args.json_schema}: the file must hold a JSON schema object")
        flag, make = "--json-schema", lambda: compiler.json_schema(schema)
    elif args.regex is not None:
        flag, make = "--regex", lambda: compiler.regex(args.regex)
    elif args.choice is not None:
        choices = [c for c in args.choice.split(",") if c]
        if not choices:
            raise PegainferError("--choice needs at least one non-empty string")
        flag, make = "--choice", lambda: compiler.choice(choices)
    else:
        return None
    return compiler.followable(flag, make)


CHAT_HELP = "type a message and Enter; /reset starts a new conversation, /exit (or Ctrl-D) leaves"


def chat_prompt(engine, messages: list[dict], max_tokens: int, template_kwargs: Optional[dict] = None
                ) -> tuple[list[int], int]:
    """The token ids of the conversation (the chat template, a generation prompt after it) with room for
    ``max_tokens`` more in the context: the oldest turns (a question and its answer, after a system message) are
    left out until it fits.  Returns (ids, how many messages were left out); ids are empty when even the last
    message does not fit."""
    system = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    while True:
        shown = messages[:system] + messages[system + dropped:]
        ids = engine.tokenizer.encode(engine.chat_template.render(shown, add_generation_prompt=True,
                                                                  **(template_kwargs or {})))
        if len(ids) + max_tokens <= engine.max_model_len or system + dropped >= len(messages) - 1:
            break
        dropped = min(dropped + 2, len(messages) - 1 - system)
    if len(ids) + 1 > engine.max_model_len:
        return [], dropped
    return ids, dropped


def cmd_chat(args) -> int:
    """A conversation on the terminal: each line read is a user turn; the answer streams to stdout; the history
    (the answers as the model wrote them) goes into the next turn's prompt through the chat template."""
    import dataclasses

    from pegainfer.errors import PegainferError

    engine = _load_engine(args)
    if engine.chat_template is None:
        raise PegainferError("this model folder has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja): use `generate` instead")
    params = _sampling_params(args, engine)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print(f"[pegainfer] {CHAT_HELP}", file=sys.stderr)
    turn = 0
    while True:
        if sys.stdin.isatty():
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages = list(system)
            print("[pegainfer] new conversation", file=sys.stderr)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        ids, dropped = chat_prompt(engine, messages, params.max_tokens, args.chat_template_kwargs)
        if not ids:
            messages.pop()
            print(f"[pegainfer] that message does not fit the context ({engine.max_model_len} tokens, "
                  f"--max-model-len): send a shorter one", file=sys.stderr)
            continue
        if dropped:
            print(f"[pegainfer] the {dropped} oldest messages no longer fit the context and are left out",
                  file=sys.stderr)
        room = engine.max_model_len - len(ids)
        turn_params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        answer = _stream(engine, ids, turn_params, request_id=f"chat-{turn}",
                         thinking=_thinking(engine, engine.tokenizer.decode(ids[-16:])))
        messages.append({"role": "assistant", "content": answer})
        turn += 1


def check_model_folder(args) -> None:
    """Read ``--model-path``'s config.json before the engine is imported (importing it imports numba and builds the
    kernels: seconds, ten in the simulator), so a missing folder or an unsupported model is a one-line error at
    once.  A Hub id is fetched first (``hub.py``) and ``args.model_path`` becomes its local folder.  The engine
    reads the folder again, in full, when it loads."""
    if getattr(args, "model_path", None) is not None:
        from pegainfer.config import load_model_config
        from pegainfer.hub import local_folder
        folder = local_folder(args.model_path, getattr(args, "revision", None), getattr(args, "download_dir", None))
        load_model_config(folder)
        args.model_path = str(folder)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)   # numba logs every device free at INFO
    from pegainfer.errors import PegainferError
    if getattr(args, "model", None) is not None:          # serve MODEL
        if args.model_path is not None and args.model_path != args.model:
            parser.error(f"serve got two models: {args.model!r} and --model-path {args.model_path!r}: give one")
        args.model_path = args.model
    try:
        check_model_folder(args)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "chat":
            return cmd_chat(args)
        if args.command == "run-batch":
            from pegainfer.batch import run_batch
            return run_batch(args)
        if args.command == "serve":
            from pegainfer.server import run_server
            return run_server(args) or 0
        if args.command == "bench":
            from pegainfer.bench import run_bench
            return run_bench(args) or 0
        if args.command == "bench-serve":
            from pegainfer.bench_serve import run_bench_serve
            return run_bench_serve(args) or 0
        if args.command == "env":
            from pegainfer.env_report import run_env
            return run_env(args)
    except PegainferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
