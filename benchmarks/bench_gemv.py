"""How close do pegainfer's weight projections come to the GPU's read bandwidth, and which geometry should each
shape take on this GPU?

Default (L2-warm: one matrix launched again and again; Qwen3-4B's shapes):
* weight streaming at T = 1 (batch-1 decode) and T = 16 (a 16-token prompt or batch): one launch of every
  implementation that reads the weight once (the GEMV, the skinny tensor-core kernel; at T = 16 also the tiled mma
  GEMM), ``*`` on what ``linear(impl=None)`` picks, GB/s against a bare 16-byte-load read kernel over 2 GB, and the
  sum over one forward step (36 layers + lm_head);
* prefill: TFLOP/s of the tensor-core GEMM at T = 128 and 2048 (``--fma``: the FMA tiles too; ``--torch``: cuBLAS
  through torch as a yardstick);
* ``--sweep`` (minutes): every GEMV geometry at T = 1, skinny geometries at T = 1 and 16, mma tiles at T = 2048.

``--cold`` (as in a real decode step: each layer's weights come from HBM once; ``--model 4b|8b|3.5-4b``):
* ``probe``: the bare read kernel over one buffer per layer of each matrix's size (what a kernel of that size can
  reach at all, ramp-up and tail included);
* ``sweep``: per projection (qkv / in_proj and gate_up with the fused residual add + RMSNorm, as the models run
  them), a graph of one launch per layer, each on its own matrix, for every candidate GEMV geometry (rows per
  warp, warps, k_split, load-ring depth); ``--tokens 2..16`` sweeps the skinny tensor-core kernel instead;
  ``--only qkv,o`` picks projections, ``--geometry o=2,4,4,6`` tries only the listed geometries;
* ``step``: the projection sequence of a whole step (L × (qkv, o, gate_up, down) + lm_head) in one graph, with
  the defaults and with the best swept geometries, against the floor (weight bytes / read bandwidth);
* ``--tuning-out FILE``: the best geometries as the JSON ``pegainfer.kernels.policy.load_tuning`` reads (the
  engine takes it as ``LaunchPolicy.tuning``; ``ab_policy.py --variant geo:tuning=FILE`` compares it).

Times come from CUDA-graph replays (one launch of a 10 µs kernel costs ~20 µs of host time).  Without a GPU both
modes run as smoke tests in the simulator (tiny shapes, wall-clock times, no sweeps).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
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
SHRINK = 256 if SIM else 1
LINEAR_NAMES = ("linear", "linear_silu_mul", "linear_add_rms_norm", "gemv", "GemvGeometry", "gemv_geometry",
                "GEMV_MAX_TOKENS", "default_impl", "SkinnyGeometry", "skinny_geometry", "linear_skinny", "gemm_mma",
                "mma_geometry", "MmaGeometry")


def linear_api() -> SimpleNamespace:
    """The ``pegainfer.kernels.linear`` names this script uses (``LINEAR_NAMES``), found through
    ``graph_timing.kernel_name``, plus ``fused_warps``: the warps of the fused add + RMSNorm GEMV's blocks (the
    norm's block size)."""
    ns = SimpleNamespace(**{n: graph_timing.kernel_name("pegainfer.kernels.linear", n) for n in LINEAR_NAMES})
    from pegainfer.kernels import norm
    ns.fused_warps = norm.BLOCK_THREADS // 32
    return ns


def random_bf16(shape, rng):
    """Device array of bf16 bits with values in ±[2^-7, 1) (the timing does not depend on them)."""
    from numba import cuda
    bits = rng.integers(0x3C00, 0x3F80, size=shape, dtype=np.uint16)
    bits |= (rng.integers(0, 2, size=shape, dtype=np.uint16) << np.uint16(15))
    return cuda.to_device(bits)


def read_bandwidth() -> float:
    if SIM:
        return float("nan")
    from pegainfer.kernels.memory import measure_read_bandwidth
    return measure_read_bandwidth(2 << 30)


def pct(part: float, whole: float):
    return 100 * part / whole if whole == whole else None


