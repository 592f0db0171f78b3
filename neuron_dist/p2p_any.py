"""A receive from any rank in a group that spans nodes and has other ranks on this node.

How it works
------------
In such a group a rank of this node sends to us through shared memory (p2p_face.py) and
the others over the network, so a receive from any rank is posted on both paths at once:
on the node's send/recv engine (collectives/p2p.py, a receive from any of the node's
ranks) and on the inter-node transport (``irecv_any``), both into the caller's tensor.
Both requests carry the same ``claim``: a one-shot token (``list.pop`` is atomic) that a
path takes just before it binds a message to its request. The path that gets the token
delivers the message; the other binds nothing (its request ends with ``Claimed`` and the
message it would have taken stays for the next receive) and is withdrawn. So exactly one
message is consumed, and only one path ever writes into the tensor.

Completion: the shared-memory request completes through its engine's callback (the
engine's own thread moves it while nobody drives that engine). The network request
completes when someone looks, or by its callback once a future or hook asks for it. A
thread in ``wait`` drives the network transport (``drive_until``) until the Work is
done; a shared-memory completion wakes it (``wake``). A failure of either path (a
deadline, a dead peer, the group torn down) takes the token too, so it fails the receive
only if no message was bound; the deadline is the group's timeout, like every receive's.
Neither path giving up because its ranks are gone (they finished and closed, or died) is
such a failure while the other path may still deliver: the network's failure then only
ends its request, the node's engine does not judge its request by its ranks' liveness, and
a thread in ``wait`` checks that some rank of this node is left once the network's is
over; when none is, the receive fails (after draining once more: a rank may have written
its last message just before it exited).
"""

from __future__ import annotations

import time

from .collectives.p2p import Request
from .errors import PeerTimeoutError
from .transport.errors import Claimed, PeerDied, TransportError

LIVENESS_PERIOD = 0.2  # with only this node's ranks left, a waiter checks them this often


