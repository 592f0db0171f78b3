"""The communicator of a group over MPI, and of its column.

How it works
------------
A transport serves one group whose rank ``k`` is rank ``world_ranks[k]`` of the parent
communicator (``MPI_COMM_WORLD``). ``create`` builds the group's own communicator with
``MPI_Comm_create_group``, which is collective over the group's members only (every member
creates the transport together, as it opens the group) and gives the communicator a fresh
context, so tags of different groups, and of the user's own MPI traffic, never meet.
Communicator rank ``k`` is group rank ``k``: no rank translation afterwards.
``MPI_Comm_create_group`` blocks until every member calls it, and nothing can interrupt it;
so each member first sends every other a 9-byte arrival note (a digest of the member list)
on the parent communicator, tag ``_ARRIVE_TAG`` (0x4E45, reserved there), with nonblocking
calls tested under the lock and sleeps between, and calls ``MPI_Comm_create_group`` only
once it has every member's note (and none withdrew: see ``_await_members``). A member that
never comes costs that group a ``PeerTimeout`` naming it at the deadline; the lock (at
SERIALIZED, every transport's) is not held by a call that waits for a member that is not
there.

``split_column`` splits a rank's column (the ranks of its local index on every node) off
the group's communicator, for MPI's own collectives (column.py).
"""

from __future__ import annotations

import hashlib
import time
from types import ModuleType
from typing import TYPE_CHECKING, ContextManager, Iterable

from ..errors import PeerTimeout, TransportError
from .orphans import keep as keep_orphans

if TYPE_CHECKING:
    from mpi4py.MPI import Comm, Intracomm

_CREATE_TAG = 0x4E44                 # tag of MPI_Comm_create_group (any value <= 32767)
_ARRIVE_TAG = 0x4E45                 # members' arrival notes before it, on the parent
_MAX_PAUSE = 2e-3                    # pauses between tests of the notes grow to this


def members_digest(world_ranks: Iterable[int]) -> bytes:
    """8 bytes naming a member list (what arrival notes carry)."""
    return hashlib.blake2b(repr(list(world_ranks)).encode(), digest_size=8).digest()


def create(MPI: ModuleType, lock: ContextManager[object], parent: Intracomm,
           world_ranks: list[int], rank: int, label: str, deadline: float | None) -> Intracomm:
    """The group's communicator: group rank ``rank`` is ``world_ranks[rank]`` of ``parent``.

    ``MPI_Comm_create_group`` blocks until every member calls it, and is made under
    ``lock`` (at SERIALIZED the process's one lock, which every transport's MPI calls
    need). So it is called only once every member is known to be here
    (``_await_members``): a member that never comes costs this group a PeerTimeout, and
    never a call that holds the lock forever while the process's other groups wait for it.
    """
    _await_members(MPI, lock, parent, world_ranks, rank, label, deadline)
    with lock:
        whole = parent.Get_group()
        try:
            group = whole.Incl(world_ranks)
        finally:
            whole.Free()
        try:
            comm: Intracomm = parent.Create_group(group, _CREATE_TAG)
            return comm
        finally:
            group.Free()


def split_column(lock: ContextManager[object], comm: Intracomm, column: list[int], rank: int,
                 label: str) -> Comm:
    """Split the column communicator off the group's ``comm`` (collective over the group:
    every member does it right after the group's creation, so all are there)."""
    if rank not in column or len(set(column)) != len(column):
        raise ValueError(f"column {column} must list distinct group ranks, {rank} "
                         f"among them")
    with lock:
        sub = comm.Split(column[0], column.index(rank))
        size = sub.Get_size()
    if size != len(column):
        sub.Free()
        raise ValueError(f"{label}: column {column} has {size} members in MPI (do "
                         f"all ranks pass the same columns?)")
    return sub


