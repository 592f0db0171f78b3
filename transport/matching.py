"""The receives a transport has posted and not matched yet, and which one a message takes:
written once, without I/O, for the shared-memory mailboxes (collectives/p2p.py) and the
rdm and MPI transports.

How it works
------------
A receive names its source (``post``) or takes a message from any rank (``post_any``).
Named receives wait in one queue per ``(source, tag)``, receives from any rank in one
queue per tag, each in the order they were posted. A queue emptied here is dropped; one
emptied by a transport's hot path may stay, empty (so ask ``bool(posted)``, not the dicts,
whether anything waits).

Which receive a message of ``(src, tag)`` takes (``next_for``): the oldest receive naming
``src`` for ``tag``, else the oldest receive of ``tag`` from any rank, even one posted
before it (MPI's rule gives the message to whichever was posted first). Named receives go
first because the network transports commit them to a source's stream when they are
posted: the rdm endpoint binds the buffer to the next position of the ``(src, tag)`` stream
(the message lands there, in order), MPI probes each named queue's head. The mailboxes
follow the same rule, so a program sees one rule wherever its peers are. A receive from
any rank takes the earliest message that no named receive was waiting for.

A receive from any rank may carry a ``claim`` (``claim()``: may it still take a message?):
neuron_dist/p2p_any.py posts one such receive on shared memory and on the network at once,
and the first path to deliver claims it. A receive whose claim fails ends with ``Claimed``
where it stands in the queue (``next_any``), so the message goes to the next.

Withdrawal (``withdraw``: a timed-out or cancelled receive) and failure (``take_peer``:
the named receives of a peer that failed; ``take_any`` once no peer is left to send to
any of them; ``take_all`` when the transport closes) take receives out of the queues; the
transport then ends them. Nothing here ends a request (but a failed claim) or touches its
buffer: the transports know what their buffers are bound to (rdm/pending.py,
mpi/matching.py, collectives/p2p.py). The rdm transport's per-message paths (posting a named receive, and
completing it with the message delivered to it) work on ``named`` directly, a dict lookup
and an ``append`` or ``popleft`` with no call; everything else goes through the methods
here.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Generic, Iterator, Protocol, TypeVar

from .errors import Claimed


class Posted(Protocol):
    """What a posted receive must offer here: its ``tag`` and, for a receive from any
    rank, its ``claim`` (None: it takes whatever comes), and how it ends."""

    tag: int
    claim: Callable[[], bool] | None

    def finish(self, error: Exception | None = None) -> None: ...


R = TypeVar("R", bound=Posted)


class PostedReceives(Generic[R]):
    """Posted, unmatched receives by ``(source, tag)`` (``named``) and by tag (``any``)."""

    __slots__ = ("named", "any")

    def __init__(self) -> None:
        self.named: dict[tuple[int, int], deque[R]] = {}
        self.any: dict[int, deque[R]] = {}

    # ------------------------------------------------------------------ posting

    def post(self, req: R, src: int, tag: int) -> deque[R]:
        """Queue ``req``, naming ``src``, behind the other receives of ``(src, tag)``; its
        queue (whose head a message of the stream goes to first)."""
        q = self.named.get((src, tag))
        if q is None:
            q = self.named[(src, tag)] = deque()
        q.append(req)
        return q

    def post_any(self, req: R, tag: int) -> deque[R]:
        """Queue ``req``, a receive from any rank, behind the others of ``tag``; its queue."""
        q = self.any.get(tag)
        if q is None:
            q = self.any[tag] = deque()
        q.append(req)
        return q

    # ------------------------------------------------------------------ matching

    def next_named(self, src: int, tag: int) -> R | None:
        """Take the oldest receive naming ``src`` for ``tag``, or None."""
        q = self.named.get((src, tag))
        if not q:
            return None
        req = q.popleft()
        if not q:
            del self.named[(src, tag)]
        return req

    def next_any(self, tag: int) -> R | None:
        """Take the oldest receive of ``tag`` from any rank that may still take a message,
        or None; those whose claim fails on the way end with ``Claimed``."""
        q = self.any.get(tag)
        while q:
            req = q.popleft()
            if req.claim is None or req.claim():
                if not q:
                    del self.any[tag]
                return req
            req.finish(Claimed())  # (satisfied by another path meanwhile)
        self.any.pop(tag, None)
        return None

    def next_for(self, src: int, tag: int) -> R | None:
        """The receive a message of ``(src, tag)`` takes, taken out of its queue: the
        oldest naming ``src``, else the oldest from any rank (see the module docstring)."""
        q = self.named.get((src, tag))  # (next_named, written out: once per message)
        if q:
            req = q.popleft()
            if not q:
                del self.named[(src, tag)]
            return req
        return self.next_any(tag) if self.any else None

    # ------------------------------------------------------------------ taking out

    def withdraw(self, req: R, src: int | None) -> bool:
        """Take ``req`` (posted naming ``src``; None: from any rank) out of its queue; False
        if it is in none (matched already)."""
        key: tuple[int, int] | int = req.tag if src is None else (src, req.tag)
        queues: dict = self.any if src is None else self.named  # type: ignore[type-arg]
        q = queues.get(key)
        if q is None or req not in q:
            return False
        q.remove(req)
        if not q:
            del queues[key]
        return True

    def take_peer(self, src: int) -> list[R]:
        """Take out every receive naming ``src``, oldest first per tag."""
        out: list[R] = []
        for key in [k for k in self.named if k[0] == src]:
            out.extend(self.named.pop(key))
        return out

    def take_any(self) -> list[R]:
        """Take out every receive from any rank."""
        out = [req for q in self.any.values() for req in q]
        self.any.clear()
        return out

    def take_all(self) -> list[R]:
        """Take out every receive, named ones first."""
        out = [req for q in self.named.values() for req in q]
        self.named.clear()
        return out + self.take_any()

    # ------------------------------------------------------------------ questions

    def waits_for(self, src: int) -> bool:
        """Does a receive name ``src``?"""
        return any(k[0] == src and q for k, q in self.named.items())

    def __iter__(self) -> Iterator[R]:
        """Every posted receive (from snapshots: safe to call without the transport's lock,
        as a hint)."""
        for queues in (self.named, self.any):
            for q in list(queues.values()):
                yield from list(q)

    def __len__(self) -> int:
        return sum(len(q) for q in self.named.values()) + sum(len(q) for q in self.any.values())

    def __bool__(self) -> bool:
        return any(self.named.values()) or any(self.any.values())


__all__ = ["Posted", "PostedReceives"]
