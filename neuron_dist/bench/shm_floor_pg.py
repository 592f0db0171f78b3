"""The floor of a Python backend inside a node: small messages through shared memory, and
nothing else.

How it works
------------
``neuron_shm_floor`` is a ``torch.distributed`` backend for benchmarks only. Rank 0 creates
one shared-memory segment for the group and names it in the store; every rank maps it, and
rank 0 unlinks it once all have (nothing stays in /dev/shm). Each rank owns a counter
(its own 64-byte line) and two slots of ``SLOT_BYTES``, used by turns (the counter's parity).

* ``all_reduce`` (SUM): copy the tensor into this rank's slot (one torch copy), store the
  call's number in the counter, wait until every peer's counter has reached it (spinning,
  then yielding), and add the peers' slots into the tensor in rank order (torch adds; with
  two ranks ``a + b`` and ``b + a`` are the same bits).
* ``broadcast``: the root copies into its slot and stores its counter; the others wait for
  it and copy out.
* A slot is written again two calls later, once every peer has reached the call in
  between: none of them still reads it.

No call descriptors, checks, timeouts, flight recorder, statistics, engine or Work
bookkeeping: what neuron's express lane costs above this is neuron's own overhead, and
what this costs above ``null`` (null_pg.py) is what moving bytes between two Python
processes through torch costs on the machine. ``bench.hotloop --backend neuron_shm_floor``
and ``bench.instructions`` (``shmfloor``) run it. Not for training: it never notices a dead
peer and waits without a deadline (bounded by ``WAIT_SECONDS``).
"""

from __future__ import annotations

import mmap
import os
import secrets
import time

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .null_pg import CompletedWork, Named

BACKEND_NAME = "neuron_shm_floor"
SLOT_BYTES = 64 << 10  # largest tensor it moves
LINE = 64
WAIT_SECONDS = 60.0  # a peer that never arrives fails the wait after this
_SPINS = 2000  # polls before each yield


class ShmFloorProcessGroup(Named, ProcessGroup):
    """See the module docstring."""

    BACKEND = BACKEND_NAME

    def __init__(self, store, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._done = CompletedWork()
        self._peers = [k for k in range(size) if k != rank]
        self._slots_at = size * LINE  # slots follow the counters
        nbytes = self._slots_at + size * 2 * SLOT_BYTES
        if rank == 0:
            name = f"/neuron-shmfloor-{os.getpid()}-{secrets.token_hex(8)}"  # (pid third, as ours)
            fd = os.open(f"/dev/shm{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)  # (sized before anyone is told its name)
            except OSError:
                os.close(fd)
                os.unlink(f"/dev/shm{name}")
                raise
            store.set("shm_floor/name", name)
        else:
            name = store.get("shm_floor/name").decode()
            fd = os.open(f"/dev/shm{name}", os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        store.add("shm_floor/mapped", 1)
        if rank == 0:  # unlinked once everyone has it mapped
            deadline = time.monotonic() + WAIT_SECONDS
            while store.add("shm_floor/mapped", 0) < size:
                if time.monotonic() > deadline:
                    os.unlink(f"/dev/shm{name}")
                    raise RuntimeError(f"{BACKEND_NAME}: ranks did not map the segment")
                time.sleep(0.001)
            os.unlink(f"/dev/shm{name}")
        self._words = memoryview(self._map).cast("q")
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._views: dict = {}
        self._seq = 0

    def _slot(self, rank: int, parity: int, like: torch.Tensor) -> torch.Tensor:
        key = (rank, parity, like.dtype, like.numel())
        view = self._views.get(key)
        if view is None:
            off = self._slots_at + (2 * rank + parity) * SLOT_BYTES
            n = like.numel() * like.element_size()
            if n > SLOT_BYTES:
                raise ValueError(f"{BACKEND_NAME}: {n} bytes exceed its {SLOT_BYTES}-byte slot")
            view = self._views[key] = self._bytes[off:off + n].view(like.dtype)
        return view

    def _wait(self, peers, seq: int) -> None:
        words, stride = self._words, LINE // 8
        deadline = None
        for k in peers:
            spins = 0
            while words[k * stride] < seq:
                spins += 1
                if spins % _SPINS == 0:
                    os.sched_yield()
                    if deadline is None:
                        deadline = time.monotonic() + WAIT_SECONDS
                    elif time.monotonic() > deadline:
                        raise RuntimeError(f"{BACKEND_NAME}: rank {k} did not arrive")

    def _begin(self) -> int:
        seq = self._seq = self._seq + 1
        self._wait(self._peers, seq - 1)  # they left the call that last used this slot
        return seq

    def allreduce(self, tensors, opts=None):
        t = tensors[0].view(-1)
        seq = self._begin()
        parity = seq & 1
        self._slot(self._rank, parity, t).copy_(t)
        self._words[self._rank * (LINE // 8)] = seq
        self._wait(self._peers, seq)
        if self._size == 2:
            t.add_(self._slot(1 - self._rank, parity, t))
        else:
            t.copy_(self._slot(0, parity, t))
            for k in range(1, self._size):
                t.add_(self._slot(k, parity, t))
        return self._done

    def broadcast(self, tensors, opts=None):
        t = tensors[0].view(-1)
        root = opts.rootRank if opts is not None else 0
        seq = self._begin()
        parity = seq & 1
        if self._rank == root:
            self._slot(root, parity, t).copy_(t)
            self._words[root * (LINE // 8)] = seq
        else:
            self._wait((root,), seq)
            t.copy_(self._slot(root, parity, t))
            self._words[self._rank * (LINE // 8)] = seq
        return self._done

    def barrier(self, opts=None):
        self.allreduce([torch.zeros(1, dtype=torch.uint8)])
        return self._done

    def shutdown(self) -> None:
        self._views.clear()
        self._words.release()
        del self._bytes
        try:
            self._map.close()
        except BufferError:  # a tensor view still refers to it: the mapping goes with it
            pass


def register() -> None:
    """Register ``neuron_shm_floor`` with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, lambda o, pg_options=None: ShmFloorProcessGroup(o.store, o.group_rank,
                                                                      o.group_size),
        extended_api=True, devices=["cpu"])
