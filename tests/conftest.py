"""The test tree, by layer (each folder's ``__init__.py`` says what it holds):

    units/         one process, no ranks forked, no network: seconds
    one_node/      ranks forked on this machine, joined by shared memory
    across_nodes/  transports between nodes, virtual nodes, network namespaces
    stack/         torch above the backend (DDP, FSDP, DTensor, ...) and launchers
    tools/         the benchmarks, the cost model and the type checker
    helpers/       what several layers share (harness, cases, relay, fake step channel)

Each folder is a package and tests/ is on ``sys.path``, so a test imports what it shares by
its place: ``from helpers.harness import run_ranks``, ``from one_node.test_collectives import
SMALL_SLOTS``. Scripts that tests launch by path sit beside their tests.

Every test must leave nothing behind (``no_leftovers`` below), and in CI nothing may skip.
"""

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

# Test ranks are forked from this process. Once torch has started its OpenMP thread pool
# (any large enough op runs in parallel), a forked child that enters a parallel region can
# hang forever inside libgomp. Keeping this process single-threaded keeps forking safe;
# the ranks inherit the setting.
torch.set_num_threads(1)

# Flight-recorder dumps (written when a test makes a collective fail) go to a private
# directory that is removed at the end of the session, not into the working tree.
_FR_DIR = tempfile.mkdtemp(prefix="neuron-fr-tests-")
os.environ.setdefault("NEURON_DIST_FR_DIR", _FR_DIR)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_FR_DIR, ignore_errors=True)


def _neuron_segments():
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("neuron-")}
    except OSError:
        return set()


def _ours_or_orphaned(name: str) -> bool:
    """A segment is a leak if this process made it or its creator is gone.

    (A segment whose creator still runs belongs to another job on this machine, caught in
    the moment between creating and unlinking its segment.)
    """
    from neuron_dist.transport.shm.procid import alive

    try:
        pid = int(name.split("-")[2])
    except (IndexError, ValueError):
        return True
    return pid == os.getpid() or not alive(pid)


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test must leave no shared-memory segment and no child process behind."""
    import multiprocessing

    before = _neuron_segments()
    yield
    leaked = {n for n in _neuron_segments() - before if _ours_or_orphaned(n)}
    children = multiprocessing.active_children()
    for c in children:
        c.kill()
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
    assert not children, f"child processes left running: {children}"


# In CI (.ci/run sets NEURON_DIST_TESTS_REQUIRE_ALL=1) a test that would skip guards
# nothing: a missing prerequisite (root, network namespaces, mpiexec, an optional package)
# fails the run instead, naming what was missing.
_REQUIRE_ALL = os.environ.get("NEURON_DIST_TESTS_REQUIRE_ALL") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"skipped in CI, where every prerequisite must be present "
                           f"(NEURON_DIST_TESTS_REQUIRE_ALL=1): {reason}")
