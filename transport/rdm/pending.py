"""The requests a group's rdm transport holds until they end: how each one completes, fails
or is withdrawn.

How it works
------------
A send larger than an eager message (or sent while the eager window is full) waits for
its acknowledgement: it is kept by ``(peer, msg_id)`` in ``sends`` until the endpoint
reports ``SendCompleted``. An eager send completed at once; its copy is kept in ``copies``
until acknowledged and then handed back to the ``CopyPool``. A receive naming its peer is
bound by the endpoint to a position in the stream of ``(peer, tag)`` when posted
(``positions``) and queued in ``recvs``: the oldest receive of a stream is the one the
endpoint's next delivery completes. A receive from any rank waits in ``any`` by tag and
takes the earliest message no named receive was waiting for.

Every request ends exactly once (``Request.finish``). When it fails or is withdrawn
while its buffer is still in use, ``unhook`` makes sure nothing here touches that buffer
afterwards: a payload being read into it goes on into scratch memory, and frames queued
on a rail that refer to it are replaced by copies. So a late message never writes into a
buffer that is the caller's again.

Everything here runs under the process's network lock (progress.NET_LOCK).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import MessageSizeMismatch
from ..matching import PostedReceives
from .links import _PAYLOAD

if TYPE_CHECKING:
    from .driver import Request
    from .links import Rail
    from .protocol import Endpoint, MessageReceived, MessageRefused, SendRefused


class CopyPool:
    """Buffers for the copies of eager sends, reused once their message is acknowledged.

    A fresh copy costs several times a reused one when the allocator has handed freed
    memory back to the kernel in between (page faults). A copy comes back when its
    message is acknowledged, and is reused only if no frame refers to it any more (a
    resend still queued on a rail holds a view of it: a bytearray with live views cannot
    change size, which is how that is checked). Holds at most ``limit`` bytes: the
    transport makes it its eager window (driver.py, ``EAGER_WINDOW_BYTES``), as many bytes
    of copies as can be unacknowledged at once, so a stream of eager sends finds its
    copies here instead of dropping half of them when acknowledgements come back in a
    batch and allocating them again. What it saves is allocations; the time per message
    of such a stream varies more from run to run than they cost (docs/design.md,
    "Thresholds and why"). It keeps only copies that were in flight together: at most
    what the busiest moment of the stream held.
    """

    def __init__(self, limit: int):
        self._free: dict[int, list[bytearray]] = {}  # size class -> [bytearray]
        self._bytes, self._limit = 0, limit

    def take(self, n: int) -> bytearray:
        size = 1 << max(10, (n - 1).bit_length())
        free = self._free.get(size)
        if free:
            self._bytes -= size
            return free.pop()
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        size = len(buf)
        if self._bytes + size > self._limit:
            return
        try:
            buf.append(0)
        except BufferError:
            return  # still referred to: let it go
        buf.pop()
        self._free.setdefault(size, []).append(buf)
        self._bytes += size


class Pending:
    """The requests of one group's rank that have not ended yet, by kind (see the module
    docstring), and the ways they end.

    ``ep`` is the group's endpoint, ``rails`` its rails by peer, ``expected`` its peers and
    ``failed`` the peers it has failed (the transport's own collections, read here);
    ``on_abort(peer, data)`` gets a peer's abort notice.
    """

    def __init__(self, ep: Endpoint, rails: dict[int, Sequence[Rail | None]],
                 expected: set[int], failed: dict[int, Exception], eager_window: int,
                 on_abort: Callable[[int, bytes], None], abort_tag: int):
        self._ep, self._rails, self._expected, self._failed = ep, rails, expected, failed
        self._on_abort, self._abort_tag = on_abort, abort_tag
        self.sends: dict[tuple[int, int], Request] = {}  # (peer, msg_id) -> its send
        # (peer, msg_id) -> the copy of an eager send, until acked
        self.copies: dict[tuple[int, int], bytearray] = {}
        self.pool = CopyPool(eager_window)
        # the posted receives (transport/matching.py); ``recvs`` and ``any`` are its
        # queues, which the per-message paths read directly
        self.posted: PostedReceives[Request] = PostedReceives()
        self.recvs, self.any = self.posted.named, self.posted.any
        self.positions: dict[Request, int] = {}  # receive -> its stream position (cancel_recv)

    # ------------------------------------------------------------------ completing

    def send_completed(self, peer: int, msg_id: int) -> None:
        """The peer acknowledged message ``msg_id``: its send completes, or its eager copy
        goes back to the pool."""
        req = self.sends.pop((peer, msg_id), None)
        if req is not None:
            req.finish()
        else:
            copy = self.copies.pop((peer, msg_id), None)
            if copy is not None:
                self.pool.give(copy)

    @staticmethod
    def complete_recv(req: Request, data: memoryview | bytearray) -> None:
        """``data`` is the message for receive ``req``: copy it in (unless it landed there)
        and complete it, or fail it when the sizes differ."""
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        if n != req.nbytes:
            # (source: known once a message is bound to it)
            error = MessageSizeMismatch(req.source, req.tag,  # type: ignore[arg-type]
                                        n, req.nbytes, data)
            req.finish(error)
            return
        if not (isinstance(data, memoryview) and data.obj is req.buf.obj):
            req.buf[:n] = data
        req.finish()

    def on_message(self, ev: MessageReceived) -> None:
        """The endpoint delivered a message: to the oldest receive of its stream (bound to
        it when posted), else, kept early, to the oldest receive of its tag from any rank."""
        if ev.tag == self._abort_tag:
            if not ev.posted:
                self._ep.take_early(ev.src, ev.tag)
            self._on_abort(ev.src, bytes(ev.data))
            return
        waiting = self.recvs.get((ev.src, ev.tag))  # (per message: no call, see matching.py)
        if waiting:  # (its buffer was bound to this position: posted, or too small)
            req = waiting.popleft()
            self.positions.pop(req, None)
            if ev.posted:
                self.complete_recv(req, ev.data)
            else:
                req.finish(MessageSizeMismatch(ev.src, ev.tag, len(ev.data), req.nbytes,
                                                ev.data))
            return
        if ev.posted:
            return  # it landed in a receive that was withdrawn since: nobody gets it
        anyone = self.posted.next_any(ev.tag)
        if anyone is not None:  # an early message (kept by the endpoint): the oldest such
            anyone.source = ev.src  # receive takes it
            early = self._ep.take_early(ev.src, ev.tag)  # (kept: this event reports it)
            self.complete_recv(anyone, early)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ failing

    def on_refused(self, ev: MessageRefused) -> None:
        """The message due for the oldest receive of ``(src, tag)`` was too large for it and
        for the memory kept for unexpected messages: it was refused (protocol.py,
        "Refusal"), its sender is told, and the receive fails."""
        req = self.posted.next_named(ev.src, ev.tag)
        if req is None:
            return  # (its receive was withdrawn: the endpoint discards it then)
        self.positions.pop(req, None)
        req.finish(MessageSizeMismatch(
            ev.src, ev.tag, ev.size, ev.expected, b"",
            f"rank {ev.src} sent {ev.size} bytes, the receive expects {ev.expected} (tag "
            f"{ev.tag}); the message was refused, not kept: it exceeds the "
            f"{self._ep.max_reassembly_bytes} bytes this rank holds for unexpected messages "
            f"from a peer"))

    def on_send_refused(self, ev: SendRefused) -> MessageSizeMismatch | None:
        """``ev.peer`` refused a message (too large for its receive and its memory): the
        send fails at once instead of being resent until the peer is declared unreachable.
        The error, if the send had completed already (an eager one), for the log."""
        error = MessageSizeMismatch(
            ev.peer, ev.tag, ev.size, ev.expected, b"",
            f"rank {ev.peer} refused a message of {ev.size} bytes on tag {ev.tag}: its "
            f"receive expects {ev.expected} bytes, and the message exceeds the memory it "
            f"holds for unexpected messages")
        req = self.sends.pop((ev.peer, ev.msg_id), None)
        if req is not None:
            self.unhook(req.buf.obj, ev.peer)  # (frames still queued must not read it)
            req.finish(error)
            return None
        self.copies.pop((ev.peer, ev.msg_id), None)  # (a frame may still hold a view)
        return error

    def fail_recv(self, req: Request, error: Exception) -> None:
        """Fail a receive. Its buffer is the caller's again at once: the endpoint withdraws
        it (the message bound to it is discarded whenever it arrives), and a payload being
        read into it goes on into scratch memory."""
        position = self.positions.pop(req, None)
        if position is not None:  # (a position: a receive naming its peer)
            self._ep.cancel_recv(req.peer, req.tag, position)  # type: ignore[arg-type]
        self.unhook(req.buf.obj, req.peer)
        req.finish(error)

    def fail_peer(self, peer: int, error: Exception) -> None:
        """Every request with ``peer`` fails with ``error``, and the receives from any rank
        too once every peer has failed (nobody is left to send to them)."""
        if all(p in self._failed for p in self._expected):
            for req in self.posted.take_any():
                req.finish(error)
        for key in [k for k in self.sends if k[0] == peer]:
            req = self.sends.pop(key)
            self._ep.cancel_send(*key)  # no segment of it goes out again, and none that is
            self.unhook(req.buf.obj, peer)  # queued on a rail (another group's, too) reads
            req.finish(error)  # its buffer after it failed
        for key in [k for k in self.copies if k[0] == peer]:
            del self.copies[key]
        for req in self.posted.take_peer(peer):
            self.fail_recv(req, error)

    def fail_all(self, error: Exception) -> None:
        """The transport closes: every request fails with ``error``."""
        for req in self.sends.values():
            self.unhook(req.buf.obj, req.peer)  # (rails other groups keep write on)
            req.finish(error)
        self.sends.clear()
        self.copies.clear()
        for req in self.posted.take_all():
            if req.peer is None:  # (a receive from any rank is bound to nothing)
                req.finish(error)
            else:
                self.fail_recv(req, error)

    def withdraw(self, req: Request, error: Exception) -> None:
        """Withdraw ``req`` (not complete yet) and fail it with ``error``
        (``RdmTransport.cancel``)."""
        peer = req.peer
        if peer is None:  # a receive from any rank (a send names its peer)
            self.posted.withdraw(req, None)
            req.finish(error)
        elif req.is_send:
            key = next((k for k, r in self.sends.items() if r is req), None)
            if key is not None:
                del self.sends[key]
                self._ep.cancel_send(*key)
            self.unhook(req.buf.obj, peer)
            req.finish(error)
        else:
            self.posted.withdraw(req, peer)
            self.fail_recv(req, error)

    def unhook(self, obj: object, peer: int | None) -> None:
        """Nothing this transport holds refers to buffer ``obj`` any more.

        A payload being read into it goes on into scratch memory (the claim stays, so the
        endpoint counts the bytes of its cancelled message), which starts with a copy of
        what was read so far: with payload authentication the frame's tag covers the
        whole payload as it came, and is checked over that memory. Queued frames that
        refer to it are replaced by copies (the part already written stays written)."""
        rails = self._rails.values() if peer is None else [self._rails.get(peer, ())]
        for rail in (r for rs in rails for r in rs if r is not None):
            if rail.stage == _PAYLOAD and rail.view.obj is obj:
                scratch = memoryview(bytearray(rail.view.nbytes))
                scratch[:rail.got] = rail.view[:rail.got]
                rail.view = scratch
            if any(v.obj is obj for v in rail.out):
                rail.out = deque(memoryview(bytes(v)) if v.obj is obj else v
                                 for v in rail.out)

    # ------------------------------------------------------------------ questions

    def busy_with(self, peer: int) -> bool:
        """Is a send to or a receive from ``peer`` pending?"""
        return any(k[0] == peer for k in self.sends) or self.posted.waits_for(peer)

    def needs_progress(self, eager_bytes: int) -> bool:
        """Does a pending request need the engine to move while nobody waits on it: a
        receive larger than ``eager_bytes`` (its sender's request completes only when this
        end reads it), or a request with a completion callback? Read without the lock,
        from snapshots: a hint (``Wire.bulk_pending``)."""
        for req in self.posted:
            if req.nbytes > eager_bytes or req.callback is not None:
                return True
        return any(req.callback is not None for req in list(self.sends.values()))