def _await_members(MPI: ModuleType, lock: ContextManager[object], parent: Intracomm,
                   world_ranks: list[int], rank: int, label: str,
                   deadline: float | None) -> None:
    """Wait until every member has reached the communicator's creation.

    Each member sends every other an arrival note (a digest of the member list, then
    ``A``) on ``parent``, tag ``_ARRIVE_TAG``, and waits for theirs, with nonblocking
    calls tested under the lock one at a time (never held while waiting). A member
    whose deadline passes withdraws: it cancels its receives and sends every other a
    withdrawal note (digest, ``W``), which a member that came late finds right after
    the arrival notes, so it fails too instead of waiting in ``MPI_Comm_create_group``
    for a member that left. (A withdrawal left over from an earlier abandoned creation
    is skipped.) Only a member that withdraws in the instant between another's last
    arrival note and its check can still leave that one waiting.

    Raises PeerTimeout naming the members not heard from by ``deadline`` (None: wait as
    long as it takes) or the members that withdrew; TransportError if a member's note
    names another member list (groups created in different orders)."""
    digest = members_digest(world_ranks)
    arrived, withdrawn = digest + b"A", digest + b"W"
    me = world_ranks[rank]
    others = {k: r for k, r in enumerate(world_ranks) if r != me}
    bufs = {k: bytearray(len(arrived)) for k in others}
    start, pause = time.monotonic(), 1e-4
    with lock:
        sends = [parent.Isend(arrived, dest=r, tag=_ARRIVE_TAG) for r in others.values()]
        recvs = {k: parent.Irecv(bufs[k], source=r, tag=_ARRIVE_TAG)
                 for k, r in others.items()}
    while True:
        with lock:
            sent = MPI.Request.Testall(sends)
            for k in sorted(recvs):
                if not recvs[k].Test():
                    continue
                if bufs[k].endswith(b"W"):  # an earlier, abandoned creation's: skip it
                    recvs[k] = parent.Irecv(bufs[k], source=others[k], tag=_ARRIVE_TAG)
                elif bytes(bufs[k]) == arrived:
                    del recvs[k]
                else:
                    raise TransportError(
                        f"{label}: group rank {k} (MPI rank {others[k]}) is creating "
                        f"a communicator over other members than {world_ranks} (do all "
                        f"ranks create their groups in the same order?)")
            if sent and not recvs:
                left = [k for k, r in others.items() if _withdrew(parent, r, withdrawn)]
                if not left:
                    return
                raise PeerTimeout(left, time.monotonic() - start,
                                  f"{label}: group rank(s) {left} gave up waiting for "
                                  f"the creation of the group's MPI communicator (members "
                                  f"{world_ranks}) before this rank joined it")
        if deadline is not None and time.monotonic() > deadline:
            break
        time.sleep(pause)
        pause = min(2 * pause, _MAX_PAUSE)
    status = MPI.Status()
    late = []
    with lock:  # withdraw: cancel the receives, tell every member
        for k, req in recvs.items():
            req.Cancel()
            req.Wait(status)
            if status.Is_cancelled() or bufs[k].endswith(b"W"):
                late.append(k)
        orphans = [(q, arrived) for q in sends if not q.Test()]
        for r in others.values():
            q = parent.Isend(withdrawn, dest=r, tag=_ARRIVE_TAG)
            if not q.Test():
                orphans.append((q, withdrawn))
    keep_orphans(orphans)
    late = sorted(late) or sorted(others)
    raise PeerTimeout(late, time.monotonic() - start,
                      f"{label}: group rank(s) {late} (MPI ranks "
                      f"{[world_ranks[k] for k in late]}) did not join the creation of the "
                      f"group's MPI communicator (members {world_ranks}) in time")

def _withdrew(parent: Comm, source: int, withdrawn: bytes) -> bool:
    """True if ``source``'s next note (if one is there) is its withdrawal (under the
    lock; a matched probe, so no other thread can take the note in between)."""
    msg = parent.Improbe(source=source, tag=_ARRIVE_TAG)
    if msg is None:
        return False
    note = bytearray(len(withdrawn))
    msg.Recv(note)
    return bytes(note) == withdrawn
