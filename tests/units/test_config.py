"""Settings live in one place: ``neuron_dist/config.py``.

Checked statically with ``ast`` (nothing is imported or executed), like test_layering.py:

* no module of the package other than config.py reads a ``NEURON_DIST_*`` variable from
  the environment (writing one, e.g. for a child process or the next group, is fine);
* every ``Settings`` field is read somewhere (as ``<something>.settings.<field>`` or
  ``settings.<field>``), so no setting is parsed and then ignored;
* the README's settings table lists exactly the variables config.py reads, each with
  config.py's default.

Two files are left out of the first check on purpose: ``launch/vnodes.py`` (stdlib only, it
must not import neuron_dist) and ``bench/link.py`` (runs standalone inside
network namespaces, no package imports).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from neuron_dist.config import Settings

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("neuron_dist", "collectives", "transport", "launch", "bench")
CONFIG = REPO / "neuron_dist" / "config.py"
EXEMPT = {REPO / "launch" / "vnodes.py", REPO / "bench" / "link.py"}
PREFIX = "NEURON_DIST_"
_READ_METHODS = ("get", "pop", "setdefault", "items", "keys", "values", "copy")


def _files() -> list[Path]:
    files = sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py"))
    assert len(files) > 20, "did not find the package's files"
    return files


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# ------------------------------------------------------------------ reads of the environment

def _is_environ(node) -> bool:
    """``os.environ`` (any ``<x>.environ``) or a bare ``environ`` (from os import environ)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _reads_environ(node, stmt) -> bool:
    if isinstance(node, ast.Subscript):
        return isinstance(node.ctx, ast.Load) and _is_environ(node.value)
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and _is_environ(f.value) and f.attr in _READ_METHODS:
            # a bare `os.environ.pop(name, None)` statement removes a variable, reads nothing
            return not (f.attr == "pop" and isinstance(stmt, ast.Expr) and stmt.value is node)
        return (isinstance(f, ast.Attribute) and f.attr == "getenv") or \
            (isinstance(f, ast.Name) and f.id == "getenv")
    if isinstance(node, ast.Compare):
        return any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and \
            any(_is_environ(c) for c in node.comparators)
    if isinstance(node, (ast.For, ast.comprehension)):
        return _is_environ(node.iter)
    return False


def _own_nodes(stmt):
    """The nodes of ``stmt`` itself, not of the statements nested in it."""
    todo = [stmt]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.stmt))


def env_reads(source: str, where: str) -> list[str]:
    """``where:line`` of every statement that reads the environment and names a
    NEURON_DIST_* variable (or the prefix itself); a compound statement whose header reads
    the environment (``for k in os.environ:``) is judged with its body."""
    found = []
    for stmt in ast.walk(ast.parse(source)):
        if not isinstance(stmt, ast.stmt):
            continue
        if not any(_reads_environ(n, stmt) for n in _own_nodes(stmt)):
            continue
        names = [n.value for n in ast.walk(stmt) if isinstance(n, ast.Constant)
                 and isinstance(n.value, str) and n.value.startswith(PREFIX)]
        if names:
            found.append(f"{where}:{stmt.lineno}: reads {names[0]} from the environment")
    return found


def test_only_config_reads_neuron_dist_variables():
    found = []
    for path in _files():
        if path == CONFIG or path in EXEMPT:
            continue
        found += env_reads(path.read_text(), _rel(path))
    assert not found, ("NEURON_DIST_* settings must be read in neuron_dist/config.py only:\n  "
                       + "\n  ".join(found))


BAD = [
    'import os\nx = os.environ.get("NEURON_DIST_SPIN", "auto")',
    'import os\nx = os.environ["NEURON_DIST_SPIN"]',
    'import os\nx = os.getenv("NEURON_DIST_SPIN")',
    'from os import environ, getenv\nx = environ.get("NEURON_DIST_SPIN")',
    'from os import getenv\nx = getenv("NEURON_DIST_SPIN")',
    'import os\nif "NEURON_DIST_SPIN" in os.environ:\n    pass',
    'import os\nold = os.environ.pop("NEURON_DIST_RAILS", None)',
    'import os\nos.environ.setdefault("NEURON_DIST_RAILS", "4")',
    'import os\nenv = {k: v for k, v in os.environ.items() if k.startswith("NEURON_DIST_")}',
    'import os\nfor k in os.environ:\n    if k.startswith("NEURON_DIST_"):\n        print(k)',
    'import os\ndef f():\n    return int(os.environ.get("NEURON_DIST_FR_SIZE", "2000"))',
]

