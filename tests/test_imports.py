"""The package's import graph has no cycles (the one-way doors of the architecture: cli → server → engine →
models → kernels → primitives; text and the loader beside them)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pegainfer"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The pegainfer modules ``path`` imports anywhere (top level or inside a function); ``from pkg import name``
    counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("pegainfer")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pegainfer") \
                and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return {m for m in out if m in modules}


def test_no_import_cycles():
    """Catches two modules importing each other (directly or round a longer loop), even through an import
    inside a function: such a pair is one room split in two, or a door opened the wrong way."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    graph = {m: _imports(p, modules) - {m} for m, p in paths.items()}
    # a package's __init__ re-exporting its own modules is not a cycle with them
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles: " + "; ".join(" → ".join(c) for c in cycles)
