"""MPI's own nonblocking collectives on a transport's column.

How it works
------------
A rank's column is the ranks of its local index on every node (communicator.py splits its
communicator off the group's). Every member of the column must start the same
collectives in the same order with matching sizes (MPI's rule): collectives/net_mpi.py
checks the calls' descriptors with a fixed-size ``iallgather`` before any other. Buffers
belong to MPI until the request completes; one that never does (a deadline, a failed
member) keeps them alive (orphans.py). They are always the call's staging buffers
(collectives/net_mpi.py copies in before and out after), never a caller's tensor, so a
collective fails at once when a column member fails or the transport closes.
"""

from __future__ import annotations

import os
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from ..errors import PeerTimeout
from .active import COLL
from .request import Request, writable

if TYPE_CHECKING:
    from mpi4py.MPI import Comm
    from typing_extensions import Buffer

    from .driver import MpiTransport

_COLL_SPIN_SECONDS = 0.05            # a waiter tests its collective back to back this long,
_FULL_POLL_EVERY = 1e-3              # with a whole poll of the transport this often

MPI_OPS = {"SUM": "SUM", "PRODUCT": "PROD", "MIN": "MIN", "MAX": "MAX",
           "BAND": "BAND", "BOR": "BOR", "BXOR": "BXOR"}
MPI_TYPES = {"float32": "FLOAT", "float64": "DOUBLE", "int8": "INT8_T",
             "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
             "uint8": "UINT8_T"}


class CollectiveRequest(Request):
    """One of MPI's collectives on the column (``MpiTransport.iallgather`` ...).

    Unlike a send or receive, it fails at once when a column member fails (or the transport
    closes), although MPI may still own its buffers: those are always the call's staging
    buffers (collectives/net_mpi.py copies in before and out after, and drops a failed
    call's buffers from its pool), never a caller's tensor, and they stay alive until MPI
    completes the request (orphans).
    """

    __slots__ = ("name", "mpi", "_calls")

    def __init__(self, name: str, owner: MpiTransport, calls: ColumnCalls, nbytes: int):
        super().__init__(None, -1, memoryview(b""), False, owner)
        self.name, self.nbytes, self._calls = name, nbytes, calls
        self.mpi: Any = None  # MPI's request (an mpi4py Request), while MPI has it

    def _block(self, deadline: float) -> bool:
        return self._calls.drive(self, deadline)

    def wait(self, deadline: float) -> None:
        try:
            super().wait(deadline)
        except PeerTimeout as e:
            if self.error is not None:
                raise
            raise PeerTimeout([], e.waited,
                              f"MPI's {self.name} ({self.nbytes} bytes) with column "
                              f"{self._calls.column} did not complete in time: a member is "
                              f"late or made another call", network=True) from None