# ================================================================================================ L2-warm
# (name, N rows, K, gated) — Qwen3-4B: hidden 2560, q 32×128, kv 8×128, intermediate 9728, vocab 151936
SHAPES = [("qkv", 6144, 2560, False), ("o", 2560, 4096, False), ("gate_up+silu", 19456, 2560, True),
          ("down", 2560, 9728, False), ("lm_head", 151936, 2560, False)]
LAYERS = 36
DECODE_IMPLS = {1: ("gemv", "skinny"), 16: ("skinny", "gemv", "gemm_mma")}
SKINNY_SWEEP = [(1, 4), (2, 2), (2, 4), (4, 1), (4, 2)]
"""(n_tiles, unroll) pairs the warm skinny sweep tries, each with 4 and 8 warps per block and k_split 1..8."""
MMA_TILES = [(2, 4, 2, 4), (2, 4, 4, 4), (2, 2, 2, 4), (1, 4, 2, 4), (4, 2, 2, 2), (2, 2, 4, 4)]


def launches_for(fn, target_s: float, cap: int) -> int:
    """Enough launches that one graph replay lasts about ``target_s`` (at least 3, at most ``cap``)."""
    if SIM:
        return 1
    from numba import cuda
    fn()
    cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    cuda.synchronize()
    return int(max(3, min(cap, target_s / max(time.perf_counter() - t0, 1e-6))))


def geometry_text(L, impl: str, n: int, k: int, T: int, gated: bool) -> str:
    if impl == "gemv":
        g = L.gemv_geometry(n, k, min(T, L.GEMV_MAX_TOKENS), gated)
        passes = f" ({-(-T // g.max_tokens)} passes)" if T > g.max_tokens else ""
        return f"rows={g.rows_per_warp} warps={g.warps} k_split={g.k_split} tt={g.max_tokens} stages={g.stages}" + passes
    if impl == "skinny":
        g = L.skinny_geometry(n, k, T, gated)
        return f"n_tiles={g.n_tiles} unroll={g.unroll} warps={g.warps} k_split={g.k_split} wps={g.warps_per_sm}"
    if impl == "gemm_mma":
        g = L.mma_geometry(n, k, T, gated)
        return f"tile=({g.warps_m}, {g.warps_n}, {g.mt}, {g.nt}) stages={g.stages} k_splits={g.k_splits}"
    return ""


def op_fn(L, x, w, out, gated, impl, geometry=None):
    """A no-argument function running one projection (``linear`` / ``linear_silu_mul`` or a forced geometry)."""
    if geometry is not None:
        if impl == "gemv":
            return lambda: L.gemv(x, w, out, gated=gated, geometry=geometry)
        return lambda: L.linear_skinny(x, w, out, gated=gated, geometry=geometry)
    op = L.linear_silu_mul if gated else L.linear
    return lambda: op(x, w, out, impl=impl)


def bench_decode(L, weights, rng, read_bw, launches) -> list[dict]:
    """T = 1 and T = 16: every shape with every weight-streaming implementation; ``default`` marks what
    ``linear(impl=None)`` takes."""
    from numba import cuda
    rows = []
    for T, impls in DECODE_IMPLS.items():
        for name, (w, n, k, gated) in weights.items():
            n_out = n // 2 if gated else n
            x = random_bf16((T, k), rng)
            out = cuda.device_array((T, n_out), np.uint16)
            default = L.default_impl(T)
            for impl in impls + ((default,) if default not in impls else ()):
                sec = time_calls([op_fn(L, x, w, out, gated, impl)] * launches)
                nbytes = n * k * 2 + T * (k + n_out) * 2
                rows.append(dict(kind="decode", name=name, N=n, K=k, T=T, impl=impl, default=impl == default,
                                 us=sec * 1e6, GBps=nbytes / sec / 1e9, pct_of_read=pct(nbytes / sec, read_bw),
                                 geometry=geometry_text(L, impl, n, k, T, gated)))
    return rows


