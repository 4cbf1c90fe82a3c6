"""The command line as a user runs it: `python -m pegainfer ...` in a subprocess, on the built-in demo model
(in the simulator on CI)."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest


def run_cli(*args, timeout=900, cwd=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "pegainfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def test_help_explains_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for word in ("generate", "serve", "bench", "bench-serve", "env"):
        assert word in r.stdout
    r = run_cli("generate", "--help")
    assert r.returncode == 0
    for flag in ("--model-path", "--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p",
                 "--seed", "--ignore-eos", "--max-model-len", "--cuda-graph", "--log-level", "--repetition-penalty",
                 "--frequency-penalty", "--presence-penalty"):
        assert flag in r.stdout
    assert "default: 'Hello, my name is'" in " ".join(r.stdout.split())    # the default prompt is shown
    r = run_cli("serve", "--help")
    assert r.returncode == 0
    assert "--scheduling-policy" in r.stdout
    serve_help = " ".join(r.stdout.split())
    assert "Serve the model over HTTP with the OpenAI API" in serve_help          # a description line
    for flag in ("--port", "--max-waiting", "--max-batch", "--max-body-bytes", "--served-model-name", "--api-key",
                 "--access-log", "--log-level"):
        assert flag in serve_help
    assert "not yet admitted" in serve_help    # what --max-waiting counts
    r = run_cli("bench", "--help")
    bench_help = " ".join(r.stdout.split())
    assert r.returncode == 0 and "Time --runs greedy generations" in bench_help
    assert "--batch" in bench_help and "decode steps of this many sequences" in bench_help
    r = run_cli("bench-serve", "--help")
    serve_help = " ".join(r.stdout.split())
    assert r.returncode == 0 and "streamed /v1/completions requests" in serve_help
    for flag in ("--base-url", "--model-path", "--max-concurrency", "--request-rate", "--num-prompts",
                 "--input-len", "--output-len", "--range-ratio", "--dataset-name", "--prompt-format", "--hf",
                 "--json", "--serve-args"):
        assert flag in serve_help, flag


def greedy_text_of_transformers(folder, prompt, n):
    """The text of transformers' ``n`` greedy tokens after ``prompt`` (bf16, CPU): the oracle of the demo's
    continuation (its greedy margins are wide enough for both engines' rounding)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from pegainfer.text.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folder)
    ids = tok.encode(prompt)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return len(ids), tok.decode(out[0, len(ids):].tolist())


SUMMARY = re.compile(r"\[pegainfer\] prompt tokens (\d+), generated tokens (\d+) \((\w+)\), TTFT ([\d.]+) ms, "
                     r"TPOT ([\d.]+) ms, ([\d.]+) tok/s")


def test_generate_on_demo_model_streams_and_summarises():
    """``generate`` on the demo model: the device line first, the demo labelled as random, stdout the model's greedy
    continuation (transformers' on the same weights) and a newline, and one summary line whose counts are the
    prompt's tokens and the 3 generated (stopped by length) and whose tok/s is 1 / TPOT."""
    from pegainfer.demo import ensure_demo_model
    from pegainfer.device import describe
    r = run_cli("generate", "--prompt", "Hello", "--max-tokens", "3", "--temperature", "0", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == f"[pegainfer] {describe()}"
    assert any("[pegainfer] using the built-in demo model" in line and "RANDOM" in line for line in lines)
    n_prompt, text = greedy_text_of_transformers(ensure_demo_model(), "Hello", 3)
    assert r.stdout == text + "\n" and text.strip() and "\ufffd" not in text, (r.stdout, text)
    summary = [m for m in map(SUMMARY.fullmatch, lines) if m]
    assert len(summary) == 1, r.stderr
    prompt_tokens, generated, reason, ttft, tpot, tok_s = summary[0].groups()
    assert (int(prompt_tokens), int(generated), reason) == (n_prompt, 3, "length")
    ttft, tpot, tok_s = float(ttft), float(tpot), float(tok_s)
    assert ttft > 0 and tpot > 0.005
    assert 1e3 / (tpot + 0.005) - 0.05 <= tok_s <= 1e3 / (tpot - 0.005) + 0.05     # within the printed rounding
    assert "\r" not in r.stderr                             # no progress line when stderr is not a terminal


def test_seeded_sampling_is_reproducible():
    """Sampling with ``--seed 11`` twice gives the same text; ``--seed 12`` another (the seed is used, not a fixed
    one)."""
    args = ("generate", "--prompt", "The", "--max-tokens", "3", "--temperature", "1.0", "--top-k", "20",
            "--ignore-eos")
    a, b, c = run_cli(*args, "--seed", "11"), run_cli(*args, "--seed", "11"), run_cli(*args, "--seed", "12")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    assert a.stdout.strip() and a.stdout == b.stdout
    assert c.stdout.strip() and c.stdout != a.stdout, (a.stdout, c.stdout)


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_bad_model_folder_is_one_line_without_traceback(command):
    r = run_cli(command, "--model-path", "/nonexistent/model", "--port", "0") if command == "serve" else \
        run_cli(command, "--model-path", "/nonexistent/model")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == ["error: model folder /nonexistent/model does not exist"]


BAD_VALUES = [
    (("generate", "--temperature", "-1"), "must be >= 0"),
    (("generate", "--temperature", "nan"), "finite"),
    (("generate", "--top-p", "2"), "(0, 1]"),
    (("generate", "--top-p", "0"), "(0, 1]"),
    (("generate", "--min-p", "5"), "[0, 1]"),
    (("generate", "--presence-penalty", "3"), "[-2, 2]"),
    (("generate", "--frequency-penalty", "-2.5"), "[-2, 2]"),
    (("generate", "--repetition-penalty", "0"), "(0, 10]"),
    (("generate", "--top-k", "-1"), "at least 0"),
    (("generate", "--max-tokens", "0"), "at least 1"),
    (("generate", "--max-model-len", "1"), "at least 2"),
    (("generate", "--seed", "1.5"), "whole number"),
    (("generate", "--log-level", "loud"), "invalid choice"),
    (("serve", "--port", "99999"), "between 0 and 65535"),
    (("serve", "--max-batch", "0"), "at least 1"),
    (("serve", "--max-waiting", "-1"), "at least 0"),
    (("serve", "--max-body-bytes", "0"), "at least 1"),
    (("bench", "--runs", "0"), "at least 1"),
    (("bench", "--prompt-len", "0"), "at least 1"),
    (("bench", "--output-len", "-3"), "at least 1"),
    (("bench", "--json", "/nonexistent/folder/out.json"), "does not exist"),
    (("bench", "--json", "/"), "is a folder"),
    (("generate", "--trace-output-path", "/dev/null"), "is a file"),
    (("generate", "--trace-output-path", "/dev/null/trace"), "under the file /dev/null"),
    (("generate", "--launch-policy", "nope=1"), "LaunchPolicy has no field 'nope'"),
    (("serve", "--launch-policy", "pdl=gemv+no way"), "is not a launch name"),
    (("serve", "--prefix-state-snapshots", "0"), "at least 1"),
    (("bench", "--launch-policy", "preload_o=maybe"), "preload_o: 'maybe' is not true or false"),
    (("bench", "--launch-policy", ","), "expected FIELD=VALUE"),
    (("serve", "--chat-template", "/no/such/template.jinja"), "is no file and no Jinja template"),
    (("chat", "--chat-template", "{{ unclosed"), "the chat template does not compile (line 1"),
    (("serve", "--allowed-origins", "[1, 2]"), "JSON list of strings"),
    (("serve", "--allowed-origins", " , "), "at least one value"),
    (("generate", "--prompt-file", "/nonexistent/prompt.txt"), "no such file"),
    (("chat", "--chat-template-kwargs", "[1]"), "expected a JSON object"),
    (("generate", "--chat-template-kwargs", "{"), "not JSON"),
    (("generate", "--prompt-file", "/"), "is a folder"),
]


@pytest.mark.parametrize("args, says", BAD_VALUES)
def test_bad_values_are_refused_while_parsing(args, says, capsys):
    """Every value is checked by the parser itself: argparse's one ``error: argument --flag: ...`` line, exit
    status 2 (in-process: a subprocess per value would cost seconds each)."""
    from pegainfer.__main__ import build_parser
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(list(args))
    assert stop.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    flag = re.search(r"error: argument ([-\w/]+): ", err[0]) if len(err) == 1 else None   # (an alias: --a/--b)
    assert flag and args[1] in flag.group(1).split("/") and says in err[0], err


@pytest.mark.parametrize("args", [("generate", "--temperature", "-1"), ("serve", "--port", "99999"),
                                  ("bench", "--runs", "0")], ids=["generate", "serve", "bench"])
def test_a_bad_value_stops_the_command_before_anything_loads(args):
    r = run_cli(*args, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    err = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(err) == 1 and err[0].startswith(f"python -m pegainfer {args[0]}: error: argument {args[1]}: ")
    assert "[pegainfer]" not in r.stderr and not r.stdout    # the device line and the model load come later


def engine_option_of_each_command(monkeypatch, option, commands, cases):
    """For each command line ``argv + extra`` (``commands``: (argv, the function that builds its engine); ``cases``:
    (extra, want)), the ``option`` keyword its ``Engine.from_folder`` gets must be ``want`` (the build stops there)."""
    from pegainfer.__main__ import build_parser
    from pegainfer.engine.engine import Engine

    seen = []

    class Stop(Exception):
        pass

    def recording(cls, *a, **kw):
        seen.append(kw.get(option))
        raise Stop
    monkeypatch.setattr(Engine, "from_folder", classmethod(recording))
    for argv, run in commands:
        for extra, want in cases:
            with pytest.raises(Stop):
                run(build_parser().parse_args(argv + extra))
            assert seen.pop() == want, (argv, extra)


def batch_files(tmp_path) -> list[str]:
    return ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]


def test_launch_policy_reaches_every_commands_engine(monkeypatch):
    """``--launch-policy``: generate, serve and bench build their engine with the default policy changed by those
    fields (and without it, with the default itself)."""
    from pegainfer.__main__ import cmd_generate
    from pegainfer.bench import run_bench
    from pegainfer.kernels.policy import LaunchPolicy
    from pegainfer.server import engine_from_args

    engine_option_of_each_command(
        monkeypatch, "policy",
        [(["generate"], cmd_generate), (["serve"], engine_from_args), (["bench"], run_bench),
         (["bench", "--batch", "2"], run_bench)],
        [([], LaunchPolicy()), (["--launch-policy", "pdl=none,head_argmax=off"],
                                LaunchPolicy(pdl=frozenset(), head_argmax=False))])


def test_chat_template_flag_reaches_every_commands_engine(monkeypatch, tmp_path):
    """``--chat-template``: generate, chat, serve and run-batch build their engine with the template's text, read
    from a Jinja file, from a JSON file's ``chat_template`` or given inline; without the flag, None (the folder's)."""
    import json

    from pegainfer.__main__ import _load_engine
    from pegainfer.server import engine_from_args

    text = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(text)
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": text}))
    engine_option_of_each_command(
        monkeypatch, "chat_template",
        [(["generate", "--chat"], _load_engine), (["chat"], _load_engine), (["serve"], engine_from_args),
         (["run-batch"] + batch_files(tmp_path), engine_from_args)],
        [([], None), (["--chat-template", str(tmp_path / "t.jinja")], text),
         (["--chat-template", str(tmp_path / "t.json")], text), (["--chat-template", text], text)])


def test_mamba_ssm_cache_dtype_reaches_every_commands_engine(monkeypatch, tmp_path):
    """``--mamba-ssm-cache-dtype``: generate, chat, serve, run-batch and bench (both modes) build their engine with
    it; ``auto`` without the flag; a value other than auto / float32 / bfloat16 is refused while parsing."""
    from pegainfer.__main__ import _load_engine, build_parser
    from pegainfer.bench import run_bench
    from pegainfer.server import engine_from_args

    engine_option_of_each_command(
        monkeypatch, "mamba_ssm_cache_dtype",
        [(["generate"], _load_engine), (["chat"], _load_engine), (["serve"], engine_from_args),
         (["run-batch"] + batch_files(tmp_path), engine_from_args), (["bench"], run_bench),
         (["bench", "--batch", "2"], run_bench)],
        [([], "auto"), (["--mamba-ssm-cache-dtype", "bfloat16"], "bfloat16")])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--mamba-ssm-cache-dtype", "float16"])


def test_env_reports_where_kernels_run_and_the_versions():
    """``env`` (no model loaded): where kernels run and why, pegainfer's and the packages' versions, as lines or as
    one JSON object."""
    import importlib.metadata

    import pegainfer
    r = run_cli("env")
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^pegainfer +{re.escape(pegainfer.__version__)} \(", r.stdout, re.M), r.stdout
    assert re.search(r"^kernels run on +(Numba's CUDA simulator|the GPU)$", r.stdout, re.M), r.stdout
    r = run_cli("env", "--json")
    got = json.loads(r.stdout)
    assert got["numba-cuda"] == importlib.metadata.version("numba-cuda")
    assert got["kernels run on"] == ("Numba's CUDA simulator" if pegainfer.SIMULATOR else "the GPU")
    assert got["because"] and got["hugging face cache"]
    if not pegainfer.SIMULATOR:
        assert got["gpu"] and "compute capability" in got and "could not" not in got["gpu"]


def test_chat_template_kwargs_reach_the_template():
    """``generate --chat --chat-template-kwargs '{"enable_thinking": false}'``: the prompt is the template rendered
    with the variable (the summary counts its tokens: the closed think block Qwen3's template then writes)."""
    from pegainfer.demo import ensure_demo_model
    from pegainfer.text.chat import ChatTemplate
    from pegainfer.text.tokenizer import Tokenizer
    folder = ensure_demo_model()
    messages = [{"role": "user", "content": "Hi"}]
    template = ChatTemplate.from_folder(folder)
    off = template.render(messages, add_generation_prompt=True, enable_thinking=False)
    assert off != template.render(messages, add_generation_prompt=True)       # the variable matters to it
    r = run_cli("generate", "--chat", "--prompt", "Hi", "--max-tokens", "2", "--chat-template-kwargs",
                '{"enable_thinking": false}')
    assert r.returncode == 0, r.stderr
    summary = [m for m in map(SUMMARY.fullmatch, r.stderr.splitlines()) if m]
    assert int(summary[0].group(1)) == len(Tokenizer.from_folder(folder).encode(off))


def test_a_terminal_sees_the_thinking_dimmed(monkeypatch):
    """On a terminal a chat answer's thinking is dimmed and its tags dropped; piped, the text is written as is."""
    import io

    from pegainfer.__main__ import DIM, RESET, _Writer

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    for stdout, want in ((Terminal(), DIM + "Let me see." + RESET + "Blue."),
                         (io.StringIO(), "<think>\nLet me see.\n</think>\n\nBlue.")):
        monkeypatch.setattr(sys, "stdout", stdout)
        writer = _Writer("detect")
        for piece in ("<thi", "nk>\nLet me", " see.\n</th", "ink>\n\nBlue."):
            writer.write(piece)
        writer.close()
        assert stdout.getvalue().replace(RESET + DIM, "") == want, stdout.getvalue()    # (dimmed piece by piece)
    monkeypatch.setattr(sys, "stdout", Terminal())
    writer = _Writer(None)                      # a template that does not think: as is, on a terminal too
    writer.write("<think>x</think>y")
    assert sys.stdout.getvalue() == "<think>x</think>y"


def test_generate_reads_the_prompt_from_a_file_or_stdin(tmp_path):
    """``--prompt-file FILE`` and ``--prompt-file -`` (stdin) give the prompt's tokens (the summary counts them) and
    the same greedy text."""
    from pegainfer.demo import ensure_demo_model
    from pegainfer.text.tokenizer import Tokenizer
    text = "The capital of France is\nParis, and"
    (tmp_path / "p.txt").write_text(text, encoding="utf-8")
    args = ("generate", "--max-tokens", "2", "--temperature", "0", "--ignore-eos")
    from_file = run_cli(*args, "--prompt-file", str(tmp_path / "p.txt"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    from_stdin = subprocess.run([sys.executable, "-m", "pegainfer", *args, "--prompt-file", "-"], input=text,
                                capture_output=True, text=True, timeout=900, env=env)
    assert from_file.returncode == from_stdin.returncode == 0, from_file.stderr + from_stdin.stderr
    assert from_file.stdout == from_stdin.stdout and from_file.stdout.strip()
    n = len(Tokenizer.from_folder(ensure_demo_model()).encode(text))
    for r in (from_file, from_stdin):
        summary = [m for m in map(SUMMARY.fullmatch, r.stderr.splitlines()) if m]
        assert len(summary) == 1 and int(summary[0].group(1)) == n, r.stderr


def test_generate_renders_the_prompt_with_the_given_chat_template(tmp_path):
    """``generate --chat --chat-template FILE`` on the demo model: the prompt is the given template's rendering
    (its token count), not the folder's; a template that does not compile stops it while parsing, in one line."""
    from pegainfer.demo import ensure_demo_model
    from pegainfer.text.tokenizer import Tokenizer

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m.content }}>> and more words{% endfor %}")
    r = run_cli("generate", "--chat", "--chat-template", str(template), "--prompt", "hello", "--max-tokens", "1",
                "--temperature", "0", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    want = len(Tokenizer.from_folder(ensure_demo_model()).encode("<<hello>> and more words"))
    assert f"prompt tokens {want}," in r.stderr, r.stderr[-2000:]
    template.write_text("{% for m in messages %}")
    r = run_cli("generate", "--chat", "--chat-template", str(template), "--max-tokens", "1", timeout=900)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "[pegainfer]" not in r.stderr, r.stderr[-2000:]
    assert "error: argument --chat-template: the chat template does not compile (line 1" in r.stderr, r.stderr


def test_serve_passes_the_prefix_cache_flags_to_the_engine(monkeypatch):
    """``serve --enable-prefix-caching --prefix-state-snapshots N`` reaches ``Engine.from_folder``; by default
    neither is forced (the engine picks per model)."""
    from pegainfer.__main__ import build_parser
    from pegainfer.engine.engine import Engine
    from pegainfer.server import engine_from_args

    seen = []
    monkeypatch.setattr(Engine, "from_folder", classmethod(lambda cls, *a, **kw: seen.append(kw)))
    engine_from_args(build_parser().parse_args(["serve", "--enable-prefix-caching", "--prefix-state-snapshots",
                                                "40"]))
    engine_from_args(build_parser().parse_args(["serve"]))
    assert [(kw["enable_prefix_caching"], kw["prefix_state_snapshots"]) for kw in seen] == [(True, 40), (None, None)]


def test_serve_takes_the_model_as_vllm_serve_does(monkeypatch):
    """``serve MODEL`` is ``serve --model-path MODEL`` (the folder checked, then run_server given it); two
    different models are refused while the flags are read."""
    import pegainfer.server
    from pegainfer.__main__ import main
    from pegainfer.demo import ensure_demo_model

    seen = []
    monkeypatch.setattr(pegainfer.server, "run_server", lambda args: seen.append(args.model_path))
    folder = str(ensure_demo_model())
    assert main(["serve", folder, "--port", "0"]) == 0 and seen == [folder]
    assert main(["serve", folder, "--model-path", folder]) == 0 and seen == [folder, folder]
    r = run_cli("serve", "/nonexistent/model", "--port", "0")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: model folder /nonexistent/model does "
                                                                   "not exist"], r.stderr
    r = run_cli("serve", "a", "--model-path", "b")
    assert r.returncode == 2 and "serve got two models: 'a' and --model-path 'b': give one" in r.stderr
    from pegainfer.__main__ import build_parser      # vLLM's flag names as aliases
    args = build_parser().parse_args(["serve", "--model", "m", "--max-num-seqs", "8"])
    assert (args.model_path, args.max_batch) == ("m", 8)


def test_serve_on_a_port_in_use_fails_at_once():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = run_cli("serve", "--port", str(port), timeout=120)
        elapsed = time.monotonic() - t0
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use): is another server running there? "
        f"Stop it, or choose another port with --port"]
    assert "listening" not in r.stderr and elapsed < 60   # before the model loads (the demo takes minutes here)


# What setuptools' editable install puts on sys.meta_path, after the path finder: ``pegainfer`` and its
# submodules come from ROOT.  Run from a folder that holds a folder named pegainfer (a clone), the path finder takes
# that folder for a namespace package first, and only ``pegainfer.__main__`` comes from ROOT.
SHADOWED_RUN = """
import runpy, sys
from importlib.machinery import PathFinder
ROOT = sys.argv[1]
class EditableFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "pegainfer":
            return PathFinder.find_spec(fullname, [ROOT])
        if fullname.rpartition(".")[0] == "pegainfer":
            return PathFinder.find_spec(fullname, [ROOT + "/pegainfer"])
        return None
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()] + [EditableFinder]
sys.path = [p for p in sys.path if p not in ("", ".", ROOT)]
sys.path.insert(0, "")                 # python -m puts the working folder first
sys.argv = ["pegainfer", "--help"]
runpy.run_module("pegainfer", run_name="__main__", alter_sys=True)
"""


def test_run_from_the_clones_parent_folder_says_so(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    clone = tmp_path / "pegainfer"             # a clone: pyproject.toml, README.md, pegainfer/, tests/ ...
    (clone / "pegainfer").mkdir(parents=True)
    (clone / "README.md").write_text("# pegainfer\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", SHADOWED_RUN, root], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: 'pegainfer' here is the folder {clone}, not the installed package: run python -m pegainfer from "
        f"another folder (e.g. cd into the clone)"]


def test_unsupported_architecture_is_named(tmp_path):
    """A folder of another architecture: one error line naming its architecture and model type, and the ones
    pegainfer runs, exit status 2."""
    from pegainfer.config import SUPPORTED
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    r = run_cli("generate", "--model-path", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: unsupported model (LlamaForCausalLM, model_type 'llama' in {tmp_path / 'config.json'}): pegainfer "
        f"runs {SUPPORTED}"]
    assert "Qwen3ForCausalLM" in SUPPORTED


def test_bench_runs_end_to_end(tmp_path):
    """``bench`` on the demo model: one timed run after the warm-up (so each percentile is its one TTFT and its
    one gap between the 2 tokens), tok/s 1 / TPOT p50, the table printing the JSON's figures, and the floor."""
    out = tmp_path / "bench.json"
    r = run_cli("bench", "--prompt-len", "4", "--output-len", "2", "--runs", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert (res["prompt_len"], res["output_len"], res["runs"], res["model"]) == (4, 2, 1, "demo-qwen3")
    for key in ("ttft_ms", "tpot_ms"):
        assert res[key]["p50"] > 0 and res[key]["p50"] == res[key]["p90"] == res[key]["p99"], (key, res[key])
        assert f"{key:<28}" + "".join(f"{res[key][p]:>12.3f}" for p in ("p50", "p90", "p99")) in r.stdout
    assert res["tok_s"] == pytest.approx(1e3 / res["tpot_ms"]["p50"])
    assert f"{'tok/s (1/TPOT p50)':<28}{res['tok_s']:>12.1f}" in r.stdout
    floor = res["floor_bytes"]   # the demo Qwen3: tied embedding (read in full as the LM head), no recurrent state
    assert floor["weights_read"] == res["weight_bytes"] and floor["recurrent_state_rw"] == 0
    assert floor["kv_context_tokens"] == 4 + 2 / 2 and floor["kv_read"] > 0
    assert floor["total"] == floor["weights_read"] + floor["kv_read"]
    assert "recurrent state r+w" in r.stdout


def test_bench_batch_times_decode_steps_of_the_whole_batch(tmp_path):
    """``bench --batch 2 --penalties`` on the demo model: every timed step decodes both (penalized) sequences, at the
    context asked for, and the floor counts the KV of both."""
    out = tmp_path / "batch.json"
    r = run_cli("bench", "--batch", "2", "--prompt-len", "4", "--output-len", "2", "--runs", "1", "--json", str(out),
                "--penalties")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["batch"] == 2 and res["output_len"] == 2 and res["short_steps"] == 0 and res["penalties"] is True
    assert 0 < res["step_ms"]["p50"] <= res["step_ms"]["p90"] <= res["step_ms"]["p99"]
    assert res["tok_s"] == pytest.approx(2e3 / res["step_ms"]["p50"])
    # the prompt is 4 - 1 - 2 tokens; the timed steps read 4 and 5 tokens of context per sequence
    assert 4.5 <= res["mean_context_tokens"] <= 5.5     # (+1 if a scheduler decodes one while the other prefills)
    floor = res["floor_bytes"]
    assert floor["batch"] == 2 and floor["kv_context_tokens"] == res["mean_context_tokens"]
    assert floor["weights_read"] == res["weight_bytes"] and floor["recurrent_state_rw"] == 0
    assert floor["total"] == floor["weights_read"] + floor["kv_read"]
    assert "decode step ms" in r.stdout and "KV read (2 x ctx " in r.stdout
    if not res["simulator"]:
        assert 0 < res["floor_ratio"] and res["floor_step_ms"] > 0


def test_bench_floor_counts_recurrent_state_and_untied_embedding_rows():
    """decode_floor_bytes on a stand-in model: an untied embedding is read one row per token (the LM head in full),
    and a hybrid model's state buffers ``[layers, slots, ...]`` are read and written once per step for one slot."""
    from types import SimpleNamespace

    import numpy as np

    from pegainfer.bench import decode_floor_bytes

    V, H, slots = 100, 8, 2
    model = SimpleNamespace(V=V, H=H, embed=object(), lm_head=object(), num_slots=slots,
                            conv_state=np.zeros((3, slots, 24, 3), np.uint16),
                            ssm_state=np.zeros((3, slots, 2, 4, 4), np.float32),
                            weight_bytes=lambda: 2 * (2 * V * H + 500), kv_bytes_per_token=lambda: 64)
    floor = decode_floor_bytes(model, context_tokens=10.5)
    assert floor["weights_read"] == 2 * (V * H + H + 500)
    assert floor["recurrent_state_rw"] == 2 * 3 * (24 * 3 * 2 + 2 * 4 * 4 * 4)
    assert floor["kv_read"] == 672 and floor["kv_context_tokens"] == 10.5
    assert floor["total"] == floor["weights_read"] + floor["recurrent_state_rw"] + floor["kv_read"]
    batched = decode_floor_bytes(model, context_tokens=10.5, batch=3)    # 3 sequences: 3 rows, 3 states, 3 KVs
    assert batched["weights_read"] == 2 * (V * H + 3 * H + 500)
    assert batched["recurrent_state_rw"] == 3 * floor["recurrent_state_rw"]
    assert batched["kv_read"] == 3 * 672 and batched["batch"] == 3


def test_generate_penalty_flags_reach_the_sampling_params():
    """Catches a penalty flag parsed but not passed on, or the folder's repetition_penalty ignored: the defaults
    come from generation_config.json (here 1.05), explicit flags win."""
    from types import SimpleNamespace

    from pegainfer.__main__ import _sampling_params, build_parser
    engine = SimpleNamespace(generation_defaults=SimpleNamespace(temperature=0.6, repetition_penalty=1.05))
    p = _sampling_params(build_parser().parse_args(["generate"]), engine)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.temperature) == (1.05, 0.0, 0.0, 0.6)
    args = build_parser().parse_args(["generate", "--repetition-penalty", "1.3", "--frequency-penalty", "0.5",
                                      "--presence-penalty", "-1"])
    p = _sampling_params(args, engine)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.3, 0.5, -1.0) and p.penalized