class ColumnCalls:
    """MPI's collectives of ``owner`` (a transport) on ``comm``, its column's communicator
    (the group ranks ``column``, in node order)."""

    def __init__(self, owner: MpiTransport, MPI: ModuleType, comm: Comm, column: list[int]):
        self._owner, self._MPI, self._comm, self.column = owner, MPI, comm, column
        self._column = column

    @staticmethod
    def reduces(dtype: str, op: str) -> bool:
        """Can MPI reduce elements of ``dtype`` (torch's name: ``float32``...) with ``op``
        (``SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``, ``BOR``, ``BXOR``)?"""
        if dtype not in MPI_TYPES or op not in MPI_OPS:
            return False
        return dtype.startswith(("int", "uint")) or op not in ("BAND", "BOR", "BXOR")

    def iallgather(self, send: Buffer, recv: Buffer) -> CollectiveRequest:
        """Every column member's ``send`` bytes, in column order, into ``recv``."""
        s, r = memoryview(send).cast("B"), writable(recv)
        P = len(self._column)
        if r.nbytes != s.nbytes * P:
            raise ValueError(f"iallgather: {r.nbytes} bytes cannot hold {P} x {s.nbytes}")
        B = self._MPI.BYTE
        return self._start("all_gather", r.nbytes,
                                lambda c: c.Iallgather([s, B], [r, B]), (s, r))

    def ialltoall(self, send: Buffer, recv: Buffer) -> CollectiveRequest:
        """Block ``b`` of ``send`` to column member ``b``; member ``b``'s block for this rank
        into block ``b`` of ``recv`` (blocks of one size)."""
        s, r = memoryview(send).cast("B"), writable(recv)
        P = len(self._column)
        if r.nbytes != s.nbytes or s.nbytes % P:
            raise ValueError(f"ialltoall: {s.nbytes} and {r.nbytes} bytes are not "
                             f"{P} blocks each")
        B = self._MPI.BYTE
        return self._start("all_to_all", r.nbytes,
                                lambda c: c.Ialltoall([s, B], [r, B]), (s, r))

    def iallreduce(self, buf: Buffer, dtype: str, op: str) -> CollectiveRequest:
        """Reduce ``buf`` (elements of ``dtype``) over the column with ``op``, in place."""
        b = writable(buf)
        t, o = self._typed(dtype, op, b.nbytes)
        IN_PLACE = self._MPI.IN_PLACE
        return self._start("all_reduce", b.nbytes,
                                lambda c: c.Iallreduce(IN_PLACE, [b, t], o), (b,))

    def ireduce_scatter(self, send: Buffer, recv: Buffer, dtype: str, op: str
                        ) -> CollectiveRequest:
        """Reduce ``send`` (one block per column member, in order) with ``op``; this rank's
        block of the result into ``recv``."""
        s, r = memoryview(send).cast("B"), writable(recv)
        P = len(self._column)
        if s.nbytes != r.nbytes * P:
            raise ValueError(f"ireduce_scatter: {s.nbytes} bytes are not {P} "
                             f"blocks of {r.nbytes}")
        t, o = self._typed(dtype, op, r.nbytes)
        return self._start("reduce_scatter", s.nbytes,
                                lambda c: c.Ireduce_scatter_block([s, t], [r, t], o), (s, r))

    def ibcast(self, buf: Buffer, root: int) -> CollectiveRequest:
        """Column member ``root``'s (an index into ``column``) ``buf`` into everyone's."""
        b = writable(buf)
        if not 0 <= root < len(self._column):
            raise ValueError(f"ibcast: root {root} is not an index into column {self._column}")
        B = self._MPI.BYTE
        return self._start("broadcast", b.nbytes, lambda c: c.Ibcast([b, B], root), (b,))

    def _typed(self, dtype: str, op: str, nbytes: int) -> tuple[Any, Any]:
        if not self.reduces(dtype, op):
            raise ValueError(f"MPI does not reduce {dtype} with {op} here")
        MPI = self._MPI
        t = getattr(MPI, MPI_TYPES[dtype])
        if nbytes % t.Get_size():
            raise ValueError(f"{nbytes} bytes are not whole {dtype} elements")
        return t, getattr(MPI, MPI_OPS[op])

    def _start(self, name: str, nbytes: int, start: Callable[[Comm], Any],
               bufs: tuple[memoryview, ...]) -> CollectiveRequest:
        owner = self._owner
        req = CollectiveRequest(name, owner, self, nbytes)
        with owner.lock:
            owner.check_open()
            column = self._column
            owner.matcher.read_control()
            for k in column:
                if k in owner.failed:
                    raise owner.failed[k]
            mpi_req = start(self._comm)
            if mpi_req.Test():
                req.finish()
            else:
                req.mpi = mpi_req
                owner.active.add(mpi_req, COLL, req, bufs)
                owner.polling.wake()
        return req

    def drive(self, req: CollectiveRequest, deadline: float) -> bool:
        """Wait for collective ``req``, driving MPI from this thread; False on timeout.

        A collective moves on only while its members call into MPI, and shows no progress
        until its last round: so its waiter tests its request (which drives all of MPI)
        back to back, yielding the CPU in between, for up to ``_COLL_SPIN_SECONDS`` (as a
        blocking MPI collective would), with a whole poll (peers' notices, other requests)
        every ``_FULL_POLL_EVERY``; then it polls with sleeps as ``MpiTransport.drive``
        does. One test costs a few µs of Python where a whole poll costs several times
        that, and on crowded cores every µs a waiter spends is taken from the members it
        waits for.
        """
        owner, event = self._owner, req.completion
        with owner.polling.waiting():
            start = now = time.monotonic()
            full_at = now + _FULL_POLL_EVERY
            while not event.is_set() and now - start < _COLL_SPIN_SECONDS:
                with owner.lock:
                    if owner.closed:
                        break
                    mpi_req = req.mpi
                    try:
                        if now >= full_at:
                            owner.poll()
                            full_at = now + _FULL_POLL_EVERY
                        elif mpi_req is not None and mpi_req.Test():
                            owner.active.retire(mpi_req)
                            req.finish()
                    except Exception:  # noqa: BLE001 - the whole poll below reports it
                        full_at = now
                if event.is_set():
                    break
                now = time.monotonic()
                if now >= deadline:
                    return False
                os.sched_yield()
        return event.is_set() or owner.polling.drive(event, deadline)
