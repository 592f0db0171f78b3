"""The receives a transport has posted and not matched yet, which one a message takes, and
the messages that came before any receive asked for them: written once, without I/O, for
the shared-memory mailboxes (collectives/p2p.py) and the rdm transport (the MPI transport
matches posted receives here and leaves unexpected messages in MPI's own queue).

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

A message that no posted receive takes is kept (``Unexpected``) until one asks for it: a
receive naming its source takes the oldest kept message of its ``(source, tag)``
(``take``), a receive from any rank the earliest-arrived kept message of its tag from any
source (``take_any``). So a message is matched the same way whichever came first, the
receive or the message. What is kept is the transport's own (a tensor, a bytearray);
nothing here copies it or counts its memory.

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


M = TypeVar("M")


class Unexpected(Generic[M]):
    """Messages no receive had asked for yet, by ``(source, tag)`` in arrival order
    (``kept``; a queue taken empty is dropped, so ``bool(kept)`` says whether any is kept).

    Each message is numbered as it arrives; per tag, ``_arrived`` lists ``(number,
    source)`` in that order, for receives from any rank. A message is only ever taken as
    the oldest of its ``(source, tag)``, so an entry is live exactly when its number is at
    least that queue's oldest. Entries of messages a named receive took are dropped when
    they reach the front, all at once when the tag has no message left, and by a sweep
    once they outnumber the live ones (``_live`` counts those per tag): memory stays in
    proportion to what is kept, whatever the order of taking."""

    __slots__ = ("kept", "_arrived", "_live", "_count")

    def __init__(self) -> None:
        self.kept: dict[tuple[int, int], deque[tuple[int, M]]] = {}
        self._arrived: dict[int, deque[tuple[int, int]]] = {}
        self._live: dict[int, int] = {}
        self._count = 0

    def add(self, src: int, tag: int, message: M) -> None:
        """Keep ``message`` of ``(src, tag)``, behind the others kept."""
        self._count += 1
        q = self.kept.get((src, tag))
        if q is None:
            q = self.kept[(src, tag)] = deque()
        q.append((self._count, message))
        order = self._arrived.get(tag)
        if order is None:
            order = self._arrived[tag] = deque()
            self._live[tag] = 0
        order.append((self._count, src))
        self._live[tag] += 1

    def take(self, src: int, tag: int) -> M | None:
        """Take the oldest kept message of ``(src, tag)``, or None."""
        q = self.kept.get((src, tag))
        if not q:
            return None
        message = q.popleft()[1]
        if not q:
            del self.kept[(src, tag)]
        live = self._live[tag] - 1
        if not live:  # (every entry of the tag is stale)
            del self._live[tag], self._arrived[tag]
        else:
            self._live[tag] = live
            if len(self._arrived[tag]) > 2 * live + 8:
                self._sweep(tag)
        return message

    def peek_any(self, tag: int) -> int | None:
        """The source of the message ``take_any(tag)`` would take, or None."""
        order = self._arrived.get(tag)
        while order:
            number, src = order[0]
            q = self.kept.get((src, tag))
            if q and q[0][0] == number:
                return src
            order.popleft()  # (a named receive took it)
        return None

    def take_any(self, tag: int) -> tuple[int, M] | None:
        """Take the earliest-arrived kept message of ``tag`` from any source: ``(source,
        message)``, or None."""
        src = self.peek_any(tag)
        if src is None:
            return None
        self._arrived[tag].popleft()
        return src, self.take(src, tag)  # type: ignore[return-value]  # (kept: just seen)

    def _sweep(self, tag: int) -> None:
        """Drop the stale entries of ``tag``'s arrival order."""
        kept = self.kept
        self._arrived[tag] = deque(
            (number, src) for number, src in self._arrived[tag]
            if (q := kept.get((src, tag))) and number >= q[0][0])

    def of(self, src: int) -> list[M]:
        """Every message kept from ``src`` (they stay kept)."""
        return [m for (s, _), q in self.kept.items() if s == src for _, m in q]

    def __iter__(self) -> Iterator[M]:
        for q in self.kept.values():
            for _, m in q:
                yield m

    def __bool__(self) -> bool:
        return bool(self.kept)


__all__ = ["Posted", "PostedReceives", "Unexpected"]
