"""Which step shapes get CUDA graphs (``engine/cuda_graph.py``): the sizes a padded step runs as."""
from pegainfer.engine.cuda_graph import (PREFILL_GRAPH_MAX, decode_graph_sizes, prefill_bucket,
                                         prefill_buckets)


def test_prompt_chunks_up_to_the_default_budget_replay_from_a_graph():
    """Catches a default-budget chunk (2048 tokens) left eager -- it then pays the host cost of every launch -- or a
    bucket list that pads a chunk by half or more above 512 tokens."""
    assert PREFILL_GRAPH_MAX >= 2048
    buckets = prefill_buckets(2048)
    assert buckets == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048]
    for length in range(1, 2049):
        b = prefill_bucket(length, 2048)
        assert b is not None and b >= length
        assert b <= 16 or b < 2 * length and (length <= 512 or b < 1.5 * length), (length, b)
    assert prefill_bucket(2049, 4096) is None          # longer: unpadded, eager
    assert prefill_buckets(1000)[-1] == 768             # never past the model's token buffers


def test_decode_batches_pad_to_a_captured_size():
    """Every batch up to max_batch has a captured size at most a step above it (the padded rows' waste)."""
    sizes = decode_graph_sizes(256)
    assert sizes[:8] == list(range(1, 9)) and sizes[-1] == 256 and sizes == sorted(set(sizes))
    for b in range(1, 257):
        padded = min(s for s in sizes if s >= b)
        assert padded - b < (8 if b <= 64 else 16 if b <= 128 else 32)
