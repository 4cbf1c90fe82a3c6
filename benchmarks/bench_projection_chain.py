"""Can one persistent kernel stream a decode step's projections closer to the bandwidth floor than one launch each?

The question behind it.  A batch-1 Qwen3-4B decode step reads 8 GB of weights; the floor at the H200's ~4.3 TB/s is
~1.9 ms, the engine takes ~2.75 ms.  ``profile_step.py`` puts ~18 µs of every layer's ~75 µs into the ramp and
tail of its four projection launches (blocks waiting for SM slots, the last blocks streaming alone) and ~12 µs
into the latency-bound kernels between them.  Programmatic dependent launch (PDL) already lets each GEMV issue its
first weight loads before the previous kernel ends; what a launch boundary still costs is measured here by taking
it away: one kernel whose resident blocks walk every matrix of the step in order, meeting at a grid barrier
between matrices (the next matrix's input is the previous one's output), and -- with ``carry`` -- issuing their
first loads of the next matrix *before* the barrier, so HBM never waits for the slowest block.

It times, on the same GPU in one run:
* ``launches``: the engine's own GEMVs, one launch per projection (``bench_decode_stream``'s ``step``: the qkv and
  gate_up launches with their fused add + RMSNorm, the LM head), as a CUDA graph;
* ``chain``: the persistent kernel below over the same shapes, without and with ``carry``, and with no barriers
  at all (not a valid chain: the bound on what the barriers cost), for a few register geometries (rows per warp,
  load-ring depth);
and prints ms per token against the floor (bytes / read bandwidth measured by the same run).  The chain computes
each matrix's ``W @ x`` (f32 partial sums added atomically), not the engine's norms, SwiGLU or roundings: it
answers a bandwidth question, not an accuracy one.  The engine's own version of the idea is
``linear.DecodeProjectionChain`` (``PEGAINFER_DECODE_CHAIN=1``: four stages per launch, one per layer; its TPOT
against the launches is the second half of ``gpu_session.sh chain``).

Compiled offline for sm_90 (launch bounds: 16 warps per SM) the chain takes 122–124 registers without carry; with
it 128, and ptxas spills 16 bytes at rows 2 / stages 6 and 76 at rows 4 / stages 4.  Not yet run on a GPU (written
in session 8 after the device time was spent): its first numbers go to ``benchmarks/RESULTS.md``.

Usage (GPU host):  python benchmarks/bench_projection_chain.py [--model 4b|8b|3.5-4b] [--json out.json]
    (or ``benchmarks/gpu_session.sh chain``)
In the simulator it only checks the kernel's arithmetic on tiny shapes with one block (``tests/test_cli.py``).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pegainfer  # noqa: E402,F401
from numba import cuda  # noqa: E402
from numba import types as nbtypes  # noqa: E402
from pegainfer.device import SIMULATOR  # noqa: E402
from pegainfer.kernels import linear as lin  # noqa: E402
from pegainfer.kernels.launch import launch  # noqa: E402
from pegainfer.kernels.primitives import (WARP, device_fn, float32, from_bf16_bits, grid_barrier,  # noqa: E402
                                          kernel, to_bf16_bits, uint32, warp_sum)

int64 = np.int64

TABLE_COLS = 6
"""A chain's matrix table ``[M, 6]`` int64: weight word offset (into the flat uint32 weights), rows N, words per row
(K/2), K parts (warps sharing a row group, each a contiguous 1/parts of K), x word offset, out offset."""


@device_fn
def _unit_rows(table, m, unit, rows, wrow):
    """Row word offsets of work unit ``unit`` of matrix ``m`` (a group of ``rows`` rows × one K part) into
    ``wrow``; rows past the end repeat the last one (loads stay in bounds, their sums are dropped)."""
    n = table[m, 1]
    k_words = table[m, 2]
    parts = table[m, 3]
    group = unit // parts
    part = unit - group * parts
    part_words = k_words // parts
    for r in range(rows):
        wrow[r] = table[m, 0] + min(group * rows + r, n - 1) * k_words + part * part_words


@device_fn
def _ring_prologue(w32, table, m, unit, rows, stages, wrow, wbuf):
    """Issue the first ``stages - 1`` steps of a unit's 16-byte loads into the ring (lane l, step s: slice
    ``l + 32 s`` of each row's K part)."""
    _unit_rows(table, m, unit, rows, wrow)
    slices = table[m, 2] // table[m, 3] // 4
    lane = cuda.threadIdx.x % WARP
    for s in range(stages - 1):
        cs = lane + WARP * s
        if cs < slices:
            lin._load_row_slices(w32, wrow, 4 * cs, wbuf, s * 4 * rows, rows)


