"""Send and receive of the c10d face: which of three paths a message takes, and its Work.

How it works
------------
* **One node, small send**: a contiguous tensor of up to ``EXPRESS_SEND_BYTES`` that fits
  its ring now is written whole from the tensor, in the caller's thread; the Work is
  finished when it is returned (send and isend alike: the bytes have left).
* **One node, a message that is there already**: a receive naming its source, into a
  contiguous tensor, whose message is whole at the head of the source's ring and that no
  earlier receive or queued message comes before, reads it straight into the tensor in
  the caller's thread; its Work is finished when it is returned.
* **One node, otherwise**: a ``collectives.p2p`` request is posted on the group's
  shared-memory send/recv engine (``p2p_engine.py``, its own progress); its callback
  completes the Work (a non-contiguous receive is copied back first).
* **A group that spans nodes**: a rank of this node is sent to and received from through
  shared memory as above (the node's channel numbers the node's ranks 0..n-1), any other
  rank straight over the inter-node transport, tags offset by ``P2P_TAG_BASE``
  (collectives use ``collectives.net.COLLECTIVE_TAG``); a receive from any rank listens on
  both (p2p_any.py). (Over a transport that cannot share a receive from any rank with
  shared memory, not a ``transport.base.SharedAnySource``: MPI, whose own shared memory
  serves ranks of one node, everything goes over the transport.) Over the network, a small
  send completes as it is posted; everything else completes for whoever looks at its Work
  (``wait``, ``is_completed``, ...), so no thread hand-off is on a message's path, and a
  future or a hook arms a completion callback. A receive that times out is withdrawn from the
  transport before its Work fails: the tensor is the caller's again.

Send/recv never queue behind the group's collectives. Argument checks happen in
``ProcessGroupNeuron.send``/``recv`` before anything here runs.
"""

from __future__ import annotations

import time

from torch.autograd import profiler as _profiler

from . import stats
from .collectives.net import as_bytes
from .collectives.p2p import P2P, Memory, Request
from .errors import GroupAbortedError, PeerTimeoutError
from .flat import Flat
from .p2p_any import AnySourceRecv
from .p2p_engine import P2PEngine
from .transport.base import SharedAnySource
from .transport.errors import ChannelClosed, Claimed, PeerAborted, PeerDied, PeerTimeout
from .work import NeuronWork

EXPRESS_SEND_BYTES = 1 << 20  # sends up to this size are written into the ring at once if they fit
P2P_TAG_BASE = 1 << 32  # network tags of send/recv (collectives use net.COLLECTIVE_TAG)


