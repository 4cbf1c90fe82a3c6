"""Does grammar-constrained decoding (structured output) slow a batch down?  TPOT of unconstrained rows decoding
beside rows constrained to a JSON schema, and of a batch of constrained rows, against the same batches with no
constraint, in one process (``Engine`` in process, CUDA graphs on as in serving):

    python benchmarks/constrained_decode.py --model-path DIR [--qwen3-vocab] [--batches 8,64] [--json OUT]

Scenarios, for each batch B of ``--batches`` (and each of ``--json-batches``):

* ``B free``            B unconstrained rows (the baseline);
* ``B-k free + k JSON`` the same batch with its last k rows (k = 1 and B/2) constrained to the JSON schema:
  the TPOT of its B-k unconstrained rows, against ``B free`` (target: within 3 %);
* ``B JSON``            every row constrained (``--json-batches``, default 64): against ``B free`` (target: 1.25x).

Every row decodes ``--max-tokens`` tokens (``ignore_eos``; prompts of ``--prompt-len`` random ids, sampled at
``--temperature`` with a seed per row).  The schema is an object holding an array of at least ``--min-items``
records (``{"id": int, "name": str, "active": bool, "tags": [enum]}``, 49 characters or more each, so at least two
tokens each): no constrained row can complete it, and end early, within ``--max-tokens``.  TPOT of a row: the time
between its token ``--skip`` and its last-but-one token (host clock, at the return of ``Engine.step``) over the
tokens in between -- steady state (prompts done, every row decoding; the last step is never launched ahead) --
p50 and mean over the measured rows of every round.  Each round runs every scenario once, in an order rotated from
round to round, after ``--warmup-rounds`` untimed rounds (which also capture the constrained path's graphs).

Then a check: ``--check-rows`` rows constrained to the same records schema holding one record decode until the
grammar is complete; each output must end with "stop", parse and validate (the exit status is 1 otherwise).

``--qwen3-vocab``: the random-weight Qwen3 folders of ``benchmarks/run_all.sh`` carry the demo model's tokenizer
(a few hundred tokens) while their generation config names Qwen3's EOS id 151645, which llguidance refuses as
outside that tokenizer.  The option runs the model through a view of its folder (weights and config linked) whose
tokenizer is a byte-level vocabulary of Qwen3's size with Qwen3's added tokens at Qwen3's ids
(``qwen3_vocab_view``), so the grammar engine works over a vocabulary as large as the real one.  Without a GPU it
runs in the simulator on the demo model (use tiny sizes)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QWEN3_BPE_TOKENS = 151643          # Qwen3's byte-level BPE tokens; its added tokens follow, from this id on
QWEN3_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>")
TAGS = ["red", "green", "blue", "urgent", "later"]
MIXED_TARGET, JSON_TARGET = 1.03, 1.25


class BenchError(Exception):
    """A run that cannot give the figures (printed as one line)."""


# ------------------------------------------------------------------------------------------------ the schema
def records_schema(min_items: int, max_items: int | None = None) -> dict:
    """``{"records": [record, ...]}`` with ``min_items`` .. ``max_items`` records of four fields."""
    record = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "name": {"type": "string", "maxLength": 24},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": TAGS}, "maxItems": 3}},
        "required": ["id", "name", "active", "tags"], "additionalProperties": False}
    records = {"type": "array", "items": record, "minItems": int(min_items)}
    if max_items is not None:
        records["maxItems"] = int(max_items)
    return {"type": "object", "properties": {"records": records}, "required": ["records"],
            "additionalProperties": False}


def records_errors(value, min_items: int, max_items: int | None = None) -> list[str]:
    """What keeps ``value`` from matching ``records_schema(min_items, max_items)`` ([] when it matches)."""
    if not isinstance(value, dict) or set(value) != {"records"} or not isinstance(value["records"], list):
        return [f"not an object with only a records array: {value!r}"[:200]]
    recs = value["records"]
    out = [] if min_items <= len(recs) <= (max_items if max_items is not None else len(recs)) else \
        [f"{len(recs)} records, not {min_items}..{max_items}"]
    for i, r in enumerate(recs):
        ok = (isinstance(r, dict) and set(r) == {"id", "name", "active", "tags"}
              and type(r["id"]) is int and 0 <= r["id"] <= 999999
              and isinstance(r["name"], str) and len(r["name"]) <= 24 and type(r["active"]) is bool
              and isinstance(r["tags"], list) and len(r["tags"]) <= 3 and all(t in TAGS for t in r["tags"]))
        if not ok:
            out.append(f"record {i} does not match: {r!r}"[:200])
    return out


# ------------------------------------------------------------------------------------------------ the folder
def qwen3_vocab_view(folder, dest) -> Path:
    """A view of ``folder`` in ``dest``: every file linked except the tokenizer's, and a byte-level tokenizer of
    Qwen3's size -- the 256 byte tokens, the demo tokenizer's pieces, then concatenations of two of its pieces in
    a fixed order up to id 151642, then Qwen3's 26 added tokens at ids 151643..151668 (``<|im_end|>`` = 151645)
    -- with the demo model's chat template.  No merges: prompts must be token ids (the grammar engine only needs
    each token's bytes)."""
    import os

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from pegainfer.demo import CHAT_TEMPLATE, ensure_demo_model

    src, dst = Path(folder).expanduser().resolve(), Path(dest)
    dst.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(src):
        if not name.startswith("tokenizer") and name != "chat_template.jinja":
            os.symlink(src / name, dst / name)
    demo = Tokenizer.from_file(str(ensure_demo_model() / "tokenizer.json"))
    pieces = [t for t, _ in sorted(demo.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])]
    vocab = {t: -1 for t in QWEN3_ADDED_TOKENS}          # kept out of the BPE ids (dropped below)
    for p in [*pre_tokenizers.ByteLevel.alphabet(), *pieces]:
        vocab.setdefault(p, len(vocab))
    for a in pieces:
        for b in pieces:
            if len(vocab) == len(QWEN3_ADDED_TOKENS) + QWEN3_BPE_TOKENS:
                break
            vocab.setdefault(a + b, len(vocab))
    vocab = {t: i - len(QWEN3_ADDED_TOKENS) for t, i in vocab.items() if i >= 0}
    assert len(vocab) == QWEN3_BPE_TOKENS, len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for i, t in enumerate(QWEN3_ADDED_TOKENS):          # one at a time: ids in Qwen3's order
        if t.startswith("<|"):
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
        else:
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
        assert tok.token_to_id(t) == QWEN3_BPE_TOKENS + i, t
    tok.save(str(dst / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": t.startswith("<|")}
             for t in QWEN3_ADDED_TOKENS}
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "chat_template": CHAT_TEMPLATE, "tokenizer_class": "Qwen2Tokenizer"}, indent=1))
    return dst


