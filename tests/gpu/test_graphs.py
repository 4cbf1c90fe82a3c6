"""CUDA-graph replay and eager launches must produce identical tokens (GPU only: the simulator cannot capture)."""
import numpy as np
import pytest

from tests.util import recorded_step_kinds

pytestmark = pytest.mark.gpu


def _mid_qwen3(tmp_path):
    from pegainfer.demo import write_random_qwen3, ensure_demo_model
    import shutil

    folder = tmp_path / "mid"
    write_random_qwen3(folder, {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                                "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                                "max_position_embeddings": 2048}, seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (folder / name).exists():
            shutil.copy(ensure_demo_model() / name, folder / name)
    return folder


def _mid_qwen35(tmp_path):
    """A random-weight Qwen3.5 of the same width class (3 Gated DeltaNet layers, 1 full attention), by transformers."""
    pytest.importorskip("transformers")
    from tests.gpu.shallow_models import SHALLOW_QWEN35_4B, make_shallow_qwen35

    mid = dict(SHALLOW_QWEN35_4B, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
               num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
               vocab_size=4096, max_position_embeddings=2048)
    return make_shallow_qwen35(tmp_path / "mid35", mid, seed=3)


def _step(eng, toks) -> None:
    """One engine step; each output's new tokens appended to its request's list in ``toks``."""
    for out in eng.step():
        toks[out.request_id].extend(out.new_token_ids)


def test_graph_and_eager_paths_give_identical_tokens(tmp_path):
    """Catches a captured graph that differs from its eager launches, or a padded decode batch that leaks into
    real rows: ten concurrent requests (decode batches padded from 9 and 10 to the captured 12, prompts arriving
    in mixed steps, max_tokens ending some early) give the same tokens through graphs and eagerly."""
    from pegainfer.engine.engine import Engine
    from pegainfer.engine.types import SamplingParams

    folder = _mid_qwen3(tmp_path)
    lengths = (5, 40, 300, 7, 16, 17, 90, 3, 64, 129)
    prompts = [np.random.default_rng(i).integers(0, 400, size=n).tolist() for i, n in enumerate(lengths)]
    results = {}
    for graphs in (True, False):
        eng = Engine.from_folder(str(folder), max_model_len=1024, max_batch=12, use_cuda_graph=graphs)
        assert eng.runner.padded_batch(9) == 12
        toks = {}
        for i, p in enumerate(prompts):      # arrivals one step apart: mixed steps, batches of 1..10
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=24 + i, temperature=0.8, top_p=0.9, seed=i,
                                                       ignore_eos=True))
            toks[f"r{i}"] = []
            _step(eng, toks)
        while eng.has_unfinished():
            _step(eng, toks)
        results[graphs] = toks
        assert eng.stats()["kv_pages_used"] == 0
        assert [len(toks[f"r{i}"]) for i in range(10)] == [24 + i for i in range(10)]
    first_difference = {rid: next(j for j, (a, b) in enumerate(zip(t, results[False][rid])) if a != b)
                        for rid, t in results[True].items() if t != results[False][rid]}
    assert not first_difference, first_difference


