"""tests/ mirrors fitone/: a test module named for a fitone package, or for a module inside one, lives in that
package's folder; the top level holds the tests of fitone's top-level modules and those that span several. Other
folders: scripts/ (the scripts' tests) and gpu/ (the GPU lane). Module names are unique across the folders:
tests/ has no __init__.py, so pytest imports each module by its file name."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO, SLOW

TESTS = REPO / "tests"
SOURCE = REPO / "fitone"
OTHER_FOLDERS = {"gpu", "scripts"}


def modules_of_tests() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def home_of(stem: str) -> Path | None:
    """The folder of tests/ that a module named test_<stem> belongs in: the longest prefix of `stem` (at an
    underscore) that names a fitone package, a top-level module, or a module of one package; None if none does."""
    packages = {p.parent.name for p in SOURCE.glob("*/__init__.py")}
    top = {p.stem for p in SOURCE.glob("*.py")}
    inner: dict[str, set[str]] = {}
    for package in packages:
        for module in (SOURCE / package).glob("*.py"):
            inner.setdefault(module.stem, set()).add(package)
    words = stem.split("_")
    for n in range(len(words), 0, -1):
        name = "_".join(words[:n])
        if name in packages:
            return TESTS / name
        if name in top:
            return TESTS
        if len(inner.get(name, ())) == 1:
            return TESTS / inner[name].pop()
    return None


def test_a_test_named_for_a_fitone_module_lives_where_that_module_does():
    misplaced = {str(p.relative_to(TESTS)): str(home.relative_to(REPO)) for p in modules_of_tests()
                 if p.parent.name not in OTHER_FOLDERS and (home := home_of(p.stem[5:])) and p.parent != home}
    assert not misplaced, misplaced


def test_each_folder_of_tests_is_a_fitone_package_or_a_named_other():
    packages = {p.parent.name for p in SOURCE.glob("*/__init__.py")}
    folders = {p.relative_to(TESTS).parts[0] for p in modules_of_tests() if p.parent != TESTS}
    assert folders <= packages | OTHER_FOLDERS, folders - packages - OTHER_FOLDERS


def test_module_names_are_unique_across_folders():
    names = [p.name for p in modules_of_tests()]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_the_slow_marker_names_tests_that_exist():
    """conftest.SLOW marks tests by module file name and function name: a name that is gone marks nothing."""
    modules = {p.name: p for p in modules_of_tests()}
    gone = set(SLOW) - set(modules)
    for name, tests in SLOW.items():
        if name in modules:
            defined = {f.name for f in ast.parse(modules[name].read_text()).body if isinstance(f, ast.FunctionDef)}
            gone |= {f"{name}::{t}" for t in tests if t != "*" and t not in defined}
    assert SLOW and not gone, sorted(gone)
