"""What does each overlapped (PDL) launch touch before its ``griddepcontrol.wait``, and is that what it declares?

A kernel launched with programmatic dependent launch starts while the kernel before it still runs; until its
``grid_dependency_wait()`` it may read only buffers no kernel of the step writes (weights, norm weights, RoPE tables,
block tables) and may write nothing in global memory (``primitives/pdl.py``, ``launch.py``).  What a kernel may
read there is declared once, on the kernel: ``@reads_before_wait("w32", ...)`` names the arguments (none declared:
none).  A test that runs the kernel alone cannot see a break of that contract, and the GPU does not fail loudly on
one: the read just sees old data now and then.  This reads the contract off the compiled code instead.

Without a GPU (NVVM from ``numba-cuda[cu13]``): the engine's own steps are recorded and compiled as in
``ptx_snapshot.py`` (Qwen3-4B and Qwen3.5-4B shapes; ``CASES``: decode, prompt and scoring steps that launch every
overlapped kernel variant the engine does); for every kernel an overlapping launch runs, its sm_90a PTX is split
into basic blocks, "a wait has run on every path from the entry to here" is propagated to a fixed point, and every
instruction that can run before a wait on some path is looked at, following which kernel argument each address
register comes from (``ld.param`` of an array's data pointer, then any arithmetic on it):

* the arguments whose memory it reads there (``ld`` from global or generic addresses, ``cp.async`` sources) must be
  among those the kernel declares, and
* there must be no global write there (``st`` / ``atom`` / ``red`` to global or generic addresses), and the kernel
  must have a wait at all.

    python tools/pdl_early_reads.py            # a table: kernel -> arguments read before the wait; exit 1 on a break
    python tools/pdl_early_reads.py --json     # the same as JSON (tests/kernels/test_pdl_wait_position.py)

The analysis is path-insensitive: a path the kernel's logic never takes still counts, so a kernel passes only when
a wait precedes its first global write on every path of its compiled code (``attention/decode.py`` waits once more
before its merge for that reason).  Reading a declared argument is all it checks of reads: which rows of it (e.g.
only the older keys' K/V rows) is the kernel's docstring's business.
"""
from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tools.ptx_snapshot as snap  # noqa: E402  (sets the stand-in H200 up before numba is used)

_PARAM = re.compile(r"ld\.param\.\w+\s+(%\w+),\s*\[(\w+)\]")
_REG = re.compile(r"%\w+")
_WAIT = "griddepcontrol.wait"
MODELS = ("4b", "3.5-4b", "3.5-4b-bf16-state")
CASES = ("decode1", "decode8", "prefill16", "prefill512", "score1")
"""Between them these launch every overlapped kernel variant that the models' every engine step shape
(``ptx_snapshot.every_engine_case``) does (25 kernels with the default launch policy when written; 26 with Qwen3.5's
decode step on a bf16 state)."""


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


def before_wait(ptx: str, owner: dict[int, str]) -> tuple[bool, set, list]:
    """(whether the entry has a ``griddepcontrol.wait`` at all, argument names read before the wait, global writes
    before it) of a kernel's PTX: every load, copy or store that can run before a wait on some path from the entry
    (all of them when there is no wait); an address register's arguments are those of every register it is computed
    from (the data pointer loaded with ``ld.param``)."""
    entry = ptx[ptx.index(".entry"):]                       # (device functions may come first)
    params = re.findall(r"\.param \.\w+ (\w+)", entry.split("{", 1)[0])
    index = {p: k for k, p in enumerate(params)}
    statements = _statements(entry.split("{", 1)[1])
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
    return any(_WAIT in st for st in statements), reads, writes


@dataclass
class Overlapped:
    """One overlapped launch's kernel (one compiled variant) and what its PTX does before the wait."""
    label: str              # the launch's name (``LaunchPolicy.pdl``)
    kernel: str             # the kernel function
    cases: list[str]        # the recorded steps that launch it
    waits: bool             # the PTX has a ``griddepcontrol.wait``
    reads: list[str]        # arguments read on some path before the wait
    declared: list[str]     # what the kernel's ``reads_before_wait`` declares
    writes: list[str]       # global writes on some path before the wait

    def problems(self) -> list[str]:
        """Each break of the contract, one line each; none when the kernel follows it."""
        out = [] if self.waits else ["no griddepcontrol.wait"]
        undeclared = sorted(set(self.reads) - set(self.declared))
        if undeclared:
            out.append(f"reads {', '.join(undeclared)} before the wait (declared: {', '.join(self.declared) or '-'})")
        if self.writes:
            out.append(f"{len(self.writes)} global writes before the wait: {'; '.join(self.writes[:4])}"
                       + (" ..." if len(self.writes) > 4 else ""))
        return out


def report(models=MODELS, cases=CASES) -> list[Overlapped]:
    """Every kernel variant an overlapped launch of the cases runs, with its contract and what its PTX does before
    the wait, in label order."""
    recorder = snap.Recorder()
    snap.record(list(models), list(cases), recorder)
    seen: dict[tuple, tuple[str, list]] = {}
    for case, desc, fp in recorder.launches:
        if " pdl=1 " in desc:
            label, where = seen.setdefault(fp, (desc.split(" grid=")[0], []))
            if case not in where:
                where.append(case)
    out = []
    for fp, (label, where) in seen.items():
        kernel, types = recorder.kernels[fp]
        ptx = snap._Kernel(kernel.py_func, types, **kernel.targetoptions).inspect_asm(None)
        waits, reads, writes = before_wait(ptx, param_owner(kernel, types))
        out.append(Overlapped(label, kernel.py_func.__qualname__, where, waits, sorted(reads),
                              sorted(getattr(kernel, "pdl_early_reads", ())), writes))
    return sorted(out, key=lambda o: (o.label, o.cases))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, of %s" % ", ".join(snap.MODELS))
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated decodeB, prefillT, scoreT "
                   "(default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as a JSON list, one object a kernel")
    p.add_argument("--launch-policy", metavar="FIELD=VALUE,...", default="",
                   help="check the steps of this launch policy (e.g. pdl=default+gemm_wgmma: a launch to overlap "
                        "before it becomes a default); default: the engine's")
    args = p.parse_args(argv)
    if args.launch_policy:
        from pegainfer.kernels.policy import LaunchPolicy
        from pegainfer.kernels.policy_text import parse_fields, policy_with
        snap.POLICY = policy_with(LaunchPolicy(), parse_fields(args.launch_policy))
    res = report(args.models.split(","), args.cases.split(","))
    if args.json:
        print(json.dumps([asdict(o) for o in res], indent=1))
    else:
        for o in res:
            print(f"{o.label:26s} {o.cases[0]:16s} reads early: {', '.join(o.reads) or '-'}")
            for problem in o.problems():
                print(f"{'':26s} {'':16s} CONTRACT BROKEN: {problem}")
        print(f"{len(res)} overlapped kernels, {sum(bool(o.problems()) for o in res)} breaking their contract",
              file=sys.stderr)
    return 1 if any(o.problems() for o in res) else 0


if __name__ == "__main__":
    sys.exit(main())