def print_decode(rows, launches) -> dict:
    print(f"\nWeight-streaming projections (CUDA graph of {launches} launches; bytes = weight + x + out; "
          f"* = linear(impl=None))")
    print(f"{'shape':14s} {'N':>7s} {'K':>6s} {'T':>3s} {'impl':>9s} {'us':>9s} {'GB/s':>7s} {'% read':>7s}  geometry")
    for r in rows:
        share = f"{r['pct_of_read']:6.1f}%" if r["pct_of_read"] is not None else "     - "
        print(f"{r['name']:14s} {r['N']:7d} {r['K']:6d} {r['T']:3d} {'*' if r['default'] else ' '}{r['impl']:>8s} "
              f"{r['us']:9.1f} {r['GBps']:7.0f} {share}  {r['geometry']}")
    sums = {}
    print(f"\nprojections per forward step (Qwen3-4B: {LAYERS} layers × (qkv + o + gate_up + down) + lm_head)")
    for T, impls in DECODE_IMPLS.items():
        for impl in ("default",) + impls:
            sel = [r for r in rows if r["T"] == T and (r["default"] if impl == "default" else r["impl"] == impl)]
            if not sel:
                continue
            layer = sum(r["us"] for r in sel if r["name"] != "lm_head")
            head = sum(r["us"] for r in sel if r["name"] == "lm_head")
            ms = (LAYERS * layer + head) / 1e3
            sums[f"T{T}_{impl}"] = ms
            print(f"  T={T:2d} {impl:9s}: {layer:7.1f} us/layer × {LAYERS} + lm_head {head:6.1f} us = {ms:6.2f} ms "
                  f"per step ({ms / T:6.3f} ms/token)")
    return sums


