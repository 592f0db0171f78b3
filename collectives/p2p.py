"""Point-to-point messaging with tags over per-pair byte mailboxes (MPI-style matching).

Wire format in a mailbox (every frame a multiple of 32 bytes so headers never wrap):

    [MAGIC, tag, nbytes, 0]  (4 int64 words)   payload (nbytes)   padding to 32

Sending streams a message into the destination's inbound mailbox as space frees up, in
pieces of at most a quarter of the mailbox so that the receiver copies out one piece while
the sender writes the next. Receiving matches each arriving header against posted receives
in the order they were posted (a receive names a source, or None for any source, and a
tag). The posted receives are the network transports' own (transport/matching.py): an
arriving message takes the oldest receive naming its source and tag, else the oldest
receive of its tag from any rank. A message nobody has asked for yet is drained into a
private buffer, kept in the unexpected-message queue (transport/matching.py's
``Unexpected``, the rdm transport's too) so that a sender is never stuck behind a receiver
that posts late; a later receive takes the oldest matching unexpected message. Messages
from one source are matched in the order sent (MPI's non-overtaking rule). A receive may
carry a ``claim``: a receive from any rank of a group that spans nodes is posted here and
on the network at once, and ``claim()``, called just before a message is bound to it,
says whether it may still take one (False: the network got one first; it then takes
nothing here and ends with ``Claimed``). This module moves no threads: ``P2P.progress`` does
whatever is possible now and returns, and a driver calls it (neuron_dist/p2p_engine.py).
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..transport.errors import Claimed
from ..transport.matching import PostedReceives, Unexpected
from . import one_thread

if TYPE_CHECKING:
    from ..transport.base import Mailbox

MAGIC = 0x5032504E  # "NP2P"
HEADER_BYTES = 32
FRAME_ALIGN = 32


class P2PError(RuntimeError):
    """A send or receive that cannot complete as asked (size mismatch, corrupt frame)."""


class Memory:
    """A contiguous tensor's bytes as a request's ``data``: its address and size, which is
    all the rings need (``data_ptr``, ``numel``; ``copy_`` from an unexpected message's
    buffer), without making a torch view of it (three of them, detach, reshape and a
    uint8 view, cost about 3 µs per receive here). It holds the tensor, so the memory a
    pending request reads or writes lives as long as the request."""

    __slots__ = ("tensor", "address", "nbytes")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.address, self.nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return self.nbytes

    def copy_(self, src: torch.Tensor) -> None:
        """Copy the ``nbytes`` bytes of the contiguous ``src`` here."""
        if self.nbytes:
            ctypes.memmove(self.address, src.data_ptr(), self.nbytes)


class Request:
    """One posted send or receive; ``done``/``error`` are set by ``P2P.progress``.
    ``data``: a flat uint8 tensor or a ``Memory``."""

    __slots__ = ("peer", "tag", "data", "moved", "done", "error", "source", "deadline",
                 "is_send", "header_sent", "callback", "claim", "names")

    def __init__(self, peer: int | None, tag: int, data: torch.Tensor | Memory, is_send: bool,
                 deadline: float):
        self.peer = peer  # group rank, or None for a receive from any source
        self.tag = tag
        self.data = data  # flat uint8 tensor
        self.is_send = is_send
        self.deadline = deadline
        self.moved = 0
        self.done = False
        self.error: BaseException | None = None
        self.source = -1
        self.header_sent = False
        self.callback: Callable[[Request], object] | None = None
        self.claim: Callable[[], bool] | None = None  # see the module docstring
        # group ranks of peer numbers, for messages (None: the same)
        self.names: Sequence[int] | None = None

    def describe(self) -> str:
        peer = self.peer if self.names is None or self.peer is None else self.names[self.peer]
        if self.is_send:
            return f"send to rank {peer} (tag {self.tag}, {self.data.numel()} bytes)"
        who = "any rank" if peer is None else f"rank {peer}"
        return f"recv from {who} (tag {self.tag}, {self.data.numel()} bytes)"

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done = True
        if self.callback is not None:
            self.callback(self)


class _Incoming:
    __slots__ = ("tag", "nbytes", "got", "dst", "req")

    def __init__(self, tag: int, nbytes: int, dst: torch.Tensor | Memory | None,
                 req: Request | None):
        self.tag = tag
        self.nbytes = nbytes
        self.got = 0
        self.dst = dst  # where bytes go; None drops them
        self.req = req  # the matched receive, or None for an unexpected message


class P2P:
    """Matching engine of one rank in one group.

    Parameters
    ----------
    rank, size : int
    outbox : callable
        ``outbox(dst)`` -> Mailbox from this rank to ``dst``.
    inbox : callable
        ``inbox(src)`` -> Mailbox from ``src`` to this rank.
    notify : callable, optional
        ``notify(peer)`` after this rank moved bytes into or out of a mailbox shared with
        ``peer`` (lets a sleeping peer wake up).
    """

    def __init__(self, rank: int, size: int, outbox: Callable[[int], Mailbox],
                 inbox: Callable[[int], Mailbox], notify: Callable[[int], object] | None = None):
        self.rank = rank
        self.size = size
        self._outbox = outbox
        # dst -> Mailbox, made on the first send to dst (it reserves memory)
        self._out: dict[int, Mailbox] = {}
        self._in = {k: inbox(k) for k in range(size) if k != rank}
        self._sends: dict[int, deque[Request]] = {}
        self._posted: PostedReceives[Request] = PostedReceives()  # (unmatched receives)
        self._incoming: dict[int, _Incoming | None] = {k: None for k in self._in}
        self._unexpected: Unexpected[torch.Tensor] = Unexpected()  # (their own buffers)
        self._piece: dict[int, int] = {}
        self._notify = notify or (lambda peer: None)

    # ------------------------------------------------------------------ posting
    def send_now(self, dst: int, tag: int, address: int, nbytes: int) -> bool:
        """Write a whole small message from memory at ``address`` into ``dst``'s ring right
        now, if nothing to ``dst`` is queued and it fits; True if done (then it is sent)."""
        box = self._open(dst)
        padded = nbytes + (-nbytes) % FRAME_ALIGN
        if self._sends[dst] or box.free() < HEADER_BYTES + padded:
            return False
        box.write_frame((MAGIC, tag, nbytes, 0), address, nbytes, padded)
        self._notify(dst)
        return True

    def recv_now(self, src: int, tag: int, address: int, nbytes: int) -> bool:
        """Take a message of ``tag`` and ``nbytes`` bytes from ``src`` that is whole at the
        head of its ring straight into memory at ``address``, if nothing else could take it
        first (no receive posted, no message being read or queued as unexpected). True if
        done; otherwise nothing has changed and the caller posts a request, which also
        reports a size mismatch or a corrupt frame."""
        # (the queues here are only ever changed through the core, which drops the ones it
        # empties: the dicts' truth is whether a receive waits, without a call)
        if (self._posted.named or self._posted.any or self._unexpected.kept
                or self._incoming[src] is not None):
            return False
        box = self._in[src]
        frame = HEADER_BYTES + nbytes + (-nbytes) % FRAME_ALIGN
        if box.available() < frame:
            return False
        magic, got_tag, got_bytes = box.peek_words(3)
        if magic != MAGIC or got_tag != tag or got_bytes != nbytes:
            return False
        box.take(HEADER_BYTES, address, nbytes, frame)
        self._notify(src)
        return True

    def post_send(self, req: Request) -> None:
        # (the ignores below: a send names its peer)
        self._open(req.peer)  # type: ignore[arg-type]
        self._sends[req.peer].append(req)  # type: ignore[index]

    def _open(self, dst: int) -> Mailbox:
        """The ring to ``dst``, made on the first send there (that reserves its memory)."""
        box = self._out.get(dst)
        if box is None:
            box = self._out[dst] = self._outbox(dst)
            self._piece[dst] = max(FRAME_ALIGN, box.capacity // 4)
            self._sends[dst] = deque()
        return box

    def post_recv(self, req: Request) -> None:
        if req.peer is None:
            src = self._unexpected.peek_any(req.tag)
            if src is None:
                self._posted.post_any(req, req.tag)
            elif req.claim is None or _may_take(req):
                self._deliver(req, *self._unexpected.take_any(req.tag))  # type: ignore[misc]
            return
        buf = self._unexpected.take(req.peer, req.tag)
        if buf is None:
            self._posted.post(req, req.peer, req.tag)
        else:
            self._deliver(req, req.peer, buf)

    def pending(self) -> bool:
        """Is there anything to move that nobody may ask for soon: a request, a message
        read in part, or an inbound ring at least half full (its sender may soon be stuck
        until it is drained into the unexpected-message queue)? Whole messages in a ring
        below that wait for their receive, which reads them straight into its tensor
        (``recv_now``); a sender is only stuck once its ring is all but full."""
        return bool(self._posted) or any(self._sends.values()) or any(
            inc is not None for inc in self._incoming.values()) or any(
            box.available() * 2 >= box.capacity for box in self._in.values())

    def pending_requests(self) -> list[Request]:
        reqs = [r for q in self._sends.values() for r in q] + list(self._posted)
        reqs += [inc.req for inc in self._incoming.values() if inc is not None and inc.req]
        return reqs

    def fail(self, req: Request, error: BaseException) -> None:
        """Withdraw a pending request (e.g. on timeout) and complete it with ``error``."""
        if req.is_send:
            q = self._sends.get(req.peer)  # type: ignore[arg-type]  # (a send's peer)
            if q and req in q:
                if req.header_sent and q[0] is req:
                    # Part of it is on the wire: the receiver's stream is now unusable, so
                    # this only happens when the group is being torn down anyway.
                    pass
                q.remove(req)
        elif not self._posted.withdraw(req, req.peer):
            for inc in self._incoming.values():
                if inc is not None and inc.req is req:
                    inc.req = None
                    inc.dst = None
        req.finish(error)

    # ----------------------------------------------------------------- progress
    def progress(self) -> bool:
        """Move whatever can move now; returns True if anything did."""
        moved = False
        for dst, q in self._sends.items():
            wrote = False
            while q:
                req = q[0]
                before = (req.moved, req.header_sent)
                finished = self._push(req)
                wrote |= finished or (req.moved, req.header_sent) != before
                if not finished:
                    break
                q.popleft()
            if wrote:
                self._notify(dst)
                moved = True
        for src in self._in:
            if self._pull(src):
                self._notify(src)
                moved = True
        return moved

    def _push(self, req: Request) -> bool:
        """Advance one send; True when it has fully left."""
        box = self._out[req.peer]  # type: ignore[index]  # (a send names its peer)
        n = req.data.numel()
        if not req.header_sent:
            if box.free() < HEADER_BYTES:
                return False
            box.write_words((MAGIC, req.tag, n, 0))
            req.header_sent = True
        while req.moved < n:
            m = min(box.free(), n - req.moved, self._piece[req.peer])  # type: ignore[index]
            if m <= 0:
                return False
            box.write(req.data.data_ptr() + req.moved, m)
            req.moved += m
        pad = (-n) % FRAME_ALIGN
        if pad:
            if box.free() < pad:
                return False
            box.pad(pad)
        req.finish()
        return True

    def _pull(self, src: int) -> bool:
        box = self._in[src]
        inc = self._incoming[src]
        moved = False
        if inc is None:
            available = box.available()
            if available < HEADER_BYTES:
                return False
            magic, tag, nbytes, _ = box.peek_words(4)
            if magic != MAGIC or nbytes < 0:
                raise P2PError(f"corrupt frame from rank {src} (magic {magic:#x}, size {nbytes})")
            req = self._posted.next_for(src, tag)
            frame = HEADER_BYTES + nbytes + (-nbytes) % FRAME_ALIGN
            if req is not None and available >= frame and req.data.numel() == nbytes:
                box.take(HEADER_BYTES, req.data.data_ptr(), nbytes, frame)  # whole: in one go
                self._deliver(req, src, None)
                return True
            box.skip(HEADER_BYTES)
            inc = self._incoming[src] = self._incoming_for(req, src, tag, nbytes)
            moved = True
        want = inc.nbytes - inc.got
        if want:
            m = min(box.available(), want)
            if m <= 0:
                return moved
            if inc.dst is None:
                box.skip(m)
            else:
                box.read_into(inc.dst.data_ptr() + inc.got, m)
            inc.got += m
            moved = True
            if inc.got < inc.nbytes:
                return moved
        pad = (-inc.nbytes) % FRAME_ALIGN
        if pad:
            if box.available() < pad:
                return moved
            box.skip(pad)
        self._incoming[src] = None
        if inc.req is not None:
            self._deliver(inc.req, src, None)
        elif inc.dst is not None:  # (an unexpected message, in a buffer of its own)
            req = self._posted.next_for(src, inc.tag)  # (posted while it was read)
            if req is None:
                self._unexpected.add(src, inc.tag, inc.dst)  # type: ignore[arg-type]
            else:
                self._deliver(req, src, inc.dst)  # type: ignore[arg-type]
        return True

    def _incoming_for(self, req: Request | None, src: int, tag: int, nbytes: int) -> _Incoming:
        """Where a message of ``nbytes`` from ``src`` goes: into the receive ``req`` it
        matched, else (None) into a buffer of its own, queued as unexpected."""
        if req is None:
            return _Incoming(tag, nbytes, torch.empty(nbytes, dtype=torch.uint8), None)
        if req.data.numel() != nbytes:
            req.finish(P2PError(
                f"{req.describe()}: rank {_name(req, src)} sent {nbytes} bytes with tag "
                f"{tag}; sizes of matching send and recv must be equal"))
            return _Incoming(tag, nbytes, None, None)
        req.source = src
        return _Incoming(tag, nbytes, req.data, req)

    def _deliver(self, req: Request, src: int, buf: torch.Tensor | None) -> None:
        if buf is not None:
            if buf.numel() != req.data.numel():
                req.finish(P2PError(
                    f"{req.describe()}: rank {_name(req, src)} sent {buf.numel()} bytes with "
                    f"tag {req.tag}; sizes of matching send and recv must be equal"))
                return
            threads = one_thread.enter()  # (a message that came before its receive)
            try:
                req.data.copy_(buf)
            finally:
                one_thread.leave(threads)
        req.source = src
        req.finish()


def _name(req: Request, k: int) -> int:
    """Group rank of peer number ``k`` (see ``Request.names``)."""
    return k if req.names is None else req.names[k]


def _may_take(req: Request) -> bool:
    """May ``req``, which has a claim, take a message now? (Not if its claim fails: it is
    finished then.)"""
    if req.claim():  # type: ignore[misc]  # (it has one)
        return True
    req.finish(Claimed())
    return False
