"""How fast is pegainfer's paged attention, decode and prefill, and which split / tile geometry should it take?

* Decode (batch 1, the split-K path as a decode step runs it: one launch, the last block of each kv head merges the
  splits): time per call and the bandwidth it reaches reading the K/V of the context, for contexts 512, 4096 and
  32768, with Qwen3-4B shapes (32 q / 8 kv heads x 128) and Qwen3.5's full-attention shapes (16 / 4 x 256), page
  size 16, pages shuffled, ``max_model_len`` 32768 (which, with T, fixes the number of splits).  Each "layer" has
  its own cache, and a CUDA graph replays calls round-robin over enough layers (>= 256 MB of K/V) that the K/V
  comes from HBM, not from the 50 MB L2 -- as in a real decode step.
* Prefill: one 2048-token prompt (positions 0..2047, one slot), tiled tensor-core kernel and, for reference, the
  split-K kernel; causal TFLOP/s, and the relative L2 difference between the two paths' outputs as a sanity check.
* ``--sweep`` (minutes: each geometry is a compile): decode geometries (warps per block, warp pairs over the head
  dims), split counts and minimum split sizes, prefill tile shapes, and the split-vs-tiled crossover
  for chunks of T tokens after a 4096-token prefix -- the numbers behind the split geometry, ``SPLIT_TARGET_ROWS``
  / ``MIN_SPLIT_TOKENS``, the prefill geometry and ``PREFILL_MIN_TOKENS``.

Times come from CUDA-graph replays (an eager numba launch costs ~20 us of host time, more than the kernels).
Without a GPU it runs as a smoke test in the simulator (tiny shapes, wall-clock times, no graphs).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_timing  # noqa: E402  (puts the checkout on sys.path)
from graph_timing import time_calls  # noqa: E402

import numpy as np  # noqa: E402

import pegainfer  # noqa: E402

SIM = pegainfer.SIMULATOR
PAGE = 16
MAX_MODEL_LEN = 32768
MODELS = {"qwen3-4b": (32, 8, 128), "qwen3.5-full": (16, 4, 256)}
CONTEXTS = (512, 4096, 32768)
PREFILL_T = 2048
HBM_SET_BYTES = 256 << 20      # K/V bytes cycled through per graph, > 5x the H200's L2
if SIM:
    PAGE, MAX_MODEL_LEN, CONTEXTS, PREFILL_T, HBM_SET_BYTES = 4, 64, (9, 40), 24, 0
    MODELS = {"tiny": (4, 2, 32)}


def attention_api() -> SimpleNamespace:
    """The ``pegainfer.kernels.attention`` names this script uses.  Beyond the public ``paged_attention``,
    ``attention_workspace_size``, ``attention_num_splits`` and the split constants, the sweep forces geometries
    through the launchers and pickers behind ``paged_attention`` (``paged_attention_split`` /
    ``paged_attention_prefill`` with ``geometry=``, ``split_geometry``, ``prefill_geometry``), found wherever the
    package keeps them (``graph_timing.kernel_name``, underscore or not)."""
    pkg = "pegainfer.kernels.attention"
    find = lambda *names: graph_timing.kernel_name(pkg, *names)  # noqa: E731
    return SimpleNamespace(
        paged_attention=find("paged_attention"), workspace_size=find("attention_workspace_size"),
        num_splits=find("attention_num_splits"), min_split_tokens=find("MIN_SPLIT_TOKENS"),
        min_split_tokens_wide=find("MIN_SPLIT_TOKENS_WIDE"),
        split=find("paged_attention_split", "_paged_attention_split"),
        prefill=find("paged_attention_prefill", "_paged_attention_prefill"),
        split_geometry=find("split_geometry", "_split_geometry"),
        prefill_geometry=find("prefill_geometry", "_prefill_geometry"))


A = None   # attention_api(), set by main


def min_chunk(min_split_tokens, D) -> int:
    """Fewest keys a split covers (the forced value, else the kernel's default for this head width)."""
    if min_split_tokens is None:
        min_split_tokens = A.min_split_tokens_wide if D > 128 else A.min_split_tokens
    return max(1, min_split_tokens)


def random_bf16(shape, rng):
    """Device bf16 bits of N(0, 1) values (rounded), so that softmax sees realistic, non-degenerate scores."""
    from numba import cuda
    bits = (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return cuda.to_device(bits)


class Layers:
    """``n`` independent K/V caches holding one slot of ``ctx`` tokens on shuffled pages, one block table."""

    def __init__(self, n, ctx, nkv, D, rng):
        from numba import cuda
        pages = -(-ctx // PAGE)
        self.k = [random_bf16((pages, PAGE, nkv, D), rng) for _ in range(n)]
        self.v = [random_bf16((pages, PAGE, nkv, D), rng) for _ in range(n)]
        table = np.zeros((1, MAX_MODEL_LEN // PAGE), np.int32)
        table[0, :pages] = rng.permutation(pages)
        self.tables = cuda.to_device(table)
        self.n = n


_LAYERS: dict = {}


def layers_for(ctx, nkv, D, rng, cap=128):
    """The K/V caches of one (context, shape), built once and reused by every decode measurement (random data for
    256 MB takes seconds on the host)."""
    key = (ctx, nkv, D)
    if key not in _LAYERS:
        kv_bytes = 2 * ctx * nkv * D * 2
        n = 1 if SIM else int(min(cap, max(2, math.ceil(HBM_SET_BYTES / kv_bytes))))
        _LAYERS[key] = Layers(n, ctx, nkv, D, rng)
    return _LAYERS[key]


def bench_decode(rng, read_bw, rows, geometry=None, num_splits=None, min_split_tokens=None, models=None,
                 contexts=CONTEXTS, label="decode", quiet=False):
    from numba import cuda
    for model, (nq, nkv, D) in (models or MODELS).items():
        ws = cuda.device_array(A.workspace_size(1, nq, D, MAX_MODEL_LEN, PAGE, num_splits=num_splits), np.float32)
        q = random_bf16((1, nq, D), rng)
        out = cuda.device_array((1, nq, D), np.uint16)
        slots = cuda.to_device(np.zeros(1, np.int32))
        for ctx in contexts:
            L = layers_for(ctx, nkv, D, rng)
            pos = cuda.to_device(np.array([ctx - 1], np.int32))

            def call(i):
                if geometry is None:        # the public entry point, as a decode step calls it
                    return lambda: A.paged_attention(q, L.k[i], L.v[i], L.tables, slots, pos, out, 1 / math.sqrt(D),
                                                     ws, num_splits=num_splits, min_split_tokens=min_split_tokens,
                                                     method="split", decode=True)
                return lambda: A.split(q, L.k[i], L.v[i], L.tables, slots, pos, out, 1 / math.sqrt(D), ws,
                                       num_splits=num_splits, min_split_tokens=min_split_tokens, geometry=geometry,
                                       decode=True)

            calls = [call(i % L.n) for i in range(max(L.n, 1 if SIM else 64))]
            sec = time_calls(calls)
            kv_bytes = 2 * ctx * nkv * D * 2
            splits = num_splits or A.num_splits(1, nq, MAX_MODEL_LEN, PAGE, D)
            least = min_chunk(min_split_tokens, D)
            chunk = -(-(-(-ctx // splits)) // least) * least
            row = dict(kind=label, model=model, nq=nq, nkv=nkv, D=D, ctx=ctx, splits=splits,
                       active_splits=-(-ctx // chunk), min_split_tokens=least,
                       geometry=list(geometry or A.split_geometry(D, nq // nkv)), layers=L.n, us=sec * 1e6,
                       GBps=kv_bytes / sec / 1e9, pct_of_read=100 * kv_bytes / sec / read_bw if read_bw else None)
            rows.append(row)
            if not quiet:
                print_decode_row(row)
    return rows


def print_decode_row(r):
    pct = f"{r['pct_of_read']:5.1f}%" if r["pct_of_read"] else "    - "
    print(f"  {r['kind']:7s} {r['model']:13s} ctx {r['ctx']:6d}  splits {r['active_splits']:3d}/{r['splits']:3d} "
          f"(min {r['min_split_tokens']:3d} keys)  geom {tuple(r['geometry'])}  {r['us']:9.2f} us  {r['GBps']:7.0f} GB/s  "
          f"{pct}", flush=True)


def prefill_inputs(rng, T, prefix, nq, nkv, D):
    from numba import cuda
    ctx = prefix + T
    L = Layers(1, ctx, nkv, D, rng)
    q = random_bf16((T, nq, D), rng)
    pos = cuda.to_device(np.arange(prefix, ctx, dtype=np.int32))
    slots = cuda.to_device(np.zeros(T, np.int32))
    ws = cuda.device_array(A.workspace_size(T, nq, D, MAX_MODEL_LEN, PAGE), np.float32)
    return L, q, pos, slots, ws


def causal_flops(T, prefix, nq, D):
    keys = sum(prefix + t + 1 for t in range(T))
    return 4.0 * nq * D * keys        # QK^T and PV, 2 flops per multiply-add


def bench_prefill(rng, rows, T=PREFILL_T, prefix=0, methods=("prefill", "split"), prefill_geometry=None,
                  label="prefill", models=None, quiet=False):
    from numba import cuda
    for model, (nq, nkv, D) in (models or MODELS).items():
        L, q, pos, slots, ws = prefill_inputs(rng, T, prefix, nq, nkv, D)
        outs = {}
        for method in methods:
            out = cuda.device_array((T, nq, D), np.uint16)
            if method == "prefill" and prefill_geometry is not None:
                fn = (lambda out=out, L=L: A.prefill(q, L.k[0], L.v[0], L.tables, slots, pos, out, 1 / math.sqrt(D),
                                                     geometry=prefill_geometry))
            else:
                fn = (lambda out=out, method=method, L=L: A.paged_attention(
                    q, L.k[0], L.v[0], L.tables, slots, pos, out, 1 / math.sqrt(D), ws, method=method))
            sec = time_calls([fn] * (1 if SIM else 5))
            outs[method] = out
            row = dict(kind=label, model=model, nq=nq, nkv=nkv, D=D, T=T, prefix=prefix, method=method,
                       geometry=list(prefill_geometry or A.prefill_geometry(D)) if method == "prefill" else None,
                       us=sec * 1e6, TFLOPs=causal_flops(T, prefix, nq, D) / sec / 1e12)
            rows.append(row)
        if "prefill" in outs and "split" in outs:
            a, b = (outs[m].copy_to_host().astype(np.uint32) << 16 for m in ("prefill", "split"))
            a, b = a.view(np.float32).astype(np.float64), b.view(np.float32).astype(np.float64)
            diff = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
            for r in rows[-len(methods):]:
                r["rel_l2_prefill_vs_split"] = diff
        if not quiet:
            for r in rows[-len(methods):]:
                print_prefill_row(r)
        del L
    return rows


def print_prefill_row(r):
    extra = f"  tiled-vs-split rel L2 {r['rel_l2_prefill_vs_split']:.1e}" if "rel_l2_prefill_vs_split" in r else ""
    print(f"  {r['kind']:9s} {r['model']:13s} T {r['T']:5d} prefix {r['prefix']:5d}  {r['method']:7s}"
          f"  geom {r['geometry']}  {r['us']:10.1f} us  {r['TFLOPs']:6.1f} TFLOP/s{extra}", flush=True)


def sweep(rng, read_bw, rows):
    q3 = {"qwen3-4b": MODELS["qwen3-4b"]} if not SIM else MODELS
    nq, nkv, D = next(iter(q3.values()))
    print("\ndecode geometry sweep (warps per block, warp pairs over the head dims; min split = 16 keys per warp "
          "or pair)", flush=True)
    if SIM:
        runs = [((2, False), MODELS), ((2, True), MODELS)]
    else:
        qwen35 = {"qwen3.5-full": MODELS["qwen3.5-full"]}
        runs = [((w, False), q3) for w in (2, 4, 8)] + [((w, True), qwen35) for w in (4, 8)]
    for geometry, models in runs:         # (warps, dim_split): attention.SplitGeometry's fields
        steps = geometry[0] // (2 if geometry[1] else 1)
        bench_decode(rng, read_bw, rows, geometry=geometry, min_split_tokens=16 * steps, models=models,
                     label="sweep-g")
    print("\ndecode split sweep (default warps)", flush=True)
    for splits in ((16, 32, 64, 128, 256) if not SIM else (2, 4)):
        for min_tokens in ((32, 64, 128) if not SIM else (4,)):
            bench_decode(rng, read_bw, rows, num_splits=splits, min_split_tokens=min_tokens, models=q3,
                         contexts=CONTEXTS, label="sweep-s", quiet=True)
    best = {}
    for r in rows:
        if r["kind"] == "sweep-s" and (r["ctx"] not in best or r["us"] < best[r["ctx"]]["us"]):
            best[r["ctx"]] = r
    for r in best.values():
        print(f"  best {r['ctx']:6d}: splits {r['splits']:3d} min {r['min_split_tokens']:3d}  {r['us']:8.2f} us  "
              f"{r['GBps']:6.0f} GB/s")
    print("\nprefill tile sweep (warps, keys per tile, Q in registers)", flush=True)
    for warps in ((4, 8) if not SIM else (1, 2)):
        for bk in ((32, 64) if not SIM else (16, 32)):
            bench_prefill(rng, rows, methods=("prefill",), prefill_geometry=(warps, bk, D <= 128), models=q3,
                          label="sweep-p")
    print("\nsplit vs tiled for a chunk of T tokens after a 4096-token prefix", flush=True)
    for T in ((16, 32, 64, 128, 256, 512) if not SIM else (4, 8)):
        bench_prefill(rng, rows, T=T, prefix=4096 if not SIM else 16, models=q3, label="crossover")
    return rows


def main(argv=None) -> int:
    global A
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--sweep", action="store_true", help="also sweep geometries / splits / crossover (minutes)")
    args = ap.parse_args(argv)
    A = attention_api()
    t_start = time.perf_counter()
    print(pegainfer.device.describe(), flush=True)
    if SIM:
        print("smoke run: tiny shapes, wall-clock times (meaningless), no CUDA graphs", flush=True)
        read_bw = 0.0
    else:
        from pegainfer.kernels.memory import measure_read_bandwidth
        read_bw = measure_read_bandwidth(2 << 30)
        print(f"read bandwidth (16-byte loads over 2 GB): {read_bw / 1e9:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    print(f"\ndecode, batch 1 (split-K, combine fused; bytes = K + V of the context; page {PAGE}, "
          f"max_model_len {MAX_MODEL_LEN})", flush=True)
    bench_decode(rng, read_bw, rows)
    print(f"\nprefill, one {PREFILL_T}-token prompt (causal TFLOP/s)", flush=True)
    bench_prefill(rng, rows)
    if args.sweep:
        sweep(rng, read_bw, rows)
    result = dict(device=pegainfer.device.describe(), read_bw_GBps=read_bw / 1e9, page_size=PAGE,
                  max_model_len=MAX_MODEL_LEN, rows=rows, seconds=time.perf_counter() - t_start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")
    print(f"done in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
