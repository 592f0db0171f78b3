"""The test tree keeps its layers (tests/conftest.py), checked statically with ``ast``.

* every test file sits in a layer folder, and every folder of the tree is a package whose
  ``__init__.py`` says what it holds;
* tests import what the tree shares by its place (``helpers.harness``,
  ``one_node.test_collectives``): a bare ``import harness`` would work only while some
  other file happens to have put its folder on ``sys.path``. Scripts launched by path
  (``python tests/across_nodes/mpi_job_init.py``) import their neighbours bare, as
  scripts do, and are exempt;
* the units fork no rank and start no process or socket: they must stay seconds;
* every ``tests/....py`` that the code, the docs or the tests name exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
LAYERS = {"units", "one_node", "across_nodes", "stack", "tools"}
SHARED = "helpers"
NOT_IN_UNITS = {"subprocess", "multiprocessing", "socket", "helpers.harness"}
REPO = TESTS.parent
NAMING = ["README.md", "pyproject.toml", ".ci/run", "docs", "scripts", "launch", "neuron_dist", "bench",
          "collectives", "transport", "tests"]


def tree_modules() -> dict[str, Path]:
    """Bare name -> file, of every module of the test tree."""
    return {p.stem: p for p in TESTS.rglob("*.py") if p.stem not in ("__init__", "conftest")}


def imports(path: Path):
    """Yield (line, dotted name) of every absolute import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def test_every_test_file_sits_in_a_layer():
    folders = {p.parent for p in TESTS.rglob("*.py")} - {TESTS}
    names = {f.relative_to(TESTS).parts[0] for f in folders}
    assert names == LAYERS | {SHARED}, f"folders other than the layers: {sorted(names - LAYERS)}"
    for folder in folders:
        init = folder / "__init__.py"
        assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), \
            f"{folder.relative_to(TESTS)}/__init__.py must say what the folder holds"
    stray = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py")
    assert not stray, f"put these in a layer folder: {stray}"
    assert not list((TESTS / SHARED).glob("test_*.py")), "helpers/ holds no tests"


@pytest.mark.parametrize("layer", sorted(LAYERS | {SHARED}))
def test_tests_import_the_tree_by_place(layer):
    bare = tree_modules()
    wrong = []
    for path in sorted((TESTS / layer).glob("*.py")):
        if not (path.stem.startswith("test_") or layer == SHARED):
            continue  # a script launched by path
        heads = sorted({(line, name.split(".")[0]) for line, name in imports(path)})
        wrong += [f"{path.relative_to(TESTS)}:{line}: import {head} "
                  f"(it is {bare[head].relative_to(TESTS)})"
                  for line, head in heads if head in bare]
    assert not wrong, "import the test tree by its place:\n" + "\n".join(wrong)


def test_units_fork_nothing():
    wrong = [f"{p.relative_to(TESTS)}:{line}: {name}"
             for p in sorted((TESTS / "units").glob("test_*.py"))
             for line, name in imports(p) if name in NOT_IN_UNITS]
    assert not wrong, "units start no process and open no socket:\n" + "\n".join(wrong)


def test_paths_named_in_the_repository_exist():
    files = []
    for name in NAMING:
        path = REPO / name
        files += [path] if path.is_file() else \
            [f for f in path.rglob("*") if f.suffix in (".py", ".md", ".sh", ".toml")]
    missing = [f"{f.relative_to(REPO)}: {m.group()}" for f in sorted(files)
               for m in re.finditer(r"\btests/[\w/]+\.py\b", f.read_text())
               if not (REPO / m.group()).exists()]
    assert not missing, "these name files that do not exist:\n" + "\n".join(missing)
