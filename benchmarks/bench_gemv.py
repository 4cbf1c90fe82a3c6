"""How close do pegainfer's matrix products come to the H200?

* Weight streaming (decode and short prompts): for each Qwen3-4B projection at T = 1 (batch-1 decode) and T = 16
  (a 16-token prompt or batch), the time of one launch of every implementation that reads the weight once (the
  GEMV, the skinny tensor-core kernel; at T = 16 also the tiled mma GEMM), with ``*`` on what ``linear(impl=None)``
  picks, the bandwidth achieved against a bare 16-byte-load read kernel over 2 GB (``kernels.memory``), and the
  sum over one forward step (36 layers + lm_head).  Times come from replaying a CUDA graph of ``--launches``
  launches (one launch of a 10 µs kernel costs ~20 µs of host time: eager timing would measure Python).
* GEMM (prefill): TFLOP/s of the tensor-core path (optionally the FMA tiles, and cuBLAS through torch as a
  yardstick) at T = 128 and 2048.
* ``--sweep`` (a few minutes): every GEMV geometry (rows per warp × warps × k_split) at T = 1, every skinny
  geometry (n_tiles × unroll × warps × k_split) at T = 1 and 16, and tensor-core tile shapes at T = 2048; prints
  the best per shape in the form of ``GEMV_TUNED`` / ``SKINNY_TUNED`` entries.

Usage (on the GPU host):  python benchmarks/bench_gemv.py [--json out.json] [--sweep] [--fma] [--torch]
Without a GPU it runs as a smoke test in the simulator (shapes divided by 256, wall-clock times, no graphs).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import pegainfer
from graph_timing import time_calls
from pegainfer.kernels import linear as lin
from numba import cuda

SIM = pegainfer.SIMULATOR
SHRINK = 256 if SIM else 1

# (name, N rows, K, gated) — Qwen3-4B: hidden 2560, q 32×128, kv 8×128, intermediate 9728, vocab 151936
SHAPES = [
    ("qkv", 6144, 2560, False),
    ("o", 2560, 4096, False),
    ("gate_up+silu", 19456, 2560, True),
    ("down", 2560, 9728, False),
    ("lm_head", 151936, 2560, False),
]
LAYERS = 36


def time_per_launch(fn, launches: int, reps: int = 5) -> float:
    """Seconds per call of ``fn``: median over ``reps`` replays of a CUDA graph holding ``launches`` calls."""
    return time_calls([fn] * launches, reps)


def launches_for(fn, target_s: float, cap: int) -> int:
    """Enough launches that one graph replay lasts about ``target_s`` (at least 3, at most ``cap``)."""
    if SIM:
        return 1
    fn()
    cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    cuda.synchronize()
    return int(max(3, min(cap, target_s / max(time.perf_counter() - t0, 1e-6))))


def random_bf16(shape, rng) -> object:
    """Device array of bf16 bits with values in ±[2^-7, 1) (the timing does not depend on them)."""
    bits = rng.integers(0x3C00, 0x3F80, size=shape, dtype=np.uint16)
    bits |= (rng.integers(0, 2, size=shape, dtype=np.uint16) << np.uint16(15))
    return cuda.to_device(bits)


def read_bandwidth() -> float:
    if SIM:
        return float("nan")
    from pegainfer.kernels.memory import measure_read_bandwidth
    return measure_read_bandwidth(2 << 30)


def geometry_text(impl: str, n: int, k: int, T: int, gated: bool) -> str:
    if impl == "gemv":
        g = lin.gemv_geometry(n, k, min(T, lin.GEMV_MAX_TOKENS), gated)
        return (f"rows={g.rows_per_warp} warps={g.warps} k_split={g.k_split} tt={g.max_tokens} stage_x={g.stage_x} "
                f"k_chunk={lin._gemv_k_chunk(k, g)}" + (f" ({-(-T // g.max_tokens)} passes)" if T > g.max_tokens else ""))
    if impl == "skinny":
        g = lin.skinny_geometry(n, k, T, gated)
        return f"n_tiles={g.n_tiles} unroll={g.unroll} warps={g.warps} k_split={g.k_split} wps={g.warps_per_sm}"
    if impl == "gemm_mma":
        return f"tile={lin.mma_tile(T, n)}"
    return ""


def op_fn(x, w, out, gated, impl, geometry=None):
    """A no-argument function running one projection (``linear`` / ``linear_silu_mul`` or a forced geometry)."""
    if geometry is not None:
        if impl == "gemv":
            return lambda: lin.gemv(x, w, out, gated=gated, geometry=geometry)
        return lambda: lin.linear_skinny(x, w, out, gated=gated, geometry=geometry)
    op = lin.linear_silu_mul if gated else lin.linear
    return lambda: op(x, w, out, impl=impl)


DECODE_IMPLS = {1: ("gemv", "skinny"), 16: ("skinny", "gemv", "gemm_mma")}


def bench_decode(weights, rng, read_bw, launches, rows) -> list[dict]:
    """T = 1 (batch-1 decode) and T = 16 (a 16-token prompt / batched decode): every shape with every
    weight-streaming implementation; ``default`` marks what ``linear(impl=None)`` takes."""
    for T, impls in DECODE_IMPLS.items():
        for name, (w, n, k, gated) in weights.items():
            n_out = n // 2 if gated else n
            x = random_bf16((T, k), rng)
            out = cuda.device_array((T, n_out), np.uint16)
            default = lin.default_impl(T)
            for impl in impls + ((default,) if default not in impls else ()):
                sec = time_per_launch(op_fn(x, w, out, gated, impl), launches)
                nbytes = n * k * 2 + T * (k + n_out) * 2
                rows.append(dict(kind="decode", name=name, N=n, K=k, T=T, impl=impl, default=impl == default,
                                 us=sec * 1e6, GBps=nbytes / sec / 1e9,
                                 pct_of_read=100 * nbytes / sec / read_bw if read_bw == read_bw else None,
                                 geometry=geometry_text(impl, n, k, T, gated)))
    return rows


def print_decode(rows, launches) -> dict:
    print(f"\nWeight-streaming projections (CUDA graph of {launches} launches; bytes = weight + x + out; "
          f"* = linear(impl=None))")
    print(f"{'shape':14s} {'N':>7s} {'K':>6s} {'T':>3s} {'impl':>9s} {'us':>9s} {'GB/s':>7s} {'% read':>7s}  geometry")
    for r in rows:
        pct = f"{r['pct_of_read']:6.1f}%" if r["pct_of_read"] is not None else "     - "
        mark = "*" if r["default"] else " "
        print(f"{r['name']:14s} {r['N']:7d} {r['K']:6d} {r['T']:3d} {mark}{r['impl']:>8s} {r['us']:9.1f} "
              f"{r['GBps']:7.0f} {pct}  {r['geometry']}")
    sums = {}
    print(f"\nprojections per forward step (Qwen3-4B: {LAYERS} layers × (qkv + o + gate_up + down) + lm_head)")
    for T, impls in DECODE_IMPLS.items():
        for impl in ("default",) + impls:
            if not any(r["T"] == T and r["impl"] == impl for r in rows) and impl != "default":
                continue
            sel = [r for r in rows if r["T"] == T and (r["default"] if impl == "default" else r["impl"] == impl)]
            layer = sum(r["us"] for r in sel if r["name"] != "lm_head")
            head = sum(r["us"] for r in sel if r["name"] == "lm_head")
            ms = (LAYERS * layer + head) / 1e3
            sums[f"T{T}_{impl}"] = ms
            print(f"  T={T:2d} {impl:9s}: {layer:7.1f} us/layer × {LAYERS} + lm_head {head:6.1f} us = {ms:6.2f} ms "
                  f"per step ({ms / T:6.3f} ms/token)")
    return sums


def bench_gemm(weights, rng, impls, use_torch, rows) -> list[dict]:
    torch = None
    if use_torch and not SIM:
        import torch  # noqa: F811  (only as a yardstick: cuBLAS through torch)
    for name, (w, n, k, gated) in weights.items():
        n_out = n // 2 if gated else n
        for T in (128, 2048):
            T = max(1, T // SHRINK) if SIM else T
            x = random_bf16((T, k), rng)
            out = cuda.device_array((T, n_out), np.uint16)
            flops = 2.0 * T * n * k
            for impl in impls:
                op = lin.linear_silu_mul if gated else lin.linear
                fn = (lambda x=x, w=w, out=out, op=op, impl=impl: op(x, w, out, impl=impl))
                sec = time_per_launch(fn, launches_for(fn, 0.05, 50))
                rows.append(dict(kind="gemm", name=name, N=n, K=k, T=T, impl=impl, us=sec * 1e6,
                                 TFLOPs=flops / sec / 1e12))
            if torch is not None:
                tx = torch.randn(T, k, device="cuda", dtype=torch.bfloat16)
                tw = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                torch.matmul(tx, tw.T)
                torch.cuda.synchronize()
                reps = 20
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(reps):
                    torch.matmul(tx, tw.T)
                e.record()
                e.synchronize()
                sec = s.elapsed_time(e) * 1e-3 / reps
                rows.append(dict(kind="gemm", name=name, N=n, K=k, T=T, impl="torch_cublas", us=sec * 1e6,
                                 TFLOPs=flops / sec / 1e12))
                del tx, tw
    return rows


def sweep_gemv(weights, rng, rows) -> list[dict]:
    """Every GEMV geometry per shape at T = 1; prints the best of each shape as a ``GemvGeometry`` to paste."""
    for name, (w, n, k, gated) in weights.items():
        x = random_bf16((1, k), rng)
        out = cuda.device_array((1, n // 2 if gated else n), np.uint16)
        results = []
        for r, stage_x in ((1, True), (2, True), (4, True), (8, True), (2, False), (4, False)):
            if gated and r % 2:
                continue
            for warps in (4, 8, 16):
                for k_split in (1, 2, 4, 8):
                    if warps % k_split or (k_split > 1 and k // k_split < 512):
                        continue
                    geo = lin.GemvGeometry(rows_per_warp=r, warps=warps, k_split=k_split, max_tokens=1,
                                           stage_x=stage_x)
                    fn = (lambda x=x, w=w, out=out, gated=gated, geo=geo:
                          lin.gemv(x, w, out, gated=gated, geometry=geo))
                    sec = time_per_launch(fn, 30, reps=3)
                    results.append((sec, geo))
                    rows.append(dict(kind="gemv_sweep", name=name, N=n, K=k, T=1, us=sec * 1e6,
                                     GBps=n * k * 2 / sec / 1e9, rows_per_warp=r, warps=warps, k_split=k_split,
                                     stage_x=stage_x))
        best_sec, best = min(results, key=lambda p: p[0])
        default = lin.gemv_geometry(n, k, 1, gated)
        default_sec = next((sec for sec, g in results if g == default), float("nan"))
        print(f"  {name:13s} best {best_sec * 1e6:7.1f} us {n * k * 2 / best_sec / 1e9:6.0f} GB/s   default "
              f"{default_sec * 1e6:7.1f} us   ({n}, {k}, 1, {gated}): GemvGeometry(rows_per_warp="
              f"{best.rows_per_warp}, warps={best.warps}, k_split={best.k_split}, max_tokens=1, stage_x={best.stage_x})",
              flush=True)
    return rows


SKINNY_SWEEP = [(1, 4), (2, 2), (2, 4), (4, 1), (4, 2)]
"""(n_tiles, unroll) pairs the skinny sweep tries, each with 4 and 8 warps per block and k_split 1..8."""


def sweep_skinny(weights, rng, rows) -> list[dict]:
    """Skinny-kernel geometries per shape at T = 1 and T = 16; prints the best as a ``SKINNY_TUNED`` entry."""
    for T in (1, 16):
        for name, (w, n, k, gated) in weights.items():
            x = random_bf16((T, k), rng)
            out = cuda.device_array((T, n // 2 if gated else n), np.uint16)
            results = []
            for nt, unroll in SKINNY_SWEEP:
                for warps in (4, 8):
                    for k_split in (1, 2, 4, 8):
                        if warps % k_split or (k_split > 1 and k // k_split < 32 * unroll * 4):
                            continue
                        geo = lin.SkinnyGeometry(n_tiles=nt, unroll=unroll, warps=warps, k_split=k_split)
                        sec = time_per_launch(op_fn(x, w, out, gated, "skinny", geo), 30, reps=3)
                        results.append((sec, geo))
                        rows.append(dict(kind="skinny_sweep", name=name, N=n, K=k, T=T, us=sec * 1e6,
                                         GBps=n * k * 2 / sec / 1e9, n_tiles=nt, unroll=unroll, warps=warps,
                                         k_split=k_split))
            best_sec, best = min(results, key=lambda p: p[0])
            default = lin.skinny_geometry(n, k, T, gated)
            default_sec = next((sec for sec, g in results if g == default), float("nan"))
            print(f"  T={T:2d} {name:13s} best {best_sec * 1e6:7.1f} us {n * k * 2 / best_sec / 1e9:6.0f} GB/s   "
                  f"default {default_sec * 1e6:7.1f} us   ({n}, {k}, {-(-T // 16)}, {gated}): SkinnyGeometry("
                  f"n_tiles={best.n_tiles}, unroll={best.unroll}, warps={best.warps}, k_split={best.k_split})",
                  flush=True)
    return rows


MMA_TILES = [(2, 4, 2, 4), (2, 4, 4, 4), (2, 2, 2, 4), (1, 4, 2, 4), (4, 2, 2, 2), (2, 2, 4, 4)]


def sweep_mma(weights, rng, rows) -> list[dict]:
    """The tensor-core GEMM's tile shapes (warps_m, warps_n, mt, nt) at T = 2048 on every shape."""
    for name, (w, n, k, gated) in weights.items():
        T = 2048 // SHRINK
        x = random_bf16((T, k), rng)
        out = cuda.device_array((T, n // 2 if gated else n), np.uint16)
        line = []
        for tile in MMA_TILES:
            fn = (lambda x=x, w=w, out=out, gated=gated, tile=tile: lin.gemm_mma(x, w, out, gated=gated, tile=tile))
            sec = time_per_launch(fn, launches_for(fn, 0.05, 20), reps=3)
            tflops = 2.0 * T * n * k / sec / 1e12
            rows.append(dict(kind="mma_sweep", name=name, N=n, K=k, T=T, tile=tile, us=sec * 1e6, TFLOPs=tflops))
            line.append(f"{tile}: {tflops:5.1f}")
        print(f"  {name:13s} TFLOP/s  " + "  ".join(line), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--launches", type=int, default=50, help="launches per CUDA graph for T = 1 / 16 (default 50)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time every GEMV geometry and several mma tiles (a few minutes)")
    ap.add_argument("--fma", action="store_true", help="also time the FMA-tiled GEMM")
    ap.add_argument("--torch", action="store_true", help="also time torch.matmul (cuBLAS) as a yardstick")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    print(pegainfer.device.describe(), flush=True)
    if SIM:
        print(f"smoke run: shapes divided by {SHRINK}, wall-clock times (meaningless), no CUDA graphs", flush=True)
    rng = np.random.default_rng(0)
    weights = {}
    for name, n, k, gated in SHAPES:
        n, k = max(16, n // SHRINK), max(64, k // SHRINK // 8 * 8)
        weights[name] = (random_bf16((n, k), rng), n, k, gated)

    read_bw = read_bandwidth()
    print(f"read bandwidth (16-byte loads over 2 GB): {read_bw / 1e9:.0f} GB/s", flush=True)

    rows: list[dict] = bench_decode(weights, rng, read_bw, args.launches, [])
    sums = print_decode(rows, args.launches)
    decode_ms = sums["T1_default"]

    impls = ["gemm_mma"] + (["gemm_fma"] if args.fma else [])
    print("\nGEMM (prefill) ...", flush=True)
    gemm_rows = bench_gemm(weights, rng, impls, args.torch, [])
    print("\nGEMM (prefill)")
    print(f"{'shape':14s} {'N':>7s} {'K':>6s} {'T':>5s} {'impl':>13s} {'us':>10s} {'TFLOP/s':>8s}")
    for r in gemm_rows:
        print(f"{r['name']:14s} {r['N']:7d} {r['K']:6d} {r['T']:5d} {r['impl']:>13s} {r['us']:10.1f} "
              f"{r['TFLOPs']:8.1f}")
    rows += gemm_rows

    if args.sweep:
        print("\nGEMV geometry sweep (T = 1)", flush=True)
        rows += sweep_gemv(weights, rng, [])
        print("\nskinny tensor-core geometry sweep (T = 1, 16)", flush=True)
        rows += sweep_skinny(weights, rng, [])
        print(f"\nmma tile sweep (T = {2048 // SHRINK}; (warps_m, warps_n, mt, nt))", flush=True)
        rows += sweep_mma(weights, rng, [])

    result = dict(device=pegainfer.device.describe(), read_bw_GBps=read_bw / 1e9,
                  decode_projection_ms_per_token=decode_ms, step_ms=sums, rows=rows, seconds=time.perf_counter() - t_start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")
    print(f"done in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
