"""PyTorch's own distributed suite (``DistributedTest._DistTestBase``) run on neuron.

torch ships it as ``torch/testing/_internal/distributed/distributed_test.py``; torch's
``test/distributed/test_distributed_spawn.py`` runs it with the environment variables
``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR``. Not collected by our suite directly:
``tests/stack/test_upstream.py`` runs this file in a pytest subprocess per world size,
because the upstream module reads ``BACKEND`` and ``WORLD_SIZE`` once, when it is imported,
to choose its tests.

The upstream module gates its tests on backend *names* and branches on them at run time
(``BACKEND == "gloo"`` selects the CPU code paths). Imported with ``BACKEND=gloo`` it
selects exactly the tests gloo runs on CPU; every process group those tests create is then
built on neuron (``UPSTREAM_BACKEND=neuron``, the default): the module's ``dist`` is a view
of ``torch.distributed`` whose ``init_process_group`` and ``new_group`` build ``neuron``
groups where the tests ask for gloo. ``UPSTREAM_BACKEND=gloo`` runs the same selection on
gloo itself, to compare.

Tests that do not apply (GPU-only, other backends or world sizes, gloo-specific APIs) are
deselected when pytest collects them (this module is also loaded as a plugin, ``-p
stack.upstream_dist``), each with its reason: nothing is left to skip. ``python upstream_dist.py``
prints them.

Ranks are forked, not spawned as upstream does: a spawned rank re-imports torch and this
module (~25 s a test on a busy 2-core machine, against ~1 s); the test process is
single-threaded when it forks (conftest.py), as the project's own harness relies on too.
"""

from __future__ import annotations

import inspect
import os
import sys
import types

os.environ.setdefault("BACKEND", "gloo")
if os.environ["BACKEND"] != "gloo":
    raise RuntimeError("upstream_dist.py selects gloo's CPU tests: run it with BACKEND=gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", "")  # set per test by initialize_temp_directories()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed import distributed_test as upstream  # noqa: E402

BACKEND = os.environ.get("UPSTREAM_BACKEND", "neuron")
WORLD_SIZE = int(os.environ["WORLD_SIZE"])


def _as_neuron(backend):
    if backend is None or str(backend).lower() != "gloo":
        return backend
    return "neuron"


class _DistOnNeuron(types.ModuleType):
    """``torch.distributed`` as the upstream tests see it: gloo groups are built on neuron."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def init_process_group(backend=None, *args, **kwargs):
        return dist.init_process_group(_as_neuron(backend), *args, **kwargs)

    @staticmethod
    def new_group(*args, backend=None, **kwargs):
        return dist.new_group(*args, backend=_as_neuron(backend), **kwargs)


if BACKEND == "neuron":
    import neuron_dist  # noqa: F401,E402 - registers the backend even without autoload
    upstream.dist = _DistOnNeuron("torch.distributed")
elif BACKEND != "gloo":
    raise RuntimeError(f"UPSTREAM_BACKEND must be neuron or gloo, not {BACKEND!r}")


# Tests upstream lets gloo run, that cannot pass on another backend whatever it does.
NOT_FOR_NEURON = {
    "test_get_backend": "asserts dist.get_backend() == 'gloo' (the module's BACKEND name)",
    "test_monitored_barrier_gloo": "monitored_barrier is hard-wired to gloo in torch",
    "test_monitored_barrier_gloo_subgroup": "monitored_barrier is hard-wired to gloo in torch",
    "test_monitored_barrier_gloo_rank_0_timeout": "monitored_barrier is hard-wired to gloo in torch",
}


def _skipped_when_run(fn) -> str | None:
    """Why one of upstream's run-time skip decorators would skip ``fn`` on this machine at
    this world size (they end the rank processes with a "skip" exit code), or None."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    while hasattr(fn, "__wrapped__"):
        name = fn.__code__.co_qualname.split(".<locals>")[0]
        free = inspect.getclosurevars(fn).nonlocals
        if name == "skip_if_no_gpu" and gpus < WORLD_SIZE:
            return "needs a CUDA device per rank (skip_if_no_gpu)"
        if name == "skip_if_lt_x_gpu" and gpus < free["x"] and not free.get("allow_cpu"):
            return f"needs {free['x']} CUDA devices (skip_if_lt_x_gpu)"
        if name == "skip_if_small_worldsize" and WORLD_SIZE < 8:
            return "needs world size 8 or more (skip_if_small_worldsize)"
        if name == "skip_if_odd_worldsize" and WORLD_SIZE % 2:
            return "needs an even world size (skip_if_odd_worldsize)"
        fn = fn.__wrapped__
    return None


def _exclusions() -> dict[str, str]:
    """Every upstream test not run here, with the reason."""
    out = {}
    base = upstream.DistributedTest._DistTestBase
    for name in dir(base):
        if not name.startswith("test"):
            continue
        fn = getattr(base, name)
        if getattr(fn, "__unittest_skip__", False):  # upstream's own gating, fixed at import
            out[name] = f"upstream skips it for gloo: {fn.__unittest_skip_why__}"
        elif (why := _skipped_when_run(fn)) is not None:
            out[name] = f"upstream skips it for gloo when run: {why}"
    if BACKEND == "neuron":
        for name, why in NOT_FOR_NEURON.items():
            if not hasattr(base, name):
                raise RuntimeError(f"NOT_FOR_NEURON names {name}, which upstream does not have")
            out.setdefault(name, f"not for neuron: {why}")
    return out


EXCLUDED = _exclusions()


class TestUpstreamDist(upstream.TestDistBackend, upstream.DistributedTest._DistTestBase):
    """The upstream suite, as test_distributed_spawn.py runs it, with forked ranks."""

    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


def pytest_collection_modifyitems(config, items):
    """Deselect the excluded tests (this module is also loaded as a plugin: ``-p``)."""
    def excluded(item):
        return getattr(item, "cls", None) is TestUpstreamDist and item.name in EXCLUDED

    drop = [i for i in items if excluded(i)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if not excluded(i)]


if __name__ == "__main__":
    print("\n".join(f"{k}: {v}" for k, v in sorted(EXCLUDED.items())))
    sys.exit(0)
