"""The package's shape: no import circle among its modules, a runtime that reads the plan's data (megatrain.ir) but
never the planner, kernels that import neither, and modules a reader can hold (at most 450 lines)."""

import ast
from pathlib import Path

import networkx as nx

PKG = Path(__file__).resolve().parents[1] / "megatrain"
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(mods: dict[str, Path]) -> nx.DiGraph:
    """Module -> each megatrain module it imports, at module level or inside a function (``from a package import
    its submodules``: the submodules alone; any import of a submodule runs its package first, which is no
    dependency of the importer's)."""
    g = nx.DiGraph()
    for name, path in mods.items():
        g.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                targets = subs if all(s in mods for s in subs) else [base, *subs]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    g.add_edge(name, t)
    return g


def test_no_module_imports_itself_through_others():
    cycles = [sorted(c) for c in nx.strongly_connected_components(_imports(_modules())) if len(c) > 1]
    assert not cycles, cycles


def test_the_runtime_reads_the_ir_not_the_planner_and_the_kernels_neither():
    g = _imports(_modules())
    runtime = [(a, b) for a, b in g.edges if a.startswith("megatrain.runtime") and b.startswith("megatrain.planner")]
    kernels = [(a, b) for a, b in g.edges if a.startswith("megatrain.kernels")
               and b.startswith(("megatrain.runtime", "megatrain.planner"))]
    assert not runtime and not kernels, (runtime, kernels)


def test_modules_stay_short():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
