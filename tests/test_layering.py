"""fitone's import structure, read from the source with ast: where DeepSpeed may be imported, and no cycles.

Every import statement counts, also one inside a function (it runs when the function does); imports under
`if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fitone"
# DeepSpeed's engine, its process group and logs, and its ZeRO-2 internals (pinned to one version in zero2)
DEEPSPEED_ALLOWED = ("fitone.zero2", "fitone.engine", "fitone.runtime")


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module under fitone/ (a package by its __init__.py)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level, in functions and classes, not under TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                for other in child.orelse:
                    walk(other)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child)

    walk(ast.parse(path.read_text(), filename=str(path)))
    return found


def imported_names(module: str, path: Path) -> list[str]:
    """The dotted names `module` imports; `from a import b` names a.b where that is a module, else a."""
    known = modules()
    names = []
    for node in imports(path):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
            continue
        base = node.module or ""
        if node.level:  # relative: up from the module's package
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        names += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    return names


def import_graph() -> dict[str, set[str]]:
    """fitone module -> the fitone modules it imports."""
    known = modules()
    return {m: {n for n in imported_names(m, p) if n in known and n != m} for m, p in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _allowed(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in DEEPSPEED_ALLOWED)


def test_deepspeed_is_imported_only_from_zero2_engine_and_runtime():
    """DeepSpeed's names are pinned to one version in fitone/zero2 (zero2.check_version): a DeepSpeed import
    elsewhere is version-pinned knowledge outside its fence."""
    outside = sorted(f"{m} imports {name}" for m, p in modules().items() if not _allowed(m)
                     for name in imported_names(m, p) if name.split(".")[0] == "deepspeed")
    assert outside == []


def test_the_layering_test_sees_function_local_and_skips_type_checking_imports(tmp_path):
    """The walk itself: an import in a function counts, one under TYPE_CHECKING does not."""
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import deepspeed\n"
                    "def f():\n    from deepspeed.ops import adam\n    import fitone.render\n")
    assert imported_names("fitone.m", path) == ["typing", "deepspeed.ops", "fitone.render"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_fitone_modules():
    """A cycle means two modules each need the other (Plan and render did: the plan drew itself through
    render, which read the plan's categories); data is imported by what draws or uses it, not the reverse."""
    graph = import_graph()
    assert {"fitone.plan.components", "fitone.render"} <= set(graph)  # the walk found the tree
    assert cycles(graph) == []
