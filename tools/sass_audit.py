"""What did ptxas make of each kernel the served models launch?  Registers, spills and the instructions that cost
without showing in the Python: GPU-scope fences, local memory, and the spin loops a kernel meant to have.

Input: the normalized PTX that ``tools/ptx_snapshot.py --out snap.json --ptx-dir DIR`` writes (no GPU needed).
Each file is assembled for sm_90a with ``ptxas`` (the dispatcher's launch bounds put back from the file's target
options line) and disassembled with ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel has one), then counted::

    python tools/ptx_snapshot.py --out snap.json --ptx-dir ptx
    python tools/sass_audit.py snap.json ptx [--ptxas PATH] [--nvdisasm PATH] [--sass-dir DIR]

Columns: registers, spill bytes (stores), ``LDL`` / ``STL`` (local memory: spills and local arrays),
``MEMBAR.*.GPU`` (GPU-scope fences: a ``threadfence``, or a release at cluster / GPU scope), ``HGMMA`` and
``LDG.E.*.STRONG.GPU`` (loads at L2 / GPU scope: ``ld.global.cg``, acquire and relaxed loads).  Two pitfalls it was
written for, both found in this code by reading its ``--sass-dir`` output: a spin loop on a *weak* load
(``ld.global.cg``) that ptxas deleted, since nothing says the value can change (the loop must load with
``ld.acquire`` / ``ld.relaxed``: its SASS then loops on the load, with ``CCTL.IVALL`` and ``YIELD``), and
``mbarrier.arrive.release.cluster``, which puts ``MEMBAR.ALL.GPU`` before every arrival (in the K loop of the GEMM
clusters, since deleted: every stage).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

COUNTED = {"LDL": r"\bLDL\b", "STL": r"\bSTL\b", "MEMBAR.GPU": r"MEMBAR\.\w+\.GPU", "HGMMA": r"\bHGMMA\b",
           "LDG.STRONG.GPU": r"LDG\.E[.\w]*\.STRONG\.GPU"}


def assemblable(ptx: str) -> str:
    """The snapshot's normalized PTX as ptxas takes it: unique names for the anonymized module-scope symbols, the
    launch bounds of its target-options line on the entry, ISA 8.5 for sm_90a."""
    names = iter(range(1 << 20))
    ptx = re.sub(r"SYM\?", lambda m: f"SYMQ{next(names)}", ptx)
    bounds = re.search(r"\('launch_bounds', \((\d+)(?:, (\d+))?\)\)", ptx)
    if bounds:
        extra = f"\n.maxntid {bounds.group(1)}, 1, 1"
        if bounds.group(2):
            extra += f"\n.minnctapersm {bounds.group(2)}"
        ptx = re.sub(r"(\.visible \.entry [^(]+\([^)]*\))", lambda m: m.group(1) + extra, ptx, count=1)
    ptx = re.sub(r"\.version \d+\.\d+", ".version 8.5", ptx)
    return re.sub(r"\.target sm_90a?\b", ".target sm_90a", ptx)


def audit(ptx_file: Path, ptxas: str, nvdisasm: str, work: Path, sass_dir: Path | None) -> dict:
    src, cubin = work / "k.ptx", work / "k.cubin"
    src.write_text(assemblable(ptx_file.read_text()))
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(cubin)], capture_output=True, text=True)
    if r.returncode:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"ptxas exit {r.returncode}"}
    sass = subprocess.run([nvdisasm, str(cubin)], capture_output=True, text=True, check=True).stdout
    if sass_dir is not None:
        (sass_dir / (ptx_file.stem + ".sass")).write_text(sass)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    row = {"registers": int(regs.group(1)) if regs else None, "spill": int(spill.group(1)) if spill else 0}
    row.update({name: len(re.findall(pattern, sass)) for name, pattern in COUNTED.items()})
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("snapshot", help="the JSON of tools/ptx_snapshot.py --out")
    p.add_argument("ptx_dir", help="its --ptx-dir")
    p.add_argument("--ptxas", default=shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas")
    p.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    p.add_argument("--sass-dir", help="also keep each kernel's SASS here")
    args = p.parse_args(argv)
    for tool in (args.ptxas, args.nvdisasm):
        if shutil.which(tool) is None and not Path(tool).is_file():
            print(f"error: {tool} not found -- pass --ptxas / --nvdisasm (a CUDA toolkit's ptxas; nvdisasm: "
                  "pip install nvidia-cuda-nvdisasm)", file=sys.stderr)
            return 2
    launches = {}
    for desc, digest in json.loads(Path(args.snapshot).read_text()).items():
        launches.setdefault(digest[:16], []).append(desc)
    sass_dir = Path(args.sass_dir) if args.sass_dir else None
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
    print(f"{'kernel (first launch that uses it)':<70} {'regs':>4} {'spill':>5} " +
          " ".join(f"{name:>{max(5, len(name))}}" for name in COUNTED))
    with tempfile.TemporaryDirectory() as tmp:
        for ptx_file in sorted(Path(args.ptx_dir).glob("*.ptx")):
            row = audit(ptx_file, args.ptxas, args.nvdisasm, Path(tmp), sass_dir)
            first = launches.get(ptx_file.stem[:16], [ptx_file.stem])[0]
            name = re.sub(r"\s*\(.*", "", first)
            name = re.sub(r" (grid|block|shared|pdl)=\S+", "", name)[:70]
            if "error" in row:
                print(f"{name:<70} ptxas: {row['error']}")
                continue
            print(f"{name:<70} {row['registers']:>4} {row['spill']:>5} " +
                  " ".join(f"{row[n]:>{max(5, len(n))}}" for n in COUNTED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