class PointToPoint:
    """The send/recv of one group (see the module docstring).

    Parameters
    ----------
    rank, size : int
        This rank and the group size.
    channel : ShmChannel
        The node's shared-memory channel (mailboxes and rings).
    net : transport.base.NetTransport or None
        The group's between-nodes transport when the group spans nodes.
    label : callable
        ``label()``: the group's name for messages.
    on_error : callable
        ``on_error(exc, what)`` -> ``(error to raise, fatal)``: the group's translation of
        transport errors (it also aborts the group when fatal).
    timeout, timeout_text : callable
        The group's current default timeout, in seconds and as text.
    local : sequence of int, optional
        In a group that spans nodes: the group ranks on this node, in the order of the
        node's channel.

    Its public attributes, for the Work ops here and for a receive from any rank on both
    paths (p2p_any.py): ``net``, ``label``, ``on_error``, ``timeout_text`` (the
    parameters), ``shared_net`` (``net`` when such receives listen on both paths, else
    None); and ``shm_engine()``, ``withdraw_shm`` and ``check_node_senders``.
    """

    def __init__(self, rank: int, size: int, channel, net, label, on_error, timeout,
                 timeout_text, local=None):
        self._rank, self._size = rank, size
        self._channel, self.net = channel, net
        # group rank -> the node channel's number for it: the peers reached through
        # shared memory (every peer in a one-node group; see the module docstring)
        if net is None:
            self._local, self._names = {k: k for k in range(size)}, None
        elif local is not None and len(local) > 1 and isinstance(net, SharedAnySource):
            self._local, self._names = {g: i for i, g in enumerate(local)}, tuple(local)
        else:
            self._local, self._names = {}, None
        # The transport, where a receive from any rank listens on both paths (p2p_any.py).
        self.shared_net: SharedAnySource | None = net if self._names is not None else None
        self.label, self.on_error = label, on_error
        self._timeout, self.timeout_text = timeout, timeout_text
        self._shm = None  # P2PEngine, made on first use
        self._stopped = False
        self._spare = None  # the last Work of a send/recv that completed as posted (_done)

    def send(self, t, dst: int, tag: int):
        """Send tensor ``t`` to group rank ``dst``; its Work."""
        nbytes = t.numel() * t.element_size()
        # A small message that fits the ring is written whole, now, from the tensor itself:
        # no request, no progress engine (send and isend alike: the bytes have left).
        shm_dst = self._local.get(dst)
        if (nbytes <= EXPRESS_SEND_BYTES and shm_dst is not None and not self._stopped
                and t.is_contiguous() and not _profiler._is_profiler_enabled
                and self.shm_engine().send_now(shm_dst, int(tag), t.data_ptr(), nbytes)):
            stats.add_call(nbytes)
            return self._done(t, lambda: f"send to rank {dst} (tag {tag}, {nbytes} bytes) "
                                         f"in group {self.label()}")
        return self._post(t, dst, tag, True, "send")

    def _done(self, t, what, source: int = -1):
        """The finished Work of a send or receive of ``t`` that completed as it was posted
        (``source``: a receive's sender).

        c10d waits on a synchronous send's Work and drops it, so the last such Work is
        made again (not a c10d object made and freed per send) when nothing else can reach
        it (``NeuronWork.restart``). A Work someone kept (isend), or made a future or hook
        from, is never touched again.
        """
        if self._spare is None or not self._spare.restart([t], what, True, source):
            self._spare = NeuronWork([t], what)
            self._spare.complete_unseen(source)
        return self._spare

    def recv(self, t, src, tag: int):
        """Receive into tensor ``t`` from group rank ``src`` (None: any rank); its Work."""
        # A message from this node that is already whole at the head of its ring is read
        # straight into the tensor, now: no request, no progress engine.
        shm_src = self._local.get(src)
        if (shm_src is not None and not self._stopped and t.is_contiguous()
                and not _profiler._is_profiler_enabled):
            nbytes = t.numel() * t.element_size()
            if self.shm_engine().recv_now(shm_src, int(tag), t.data_ptr(), nbytes):
                stats.add_call(nbytes)
                return self._done(t, lambda: f"recv from rank {src} (tag {tag}, {nbytes} "
                                             f"bytes) in group {self.label()}", src)
        return self._post(t, src, tag, False, "recv")

    def stop(self, error) -> None:
        """The group is going away: pending and later sends/receives fail (with ``error``)."""
        self._stopped = True
        if self._shm is not None:
            self._shm.stop(error)

    def shm_engine(self) -> P2PEngine:
        """The group's shared-memory send/recv engine (made on first use)."""
        if self._shm is None:
            ch = self._channel  # (ch.rank, ch.size: this node's part of the group)
            p2p = P2P(ch.rank, ch.size, lambda k: ch.mailbox(ch.rank, k),
                      lambda k: ch.mailbox(k, ch.rank), ch.ring)
            self._shm = P2PEngine(p2p, ch, self.label(),
                                  lambda exc, what: self.on_error(exc, what)[0])
        return self._shm

    def withdraw_shm(self, req) -> None:
        """Withdraw a request of the shared-memory engine unless it completed."""
        if self._shm is not None:
            self._shm.withdraw(req, Claimed())

    def check_node_senders(self) -> None:
        """Raise a transport error if no other rank of this node is left to send (or one
        aborted the group)."""
        ch = self._channel
        ch.check_peers([k for k in range(ch.size) if k != ch.rank], float("inf"),
                       any_suffices=True)

    def _post(self, t, peer, tag: int, is_send: bool, name: str):
        if _profiler._is_profiler_enabled:
            what = f"group={self.label()} peer={peer} tag={tag} bytes={t.numel() * t.element_size()}"
            with _profiler.record_function(f"neuron:{name}", what):
                return self._post_now(t, peer, tag, is_send, name)
        return self._post_now(t, peer, tag, is_send, name)

    def _post_now(self, t, peer, tag: int, is_send: bool, name: str):
        if self._stopped:
            raise GroupAbortedError(f"{name}: the group was destroyed")
        shm_peer = self._local.get(peer)
        if shm_peer is None and self.net is not None:
            if peer is None and self._names is not None:
                return self._post_any(t, tag)
            return self._post_net(t, peer, tag, is_send, name)
        if t.is_contiguous():
            f, data = None, Memory(t)
        else:
            f = Flat(t, read=is_send)
            data = f.bytes  # (a torch view: made once)
        req = Request(shm_peer, int(tag), data, is_send, time.monotonic() + self._timeout())
        req.names = self._names
        work = NeuronWork([t], lambda: f"{req.describe()} in group {self.label()}")
        op = work.op = _ShmOp(self.shm_engine(), req, work, None if is_send else f)
        req.callback = op.done
        stats.add_call(data.numel())
        op.engine.post(req)
        return work

    def _post_any(self, t, tag: int):
        """A receive from any rank, in a group that spans nodes with other ranks on this
        node: on shared memory and the network at once (p2p_any.py)."""
        if tag < 0:
            raise ValueError(f"recv: tag must be >= 0, not {tag}")
        if t.is_contiguous():
            f, data, buf = None, Memory(t), as_bytes(t)
        else:
            f = Flat(t, read=False)
            data, buf = f.bytes, as_bytes(f.bytes)
        op = AnySourceRecv(self, int(tag), data, f, self._names,
                           time.monotonic() + self._timeout())
        stats.add_call(data.numel())
        work = NeuronWork([t], op)
        work.op = op
        try:
            op.start(work, buf, P2P_TAG_BASE + int(tag))
        except (PeerDied, PeerAborted, ChannelClosed) as e:
            self.withdraw_shm(op.shm)
            raise self.on_error(e, op())[0] from None
        return work

    def _post_net(self, t, peer, tag: int, is_send: bool, name: str):
        """Send/recv in a group that spans nodes: straight over the inter-node transport.

        A contiguous tensor's memory is handed to the transport as it is (no torch view ops:
        they cost several µs each here); a send the transport completes at once (it copied
        a small message) returns a finished Work without any completion machinery. The
        Work's description is only formatted if someone reads it (an error, a log).
        """
        if tag < 0:
            raise ValueError(f"{name}: tag must be >= 0, not {tag}")
        f = None
        if t.is_contiguous():
            buf = as_bytes(t)
        else:
            f = Flat(t, read=is_send)
            buf = as_bytes(f.bytes)
        op = _NetOp(self, peer, tag, is_send, name, buf.nbytes, f)
        stats.add_call(op.nbytes)
        net = self.net
        try:
            if peer is None:
                req = net.irecv_any(P2P_TAG_BASE + int(tag), buf)
            elif is_send:
                req = net.isend(peer, P2P_TAG_BASE + int(tag), buf)
                if req.test():
                    return self._done(t, op)
            else:
                req = net.irecv(peer, P2P_TAG_BASE + int(tag), buf)
        except (PeerDied, PeerAborted, ChannelClosed) as e:
            raise self.on_error(e, op())[0] from None
        op.req = req
        op.deadline = time.monotonic() + self._timeout()
        # Completed by whoever looks (wait, is_completed, ...): no completion callback, so
        # no hand-off to the transport's callback thread per message. A future or hook
        # arms the callback. (The op describes the work: it is callable.)
        op.work = work = NeuronWork([t], op)
        work.op = op
        return work


