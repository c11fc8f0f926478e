"""fitone's import structure, read from the source with ast: where DeepSpeed may be imported, no cycles, the
floors import nothing above them, and a function-local import of a fitone module only where it has a reason.

Every import statement counts, also one inside a function (it runs when the function does); imports under
`if TYPE_CHECKING:` do not (they never run). Importing `fitone.a.b` also runs the package `fitone.a`, and
`fitone.X` of the lazy public API (fitone/__init__.py's `_API`) imports the module that defines X.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fitone"
# DeepSpeed's engine, its process group and logs, and its ZeRO-2 internals (pinned to one version in zero2)
DEEPSPEED_ALLOWED = ("fitone.zero2", "fitone.engine", "fitone.runtime")
# what takes a second or more to import, or may be missing: kept off `fitone --help` and `import fitone`
HEAVY = {"torch", "deepspeed", "transformers", "datasets", "accelerate", "matplotlib", "numpy", "wandb",
         "tensorboard", "liger_kernel", "triton"}
# the floors, each with what it may import
FLOORS = {"fitone.errors": set(), "fitone.units": {"fitone.errors"}, "fitone.config": {"fitone.errors", "fitone.units"},
          "fitone.memory": {"fitone.units"}}


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


def statements(path: Path) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that can run, and whether it is function-local (runs when its function does):
    at module level, in functions and classes, not under TYPE_CHECKING."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def walk(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                for other in child.orelse:
                    walk(other, local)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, local))
            walk(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    return [node for node, _ in statements(path)]


@cache
def lazy_api() -> dict[str, str]:
    """fitone/__init__.py's `_API`: public name -> the module that defines it, imported on first use."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_API" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("fitone/__init__.py has no _API table")


def _names_of(module: str, path: Path, node: ast.Import | ast.ImportFrom, known) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: up from the module's package
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    names = []
    for alias in node.names:
        full = f"{base}.{alias.name}"
        names.append(full if full in known else lazy_api().get(alias.name, base) if base == "fitone" else base)
    return names


def imported_names(module: str, path: Path) -> list[str]:
    """The dotted names `module` imports; `from a import b` names a.b where that is a module, else a (and
    `from fitone import X` the module of the lazy API's X)."""
    known = modules()
    return [name for node in imports(path) for name in _names_of(module, path, node, known)]


def _api_uses(path: Path) -> set[str]:
    """The modules of the lazy API that `fitone.X` in this file imports when it runs."""
    return {lazy_api()[node.attr] for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "fitone"
            and node.attr in lazy_api()}


def _with_packages(module: str, name: str) -> set[str]:
    """`name` and the packages that importing it runs first (not `module`'s own, already running)."""
    parts = name.split(".")
    own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - own | {name}


@cache
def _edges() -> dict[str, list[tuple[str, bool, int]]]:
    """fitone module -> (fitone module it imports, function-local?, line) for each import that can run."""
    known = modules()
    out: dict[str, list[tuple[str, bool, int]]] = {}
    for m, path in known.items():
        edges = [(n, local, node.lineno) for node, local in statements(path)
                 for name in _names_of(m, path, node, known) if name in known
                 for n in sorted(_with_packages(m, name)) if n in known and n != m]
        out[m] = edges + [(n, True, 0) for n in sorted(_api_uses(path)) if n != m]
    return out


def import_graph() -> dict[str, set[str]]:
    """fitone module -> the fitone modules it imports (at import time or when a function runs)."""
    return {m: {n for n, _, _ in edges} for m, edges in _edges().items()}


def _eager(module: str) -> set[str]:
    """The fitone modules importing `module` loads (module-level imports, followed)."""
    parts = module.split(".")
    seen: set[str] = {".".join(parts[:i]) for i in range(1, len(parts))}  # its packages run first
    todo = [module, *seen]
    while todo:
        for n, local, _ in _edges()[todo.pop()]:
            if not local and n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _heavy(module: str) -> set[str]:
    """The heavy packages importing `module` loads."""
    known = modules()
    return {node_name.split(".")[0] for m in {module} | _eager(module) for node, local in statements(known[m])
            if not local for node_name in _names_of(m, known[m], node, known) if node_name.split(".")[0] in HEAVY}


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
    # the public API's lazy names import their modules when used, and a submodule's import runs its package
    path.write_text("import fitone\ndef f():\n    return fitone.probe_batch, fitone.__version__\n")
    assert _api_uses(path) == {"fitone.probe.api"}
    assert _with_packages("fitone.train", "fitone.plan.shape") == {"fitone.plan", "fitone.plan.shape"}
    assert _with_packages("fitone.plan.estimate", "fitone.plan.shape") == {"fitone.plan.shape"}  # its own runs
    assert "fitone.train" in import_graph()["fitone.cli.train"]  # `fitone.train(cfg)`, through the lazy API


