"""The shape of the anydevice package: modules per package, the largest modules, the import
circles, the longest import chain, and the layers of its subpackages.

    python scripts/import_graph.py [--all-imports] [--json]

Imports are read from the syntax tree, never executed. By default only imports that run
when a module loads count (top level, outside ``if TYPE_CHECKING:``); ``--all-imports``
adds those inside functions and those for type checkers alone, which break a circle at
load time but still tie the modules together (what a reader has to hold in mind). An
import of a name from a module's own package (``from anydevice.doctor import examine``
inside ``doctor/``) ties it to the package's ``__init__`` like any other.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "anydevice"

#: The subpackages (and top-level modules) by layer, lowest first: each imports only from
#: layers below its own, through function-level imports too (docs/design.md draws them).
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "_version", "heartbeat"}),
    frozenset({"hardware"}),
    frozenset({"placement", "numerics", "extension"}),
    frozenset({"feeding", "measure"}),
    frozenset({"launching", "checkpoints"}),
    frozenset({"training"}),
    frozenset({"doctor", "testing"}),
    frozenset({"cli", ""}),
    frozenset({"__main__"}),
)


def concern(module: str) -> str:
    """The subpackage (or top-level module) ``module`` belongs to; "" for ``anydevice``."""
    return module.split(".")[1] if "." in module else ""


def layer_breaches(edges: dict[str, set[str]]) -> list[str]:
    """Imports that do not go down a layer: ``a -> b`` where ``b``'s layer is not below
    ``a``'s (or either is in no layer)."""
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    out = []
    for v, ws in sorted(edges.items()):
        for w in sorted(ws):
            a, b = concern(v), concern(w)
            if a == b:
                continue
            if a not in rank or b not in rank or rank[b] >= rank[a]:
                out.append(f"{v} -> {w}")
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path, name: str, everything: bool, known: set[str]) -> set[str]:
    """The anydevice modules ``path`` imports: ``from pkg import sub`` ties it to ``sub``
    alone, ``from pkg import name`` to ``pkg`` (its own package too); with ``everything``,
    also the imports inside functions and under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt], top: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _type_checking(node):
                if everything:  # a type-only import ties the modules together as well
                    visit(node.body, False)
                visit(node.orelse, top)
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("anydevice"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                if base.startswith("anydevice"):
                    for a in node.names:
                        sub = f"{base}.{a.name}"
                        found.add(sub if sub in known else base)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if everything:
                    visit(node.body, False)
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.AST):
                    visit([n for n in inner if isinstance(n, ast.stmt)] or [], top)
                    for h in inner:
                        if isinstance(h, ast.ExceptHandler):
                            visit(h.body, top)

    visit(tree.body, True)
    return found


def graph(everything: bool) -> tuple[dict[str, set[str]], dict[str, int]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    sizes = {}
    for name, path in paths.items():
        sizes[name] = len(path.read_text().splitlines())
        found = imports(path, name, everything, set(paths))
        edges[name] = {m for m in found if m in paths and m != name}
    return edges, sizes


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(out)


def longest_chain(edges: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports with no module twice (on the graph with each circle
    collapsed, so that it is well defined)."""
    comp = {m: m for m in edges}
    for part in circles(edges):
        for m in part:
            comp[m] = part[0]
    dag: dict[str, set[str]] = defaultdict(set)
    for v, ws in edges.items():
        for w in ws:
            if comp[v] != comp[w]:
                dag[comp[v]].add(comp[w])
    best: dict[str, list[str]] = {}

    def chain(v: str) -> list[str]:
        if v not in best:
            tails = [chain(w) for w in dag[v]]
            best[v] = [v, *max(tails, key=len, default=[])]
        return best[v]

    return max((chain(v) for v in set(comp.values())), key=len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all-imports", action="store_true", help="count function-level imports")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    edges, sizes = graph(args.all_imports)
    per_package: dict[str, int] = defaultdict(int)
    for name in edges:
        parts = name.split(".")
        is_package = (PACKAGE.parent / Path(*parts) / "__init__.py").exists()
        per_package[name if is_package else ".".join(parts[:-1])] += 0 if is_package else 1
    found = circles(edges)
    chain = longest_chain(edges)
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    report = {
        "modules": len(edges),
        "modules_per_package": dict(sorted(per_package.items())),
        "largest": largest,
        "circles": found,
        "longest_chain": chain,
        "layer_breaches": layer_breaches(edges),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{len(edges)} modules; per package:")
    for name, n in report["modules_per_package"].items():
        print(f"  {name:32s} {n}")
    print("largest: " + ", ".join(f"{m} ({n} lines)" for m, n in largest))
    print(f"{len(found)} import circle(s):")
    for part in found:
        print("  " + " <-> ".join(part))
    print(f"longest import chain ({len(chain)} modules): " + " -> ".join(chain))
    breaches = report["layer_breaches"]
    print(f"{len(breaches)} import(s) not going down a layer" + (":" if breaches else ""))
    for line in breaches:
        print("  " + line)


if __name__ == "__main__":
    main()
