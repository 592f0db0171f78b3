"""PyTorch's own distributed test suite (``_DistTestBase``) passes on neuron.

Each world size runs ``upstream_dist.py`` in a pytest subprocess (the upstream module
chooses its tests from ``BACKEND`` and ``WORLD_SIZE`` when it is imported, so one process
cannot hold two world sizes). Every test it selects must pass: none may fail, error or skip,
and the number that ran must be the one docs/testing.md states, so a test that silently
stopped being selected fails here too. docs/testing.md lists what is excluded and why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
# Tests that run (and pass) per world size with torch 2.13.0: docs/testing.md, "PyTorch's own tests".
EXPECTED_PASSED = {2: 87, 3: 87}


def _run(world: int, tmp: str, xml: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "BACKEND": "gloo", "WORLD_SIZE": str(world),
           # as torch's run_test.py does for its file:// pass: the re-initialising test
           # (test_barrier_timeout_global) runs only with it
           "INIT_METHOD": f"file://{tmp}/shared_init_file",
           "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])),
           # upstream's per-test bound on its rank processes (default 300 s)
           "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": "120"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
           "-p", "stack.upstream_dist", os.path.join(HERE, "upstream_dist.py"), f"--junitxml={xml}"]
    proc = subprocess.Popen(cmd, env=env, cwd=os.path.dirname(TESTS), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its rank processes
        out, _ = proc.communicate()
        pytest.fail(f"upstream suite at world size {world} exceeded {timeout:.0f} s:\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _outcomes(xml: str) -> dict[str, list[str]]:
    out = {"passed": [], "failed": [], "skipped": []}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kind = ("failed" if case.find("failure") is not None or case.find("error") is not None
                else "skipped" if case.find("skipped") is not None else "passed")
        out[kind].append(case.get("name"))
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", sorted(EXPECTED_PASSED))
def test_torch_distributed_suite_passes_on_neuron(world, tmp_path):
    xml = str(tmp_path / "upstream.xml")
    res = _run(world, str(tmp_path), xml, timeout=840)
    assert os.path.exists(xml), res.stdout[-6000:]
    got = _outcomes(xml)
    assert not got["failed"] and not got["skipped"] and res.returncode == 0, \
        f"failed: {got['failed']}\nskipped: {got['skipped']}\n{res.stdout[-8000:]}"
    assert len(got["passed"]) == EXPECTED_PASSED[world], \
        f"{len(got['passed'])} upstream tests ran at world size {world}, docs/testing.md says " \
        f"{EXPECTED_PASSED[world]}:\n{res.stdout[-3000:]}"
