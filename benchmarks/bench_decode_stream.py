"""Batch-1 decode projections with *cold* weights, as in a real decode step.

``bench_gemv.py`` times one matrix launched again and again: a 31 MB qkv matrix then sits in the H200's 50 MB L2
and the numbers flatter the GEMV.  In a decode step every layer's weights come from HBM once.  This benchmark
allocates all the layers of a model shape (uninitialised device memory: the timing does not depend on values) and
times CUDA graphs that walk through the layers the way the forward pass does:

* ``probe``: the bare 16-byte-load read kernel over 36 distinct buffers of each matrix's size: what a kernel of
  that size can reach at all (ramp-up and tail included), next to the big-buffer read bandwidth.
* ``sweep``: for each projection (qkv and gate_up fused with the residual add + RMSNorm as the model runs them; o,
  down plain), a graph of one launch per layer, each on its own layer's matrix, for every candidate GEMV geometry
  (rows per warp, warps, k_split, load-ring depth ``stages``, persistent grid).  Prints the best per shape as
  ``GEMV_TUNED`` entries.
* ``step``: the whole projection sequence of a decode step (L × (qkv, o, gate_up, down) + lm_head) in one graph,
  with the current defaults and with the best swept geometries: milliseconds per token against the floor
  (weight bytes / read bandwidth).

Usage (GPU host):  python benchmarks/bench_decode_stream.py [--model 4b|8b|3.5-4b] [--quick] [--json out.json]
    [--only o,down] [--geometry o=2,4,4,6 ...]   (sweep only these projections / only these geometries)
Without a GPU: a smoke run in the simulator (tiny shapes, wall-clock times).
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np

import pegainfer
from graph_timing import time_calls
from pegainfer.kernels import linear as lin
from pegainfer.kernels.launch import launch
from pegainfer.kernels.memory import measure_read_bandwidth, read_sum_u32x4
from pegainfer.kernels.primitives import grid
from numba import cuda

SIM = pegainfer.SIMULATOR

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
    """One projection of every layer: L weight matrices and the buffers its launches use."""

    def __init__(self, name, n, k, gated, fused, layers, hidden, tokens=1):
        self.name, self.n, self.k, self.gated, self.fused = name, n, k, gated, fused and tokens == 1
        self.tokens = tokens
        self.w = [cuda.device_array((n, k), np.uint16) for _ in range(layers)]
        n_out = n // 2 if gated else n
        self.x = cuda.to_device(np.full((tokens, k), 0x3F80, np.uint16))     # 1.0
        self.out = cuda.device_array((tokens, n_out), np.uint16)
        if self.fused:
            self.res_in = cuda.to_device(np.full((1, k), 0x3F80, np.uint16))
            self.res_out = cuda.device_array((1, k), np.uint16)
            self.norm_w = cuda.to_device(np.full(k, 0x3F80, np.uint16))

    @property
    def bytes(self) -> int:
        return self.n * self.k * 2

    def call(self, layer: int, geo=None):
        w = self.w[layer]
        if self.fused:
            return lambda: lin.linear_add_rms_norm(self.res_in, self.x, self.norm_w, 1e-6, self.res_out, w, self.out,
                                                   gated=self.gated, geometry=geo)
        if geo is None:
            op = lin.linear_silu_mul if self.gated else lin.linear
            return lambda: op(self.x, w, self.out)
        if isinstance(geo, lin.SkinnyGeometry):
            return lambda: lin.linear_skinny(self.x, w, self.out, gated=self.gated, geometry=geo)
        return lambda: lin.gemv(self.x, w, self.out, gated=self.gated, geometry=geo)


def skinny_candidates(p: Projection, quick: bool):
    """Skinny tensor-core geometries worth timing for one projection at T > 1 (``--tokens``): (n_tiles, unroll,
    stages, warps_per_sm) shapes that compile without spills on sm_90, × warps × k_split."""
    shapes = ((2, 4, 1, 16), (2, 2, 1, 16), (2, 4, 2, 8), (4, 2, 2, 8), (2, 2, 3, 8), (2, 2, 2, 16), (4, 4, 1, 8),
              (1, 4, 1, 16))
    if p.tokens > 16:
        shapes = ((2, 1, 1, 16), (1, 1, 1, 16), (1, 1, 2, 8), (2, 1, 2, 8))
    if quick:
        shapes = shapes[:4]
    for (nt, unroll, stages, wps), warps, k_split in itertools.product(shapes, (4, 8), (1, 2, 4, 8)):
        if p.k // (32 * unroll * k_split) < 2 or warps % k_split:
            continue
        yield lin.SkinnyGeometry(n_tiles=nt, unroll=unroll, warps=warps, k_split=k_split, warps_per_sm=wps,
                                 stages=stages)


EXPLICIT: dict[str, list] = {}
"""``--geometry NAME=R,WARPS,K_SPLIT,STAGES``: the only GEMV geometries the sweep tries for that projection."""


def parse_geometry(spec: str) -> tuple[str, "lin.GemvGeometry"]:
    name, sep, nums = spec.partition("=")
    try:
        r, warps, k_split, stages = (int(v) for v in nums.split(","))
    except ValueError:
        raise SystemExit(f"error: --geometry {spec!r}: expected NAME=ROWS,WARPS,K_SPLIT,STAGES") from None
    return name, lin.GemvGeometry(rows_per_warp=r, warps=warps, k_split=k_split, max_tokens=1, stages=stages,
                                  persistent=True)


def candidates(p: Projection, quick: bool):
    """GEMV geometries worth timing for one projection at T = 1 (fused ones keep norm's block size)."""
    if p.name in EXPLICIT:
        yield from EXPLICIT[p.name]
        return
    if p.tokens > 1:
        yield from skinny_candidates(p, quick)
        return
    rows_stages = {1: (4, 8, 16), 2: (2, 4, 6, 8), 4: (2, 3, 4)}
    if quick:
        rows_stages = {1: (8, 16), 2: (4, 8), 4: (2, 4)}
    warps_opts = (lin.NORM_THREADS // 32,) if p.fused else (4, 8, 16)
    persist_opts = (True,)          # one token: the decode kernel always launches one resident wave
    for (r, stages_opts), warps, k_split, persistent in itertools.product(
            rows_stages.items(), warps_opts, (1, 2, 4, 8), persist_opts):
        if p.gated and r % 2:
            continue
        if warps % k_split or p.k // k_split < 512 or k_split > warps:
            continue
        for stages in stages_opts:
            yield lin.GemvGeometry(rows_per_warp=r, warps=warps, k_split=k_split, max_tokens=1, stages=stages,
                                   persistent=persistent)


def geo_text(g) -> str:
    if g is None:
        return "default"
    if isinstance(g, lin.SkinnyGeometry):
        return (f"skinny n_tiles={g.n_tiles} unroll={g.unroll} stages={g.stages} warps={g.warps} "
                f"k_split={g.k_split} warps_per_sm={g.warps_per_sm}")
    return f"rows={g.rows_per_warp} warps={g.warps} k_split={g.k_split} stages={g.stages} persistent={g.persistent}"


def time_layers(p: Projection, geo, layers: int, reps: int = 5) -> float:
    """Seconds per launch of a graph with one launch per layer (each on its own, cold, matrix)."""
    return time_calls([p.call(i, geo) for i in range(layers)], reps)


def probe(projs, layers, read_bw, rows):
    print(f"\nread kernel over {layers} distinct buffers of each size (graph of {layers} launches)")
    for p in projs:
        bufs = [cuda.device_array(p.bytes // 4, np.uint32) for _ in range(layers)]
        out = cuda.device_array(132 * 8, np.uint32)
        calls = [lambda a=a: launch(read_sum_u32x4, grid(132 * 8, 1), 512, a, out) for a in bufs]
        sec = time_calls(calls)
        bw = p.bytes / sec
        rows.append(dict(kind="probe", name=p.name, MB=p.bytes / 1e6, us=sec * 1e6, GBps=bw / 1e9,
                         pct=100 * bw / read_bw))
        print(f"  {p.name:8s} {p.bytes / 1e6:7.1f} MB  {sec * 1e6:7.1f} us  {bw / 1e9:6.0f} GB/s  "
              f"{100 * bw / read_bw:5.1f}% of read bw")
        del bufs


def sweep(projs, layers, read_bw, quick, rows) -> dict:
    best = {}
    for p in projs:
        res = []
        t0 = time.perf_counter()
        default_s = time_layers(p, None, layers)
        for geo in candidates(p, quick):
            try:
                sec = time_layers(p, geo, layers, reps=3)
            except Exception as e:                     # a geometry that does not fit (shared memory): skip it
                print(f"  {p.name} {geo_text(geo)}: {type(e).__name__}: {str(e)[:80]}")
                continue
            res.append((sec, geo))
        res.sort(key=lambda r: r[0])
        print(f"\n{p.name} ({p.n}×{p.k}{', gated' if p.gated else ''}{', fused norm' if p.fused else ''}; "
              f"{p.bytes / 1e6:.1f} MB; {len(res)} geometries in {time.perf_counter() - t0:.0f} s): "
              f"default {default_s * 1e6:.1f} us = {p.bytes / default_s / 1e9:.0f} GB/s")
        for sec, geo in res[:8]:
            print(f"  {sec * 1e6:7.1f} us  {p.bytes / sec / 1e9:6.0f} GB/s  {100 * p.bytes / sec / read_bw:5.1f}%  "
                  f"{geo_text(geo)}")
        for sec, geo in res:
            rows.append(dict(kind="sweep", name=p.name, us=sec * 1e6, GBps=p.bytes / sec / 1e9,
                             geometry=geo_text(geo)))
        rows.append(dict(kind="sweep_default", name=p.name, us=default_s * 1e6, GBps=p.bytes / default_s / 1e9))
        if res:
            best[p.name] = res[0][1]
    return best


def step_calls(projs, head, layers, geos):
    calls = []
    for i in range(layers):
        for p in projs:
            calls.append(p.call(i, geos.get(p.name)))
    calls.append(head.call(0, geos.get("lm_head")))
    return calls


def step(projs, head, layers, read_bw, geos, label, rows):
    calls = step_calls(projs, head, layers, geos)
    sec = time_calls(calls, reps=5) * len(calls)
    total = sum(p.bytes for p in projs) * layers + head.bytes
    floor = total / read_bw
    rows.append(dict(kind="step", label=label, ms=sec * 1e3, floor_ms=floor * 1e3, GBps=total / sec / 1e9))
    print(f"  {label:10s} {sec * 1e3:7.3f} ms/token  {total / sec / 1e9:6.0f} GB/s  floor {floor * 1e3:.3f} ms "
          f"({100 * floor / sec:.1f}% of floor)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="sim" if SIM else "4b", choices=sorted(MODELS))
    ap.add_argument("--quick", action="store_true", help="fewer geometries")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated projections to sweep (default: all)")
    ap.add_argument("--tokens", type=int, default=1,
                    help="tokens per projection (default 1: the GEMV; 2-64: the skinny tensor-core kernel, as a "
                         "short prompt's prefill runs it; the sweep then tries skinny geometries)")
    ap.add_argument("--geometry", action="append", default=[], metavar="NAME=R,WARPS,K_SPLIT,STAGES",
                    help="sweep only these GEMV geometries for projection NAME (repeatable; e.g. o=2,4,4,6)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tuning-out", default=None,
                    help=f"write the best geometries as JSON for {lin.GEMV_TUNING_ENV} (see linear.load_gemv_tuning)")
    args = ap.parse_args()
    if SIM:                  # a smoke run: the default step only (the sweep's hundreds of launches take too long)
        args.no_sweep, args.model = True, "sim"
    for spec in args.geometry:
        name, geo = parse_geometry(spec)
        EXPLICIT.setdefault(name, []).append(geo)
    m = MODELS[args.model]
    layers = m["layers"]
    read_bw = float("nan") if SIM else measure_read_bandwidth(2 << 30)
    print(f"model {args.model}: {layers} layers; read bandwidth {read_bw / 1e9:.0f} GB/s"
          f"{'  (SIMULATOR: times are meaningless)' if SIM else ''}")
    projs = [Projection(name, *shape, layers=layers, hidden=m["hidden"], tokens=args.tokens)
             for name, shape in m["shapes"].items()]
    head = Projection("lm_head", m["vocab"], m["hidden"], False, True, layers=1, hidden=m["hidden"])
    rows: list[dict] = []
    if not SIM:
        probe(projs + [head], layers, read_bw, rows)
    best = {}
    if not args.no_sweep:
        chosen = set(args.only.split(",")) if args.only else None
        best = sweep([p for p in projs if chosen is None or p.name in chosen], layers, read_bw, args.quick, rows)
        if args.tokens == 1 and (chosen is None or "lm_head" in chosen):
            best.update(sweep([head], 1, read_bw, True, rows))
        if args.tokens > 1:
            print("\nSKINNY_TUNED entries (n_cols, K, m16 tiles, gated):")
            for p in projs:
                g = best.get(p.name)
                if g is not None:
                    print(f"    ({p.n}, {p.k}, {-(-args.tokens // 16)}, {p.gated}): {g},   # {p.name}")
        else:
            print("\nGEMV_TUNED entries (n_cols, K, max_tokens, gated):")
            for p in projs + [head]:
                g = best.get(p.name)
                if g is not None:
                        print(f"    ({p.n}, {p.k}, 1, {p.gated}): GemvGeometry(rows_per_warp={g.rows_per_warp}, "
                          f"warps={g.warps}, k_split={g.k_split}, max_tokens=1, stages={g.stages}, "
                          f"persistent={g.persistent}),   # {p.name}")
    if args.tuning_out and best:
        from dataclasses import asdict
        size = dict(max_tokens=1) if args.tokens == 1 else dict(m_tiles=-(-args.tokens // 16))
        entries = [dict(n_cols=p.n, k=p.k, **size, gated=p.gated, geometry=asdict(best[p.name]))
                   for p in projs + [head] if p.name in best]
        with open(args.tuning_out, "w") as f:
            json.dump(entries, f, indent=1)
    print(f"\nprojections of one {'decode step' if args.tokens == 1 else f'{args.tokens}-token prefill'} "
          f"({layers} × (qkv, o, gate_up, down) + lm_head), one graph:")
    step(projs, head, layers, read_bw, {}, "default", rows)
    if best:
        step(projs, head, layers, read_bw, best, "best", rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, read_bw_GBps=read_bw / 1e9, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
