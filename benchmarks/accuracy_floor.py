"""How far apart are two *valid* bf16 implementations on a random-weight model? Compares, on one folder and one
prompt: Hugging Face bf16 (sdpa), Hugging Face bf16 (eager attention), Hugging Face fp32 and pegainfer, as relative
L2 of the logits at every prompt position. Prints a matrix and writes --json.

    python benchmarks/accuracy_floor.py --model-path DIR [--prompt-len 128] [--json OUT]
"""
import argparse
import json

import numpy as np

import pegainfer  # noqa: F401


def rel(a, b):
    return float(np.mean([np.linalg.norm(a[t] - b[t]) / np.linalg.norm(b[t]) for t in range(len(a))]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    import transformers
    prompt = np.random.default_rng(0).integers(0, 150000, size=args.prompt_len).tolist()  # both vocabularies hold these ids
    ids = torch.tensor([prompt], device="cuda")
    logits = {}
    for name, dtype, attn in [("hf_bf16_sdpa", torch.bfloat16, "sdpa"), ("hf_bf16_eager", torch.bfloat16, "eager"),
                              ("hf_fp32", torch.float32, "sdpa")]:
        m = transformers.AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype,
                                                              attn_implementation=attn).cuda().eval()
        with torch.inference_mode():
            logits[name] = m(ids).logits[0].float().cpu().numpy().astype(np.float64)
        del m
        torch.cuda.empty_cache()
    from pegainfer.engine.engine import Engine
    eng = Engine.from_folder(args.model_path, max_model_len=1024, use_cuda_graph=False)
    logits["pegainfer"] = eng.score(prompt).astype(np.float64)
    names = list(logits)
    res = {a: {b: rel(logits[a], logits[b]) for b in names} for a in names}
    print("mean relative L2 over positions, row vs column (column is the reference)")
    print(f"{'':<16}" + "".join(f"{n:>16}" for n in names))
    for a in names:
        print(f"{a:<16}" + "".join(f"{res[a][b]:>16.4f}" for b in names))
    top = {a: float(np.mean(np.argmax(logits[a], -1) == np.argmax(logits["hf_fp32"], -1))) for a in names}
    print("argmax agreement with hf_fp32:", top)
    if args.json:
        json.dump({"rel_l2": res, "argmax_agree_fp32": top}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
