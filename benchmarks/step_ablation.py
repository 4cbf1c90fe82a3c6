"""Where does a batch-1 decode step's GPU time go?  Time the real model's decode step as one CUDA graph, then
again with whole kernel families replaced by nothing (their outputs are then stale, which does not change the time
of what remains): the difference is what that family costs *inside the graph* (kernel time plus its launch gap),
which per-kernel event timing of an eager step cannot give for kernels of a few microseconds.

Usage (GPU host):  python benchmarks/step_ablation.py --model-path DIR [--context 128] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json

import pegainfer  # noqa: F401
from graph_timing import last_decode_step, time_calls
from pegainfer.kernels import attention, embedding, gated_delta, rope, sampling
from pegainfer.kernels.launch import on_stream

FAMILIES = {
    "qk_norm_rope": (rope, "qk_norm_rope_store"),
    "attention": (attention, "paged_attention"),
    "gated_delta_step": (gated_delta, "gated_delta_decode_step"),
    "embedding": (embedding, "embedding"),
    "sampling": (sampling, "sample"),
}


@contextlib.contextmanager
def without(names):
    """Replace the launch wrappers of the named families by no-ops (the models call them through the module)."""
    saved = [(mod, attr, getattr(mod, attr)) for n in names for mod, attr in [FAMILIES[n]]]
    try:
        for mod, attr, _ in saved:
            setattr(mod, attr, lambda *a, **k: None)
        yield
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--context", type=int, default=128, help="tokens already in the KV cache")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine, step = last_decode_step(args.model_path, args.context)
    runner = engine.runner
    latency_bound = ("qk_norm_rope", "attention") + (("gated_delta_step",) if engine.model.arch == "qwen3_5" else ())
    variants = [("full step", ())] + [(f"- {n}", (n,)) for n in latency_bound] + [
        ("- " + " - ".join(latency_bound), latency_bound),
        ("projections + norms only", latency_bound + ("embedding", "sampling"))]
    res = {}
    with on_stream(runner.stream):
        for label, names in variants:
            with without(names):
                res[label] = 1e3 * time_calls([step] * 20, reps=5)
    full = res["full step"]
    wb = engine.model.weight_bytes()
    from pegainfer.kernels.memory import measure_read_bandwidth
    bw = measure_read_bandwidth()
    print(f"\n{engine.model_name}: context {args.context}, weight bytes {wb / 1e9:.3f} GB, read bw {bw / 1e9:.0f} GB/s, "
          f"floor {1e3 * wb / bw:.3f} ms")
    print(f"{'variant':32s} {'ms/step':>9s} {'saved':>8s}")
    for label, ms in res.items():
        print(f"{label:32s} {ms:9.3f} {full - ms:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=engine.model_name, context=args.context, weight_bytes=wb, read_bw=bw, ms=res), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
