"""The README runs as written, and its performance table says what results/ holds.

* Every ```bash, ```sh and ```python block of README.md is run, one test per block, in
  the clone's root with the clone's venv first on ``PATH``: a shell block with
  ``bash -euo pipefail``, a python block as a script. A block preceded by
  ``<!-- readme-test: file NAME -->`` is saved as ``NAME`` in the clone's root for the
  blocks after it (the quick start), and removed afterwards; where the README says what
  such a file prints ("it prints `...`"), the block that runs it must print that.
* A block preceded by ``<!-- readme-test: skip (REASON) -->`` is not run, and REASON must
  be one of ``ALLOWED_SKIPS``: it needs several machines, or it is one of the two set-up
  commands (CI runs those anyway).
* Every figure of the performance table appears in the file of ``results/`` its row names,
  and the command the row names is the one that file records on its first line.

Each block is bounded in time and runs in a session of its own, which is killed after it,
so nothing it started outlives it. pip is kept off the network (``PIP_NO_INDEX``): the
README's install block must find everything already installed, as it is in the venv the
suite runs in.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.procs import processes_with

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
ALLOWED_SKIPS = ("needs several machines", "one of the two set-up commands")
RUN = ("bash", "sh", "python")
BLOCK_TIMEOUT = 180.0  # seconds for one block (the slowest, TorchTitan's two runs, took 40 s on 2 cores)

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")


def blocks(text: str | None = None) -> list[dict]:
    """Fenced blocks of the README: language, body, the line it starts on, and the
    ``readme-test`` marker on the last non-blank line before it (or None)."""
    text = README.read_text() if text is None else text
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        out.append({"lang": m.group(1), "body": m.group(2), "marker": marker and marker.group(1),
                    "line": text.count("\n", 0, m.start()) + 1})
    return out


def runnable() -> list[dict]:
    return [b for b in blocks() if b["lang"] in RUN
            and not (b["marker"] or "").startswith(("skip", "file"))]


def files() -> list[tuple[str, str]]:
    out = []
    for b in blocks():
        if (b["marker"] or "").startswith("file"):
            out.append((b["marker"].split(None, 1)[1].strip(), b["body"]))
    return out


def _id(b: dict) -> str:
    first = next((ln.strip() for ln in b["body"].splitlines()
                  if ln.strip() and not ln.lstrip().startswith("#")), "")
    return f"L{b['line']}-{first[:40]}"


# ------------------------------------------------------------------ the markers

def test_every_marker_is_known_and_every_skip_has_an_allowed_reason():
    wrong = []
    for b in blocks():
        m = b["marker"]
        if m is None:
            continue
        if m.startswith("skip"):
            reason = re.fullmatch(r"skip \((.*)\)", m)
            if not reason or reason.group(1) not in ALLOWED_SKIPS:
                wrong.append(f"line {b['line']}: {m!r}: a skip's reason must be one of {ALLOWED_SKIPS}")
        elif m.startswith("file"):
            if not re.fullmatch(r"file [\w.-]+", m) or b["lang"] not in RUN:
                wrong.append(f"line {b['line']}: {m!r} must be 'file NAME' before a code block")
        else:
            wrong.append(f"line {b['line']}: unknown marker {m!r}")
        if b["lang"] not in RUN:
            wrong.append(f"line {b['line']}: a marker before a ```{b['lang']} block, which is never run")
    assert not wrong, "\n".join(wrong)
    assert len(runnable()) >= 6, [_id(b) for b in runnable()]
    # a marker that does not sit right before a block would silently do nothing
    text = README.read_text()
    assert text.count("readme-test:") == sum(b["marker"] is not None for b in blocks())


# ------------------------------------------------------------------ running the blocks

@pytest.fixture(scope="module")
def readme_env():
    venv = REPO / ".venv"
    if not (venv / "bin" / "activate").exists() or venv.resolve() != Path(sys.prefix).resolve():
        pytest.skip(f"the README's commands use the clone's .venv ({venv}); this suite runs in "
                    f"{sys.prefix}: run it with scripts/test.sh")
    written = []
    for name, body in files():
        path = REPO / name
        assert not path.exists() or path.read_text() == body, \
            f"{path} exists and is not the README's: not overwriting it"
        path.write_text(body)
        written.append(path)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
           and not k.startswith("NEURON_DIST_")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               # (pip's inverted flag: "false" turns build isolation off, so the editable
               # build uses the venv's setuptools instead of fetching one)
               PIP_NO_BUILD_ISOLATION="false")
    try:
        yield env
    finally:
        for path in written:
            path.unlink(missing_ok=True)


def _prerequisites(body: str):
    if "--netns" in body:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from launch import vnodes
        if not vnodes.netns_available():
            pytest.skip("needs root and working ip netns/veth/bridge (--netns)")
    if "launch/titan.py" in body:
        pytest.importorskip("torchtitan")


@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT + 60)
@pytest.mark.parametrize("block", runnable(), ids=_id)
def test_readme_block_runs_as_written(block, readme_env, tmp_path):
    _prerequisites(block["body"])
    script = tmp_path / ("block.py" if block["lang"] == "python" else "block.sh")
    script.write_text(block["body"])
    cmd = ([sys.executable, str(script)] if block["lang"] == "python"
           else ["bash", "-euo", "pipefail", str(script)])
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=readme_env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"README line {block['line']}: still running after {BLOCK_TIMEOUT:.0f} s:\n"
                    f"{block['body']}\n--- output (tail) ---\n{out[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the block left in its session
        except ProcessLookupError:
            pass
    took = time.monotonic() - start
    assert proc.returncode == 0, (f"README line {block['line']} failed (exit {proc.returncode}, "
                                  f"{took:.0f} s):\n{block['body']}\n--- output (tail) ---\n"
                                  f"{out[-8000:]}")
    for name, _ in files():
        if name in block["body"]:
            assert not processes_with(name), f"processes running {name} outlived the block"
            said = re.search(rf"`{re.escape(name)}`.*?it prints `([^`]+)`", README.read_text(), re.S)
            if said:
                assert said.group(1) in out, f"the README says {name} prints {said.group(1)!r}:\n{out[-4000:]}"


# ------------------------------------------------------------------ the performance table

def performance_rows(text: str | None = None) -> list[list[str]]:
    text = README.read_text() if text is None else text
    start = text.index("\n## Performance")
    end = text.index("\n## ", start + 1)
    rows = [ln for ln in text[start:end].splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows]
    head, rule, *body = cells
    assert head == ["measurement", "neuron", "gloo", "vs gloo", "file", "command"], head
    assert set("".join(rule)) <= set("-: "), rule
    return body


def recorded_command(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    return re.sub(r"^[#$]\s*", "", first).strip()


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def test_every_performance_figure_is_in_the_results_file_it_names():
    rows = performance_rows()
    assert len(rows) >= 5, rows
    wrong, command = [], None
    for what, *figures, file_cell, command_cell in rows:
        name = file_cell.strip("`")
        assert re.fullmatch(r"results/[\w.-]+\.txt", name), f"{what}: {file_cell!r} names no results file"
        path = REPO / name
        assert path.exists(), f"{what}: {name} does not exist"
        command = command if command_cell == "same" else command_cell.strip("`")
        assert command, f"{what}: the first row cannot say 'same'"
        if command != recorded_command(path):
            wrong.append(f"{what}: {name} was made by `{recorded_command(path)}`, "
                         f"the table says `{command}`")
        data = path.read_text()
        for cell in figures:
            numbers = _NUMBER.findall(cell)
            assert numbers, f"{what}: a figure cell without a figure: {cell!r}"
            for n in numbers:
                if not re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", data):
                    wrong.append(f"{what}: {n} (from {cell!r}) is not in {name}")
    assert not wrong, "\n".join(wrong)