def test_async_scheduling_gives_identical_tokens(tmp_path):
    """Decode steps launched ahead of reading the previous token (async scheduling) vs waiting for every step:
    the same tokens, greedy and seeded, one request at a time (batch 1, as the benchmarks run)."""
    from pegainfer.engine.engine import Engine
    from pegainfer.engine.types import SamplingParams

    folder = _mid_qwen3(tmp_path)
    prompts = [np.random.default_rng(i).integers(0, 400, size=n).tolist() for i, n in ((0, 5), (1, 40), (2, 300))]
    results = {}
    for overlap in (True, False):
        eng = Engine.from_folder(str(folder), max_model_len=1024, max_batch=1, async_scheduling=overlap)
        toks = []
        for i, p in enumerate(prompts):
            for params in (SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                           SamplingParams(max_tokens=20, temperature=0.9, top_k=50, seed=i, ignore_eos=True)):
                eng.add_request(f"r{i}", p, params)
                got = []
                while eng.has_unfinished():
                    for out in eng.step():
                        got.extend(out.new_token_ids)
                toks.append(got)
        results[overlap] = toks
        assert eng.stats()["kv_pages_used"] == 0
    assert [len(t) for t in results[True]] == [32, 20] * 3
    assert results[True] == results[False]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_mixed_steps_replayed_from_graphs_give_the_eager_tokens(tmp_path, arch):
    """Catches a mixed-step graph (decodes beside prompt chunks, padded to its (Dp, Cp, Rp) shape) that differs from
    the same padded step launched eagerly, or padding that leaks into real rows (Qwen3.5: into the Gated DeltaNet
    states, through the padding decode rows between the decodes and the chunks): three waves of eight streams, each
    arriving one step after the one before while the earlier ones decode (every step of a wave's start is mixed);
    the waves' prompts differ in length but not in bucket, so the first wave captures its shapes (at first sight)
    and the later waves replay them.  Graphs and eager give the same tokens, greedy and sampled."""
    from pegainfer.engine.engine import Engine
    from pegainfer.engine.types import SamplingParams

    folder = _mid_qwen3(tmp_path) if arch == "qwen3" else _mid_qwen35(tmp_path)
    base = (5, 40, 100, 7, 20, 60, 3, 90)        # + wave (0..2): each stays within its prefill bucket
    results, replayed = {}, []
    for graphs in (True, False):
        eng = Engine.from_folder(str(folder), max_model_len=1024, max_batch=24, use_cuda_graph=graphs)
        assert eng.runner.pad_mixed
        if graphs:
            assert eng.runner.graphs.has("mixed", 24, 128, 16)    # captured at warm-up
            replay = eng.runner.graphs.replay
            eng.runner.graphs.replay = lambda *key: (replayed.append(key), replay(*key))[1]
        toks = {}
        with recorded_step_kinds(eng) as kinds:   # (mixed steps planned beside decodes launched ahead included)
            for wave in range(3):
                for i, n in enumerate(base):
                    rid = f"w{wave}r{i}"
                    prompt = np.random.default_rng(10 * wave + i).integers(0, 400, size=n + wave).tolist()
                    eng.add_request(rid, prompt, SamplingParams(max_tokens=10 + i,
                                                                temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i,
                                                                ignore_eos=True))
                    toks[rid] = []
                    _step(eng, toks)
                while eng.has_unfinished():
                    _step(eng, toks)
        results[graphs] = toks
        assert kinds.count("mixed") >= 3 * 6, kinds
        assert eng.model.arch == arch and eng.stats()["kv_pages_used"] == 0 and eng.stats()["slots_used"] == 0
        assert all(len(toks[f"w{w}r{i}"]) == 10 + i for w in range(3) for i in range(8))
        del eng
    mixed_replays = [k for k in replayed if k[0] == "mixed"]
    assert len(mixed_replays) >= 2 * 6, replayed
    first_difference = {rid: next(j for j, (a, b) in enumerate(zip(t, results[False][rid])) if a != b)
                        for rid, t in results[True].items() if t != results[False][rid]}
    assert not first_difference, first_difference


