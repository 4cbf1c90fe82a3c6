"""safetensors reading: dtypes, memory-map views, shards, uploads, and every corrupt/mismatched-file message."""
import io
import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import pegainfer  # noqa: F401  (before numba)
from numba import cuda
from pegainfer.demo import qwen3_tensor_shapes, write_random_qwen3
from pegainfer.errors import OutOfMemoryError, WeightError
from pegainfer.kernels.primitives import from_bf16_bits
from pegainfer.weights import (Progress, WeightReader, check_gpu_memory, list_tensor_names, prefix_for,
                               read_header)


def save(folder, tensors, name="model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / name))
    return folder


# --------------------------------------------------------------------------------------------------- dtypes
def test_bf16_is_a_zero_copy_memmap_view(tmp_path, rng):
    w = rng.standard_normal((48, 32)).astype(ml_dtypes.bfloat16)
    r = WeightReader(save(tmp_path, {"w": w}))
    host = r.host_bf16("w", (48, 32))
    assert host.dtype == np.uint16 and host.shape == (48, 32)
    np.testing.assert_array_equal(host, w.view(np.uint16))
    assert not host.flags.owndata and not host.flags.writeable
    mm = r._maps[r.info("w").file]
    assert np.shares_memory(host, mm)  # a view into the file's one memory map, not a copy
    assert r.dtype("w") == "BF16" and r.shape("w") == (48, 32)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_f16_f32_are_rounded_to_bf16(tmp_path, rng, dtype):
    w = rng.standard_normal((16, 40)).astype(dtype)
    r = WeightReader(save(tmp_path, {"w": w}))
    want = w.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)    # ml_dtypes' round to nearest even
    np.testing.assert_array_equal(r.host_bf16("w", (16, 40)), want)
    assert r.dtype("w") == ("F16" if dtype == np.float16 else "F32")


def test_f32_rounds_to_nearest_even(tmp_path):
    # 1 + 2^-8 lies halfway between bf16 1.0 (0x3F80) and 1 + 2^-7 (0x3F81): ties go to the even 0x3F80;
    # 1 + 3*2^-8 lies halfway between 0x3F81 and 0x3F82: ties go to 0x3F82.  1 + 2^-8 + 2^-20 rounds up.
    w = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -2.0], np.float32)
    r = WeightReader(save(tmp_path, {"w": w}))
    np.testing.assert_array_equal(r.host_bf16("w"), np.array([0x3F80, 0x3F82, 0x3F81, 0xC000], np.uint16))


def test_unsupported_dtype_only_when_read(tmp_path):
    r = WeightReader(save(tmp_path, {"ids": np.arange(6, dtype=np.int64), "w": np.ones(4, np.float32)}))
    assert set(r.names()) == {"ids", "w"} and r.dtype("ids") == "I64"
    with pytest.raises(WeightError, match="'ids' in model.safetensors has dtype I64"):
        r.host_bf16("ids")
    assert r.host_bf16("w").tolist() == [0x3F80] * 4


# --------------------------------------------------------------------------------------------------- files
def test_sharded_with_index_matches_single_file(tmp_path):
    one = write_random_qwen3(tmp_path / "one", seed=3)
    three = write_random_qwen3(tmp_path / "three", seed=3, shards=3)
    r1, r3 = WeightReader(one), WeightReader(three)
    assert [f.name for f in r3.files] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert r3.index is not None and sorted(r1.names()) == sorted(r3.names())
    shapes = qwen3_tensor_shapes(json.loads((one / "config.json").read_text()), tie=True)
    assert sorted(r1.names()) == sorted(shapes)
    for name, shape in shapes.items():
        np.testing.assert_array_equal(r1.host_bf16(name, shape), r3.host_bf16(name, shape))
    assert sorted(list_tensor_names(three)) == sorted(shapes)
    assert len({r3.info(n).file for n in r3.names()}) == 3


def test_shards_without_index_are_globbed(tmp_path):
    folder = write_random_qwen3(tmp_path, seed=1, shards=2)
    os.remove(folder / "model.safetensors.index.json")
    r = WeightReader(folder)
    assert r.index is None and len(r.files) == 2 and r.has("model.norm.weight")
    assert r.prefix == "model."


def test_index_lists_a_missing_shard(tmp_path):
    folder = write_random_qwen3(tmp_path, seed=1, shards=2)
    os.remove(folder / "model-00002-of-00002.safetensors")
    with pytest.raises(WeightError, match="lists model-00002-of-00002.safetensors, which is missing"):
        WeightReader(folder)


def test_no_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(WeightError, match=r"no \*.safetensors weights .*found pytorch_model.bin"):
        WeightReader(tmp_path)


def test_missing_tensor_names_it_and_the_files(tmp_path):
    r = WeightReader(write_random_qwen3(tmp_path, seed=0, shards=2))
    with pytest.raises(WeightError) as e:
        r.host_bf16("model.layers.0.self_attn.q_proj.weights")
    msg = str(e.value)
    assert "'model.layers.0.self_attn.q_proj.weights' not found" in msg
    assert "model-00001-of-00002.safetensors" in msg and str(tmp_path) in msg
    assert "closest: 'model.layers.0.self_attn.q_proj.weight'" in msg


def test_wrong_shape_names_both_shapes(tmp_path):
    r = WeightReader(save(tmp_path, {"model.norm.weight": np.ones(64, np.float32)}))
    with pytest.raises(WeightError, match=r"'model.norm.weight' .*has shape \[64\], expected \[128\]"):
        r.upload("model.norm.weight", (128,))


