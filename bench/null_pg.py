"""The ``null`` process group: the dispatch floor the benchmark measures beside neuron and gloo.

A Python ``ProcessGroup`` subclass whose collectives do nothing and return a Work that is
already complete. Timing ``dist.all_reduce`` on it measures what every Python backend pays
before it moves a byte: torch's c10d dispatch, the options objects, the call into Python,
handing back a Work and waiting on it. Everything neuron takes above that is neuron's own
cost, so the benchmark runs it in the same ranks as neuron and gloo and reports neuron's
small-op time as a multiple of it.

Register it in each rank with ``register()`` before ``dist.new_group(backend="null")``. Its
results are wrong by design (outputs are never written): the benchmark skips ``--check``
for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BACKEND_NAME = "null"


class CompletedWork(dist.Work):
    """A Work that completed before it was returned (one per group, reused)."""

    def __init__(self):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result([])

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def get_future(self):
        return self._future


class Named:
    """What c10d asks a benchmark's Python ``ProcessGroup`` about its names (mixed in before
    ``ProcessGroup``; ``BACKEND`` is the registered name)."""

    BACKEND = ""
    _group_name = _group_desc = ""

    def getBackendName(self) -> str:
        return self.BACKEND

    def name(self) -> str:
        return self.BACKEND

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_name(self) -> str:
        return self._group_name


class NullProcessGroup(Named, dist.ProcessGroup):
    """Every collective and send/recv the benchmark calls, doing nothing."""

    BACKEND = BACKEND_NAME

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._done = CompletedWork()

    def _nothing(self, *args, **kwargs):
        return self._done

    allreduce = allreduce_coalesced = _nothing
    allgather = all_gather_single = all_gather_single_coalesced = _nothing
    reduce_scatter = reduce_scatter_single = reduce_scatter_single_coalesced = _nothing
    broadcast = reduce = gather = scatter = _nothing
    alltoall = all_to_all_single = _nothing
    send = recv = recv_anysource = barrier = _nothing


def _create(dist_opts, pg_options=None) -> NullProcessGroup:
    return NullProcessGroup(dist_opts.group_rank, dist_opts.group_size)


def register() -> None:
    """Register the ``null`` backend with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list or hasattr(dist.Backend, BACKEND_NAME.upper()):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