@functools.cache
def chain_kernel(rows_per_warp: int, stages: int, warps: int, carry: bool, barrier: bool = True):
    """Build the chain kernel for ``rows_per_warp`` rows per warp, a load ring ``stages`` deep and blocks of
    ``warps`` warps (compile-time: they size the register arrays and the launch bounds: 16 warps per SM).
    ``barrier=False`` leaves the grid barriers out (wrong as a chain, since x would not be ready: the bound on
    what the barriers cost)."""
    R, S = rows_per_warp, stages
    R4 = 4 * R
    SR4 = S * R4
    CARRY = carry
    BARRIER = barrier
    nthreads = warps * WARP

    @lin._bounded_kernel(nthreads)
    def projection_chain(w32, table, x32, out, counter, status):
        """``out[o_m + n] += Σ_k W_m[n, k] · x_m[k]`` for every matrix m of ``table``, in order, one grid barrier
        between matrices.

        w32 flat uint32 (bf16 pairs) holding every matrix; table ``[M, 6]`` int64 (``TABLE_COLS``); x32 uint32
        holding each matrix's input (bf16 pairs from word ``table[m, 4]``); out f32 (zeroed by the caller);
        counter, status ``[1]`` int32, zeroed by the caller.

        Geometry: a persistent grid (every block resident: the barrier needs it).  Matrix m is cut into units of
        ``rows_per_warp`` rows × one of ``table[m, 3]`` K parts; global warp g takes units g, g + W, ... (W warps
        in the grid).  Per unit, lane l streams the 16-byte slices ``l + 32 s`` of its rows' K part through a
        register ring ``stages`` deep (as the engine's one-token GEMV) and dots them with x staged in shared memory
        (``linear._x_word_index`` order; loaded with plain, coherent loads: in a real chain the previous matrix
        wrote it).  A unit's successor's first loads go out before its warp reduction; with ``carry``, a warp's
        last unit of matrix m is followed by the first loads of its first unit of m + 1 *before the barrier*.
        Dynamic shared memory: ``4 · 128 · ceil(K_max / 256)`` bytes."""
        xs = cuda.shared.array(0, nbtypes.uint32)   # dynamic; a numba type (the simulator needs its itemsize)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        gw = cuda.blockIdx.x * (nthreads // WARP) + tid // WARP
        nw = cuda.gridDim.x * (nthreads // WARP)
        acc = cuda.local.array(R, float32)
        wrow = cuda.local.array(R, int64)
        wbuf = cuda.local.array(SR4, uint32)
        n_mat = table.shape[0]
        ready = False                               # the ring holds the first steps of unit gw of this matrix
        for m in range(n_mat):
            n = table[m, 1]
            k_words = table[m, 2]
            parts = table[m, 3]
            slices = k_words // parts // 4         # 16-byte slices per row and K part
            units = ((n + R - 1) // R) * parts
            if not ready and gw < units:
                _ring_prologue(w32, table, m, gw, R, S, wrow, wbuf)
            ready = False
            if BARRIER and m > 0:
                grid_barrier(counter, m * cuda.gridDim.x, status)
            x0 = table[m, 4]
            for w in range(tid, k_words, nthreads):
                c = w >> 2
                xs[128 * (c >> 5) + 32 * (w & 3) + (c & 31)] = x32[x0 + w]
            cuda.syncthreads()
            u = gw
            for _ in range((units + nw - 1) // nw):    # the same trip count in every warp (warp_sum below)
                for r in range(R):
                    acc[r] = float32(0.0)
                c_part = (u % parts) * slices       # the part's first slice within the row (x's index)
                c = lane if u < units else slices   # a warp without a unit this round adds zeros
                while c < slices:
                    for s in range(S):              # unrolled: ring slot s holds slice c
                        c_pre = c + (S - 1) * WARP
                        if c_pre < slices:
                            lin._load_row_slices(w32, wrow, 4 * c_pre, wbuf, ((s + S - 1) % S) * R4, R)
                        if c < slices:
                            cx = c_part + c
                            xb = 128 * (cx >> 5) + (cx & 31)
                            lin._dot_slices_x_words(acc, wbuf, s * R4, xs[xb], xs[xb + 32], xs[xb + 64],
                                                    xs[xb + 96], R)
                        c += WARP
                row0 = (u // parts) * R
                nu = u + nw
                if u >= units:
                    pass
                elif nu < units:                    # the next unit's loads fly through the reduction
                    _ring_prologue(w32, table, m, nu, R, S, wrow, wbuf)
                elif CARRY and m + 1 < n_mat and gw < ((table[m + 1, 1] + R - 1) // R) * table[m + 1, 3]:
                    _ring_prologue(w32, table, m + 1, gw, R, S, wrow, wbuf)
                    ready = True
                for r in range(R):
                    v = warp_sum(acc[r])
                    if lane == 0 and u < units and row0 + r < n:
                        cuda.atomic.add(out, table[m, 5] + row0 + r, v)
                u = nu
            if CARRY and gw >= units and m + 1 < n_mat and gw < ((table[m + 1, 1] + R - 1) // R) * table[m + 1, 3]:
                _ring_prologue(w32, table, m + 1, gw, R, S, wrow, wbuf)
                ready = True
            cuda.syncthreads()                      # xs is restaged for the next matrix

    return projection_chain


@kernel
def zero_chain_state(out, counter, status):
    """``out[:] = 0``, ``counter[0] = status[0] = 0`` (grid-stride; run before every chain launch)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i == 0:
        counter[0] = 0
        status[0] = 0
    for j in range(i, out.shape[0], cuda.gridDim.x * cuda.blockDim.x):
        out[j] = float32(0.0)


def k_parts(n: int, k: int, rows: int, warps_in_grid: int) -> int:
    """K parts for an ``[n, k]`` matrix: the count in 1, 2, 4, 8 (each part whole 16-byte slices, at least 512
    elements) whose units fill the grid's warps most evenly (units / warps closest below a whole number of
    rounds), the fewest parts among equals."""
    best, best_eff = 1, -1.0
    for parts in (1, 2, 4, 8):
        part = k // parts
        if k % (8 * parts) or part < 512:
            break
        rounds = -(-n // rows) * parts / warps_in_grid
        eff = rounds / -(-rounds // 1)
        if eff > best_eff + 0.02:
            best, best_eff = parts, eff
    return best


class Chain:
    """Every matrix of a step in one flat device buffer, with its table, inputs and outputs."""

    def __init__(self, shapes: list[tuple[int, int]], seed: int = 0, fill: bool = False):
        self.shapes = shapes
        self.w_off = np.cumsum([0] + [n * k // 2 for n, k in shapes])
        self.x_off = np.cumsum([0] + [k // 2 for _, k in shapes])
        self.o_off = np.cumsum([0] + [n for n, _ in shapes])
        rng = np.random.default_rng(seed)
        if fill:        # small chains (tests): random bf16 values; big ones stay uninitialised (timing only)
            self.w_host = (rng.standard_normal(int(self.w_off[-1]) * 2).astype(np.float32) * 0.1)
            self.w = cuda.to_device(to_bf16_bits(self.w_host).view(np.uint32))
        else:
            self.w_host = None
            self.w = cuda.device_array(int(self.w_off[-1]), np.uint32)
        self.x_host = rng.standard_normal(int(self.x_off[-1]) * 2).astype(np.float32)
        self.x = cuda.to_device(to_bf16_bits(self.x_host).view(np.uint32))
        self.out = cuda.device_array(int(self.o_off[-1]), np.float32)
        self.counter = cuda.to_device(np.zeros(1, np.int32))
        self.status = cuda.to_device(np.zeros(1, np.int32))

    @property
    def bytes(self) -> int:
        return int(self.w_off[-1]) * 4

    def table(self, rows: int, warps_in_grid: int):
        t = np.array([(self.w_off[i], n, k // 2, k_parts(n, k, rows, warps_in_grid), self.x_off[i], self.o_off[i])
                      for i, (n, k) in enumerate(self.shapes)], dtype=np.int64)
        return cuda.to_device(t)

    def call(self, rows: int, stages: int, warps: int, carry: bool, blocks: int, barrier: bool = True):
        """The launches of one chain run (zeroing, then the chain), for ``time_calls`` or a direct call."""
        kern = chain_kernel(rows, stages, warps, carry, barrier)
        table = self.table(rows, blocks * warps)
        shared = 4 * 128 * -(-max(k for _, k in self.shapes) // 256)

        def run():
            launch(zero_chain_state, 64, 256, self.out, self.counter, self.status)
            launch(kern, blocks, warps * WARP, self.w, table, self.x, self.out, self.counter, self.status,
                   shared=shared)
        return run

    def reference(self) -> np.ndarray:
        """``W_m @ x_m`` of every matrix (f32 of the bf16 values), concatenated."""
        w = from_bf16_bits(to_bf16_bits(self.w_host))
        x = from_bf16_bits(to_bf16_bits(self.x_host))
        outs = []
        for i, (n, k) in enumerate(self.shapes):
            wm = w[2 * self.w_off[i]:2 * self.w_off[i + 1]].reshape(n, k)
            outs.append(wm @ x[2 * self.x_off[i]:2 * self.x_off[i + 1]])
        return np.concatenate(outs)


def step_shapes(model: str) -> list[tuple[int, int]]:
    """Every projection of a decode step in order, as ``bench_decode_stream.MODELS`` lists them per layer."""
    from bench_decode_stream import MODELS
    m = MODELS[model]
    per_layer = [(n, k) for n, k, _, _ in m["shapes"].values()]
    return per_layer * m["layers"] + [(m["vocab"], m["hidden"])]


GEOMETRIES = [(2, 4), (2, 6), (4, 3), (4, 4)]
"""(rows per warp, ring depth) pairs timed: the engine's tuned one-token GEMVs use these."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="4b", choices=["4b", "8b", "3.5-4b"])
    ap.add_argument("--warps", type=int, default=8, help="warps per block (2 blocks per SM at 8)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if SIMULATOR:
        print("bench_projection_chain needs a GPU (its grid barrier needs every block resident at once); "
              "tests/test_cli.py checks the kernel in the simulator with one block")
        return 0
    from bench_decode_stream import MODELS, Projection, step_calls
    from graph_timing import time_calls
    from pegainfer.kernels.memory import measure_read_bandwidth

    read_bw = measure_read_bandwidth(2 << 30)
    m = MODELS[args.model]
    rows: list[dict] = []
    chain = Chain(step_shapes(args.model))
    floor = chain.bytes / read_bw
    print(f"model {args.model}: {len(chain.shapes)} matrices, {chain.bytes / 1e9:.2f} GB; read bandwidth "
          f"{read_bw / 1e9:.0f} GB/s; floor {floor * 1e3:.3f} ms")

    def report(label, sec, **extra):
        rows.append(dict(label=label, ms=sec * 1e3, floor_ms=floor * 1e3, pct=100 * floor / sec, **extra))
        print(f"  {label:34s} {sec * 1e3:7.3f} ms/token  {100 * floor / sec:5.1f}% of floor")

    projs = [Projection(name, *shape, layers=m["layers"], hidden=m["hidden"]) for name, shape in m["shapes"].items()]
    head = Projection("lm_head", m["vocab"], m["hidden"], False, True, layers=1, hidden=m["hidden"])
    calls = step_calls(projs, head, m["layers"], {})
    report("launches (engine GEMVs, one graph)", time_calls(calls, reps=5) * len(calls))
    del projs, head, calls

    blocks = lin._sm_count() * (lin.WARPS_PER_SM // args.warps)
    for r, s in GEOMETRIES:
        for carry, barrier in ((False, True), (True, True), (True, False)):
            run = chain.call(r, s, args.warps, carry, blocks, barrier)
            sec = time_calls([run], reps=5)
            status = int(chain.status.copy_to_host()[0])
            label = f"chain rows={r} stages={s} " + (f"carry={'yes' if carry else 'no'}" if barrier else "no barriers")
            if status:
                print(f"  {label}: a grid barrier gave up (blocks not all resident?): not timed")
                continue
            report(label, sec, rows_per_warp=r, stages=s, carry=carry, barrier=barrier, blocks=blocks,
                   warps=args.warps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, read_bw_GBps=read_bw / 1e9, bytes=chain.bytes, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
