"""What does each overlapped (PDL) launch touch before its ``griddepcontrol.wait``?

A kernel launched with programmatic dependent launch starts while the kernel before it still runs; until its
``grid_dependency_wait()`` it may read only buffers no kernel of the step writes (weights, norm weights, RoPE tables,
block tables) and may write nothing in global memory (``primitives/pdl.py``, ``launch.py``).  A test that runs the
kernel alone cannot see a break of that contract, and the GPU does not fail loudly on one: the read just sees old
data now and then.  This reads the contract off the compiled code instead.

Without a GPU (NVVM from ``numba-cuda[cu13]``): the engine's own steps are recorded and compiled as in
``ptx_snapshot.py`` (Qwen3-4B and Qwen3.5-4B shapes, decode and prompt cases); for every launch that overlaps, the
sm_90a PTX is read from its entry to the first ``griddepcontrol.wait``, following which kernel argument each address
register comes from (``ld.param`` of an array's data pointer, then any arithmetic on it), and lists

* the arguments whose memory it reads there (``ld`` from global or generic addresses, ``cp.async`` sources), and
* every global write there (``st`` / ``atom`` / ``red`` to global or generic addresses): there must be none.

    python tools/pdl_early_reads.py            # a table: kernel -> arguments read before the wait

The analysis is path-insensitive, so it errs towards reporting: a path the kernel's logic never takes still counts.
``paged_decode_attention`` shows this: a work item whose key loop ran zero times would skip the wait and still write
its output, and the tool reports those writes, although a split that has work always has keys.  Read each report
against the kernel's docstring (measured on 2026-12-02: every kernel of the default PDL set reads before its wait
exactly what its docstring allows -- weights, norm weights, RoPE tables, block tables, slots and positions, the
recurrent state of ``gated_delta_decode_step``, the residual of a ``residual_ready`` launch -- and writes nothing
there, but for that one report).
"""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tools.ptx_snapshot as snap  # noqa: E402  (sets the stand-in H200 up before numba is used)

_PARAM = re.compile(r"ld\.param\.\w+\s+(%\w+),\s*\[(\w+)\]")
_REG = re.compile(r"%\w+")
_WAIT = "griddepcontrol.wait"


def param_owner(kernel, types) -> dict[int, str]:
    """Index of each flattened PTX parameter that is an array's data pointer -> the kernel argument's name.  numba
    passes an array as (meminfo, parent, nitems, itemsize, data, shape..., strides...), a scalar as one value."""
    names = list(inspect.signature(kernel.py_func).parameters)
    owner, i = {}, 0
    for name, ty in zip(names, types):
        ndim = getattr(ty, "ndim", None)
        if ndim is None:
            i += 1
            continue
        owner[i + 4] = name
        i += 5 + 2 * ndim
    return owner


def _statements(body: str) -> list[str]:
    """The entry's instructions and labels, one a line (inline-asm blocks hold several), comments dropped."""
    out = []
    for line in body.splitlines():
        for st in line.split("//", 1)[0].split(";"):
            st = st.strip().strip("{}").strip()
            if st and not st.startswith("."):
                out.append(st)
    return out


def _early(statements: list[str]) -> list[bool]:
    """For each statement, whether it can run before any ``griddepcontrol.wait`` (on some path from the entry):
    basic blocks split at labels and branches, "a wait has run on every path here" propagated to a fixed point."""
    blocks, cur = [], []
    for st in statements:
        if st.endswith(":") and cur:
            blocks.append(cur)
            cur = []
        cur.append(st)
        if re.match(r"(@!?%\w+\s+)?(bra|ret|exit)\b", st):
            blocks.append(cur)
            cur = []
    if cur:
        blocks.append(cur)
    label = {b[0][:-1]: i for i, b in enumerate(blocks) if b[0].endswith(":")}
    succ = []
    for i, b in enumerate(blocks):
        last = b[-1]
        m = re.match(r"(@!?%\w+\s+)?bra(\.uni)?\s+(\S+)", last)
        nxt = [i + 1] if i + 1 < len(blocks) else []
        if m:
            succ.append([label[m.group(3)]] + (nxt if m.group(1) else []))
        elif re.match(r"(@!?%\w+\s+)?(ret|exit)\b", last):
            succ.append(nxt if last.startswith("@") else [])
        else:
            succ.append(nxt)
    has_wait = [any(_WAIT in st for st in b) for b in blocks]
    waited_in = [i != 0 for i in range(len(blocks))]           # optimistic, the entry excepted
    preds = [[] for _ in blocks]
    for i, ss in enumerate(succ):
        for j in ss:
            preds[j].append(i)
    changed = True
    while changed:
        changed = False
        for i in range(1, len(blocks)):
            v = all(waited_in[p] or has_wait[p] for p in preds[i]) if preds[i] else True
            if v != waited_in[i]:
                waited_in[i], changed = v, True
    out = []
    for i, b in enumerate(blocks):
        waited = waited_in[i]
        for st in b:
            out.append(not waited)
            waited = waited or _WAIT in st
    return out