def bench_gemm(L, weights, rng, impls, use_torch) -> list[dict]:
    from numba import cuda
    torch, rows = None, []
    if use_torch and not SIM:
        import torch  # noqa: F811  (only as a yardstick: cuBLAS through torch)
    for name, (w, n, k, gated) in weights.items():
        n_out = n // 2 if gated else n
        for T in (128, 2048):
            T = max(1, T // SHRINK)
            x = random_bf16((T, k), rng)
            out = cuda.device_array((T, n_out), np.uint16)
            flops = 2.0 * T * n * k
            for impl in impls:
                fn = op_fn(L, x, w, out, gated, impl)
                sec = time_calls([fn] * launches_for(fn, 0.05, 50))
                rows.append(dict(kind="gemm", name=name, N=n, K=k, T=T, impl=impl, us=sec * 1e6,
                                 TFLOPs=flops / sec / 1e12))
            if torch is not None:
                tx = torch.randn(T, k, device="cuda", dtype=torch.bfloat16)
                tw = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                torch.matmul(tx, tw.T)
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(20):
                    torch.matmul(tx, tw.T)
                e.record()
                e.synchronize()
                sec = s.elapsed_time(e) * 1e-3 / 20
                rows.append(dict(kind="gemm", name=name, N=n, K=k, T=T, impl="torch_cublas", us=sec * 1e6,
                                 TFLOPs=flops / sec / 1e12))
    return rows


def sweep_gemv(L, weights, rng) -> list[dict]:
    """Every GEMV geometry per shape at T = 1 (one L2-warm matrix); prints the best of each shape."""
    from numba import cuda
    rows = []
    for name, (w, n, k, gated) in weights.items():
        x = random_bf16((1, k), rng)
        out = cuda.device_array((1, n // 2 if gated else n), np.uint16)
        results = []
        for r, stage_x in ((1, True), (2, True), (4, True), (8, True), (2, False), (4, False)):
            for warps, k_split in itertools.product((4, 8, 16), (1, 2, 4, 8)):
                if (gated and r % 2) or warps % k_split or (k_split > 1 and k // k_split < 512):
                    continue
                geo = L.GemvGeometry(rows_per_warp=r, warps=warps, k_split=k_split, max_tokens=1, stage_x=stage_x)
                sec = time_calls([op_fn(L, x, w, out, gated, "gemv", geo)] * 30, reps=3)
                results.append((sec, geo))
                rows.append(dict(kind="gemv_sweep", name=name, N=n, K=k, T=1, us=sec * 1e6,
                                 GBps=n * k * 2 / sec / 1e9, geometry=dataclasses.asdict(geo)))
        best_sec, best = min(results, key=lambda p: p[0])
        default = L.gemv_geometry(n, k, 1, gated)
        default_sec = next((sec for sec, g in results if g == default), float("nan"))
        print(f"  {name:13s} best {best_sec * 1e6:7.1f} us {n * k * 2 / best_sec / 1e9:6.0f} GB/s   default "
              f"{default_sec * 1e6:7.1f} us   {best}", flush=True)
    return rows


def sweep_skinny_warm(L, weights, rng) -> list[dict]:
    """Skinny-kernel geometries per shape at T = 1 and T = 16 (one L2-warm matrix); prints the best."""
    from numba import cuda
    rows = []
    for T in (1, 16):
        for name, (w, n, k, gated) in weights.items():
            x = random_bf16((T, k), rng)
            out = cuda.device_array((T, n // 2 if gated else n), np.uint16)
            results = []
            for (nt, unroll), warps, k_split in itertools.product(SKINNY_SWEEP, (4, 8), (1, 2, 4, 8)):
                if warps % k_split or (k_split > 1 and k // k_split < 32 * unroll * 4):
                    continue
                geo = L.SkinnyGeometry(n_tiles=nt, unroll=unroll, warps=warps, k_split=k_split)
                sec = time_calls([op_fn(L, x, w, out, gated, "skinny", geo)] * 30, reps=3)
                results.append((sec, geo))
                rows.append(dict(kind="skinny_sweep", name=name, N=n, K=k, T=T, us=sec * 1e6,
                                 GBps=n * k * 2 / sec / 1e9, geometry=dataclasses.asdict(geo)))
            best_sec, best = min(results, key=lambda p: p[0])
            default = L.skinny_geometry(n, k, T, gated)
            default_sec = next((sec for sec, g in results if g == default), float("nan"))
            print(f"  T={T:2d} {name:13s} best {best_sec * 1e6:7.1f} us {n * k * 2 / best_sec / 1e9:6.0f} GB/s   "
                  f"default {default_sec * 1e6:7.1f} us   {best}", flush=True)
    return rows


def sweep_mma(L, weights, rng) -> list[dict]:
    """The tensor-core GEMM's tile shapes (warps_m, warps_n, mt, nt) at T = 2048 on every shape."""
    from numba import cuda
    rows = []
    for name, (w, n, k, gated) in weights.items():
        T = 2048 // SHRINK
        x = random_bf16((T, k), rng)
        out = cuda.device_array((T, n // 2 if gated else n), np.uint16)
        line = []
        for tile in MMA_TILES:
            geo = L.MmaGeometry(*tile, stages=4)
            fn = (lambda x=x, w=w, out=out, gated=gated, geo=geo: L.gemm_mma(x, w, out, gated=gated, geometry=geo))
            sec = time_calls([fn] * launches_for(fn, 0.05, 20), reps=3)
            tflops = 2.0 * T * n * k / sec / 1e12
            rows.append(dict(kind="mma_sweep", name=name, N=n, K=k, T=T, tile=tile, us=sec * 1e6, TFLOPs=tflops))
            line.append(f"{tile}: {tflops:5.1f}")
        print(f"  {name:13s} TFLOP/s  " + "  ".join(line), flush=True)
    return rows


def run_warm(args, L) -> dict:
    rng = np.random.default_rng(0)
    weights = {}
    for name, n, k, gated in SHAPES:
        n, k = max(16, n // SHRINK), max(64, k // SHRINK // 8 * 8)
        weights[name] = (random_bf16((n, k), rng), n, k, gated)
    read_bw = read_bandwidth()
    print(f"read bandwidth (16-byte loads over 2 GB): {read_bw / 1e9:.0f} GB/s", flush=True)
    launches = 1 if SIM else args.launches
    rows = bench_decode(L, weights, rng, read_bw, launches)
    sums = print_decode(rows, launches)
    impls = ["gemm_mma"] + (["gemm_fma"] if args.fma else [])
    gemm_rows = bench_gemm(L, weights, rng, impls, args.torch)
    print("\nGEMM (prefill)")
    print(f"{'shape':14s} {'N':>7s} {'K':>6s} {'T':>5s} {'impl':>13s} {'us':>10s} {'TFLOP/s':>8s}")
    for r in gemm_rows:
        print(f"{r['name']:14s} {r['N']:7d} {r['K']:6d} {r['T']:5d} {r['impl']:>13s} {r['us']:10.1f} {r['TFLOPs']:8.1f}")
    rows += gemm_rows
    if args.sweep and not SIM:
        print("\nGEMV geometry sweep (T = 1)", flush=True)
        rows += sweep_gemv(L, weights, rng)
        print("\nskinny tensor-core geometry sweep (T = 1, 16)", flush=True)
        rows += sweep_skinny_warm(L, weights, rng)
        print("\nmma tile sweep (T = 2048; (warps_m, warps_n, mt, nt))", flush=True)
        rows += sweep_mma(L, weights, rng)
    return dict(mode="warm", read_bw_GBps=read_bw / 1e9, decode_projection_ms_per_token=sums.get("T1_default"),
                step_ms=sums, rows=rows)


# ================================================================================================ cold
# name -> (rows N (2I when gated), K, gated, fused with add + RMSNorm)
MODELS = {
    "4b": dict(layers=36, hidden=2560, vocab=151936, shapes={
        "qkv": (6144, 2560, False, True), "o": (2560, 4096, False, False),
        "gate_up": (19456, 2560, True, True), "down": (2560, 9728, False, False)}),
    "8b": dict(layers=36, hidden=4096, vocab=151936, shapes={
        "qkv": (6144, 4096, False, True), "o": (4096, 4096, False, False),
        "gate_up": (24576, 4096, True, True), "down": (4096, 12288, False, False)}),
    # Qwen3.5-4B: every shape it streams (in_proj of the 24 Gated DeltaNet layers, qkv of the 8 full-attention
    # layers, o / out_proj (2560×4096 both), the MLP) in each of 32 layers: the sweep is per shape; the step line
    # reads more than the real step (both first projections in every layer)
    "3.5-4b": dict(layers=32, hidden=2560, vocab=248320, shapes={
        "in_proj": (12352, 2560, False, True), "qkv": (10240, 2560, False, True), "o": (2560, 4096, False, False),
        "gate_up": (18432, 2560, True, True), "down": (2560, 9216, False, False)}),
    "sim": dict(layers=2, hidden=256, vocab=512, shapes={
        "qkv": (96, 256, False, True), "o": (64, 256, False, False),
        "gate_up": (128, 256, True, True), "down": (64, 512, False, False)}),
}


class Projection:
    """One projection of every layer: L weight matrices (uninitialised: the timing does not depend on values) and
    the buffers its launches use."""

    def __init__(self, L, name, n, k, gated, fused, layers, tokens=1):
        from numba import cuda
        self.L, self.name, self.n, self.k, self.gated = L, name, n, k, gated
        self.fused, self.tokens = fused and tokens == 1, tokens
        empty = (lambda shape: cuda.to_device(np.zeros(shape, np.uint16))) if SIM else \
            (lambda shape: cuda.device_array(shape, np.uint16))       # (the simulator would compute on garbage)
        self.w = [empty((n, k)) for _ in range(layers)]
        self.x = cuda.to_device(np.full((tokens, k), 0x3F80, np.uint16))     # 1.0
        self.out = cuda.device_array((tokens, n // 2 if gated else n), np.uint16)
        if self.fused:
            self.res_in = cuda.to_device(np.full((1, k), 0x3F80, np.uint16))
            self.res_out = cuda.device_array((1, k), np.uint16)
            self.norm_w = cuda.to_device(np.full(k, 0x3F80, np.uint16))

    @property
    def bytes(self) -> int:
        return self.n * self.k * 2

    def call(self, layer: int, geo=None):
        L, w = self.L, self.w[layer]
        if self.fused:
            return lambda: L.linear_add_rms_norm(self.res_in, self.x, self.norm_w, 1e-6, self.res_out, w, self.out,
                                                 gated=self.gated, geometry=geo)
        if geo is None:
            op = L.linear_silu_mul if self.gated else L.linear
            return lambda: op(self.x, w, self.out)
        if isinstance(geo, L.SkinnyGeometry):
            return lambda: L.linear_skinny(self.x, w, self.out, gated=self.gated, geometry=geo)
        return lambda: L.gemv(self.x, w, self.out, gated=self.gated, geometry=geo)


def parse_geometry(L, spec: str):
    """``NAME=ROWS,WARPS,K_SPLIT,STAGES`` → ``(name, GemvGeometry)`` (one token, persistent grid)."""
    name, _, nums = spec.partition("=")
    try:
        r, warps, k_split, stages = (int(v) for v in nums.split(","))
    except ValueError:
        raise SystemExit(f"error: --geometry {spec!r}: expected NAME=ROWS,WARPS,K_SPLIT,STAGES") from None
    return name, L.GemvGeometry(rows_per_warp=r, warps=warps, k_split=k_split, max_tokens=1, stages=stages,
                                persistent=True)


def skinny_candidates(L, p: Projection, quick: bool):
    """Skinny tensor-core geometries for one projection at T > 1: (n_tiles, unroll, stages, warps_per_sm) shapes
    that compile without spills on sm_90, × warps × k_split."""
    shapes = ((2, 4, 1, 16), (2, 2, 1, 16), (2, 4, 2, 8), (4, 2, 2, 8), (2, 2, 3, 8), (2, 2, 2, 16), (4, 4, 1, 8),
              (1, 4, 1, 16))
    if quick:
        shapes = shapes[:4]
    for (nt, unroll, stages, wps), warps, k_split in itertools.product(shapes, (4, 8), (1, 2, 4, 8)):
        if p.k // (32 * unroll * k_split) < 2 or warps % k_split:
            continue
        yield L.SkinnyGeometry(n_tiles=nt, unroll=unroll, warps=warps, k_split=k_split, warps_per_sm=wps,
                               stages=stages)


def candidates(L, p: Projection, quick: bool, explicit: dict):
    """Geometries worth timing for one projection: ``explicit[p.name]`` when given; one token: GEMV geometries
    (fused ones keep the norm's block size); more: skinny ones."""
    if p.name in explicit:
        yield from explicit[p.name]
        return
    if p.tokens > 1:
        yield from skinny_candidates(L, p, quick)
        return
    rows_stages = {1: (8, 16), 2: (4, 8), 4: (2, 4)} if quick else {1: (4, 8, 16), 2: (2, 4, 6, 8), 4: (2, 3, 4)}
    warps_opts = (L.fused_warps,) if p.fused else (4, 8, 16)
    for (r, stages_opts), warps, k_split in itertools.product(rows_stages.items(), warps_opts, (1, 2, 4, 8)):
        if (p.gated and r % 2) or warps % k_split or p.k // k_split < 512 or k_split > warps:
            continue
        for stages in stages_opts:      # one token: the decode kernel always launches one resident wave
            yield L.GemvGeometry(rows_per_warp=r, warps=warps, k_split=k_split, max_tokens=1, stages=stages,
                                 persistent=True)


def geo_text(L, g) -> str:
    if g is None:
        return "default"
    if isinstance(g, L.SkinnyGeometry):
        return (f"skinny n_tiles={g.n_tiles} unroll={g.unroll} stages={g.stages} warps={g.warps} "
                f"k_split={g.k_split} warps_per_sm={g.warps_per_sm}")
    return f"rows={g.rows_per_warp} warps={g.warps} k_split={g.k_split} stages={g.stages}"


def time_layers(p: Projection, geo, layers: int, reps: int = 5) -> float:
    """Seconds per launch of a graph with one launch per layer (each on its own, cold, matrix)."""
    return time_calls([p.call(i, geo) for i in range(layers)], reps)


def probe(projs, layers, read_bw, rows) -> None:
    from numba import cuda

    from pegainfer.kernels.launch import launch
    from pegainfer.kernels.memory import read_sum_u32x4
    from pegainfer.kernels.primitives import grid
    print(f"\nread kernel over {layers} distinct buffers of each size (graph of {layers} launches)")
    for p in projs:
        bufs = [cuda.device_array(p.bytes // 4, np.uint32) for _ in range(layers)]
        out = cuda.device_array(132 * 8, np.uint32)
        sec = time_calls([lambda a=a: launch(read_sum_u32x4, grid(132 * 8, 1), 512, a, out) for a in bufs])
        bw = p.bytes / sec
        rows.append(dict(kind="probe", name=p.name, MB=p.bytes / 1e6, us=sec * 1e6, GBps=bw / 1e9,
                         pct=pct(bw, read_bw)))
        print(f"  {p.name:8s} {p.bytes / 1e6:7.1f} MB  {sec * 1e6:7.1f} us  {bw / 1e9:6.0f} GB/s  "
              f"{100 * bw / read_bw:5.1f}% of read bw")
        del bufs


def sweep(L, projs, layers, read_bw, quick, explicit, rows) -> dict:
    best = {}
    for p in projs:
        res, t0 = [], time.perf_counter()
        default_s = time_layers(p, None, layers)
        for geo in candidates(L, p, quick, explicit):
            try:
                sec = time_layers(p, geo, layers, reps=3)
            except Exception as e:                     # a geometry that does not fit (shared memory): skip it
                print(f"  {p.name} {geo_text(L, geo)}: {type(e).__name__}: {str(e)[:80]}")
                continue
            res.append((sec, geo))
        res.sort(key=lambda r: r[0])
        print(f"\n{p.name} ({p.n}×{p.k}{', gated' if p.gated else ''}{', fused norm' if p.fused else ''}; "
              f"{p.bytes / 1e6:.1f} MB; {len(res)} geometries in {time.perf_counter() - t0:.0f} s): "
              f"default {default_s * 1e6:.1f} us = {p.bytes / default_s / 1e9:.0f} GB/s")
        for sec, geo in res[:8]:
            print(f"  {sec * 1e6:7.1f} us  {p.bytes / sec / 1e9:6.0f} GB/s  {100 * p.bytes / sec / read_bw:5.1f}%  "
                  f"{geo_text(L, geo)}")
        rows += [dict(kind="sweep", name=p.name, us=sec * 1e6, GBps=p.bytes / sec / 1e9, geometry=geo_text(L, geo))
                 for sec, geo in res]
        rows.append(dict(kind="sweep_default", name=p.name, us=default_s * 1e6, GBps=p.bytes / default_s / 1e9))
        if res:
            best[p.name] = res[0][1]
    return best


def tuning_entries(projs, best: dict, tokens: int) -> list[dict]:
    """The best geometries in the tuning-file form ``policy.load_tuning`` reads: ``{"n_cols", "k", "max_tokens"
    (one token) or "m_tiles" (16-token tiles of the skinny kernel), "gated", "geometry": {fields}}``."""
    size = dict(max_tokens=1) if tokens == 1 else dict(m_tiles=-(-tokens // 16))
    return [dict(n_cols=p.n, k=p.k, **size, gated=p.gated, geometry=dataclasses.asdict(best[p.name]))
            for p in projs if p.name in best]


def step(L, projs, head, layers, read_bw, geos, label, rows) -> None:
    calls = [p.call(i, geos.get(p.name)) for i in range(layers) for p in projs] + [head.call(0, geos.get("lm_head"))]
    sec = time_calls(calls, reps=5) * len(calls)
    total = sum(p.bytes for p in projs) * layers + head.bytes
    floor = total / read_bw
    rows.append(dict(kind="step", label=label, ms=sec * 1e3, floor_ms=floor * 1e3, GBps=total / sec / 1e9))
    print(f"  {label:10s} {sec * 1e3:7.3f} ms/token  {total / sec / 1e9:6.0f} GB/s  floor {floor * 1e3:.3f} ms "
          f"({100 * floor / sec:.1f}% of floor)")


def run_cold(args, L) -> dict:
    explicit: dict[str, list] = {}
    for spec in args.geometry:
        name, geo = parse_geometry(L, spec)
        explicit.setdefault(name, []).append(geo)
    model = "sim" if SIM else args.model
    m = MODELS[model]
    layers = m["layers"]
    read_bw = read_bandwidth()
    print(f"model {model}: {layers} layers; read bandwidth {read_bw / 1e9:.0f} GB/s")
    projs = [Projection(L, name, *shape, layers=layers, tokens=args.tokens) for name, shape in m["shapes"].items()]
    head = Projection(L, "lm_head", m["vocab"], m["hidden"], False, True, layers=1)
    rows: list[dict] = []
    best = {}
    if not SIM:                      # a smoke run: the default step only (the sweep's hundreds of launches)
        probe(projs + [head], layers, read_bw, rows)
        if not args.no_sweep:
            chosen = set(args.only.split(",")) if args.only else None
            best = sweep(L, [p for p in projs if chosen is None or p.name in chosen], layers, read_bw, args.quick,
                         explicit, rows)
            if args.tokens == 1 and (chosen is None or "lm_head" in chosen):
                best.update(sweep(L, [head], 1, read_bw, True, explicit, rows))
            print("\nbest geometries:")
            for p in projs + [head]:
                if p.name in best:
                    print(f"  {p.name:8s} ({p.n}, {p.k}, {p.gated}): {best[p.name]}")
    entries = tuning_entries(projs + [head], best, args.tokens)
    if args.tuning_out:
        with open(args.tuning_out, "w") as f:
            json.dump(entries, f, indent=1)
        print(f"wrote {len(entries)} tuning entries to {args.tuning_out}")
    print(f"\nprojections of one {'decode step' if args.tokens == 1 else f'{args.tokens}-token prefill'} "
          f"({layers} × ({', '.join(m['shapes'])}) + lm_head), one graph:")
    step(L, projs, head, layers, read_bw, {}, "default", rows)
    if best:
        step(L, projs, head, layers, read_bw, best, "best", rows)
    return dict(mode="cold", model=model, read_bw_GBps=read_bw / 1e9, rows=rows, tuning=entries)


# ================================================================================================ the command
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    warm = ap.add_argument_group("L2-warm (default)")
    warm.add_argument("--launches", type=int, default=50, help="launches per CUDA graph for T = 1 / 16 (default 50)")
    warm.add_argument("--sweep", action="store_true", help="also time every GEMV / skinny geometry and mma tile")
    warm.add_argument("--fma", action="store_true", help="also time the FMA-tiled GEMM")
    warm.add_argument("--torch", action="store_true", help="also time torch.matmul (cuBLAS) as a yardstick")
    cold = ap.add_argument_group("cold weights (--cold)")
    cold.add_argument("--cold", action="store_true", help="one matrix per layer, as in a real step (see above)")
    cold.add_argument("--model", default="4b", choices=sorted(k for k in MODELS if k != "sim"))
    cold.add_argument("--quick", action="store_true", help="fewer geometries")
    cold.add_argument("--no-sweep", action="store_true", help="probe and step only")
    cold.add_argument("--only", default=None, help="comma-separated projections to sweep (default: all)")
    cold.add_argument("--tokens", type=int, default=1,
                      help="tokens per projection (default 1: the GEMV; 2-16: the skinny tensor-core kernel, as a "
                           "small decode batch runs it)")
    cold.add_argument("--geometry", action="append", default=[], metavar="NAME=R,WARPS,K_SPLIT,STAGES",
                      help="sweep only these GEMV geometries for projection NAME (repeatable; e.g. o=2,4,4,6)")
    cold.add_argument("--tuning-out", default=None, metavar="FILE",
                      help="write the best geometries as a tuning file (policy.load_tuning)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    print(pegainfer.device.describe(), flush=True)
    if SIM:
        print("smoke run in the simulator: tiny shapes, wall-clock times (meaningless), no CUDA graphs", flush=True)
    L = linear_api()
    result = run_cold(args, L) if args.cold else run_warm(args, L)
    result.update(device=pegainfer.device.describe(), seconds=time.perf_counter() - t_start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")
    print(f"done in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
