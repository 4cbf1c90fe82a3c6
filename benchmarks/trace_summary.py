"""Summarise a pegainfer Chrome trace: GPU time per kernel name over the traced eager steps.

    python benchmarks/trace_summary.py TRACE.json [--json OUT]
"""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    per = collections.defaultdict(lambda: [0, 0.0])
    steps = collections.defaultdict(list)
    for e in events:
        if e["tid"].startswith("GPU kernels"):
            key = f'{e["args"].get("step", "")}: {e["name"]}'
            per[key][0] += 1
            per[key][1] += e["dur"]
        elif e["tid"] == "engine steps":
            steps[e["name"].split(" ")[0]].append(e["dur"])
    total = sum(v[1] for v in per.values())
    print(f"{'step: kernel':<48}{'launches':>10}{'GPU us':>12}{'share':>8}")
    for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<48}{n:>10}{us:>12.1f}{100 * us / max(total, 1e-9):>7.1f}%")
    print(f"{'total (traced eager steps)':<48}{sum(v[0] for v in per.values()):>10}{total:>12.1f}")
    for kind, durs in steps.items():
        durs = sorted(durs)
        print(f"engine step {kind}: n={len(durs)} median {durs[len(durs) // 2] / 1e3:.3f} ms")
    if args.json:
        json.dump({"kernels": per, "total_us": total}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
