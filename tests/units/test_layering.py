"""The layers import only downwards, and every module says what it is.

    neuron_dist/   c10d face (process_group, engine, work, ...)   may import everything
    collectives/   algorithms, written against transport.base     of transport only the
                                                                   contract (base, errors,
                                                                   matching),
                                                                   no torch.distributed,
                                                                   no c10d layer
    transport/     how bytes move                                 no torch.distributed,
                                                                   no c10d layer, no collectives
    launch/        launchers installed with it (train, vnodes)    the backend, not the lab
    bench/         the lab: benchmarks, stand-in backends, the    anything; it is not
                   cost model and simulator (not installed)        installed, and nothing
                                                                   installed imports it

Inside collectives/, ``x.py`` runs collective x on one node and ``x_net.py`` beside it runs
it in a group that spans nodes, with the same signatures; every one of them says how it
works at the top.

Checked statically with ``ast`` (nothing is imported or executed). Imports are resolved to
the installed names (``collectives/x.py`` is ``neuron_dist.collectives.x``; relative imports
are resolved against that), so ``from ..transport.shm import channel``,
``from ..transport import shm``, ``import neuron_dist.transport.shm`` and a stray absolute
``import transport.shm`` are all caught, as are ``importlib.import_module("...")`` /
``__import__("...")`` with a literal name and attribute use of ``torch.distributed``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# repository folder -> installed package (pyproject's package-dir mapping)
LAYERS = {"neuron_dist": "neuron_dist", "collectives": "neuron_dist.collectives",
          "transport": "neuron_dist.transport", "launch": "neuron_dist.launch"}
LAB = {"bench": "bench"}  # runs from the repository only: not a package pyproject installs
TOP_LEVEL_ALIASES = {"collectives": "neuron_dist.collectives", "transport": "neuron_dist.transport"}


def _under(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def module_name(path: Path) -> tuple[str, bool]:
    """(installed dotted name, is_package) of a repository file."""
    rel = path.relative_to(REPO)
    parts = list(rel.with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    base = {**LAYERS, **LAB}[parts[0]]
    return ".".join([base, *parts[1:]]), is_pkg


def _normalise(name: str) -> str:
    head = name.split(".", 1)[0]
    if head in TOP_LEVEL_ALIASES:
        return TOP_LEVEL_ALIASES[head] + name[len(head):]
    return name


def imported_names(source: str, module: str, is_pkg: bool):
    """Yield (line, imported dotted name, ancestor_only, text) for every import in source.

    ``ancestor_only`` marks the base of a ``from X import y``: importing X there only
    matters if X itself is forbidden (its names are yielded separately as X.y).
    """
    tree = ast.parse(source)
    package = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, _normalise(alias.name), False, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                up = node.level - 1
                if up >= len(parts):
                    raise AssertionError(f"{module}:{node.lineno}: relative import beyond the top package")
                base = ".".join(parts[:len(parts) - up])
                if node.module:
                    base = f"{base}.{node.module}"
            else:
                base = _normalise(node.module)
            dots = "." * node.level
            text = f"from {dots}{node.module or ''} import {', '.join(a.name for a in node.names)}"
            yield node.lineno, base, True, text
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{base}.{alias.name}", False, text
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if fname in ("import_module", "__import__") and node.args and \
                    isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                target = node.args[0].value
                if target.startswith(".") and fname == "import_module":
                    level = len(target) - len(target.lstrip("."))
                    parts = package.split(".")
                    target = ".".join(parts[:len(parts) - (level - 1)]) + "." + target.lstrip(".")
                yield node.lineno, _normalise(target.rstrip(".")), False, f"{fname}({node.args[0].value!r})"
        elif isinstance(node, ast.Attribute) and node.attr == "distributed" and \
                isinstance(node.value, ast.Name) and node.value.id == "torch":
            yield node.lineno, "torch.distributed", False, "torch.distributed (attribute use)"


def _concrete_transport(name: str) -> bool:
    """A name of the transport layer beyond its contract (``base``, ``errors``, and
    ``matching``: the posted receives every transport matches with, no transport itself)."""
    return _under(name, "neuron_dist.transport") and name != "neuron_dist.transport" \
        and not _under(name, "neuron_dist.transport.base") \
        and not _under(name, "neuron_dist.transport.errors") \
        and not _under(name, "neuron_dist.transport.matching")


def _c10d(name: str) -> bool:
    """A name of the c10d layer: neuron_dist itself or anything of it outside the lower layers."""
    return _under(name, "neuron_dist") and not _under(name, "neuron_dist.transport") \
        and not _under(name, "neuron_dist.collectives")


def _lab(name: str) -> bool:
    return _under(name, "bench")


NO_LAB = (_lab, "the installed backend must not import the lab (bench/ is not installed)")

RULES = {
    # layer package -> [(predicate on an imported name, why it is forbidden)]; a module
    # obeys the first layer it is under (so neuron_dist, the c10d face, comes last)
    "neuron_dist.collectives": [
        NO_LAB,
        (_concrete_transport,
         "collectives must not import a concrete transport (only transport.base / transport.errors"
         " / transport.matching)"),
        (lambda n: _under(n, "torch.distributed"), "collectives must not import torch.distributed"),
        (_c10d, "collectives must not import the c10d layer (neuron_dist.*)"),
    ],
    "neuron_dist.transport": [
        NO_LAB,
        (lambda n: _under(n, "torch.distributed"), "transport must not import torch.distributed"),
        (lambda n: _under(n, "neuron_dist.collectives"), "transport must not import collectives"),
        (_c10d, "transport must not import the c10d layer (neuron_dist.*)"),
    ],
    "neuron_dist.launch": [NO_LAB],
    "neuron_dist": [NO_LAB],
}


def violations(source: str, module: str, is_pkg: bool, where: str) -> list[str]:
    layer = next((pkg for pkg in RULES if _under(module, pkg)), None)
    if layer is None:
        return []
    found, reported = [], set()
    for line, name, ancestor_only, text in imported_names(source, module, is_pkg):
        if ancestor_only and _under(module, name):
            continue  # `from neuron_dist import x`: the parent package is imported anyway
        if (line, text) in reported:
            continue  # one message per statement
        for bad, why in RULES[layer]:
            if bad(name):
                found.append(f"{where}:{line}: `{text}` imports {name}: {why}")
                reported.add((line, text))
                break
    return found


def _files(folder: str) -> list[Path]:
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"no python files under {folder}/"
    return files


ALL_FILES = [p for folder in {**LAYERS, **LAB} for p in _files(folder)]


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_layer_imports_only_downwards(folder):
    found = []
    for path in _files(folder):
        module, is_pkg = module_name(path)
        found += violations(path.read_text(), module, is_pkg, _rel(path))
    assert not found, "layering violations:\n  " + "\n  ".join(found)


def test_every_module_has_a_docstring():
    missing = []
    for path in ALL_FILES:
        tree = ast.parse(path.read_text(), filename=str(path))
        doc = ast.get_docstring(tree)
        if not doc or not doc.strip():
            missing.append(f"{_rel(path)}:1: no module docstring")
    assert not missing, "modules without a docstring:\n  " + "\n  ".join(missing)


def test_layers_are_the_installed_packages():
    """The mapping above must match pyproject's package-dir, or the checks resolve wrongly."""
    text = (REPO / "pyproject.toml").read_text()
    for folder, pkg in LAYERS.items():
        assert f'"{pkg}" = "{folder}"' in text, f"pyproject maps {pkg} elsewhere than {folder}/"
    for folder in LAB:
        assert f'"{folder}' not in text, \
            f"pyproject names the lab's package {folder}: the lab is not installed"


