"""CUDA-graph replay and eager launches must produce identical tokens (GPU only: the simulator cannot capture)."""
import numpy as np
import pytest

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
            for out in eng.step():
                toks[out.request_id].extend(out.new_token_ids)
        while eng.has_unfinished():
            for out in eng.step():
                toks[out.request_id].extend(out.new_token_ids)
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