class AnySourceRecv:
    """One receive from any rank as its Work sees it (``NeuronWork.op``): ``drive``,
    ``poll``, ``arm``, and, called, the Work's description.

    Parameters
    ----------
    face : PointToPoint
        The group's send/recv (its shared-memory engine, transport, labels, errors).
    tag : int
    data
        The receiving bytes for the node's engine (a ``Memory`` or a uint8 tensor).
    flat : Flat or None
        Copied back into the caller's non-contiguous tensor on success.
    names : sequence of int
        Group ranks of the node's ranks (the engine's peer numbers).
    deadline : float
        When the receive fails if nothing came (``time.monotonic()``).
    """

    __slots__ = ("face", "tag", "nbytes", "flat", "names", "work", "token", "shm", "net",
                 "deadline", "armed")

    def __init__(self, face, tag: int, data, flat, names, deadline: float):
        self.face, self.tag, self.flat, self.names = face, tag, flat, names
        self.nbytes = data.numel()
        self.deadline = deadline
        self.token = [True]
        self.armed = False
        self.work = None
        self.net = None
        self.shm = Request(None, tag, data, False, deadline)
        self.shm.claim = self.claim
        self.shm.names = names
        self.shm.callback = self._shm_done

    def start(self, work, buf, net_tag: int) -> None:
        """Post on both paths, the shared-memory one first (it may complete at once);
        ``buf`` is the receiving memory as the transport takes it, ``net_tag`` its tag."""
        self.work = work
        self.face.shm_engine().post(self.shm)
        if self.token:
            try:
                net = self.net = self.face.shared_net.irecv_any(net_tag, buf, claim=self.claim)
            except PeerDied:
                return  # every rank on other nodes is gone: this node's may still send
            if net.done():
                self._net_done(net)
            elif self.work is None:  # the node's engine completed it meanwhile
                self._withdraw_net()

    def claim(self) -> bool:
        """Take the token; True for the one caller that gets it."""
        try:
            self.token.pop()
        except IndexError:
            return False
        return True

    def __call__(self) -> str:
        return (f"recv from any rank (tag {self.tag}, {self.nbytes} bytes) in group "
                f"{self.face.label()}")

    # ------------------------------------------------------------- completion
    def _finish(self, error, source: int) -> None:
        work, self.work = self.work, None
        if work is None:
            return
        if error is None and self.flat is not None:
            self.flat.finish()
        work.complete(error, source)

    def _shm_done(self, req) -> None:
        """The node's engine finished its request (under the engine's lock)."""
        if isinstance(req.error, Claimed):
            return  # the network took the message
        if req.error is None:
            self._finish(None, self.names[req.source])
        elif self.claim():  # a real failure, and no message was bound anywhere
            self._finish(req.error, -1)
        else:
            return  # the network bound a message: it completes the receive
        self._withdraw_net()
        if self.net is not None:
            self.face.shared_net.wake()  # a thread in drive() looks again
        self._release_shm()

    def _net_done(self, req) -> None:
        """The transport finished its request (seen by whoever looks, or its callback)."""
        if isinstance(req.error, Claimed) or self.work is None:
            return
        if req.error is None:
            self._finish(None, req.source if req.source is not None else -1)
        elif isinstance(req.error, PeerDied):
            # Every rank on other nodes is gone (done, or dead): nothing more can come from
            # there, but this node's ranks may still send. (If they are gone too, the
            # node's engine fails its request: then the receive fails.)
            self.net = None
            self.face.shared_net.wake()
            return
        elif self.claim():
            self._finish(self.face.on_error(req.error, self())[0], -1)
        else:
            return  # the node's engine bound a message: it completes the receive
        self.face.withdraw_shm(self.shm)
        self._release_shm()
        if req.done():
            req.claim = None  # (no cycle is left)

    def _withdraw_net(self) -> None:
        """Withdraw the network request unless it completed (it then refers to us no more)."""
        net = self.net
        if net is None:
            return
        if not net.done():
            try:
                self.face.shared_net.cancel(net, Claimed())
            except Exception:  # noqa: BLE001 - closed: it is finished with the rest
                return
        net.claim = None  # (done: nothing calls it any more; no cycle is left)

    def _release_shm(self) -> None:
        shm = self.shm
        if shm.done:  # (withdrawn or complete: its callback and claim are not called again)
            shm.callback = shm.claim = None

    def _check_local(self) -> None:
        """Fail the receive if no rank of this node is left to send it (nor, by now, on
        any other node), or one aborted the group."""
        face = self.face
        try:
            face.check_node_senders()
        except TransportError as e:
            face.shm_engine().poll()  # (a last message written just before its sender exited)
            if self.work is not None and self.claim():
                face.withdraw_shm(self.shm)
                self._release_shm()
                self._finish(face.on_error(e, self())[0], -1)

    # ---------------------------------------------------------------- Work.op
    def poll(self) -> None:
        net = self.net
        if net is not None and net.done():
            self._net_done(net)

    def arm(self) -> None:
        net = self.net
        if net is not None and not self.armed:
            self.armed = True
            net.on_complete(self._net_done)

    def drive(self, deadline: float) -> None:
        end = min(deadline, self.deadline)
        face = self.face
        while self.work is not None:
            net = self.net
            if net is not None and net.done():
                self._net_done(net)
                continue
            if net is None:  # only the node's engine can still deliver
                try:
                    face.shm_engine().drive(self.shm,
                                            min(end, time.monotonic() + LIVENESS_PERIOD))
                except PeerTimeoutError:
                    pass
                if self.work is not None and self.token:
                    self._check_local()
            else:
                face.shared_net.drive_until(lambda: self.work is None or net.done(), end)
            if self.work is None or time.monotonic() < end:
                continue
            if deadline < self.deadline:
                work = self.work
                if work is not None:
                    raise PeerTimeoutError(f"{work.what}: Timed out in Work.wait")
                return
            if self.claim():  # nothing was bound: withdraw both, then fail
                face.withdraw_shm(self.shm)
                self._release_shm()
                self._withdraw_net()
                self._finish(PeerTimeoutError(
                    f"{self()}: Timed out after {face.timeout_text()}: no rank sent it"), -1)
                return
            end = time.monotonic() + 0.05  # a path is completing it right now