def test_chat_keeps_the_conversation_and_resets_it():
    """Catches a turn rendered without the history (or the answer left out of it), /reset not clearing it, or the
    loop not ending at the end of input: two turns, /reset, one more; each turn's prompt is the chat template of
    the system message and the conversation so far, with the previous answer as the model wrote it."""
    from pegainfer.demo import ensure_demo_model
    from pegainfer.text.chat import ChatTemplate
    from pegainfer.text.tokenizer import Tokenizer

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "pegainfer", "chat", "--max-tokens", "2", "--temperature", "0",
                        "--system", "Be brief."], input="hello there\nand again\n/reset\nthird\n",
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    answers = r.stdout.split("\n")[:3]
    folder = ensure_demo_model()
    tok, template = Tokenizer.from_folder(folder), ChatTemplate.from_folder(folder)
    system = {"role": "system", "content": "Be brief."}
    conversations = [[system, {"role": "user", "content": "hello there"}],
                     [system, {"role": "user", "content": "hello there"}, {"role": "assistant", "content": answers[0]},
                      {"role": "user", "content": "and again"}],
                     [system, {"role": "user", "content": "third"}]]
    want = [len(tok.encode(template.render(c, add_generation_prompt=True))) for c in conversations]
    got = [int(n) for n in re.findall(r"prompt tokens (\d+), generated tokens 2 \(length\)", r.stderr)]
    assert got == want and "new conversation" in r.stderr
    assert r.stdout.count("\n") == 3


