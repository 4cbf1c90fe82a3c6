"""How much host time does one eager kernel launch take?

A step that is not replayed from a CUDA graph (a mixed step of decodes and prompt chunks, a prompt chunk longer than
the largest captured bucket) launches every kernel from Python, ~500 for a Qwen3-4B forward pass, and if each launch
costs more host time than its kernel runs, the GPU waits for Python.  This times the host side of launches whose
GPU work is trivial (the host is then the bottleneck): µs per launch, median of rounds of ``--launches`` launches,
the stream synchronised once a round, for

* numba's own launch (``kernel[grid, block, stream](...)``) of a kernel with 2 and with 8 array arguments;
* ``pegainfer.kernels.launch.launch`` of the same kernels, without and with programmatic dependent launch (PDL);
* the same with 64 KB of dynamic shared memory (the opt-in path the tensor-core kernels take);
* the real entry points, timed the same way: ``linear`` on 64 tokens (the Hopper GEMM and its split-K), an RMSNorm,
  ``paged_attention`` of a decode batch.

Without a GPU it runs as a smoke test in the simulator (launches there are Python threads: the times mean nothing).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_timing  # noqa: E402,F401  (puts the checkout on sys.path)

import numpy as np  # noqa: E402

import pegainfer  # noqa: E402,F401  (before numba: it picks the GPU or the simulator)
from numba import cuda  # noqa: E402  (a module global: the simulator swaps it inside its launches)
from numba import types as nbtypes  # noqa: E402


def build_kernels():
    from pegainfer.kernels.primitives import kernel, pdl_prologue, uint32

    @kernel
    def touch2(a, b):
        """Two array arguments; each thread of block 0 copies one word (after the PDL wait when launched so)."""
        pdl_prologue()
        i = cuda.threadIdx.x
        if cuda.blockIdx.x == 0 and i < a.shape[0]:
            b[i] = a[i] + uint32(1)

    @kernel
    def touch8(a, b, c, d, e, f, g, h):
        """Eight array arguments, the same work."""
        pdl_prologue()
        i = cuda.threadIdx.x
        if cuda.blockIdx.x == 0 and i < a.shape[0]:
            b[i] = a[i] + c[i] + d[i] + e[i] + f[i] + g[i] + h[i]

    @kernel
    def touch_shared(a, b):
        """Two arrays and dynamic shared memory."""
        pdl_prologue()
        s = cuda.shared.array(0, nbtypes.uint32)
        i = cuda.threadIdx.x
        s[i] = a[i]
        cuda.syncthreads()
        if cuda.blockIdx.x == 0:
            b[i] = s[i] + uint32(1)

    return touch2, touch8, touch_shared


def time_launches(fn, launches: int, rounds: int, stream) -> float:
    """Median µs of host time per call of ``fn`` over ``rounds`` rounds of ``launches`` calls (one sync a round)."""
    fn()
    stream.synchronize()
    per = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(launches):
            fn()
        per.append((time.perf_counter() - t) / launches * 1e6)
        stream.synchronize()
    return statistics.median(per)


def run(args) -> dict:
    import pegainfer
    from pegainfer.kernels.launch import launch, on_stream
    from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy

    touch2, touch8, touch_shared = build_kernels()
    n = 256
    arrays = [cuda.to_device(np.arange(n, dtype=np.uint32)) for _ in range(8)]
    a, b = arrays[0], arrays[1]
    stream = cuda.stream()
    pdl = LaunchPolicy(pdl=None)                         # every launch named may overlap
    shared = 64 * 1024 if not pegainfer.SIMULATOR else 1024
    rows = []

    def add(name, fn):
        with on_stream(stream):
            us = time_launches(fn, args.launches, args.rounds, stream)
        rows.append({"launch": name, "us_per_launch": us})
        print(f"  {name:58s} {us:8.1f} µs", flush=True)

    print(f"{pegainfer.device.describe()}; {args.launches} launches a round, median of {args.rounds} rounds "
          "(host time per launch)", flush=True)
    add("numba kernel[grid, block, stream](2 arrays)", lambda: touch2[1, 32, stream](a, b))
    add("numba kernel[grid, block, stream](8 arrays)", lambda: touch8[1, 32, stream](*arrays))
    add("launch(), 2 arrays", lambda: launch(touch2, 1, 32, a, b))
    add("launch(), 8 arrays", lambda: launch(touch8, 1, 32, *arrays))
    add("launch() with PDL, 2 arrays", lambda: launch(touch2, 1, 32, a, b, name="touch", policy=pdl))
    add("launch() with PDL, 8 arrays", lambda: launch(touch8, 1, 32, *arrays, name="touch", policy=pdl))
    add(f"launch(), {shared // 1024} KB dynamic shared memory",
        lambda: launch(touch_shared, 1, 256, a, b, shared=shared))
    add(f"launch() with PDL, {shared // 1024} KB dynamic shared memory",
        lambda: launch(touch_shared, 1, 256, a, b, shared=shared, name="touch", policy=pdl))

    # the real entry points a forward pass calls (each one launch or two)
    from pegainfer.kernels import norm
    from pegainfer.kernels.linear import linear, linear_workspace_size
    T, K, N = (64, 2560, 6144) if not pegainfer.SIMULATOR else (17, 64, 48)
    x = cuda.to_device(np.zeros((T, K), np.uint16))
    w = cuda.to_device(np.zeros((N, K), np.uint16))
    out = cuda.device_array((T, N), np.uint16)
    ws = cuda.device_array(linear_workspace_size(T, [(N, K, False)]), np.float32)
    add(f"linear() T={T} ({N}x{K}, default path, workspace)", lambda: linear(x, w, out, workspace=ws))
    nw = cuda.to_device(np.zeros(K, np.uint16))
    xo = cuda.device_array((T, K), np.uint16)
    add(f"norm.rms_norm() T={T}", lambda: norm.rms_norm(x, nw, xo, 1e-6, policy=DEFAULT_POLICY))
    return {"device": pegainfer.device.describe(), "simulator": pegainfer.SIMULATOR, "launches": args.launches,
            "rounds": args.rounds, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=None, help="launches a round (default 500; 3 in the simulator)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 5; 1 in the simulator)")
    ap.add_argument("--json", default=None, help="write the measurements here")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import pegainfer
    sim = pegainfer.SIMULATOR
    args.launches = args.launches or (3 if sim else 500)
    args.rounds = args.rounds or (1 if sim else 5)
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