# ------------------------------------------------------------------------------------------------ scenarios
@dataclass(frozen=True)
class Scenario:
    batch: int
    constrained: int          # the batch's last ``constrained`` rows follow the grammar

    @property
    def name(self) -> str:
        free = self.batch - self.constrained
        if not self.constrained:
            return f"{free} free"
        return f"{self.batch} JSON" if not free else f"{free} free + {self.constrained} JSON"

    @property
    def baseline(self) -> str:
        return f"{self.batch} free"

    @property
    def measured(self) -> str:
        """Whose TPOT the scenario reports: the unconstrained rows', or the constrained rows' when there are none."""
        return "JSON" if self.constrained == self.batch else "free"


def scenarios(batches: list[int], json_batches: list[int]) -> list[Scenario]:
    """Each batch free, with 1 and B/2 constrained rows, then the all-constrained batches (with their free
    baselines)."""
    out = []
    for b in sorted(set(batches) | set(json_batches)):
        out.append(Scenario(b, 0))
        if b in batches:
            out += [Scenario(b, k) for k in sorted({1, b // 2}) if 0 < k < b]
        if b in json_batches:
            out.append(Scenario(b, b))
    return out


def steady_tpot(times: list[float], skip: int) -> float:
    """Seconds per token between token ``skip`` and the last-but-one token of one row (``times``: when each token
    arrived)."""
    last = len(times) - 2
    if last <= skip:
        raise ValueError(f"{len(times)} tokens leave nothing after --skip {skip}: raise --max-tokens")
    return (times[last] - times[skip]) / (last - skip)


def run_batch(engine, sc: Scenario, grammar: str, args, round_no: int) -> dict:
    """Decode one batch of ``sc`` to the end; per-row TPOTs of the free and constrained rows, and a constrained
    row's text."""
    import numpy as np

    from pegainfer.engine.types import SamplingParams
    rng = np.random.default_rng(round_no)
    rows = []
    for r in range(sc.batch):
        constrained = r >= sc.batch - sc.constrained
        rid = f"r{round_no}-{sc.batch}-{sc.constrained}-{r}"
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1000 * round_no + r,
                                ignore_eos=True, grammar=grammar if constrained else None)
        engine.add_request(rid, rng.integers(0, 256, size=args.prompt_len).tolist(), params)
        rows.append((rid, constrained))
    times = {rid: [] for rid, _ in rows}
    texts = {rid: [] for rid, _ in rows}
    reasons = {}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            times[out.request_id] += [now] * len(out.new_token_ids)
            texts[out.request_id].append(out.delta_text)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    short = [(rid, len(times[rid]), reasons.get(rid)) for rid, _ in rows if len(times[rid]) != args.max_tokens]
    if short:
        rid, n, why = short[0]
        raise BenchError(f"{sc.name}: {len(short)} rows ended early ({rid}: {n} of {args.max_tokens} tokens, "
                           f"{why}); raise --min-items")
    tpot = {"free": [], "JSON": []}
    for rid, constrained in rows:
        tpot["JSON" if constrained else "free"].append(steady_tpot(times[rid], args.skip))
    sample = next(("".join(texts[rid]) for rid, c in rows if c), None)
    return {"tpot": tpot, "constrained_text": sample}


def _summary(values: list[float]) -> dict:
    return {"p50_ms": statistics.median(values) * 1e3, "mean_ms": statistics.fmean(values) * 1e3,
            "rows": len(values)} if values else None


def check_outputs(engine, rows: int, max_tokens: int, temperature: float) -> dict:
    """``rows`` requests constrained to one record, decoded until the grammar completes: their finish reasons,
    texts and what is wrong with each (parse or schema)."""
    from pegainfer.engine.types import SamplingParams
    schema = records_schema(1, 1)
    grammar = engine.grammar_compiler.json_schema(schema)
    for r in range(rows):
        engine.add_request(f"check-{r}", [r % 256] * 4, SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=r, grammar=grammar))
    texts, reasons = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.delta_text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    found = []
    for r in range(rows):
        text, reason = texts.get(f"check-{r}", ""), reasons.get(f"check-{r}")
        try:
            errs = records_errors(json.loads(text), 1, 1)
        except ValueError as e:
            errs = [f"does not parse: {e}"]
        found.append({"text": text, "finish_reason": reason,
                      "errors": ([] if reason == "stop" else [f"finish reason {reason}"]) + errs})
    return {"schema": schema, "rows": found, "valid": sum(not f["errors"] for f in found)}


def bench(engine, args) -> dict:
    """Every scenario over ``--rounds`` rounds (after the warm-up rounds), the ratios and the check."""
    scs = scenarios(args.batches, args.json_batches)
    schema = records_schema(args.min_items)
    grammar = engine.grammar_compiler.json_schema(schema)
    try:
        error = engine.grammar_compiler.check(grammar)
    except ValueError as e:           # llguidance refuses the tokenizer itself (e.g. an EOS id outside it)
        error = f"{e} (for a random-weight Qwen3 folder, add --qwen3-vocab)"
    if error:
        raise BenchError(f"llguidance cannot follow the benchmark's schema with this tokenizer: {error}")
    pooled = {sc: {"free": [], "JSON": []} for sc in scs}
    samples = {}
    for round_no in range(args.warmup_rounds + args.rounds):
        order = scs[round_no % len(scs):] + scs[:round_no % len(scs)]
        for sc in order:
            got = run_batch(engine, sc, grammar, args, round_no)
            if round_no >= args.warmup_rounds:
                for kind in ("free", "JSON"):
                    pooled[sc][kind] += got["tpot"][kind]
            samples[sc] = got["constrained_text"]
    results = {}
    for sc in scs:
        results[sc.name] = {"batch": sc.batch, "constrained_rows": sc.constrained, "measured": sc.measured,
                            "tpot": _summary(pooled[sc][sc.measured]),
                            "constrained_rows_tpot": _summary(pooled[sc]["JSON"]),
                            "constrained_text": samples[sc]}
    ratios = []
    for sc in scs:
        if sc.constrained:
            base, got = results[sc.baseline]["tpot"], results[sc.name]["tpot"]
            target = JSON_TARGET if sc.measured == "JSON" else MIXED_TARGET
            r50 = got["p50_ms"] / base["p50_ms"]
            ratios.append({"scenario": sc.name, "baseline": sc.baseline, "ratio_p50": r50,
                           "ratio_mean": got["mean_ms"] / base["mean_ms"], "target": target, "met": r50 <= target})
    check = check_outputs(engine, args.check_rows, args.check_max_tokens, args.temperature) if args.check_rows \
        else None
    return {"scenarios": results, "ratios": ratios, "check": check, "schema_min_items": args.min_items}


def print_table(res: dict, args) -> None:
    ratio = {r["scenario"]: r for r in res["ratios"]}
    print(f"\nTPOT (ms) of the measured rows, tokens {args.skip}..{args.max_tokens - 2} of {args.max_tokens}, "
          f"{args.rounds} round{'s' if args.rounds != 1 else ''}; JSON rows: an object of at least "
          f"{args.min_items} records")
    print(f"{'scenario':<22}{'measured':>10}{'p50':>9}{'mean':>9}   {'vs':<9}{'ratio p50':>10}{'mean':>8}"
          f"{'target':>8}")
    for name, s in res["scenarios"].items():
        line = f"{name:<22}{s['measured'] + ' rows':>10}{s['tpot']['p50_ms']:9.3f}{s['tpot']['mean_ms']:9.3f}"
        r = ratio.get(name)
        if r:
            line += (f"   {r['baseline']:<9}{r['ratio_p50']:10.3f}{r['ratio_mean']:8.3f}"
                     f"{'≤ ' + format(r['target'], 'g'):>8}  {'met' if r['met'] else 'MISSED'}")
        print(line)
    c = res["check"]
    if c is not None:
        print(f"check: {c['valid']} of {len(c['rows'])} rows constrained to one record complete, parse and validate")
        for i, row in enumerate(c["rows"]):
            if row["errors"]:
                print(f"  row {i}: {'; '.join(row['errors'])}: {row['text'][:120]!r}")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes of 1 or more")
    return values


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--qwen3-vocab", action="store_true", help="run through a view with a Qwen3-sized tokenizer")
    ap.add_argument("--batches", type=_ints, default=[8, 64], help="batch sizes, comma-separated (default 8,64)")
    ap.add_argument("--json-batches", type=_ints, default=[64], help="all-constrained batch sizes (default 64)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens every row decodes (default 128)")
    ap.add_argument("--skip", type=int, default=16, help="tokens of a row before its TPOT window (default 16)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, seeded per row")
    ap.add_argument("--min-items", type=int, default=None, help="records the schema asks for (default: max-tokens)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup-rounds", type=int, default=1)
    ap.add_argument("--check-rows", type=int, default=None, help="rows of the check (default: the largest JSON "
                    "batch; 0: no check)")
    ap.add_argument("--check-max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.skip + 2 >= args.max_tokens:
        ap.error(f"--max-tokens {args.max_tokens} leaves no TPOT window after --skip {args.skip}")
    if args.min_items is None:
        args.min_items = args.max_tokens
    if args.check_rows is None:
        args.check_rows = max(args.json_batches)
    if args.max_model_len is None:
        args.max_model_len = max(args.prompt_len + args.max_tokens, 4 + args.check_max_tokens) + 16
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from pegainfer.engine.engine import Engine
    from pegainfer.errors import PegainferError
    max_batch = max(args.batches + args.json_batches + [args.check_rows])
    with tempfile.TemporaryDirectory(prefix="pegainfer-qwen3-vocab-") as tmp:
        path = args.model_path
        if args.qwen3_vocab:
            if path is None:
                print("error: --qwen3-vocab needs --model-path (a folder with a Qwen3-sized embedding)",
                      file=sys.stderr)
                return 2
            path = str(qwen3_vocab_view(path, Path(tmp) / Path(path).name))
        try:
            engine = Engine.from_folder(path, args.max_model_len, max_batch=max_batch,
                                        max_num_batched_tokens=max(2048, max_batch * args.prompt_len))
        except PegainferError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.qwen3_vocab and engine.model.V < QWEN3_BPE_TOKENS + len(QWEN3_ADDED_TOKENS):
            print(f"error: --qwen3-vocab needs an embedding of at least 151669 rows ({engine.model.V} here)",
                  file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        try:
            res = bench(engine, args)
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        res.update(model=engine.model_name, tokenizer="qwen3-vocab view" if args.qwen3_vocab else "folder",
                   tokenizer_tokens=engine.tokenizer.vocab_size, max_tokens=args.max_tokens, skip=args.skip,
                   rounds=args.rounds, temperature=args.temperature, prompt_len=args.prompt_len,
                   seconds=time.perf_counter() - t0)
    print_table(res, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    check = res["check"]
    return 1 if check is not None and check["valid"] < len(check["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