def test_qwen35_prefix_cache_gives_the_uncached_results(tmp_path):
    """Qwen3.5 with the prefix cache on, replayed from graphs: prompts sharing a 300-token prefix arrive while others
    decode (the first keeps its state at 304, a decode step in; the second recomputes, its prefill cut at 288 where
    the shared pages end); their greedy tokens equal those of the same engine with the cache off.  Then the first's
    next chat turn starts from its kept state (304 cached tokens): its first token's distribution equals the
    uncached one within a few bf16 steps of the logits.  (Not its greedy tokens: its state came from a decode step
    rather than the chunked form, one bf16 step apart in some logits, and this random model's near-uniform logits
    tie at that step -- measured: a 0.0078 difference swapping a tie between the two most likely tokens.)  Nothing
    stays in use when idle."""
    from pegainfer.engine.engine import Engine
    from pegainfer.engine.types import SamplingParams

    folder = _mid_qwen35(tmp_path)
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 400, size=300).tolist()
    prompts = {"a": shared + [1, 2, 3], "other": rng.integers(0, 400, size=50).tolist(), "b": shared + [9] * 20}
    results, hits, turn_top = {}, {}, {}
    for cache in (True, False):
        eng = Engine.from_folder(str(folder), max_model_len=1024, max_batch=8, enable_prefix_caching=cache)
        toks = {}
        for rid, prompt in prompts.items():
            eng.add_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            toks[rid] = []
            for _ in range(3):
                _step(eng, toks)
        while eng.has_unfinished():
            _step(eng, toks)
        turn = prompts["a"] + toks["a"] + [4, 5, 6]
        eng.add_request("a2", turn, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=8))
        while eng.has_unfinished():
            for out in eng.step():
                if out.logprobs:
                    turn_top[cache] = dict(out.logprobs[0].top)
        results[cache], hits[cache] = toks, eng.stats()["prefix_cache_hits"]
        assert eng.stats()["kv_pages_used"] == 0 and eng.stats()["slots_used"] == 0
        del eng
    assert results[True] == results[False]
    assert hits[True] == 304 and hits[False] == 0, hits
    on, off = turn_top[True], turn_top[False]
    common = on.keys() & off.keys()
    assert len(common) >= 6, (on, off)
    assert max(abs(on[t] - off[t]) for t in common) < 0.04, (on, off)      # five bf16 steps near the logits' size
    assert abs(max(on.values()) - max(off.values())) < 0.04, (on, off)


def test_penalties_and_prompt_logprobs_through_graphs_and_steps_ahead(tmp_path):
    """Penalties and logit bias counted on the device while steps launch ahead of the host (graphs, async
    scheduling) against eager synchronous steps: the same tokens, one greedy request alone (the LM head's argmax
    re-picked from the penalized row) and four beside each other; the penalties change the greedy stream; a prompt's
    logprobs equal those of ``score`` of the same ids."""
    from pegainfer.engine.engine import Engine
    from pegainfer.engine.types import SamplingParams

    folder = _mid_qwen3(tmp_path)
    prompts = [np.random.default_rng(10 + i).integers(0, 400, size=n).tolist() for i, n in enumerate((6, 33, 80, 17))]
    pen = [dict(repetition_penalty=1.3, frequency_penalty=1.0), dict(frequency_penalty=0.8, presence_penalty=0.4),
           dict(logit_bias={7: 3.0, 11: -2.0}), dict(repetition_penalty=1.1, presence_penalty=1.5)]
    results = {}
    for fast in (True, False):
        eng = Engine.from_folder(str(folder), max_model_len=1024, max_batch=4, use_cuda_graph=fast,
                                 async_scheduling=fast)
        runs = []
        for batch in ([0], [0, 1, 2, 3]):
            toks = {f"r{i}": [] for i in batch}
            for i in batch:
                eng.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=40, temperature=0.0 if i % 2 == 0
                                                                     else 0.7, seed=i, ignore_eos=True, **pen[i]))
            while eng.has_unfinished():
                _step(eng, toks)
            runs.append(toks)
        eng.add_request("plain", prompts[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        plain = []
        while eng.has_unfinished():
            plain += sum((o.new_token_ids for o in eng.step()), [])
        assert plain != runs[0]["r0"]
        eng.add_request("scored", prompts[2], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        got = [e.logprob for e in outs[0].prompt_logprobs[1:]]
        x = eng.score(prompts[2]).astype(np.float64)
        lse = x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1))
        np.testing.assert_allclose(got, [x[p, prompts[2][p + 1]] - lse[p] for p in range(len(prompts[2]) - 1)],
                                   rtol=0, atol=1e-6)
        assert eng.stats()["kv_pages_used"] == 0
        results[fast] = runs
    assert results[True] == results[False]
