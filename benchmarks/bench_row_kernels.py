"""How fast are the kernels between a prompt chunk's projections: qk-norm + RoPE + KV store
(``rope.qk_norm_rope_store``) at each number of heads a warp takes, and the residual add + RMSNorm
(``norm.add_rms_norm_into``), alone, at the token counts of decode batches and prompt chunks?

Qwen3-4B's shapes (32 q / 8 kv heads × 128, hidden 2560), bf16 bits of random values; each launch on its own inputs
(``--layers`` copies, so reads come from HBM), times from CUDA-graph replays (``graph_timing.time_calls``), µs per
launch.  The RoPE rows also check that every heads-per-warp choice writes the bits of one head a warp (q, and the K
/ V pages), and mark the choice ``choose_heads_per_warp`` makes; the norm rows give the bandwidth of the four rows
it moves (residual and delta read, the sum and the normalized row written).

    python benchmarks/bench_row_kernels.py [--tokens 64,512,2112,8192] [--layers 8] [--json F]

Without a GPU it runs as a smoke test in the simulator (tiny heads, a few tokens, wall-clock times).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_timing  # noqa: E402  (puts the checkout on sys.path)
from graph_timing import time_calls  # noqa: E402

import numpy as np  # noqa: E402

import pegainfer  # noqa: E402

SIM = pegainfer.SIMULATOR
NQ, NKV, D, HIDDEN = 32, 8, 128, 2560           # Qwen3-4B
TOKENS = (64, 512, 2112, 8192)
PAGE = 16
if SIM:
    NQ, NKV, D, HIDDEN, TOKENS = 8, 4, 32, 64, (3, 5)


def bits(rng, shape, lo=0x3C00, hi=0x4000):
    """bf16 bits of values in [1, 2) (a norm or a rotation of them stays finite)."""
    return rng.integers(lo, hi, shape).astype(np.uint16)


class RopeInputs:
    """One layer's qk-norm/RoPE inputs for ``T`` tokens of one sequence slot per 4096 positions: qkv ``[T, (NQ +
    2·NKV)·D]``, shuffled pages, q out ``[T, NQ, D]``."""

    def __init__(self, rng, T, cos, sin, norm_w):
        from numba import cuda
        self.cos, self.sin, self.w = cos, sin, norm_w
        self.qkv = cuda.to_device(bits(rng, (T, (NQ + 2 * NKV) * D)))
        positions = np.arange(T) % 4096
        slots = np.arange(T) // 4096
        pages_per_slot = 4096 // PAGE
        num_pages = pages_per_slot * (int(slots[-1]) + 1)
        self.tables = cuda.to_device(rng.permutation(num_pages).reshape(-1, pages_per_slot).astype(np.int32))
        self.positions = cuda.to_device(positions.astype(np.int32))
        self.slots = cuda.to_device(slots.astype(np.int32))
        self.k = cuda.to_device(np.zeros((num_pages, PAGE, NKV, D), np.uint16))
        self.v = cuda.to_device(np.zeros((num_pages, PAGE, NKV, D), np.uint16))
        self.q = cuda.device_array((T, NQ, D), np.uint16)

    def run(self, heads_per_warp):
        from pegainfer.kernels.rope import qk_norm_rope_store
        qk_norm_rope_store(self.qkv, self.w, self.w, self.cos, self.sin, self.positions, self.slots, self.tables,
                           self.k, self.v, self.q, 1e-6, D, heads_per_warp=heads_per_warp)

    def outputs(self):
        return self.q.copy_to_host(), self.k.copy_to_host(), self.v.copy_to_host()


def rope_rows(rng, tokens, layers):
    from numba import cuda

    from pegainfer.kernels.rope import choose_heads_per_warp, rope_tables
    cos, sin = (cuda.to_device(t) for t in rope_tables(4096, D, 1e6))
    norm_w = cuda.to_device(bits(rng, D, 0x3F00, 0x3F90))
    choices = [h for h in (1, 2, 4) if NQ % h == 0 and NKV % h == 0]
    rows = []
    for T in tokens:
        inputs = [RopeInputs(rng, T, cos, sin, norm_w) for _ in range(layers)]
        one_head = None
        for hpw in choices:
            inputs[0].run(hpw)
            got = inputs[0].outputs()
            if one_head is None:
                one_head = got
            same = all(np.array_equal(a, b) for a, b in zip(got, one_head))
            us = time_calls([lambda x=x, h=hpw: x.run(h) for x in inputs]) * 1e6
            rows.append({"kernel": "qk_norm_rope_store", "tokens": T, "heads_per_warp": hpw, "us": us,
                         "bits_of_one_head": same, "chosen": hpw == choose_heads_per_warp(T, NQ, NKV)})
    return rows


def norm_rows(rng, tokens, layers):
    from numba import cuda

    from pegainfer.kernels.norm import add_rms_norm_into
    rows = []
    weight = cuda.to_device(bits(rng, HIDDEN, 0x3F00, 0x3F90))
    for T in tokens:
        residual = [cuda.to_device(bits(rng, (T, HIDDEN))) for _ in range(layers + 1)]
        delta = [cuda.to_device(bits(rng, (T, HIDDEN))) for _ in range(layers)]
        normed = cuda.device_array((T, HIDDEN), np.uint16)
        us = time_calls([lambda i=i: add_rms_norm_into(residual[i], delta[i], weight, residual[i + 1], normed, 1e-6)
                         for i in range(layers)]) * 1e6
        rows.append({"kernel": "add_rms_norm_into", "tokens": T, "us": us,
                     "gb_s": 4 * T * HIDDEN * 2 / us / 1e3})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=None, help="token counts, comma-separated (default: %s)"
                    % ",".join(map(str, TOKENS)))
    ap.add_argument("--layers", type=int, default=2 if SIM else 8, help="inputs per shape, each launch its own")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(TOKENS)
    rng = np.random.default_rng(0)
    rows = rope_rows(rng, tokens, args.layers) + norm_rows(rng, tokens, args.layers)
    print(f"{'simulator (wall clock) ' if SIM else ''}Qwen3-4B shapes: {NQ} q / {NKV} kv heads x {D}, hidden {HIDDEN}")
    print(f"{'kernel':<20}{'tokens':>8}{'heads/warp':>12}{'us':>10}   note")
    for r in rows:
        if r["kernel"] == "qk_norm_rope_store":
            note = ("chosen" if r["chosen"] else "") + ("" if r["bits_of_one_head"] else "  DIFFERS from 1 head a warp")
            print(f"{r['kernel']:<20}{r['tokens']:>8}{r['heads_per_warp']:>12}{r['us']:>10.1f}   {note}")
        else:
            print(f"{r['kernel']:<20}{r['tokens']:>8}{'-':>12}{r['us']:>10.1f}   {r['gb_s']:.0f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"simulator": SIM, "rows": rows}, indent=1))
    return 0 if all(r.get("bits_of_one_head", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