def test_chat_prompt_leaves_out_the_oldest_turns_that_do_not_fit():
    """The system message stays; the oldest turns go, a question with its answer, until the prompt and the answer's
    room fit the context; a last message that cannot fit alone gives no ids."""
    from types import SimpleNamespace

    from pegainfer.__main__ import chat_prompt
    from pegainfer.demo import ensure_demo_model
    from pegainfer.text.chat import ChatTemplate
    from pegainfer.text.tokenizer import Tokenizer

    folder = ensure_demo_model()
    tok, template = Tokenizer.from_folder(folder), ChatTemplate.from_folder(folder)
    turns = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        turns += [{"role": "user", "content": f"question {i} " * 4}, {"role": "assistant", "content": f"answer {i}"}]
    turns.append({"role": "user", "content": "last"})
    full = len(tok.encode(template.render(turns, add_generation_prompt=True)))
    engine = SimpleNamespace(tokenizer=tok, chat_template=template, max_model_len=full + 8)
    ids, dropped = chat_prompt(engine, turns, 8)
    assert dropped == 0 and len(ids) == full
    engine.max_model_len = full - 10
    ids, dropped = chat_prompt(engine, turns, 8)
    kept = turns[:1] + turns[1 + dropped:]
    assert dropped >= 2 and dropped % 2 == 0 and kept[1]["role"] == "user" and kept[0] == turns[0]
    assert len(ids) + 8 <= engine.max_model_len
    assert ids == tok.encode(template.render(kept, add_generation_prompt=True))
    engine.max_model_len = 5
    assert chat_prompt(engine, turns, 8)[0] == []


