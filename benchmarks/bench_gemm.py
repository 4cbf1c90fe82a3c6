"""How fast are pegainfer's projection GEMMs at every token count, against the GPU's read bandwidth and torch.matmul?

Per projection of Qwen3-4B, Qwen3-8B and Qwen3.5-4B (qkv / Qwen3.5's gated q + k + v, in_proj, o / out_proj, gate_up
with its SwiGLU, down, LM head) and T in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048) tokens: our time with cold
weights (a CUDA graph of launches, each on its own copy of the weight, enough copies to overflow the L2 cache, as a
decode step meets each layer's weights), TFLOP/s, the share of the read bandwidth measured in the same run (weight
+ x + out bytes over a bare 16-byte-load read kernel's rate), and torch.matmul's time on the same weight copies in
the same run (torch imported only here, as a yardstick; it computes the plain GEMM, gate_up without the SwiGLU).

Modes (combinable):
* default: the path ``linear(impl=None)`` takes; ``--impl a,b``: those paths instead (``gemv``, ``skinny``,
  ``gemm_mma``, ``gemm_wgmma``, ``gemm_fma``), side by side;
* ``--sweep``: every candidate geometry of both tensor-core GEMMs (``gemm_mma``, Hopper's ``gemm_wgmma``: tiles ×
  ring depths × K splits, each checked against the reference kernel) and the skinny kernel; the table then shows
  the best of each, and the best geometry per (shape, token tile) is printed (and written to the JSON, and with
  ``--tuning-out FILE`` as a tuning file the engine and ``ab_policy.py`` read);
* ``--hot``: beside each cell, the default path with its weight hot in L2 (one copy launched again and again): how
  much of a launch the DRAM stream is;
* ``--check``: correctness on the GPU first: real shapes against the reference kernel, bit for bit on data whose sums
  are exact in f32, and within one bf16 ulp on random data.

Without a GPU it runs as a smoke test in the simulator (tiny shapes, wall-clock times, no torch).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_timing  # noqa: E402  (puts the checkout on sys.path)
from graph_timing import time_calls  # noqa: E402

import numpy as np  # noqa: E402

import pegainfer  # noqa: E402
from pegainfer.kernels.primitives import cuda, grid, kernel, uint16, uint32  # noqa: E402

SIM = pegainfer.SIMULATOR
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048)
# name -> [(projection, rows N (2I when gated), K, gated)]
MODELS = {
    "qwen3-4b": [("qkv", 6144, 2560, False), ("o", 2560, 4096, False), ("gate_up", 19456, 2560, True),
                 ("down", 2560, 9728, False), ("lm_head", 151936, 2560, False)],
    "qwen3.5-4b": [("in_proj", 12352, 2560, False), ("qkv", 10240, 2560, False), ("out_proj", 2560, 4096, False),
                   ("gate_up", 18432, 2560, True), ("down", 2560, 9216, False), ("lm_head", 248320, 2560, False)],
    "qwen3-8b": [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 24576, 4096, True),
                 ("down", 4096, 12288, False), ("lm_head", 151936, 4096, False)],
}
SIM_MODEL = [("qkv", 48, 64, False), ("gate_up", 32, 64, True), ("down", 16, 128, False)]
SIM_TOKENS = (1, 2, 17)
COLD_BYTES = 256 << 20
"""Weight bytes one timing graph cycles through (the H200's L2 holds 50 MB): copies = this / matrix bytes."""

# Tensor-core GEMM candidates per token tile (mma_token_tile): (warps_m, warps_n, mt, nt, stages[, warps per SM])
SWEEP_TILES = {
    16: [(1, 4, 1, 4, 4), (1, 4, 1, 4, 8), (1, 4, 1, 2, 8), (1, 8, 1, 2, 4)],
    32: [(1, 4, 2, 4, 4), (1, 4, 2, 4, 8), (1, 4, 2, 2, 8)],
    64: [(1, 4, 4, 4, 4), (1, 4, 4, 4, 8), (1, 4, 4, 2, 6), (2, 4, 2, 4, 4)],
    128: [(2, 4, 4, 4, 4), (2, 2, 4, 4, 4), (4, 2, 2, 4, 4)],
    256: [(2, 4, 4, 4, 4), (4, 2, 4, 4, 3), (4, 4, 4, 4, 3)],
    512: [(2, 4, 4, 4, 4), (2, 4, 2, 4, 4), (2, 4, 4, 8, 3, 8)],
    2048: [(2, 4, 4, 4, 4), (2, 4, 4, 8, 3, 8)],
}
SIM_SWEEP_TILES = [(1, 1, 1, 2, 3), (1, 2, 2, 1, 2)]
# Hopper GEMM candidates per token tile: (warpgroups, bn, stages)
SWEEP_WGMMA = {
    16: [(1, 64, 8), (1, 128, 6), (1, 256, 4)],
    32: [(1, 48, 8), (1, 64, 8), (1, 96, 8), (1, 128, 6), (1, 160, 6), (1, 192, 5)],
    64: [(1, 48, 8), (1, 64, 8), (1, 80, 8), (1, 96, 8), (1, 128, 6), (1, 160, 6), (1, 192, 5), (1, 256, 5)],
    128: [(2, 64, 8), (2, 128, 5), (1, 96, 6), (1, 128, 6), (1, 160, 6), (2, 160, 4), (2, 256, 4)],
    256: [(2, 96, 5), (2, 128, 5), (2, 160, 4), (2, 256, 4), (2, 256, 3)],
    512: [(2, 128, 5), (2, 160, 5), (2, 256, 4), (2, 256, 3)],
    1024: [(2, 128, 5), (2, 160, 5), (2, 160, 6), (2, 256, 4)],
    2048: [(2, 128, 5), (2, 160, 5), (2, 160, 6), (2, 192, 4), (2, 256, 4), (2, 256, 3)],
}
"""160-column tiles at 512-2048 tokens: a 2560-column weight (o / down of the 4B models) is 320 tiles of 128 × 128 at
2048 tokens, 2.4 waves on 132 SMs, and 256 tiles of 128 × 160, two.  Above 256 tokens each tile is also tried
persistent (``WgmmaGeometry.persistent``: one resident wave of blocks walking the tiles)."""
SIM_SWEEP_WGMMA = [(1, 64, 3)]
SWEEP_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
"""The token counts the sweep tries geometries at: the largest of each token tile (whose kernel serves every T up
to it); the other T take their tile's winner."""
SPLITS = (1, 2, 4, 8, 16)
HOT_LAUNCHES = 16
WORKSPACE_FLOATS = 48 << 20 if not SIM else 1 << 16


# ------------------------------------------------------------------------------------------------ data
@kernel
def fill_bf16(a, seed):
    """Pseudo-random bf16 bits with magnitudes in [2^-7, 1) and random signs (a hash of the index)."""
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        h = uint32(i) * uint32(2654435761) + uint32(seed) * uint32(40503)
        h ^= h >> uint32(15)
        h *= uint32(2246822519)
        h ^= h >> uint32(13)
        a[i] = uint16(uint32(0x3C00) + (h % uint32(0x380)) | ((h >> uint32(31)) << uint32(15)))


def random_bf16(shape, seed: int):
    """A device array of bf16 bits filled on the device (``_fill_kernel``)."""
    from pegainfer.kernels.launch import launch
    a = cuda.device_array(shape, np.uint16)
    flat = a.reshape(-1)
    launch(fill_bf16, grid(flat.shape[0], 256 * 8, sim_cap=4), 256 if not SIM else 32, flat, np.uint32(seed))
    return a


class Shape:
    """One projection shape: its cold weight copies, x and out for a token count, and what was measured on it."""

    def __init__(self, name: str, n: int, k: int, gated: bool, copies: int | None = None):
        self.name, self.n, self.k, self.gated = name, n, k, gated
        self.n_out = n // 2 if gated else n
        self.bytes = n * k * 2
        self.copies = copies or (1 if SIM else max(2, min(16, -(-COLD_BYTES // self.bytes))))
        self.w = [random_bf16((n, k), seed=11 + i) for i in range(self.copies)]

    def buffers(self, T: int):
        from numba import cuda
        return random_bf16((T, self.k), seed=T), cuda.device_array((T, self.n_out), np.uint16)


# ------------------------------------------------------------------------------------------------ our paths
def linear_api():
    """The ``pegainfer.kernels.linear`` names this script uses, where this checkout has them (an older tree lacks
    the split-K workspace and the GEMM geometries: ``--impl`` still compares its paths)."""
    names = {}
    for n in ("linear", "linear_silu_mul", "default_impl", "reference_linear", "reference_linear_silu_mul",
              "gemm_mma", "MmaGeometry", "mma_geometry", "linear_workspace_size", "mma_token_tile", "gemm_wgmma",
              "WgmmaGeometry", "wgmma_geometry"):
        try:
            names[n] = graph_timing.kernel_name("pegainfer.kernels.linear", n)
        except AttributeError:
            names[n] = None
    try:
        names["workspace_need"] = graph_timing.kernel_name("pegainfer.kernels.linear.splitk", "workspace_need")
    except (AttributeError, ModuleNotFoundError):
        names["workspace_need"] = None
    names["IMPLS"] = graph_timing.kernel_name("pegainfer.kernels.linear", "IMPLS")
    names["SKINNY_MAX_TOKENS"] = graph_timing.kernel_name("pegainfer.kernels.linear", "SKINNY_MAX_TOKENS")
    return type("LinearApi", (), names)


def op_call(L, s: Shape, x, w, out, impl, geometry, ws, policy=None):
    """A no-argument function running one projection: ``linear`` / ``linear_silu_mul`` on ``impl`` (None: the
    default path), or the GEMM of a forced ``geometry`` (``gemm_wgmma`` for a ``WgmmaGeometry``, else ``gemm_mma``;
    with launch ``policy``)."""
    if geometry is not None:
        kw = {"policy": policy} if policy is not None else {}
        gemm = L.gemm_wgmma if is_wgmma(L, geometry) else L.gemm_mma
        return lambda: gemm(x, w, out, gated=s.gated, geometry=geometry, workspace=ws, **kw)
    op = L.linear_silu_mul if s.gated else L.linear
    kw = {"workspace": ws} if L.linear_workspace_size is not None else {}
    return lambda: op(x, w, out, impl=impl, **kw)


def is_wgmma(L, geometry) -> bool:
    return L.WgmmaGeometry is not None and isinstance(geometry, L.WgmmaGeometry)


def time_ours(L, s: Shape, x, out, impl, geometry, ws, policy=None) -> float:
    """Seconds per launch: one graph of a launch on each weight copy."""
    return time_calls([op_call(L, s, x, w, out, impl, geometry, ws, policy) for w in s.w], reps=5)


def time_hot(L, s: Shape, x, out, ws) -> float:
    """Seconds per launch of the default path with the weight hot in L2: one copy launched ``HOT_LAUNCHES`` times in
    a graph (what the launch costs when the DRAM stream is not its limit)."""
    return time_calls([op_call(L, s, x, s.w[0], out, None, None, ws)] * HOT_LAUNCHES, reps=5)


def pdl_policy():
    """The default launch policy with the GEMM added to the launches that overlap the kernel before them."""
    from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
    return LaunchPolicy(pdl=DEFAULT_POLICY.pdl | {"gemm_mma"})


def reference_out(L, s: Shape, x):
    """The reference kernel's output bits for x and the first weight copy."""
    from numba import cuda
    out = cuda.device_array((x.shape[0], s.n_out), np.uint16)
    (L.reference_linear_silu_mul if s.gated else L.reference_linear)(x, s.w[0], out)
    return out.copy_to_host()


def ulp_mismatch(got, ref) -> float:
    """Share of outputs more than one bf16 ulp from the reference (different f32 sum orders round alike to within
    one ulp, but for outputs within a few f32 ulps of a rounding boundary)."""
    g = got.astype(np.int32)
    r = ref.astype(np.int32)
    # bf16 bits as a monotonic integer line (sign-magnitude -> two's complement order)
    g = np.where(g & 0x8000, -(g & 0x7FFF), g)
    r = np.where(r & 0x8000, -(r & 0x7FFF), r)
    return float(np.mean(np.abs(g - r) > 1))


# ------------------------------------------------------------------------------------------------ torch
class Torch:
    """torch.matmul on the same weight copies (a zero-copy bf16 view of each), timed as a CUDA graph."""

    def __init__(self):
        import torch
        self.torch = torch

    def time(self, s: Shape, x) -> float:
        torch = self.torch
        try:                                  # the very bytes our kernels read
            tw = [torch.as_tensor(w, device="cuda").view(torch.bfloat16) for w in s.w]
            tx = torch.as_tensor(x, device="cuda").view(torch.bfloat16)
        except (TypeError, RuntimeError):     # a torch without uint16 tensors: its own random copies
            tw = [torch.randn(s.n, s.k, device="cuda", dtype=torch.bfloat16) for _ in s.w]
            tx = torch.randn(x.shape[0], s.k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty((x.shape[0], s.n), device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                for w in tw:
                    torch.matmul(tx, w.t(), out=out)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in tw:
                torch.matmul(tx, w.t(), out=out)
        graph.replay()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3 / len(tw))
        del graph
        return float(np.median(times))


# ------------------------------------------------------------------------------------------------ sweep
def sweep_candidates(L, s: Shape, T: int):
    """Tensor-core GEMM geometries worth timing at T tokens: the token tile's candidate tiles, each with the split
    counts 1, 2, 4, 8, 16 and the heuristic's (at least 4 K tiles a split; tall weights, whose tiles already fill
    the GPU, unsplit)."""
    tiles = SIM_SWEEP_TILES if SIM else SWEEP_TILES.get(L.mma_token_tile(T), [])
    default = L.mma_geometry(s.n, s.k, T, s.gated)
    bases = [L.MmaGeometry(warps_m=wm, warps_n=wn, mt=mt, nt=nt, stages=stages, **(
        {"warps_per_sm": wps[0]} if wps else {})) for wm, wn, mt, nt, stages, *wps in tiles]
    defaults = [default]
    if L.WgmmaGeometry is not None:
        wtiles = SIM_SWEEP_WGMMA if SIM else SWEEP_WGMMA.get(L.mma_token_tile(T), [])
        fills = [{}]
        if "fill" in {f.name for f in dataclasses.fields(L.WgmmaGeometry)} and T <= 64:
            fills = [{"fill": "tma"}, {"fill": "ring"}]          # the two ways of filling the ring
        bases += [L.WgmmaGeometry(warpgroups=g, bn=bn, stages=st, **f) for g, bn, st in wtiles for f in fills]
        defaults.append(L.wgmma_geometry(s.n, s.k, T, s.gated))
    out = []
    for base in bases:
        n_kt = -(-s.k // (64 if is_wgmma(L, base) else 32))
        default_splits = {d.k_splits for d in defaults if type(d) is type(base)}
        n_tiles = -(-T // base.bm) * -(-s.n // base.bn)
        splits = {1} | (default_splits if T <= 256 else set()) | (
            {sp for sp in SPLITS + (3, 5, 6) if n_tiles * sp <= 4 * 132} if n_tiles < 2 * 132 and T <= 256 else set())
        for sp in sorted(splits):
            if sp == 1 or n_kt // sp >= 4:
                out.append(dataclasses.replace(base, k_splits=sp))
        if T > 256 and is_wgmma(L, base) and "persistent" in {f.name for f in dataclasses.fields(base)}:
            out.append(dataclasses.replace(base, persistent=True))      # one resident wave walking the tiles
    out += [d for d in defaults if d not in out]
    return out


def sweep_cell(L, s: Shape, T: int, x, out, ws, ref, rows, deadline: float):
    """Time every candidate at (shape, T); each one's output checked against the reference; returns the best
    (seconds, geometry) of each GEMM (``{"gemm_mma": ..., "gemm_wgmma": ...}``) and records every result in
    ``rows``."""
    best = {}
    for geo in sweep_candidates(L, s, T):
        if time.perf_counter() > deadline:
            break
        part, counters = L.workspace_need(geo, T, s.n)
        if part + counters > WORKSPACE_FLOATS:
            continue
        try:
            sec = time_ours(L, s, x, out, None, geo, ws)
        except Exception as e:                          # a tile that does not fit: skip it
            print(f"    {geo}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        bad = None
        if ref is not None:
            op_call(L, s, x, s.w[0], out, None, geo, ws)()
            bad = ulp_mismatch(out.copy_to_host(), ref)
        rows.append(dict(kind="sweep", model_shape=s.name, N=s.n, K=s.k, T=T, gated=s.gated, us=sec * 1e6,
                         geometry=dataclasses.asdict(geo), mismatch=bad))
        if bad is not None and bad > (5e-3 if s.gated else 1e-3):   # (SwiGLU turns 1 ulp of g or u into more)
            print(f"    WRONG {geo}: {100 * bad:.2f}% of outputs off by more than one ulp", flush=True)
            continue
        kind = "gemm_wgmma" if is_wgmma(L, geo) else "gemm_mma"
        if kind not in best or sec < best[kind][0]:
            best[kind] = (sec, geo)
    return best


# ------------------------------------------------------------------------------------------------ check
def check(L, read_shapes) -> bool:
    """Real shapes against the reference kernel: exact data bit for bit, random data within one ulp, for the
    default geometry and a split one."""
    from numba import cuda
    rng = np.random.default_rng(0)
    ok = True
    ws = cuda.to_device(np.full(WORKSPACE_FLOATS, np.nan, np.float32))
    for name, n, k, gated, T in read_shapes:
        s = Shape(name, n, k, gated, copies=1)
        xi = rng.integers(-8, 9, (T, k)).astype(np.float32) / 8
        wi = rng.integers(-8, 9, (n, k)).astype(np.float32) / 16
        from pegainfer.kernels.primitives import to_bf16_bits
        x = cuda.to_device(to_bf16_bits(xi))
        s.w[0] = cuda.to_device(to_bf16_bits(wi))
        ref = reference_out(L, s, x)
        out = cuda.device_array((T, s.n_out), np.uint16)
        defaults = [L.mma_geometry(n, k, T, gated)]
        if L.wgmma_geometry is not None:
            defaults.append(L.wgmma_geometry(n, k, T, gated))
        for geo in [g for d in defaults for g in (d, dataclasses.replace(d, k_splits=3),
                                                   dataclasses.replace(d, k_splits=1))]:
            op_call(L, s, x, s.w[0], out, None, geo, ws)()
            diff = int(np.sum(out.copy_to_host() != ref))
            ok &= diff == 0
            print(f"  check {name:9s} {n}x{k} T={T:4d} {geo}: {'ok' if diff == 0 else f'{diff} outputs differ'}",
                  flush=True)
        xr = random_bf16((T, k), seed=5)
        ref = reference_out(L, s, xr)
        for geo in defaults:
            op_call(L, s, xr, s.w[0], out, None, geo, ws)()
            bad = ulp_mismatch(out.copy_to_host(), ref)
            ok &= bad < (5e-3 if gated else 1e-3)
            print(f"  check {name:9s} random data, {type(geo).__name__}: {100 * bad:.3f}% of outputs more than one "
                  "ulp off", flush=True)
    return ok


CHECK_SHAPES = [("o", 2560, 4096, False, 5), ("gate_up", 19456, 2560, True, 16), ("down", 4096, 12288, False, 33),
                ("o", 2560, 4096, False, 64), ("qkv", 6144, 2560, False, 130), ("gate_up", 18432, 2560, True, 256),
                ("in_proj", 12352, 2560, False, 520)]
SIM_CHECK_SHAPES = [("qkv", 48, 64, False, 5), ("gate_up", 32, 128, True, 17)]


# ------------------------------------------------------------------------------------------------ the run
def run(args) -> dict:
    from numba import cuda
    L = linear_api()
    impls = args.impl.split(",") if args.impl else [None]
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(SIM_TOKENS if SIM else TOKENS)
    models = {"sim": SIM_MODEL} if SIM else {m: MODELS[m] for m in (args.models.split(",") if args.models
                                                                    else MODELS)}
    read_bw = float("nan")
    if not SIM:
        from pegainfer.kernels.memory import measure_read_bandwidth
        read_bw = measure_read_bandwidth(2 << 30)
    print(f"read bandwidth (16-byte loads over 2 GB): {read_bw / 1e9:.0f} GB/s", flush=True)
    result = dict(device=pegainfer.device.describe(), read_bw_GBps=read_bw / 1e9, rows=[], tuned=[], check=None)
    if args.check:
        result["check"] = check(L, SIM_CHECK_SHAPES if SIM else CHECK_SHAPES)
        print(f"check: {'passed' if result['check'] else 'FAILED'}", flush=True)
    print_header()
    torch = Torch() if not SIM and not args.no_torch else None
    ws = cuda.to_device(np.full(WORKSPACE_FLOATS, np.nan, np.float32)) if L.linear_workspace_size else None
    deadline = time.perf_counter() + args.deadline
    measured: dict = {}
    rows = result["rows"]
    for model, shapes in models.items():
        for name, n, k, gated in shapes:
            key = (n, k, gated)
            if key in measured:                   # the same matrix shape in another model: reuse its numbers
                for r in measured[key]:
                    rows.append(dict(r, model=model, proj=name))
                continue
            s = Shape(name, n, k, gated)
            mine, winners = [], {}
            for T in sorted(tokens, key=lambda t: (t not in SWEEP_TOKENS, t)):
                x, out = s.buffers(T)
                flops = 2.0 * T * n * k
                nbytes = s.bytes + 2 * T * (k + s.n_out)
                cell = dict(model=model, proj=name, N=n, K=k, gated=gated, T=T, flops=flops, bytes=nbytes, impls={})
                if torch is not None:
                    cell["torch_us"] = torch.time(s, x) * 1e6
                for impl in impls:
                    if (impl == "skinny" and T > L.SKINNY_MAX_TOKENS) or (impl == "gemv" and T > 64):
                        continue
                    sec = time_ours(L, s, x, out, impl, None, ws)
                    cell["impls"][impl or f"default ({L.default_impl(T)})"] = sec * 1e6
                if args.hot:
                    cell["hot_us"] = time_hot(L, s, x, out, ws) * 1e6
                if args.sweep and T >= 2 and L.MmaGeometry is not None:
                    tile = L.mma_token_tile(T)
                    if T in SWEEP_TOKENS or SIM or tile not in winners:
                        ref = reference_out(L, s, x) if T <= 512 and not (name == "lm_head" and T > 16) else None
                        bests = sweep_cell(L, s, T, x, out, ws, ref, rows, deadline)
                        if bests:
                            winners[tile] = bests
                    else:
                        bests = {kind: (time_ours(L, s, x, out, None, geo, ws), geo)
                                 for kind, (_, geo) in winners[tile].items()}
                    for kind, (sec, _) in (bests or {}).items():
                        cell["impls"][f"{kind} tuned"] = sec * 1e6
                    best = min(bests.values(), key=lambda b: b[0]) if bests else None
                    if best is not None:
                        if not SIM and T <= 256:      # the same launches overlapping each other's ramp (PDL)
                            cell["impls"]["tuned, PDL"] = time_ours(L, s, x, out, None, best[1], ws,
                                                                              pdl_policy()) * 1e6
                        cell["tuned"] = dict(dataclasses.asdict(best[1]), type=type(best[1]).__name__)
                        result["tuned"].append(dict(n_cols=n, k=k, tokens=L.mma_token_tile(T), T=T, gated=gated,
                                                    geometry=cell["tuned"], us=best[0] * 1e6))
                    if T <= L.SKINNY_MAX_TOKENS and "skinny" in L.IMPLS and "skinny" not in impls:
                        cell["impls"]["skinny"] = time_ours(L, s, x, out, "skinny", None, ws) * 1e6
                best_us = min(cell["impls"].values())
                cell.update(kind="table", us=best_us, best=min(cell["impls"], key=cell["impls"].get),
                            TFLOPs=flops / best_us / 1e6, pct_read=100 * nbytes / (best_us * 1e-6) / read_bw)
                print_row(cell)
                rows.append(cell)
                mine.append(cell)
            mine.sort(key=lambda c: c["T"])
            measured[key] = mine
            del s
            if args.json:                         # what was measured so far survives a kill
                write_json(args.json, result)
    return result


def print_header() -> None:
    print(f"\n{'model':10s} {'proj':8s} {'N':>6s} {'K':>5s} {'T':>5s} {'ours us':>9s} {'TFLOP/s':>8s} {'% read':>7s} "
          f"{'torch us':>9s} {'vs torch':>8s}  path (others, us)", flush=True)


def print_row(c: dict) -> None:
    torch_us = c.get("torch_us")
    ratio = f"{torch_us / c['us']:7.2f}x" if torch_us else "       -"
    others = ", ".join(f"{k} {v:.1f}" for k, v in c["impls"].items() if k != c["best"])
    pct = f"{c['pct_read']:6.1f}%" if c["pct_read"] == c["pct_read"] else "     - "
    print(f"{c['model']:10s} {c['proj']:8s} {c['N']:6d} {c['K']:5d} {c['T']:5d} {c['us']:9.1f} {c['TFLOPs']:8.1f} "
          f"{pct} {torch_us or float('nan'):9.1f} {ratio}  {c['best']}" + (f" ({others})" if others else "")
          + (f"; weight hot in L2 {c['hot_us']:.1f}" if "hot_us" in c else ""), flush=True)


def print_table(rows: list[dict]) -> None:
    """Every measured (model, projection, T), in model order."""
    print("\nAll measurements (cold weights; ours = the fastest of the paths timed)")
    print_header()
    order = {m: i for i, m in enumerate(MODELS)}
    for c in sorted((r for r in rows if r.get("kind") == "table"),
                    key=lambda r: (order.get(r["model"], -1), r["proj"], r["T"])):
        print_row(c)


def best_per_tile(tuned: list[dict]) -> dict:
    """``{(n_cols, K, token tile, gated): entry}``: the largest T of a tile decides it (the tile's kernel serves
    every T up to it)."""
    best = {}
    for e in tuned:
        key = (e["n_cols"], e["k"], e["tokens"], e["gated"])
        if key not in best or e["T"] > best[key]["T"]:
            best[key] = e
    return best


def write_tuning(path: str, tuned: list[dict]) -> None:
    """The best geometries as a tuning file (``policy.load_tuning``: the command line's ``--launch-policy
    tuning=FILE``, ``ab_policy.py``'s ``tuning=FILE``)."""
    entries = []
    for (n, k, t, gated), e in sorted(best_per_tile(tuned).items()):
        g = dict(e["geometry"])
        kind = "wgmma" if g.pop("type", "MmaGeometry") == "WgmmaGeometry" else "mma"
        entries.append(dict(kind=kind, n_cols=n, k=k, tokens=t, gated=gated, geometry=g))
    with open(path, "w") as f:
        json.dump(entries, f, indent=1)
    print(f"wrote {len(entries)} tuning entries to {path}")


def print_tuned(tuned: list[dict]) -> None:
    """The best geometry per (shape, token tile) as ``geometry.MMA_TUNED`` entries."""
    best = best_per_tile(tuned)
    print("\nBest geometry per (n_cols, K, token tile, gated)")
    for (n, k, t, gated), e in sorted(best.items()):
        g = dict(e["geometry"])
        kind = g.pop("type", "MmaGeometry")
        print(f"    ({n}, {k}, {t}, {gated}): {kind}({', '.join(f'{a}={b}' for a, b in g.items())}),"
              f"   # {e['us']:.1f} us at T = {e['T']}")


def write_json(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--tokens", default=None, help=f"comma-separated token counts (default {TOKENS})")
    ap.add_argument("--impl", default=None, help="comma-separated paths to time side by side (default: the one "
                                                 "linear(impl=None) takes)")
    ap.add_argument("--sweep", action="store_true", help="also time every tensor-core GEMM geometry")
    ap.add_argument("--check", action="store_true", help="first check real shapes against the reference kernel")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.matmul")
    ap.add_argument("--hot", action="store_true", help="also time the default path with its weight hot in L2 (one "
                    f"copy launched {HOT_LAUNCHES} times): how much of a launch is the DRAM stream")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which the sweep stops trying")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--tuning-out", default=None, help="with --sweep: write the best geometry per (shape, token "
                                                       "tile) as a tuning file (--launch-policy tuning=FILE, ab_policy.py)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    print(pegainfer.device.describe(), f"(pegainfer from {Path(pegainfer.__file__).parent})", flush=True)
    if SIM:
        print("smoke run in the simulator: tiny shapes, wall-clock times (meaningless), no torch", flush=True)
    result = run(args)
    print_table(result["rows"])
    if result["tuned"]:
        print_tuned(result["tuned"])
        if args.tuning_out:
            write_tuning(args.tuning_out, result["tuned"])
    result["seconds"] = time.perf_counter() - t0
    if args.json:
        write_json(args.json, result)
        print(f"\nwrote {args.json}")
    print(f"done in {result['seconds']:.0f} s")
    return 0 if result["check"] in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