GOOD = [
    'import os\nos.environ["NEURON_DIST_RAILS"] = "4"',                 # writing is fine
    'import os\nos.environ.pop("NEURON_DIST_RAILS", None)',             # so is removing
    'import os\ndel os.environ["NEURON_DIST_RAILS"]',
    'import os\nos.environ.update(NEURON_DIST_NODE_NAME="a")',
    'import os\nenv = dict(os.environ, NEURON_DIST_RAILS="1")',         # a child's environment
    'import os\nrank = int(os.environ.get("RANK", "0"))',              # not ours
    'import os\nmsg = "set NEURON_DIST_NODE_NAME"\nrank = os.environ["RANK"]',
    'from .config import environment\nx = environment().get("NEURON_DIST_RAILS")',
]


@pytest.mark.parametrize("source", BAD)
def test_checker_catches(source):
    assert env_reads(source, "example.py"), source


@pytest.mark.parametrize("source", GOOD)
def test_checker_allows(source):
    assert env_reads(source, "example.py") == [], source


# ------------------------------------------------------------------ every field is used

def settings_fields_read() -> set[str]:
    """Attribute names read as ``settings.<name>`` / ``<x>.settings.<name>`` outside
    config.py."""
    used = set()
    for path in _files():
        if path == CONFIG:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)):
                continue
            base = node.value
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            if name == "settings":
                used.add(node.attr)
    return used


def test_every_settings_field_is_read_somewhere():
    fields = {f.name for f in dataclasses.fields(Settings)}
    unused = sorted(fields - settings_fields_read())
    assert not unused, (f"Settings fields parsed but never read: {unused}: wire them to the "
                        f"code or delete them (and their README rows)")


# ------------------------------------------------------------------ the README's table

def config_variables() -> dict[str, str | None]:
    """Every variable config.py reads (through its ``_env`` / ``_flag`` helpers) -> default."""
    out = {}
    for node in ast.walk(ast.parse(CONFIG.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("_env", "_flag") \
                and node.args and isinstance(node.args[0], ast.Constant):
            name = node.args[0].value
            default = node.args[1].value if len(node.args) > 1 else None
            out[name] = default
    return out


def readme_settings() -> dict[str, str]:
    """The README's settings table: variable -> its default cell."""
    text = (REPO / "README.md").read_text()
    start = text.index("### Settings")
    end = text.index("\n#", start + 1)
    rows = re.findall(r"^\| `(NEURON_DIST_\w+)` \| (.*?) \|", text[start:end], re.M)
    return dict(rows)


def test_readme_lists_every_setting_with_its_default():
    # (torchrun's own variables that config.py also reads, e.g. MASTER_ADDR, are torch's)
    ours = {k: v for k, v in config_variables().items() if k.startswith("NEURON_DIST_")}
    readme = readme_settings()
    assert len(ours) > 15, ours
    assert not set(ours) - set(readme), f"not in the README's table: {sorted(set(ours) - set(readme))}"
    assert not set(readme) - set(ours), f"in the README but never read: {sorted(set(readme) - set(ours))}"
    wrong = {name: (default, readme[name]) for name, default in ours.items()
             if default is not None and f"`{default}`" not in readme[name]}
    assert not wrong, f"README default differs from config.py's (config, README): {wrong}"


def test_the_auth_key_has_a_minimum_length_and_is_never_recorded(monkeypatch):
    """Finding: the key had no length check, and the benchmark's environment record copied
    every NEURON_DIST_* variable, the key included, into its JSON."""
    from neuron_dist.config import MIN_AUTH_KEY_CHARS, environment

    with pytest.raises(ValueError, match=f"at least {MIN_AUTH_KEY_CHARS} characters"):
        Settings.from_env({"NEURON_DIST_AUTH_KEY": "short"})
    key = "a much longer job secret"
    assert Settings.from_env({"NEURON_DIST_AUTH_KEY": key}).auth_key == key
    monkeypatch.setenv("NEURON_DIST_AUTH_KEY", key)
    monkeypatch.setenv("NEURON_DIST_RAILS", "2")
    env = environment()
    assert env["NEURON_DIST_RAILS"] == "2" and key not in repr(env)
    assert env["NEURON_DIST_AUTH_KEY"] == "(set)"


def test_the_job_key_goes_through_a_slow_salted_kdf():
    """Finding: derive_key was one salt-less SHA-256, so a key could be guessed offline at
    a hash per guess from the store's tags."""
    import hashlib
    import time

    from neuron_dist.transport.rdm.handshake import derive_key

    secret = "another long job secret"
    assert derive_key(secret) != hashlib.sha256(b"neuron-dist auth key\0" + secret.encode()).digest()
    assert derive_key(secret) == hashlib.scrypt(secret.encode(), salt=b"neuron-dist auth key v2",
                                                n=1 << 14, r=8, p=1, maxmem=64 << 20, dklen=32)
    start = time.perf_counter()
    derive_key(secret)  # once per process: opening more groups stays fast
    assert time.perf_counter() - start < 0.005
