"""How fast is one Gated DeltaNet layer's chunked delta rule on a prompt: the tensor-core kernels
(``gated_delta.chunked_mma``) at their default launch geometry and at forced ones, with a correctness check.

Qwen3.5-4B's heads (16 key / 32 value heads × 128, chunks of 64), one prompt of 2048 and 8192 tokens (``--tokens``)
continuing from a random state: µs per layer (prepare + scan; times from CUDA-graph replays of ``--calls`` calls) and
what 24 such layers (Qwen3.5-4B's Gated DeltaNet layers) add to a prompt.  ``--geometry W,S`` (repeatable) also
times the kernels with W warps a scan block and S stages (``gated_delta.ChunkGeometry``; ``W,S,P``: and a key
head's value heads over P prepare blocks), with their speed-up over the default geometry.  The check runs each geometry once from the same state and compares outputs and final states
with the token-by-token reference kernel: relative L2 of states and outputs, the share of bf16 outputs bit-equal.
``--trace`` prints the time of each kernel of one eager call of each geometry (the launch tracer), so prepare and
scan show apart.

``--decode-batch 1,64,256`` times the fused decode step instead (``gated_delta.gated_delta_decode_step``, one token
of B sequences, launched alone: no PDL overlap), against its floor: each sequence's f32 state of every value head is
read and written back once, ``2 · B · Hv · Dk · Dv · 4`` bytes over the read bandwidth measured in the same run.  Its
check: the decode launch's outputs and states bit for bit against the general path's (no ``decode_token_slots``).

    python benchmarks/bench_gated_delta.py [--tokens 2048,8192] [--geometry 1,2 --geometry 4,2,1] [--trace] [--json F]
    python benchmarks/bench_gated_delta.py --decode-batch 1,64,256 [--json F]

Without a GPU it runs as a smoke test in the simulator (tiny heads, 40 tokens, chunks of 16, wall-clock times).
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
HEADS = dict(num_k_heads=16, num_v_heads=32, key_dim=128, value_dim=128)   # Qwen3.5-4B's linear attention
CHUNK = 64
TOKENS = (2048, 8192)
LAYERS = 24
if SIM:
    HEADS, CHUNK, TOKENS = dict(num_k_heads=1, num_v_heads=2, key_dim=16, value_dim=16), 16, (40,)


class Layer:
    """One layer's rule inputs on the device for one prompt of ``T`` tokens: qkv ``[T, 2·Hk·Dk + Hv·Dv]``, a, b
    ``[T, Hv]`` (bf16 bits of N(0, 1) values, b × 2), a_log / dt_bias as the tests draw them, a state ``[1, Hv, Dk,
    Dv]`` of N(0, 0.05²) values (``reset`` puts it back)."""

    def __init__(self, rng, T):
        from numba import cuda
        hk, hv, kd, vd = (HEADS[k] for k in ("num_k_heads", "num_v_heads", "key_dim", "value_dim"))
        self.hk, self.hv, self.T = hk, hv, T
        bits = lambda shape, scale=1.0: (np.asarray(rng.standard_normal(shape) * scale, np.float32)  # noqa: E731
                                         .view(np.uint32) >> 16).astype(np.uint16)
        self.qkv = cuda.to_device(bits((T, 2 * hk * kd + hv * vd)))
        self.a = cuda.to_device(bits((T, hv)))
        self.b = cuda.to_device(bits((T, hv), 2.0))
        self.a_log = cuda.to_device(np.log(rng.uniform(0.05, 2.0, hv)).astype(np.float32))
        self.dt_bias = cuda.to_device(rng.uniform(-1.0, 1.0, hv).astype(np.float32))
        self.state0 = (rng.standard_normal((1, hv, kd, vd)) * 0.05).astype(np.float32)
        self.state = cuda.to_device(self.state0)
        self.slots = cuda.to_device(np.zeros(1, np.int32))
        self.offsets = cuda.to_device(np.array([0, T], np.int32))
        self.out = cuda.device_array((T, hv * vd), np.uint16)

    def reset(self):
        self.state.copy_to_device(self.state0)

    def args(self):
        return (self.qkv, self.a, self.b, self.a_log, self.dt_bias, self.state, self.slots, self.offsets, self.out)

    def reference(self):
        """A function that runs the token-by-token reference kernel on this layer."""
        from pegainfer.kernels.gated_delta import reference_gated_delta
        return lambda: reference_gated_delta(*self.args())

    def chunked(self, geometry=None):
        """A function that runs the chunked kernels on this layer (at ``geometry``; None: the default)."""
        from pegainfer.kernels.gated_delta import allocate_chunk_scratch, gated_delta_chunked
        scratch = allocate_chunk_scratch(self.T, self.hk, self.hv, CHUNK)
        options = dict(geometry=geometry) if geometry is not None else {}
        return lambda: gated_delta_chunked(*self.args(), scratch, max_seq_tokens=self.T, **options)

    def result(self, fn):
        """(out as float64, final state) of one run of ``fn`` from the initial state."""
        from pegainfer.kernels.primitives import from_bf16_bits
        self.reset()
        fn()
        return from_bf16_bits(self.out.copy_to_host()).astype(np.float64), self.state.copy_to_host()


class DecodeBatch:
    """One layer's decode-step inputs on the device for ``B`` sequences of one token each, at position ``POSITION``:
    the in_proj outputs (x ``[B, 2·Hk·Dk + Hv·Dv]``, z ``[B, Hv·Dv]``, a, b ``[B, Hv]``), the conv weights and ring,
    the norm weights and a state ``[B, Hv, Dk, Dv]`` of N(0, 0.05²) values (``reset`` puts it and the ring back)."""

    POSITION = 100
    TAPS = 4

    def __init__(self, rng, B, state_dtype: str = "float32"):
        from numba import cuda
        hk, hv, kd, vd = (HEADS[k] for k in ("num_k_heads", "num_v_heads", "key_dim", "value_dim"))
        self.B, self.hv, self.kd, self.vd = B, hv, kd, vd
        channels = 2 * hk * kd + hv * vd
        bits = lambda shape, scale=1.0: (np.asarray(rng.standard_normal(shape) * scale, np.float32)  # noqa: E731
                                         .view(np.uint32) >> 16).astype(np.uint16)
        self.x, self.z = cuda.to_device(bits((B, channels))), cuda.to_device(bits((B, hv * vd)))
        self.a, self.b = cuda.to_device(bits((B, hv))), cuda.to_device(bits((B, hv), 2.0))
        self.conv_weight = cuda.to_device(bits((channels, self.TAPS), 0.5))
        self.ring0 = bits((B, channels, self.TAPS))
        self.ring = cuda.to_device(self.ring0)
        self.norm_weight = cuda.to_device(bits((vd,), 0.5))
        self.a_log = cuda.to_device(np.log(rng.uniform(0.05, 2.0, hv)).astype(np.float32))
        self.dt_bias = cuda.to_device(rng.uniform(-1.0, 1.0, hv).astype(np.float32))
        self.state0 = (rng.standard_normal((B, hv, kd, vd)) * 0.05).astype(np.float32)
        if state_dtype == "bfloat16":      # the state kept as bf16 bits (--mamba-ssm-cache-dtype bfloat16)
            self.state0 = (self.state0.view(np.uint32) >> 16).astype(np.uint16)
        self.state = cuda.to_device(self.state0)
        self.slots = cuda.to_device(np.arange(B, dtype=np.int32))
        self.offsets = cuda.to_device(np.arange(B + 1, dtype=np.int32))
        self.positions = cuda.to_device(np.full(B, self.POSITION, np.int32))
        self.out = cuda.device_array((B, hv * vd), np.uint16)

    @property
    def state_bytes(self) -> int:
        """What the step must move at least: every state read and written back once."""
        return 2 * self.state0.nbytes

    def reset(self):
        self.state.copy_to_device(self.state0)
        self.ring.copy_to_device(self.ring0)

    def step(self, decode: bool):
        """A function that runs the fused step once: as a decode step (``decode_token_slots``; no PDL, so
        repeated launches do not overlap) or through the general path."""
        from pegainfer.kernels.gated_delta import gated_delta_decode_step
        from pegainfer.kernels.policy import LaunchPolicy
        policy = LaunchPolicy(pdl=frozenset())
        return lambda: gated_delta_decode_step(self.x, self.conv_weight, self.ring, self.z, self.a, self.b,
                                               self.a_log, self.dt_bias, self.norm_weight, 1e-6, self.state,
                                               self.slots, self.offsets, self.positions, self.out,
                                               decode_token_slots=self.slots if decode else None, policy=policy)

    def result(self, fn):
        """(out bits, final state) of one run of ``fn`` from the initial state and ring."""
        self.reset()
        fn()
        return self.out.copy_to_host(), self.state.copy_to_host()


def run_decode(batches, calls: int, state_dtypes=("float32",)) -> list[dict]:
    """Time the fused decode step at each batch size and state dtype against its state floor (module
    docstring)."""
    read_bw = float("nan")
    if not SIM:
        from pegainfer.kernels.memory import measure_read_bandwidth
        read_bw = measure_read_bandwidth(2 << 30)
    print(f"heads {HEADS}; the fused decode step alone, per layer "
          f"({'simulator: wall clock' if SIM else 'CUDA-graph replays'}); read bandwidth {read_bw / 1e9:.0f} GB/s")
    print(f"{'B':>5s} {'state':>8s} {'us/layer':>10s} {'x24 ms':>8s} {'state MB':>9s} {'GB/s':>8s} {'% read':>7s}  "
          f"{'out bit-eq':>10s} {'state bit-eq':>12s}")
    rng = np.random.default_rng(0)
    rows = []
    for B, dtype in [(B, d) for B in batches for d in state_dtypes]:
        layer = DecodeBatch(rng, B, dtype)
        general_out, general_state = layer.result(layer.step(decode=False))
        fn = layer.step(decode=True)
        out, state = layer.result(fn)
        sec = time_calls([fn] * (1 if SIM else calls))
        row = dict(B=B, state_dtype=dtype, us=sec * 1e6, state_bytes=layer.state_bytes,
                   GBps=layer.state_bytes / sec / 1e9, pct_read=100 * layer.state_bytes / sec / read_bw, out_bit_equal=float(np.mean(out == general_out)),
                   state_bit_equal=float(np.mean(state == general_state)))
        rows.append(row)
        pct = f"{row['pct_read']:6.1f}%" if row["pct_read"] == row["pct_read"] else "      -"
        print(f"{B:5d} {dtype:>8s} {row['us']:10.1f} {sec * 1e3 * LAYERS:8.2f} {layer.state_bytes / 1e6:9.1f} "
              f"{row['GBps']:8.0f} {pct}  {row['out_bit_equal']:10.4f} {row['state_bit_equal']:12.4f}", flush=True)
        del layer
    return rows


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def trace_call(fn):
    """Per-kernel GPU times (µs) of one eager call of ``fn`` through the launch tracer: [(kernel name, µs)]."""
    from numba import cuda

    from pegainfer.kernels import launch as launch_module
    times = []

    class Timer:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            self.start, self.end = cuda.event(), cuda.event()
            self.start.record()

        def __exit__(self, *exc):
            self.end.record()
            self.end.synchronize()
            times.append((self.name, cuda.event_elapsed_time(self.start, self.end) * 1e3))

    fn()     # compiled and warm
    cuda.synchronize()
    with launch_module.traced(Timer):
        fn()
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", help="prompt lengths, comma-separated (default: %s)" % ",".join(map(str, TOKENS)))
    ap.add_argument("--geometry", action="append", default=[], metavar="W,S[,P]",
                    help="also time the kernels with W warps a scan block, S stages and P prepare blocks a key "
                         "head (ChunkGeometry.prepare_split; default 0: by the launch's size)")
    ap.add_argument("--calls", type=int, default=3, help="calls a CUDA-graph replay times (default 3)")
    ap.add_argument("--trace", action="store_true",
                    help="print each kernel's time of one eager call of each geometry")
    ap.add_argument("--decode-batch", metavar="B[,B...]",
                    help="time the fused decode step at these batch sizes instead (e.g. 1,64,256)")
    ap.add_argument("--state-dtype", default="float32", metavar="D[,D...]",
                    help="with --decode-batch: the state's dtypes, float32 and/or bfloat16 (default float32)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.decode_batch:
        dtypes = args.state_dtype.split(",")
        if not set(dtypes) <= {"float32", "bfloat16"}:
            ap.error(f"--state-dtype {args.state_dtype}: float32 and/or bfloat16")
        rows = run_decode([int(b) for b in args.decode_batch.split(",")], args.calls, dtypes)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(heads=HEADS, decode_rows=rows), f, indent=1)
        return 0
    from pegainfer.kernels.gated_delta import ChunkGeometry, chunk_geometry
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(TOKENS)
    forced = [ChunkGeometry(CHUNK, *map(int, g.split(","))) for g in args.geometry]
    default = chunk_geometry(HEADS["key_dim"], HEADS["value_dim"], CHUNK)
    rng = np.random.default_rng(0)
    rows = []
    print(f"heads {HEADS}, chunk {CHUNK}; default geometry {tuple(default)}; times per layer "
          f"({'simulator: wall clock' if SIM else 'CUDA-graph replays'}); (warps, stages) of the scan, prepare blocks a key head (0: by size)")
    print(f"{'T':>6s}  {'geometry':22s} {'us/layer':>10s} {'x24 ms':>8s} {'speed-up':>8s}  {'state vs ref':>12s} "
          f"{'out vs ref':>10s} {'out bit-eq':>10s}")
    for T in tokens:
        layer = Layer(rng, T)
        ref_out, ref_state = layer.result(layer.reference())
        runs = [(f"{tuple(default)[1:]} default", None)] + [(f"{tuple(g)[1:]}", g) for g in forced]
        base = None
        for label, geo in runs:
            fn = layer.chunked(geo)
            out, state = layer.result(fn)
            sec = time_calls([fn] * (1 if SIM else args.calls))
            base = base or sec
            row = dict(T=T, geometry=label, us=sec * 1e6, speedup=base / sec, state_rel_l2=rel_l2(state, ref_state),
                       out_rel_l2=rel_l2(out, ref_out), out_bit_equal=float(np.mean(out == ref_out)))
            rows.append(row)
            print(f"{T:6d}  {label:22s} {row['us']:10.1f} {sec * 1e3 * LAYERS:8.2f} {row['speedup']:8.2f}  "
                  f"{row['state_rel_l2']:12.2e} {row['out_rel_l2']:10.2e} {row['out_bit_equal']:10.4f}", flush=True)
            if args.trace and not SIM:
                row["kernels_us"] = trace_call(fn)
                print("          " + ", ".join(f"{name} {us:.1f} us" for name, us in row["kernels_us"]), flush=True)
        del layer
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(heads=HEADS, chunk=CHUNK, default_geometry=list(default), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
