"""``benchmarks/constrained_decode.py``: every scenario runs through the real engine (scheduler, runner, grammar
masks, sampler) over the hash model in the simulator -- the demo model's transformer takes seconds a step there --
with constrained rows that really follow the schema and a check whose outputs validate; the Qwen3-sized tokenizer
view puts Qwen3's EOS where llguidance accepts it; the helpers' arithmetic and validation."""
import json

import numpy as np
import pytest

from tests.benchmarks.scripts import one_line_error, run_script
from tests.text.schema_check import errors


@pytest.fixture
def cd(bench_modules):
    import constrained_decode
    return constrained_decode


def test_scenarios_and_the_tpot_window(cd):
    names = [s.name for s in cd.scenarios([8, 64], [64])]
    assert names == ["8 free", "7 free + 1 JSON", "4 free + 4 JSON", "64 free", "63 free + 1 JSON",
                     "32 free + 32 JSON", "64 JSON"]
    assert [s.name for s in cd.scenarios([2], [4])] == ["2 free", "1 free + 1 JSON", "4 free", "4 JSON"]
    # tokens 2..5 (the last one left out): (9 - 3) / 3
    assert cd.steady_tpot([0.0, 1.0, 3.0, 5.0, 7.0, 9.0, 100.0], 2) == 2.0


def test_records_check_matches_the_schema(cd):
    """The benchmark's own validator agrees with the tests' validator on good and bad values."""
    schema = cd.records_schema(1, 2)
    good = {"records": [{"id": 7, "name": "ab", "active": True, "tags": ["red"]}]}
    bad = [{"records": []},
           {"records": [{"id": 7, "name": "x" * 25, "active": True, "tags": []}]},
           {"records": [{"id": 7, "name": "ab", "active": 1, "tags": []}]},
           {"records": [{"id": 7, "name": "ab", "active": True, "tags": ["pink"]}]},
           {"records": [{"id": 7, "name": "ab", "active": True, "tags": [], "extra": 0}]},
           {"records": [{"id": -1, "name": "ab", "active": True, "tags": []}]}]
    assert cd.records_errors(good, 1, 2) == [] and errors(good, schema) == []
    for value in bad:
        assert cd.records_errors(value, 1, 2) and errors(value, schema), value


def test_every_scenario_through_the_engine(cd, capsys):
    """Catches a benchmark that times rows which are not constrained, or whose batches shrink: every JSON row of
    the timed batches starts the schema's object, every row decodes the full length (else ``BenchError``), the
    table and JSON have every scenario with its ratio and target, and the check's rows validate."""
    from tests.engine.hash_engine import hash_engine
    args = cd.parse_args(["--batches", "2", "--json-batches", "2", "--max-tokens", "5", "--skip", "1",
                          "--prompt-len", "3", "--rounds", "1", "--warmup-rounds", "0", "--check-rows", "2",
                          "--check-max-tokens", "150"])
    engine = hash_engine(max_batch=2, max_model_len=args.max_model_len)
    res = cd.bench(engine, args)
    cd.print_table(res, args)
    out = capsys.readouterr().out
    names = ["2 free", "1 free + 1 JSON", "2 JSON"]
    assert list(res["scenarios"]) == names
    for name, rows in zip(names, (2, 1, 2)):
        s = res["scenarios"][name]
        assert s["tpot"]["rows"] == rows and s["tpot"]["p50_ms"] > 0, s
        assert any(line.startswith(name + " ") for line in out.splitlines()), out
        if name == "2 free":
            assert s["constrained_text"] is None and s["constrained_rows_tpot"] is None
        else:
            text, start = s["constrained_text"], '{"records": [{"id": '   # 5 tokens: a prefix of the object
            assert len(text) >= 5 and (text.startswith(start) or start.startswith(text)), text
    ratios = {r["scenario"]: r for r in res["ratios"]}
    assert set(ratios) == {"1 free + 1 JSON", "2 JSON"}
    assert ratios["1 free + 1 JSON"]["target"] == 1.03 and ratios["2 JSON"]["target"] == 1.25
    assert all(r["ratio_p50"] > 0 and r["baseline"] == "2 free" for r in ratios.values())
    assert "≤ 1.03" in out and "≤ 1.25" in out
    check = res["check"]
    assert check["valid"] == 2 and "check: 2 of 2 rows" in out
    for row in check["rows"]:
        assert row["finish_reason"] == "stop" and errors(json.loads(row["text"]), check["schema"]) == [], row
    json.dumps(res)                                    # what --json writes


def test_qwen3_vocab_view(cd, tmp_path):
    """Qwen3's size and added-token ids, the folder's other files linked, and llguidance accepts EOS 151645 over a
    151936-row embedding (it refuses it with the demo tokenizer the random folders carry)."""
    from pegainfer.text.structured import GrammarCompiler
    from pegainfer.text.tokenizer import Tokenizer
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "tokenizer.json").write_text("not read")
    view = cd.qwen3_vocab_view(src, tmp_path / "view")
    assert (view / "config.json").is_symlink() and not (view / "tokenizer.json").is_symlink()
    tok = Tokenizer.from_folder(view)
    assert tok.vocab_size == 151669 and tok.eos_token_id == 151645
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<tool_call>", "<think>", "</think>")] == \
        [151643, 151657, 151667, 151668]
    compiler = GrammarCompiler(tok, 151936, [151645])
    constraint = compiler.constraint(compiler.json_schema(cd.records_schema(1)))
    mask = np.zeros((1, 4748), np.int32)
    constraint.fill(mask, 0)
    allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
    texts = [tok.decode([int(i)]) for i in allowed]
    assert texts and all(t and '{"records": ['.startswith(t) for t in texts), texts


def test_qwen3_vocab_needs_a_folder():
    r = run_script("constrained_decode.py", "--qwen3-vocab", timeout=120)
    assert r.returncode == 2
    assert one_line_error(r) == "error: --qwen3-vocab needs --model-path (a folder with a Qwen3-sized embedding)"