def test_no_import_cycle_among_fitone_modules():
    """A cycle means two modules each need the other (Plan and render did: the plan drew itself through
    render, which read the plan's categories); data is imported by what draws or uses it, not the reverse."""
    graph = import_graph()
    assert {"fitone.plan.components", "fitone.render"} <= set(graph)  # the walk found the tree
    assert cycles(graph) == []


def test_nothing_imports_upward_into_the_cli_and_the_floors_import_nothing_above_them():
    """Imports point down: the CLI is a thin layer that nothing below imports (the API works without it);
    errors.py is the floor every module may raise from, units and config stand on it, and memory.py's
    readings need only units."""
    graph = import_graph()
    into_cli = sorted(f"{m} imports {n}" for m, names in graph.items()
                      if not (m == "fitone.cli" or m.startswith("fitone.cli.") or m == "fitone.__main__")
                      for n in names if n == "fitone.cli" or n.startswith("fitone.cli."))
    assert into_cli == []
    above = {floor: sorted(graph[floor] - allowed) for floor, allowed in FLOORS.items() if graph[floor] - allowed}
    assert above == {}


def function_local_imports() -> list[tuple[str, int, str]]:
    """(module, line, fitone module) of each function-local import of a fitone module."""
    known = modules()
    return sorted({(m, node.lineno, name) for m, path in known.items() for node, local in statements(path) if local
                   for name in _names_of(m, path, node, known) if name.split(".")[0] == "fitone"})


def _type_only_imports(module: str) -> set[str]:
    """The fitone modules `module` names under `if TYPE_CHECKING:` (their types, never imported)."""
    known, path = modules(), modules()[module]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.body:
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    found |= {n for n in _names_of(module, path, child, known) if n in known}
    return found


def _reason(module: str, target: str) -> str:
    """Why `module` imports `target` in a function: the heavy packages a module-level import would add to
    `module`'s import, the import-time cycle it would close, or that `target` is the layer above `module` (it
    names `module`'s types: render, which draws the plan and probe results that offer `str()`/`.plot()` through
    it); '' for none."""
    if target not in modules():
        return ""
    heavy = _heavy(target) - _heavy(module)
    if heavy:
        return "keeps " + ", ".join(sorted(heavy)) + " off its import"
    if module in _eager(target):
        return "would close an import cycle"
    above = any(module == n or module.startswith(n + ".") for n in _type_only_imports(target))
    return "the layer above it, which draws it" if above else ""


def _commented(path: Path, line: int) -> bool:
    """A comment on the import's line, or on the line above the block of imports it opens or belongs to."""
    lines = path.read_text().splitlines()
    i = line - 1
    while i > 0 and lines[i - 1].strip().startswith(("from ", "import ")):
        i -= 1
    return "#" in lines[line - 1] or lines[i - 1].strip().startswith("#")


def test_a_fitone_module_is_imported_in_a_function_only_for_a_reason_that_a_comment_gives():
    """A function-local import of a fitone module hides a dependency from the top of the file: it is kept only
    where a module-level one would load a heavy package that the importing module does not (torch on `fitone
    --help`'s path), close an import cycle, or make data depend on the layer that draws it; a comment says why."""
    known = modules()
    found = function_local_imports()
    assert any(m == "fitone.cli.plan" and t == "fitone.plan" for m, _, t in found)  # the walk sees them
    without = sorted(f"{known[m].relative_to(PACKAGE.parent)}:{line} imports {t} with no reason to be local"
                     for m, line, t in found if not _reason(m, t))
    silent = sorted(f"{known[m].relative_to(PACKAGE.parent)}:{line} imports {t} ({_reason(m, t)}) with no comment"
                    for m, line, t in found if _reason(m, t) and not _commented(known[m], line))
    assert without + silent == []