def test_run_batch_answers_each_line_in_order(tmp_path):
    """OpenAI's batch format through the server's routes in process: each line's answer in the input's order, a
    bad body as its route's 400, a line that is not a request as an error entry; greedy duplicates agree."""
    lines = [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}},
             {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Once upon", "max_tokens": 3, "temperature": 0, "ignore_eos": True}},
             "not json",
             {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -1}},
             {"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}},
             {"custom_id": "cmpl-again", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Once upon", "max_tokens": 3, "temperature": 0, "ignore_eos": True}}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    r = run_cli("run-batch", "-i", str(src), "-o", str(dst), "--max-batch", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["chat", "cmpl", None, "bad", "get", "cmpl-again"]
    status = [o["response"]["status_code"] if o["response"] else None for o in out]
    assert status == [200, 200, None, 400, None, 200]
    assert out[0]["response"]["body"]["object"] == "chat.completion"
    assert out[1]["response"]["body"]["choices"][0]["text"] == out[5]["response"]["body"]["choices"][0]["text"]
    assert out[1]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert out[3]["response"]["body"]["error"]["param"] == "max_tokens"
    assert "not JSON" in out[2]["error"]["message"] and "must be POST" in out[4]["error"]["message"]
    assert re.search(r"6 requests: 3 answered, 3 failed", r.stderr)


def test_generate_holds_the_output_to_a_schema_or_a_regex(tmp_path):
    """--json-schema: the text is JSON valid for the schema and ends there ("stop"); --choice: one of the choices;
    a pattern the grammar engine cannot read is a one-line error (exit status 2)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    r = run_cli("generate", "--json-schema", str(path), "--max-tokens", "20", "--temperature", "1", "--seed", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) in ({"ok": True}, {"ok": False}) and "(stop)" in r.stderr
    r = run_cli("generate", "--choice", "yes,no,maybe", "--max-tokens", "8", "--temperature", "1", "--seed", "4")
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no", "maybe"), r.stdout
    r = run_cli("generate", "--regex", "(unclosed", "--max-tokens", "2")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --regex cannot be followed")
