"""How far apart are two *valid* bf16 implementations of the same model, and where does pegainfer sit among them?

Runs one random prompt through Hugging Face bf16 (sdpa attention), Hugging Face bf16 (eager attention), Hugging Face
fp32 and pegainfer on one model folder, and prints the mean relative L2 distance of their logits over the prompt's
positions, every pair (row vs column, the column as the reference), and each one's argmax agreement with fp32.
HF's two bf16 attention backends set the floor a bf16 implementation can be held to (``docs/perf/accuracy.md``).

    python benchmarks/accuracy_floor.py --model-path DIR [--prompt-len 128] [--json OUT]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_timing  # noqa: E402  (puts the checkout on sys.path)

import numpy as np  # noqa: E402


def rel(a, b) -> float:
    """Mean over positions of ``|a_t - b_t| / |b_t|``."""
    return float(np.mean([np.linalg.norm(a[t] - b[t]) / np.linalg.norm(b[t]) for t in range(len(a))]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    graph_timing.require_gpu("accuracy_floor.py", "it runs Hugging Face and pegainfer on the full model")
    import torch

    from pegainfer.bench import hf_model_class
    from pegainfer.engine.engine import Engine
    # ids below 150000: inside both the Qwen3 and the Qwen3.5 vocabulary
    prompt = np.random.default_rng(0).integers(0, 150000, size=args.prompt_len).tolist()
    ids = torch.tensor([prompt], device="cuda")
    cls = hf_model_class(args.model_path)
    logits = {}
    for name, dtype, attn in [("hf_bf16_sdpa", torch.bfloat16, "sdpa"), ("hf_bf16_eager", torch.bfloat16, "eager"),
                              ("hf_fp32", torch.float32, "sdpa")]:
        m = cls.from_pretrained(args.model_path, dtype=dtype, attn_implementation=attn).cuda().eval()
        with torch.inference_mode():
            logits[name] = m(ids).logits[0].float().cpu().numpy().astype(np.float64)
        del m
        torch.cuda.empty_cache()
    eng = Engine.from_folder(args.model_path, max_model_len=1024, use_cuda_graph=False)
    logits["pegainfer"] = eng.score(prompt).astype(np.float64)
    names = list(logits)
    res = {a: {b: rel(logits[a], logits[b]) for b in names} for a in names}
    print("mean relative L2 over positions, row vs column (column is the reference)")
    print(f"{'':<16}" + "".join(f"{n:>16}" for n in names))
    for a in names:
        print(f"{a:<16}" + "".join(f"{res[a][b]:>16.4f}" for b in names))
    top = {a: float(np.mean(np.argmax(logits[a], -1) == np.argmax(logits["hf_fp32"], -1))) for a in names}
    print("argmax agreement with hf_fp32:", {a: round(v, 4) for a, v in top.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rel_l2": res, "argmax_agree_fp32": top}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