# ------------------------------------------------------- the checker catches what it should
BAD = [
    ("neuron_dist.collectives.x", "from ..transport.shm import channel"),
    ("neuron_dist.collectives.x", "from ..transport.shm.channel import ShmChannel"),
    ("neuron_dist.collectives.x", "from ..transport import shm"),
    ("neuron_dist.collectives.x", "from .. import transport\nimport neuron_dist.transport.shm.segment"),
    ("neuron_dist.collectives.x", "import transport.shm"),
    ("neuron_dist.collectives.x", "from transport.shm import segment"),
    ("neuron_dist.collectives.x", "import torch.distributed as dist"),
    ("neuron_dist.collectives.x", "from torch import distributed"),
    ("neuron_dist.collectives.x", "from torch.distributed import ReduceOp"),
    ("neuron_dist.collectives.x", "import torch\ntorch.distributed.all_reduce(t)"),
    ("neuron_dist.collectives.x", "import importlib\nimportlib.import_module('neuron_dist.transport.shm')"),
    ("neuron_dist.collectives.x", "from ..process_group import ProcessGroupNeuron"),
    ("neuron_dist.collectives.x", "def f():\n    from .. import engine\n"),
    ("neuron_dist.collectives.x", "from ..transport.rdm.driver import RdmTransport"),
    ("neuron_dist.collectives.x", "from ..transport import mpi"),
    ("neuron_dist.collectives.x", "from ..transport.requests import Completion"),
    ("neuron_dist.collectives.x_net", "from ..topology import Topology"),
    ("neuron_dist.transport.shm.x", "import torch.distributed"),
    ("neuron_dist.transport.shm.x", "from ...process_group import ProcessGroupNeuron"),
    ("neuron_dist.transport.shm.x", "from ... import work"),
    ("neuron_dist.transport.shm.x", "from neuron_dist.engine import CollectiveEngine"),
    ("neuron_dist.transport.shm.x", "from neuron_dist import errors"),
    ("neuron_dist.transport.shm.x", "import neuron_dist"),
    ("neuron_dist.transport.x", "from ..collectives import allreduce"),
    ("neuron_dist.transport.x", "from ..collectives.descriptor import Call"),
    ("neuron_dist.transport.x", "import collectives.context"),
    ("neuron_dist.transport.x", "__import__('neuron_dist.work')"),
    ("neuron_dist.launch.train", "from bench import null_pg"),
    ("neuron_dist.launch.train", "def main():\n    import bench.job_floor_pg\n"),
    ("neuron_dist.process_group", "from bench.netsim import SimNet"),
    ("neuron_dist.collectives.x", "import bench"),
    ("neuron_dist.transport.rdm.x", "importlib.import_module('bench.link')"),
]