class _ShmOp:
    """A one-node send/recv as its Work sees it (``NeuronWork.op``): the waiting thread
    drives the group's send/recv engine; the request's callback (``done``) completes the
    Work, copying a receive into its tensor first when that is not contiguous (``flat``).
    One object, not a closure and its cells (see ``_NetOp``)."""

    __slots__ = ("engine", "req", "work", "flat")

    def __init__(self, engine, req, work, flat):
        self.engine, self.req, self.work, self.flat = engine, req, work, flat

    def drive(self, deadline: float) -> None:
        req = self.req
        if req is not None:  # (None: done already)
            self.engine.drive(req, deadline)

    def done(self, req) -> None:
        if req.error is None and self.flat is not None:
            self.flat.finish()
        work, self.work = self.work, None
        self.req = None  # (the request's callback refers to this object: no cycle is left)
        if work is not None:
            source = req.source
            if req.names is not None and source >= 0:
                source = req.names[source]  # (the node's number -> the group rank)
            work.complete(req.error, source)

    def poll(self) -> None:
        pass

    def arm(self) -> None:
        pass


class _NetOp:
    """A send/recv of a group that spans nodes as its Work sees it (``NeuronWork.op``):
    what makes progress (``drive``), what completes the Work once its request has finished
    (``poll``, ``finish``), what makes it complete by itself (``arm``), and, called, the
    Work's description.

    One object per message instead of closures and bound methods: a pending receive keeps
    12 container objects alive instead of 29 (test_multinode.py counts them), and so
    wakes the cyclic garbage collector, whose full passes over torch's objects take tens
    of ms, less often.
    """

    __slots__ = ("face", "peer", "tag", "is_send", "name", "nbytes", "flat", "req", "work",
                 "deadline", "open", "armed")

    def __init__(self, face, peer, tag, is_send, name, nbytes, flat):
        self.face, self.peer, self.tag, self.is_send = face, peer, tag, is_send
        self.name, self.nbytes, self.flat = name, nbytes, flat
        self.open = [True]  # whoever pops it completes the work (list.pop is atomic)
        self.armed = False

    def __call__(self) -> str:
        who = f"rank {self.peer}" if self.peer is not None else "any rank"
        return (f"{self.name} {'to' if self.is_send else 'from'} {who} (tag {self.tag}, "
                f"{self.nbytes} bytes) in group {self.face.label()}")

    def finish(self, req) -> None:
        try:
            self.open.pop()
        except IndexError:
            return
        # (The Work's description and an armed request's callback refer to this object:
        # no cycle is left.)
        work, self.work, self.req = self.work, None, None
        error = req.error
        if error is not None:
            error = self.face.on_error(error, work.what)[0]
        elif self.flat is not None and not self.is_send:
            self.flat.finish()  # a receive into a non-contiguous tensor: copy it back
        work.complete(error, req.source if req.source is not None else -1)

    def poll(self) -> None:
        req = self.req  # (None: finished already)
        if req is not None and req.done():
            self.finish(req)

    def arm(self) -> None:
        req = self.req
        if req is not None and not self.armed:
            self.armed = True
            req.on_complete(self.finish)

    def drive(self, deadline: float) -> None:
        req, op_deadline = self.req, self.deadline
        if req is None:
            return
        try:
            req.wait(min(deadline, op_deadline))
        except PeerTimeout:
            work = self.work
            if work is None:
                return  # completed meanwhile, by a thread that ran finish()
            if deadline < op_deadline:
                raise PeerTimeoutError(f"{work.what}: Timed out in Work.wait") from None
            face = self.face
            who = f"rank {self.peer}" if self.peer is not None else "any rank"
            timeout = PeerTimeout([] if self.peer is None else [self.peer], 0.0,
                                  f"{who} did not {'receive' if self.is_send else 'send'} it",
                                  network=True)
            # Withdrawn before the Work fails: the tensor is the caller's again and a late
            # message never lands in it. A receive from any rank binds no stream: the group
            # goes on. Otherwise the stream with that peer is out of step: the group fails,
            # on every rank, as after a collective's time-out (one node alike).
            if not face.net.cancel(req, timeout):
                self.finish(req)  # it completed in the meantime after all
                return
            try:
                self.open.pop()
            except IndexError:
                return
            self.work = self.req = None
            if self.peer is None:
                error = PeerTimeoutError(f"{work.what}: Timed out after "
                                         f"{face.timeout_text()}: {timeout}")
            else:
                error = face.on_error(timeout, work.what)[0]
            work.complete(error, -1)
            return
        except Exception:  # noqa: BLE001 - finish() reports it
            pass
        self.finish(req)
