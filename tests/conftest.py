import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _neuron_segments():
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("neuron-")}
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test must leave no shared-memory segment and no child process behind."""
    import multiprocessing

    before = _neuron_segments()
    yield
    leaked = _neuron_segments() - before
    children = multiprocessing.active_children()
    for c in children:
        c.kill()
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
    assert not children, f"child processes left running: {children}"