GOOD = [
    ("neuron_dist.collectives.x", "from .context import Context\nimport torch\nfrom ..transport.base import Channel"),
    ("neuron_dist.collectives.x", "from ..transport import errors\nfrom ..transport.errors import PeerDied"),
    ("neuron_dist.transport.shm.x", "from ..errors import PeerDied\nfrom . import layout as L\nimport torch"),
    ("neuron_dist.transport.shm.x", "from .segment import Segment\nimport os, mmap"),
    ("neuron_dist.transport.x", "from typing import Protocol"),
    ("bench.scale", "from neuron_dist.launch import vnodes\nfrom bench import null_pg\n"
                    "import torch.distributed as dist"),
    ("neuron_dist.launch.train", "import torch.distributed as dist\nfrom neuron_dist import config"),
]


def _functions(path: Path) -> dict:
    """Top-level public functions of a module: name -> parameter names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {f.name: [a.arg for a in f.args.posonlyargs + f.args.args + f.args.kwonlyargs]
            for f in tree.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}


NET_ALGORITHMS = sorted((REPO / "collectives").glob("*_net.py"))


def test_every_algorithm_across_nodes_sits_beside_its_one_node_counterpart():
    """``x_net.py`` has an ``x.py``, and the collectives both define take the same
    parameters (the c10d face picks one table or the other per group)."""
    assert len(NET_ALGORITHMS) >= 7, NET_ALGORITHMS
    problems = []
    for path in NET_ALGORITHMS:
        one_node = path.with_name(path.name[:-len("_net.py")] + ".py")
        if not one_node.exists():
            problems.append(f"{_rel(path)}: no {_rel(one_node)} beside it")
            continue
        theirs = _functions(one_node)
        shared = {name: params for name, params in _functions(path).items() if name in theirs}
        if not shared:
            problems.append(f"{_rel(path)}: defines none of {_rel(one_node)}'s collectives")
        for name, params in shared.items():
            if params != theirs[name]:
                problems.append(f"{_rel(path)}: {name}{tuple(params)} but "
                                f"{_rel(one_node)}: {name}{tuple(theirs[name])}")
    assert not problems, "\n  ".join(["across-nodes algorithms out of step:", *problems])


@pytest.mark.parametrize("path", NET_ALGORITHMS + [REPO / "collectives" / "net.py"],
                         ids=lambda p: p.name)
def test_between_nodes_modules_say_how_they_work(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "How it works" in doc, f"{_rel(path)}: no 'How it works' section in its docstring"


@pytest.mark.parametrize("module,source", BAD)
def test_checker_catches(module, source):
    found = violations(source, module, False, "example.py")
    assert found, f"not caught in {module}: {source!r}"
    assert all(f.startswith("example.py:") for f in found), found


@pytest.mark.parametrize("module,source", GOOD)
def test_checker_allows(module, source):
    assert violations(source, module, False, "example.py") == []


def test_module_names_resolve_like_the_installed_packages():
    assert module_name(REPO / "collectives" / "allreduce.py") == ("neuron_dist.collectives.allreduce", False)
    assert module_name(REPO / "transport" / "shm" / "__init__.py") == ("neuron_dist.transport.shm", True)
    assert module_name(REPO / "neuron_dist" / "engine.py") == ("neuron_dist.engine", False)
    assert module_name(REPO / "bench" / "scale.py") == ("bench.scale", False)
    # `from .. import errors` inside transport/shm/channel.py is transport.errors, allowed
    names = [n for _, n, _, _ in imported_names("from ..errors import PeerDied", "neuron_dist.transport.shm.channel", False)]
    assert "neuron_dist.transport.errors.PeerDied" in names, names