def before_wait(ptx: str, owner: dict[int, str]) -> tuple[set, list]:
    """(argument names read before the wait, global writes before it) of a kernel's PTX: every load, copy or store
    that can run before a ``griddepcontrol.wait`` on some path from the entry; an address register's arguments are
    those of every register it is computed from (the data pointer loaded with ``ld.param``)."""
    entry = ptx[ptx.index(".entry"):]                       # (device functions may come first)
    params = re.findall(r"\.param \.\w+ (\w+)", entry.split("{", 1)[0])
    index = {p: k for k, p in enumerate(params)}
    statements = _statements(entry.split("{", 1)[1])
    if not any(_WAIT in st for st in statements):
        return set(), []
    origin: dict[str, set] = {}
    for _ in range(2):                                       # loops: a register may be set after its use
        for st in statements:
            st = re.sub(r"^@!?%\w+\s+", "", st)
            m = _PARAM.match(st)
            if m:
                name = owner.get(index.get(m.group(2), -1))
                origin[m.group(1)] = {name} if name else set()
                continue
            op = st.split()[0]
            regs = _REG.findall(st)
            if regs and not op.startswith(("st.", "atom.", "red.", "cp.", "bra", "prefetch", "ld.")):
                origin[regs[0]] = origin.get(regs[0], set()).union(*(origin.get(r, set()) for r in regs[1:]))
    reads, writes = set(), []
    for st, early in zip(statements, _early(statements)):
        if not early:
            continue
        st = re.sub(r"^@!?%\w+\s+", "", st)              # a predicate guard: the instruction still may run
        op = st.split()[0]
        brackets = re.findall(r"\[([^\]]+)\]", st)
        local = any(s in op for s in (".shared", ".local", ".param", ".const"))
        if op.startswith("cp.async"):                       # shared destination, global source (second operand)
            if len(brackets) >= 2:
                reads |= {n for r in _REG.findall(brackets[1]) for n in origin.get(r, set())}
        elif op.startswith(("st.", "atom.", "red.")) and not local:
            writes.append(st)
        elif op.startswith(("ld.", "prefetch")) and not local and brackets:
            reads |= {n for r in _REG.findall(brackets[0]) for n in origin.get(r, set())}
    return reads, writes


def report(models=("4b", "3.5-4b"), cases=("decode1", "decode8", "prefill16", "prefill512")) -> dict:
    """``{kernel label: (sorted argument names read before the wait, global writes before it)}`` over every
    overlapped launch of the cases (labels of one kernel merged)."""
    recorder = snap.Recorder()
    snap.record(list(models), list(cases), recorder)
    pdl = {fp for _, desc, fp in recorder.launches if " pdl=1 " in desc}
    labels = {}
    for _, desc, fp in recorder.launches:
        if fp in pdl:
            labels.setdefault(fp, desc.split(" grid=")[0])
    out: dict[str, tuple[set, list]] = {}
    for fp in pdl:
        kernel, types = recorder.kernels[fp]
        ptx = snap._Kernel(kernel.py_func, types, **kernel.targetoptions).inspect_asm(None)
        reads, writes = before_wait(ptx, param_owner(kernel, types))
        r, w = out.setdefault(labels[fp], (set(), []))
        r |= reads
        w += writes
    return {k: (sorted(r), w) for k, (r, w) in sorted(out.items())}


def main() -> int:
    res = report()
    for label, (reads, writes) in res.items():
        print(f"{label:32s} reads early: {', '.join(reads) or '-'}" + (f"   WRITES: {writes}" if writes else ""))
    return 1 if any(w for _, w in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
