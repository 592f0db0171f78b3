"""The type checker: mypy, strict, on the layers below the c10d face (pyproject's
``[tool.mypy]``). ``CHECKED`` lists the packages held to it; every other module is read
for its types only.

mypy sees the repository as the installed package: its folders are laid out as
``neuron_dist.transport`` and ``neuron_dist.collectives`` (pyproject's package-dir
mapping) in a temporary directory of links, removed afterwards. Its cache is the
repository's ``.mypy_cache`` (git ignores it), so a second run takes a moment.

By hand::

    python -m pytest tests/tools/test_types.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Held to strict typing, every module of them.
CHECKED = ["neuron_dist.transport", "neuron_dist.collectives"]
LAYERS = {"collectives": "collectives", "transport": "transport"}  # package -> folder


def _installed_layout(root: Path) -> None:
    """``root/neuron_dist`` as the installed package: links to the repository's files."""
    pkg = root / "neuron_dist"
    pkg.mkdir()
    for entry in (REPO / "neuron_dist").iterdir():
        if entry.suffix == ".py":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in LAYERS.items():
        (pkg / name).symlink_to(REPO / folder, target_is_directory=True)


def test_strict_types():
    pytest.importorskip("mypy")
    with tempfile.TemporaryDirectory(prefix="neuron-mypy-") as tmp:
        _installed_layout(Path(tmp))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
               "--cache-dir", str(REPO / ".mypy_cache"), "--no-error-summary"]
        for pkg in CHECKED:
            cmd += ["-p", pkg]
        env = {**os.environ, "MYPYPATH": tmp}
        run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                             timeout=240)
    report = (run.stdout + run.stderr).replace(tmp + "/neuron_dist/", "")
    assert run.returncode == 0, f"mypy found errors:\n{report}"
