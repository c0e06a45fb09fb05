"""No import cycles among multiattn's modules (module-level imports only).

The graph is built from the installed source tree with ``ast`` (nothing is imported but
the ``multiattn`` package itself, to find where its subpackages live: in a checkout
``multiattn.backends`` is the folder ``backends/`` and ``multiattn.conformance`` is
``conformance/``). An edge ``a -> b`` is an import of ``b`` that ``a`` runs when it is
imported: a statement at module level, also inside ``if``/``try``/``with`` blocks and
class bodies, but not inside functions nor ``if TYPE_CHECKING:`` blocks. ``import a.b`` and
``from a import b`` (``a.b`` a module) count as importing ``a.b``; ``from a import name``
(``name`` not a module) as importing ``a``. Importing ``a.b.c`` also runs the packages
``a`` and ``a.b`` first: they count as imported too, except the importer's own enclosing
packages (already running when it runs; counting them would put every package's
``__init__`` in a cycle with each module it re-exports).

A cycle is a strongly connected component of more than one module (or a module that
imports itself).
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "multiattn"
#: packages whose folders may lie apart from ``multiattn/`` (see ``package-dir``)
ROOTS = (PACKAGE, f"{PACKAGE}.backends", f"{PACKAGE}.conformance")
TRY = (ast.Try, getattr(ast, "TryStar", ast.Try))  # try/except* from Python 3.11


def source_modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the installed package."""
    modules: dict[str, Path] = {}
    for root in ROOTS:
        spec = importlib.util.find_spec(root)
        assert spec is not None and spec.submodule_search_locations, root
        for location in spec.submodule_search_locations:
            base = Path(location)
            for path in sorted(base.rglob("*.py")):
                parts = path.relative_to(base).with_suffix("").parts
                folders = [base.joinpath(*parts[:i]) for i in range(1, len(parts))]
                if not all((f / "__init__.py").is_file() for f in folders):
                    continue  # not inside a package (data folders)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules.setdefault(".".join((root, *parts)), path)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module runs (not in functions)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from module_level_imports(node.body)
            yield from module_level_imports(node.orelse)
        elif isinstance(node, TRY):
            for block in (node.body, node.orelse, node.finalbody):
                yield from module_level_imports(block)
            for handler in node.handlers:
                yield from module_level_imports(handler.body)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from module_level_imports(node.body)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in module_level_imports(tree.body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    anchor = name.split(".")
                    if not is_package:
                        anchor = anchor[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                else:
                    base = node.module or ""
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                # `import a.b.c` of a non-module `c` cannot happen; keep the longest
                # prefix that is one of ours.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target:
                    graph[name].add(target)
        # the packages enclosing every target, but the importer's own
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        for target in list(graph[name]):
            parts = target.split(".")
            for i in range(1, len(parts)):
                package = ".".join(parts[:i])
                if package in modules and package not in own:
                    graph[name].add(package)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package's depth stays far below the limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"  {{{', '.join(component)}}}\n" + "\n".join(edges)


def test_graph_covers_the_subpackages():
    modules = source_modules()
    for name in (*ROOTS, f"{PACKAGE}.ops", f"{PACKAGE}.paddle", f"{PACKAGE}.backends.torch"):
        assert name in modules, name


def test_no_import_cycles():
    graph = import_graph(source_modules())
    found = cycles(graph)
    assert not found, "import cycles (module-level imports):\n" + "\n".join(
        describe(c, graph) for c in found
    )