# --------------------------------------------------------------------------------------------------- corrupt
def _valid_file(tmp_path):
    return save(tmp_path, {"a": np.arange(8, dtype=np.float32), "b": np.ones((2, 3), np.float32)}) / \
        "model.safetensors"


def _rewrite_header(path, header: bytes, n=None):
    data = path.read_bytes()
    old_n = int.from_bytes(data[:8], "little")
    n = len(header) if n is None else n
    path.write_bytes(n.to_bytes(8, "little") + header + data[8 + old_n:])


@pytest.mark.parametrize("damage,match", [
    ("tiny", "the file is only 3 bytes"),
    ("huge_length", "header length .* does not fit"),
    ("not_json", "header is not valid JSON"),
    ("truncated", "tensor 'b' ends at data byte"),
    ("bad_entry", "bad header entry for 'a'"),
    ("size_mismatch", r"tensor 'a' is 32 bytes, but F32 \[9\] needs 36"),
])
def test_corrupt_files(tmp_path, damage, match):
    path = _valid_file(tmp_path)
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    if damage == "tiny":
        path.write_bytes(b"abc")
    elif damage == "huge_length":
        _rewrite_header(path, b"{}", n=10 ** 12)
    elif damage == "not_json":
        _rewrite_header(path, b"{\"a\": [1, 2")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-4])
    elif damage == "bad_entry":
        header["a"]["data_offsets"] = [8, 4]
        _rewrite_header(path, json.dumps(header).encode())
    elif damage == "size_mismatch":
        header["a"]["shape"] = [9]
        _rewrite_header(path, json.dumps(header).encode())
    with pytest.raises(WeightError) as e:
        WeightReader(tmp_path)
    msg = str(e.value)
    assert "model.safetensors" in msg and "truncated or corrupt" in msg and "re-download" in msg
    import re
    assert re.search(match, msg), msg


def test_read_header_offsets_are_absolute(tmp_path):
    path = _valid_file(tmp_path)
    info = read_header(path)
    n = int.from_bytes(path.read_bytes()[:8], "little")
    raw = path.read_bytes()
    a = np.frombuffer(raw[info["a"].begin:info["a"].end], np.float32)
    assert info["a"].begin >= 8 + n and a.tolist() == list(range(8))


# --------------------------------------------------------------------------------------------------- device
def test_upload_new_array_and_into_slices(tmp_path, rng):
    q = rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((2, 8)).astype(np.float32)
    v = rng.standard_normal((2, 8)).astype(np.float16)
    r = WeightReader(save(tmp_path, {"q": q, "k": k, "v": v}))
    dq = r.upload("q", (4, 8))
    np.testing.assert_array_equal(dq.copy_to_host(), q.view(np.uint16))
    qkv = cuda.device_array((8, 8), np.uint16)
    r.upload("q", (4, 8), dest=qkv[0:4])
    r.upload("k", (2, 8), dest=qkv[4:6])
    r.upload("v", (2, 8), dest=qkv[6:8])
    expect = np.concatenate([q.view(np.uint16), k.astype(ml_dtypes.bfloat16).view(np.uint16),
                             v.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)])
    np.testing.assert_array_equal(qkv.copy_to_host(), expect)
    np.testing.assert_allclose(from_bf16_bits(qkv.copy_to_host()[4:6]), k, rtol=1e-2)
    with pytest.raises(ValueError, match="destination"):
        r.upload("k", (2, 8), dest=qkv[0:3])


def test_upload_counts_progress(tmp_path):
    folder = write_random_qwen3(tmp_path, seed=0)
    out = io.StringIO()
    with WeightReader(folder, progress=Progress(verbose=True, stream=out)) as r:
        r.progress.total_bytes = r.bf16_nbytes(r.names())
        r.progress.total_tensors = len(r.names())
        for n in r.names():
            r.upload(n)
    assert r.progress.bytes == r.progress.total_bytes == sum(2 * r.info(n).numel for n in r.names())
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and f"{len(r.names())} tensors" in lines[0] and "MB/s" in lines[0]


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_updates_one_line():
    out = _Tty()
    p = Progress(total_bytes=4_000_000, total_tensors=2, stream=out)
    p.update(2_000_000)
    p._last_draw = 0.0  # do not wait for the 0.1 s redraw throttle
    p.update(2_000_000)
    p.finish()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n") and text.count("\r") >= 2
    assert "2/2 tensors" in text and "(100%)" in text
    quiet = io.StringIO()
    Progress(stream=quiet).finish()
    assert quiet.getvalue() == ""  # not a terminal, not verbose: silent


# --------------------------------------------------------------------------------------------------- helpers
def test_prefix_for():
    assert prefix_for(["model.language_model.embed_tokens.weight", "model.visual.x", "lm_head.weight"]) == \
        "model.language_model."
    assert prefix_for(["model.embed_tokens.weight", "model.norm.weight"]) == "model."
    with pytest.raises(WeightError, match="model.embed_tokens.weight"):
        prefix_for(["encoder.weight"])


def test_check_gpu_memory():
    check_gpu_memory(10 * 2 ** 30, "the weights", free_bytes=11 * 2 ** 30)
    with pytest.raises(OutOfMemoryError) as e:
        check_gpu_memory(int(9.5 * 2 ** 30), "the KV cache (4096 tokens)", free_bytes=2 ** 30)
    assert str(e.value) == ("needs 9.50 GiB for the KV cache (4096 tokens), only 1.00 GiB free on the GPU: "
                            "lower --max-model-len or use a larger GPU")
    if pegainfer.SIMULATOR:
        check_gpu_memory(10 ** 15, "anything")  # the simulator has no memory limit to check
