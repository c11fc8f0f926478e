"""The layout of tests/: module names are unique across its folders (tests/ has no __init__.py, so pytest
imports each module by its file name), and the slow marker's list names tests that exist."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO, SLOW

TESTS = REPO / "tests"


def modules_of_tests() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


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
