"""Where does a decode step's time go, kernel by kernel, *inside the CUDA graph*?  Replays the model's batch-1 decode
step captured as a graph under the CUDA profiling interface (CUPTI, through ``torch.profiler``: torch is only the
tracer here, it runs nothing) and prints, per kernel family, how long its kernels run and how much each one moves
the step's end (``wall``: from the previous kernel's end to this one's; with PDL kernels overlap, so a kernel that
finishes under the previous one's tail adds little).  The per-family ``wall`` column sums to the step time.

Usage (GPU host with torch):  python benchmarks/profile_step.py --model-path DIR [--context 128] [--steps 20]
    [--trace out.json]   (the raw Chrome trace, opens in Perfetto)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pegainfer  # noqa: F401,E402


def short_name(name: str) -> str:
    """The Python function name of a numba kernel as the profiler shows it, demangled
    (``pegainfer::kernels::linear::_gemv_decode_kernel::_3clocals_3e::gemv_decode[abi:..](Array<..>, ..)`` ->
    ``gemv_decode``) or mangled (``_ZN6cudapy9pegainfer..11gemv_decode..``)."""
    if name.startswith("_ZN"):
        parts, i = [], 3
        while (m := re.match(r"(\d+)", name[i:])):
            n = int(m.group(1))
            i += len(m.group(1))
            parts.append(name[i:i + n])
            i += n
    else:
        parts = name.split("(")[0].split("[")[0].split("::")
    names = [p for p in parts if p and not p.startswith("_3c")]
    return names[-1] if names else name[-48:]


def kernel_events(prof, path: str) -> list[tuple[str, float, float]]:
    """(short name + grid x block, start µs, end µs) of every GPU kernel in the profiler's Chrome trace (written to ``path``), in
    start order."""
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") != "kernel":
            continue
        a = e.get("args", {})
        geo = f" {a['grid'][0]}x{a['block'][0]}" if "grid" in a and "block" in a else ""
        out.append((short_name(e["name"]) + geo, float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    out.sort(key=lambda r: r[1])
    return out


def attribute(kernels):
    """Per kernel: (name, start, dur, gap before it, wall = end - previous end)."""
    rows, prev_end = [], None
    for name, s, e in kernels:
        gap = 0.0 if prev_end is None else s - prev_end
        wall = e - s if prev_end is None else e - prev_end
        rows.append((name, s, e - s, gap, wall))
        prev_end = e if prev_end is None else max(prev_end, e)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="decode steps in the profiled graph")
    ap.add_argument("--trace", default=None, help="also write the raw Chrome trace here")
    ap.add_argument("--layer", type=int, default=None, help="print this layer's kernels one by one (default: middle)")
    args = ap.parse_args()

    from pegainfer.device import SIMULATOR
    if SIMULATOR:
        print("profile_step.py needs a GPU: it reads the CUDA profiling interface's kernel records")
        return 2
    from torch.profiler import ProfilerActivity, profile

    from graph_timing import captured, last_decode_step
    from pegainfer.kernels.launch import on_stream

    engine, step = last_decode_step(args.model_path, args.context)
    runner = engine.runner
    with on_stream(runner.stream), captured([step] * args.steps) as replay:
        replay()
        replay()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay()
    import tempfile
    kernels = kernel_events(prof, args.trace or tempfile.mktemp(suffix=".json"))
    if not kernels:
        print("no kernel events recorded (CUPTI unavailable?)")
        return 1
    per_step = len(kernels) // args.steps
    rows = attribute(kernels)
    total = (kernels[-1][2] - kernels[0][1]) / args.steps
    fam = collections.OrderedDict()
    for name, _, dur, gap, wall in rows:
        f = fam.setdefault(name, [0, 0.0, 0.0, 0.0])
        f[0] += 1
        f[1] += dur
        f[2] += gap
        f[3] += wall
    n = args.steps
    print(f"\n{engine.model_name}: context {args.context}, {per_step} kernels per step, step {total:.1f} us "
          f"(graph of {n} steps, CUPTI)")
    print(f"{'kernel':34s} {'per step':>8s} {'dur us':>8s} {'gap us':>8s} {'wall us':>8s} {'wall/step':>10s}")
    for name, (c, d, g, w) in sorted(fam.items(), key=lambda kv: -kv[1][3]):
        print(f"{name[:34]:34s} {c / n:8.1f} {d / c:8.2f} {g / c:8.2f} {w / c:8.2f} {w / n:10.1f}")
    # two layers' worth of kernels, one by one, from the middle of the second profiled step
    step2 = rows[per_step:2 * per_step] if args.steps > 1 else rows
    n_layers = int(getattr(engine.model, "L", 0) or 1)
    k = max(1, round(per_step / n_layers))
    li = args.layer if args.layer is not None else n_layers // 2
    lo = min(len(step2) - 1, 1 + li * k)
    print(f"\nstep 2, kernels {lo}..{lo + 2 * k - 1} (~layer {li}): start, dur, gap before, wall (us)")
    t0 = step2[lo][1]
    for name, s, dur, gap, wall in step2[lo:lo + 2 * k]:
        print(f"  {name[:34]:34s} {s - t0:8.2f} {dur:8.2f} {gap:8.2f} {wall:8.2f}")
    tail = step2[-6:]
    print("step 2, last kernels:")
    for name, s, dur, gap, wall in tail:
        print(f"  {name[:34]:34s} {s - t0:8.2f} {dur:8.2f} {gap:8.2f} {wall:8.2f}")
    return 0


if __name__ == "__main__":
    code = main()
    # torch's profiler (CUPTI) and numba both hold the CUDA context; their teardown at interpreter exit has aborted
    # with "double free or corruption" after the tables were printed (H200, session 13).  Everything is written by
    # now: leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
