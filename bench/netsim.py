"""The between-nodes algorithms for thousands of ranks in one process, over a simulated network.

How it works
------------
The algorithms between nodes (collectives/net_*.py) are generators over a ``NetCall``:
they post ``send`` / ``recv``, ``reduce`` and ``buffer``, and ``yield`` where everything
posted must be complete. ``Simulation`` gives each of P ranks a ``SimNet`` with that
interface and drives all P generators, round-robin, in this one process: a send copies its
bytes at once (eager, as the transport's small messages are); a receive is matched with
the sender's messages to this rank in order (per pair first in, first out, as on a rail);
a rank at a ``yield`` runs again once every receive it posted has been filled. What the
algorithm code computes is real: pass real tensors and every result can be checked. Pass
``meta`` tensors (``torch.empty(n, device="meta")``) and nothing is allocated: the same
code runs, only the counts are kept, so 4096 ranks of 1 MiB cost no memory.

It counts per rank: messages and bytes sent and received (a first message to a peer above
``net.PIGGYBACK_BYTES`` counts one more message, its call descriptor, as ``NetCall``
sends it; one above ``net.ACKED_BYTES`` counts as acked: its ACK frame, which the cost
model prices and the clock below does not), distinct peers, rounds on the critical path
(``hops``: a Lamport clock, +1 per message along a chain of dependent messages), and
predicts time with a ``net_cost.Link``:
a rank's clock advances by alpha per message it sends or receives, gamma per byte it
reduces; a message leaves when the sender's link is free (beta per byte, one direction)
and arrives lat later; a ``yield`` waits for the last arrival. A rank that waits for a
message nobody sends is a deadlock (``SimError`` names the ranks); so is a message left
unreceived at the end, a size that differs between sender and receiver, or a generator
that returns with something still posted.

Used by tests/units/test_net_algorithms.py (every algorithm, 2 to 1024 ranks) and
``python -m bench.scaleplan`` (docs/performance.md's table to 4096 ranks).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from neuron_dist.collectives.net import ACKED_BYTES, PIGGYBACK_BYTES, as_bytes
from neuron_dist.collectives.net_cost import MEASURED, Link
from neuron_dist.collectives.reduce_ops import Scratch, reduce_into


class SimError(AssertionError):
    """The simulated algorithm did something a real network would hang or fail on."""


@dataclass
class RankStats:
    """What one rank did in a simulated call."""

    sent: int = 0
    received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    reduced: int = 0
    peers: set = field(default_factory=set)
    hops: int = 0
    time: float = 0.0
    waits: int = 0  # yields with a receive posted since the one before
    acked_sent: int = 0  # sends above ACKED_BYTES (each waits for an ACK frame)
    acked_received: int = 0  # receives above it (each answered with an ACK frame)


@dataclass
class Stats:
    """The whole call: per-rank stats and their maxima (the critical path)."""

    ranks: list

    @property
    def sent(self) -> int:
        return max(r.sent for r in self.ranks)

    @property
    def received(self) -> int:
        return max(r.received for r in self.ranks)

    @property
    def bytes(self) -> int:
        return max(max(r.bytes_sent, r.bytes_received) for r in self.ranks)

    @property
    def reduced(self) -> int:
        return max(r.reduced for r in self.ranks)

    @property
    def acks(self) -> int:
        """ACK frames of messages above ACKED_BYTES one rank sends or receives, at most."""
        return max(r.acked_sent + r.acked_received for r in self.ranks)

    @property
    def acked(self) -> int:
        """Sends above ACKED_BYTES of one rank (each waits for its ack), at most."""
        return max(r.acked_sent for r in self.ranks)

    @property
    def peers(self) -> int:
        return max(len(r.peers) for r in self.ranks)

    @property
    def hops(self) -> int:
        return max(r.hops for r in self.ranks)

    @property
    def time(self) -> float:
        return max(r.time for r in self.ranks)

    @property
    def messages(self) -> int:
        """Messages sent by all ranks together."""
        return sum(r.sent for r in self.ranks)

    def mean(self) -> dict:
        """The average rank (what net_cost.Shape.mean counts): messages sent and received,
        waits, bytes through its link in one direction ((sent + received) / 2), bytes
        reduced."""
        n = len(self.ranks)
        return {"sent": sum(r.sent for r in self.ranks) / n,
                "received": sum(r.received for r in self.ranks) / n,
                "waits": sum(r.waits for r in self.ranks) / n,
                "bytes": sum(r.bytes_sent + r.bytes_received for r in self.ranks) / (2 * n),
                "reduced": sum(r.reduced for r in self.ranks) / n,
                "acks": sum(r.acked_sent + r.acked_received for r in self.ranks) / n,
                "acked": sum(r.acked_sent for r in self.ranks) / n}


def _nbytes(buf) -> int:
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    return len(buf)


class _Message:
    __slots__ = ("data", "nbytes", "arrival", "hop", "heard")

    def __init__(self, data, nbytes, arrival, hop, heard):
        self.data, self.nbytes, self.arrival, self.hop = data, nbytes, arrival, hop
        self.heard = heard


class SimNet:
    """One rank's ``NetCall`` in a ``Simulation`` (``send``, ``recv``, ``reduce``,
    ``buffer``)."""

    def __init__(self, sim: "Simulation", rank: int):
        self.sim, self.rank = sim, rank
        self.stats = RankStats()
        self._buffers: dict = {}
        self._told: set = set()
        self._pending = 0  # receives posted and not filled yet
        self._unwaited = 0  # sends and receives posted since the last yield
        self._recvs = 0  # receives posted since the last yield
        self._arrived: list = []  # messages filled since the last wait
        self._link_free = 0.0
        self._heard = 1 << rank  # the ranks this one has heard from, through any chain

    def send(self, peer: int, buf) -> None:
        sim, st = self.sim, self.stats
        if not 0 <= peer < sim.size or peer == self.rank:
            raise SimError(f"rank {self.rank} sends to rank {peer}")
        n = _nbytes(buf)
        messages = 1
        if peer not in self._told:
            self._told.add(peer)
            messages += n > PIGGYBACK_BYTES  # the descriptor travels apart
        st.sent += messages
        st.acked_sent += n > ACKED_BYTES
        st.bytes_sent += n
        st.peers.add(peer)
        link = sim.link
        st.time += messages * link.alpha
        self._link_free = max(self._link_free, st.time) + n * link.beta
        data = None
        if not (isinstance(buf, torch.Tensor) and buf.is_meta):
            data = bytes(as_bytes(buf)) if isinstance(buf, torch.Tensor) else bytes(buf)
        msg = _Message(data, n, self._link_free + link.lat, st.hops + 1, self._heard)
        self._unwaited += 1
        sim._deliver(self.rank, peer, msg, messages)

    def recv(self, peer: int, buf) -> None:
        sim = self.sim
        if not 0 <= peer < sim.size or peer == self.rank:
            raise SimError(f"rank {self.rank} receives from rank {peer}")
        self.stats.peers.add(peer)
        self._pending += 1
        self._unwaited += 1
        self._recvs += 1
        sim._post(peer, self.rank, buf)

    def reduce(self, out, inputs: list, spec) -> None:
        n = out.numel() * out.element_size() * (len(inputs) - 1)
        self.stats.reduced += n
        self.stats.time += n * self.sim.link.gamma
        if out.is_meta:
            return
        reduce_into(out, inputs, spec, len(inputs), self.sim.scratch)

    def buffer(self, key: str, numel: int, dtype) -> torch.Tensor:
        t = self._buffers.get(key)
        if t is None or t.numel() < numel or t.dtype != dtype:
            t = self._buffers[key] = torch.empty(numel, dtype=dtype,
                                                 device=self.sim.device)
        return t[:numel]

    def _filled(self, msg: _Message, messages: int) -> None:
        st = self.stats
        st.received += messages
        st.acked_received += msg.nbytes > ACKED_BYTES
        st.bytes_received += msg.nbytes
        self._pending -= 1
        self._arrived.append(msg)

    def _complete_wait(self) -> None:
        st, alpha = self.stats, self.sim.link.alpha
        for msg in sorted(self._arrived, key=lambda m: m.arrival):
            st.time = max(st.time, msg.arrival) + alpha
            st.hops = max(st.hops, msg.hop)
            self._heard |= msg.heard
        self._arrived.clear()


class Simulation:
    """``size`` ranks on a simulated network priced by ``link``; ``device="meta"`` for
    buffers (``SimNet.buffer``) that hold no data."""

    def __init__(self, size: int, link: Link = MEASURED, device: str = "cpu"):
        self.size, self.link, self.device = size, link, device
        self.nets = [SimNet(self, r) for r in range(size)]
        self.scratch = Scratch()
        self._queued: dict = {}  # (src, dst) -> deque of (message, count) not yet received
        self._posted: dict = {}  # (src, dst) -> deque of receive buffers not yet filled

    def heard(self, rank: int) -> set:
        """The ranks ``rank`` has heard from through some chain of messages (and itself):
        after a barrier or an all-reduce, every rank of the call."""
        mask = self.nets[rank]._heard
        return {r for r in range(self.size) if mask >> r & 1}

    def _deliver(self, src: int, dst: int, msg: _Message, messages: int) -> None:
        posted = self._posted.get((src, dst))
        if posted:
            self._fill(src, dst, posted.popleft(), msg, messages)
        else:
            self._queued.setdefault((src, dst), deque()).append((msg, messages))

    def _post(self, src: int, dst: int, buf) -> None:
        queued = self._queued.get((src, dst))
        if queued:
            msg, messages = queued.popleft()
            self._fill(src, dst, buf, msg, messages)
        else:
            self._posted.setdefault((src, dst), deque()).append(buf)

    def _fill(self, src: int, dst: int, buf, msg: _Message, messages: int) -> None:
        n = _nbytes(buf)
        if n != msg.nbytes:
            raise SimError(f"rank {dst} expected {n} B from rank {src}, which sent "
                           f"{msg.nbytes} B")
        if msg.data is not None and n:
            if isinstance(buf, torch.Tensor) and buf.is_meta:
                raise SimError("a message with data received into a meta tensor")
            as_bytes(buf)[:] = msg.data
        net = self.nets[dst]
        net._filled(msg, messages)
        if net._pending == 0 and dst in self._waiting:
            self._waiting.discard(dst)
            self._wait_done(dst)
            self._ready.append(dst)

    def _wait_done(self, r: int) -> None:
        net = self.nets[r]
        net._unwaited = 0
        net._complete_wait()

    def run(self, algorithms) -> Stats:
        """Drive ``algorithms`` (rank -> the generator that rank runs, made with
        ``self.nets[rank]``) to their end; returns the stats."""
        gens = dict(enumerate(algorithms)) if isinstance(algorithms, list) else dict(algorithms)
        self._ready = deque(sorted(gens))
        self._waiting: set = set()
        while self._ready:
            r = self._ready.popleft()
            net = self.nets[r]
            try:
                next(gens[r])
            except StopIteration:
                if net._unwaited:
                    raise SimError(f"rank {r} returned with {net._unwaited} send(s) or "
                                   f"receive(s) posted after its last yield") from None
                del gens[r]
                continue
            if net._recvs:
                net.stats.waits += 1
                net._recvs = 0
            if net._pending:
                self._waiting.add(r)
            else:
                self._wait_done(r)
                self._ready.append(r)
        if gens:
            stuck = sorted(gens)
            waits = {r: [src for (src, dst), q in self._posted.items() if dst == r and q]
                     for r in stuck[:8]}
            raise SimError(f"deadlock: {len(stuck)} rank(s) wait forever, e.g. "
                           + "; ".join(f"rank {r} for {w}" for r, w in waits.items()))
        left = {k: len(q) for k, q in self._queued.items() if q}
        if left:
            raise SimError(f"messages sent and never received (src, dst): {left}")
        return Stats([net.stats for net in self.nets])
