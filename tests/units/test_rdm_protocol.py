"""The rdm protocol core under a simulated lossy multi-rail network, and its frame decoder fuzzed.

Every test drives ``transport.rdm.protocol.Endpoint`` objects through ``Net``: a seeded,
deterministic simulation with one "wire" per (direction, rail) that drops, duplicates,
delays (hence reorders) and corrupts frames, and rails that die. No sockets, no threads.
"""

from __future__ import annotations

import heapq
import random
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from neuron_dist.transport.rdm import frames as F
from neuron_dist.transport.rdm.protocol import (DELAYED_ACK_BYTES, Endpoint, FrameRejected,
                                                MessageReceived, MessageRefused, PeerFailed,
                                                ProtocolError, SendCompleted, SendRefused,
                                                Transmit)

DT = 0.002


class Net:
    """Endpoints joined by ``rails`` lossy wires per direction, stepped in simulated time."""

    def __init__(self, endpoints, seed=0, drop=0.0, dup=0.0, corrupt=0.0, delay=(0.001, 0.02)):
        self.eps = endpoints
        self.rng = random.Random(seed)
        self.drop, self.dup, self.corrupt, self.delay = drop, dup, corrupt, delay
        self.now = 0.0
        self.queue = []  # (arrival time, n, dst, rail, bytes)
        self.n = 0
        self.dead = set()  # (a, b, rail) with a < b: the rail between a and b is cut
        self.events = {ep.rank: [] for ep in endpoints}
        self.max_inflight = {ep.rank: 0 for ep in endpoints}
        self.max_reassembly = {ep.rank: 0 for ep in endpoints}
        self.on_step = []

    def _link(self, a, b, rail):
        return (min(a, b), max(a, b), rail)

    def cut(self, a, b, rail):
        """Kill the rail between a and b: frames on it (also in flight) vanish."""
        self.dead.add(self._link(a, b, rail))

    def _put(self, src, tx):
        if self._link(src, tx.peer, tx.rail) in self.dead or self.rng.random() < self.drop:
            return
        copies = 2 if self.rng.random() < self.dup else 1
        for _ in range(copies):
            data = tx.data
            if self.rng.random() < self.corrupt:
                b = bytearray(data)
                i = self.rng.randrange(len(b))
                b[i] ^= self.rng.randrange(1, 256)
                data = bytes(b)
            self.n += 1
            t = self.now + self.rng.uniform(*self.delay)
            heapq.heappush(self.queue, (t, self.n, src, tx.peer, tx.rail, data))

    def step(self):
        self.now += DT
        for ep in self.eps:
            for tx in ep.poll_transmit(self.now):
                self._put(ep.rank, tx)
        by_rank = {ep.rank: ep for ep in self.eps}
        while self.queue and self.queue[0][0] <= self.now:
            _, _, src, dst, rail, data = heapq.heappop(self.queue)
            if self._link(src, dst, rail) in self.dead:
                continue
            self._arrive(by_rank[dst], rail, data)
        self._progress()
        for ep in self.eps:
            new = ep.events()
            self.events[ep.rank] += new
            self._delivered(new)
            for peer in range(ep.world_size):
                if peer != ep.rank:
                    self.max_inflight[ep.rank] = max(self.max_inflight[ep.rank], ep.inflight_bytes(peer))
            self.max_reassembly[ep.rank] = max(self.max_reassembly[ep.rank], ep.reassembly_bytes)
        for hook in list(self.on_step):
            hook(self)

    def _arrive(self, ep, rail, data):
        """A frame reaches ``ep`` (a datagram driver: ``receive``)."""
        ep.receive(rail, data, self.now)

    def _progress(self):
        """After this step's arrivals (subclasses: work that takes time)."""

    def _delivered(self, events):
        """The events an endpoint reported this step (subclasses: act on them)."""

    def run(self, done, max_time=60.0):
        while not done():
            assert self.now < max_time, "simulation did not finish in time"
            self.step()

    def of(self, rank, kind):
        return [e for e in self.events[rank] if isinstance(e, kind)]


def make(world, **kw):
    args = dict(rails=3, segment_bytes=256, max_message_bytes=1 << 20, rto=0.05, max_rto=0.4,
                max_retries=30, window_bytes=8 * 1024)
    args.update(kw)
    return [Endpoint(r, world, **args) for r in range(world)]


def payload(rng, n):
    return bytes(rng.getrandbits(8) for _ in range(n))


def send_traffic(eps, rng, per_pair=12, sizes=(0, 1, 255, 256, 257, 1000, 3000), tags=(0, 1, 5)):
    """Send messages between every ordered pair; return {(src, dst, tag): [bytes in send order]}."""
    sent, ids = {}, {}
    for ep in eps:
        for peer in range(ep.world_size):
            if peer == ep.rank:
                continue
            for _ in range(per_pair):
                tag = rng.choice(tags)
                data = payload(rng, rng.choice(sizes))
                msg_id = ep.send(peer, tag, data)
                sent.setdefault((ep.rank, peer, tag), []).append(data)
                ids.setdefault((ep.rank, peer), set()).add(msg_id)
    return sent, ids


def all_delivered(net, sent, ids):
    def done():
        got = sum(len(net.of(r, MessageReceived)) for r in net.events)
        completed = sum(len(net.of(r, SendCompleted)) for r in net.events)
        return got == sum(map(len, sent.values())) and completed == sum(map(len, ids.values()))
    return done


def check_delivery(net, sent, ids):
    received = {}
    for rank in net.events:
        for e in net.of(rank, MessageReceived):
            received.setdefault((e.src, rank, e.tag), []).append(bytes(e.data))
    assert received == sent  # exactly once, intact, in per-(src, tag) order
    for rank in net.events:
        done = {}
        for e in net.of(rank, SendCompleted):
            done.setdefault((rank, e.peer), []).append(e.msg_id)
        for key, msg_ids in done.items():
            assert len(msg_ids) == len(set(msg_ids)), "a completion fired twice"
            assert set(msg_ids) == ids[key]
    for rank in net.events:
        assert not net.of(rank, PeerFailed)
    for ep in net.eps:  # messages no receive was posted for wait in the endpoint until taken
        for src, dst, tag in sent:
            if dst == ep.rank:
                while ep.take_early(src, tag) is not None:
                    pass


# ---------------------------------------------------------------- delivery under faults


@pytest.mark.parametrize("seed", [1, 2])
def test_two_ranks_lossy_duplicating_reordering(seed):
    eps = make(2)
    net = Net(eps, seed=seed, drop=0.2, dup=0.1, delay=(0.001, 0.03))
    sent, ids = send_traffic(eps, random.Random(seed))
    net.run(all_delivered(net, sent, ids))
    check_delivery(net, sent, ids)
    assert eps[0].stats["retransmits"] > 0 and eps[1].stats["duplicates"] > 0
    for ep in eps:  # the window was respected (one segment may always be outstanding)
        assert net.max_inflight[ep.rank] <= ep.window_bytes
        assert ep.reassembly_bytes == 0


@pytest.mark.parametrize("seed", [4, 5])
def test_messages_framed_at_once_mix_with_queued_ones_under_loss(seed):
    """``send_now`` (the driver's fast path for small messages) beside ``send``, on a network
    that drops, duplicates and reorders: exactly once, in per-(src, tag) order, resent
    like the rest. It declines while messages wait to go to the peer (or the window is
    full), so a message framed at once never overtakes one queued before it. Those framed
    with ``notify=False`` are acknowledged like the others but report no completion."""
    eps = make(2, window_bytes=2048)
    net = Net(eps, seed=seed, drop=0.2, dup=0.1)
    rng = random.Random(seed)
    sent, ids = {}, {}
    counts = {"now": 0, "queued": 0, "quiet": 0}
    per_pair = 80

    def more(net):
        for ep in eps:
            peer = 1 - ep.rank
            if sum(len(v) for k, v in sent.items() if k[:2] == (ep.rank, peer)) >= per_pair:
                continue
            for _ in range(rng.randrange(1, 4)):
                tag = rng.choice((0, 1))
                data = payload(rng, rng.choice((0, 5, 200, 256)))
                state = ep._peers.get(peer)
                waiting = state is not None and bool(state.queue)
                notify = rng.random() < 0.5
                got = ep.send_now(peer, tag, data, net.now, notify)
                if got is None:
                    counts["queued"] += 1
                    msg_id = ep.send(peer, tag, data)
                    ids.setdefault((ep.rank, peer), set()).add(msg_id)
                else:
                    assert not waiting, "framed at once past a queued message"
                    counts["now"] += 1
                    msg_id, rail, header, body, trailer = got
                    net._put(ep.rank, Transmit(peer, rail, header, body, trailer))
                    if notify:
                        ids.setdefault((ep.rank, peer), set()).add(msg_id)
                    else:
                        counts["quiet"] += 1
                        quiet.add((ep.rank, msg_id))
                sent.setdefault((ep.rank, peer, tag), []).append(data)

    quiet = set()
    net.on_step.append(more)
    delivered = all_delivered(net, sent, ids)
    net.run(lambda: min(len(v) for v in sent_per_pair(sent)) >= per_pair and delivered()
            and not any(ep.inflight_bytes(1 - ep.rank) for ep in eps))
    check_delivery(net, sent, ids)
    assert counts["now"] >= 10 and counts["queued"] >= 10  # both paths, and the window filled
    assert counts["quiet"] >= 3
    assert not any((r, e.msg_id) in quiet for r in net.events for e in net.of(r, SendCompleted))
    assert eps[0].stats["retransmits"] > 0
    for ep in eps:
        assert net.max_inflight[ep.rank] <= ep.window_bytes


def sent_per_pair(sent):
    """Messages sent by each of the two ranks of a pair (``sent``: as ``send_traffic``)."""
    return [[d for k, v in sent.items() if k[:2] == (r, 1 - r) for d in v] for r in (0, 1)]


def test_three_ranks_all_pairs_lossy():
    eps = make(3)
    net = Net(eps, seed=3, drop=0.2, dup=0.05, delay=(0.001, 0.02))
    sent, ids = send_traffic(eps, random.Random(3), per_pair=8)
    net.run(all_delivered(net, sent, ids))
    check_delivery(net, sent, ids)


@pytest.mark.parametrize("crc", [False, True])
def test_delayed_acks_riding_on_data_under_loss(crc):
    """Both directions busy, acks held up to ack_delay and carried behind DATA frames, on
    a network that drops, duplicates, reorders (and corrupts, with CRC): still exactly once."""
    eps = make(2, ack_delay=0.01, crc=crc)
    net = Net(eps, seed=7, drop=0.15, dup=0.1, corrupt=0.1 if crc else 0.0)
    rng = random.Random(7)
    sent, ids = send_traffic(eps, rng, per_pair=2)
    rounds = [30]

    def more(net):  # keep both directions sending while acks are held
        if rounds[0] and round(net.now / DT) % 3 == 0:
            rounds[0] -= 1
            for key, batch in send_traffic(eps, rng, per_pair=1)[0].items():
                sent.setdefault(key, []).extend(batch)
            for ep in eps:
                ids[(ep.rank, 1 - ep.rank)] = set(range(ep._peers[1 - ep.rank].next_msg_id))
    net.on_step.append(more)
    delivered = all_delivered(net, sent, ids)
    net.run(lambda: not rounds[0] and delivered())
    check_delivery(net, sent, ids)
    assert all(ep.stats["acks_piggybacked"] > 10 for ep in eps), [ep.stats for ep in eps]


def _deliver(src, dst, now):
    frames = src.poll_transmit(now)
    for tx in frames:
        dst.receive(tx.rail, tx.data, now)
    return frames


def test_acks_ride_on_replies_and_wait_at_most_ack_delay():
    a, b = make(2, ack_delay=0.01, rails=2, segment_bytes=1 << 17, window_bytes=1 << 20)
    now = 0.0
    for _ in range(5):  # ping-pong: every reply carries the ack of the request
        a.send(1, 0, b"ping")
        _deliver(a, b, now)
        b.send(0, 0, b"pong")
        _deliver(b, a, now)
        now += 0.001
    assert a.stats["acks_sent"] == b.stats["acks_sent"] == 0
    assert len([e for e in a.events() if isinstance(e, SendCompleted)]) == 5
    assert len([e for e in b.events() if isinstance(e, SendCompleted)]) == 4
    assert a.next_deadline() == pytest.approx(now - 0.001 + 0.01)  # the last pong's ack
    assert _deliver(a, b, now) == []  # held: not due yet
    (ack,) = _deliver(a, b, now + 0.01)  # due: an ACK frame of its own
    assert F.decode(ack.data).type == F.ACK
    assert [type(e) for e in b.events()] == [SendCompleted]
    # acks of a large message (its sender waits for them) go at once
    a.send(1, 0, b"x" * (DELAYED_ACK_BYTES + 1))
    _deliver(a, b, now)
    (ack,) = _deliver(b, a, now)
    assert F.decode(ack.data).type == F.ACK
    b.send(0, 0, b"late")
    _deliver(b, a, now)
    a.release_acks()  # before a close
    (ack,) = _deliver(a, b, now)
    assert F.decode(ack.data).acks == [(5, 0)]  # b sent pongs 0-4, then this one


def test_backlog_bytes_counts_what_waits_for_the_window():
    """What a driver checks before completing a small send at once (driver.isend): the
    bytes queued to a peer and not yet sent, down as segments go out, down when a queued
    message is cancelled, zero once everything went."""
    a, b = make(2, window_bytes=1000, segment_bytes=256, rails=1, ack_delay=0.0)
    assert a.backlog_bytes(1) == 0
    a.send(1, 0, bytes(3000))
    later = a.send(1, 0, bytes(500))
    assert a.backlog_bytes(1) == 3500
    _deliver(a, b, 0.0)  # the window takes 3 segments of 256 (plus headers)
    sent = 3000 + 500 - a.backlog_bytes(1)
    assert 0 < sent < 1000 and sent % 256 == 0
    assert a.cancel_send(1, later)
    assert a.backlog_bytes(1) == 3000 - sent
    now = 0.0
    for _ in range(100):
        if not a.backlog_bytes(1):
            break
        now += 0.001
        _deliver(b, a, now)  # acks open the window
        _deliver(a, b, now)
    assert a.backlog_bytes(1) == 0 and a.backlog_bytes(0) == 0


def test_has_work_says_when_poll_transmit_has_something_to_send():
    """A driver skips poll_transmit while has_work is False (deadlines aside): it must turn
    True for new messages, for a window that opens, and for acks that are due now."""
    a, b = make(2, window_bytes=1000, segment_bytes=256, rails=1, ack_delay=0.01)
    assert not a.has_work
    a.send(1, 0, bytes(3000))  # more than the window holds
    assert a.has_work
    assert _deliver(a, b, 0.0) and not a.has_work  # the window is full
    assert not b.has_work  # its acks may wait
    assert _deliver(b, a, 0.0) == []
    assert _deliver(b, a, 0.011)  # held acks went at their deadline...
    assert a.has_work  # ...and opened the window
    now = 0.011
    while now < 1.0 and (a.has_work or b.has_work or a.next_deadline() is not None):
        now += 0.002  # (under the rto: nothing is resent)
        _deliver(a, b, now)
        _deliver(b, a, now)
    assert a.stats["retransmits"] == 0 and now < 0.2
    assert [bytes(e.data) for e in b.events() if isinstance(e, MessageReceived)] == [bytes(3000)]
    b.receive(0, F.encode(F.DATA, 0, 1, msg_id=0, total=1, payload=b"x"), now)  # a duplicate
    assert b.has_work  # its ack goes at once


def _land(ep, frame_bytes, rail=0, now=0.0):
    """What a stream driver does with a frame: header, data_target, payload, data_landed."""
    header_bytes = frame_bytes[:F.HEADER_SIZE]
    h = F.decode_header(header_bytes)
    target = ep.data_target(rail, h)
    assert target is not None
    return lambda: (target.__setitem__(slice(None), frame_bytes[F.HEADER_SIZE:F.HEADER_SIZE + h.length]),
                    ep.data_landed(rail, header_bytes, h, now, frame_bytes[F.HEADER_SIZE + h.length:]))


def test_a_range_being_read_in_place_has_one_reader_and_nothing_lands_after_completion():
    """Fault: a resend on a second rail after a stall longer than the RTO got the posted
    buffer too, and kept writing old bytes into it after the first copy completed the
    receive. Now a claimed range is handed to nobody else: the second copy is read aside
    and dropped unacked while the first is read, and is a plain duplicate afterwards."""
    ep = Endpoint(1, 2, rails=2, segment_bytes=64, max_message_bytes=1024)
    buf = bytearray(4)
    ep.post_recv(0, 7, buf)
    first = F.encode(F.DATA, 0, 1, msg_id=0, tag=7, seq=0, total=4, payload=b"abcd")
    h = F.decode_header(first[:F.HEADER_SIZE])
    target = ep.data_target(0, h)  # rail 0 reads the header, then stalls in the payload
    assert target is not None
    assert ep.data_target(1, h) is None  # the resend on rail 1 does not get the buffer
    ep.receive(1, first, 0.0)  # it is read aside: dropped, not acked (rail 0 will ack)
    assert ep.stats["dropped_claimed"] == 1 and ep.events() == []
    assert ep.poll_transmit(0.0) == []
    target[:] = b"abcd"
    ep.data_landed(0, first[:F.HEADER_SIZE], h, 0.0)
    (e,) = ep.events()
    assert e.posted and bytes(e.data) == b"abcd"
    buf[:] = b"USER"  # the caller owns its buffer again and reuses it
    assert ep.data_target(1, h) is None  # later copies are duplicates: acked, placed nowhere
    ep.receive(1, first, 0.0)
    assert buf == b"USER" and ep.events() == [] and ep.stats["duplicates"] == 1
    acks = [a for tx in ep.poll_transmit(0.0) for a in F.decode(tx.data).acks]
    assert acks == [(0, 0), (0, 0)]
    second = F.encode(F.DATA, 0, 1, msg_id=1, tag=7, seq=1, total=4, payload=b"efgh")
    h2 = F.decode_header(second[:F.HEADER_SIZE])
    t2 = ep.data_target(0, h2)  # no receive posted: its own reassembly buffer
    ep.release_claims(0, 0)  # rail 0's reader died in the payload: the claim ends unlanded
    t2b = ep.data_target(1, h2)  # so the resend on rail 1 may read it
    assert t2 is not None and t2b is not None
    ep.data_landed(0, second[:F.HEADER_SIZE], h2, 0.0)  # (a late landing of a dead claim)
    assert ep.events() == []
    t2b[:] = b"efgh"
    ep.data_landed(1, second[:F.HEADER_SIZE], h2, 0.0)
    (e,) = ep.events()
    assert not e.posted and bytes(e.data) == b"efgh"


class StreamNet(Net):
    """``Net`` as a stream driver sees it: a DATA frame's header is read, the payload is
    read straight into ``data_target``'s view over a random time (a reader that stalls,
    longer than the RTO at times), then ``data_landed``; the rest goes through ``receive``.
    Every receive is posted; once a receive completes, the test writes a sentinel into its
    buffer at once (the caller reuses it), so a byte written into it later is caught."""

    def __init__(self, eps, seed, stall=(0.0, 0.2), whole=0.0):
        super().__init__(eps, seed=seed, delay=(0.001, 0.01))
        self.stall = stall
        self.whole = whole  # share of frames found read ahead whole: land_whole first
        self.landing = []  # (time, ep, rail, frame bytes, target view)
        self.results = []  # posted messages, as they completed

    def _arrive(self, ep, rail, data):
        h = F.decode_header(data[:F.HEADER_SIZE])
        end = F.HEADER_SIZE + h.length
        if self.rng.random() < self.whole and ep.land_whole(
                rail, data[:F.HEADER_SIZE], h, memoryview(data)[F.HEADER_SIZE:end],
                memoryview(data)[end:], self.now):
            return
        target = ep.data_target(rail, h)
        if target is None:
            ep.receive(rail, data, self.now)
            return
        done = self.now + self.rng.uniform(*self.stall)
        self.landing.append((done, ep, rail, data, target))

    def _progress(self):
        still = []
        for item in self.landing:
            done, ep, rail, data, target = item
            if done > self.now:
                still.append(item)
                continue
            h = F.decode_header(data[:F.HEADER_SIZE])
            target[:] = data[F.HEADER_SIZE:F.HEADER_SIZE + h.length]  # the reader's write
            ep.data_landed(rail, data[:F.HEADER_SIZE], h, self.now,
                           data[F.HEADER_SIZE + h.length:])
        self.landing = still

    def _delivered(self, events):
        for e in events:
            if isinstance(e, MessageReceived) and e.posted:
                self.results.append(bytes(e.data))
                e.data[:] = b"\xee" * e.data.nbytes  # the caller reuses its buffer


@pytest.mark.parametrize("whole", [0.0, 0.5])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stalled_readers_never_write_into_a_completed_receive(seed, whole):
    """``whole``: the share of frames the driver finds read ahead whole, which it offers to
    ``land_whole`` first (the fast path meets resends and stalled readers of the others)."""
    rng = random.Random(seed)
    eps = make(2, rails=3, segment_bytes=64, rto=0.02, max_rto=0.05, max_retries=1000)
    net = StreamNet(eps, seed, whole=whole)
    msgs = [payload(rng, rng.choice((1, 40, 64, 65, 200))) for _ in range(40)]
    bufs = [bytearray(len(m)) for m in msgs]
    for b in bufs:
        eps[1].post_recv(0, 2, b)
    for m in msgs:
        eps[0].send(1, 2, m)
    net.run(lambda: len(net.results) == len(msgs) and not net.landing)
    for _ in range(200):  # let every resend still in flight arrive
        net.step()
    assert net.results == msgs
    assert all(b == b"\xee" * len(b) for b in bufs)  # nothing written after completion
    assert eps[0].stats["retransmits"] > 0 and eps[1].stats["dropped_claimed"] > 0


def test_a_cancelled_receive_gets_no_byte_and_its_message_is_discarded():
    """Fault: a receive that timed out stayed posted; its late message landed in the
    buffer the caller gave up on. Withdrawn, it gets nothing more; the rails still reading
    into it are named (the driver waits for them); its message is acked and discarded."""
    ep = Endpoint(1, 2, rails=2, segment_bytes=64, max_message_bytes=1024)
    buf, nxt = bytearray(100), bytearray(3)
    pos = ep.post_recv(0, 5, buf)
    assert ep.post_recv(0, 5, nxt) == pos + 1
    frames = [F.encode(F.DATA, 0, 1, msg_id=0, tag=5, seq=0, total=100, offset=o,
                       payload=bytes(range(o, min(100, o + 64)))) for o in (0, 64)]
    h0 = F.decode_header(frames[0][:F.HEADER_SIZE])
    t0 = ep.data_target(1, h0)  # rail 1 is reading the first segment into buf
    assert ep.cancel_recv(0, 5, pos) == [1]
    assert ep.cancel_recv(0, 5, pos) == []  # (once)
    h1 = F.decode_header(frames[1][:F.HEADER_SIZE])
    assert ep.data_target(0, h1) is None  # nothing new is aimed at buf
    ep.receive(0, frames[1], 0.0)
    t0[:] = b"x" * 64  # rail 1's reader finishes its write, then lands
    ep.data_landed(1, frames[0][:F.HEADER_SIZE], h0, 0.0)
    assert ep.events() == [] and ep.stats["discarded"] == 1
    assert bytes(buf[64:]) == bytes(36)  # only the claimed range was ever written
    acks = sorted(a for tx in ep.poll_transmit(0.0) for a in F.decode(tx.data).acks)
    assert acks == [(0, 0), (0, 64)]
    late = F.encode(F.DATA, 0, 1, msg_id=1, tag=5, seq=1, total=3, payload=b"abc")
    ep.receive(0, late, 0.0)  # the next message goes to the next receive
    (e,) = ep.events()
    assert e.posted and nxt == b"abc"
    # a withdrawn receive whose message had not started: discarded when it comes
    pos = ep.post_recv(0, 5, buf)
    assert ep.cancel_recv(0, 5, pos) == []
    ep.receive(0, F.encode(F.DATA, 0, 1, msg_id=2, tag=5, seq=2, total=2, payload=b"zz"), 0.0)
    assert ep.events() == [] and ep.stats["discarded"] == 2 and ep.reassembly_bytes == 0


def _whole(ep, frame, rail=0, now=0.0):
    """Offer ``frame`` (read ahead whole) to ``land_whole``, as the driver does."""
    h = F.decode_header(frame[:F.HEADER_SIZE])
    end = F.HEADER_SIZE + h.length
    view = memoryview(frame)
    return ep.land_whole(rail, frame[:F.HEADER_SIZE], h, view[F.HEADER_SIZE:end], view[end:],
                         now)


def test_whole_frames_land_in_one_step_and_only_where_the_general_path_would():
    """``land_whole`` takes a one-segment message that is next in its stream, into its
    posted buffer or a private copy, and declines every other case, which then takes the
    general path: duplicates, withdrawn receives, messages out of order, pieces of larger
    messages, buffers too small, a peer over its memory budget."""
    ep = Endpoint(1, 2, rails=2, segment_bytes=64, max_message_bytes=1024,
                  max_reassembly_bytes=8)
    msg = lambda i, data, tag=3, **kw: F.encode(  # noqa: E731
        F.DATA, 0, 1, msg_id=i, tag=tag, seq=kw.pop("seq", i), total=kw.pop("total", len(data)),
        payload=data, **kw)
    buf = bytearray(4)
    ep.post_recv(0, 3, buf)
    first = msg(0, b"abcd")
    assert _whole(ep, first)
    (e,) = ep.events()
    assert e.posted and bytes(e.data) == b"abcd" == buf and e.msg_id == 0
    buf[:] = b"USER"  # the caller's again
    assert not _whole(ep, first, rail=1)  # a resend of it: a duplicate
    ep.receive(1, first, 0.0)
    assert buf == b"USER" and ep.events() == [] and ep.stats["duplicates"] == 1
    acks = [a for tx in ep.poll_transmit(0.0) for a in F.decode(tx.data).acks]
    assert acks == [(0, 0), (0, 0)]
    # nothing posted: a private copy, kept as an early message within the budget
    assert _whole(ep, msg(1, b"efg"))
    (e,) = ep.events()
    assert not e.posted and bytes(e.data) == b"efg" and ep.reassembly_bytes == 3
    assert not _whole(ep, msg(2, b"hijklm"))  # 3 + 6 bytes exceed the budget of 8
    assert ep.events() == []
    assert bytes(ep.post_recv(0, 3, bytearray(3))) == b"efg" and ep.reassembly_bytes == 0
    # out of order: message 3 comes before message 2 (declined; the general path holds it)
    assert not _whole(ep, msg(3, b"no"))
    # a withdrawn receive: its message is discarded by the general path, never landed
    pos = ep.post_recv(0, 3, bytearray(6))
    assert ep.cancel_recv(0, 3, pos) == []
    assert not _whole(ep, msg(2, b"hijklm"))
    # a buffer too small, a piece of a larger message, another tag's first message
    small = bytearray(1)
    ep.post_recv(0, 4, small)
    assert not _whole(ep, msg(4, b"xy", tag=4, seq=0))
    assert not _whole(ep, msg(5, b"ab", tag=5, seq=0, total=4))
    assert _whole(ep, msg(6, b"z", tag=6, seq=0))
    assert small == bytearray(1)


def test_take_whole_reports_its_delivery_as_its_result_and_checks_the_header_itself():
    """``take_whole`` (the driver's one-step path) on frames read ahead back to back in one
    buffer: each taken frame's delivery is its result, not an event (the acks it carried
    complete their sends as events); a frame not whole in the buffer, from another rank,
    to another, with a CRC or unknown flags, or to an endpoint that requires CRCs, is
    declined untouched, for the general path to judge."""
    a, b = Endpoint(0, 3, 1, 64, 1024), Endpoint(1, 3, 1, 64, 1024)
    ping = bytearray(4)
    assert b.post_recv(0, 4, ping) == 0
    msg_id = a.send(1, 4, b"ping")
    (tx,) = a.poll_transmit(0.0)
    got = b.take_whole(tx.rail, 0, memoryview(tx.data), 0, len(tx.data), 0.0)
    assert got[1:3] == (4, msg_id) and got[0] == F.HEADER_SIZE + 4
    assert got[3].obj is ping and ping == b"ping" and got[4] is True and b.events() == []
    reply = b.send_now(0, 4, b"pong", 0.0)  # (the ack of "ping" rides on it)
    assert reply[4] == F.ACK_ENTRY.pack(msg_id, 0)
    buf = bytearray(8)
    assert a.post_recv(1, 4, memoryview(buf)) == 0
    frame = reply[2] + reply[3] + reply[4]
    two = memoryview(frame + F.encode(F.DATA, 1, 0, msg_id=1, tag=4, seq=1, payload=b"x"))
    got = a.take_whole(0, 1, two, 0, len(two), 0.0)
    assert got[0] == len(frame) and got[4] is True and buf == b"pong" + bytes(4)
    assert a.events() == [SendCompleted(1, msg_id)] and a.inflight_bytes(1) == 0
    assert a.take_whole(0, 1, two, got[0], len(two) - 1, 0.0) is None  # not whole yet
    got = a.take_whole(0, 1, two, got[0], len(two), 0.0)
    assert got[0] == len(two) and bytes(got[3]) == b"x"
    assert got[4] is False and a.take_early(1, 4) == b"x" and a.take_early(1, 4) is None
    before = dict(b.stats), b.reassembly_bytes
    for bad in (F.encode(F.DATA, 2, 1, msg_id=0, tag=1, payload=b"a"),  # another rank's
                F.encode(F.DATA, 0, 2, msg_id=1, tag=1, payload=b"a"),  # to another rank
                F.encode(F.DATA, 0, 1, msg_id=1, tag=1, payload=b"a", crc=True),
                F.encode(F.ACK, 0, 1, payload=F.pack_acks([(0, 0)]))):
        assert b.take_whole(0, 0, memoryview(bad), 0, len(bad), 0.0) is None
    flagged = bytearray(F.encode(F.DATA, 0, 1, msg_id=1, tag=1, payload=b"a"))
    flagged[4] = 0x80
    assert b.take_whole(0, 0, memoryview(flagged), 0, len(flagged), 0.0) is None
    assert (dict(b.stats), b.reassembly_bytes) == before and b.events() == []
    crc = Endpoint(1, 3, 1, 64, 1024, crc=True)
    ok = F.encode(F.DATA, 0, 1, msg_id=0, tag=1, payload=b"a")
    assert crc.take_whole(0, 0, memoryview(ok), 0, len(ok), 0.0) is None


def test_a_cancelled_send_is_never_sent_or_resent_again():
    a, b = make(2, rails=2, segment_bytes=100, window_bytes=250)
    data = bytearray(1000)
    msg_id = a.send(1, 0, data)
    first = a.poll_transmit(0.0)
    assert first and a.inflight_bytes(1) > 0
    assert a.cancel_send(1, msg_id) and not a.cancel_send(1, msg_id)
    assert a.inflight_bytes(1) == 0
    later = a.poll_transmit(10.0)  # long after every deadline
    assert all(F.decode(tx.data).msg_id != msg_id for tx in later)
    a.send(1, 1, b"next")  # the window is free for others
    assert [F.decode(tx.data).payload for tx in a.poll_transmit(10.0)] == [b"next"]


def test_headers_cannot_make_a_rank_allocate_beyond_its_budget():
    """Fault: max_reassembly_bytes was skipped for the message due next on its stream, and
    every new tag has one: one header claiming 2**44 bytes made the rank allocate them."""
    ep = Endpoint(1, 2, rails=1, segment_bytes=64, max_message_bytes=1 << 48,
                  max_reassembly_bytes=4096)
    huge = F.encode(F.DATA, 0, 1, msg_id=0, tag=1, seq=0, total=1 << 44, payload=b"x" * 64)
    assert ep.data_target(0, F.decode_header(huge[:F.HEADER_SIZE])) is None
    ep.receive(0, huge, 0.0)
    for i in range(1, 200):  # a new tag each: every message is due next on its stream
        f = F.encode(F.DATA, 0, 1, msg_id=i, tag=100 + i, seq=0, total=1000, payload=b"y" * 64)
        h = F.decode_header(f[:F.HEADER_SIZE])
        if ep.data_target(0, h) is None:
            ep.receive(0, f, 0.0)
    assert ep.reassembly_bytes <= 4096 and ep.stats["dropped_full"] >= 196
    # an allocation that fails drops the frame too (the budget allows it here)
    ep = Endpoint(1, 2, rails=1, segment_bytes=64, max_message_bytes=1 << 48,
                  max_reassembly_bytes=1 << 50)
    ep.receive(0, huge, 0.0)
    assert ep.stats["dropped_full"] == 1 and ep.reassembly_bytes == 0


def test_early_messages_count_against_the_budget_until_taken():
    """Messages no receive was posted for wait in the endpoint, counted against the peer's
    budget; taking them frees it. A receive posted later takes the oldest first."""
    a, b = make(2, rails=1, segment_bytes=100, max_reassembly_bytes=250)
    net = Net([a, b], seed=4)
    for i in range(4):
        a.send(1, 9, bytes([i]) * 100)
    for _ in range(50):
        net.step()
    assert len(net.of(1, MessageReceived)) == 2 and b.reassembly_bytes == 200
    assert b.stats["dropped_full"] > 0  # the third waits (resent) until memory is free
    assert b.post_recv(0, 9, bytearray(100)) == bytes([0]) * 100
    assert b.take_early_any(9) == (0, bytearray(bytes([1]) * 100))
    net.run(lambda: len(net.of(1, MessageReceived)) == 4)
    assert b.take_early(0, 9) == bytes([2]) * 100 and b.take_early(0, 9) == bytes([3]) * 100
    assert b.take_early(0, 9) is None and b.reassembly_bytes == 0


def test_a_message_nobody_asked_for_yet_is_read_straight_into_its_reassembly_buffer():
    """Without a posted receive, a message's first segment opens its reassembly buffer in
    data_target, so the payload is read there and not aside. A message that would pass
    max_reassembly_bytes is declined (receive() then drops it, and the sender resends),
    even the next one in its stream: taking early messages frees the memory."""
    ep = Endpoint(1, 2, rails=2, segment_bytes=64, max_message_bytes=1024,
                  max_reassembly_bytes=250)

    def frame(seq, off=0, total=100):
        return F.encode(F.DATA, 0, 1, msg_id=seq, tag=3, seq=seq, total=total, offset=off,
                        payload=bytes(range(seq, seq + total))[off:off + 64])

    for off in (64, 0):  # out of order
        _land(ep, frame(0, off))()
    (e,) = ep.events()
    assert not e.posted and bytes(e.data) == bytes(range(100))  # kept for a later receive
    _land(ep, frame(1))()
    _land(ep, frame(1, 64))()
    assert len(ep.events()) == 1 and ep.reassembly_bytes == 200  # two early messages
    for late in (frame(3), frame(2)):  # 300: over half the budget (not due), over it (due)
        assert ep.data_target(0, F.decode_header(late[:F.HEADER_SIZE])) is None
        ep.receive(0, late, 0.0)
    assert ep.stats["dropped_full"] == 2
    assert ep.take_early(0, 3) == bytes(range(100))
    _land(ep, frame(2))()
    _land(ep, frame(2, 64))()
    got = [(e.msg_id, bytes(e.data)) for e in ep.events() if isinstance(e, MessageReceived)]
    assert got == [(2, bytes(range(2, 102)))]
    assert ep.stats["rejected"] == 0


def test_rails_fill_in_turn_then_the_least_loaded_takes_the_next_segment():
    from neuron_dist.transport.rdm.protocol import FILL_BYTES
    seg = 1 << 20
    a, b = make(2, rails=3, segment_bytes=seg, window_bytes=1 << 30, max_message_bytes=1 << 30)
    for _ in range(6):  # small traffic keeps to the first rail
        a.send(1, 0, b"x")
    assert [tx.rail for tx in a.poll_transmit(0.0)] == [0] * 6
    per_rail = -(-FILL_BYTES // (seg + F.HEADER_SIZE))  # segments until a rail is full
    a.send(1, 0, bytes((3 * per_rail + 4) * seg))
    rails = [tx.rail for tx in a.poll_transmit(0.0)]
    assert rails[:3 * per_rail] == [0] * per_rail + [1] * per_rail + [2] * per_rail
    # all full: the least loaded (rail 0 also carries the small ones, so it comes last)
    assert rails[3 * per_rail:] == [1, 2, 0, 1]
    a.rail_failed(1)  # its unacked segments move to the least loaded rail left, with a new one
    a.send(1, 0, b"w")
    moved = [tx.rail for tx in a.poll_transmit(0.0)]
    assert len(moved) == per_rail + 3 and set(moved) <= {0, 2}
    a.rail_failed(0)
    a.send(1, 0, b"v")
    assert {tx.rail for tx in a.poll_transmit(0.0)} == {2}


def test_a_restored_rail_takes_traffic_again_and_a_failed_peer_stays_failed():
    a, b = make(2, rails=2)
    a.rail_failed(0, peer=1)
    a.send(1, 0, b"x")
    assert [tx.rail for tx in a.poll_transmit(0.0)] == [1]
    a.rail_restored(0, 1)
    a.rail_restored(0, 1)  # (once is enough: counted once)
    assert a.stats["rails_restored"] == 1
    a.send(1, 0, b"y")
    assert [tx.rail for tx in a.poll_transmit(0.0)] == [0]  # the first live rail with room
    with pytest.raises(ValueError, match="no rail 2"):
        a.rail_restored(2, 1)
    a.rail_failed(0, peer=1)
    a.rail_failed(1, peer=1)  # none left: the peer fails
    assert any(isinstance(e, PeerFailed) for e in a.events())
    a.rail_restored(0, 1)
    with pytest.raises(ProtocolError, match="rank 1"):
        a.send(1, 0, b"z")


def test_acked_rail_takes_the_traffic_again():
    a, b = make(2, rails=2, segment_bytes=1 << 20, window_bytes=1 << 30,
                max_message_bytes=1 << 30)
    a.send(1, 0, bytes(12 << 20))  # fills rail 0, then rail 1
    first = [tx for tx in a.poll_transmit(0.0)]
    assert {tx.rail for tx in first} == {0, 1}
    for tx in first:  # everything arrives and is acked
        b.receive(tx.rail, tx.header + bytes(tx.payload), 0.0)
    for tx in b.poll_transmit(0.0):
        a.receive(tx.rail, tx.header + bytes(tx.payload) + bytes(tx.trailer), 0.0)
    a.send(1, 0, b"y")
    assert [tx.rail for tx in a.poll_transmit(0.0)] == [0]


def test_frames_carry_acks_behind_the_payload():
    frame = F.encode(F.DATA, 0, 1, total=3, payload=b"abc", acks=[(7, 0), (9, 512)])
    got = F.decode(frame)
    assert got.payload == b"abc" and got.acks == [(7, 0), (9, 512)]
    header = F.decode_header(frame[:F.HEADER_SIZE])
    assert header.nacks == 2 and header.trailer_bytes == 32
    good = F.encode(F.DATA, 0, 1, total=3, payload=b"abc", acks=[(7, 0)], crc=True)
    bad = bytearray(good)
    bad[-1] ^= 1  # a flipped bit in an ack entry
    with pytest.raises(F.FrameError, match="CRC"):
        F.decode(bytes(bad))
    with pytest.raises(ValueError, match="ACK none"):
        F.encode_header(F.ACK, 0, 1, payload=b"x" * 16, trailer=F.pack_acks([(1, 0)]))


def test_corrupted_frames_are_dropped_never_delivered():
    eps = make(2, crc=True)
    net = Net(eps, seed=4, corrupt=0.2, drop=0.05)
    sent, ids = send_traffic(eps, random.Random(4))
    net.run(all_delivered(net, sent, ids))
    check_delivery(net, sent, ids)
    rejected = net.of(0, FrameRejected) + net.of(1, FrameRejected)
    assert rejected and all(r.reason for r in rejected)


def test_zero_byte_and_odd_sized_messages():
    eps = make(2, segment_bytes=100)
    net = Net(eps, seed=5, drop=0.2, dup=0.2)
    sizes = [0, 0, 1, 99, 100, 101, 199, 200, 201, 1234, 0]
    rng = random.Random(5)
    sent = {(0, 1, 9): [payload(rng, n) for n in sizes]}
    ids = {(0, 1): {eps[0].send(1, 9, d) for d in sent[(0, 1, 9)]}}
    net.run(all_delivered(net, sent, ids))
    check_delivery(net, sent, ids)


@pytest.mark.parametrize("drop,rto", [(0.0, 1.0), (0.1, 0.05)])
def test_rail_dying_mid_transfer_loses_nothing(drop, rto):
    eps = make(2, rto=rto, max_rto=max(rto, 0.4), window_bytes=64 * 1024)
    net = Net(eps, seed=6, drop=drop)
    rng = random.Random(6)
    sent = {(0, 1, 0): [payload(rng, 20_000) for _ in range(4)]}
    ids = {(0, 1): {eps[0].send(1, 0, d) for d in sent[(0, 1, 0)]}}

    def kill(net):
        if net.now >= 0.01 and not net.dead:
            assert eps[0].inflight_bytes(1) > 0, "the rail must die mid-transfer"
            net.cut(0, 1, 0)  # the rail that carries it all (see FILL_BYTES)
            for ep in eps:  # both drivers see the connection reset
                ep.rail_failed(0, peer=1 - ep.rank)
    net.on_step.append(kill)
    net.run(all_delivered(net, sent, ids), max_time=30)
    check_delivery(net, sent, ids)
    assert net.dead and eps[0].stats["retransmits"] > 0
    if drop == 0:  # without loss, recovery came from rail_failed, not from the long RTO
        assert net.now < rto


def test_all_rails_dead_fails_the_peer_by_name():
    eps = make(2)
    net = Net(eps, seed=7)
    eps[0].send(1, 0, b"x" * 5000)
    for _ in range(3):
        net.step()
    for rail in range(3):
        net.cut(0, 1, rail)
        eps[0].rail_failed(rail, peer=1)
    failed = eps[0].events() + net.events[0]
    failed = [e for e in failed if isinstance(e, PeerFailed)]
    assert len(failed) == 1 and failed[0].peer == 1 and "rank 1" in failed[0].reason
    assert failed[0].msg_ids == (0,)
    with pytest.raises(ProtocolError, match="rank 1"):
        eps[0].send(1, 0, b"more")
    net.step()  # a failed peer is left alone
    assert eps[0].poll_transmit(net.now + 100) == []


def test_silent_peer_fails_after_max_retries():
    ep = Endpoint(0, 3, rails=2, segment_bytes=64, max_message_bytes=1024, rto=0.1,
                  backoff=2.0, max_rto=0.5, max_retries=4)
    ep.send(2, 0, b"hello")
    now, frames = 0.0, 0
    while not ep.events():
        frames += len(ep.poll_transmit(now))
        now += 0.01
        assert now < 10
    assert frames == 5  # the first send and 4 retransmissions, on alternating rails
    assert 0.1 + 0.2 + 0.4 + 0.5 <= now <= 0.1 + 0.2 + 0.4 + 0.5 + 0.5 + 0.05


def test_window_bounds_inflight_bytes():
    eps = make(2, window_bytes=2000, segment_bytes=500, rails=2)
    net = Net(eps, seed=8, drop=0.1)
    rng = random.Random(8)
    sent = {(0, 1, 0): [payload(rng, 10_000) for _ in range(3)]}
    ids = {(0, 1): {eps[0].send(1, 0, d) for d in sent[(0, 1, 0)]}}
    net.run(all_delivered(net, sent, ids))
    check_delivery(net, sent, ids)
    assert 0 < net.max_inflight[0] <= 2000


def test_reassembly_memory_is_bounded():
    """Messages stuck behind an incomplete earlier one stop being accepted at the limit;
    the application takes what was delivered, which frees memory for the rest."""
    eps = make(2, rails=1, segment_bytes=100, max_reassembly_bytes=1000, window_bytes=1 << 20)
    rng = random.Random(9)
    sent = {(0, 1, 0): [payload(rng, 300) for _ in range(20)]}
    ids = {(0, 1): {eps[0].send(1, 0, d) for d in sent[(0, 1, 0)]}}
    net = Net(eps, seed=9)
    hold = {"on": True}
    real_put = net._put
    taken = []

    def put(src, tx):  # withhold the first message's first segment for a while
        frame = F.decode(tx.data)
        if hold["on"] and frame.type == F.DATA and frame.msg_id == 0 and frame.offset == 0:
            return
        real_put(src, tx)

    def consume(net):  # the application receives what arrived
        while (m := eps[1].take_early(0, 0)) is not None:
            taken.append(bytes(m))
    net._put = put
    net.on_step.append(consume)
    for _ in range(200):
        net.step()
    assert eps[1].stats["dropped_full"] > 0
    assert net.max_reassembly[1] <= 1000
    hold["on"] = False
    net.run(all_delivered(net, sent, ids))
    check_delivery(net, sent, ids)
    assert taken == sent[(0, 1, 0)]
    assert eps[1].reassembly_bytes == 0


# ---------------------------------------------------------------- posted receive buffers


def test_posted_buffers_receive_in_place_and_in_order():
    eps = make(2, segment_bytes=64)
    net = Net(eps, seed=10, drop=0.2, dup=0.1)
    rng = random.Random(10)
    msgs = [payload(rng, n) for n in (500, 70, 0, 300)]
    bufs = [bytearray(600) for _ in msgs[:2]]
    for b in bufs:  # two posted before anything arrives
        eps[1].post_recv(0, 3, b)
    for m in msgs:
        eps[0].send(1, 3, m)
    net.run(lambda: len(net.of(1, MessageReceived)) == 4)
    late = bytearray(400)
    assert eps[1].post_recv(0, 3, late) == msgs[2]  # early messages first, oldest first
    assert eps[1].post_recv(0, 3, late) == msgs[3]
    assert isinstance(eps[1].post_recv(0, 3, late), int)  # then it binds to the next one
    got = net.of(1, MessageReceived)
    assert [bytes(e.data) for e in got] == msgs
    assert [e.posted for e in got] == [True, True, False, False]
    assert got[0].data.obj is bufs[0] and bytes(bufs[0][:500]) == msgs[0]
    assert bytes(bufs[1][:70]) == msgs[1]
    eps[0].send(1, 3, b"late one")
    net.run(lambda: len(net.of(1, MessageReceived)) == 5)
    assert net.of(1, MessageReceived)[-1].posted and bytes(late[:8]) == b"late one"


def test_buffer_posted_after_arrival_gets_a_copy_and_small_buffer_is_refused():
    eps = make(2, rails=1, segment_bytes=64)
    net = Net(eps, seed=11)
    hold = {"on": True}
    real_put = net._put

    def put(src, tx):  # message 0 is held back so message 1 waits, unexpected, in reassembly
        frame = F.decode(tx.data)
        if hold["on"] and frame.type == F.DATA and frame.msg_id == 0:
            return
        real_put(src, tx)
    net._put = put
    eps[0].send(1, 1, b"a" * 100)
    eps[0].send(1, 1, b"b" * 200)
    for _ in range(20):
        net.step()
    assert eps[1].reassembly_bytes == 200
    small, big = bytearray(10), bytearray(300)
    eps[1].post_recv(0, 1, small)  # for message 0: too small
    eps[1].post_recv(0, 1, big)    # for message 1: already reassembled privately
    hold["on"] = False
    net.run(lambda: len(net.of(1, MessageReceived)) == 2)
    first, second = net.of(1, MessageReceived)
    assert not first.posted and bytes(first.data) == b"a" * 100 and small == bytearray(10)
    assert second.posted and bytes(big[:200]) == b"b" * 200
    assert eps[1].reassembly_bytes == 0


def test_tags_do_not_block_each_other():
    eps = make(2, rails=1)
    net = Net(eps, seed=12)
    real_put = net._put

    def put(src, tx):  # tag 1's message never gets through
        frame = F.decode(tx.data)
        if frame.type == F.DATA and frame.tag == 1:
            return
        real_put(src, tx)
    net._put = put
    eps[0].send(1, 1, b"stuck")
    eps[0].send(1, 2, b"free")
    net.run(lambda: net.of(1, MessageReceived), max_time=1)
    assert [(e.tag, bytes(e.data)) for e in net.of(1, MessageReceived)] == [(2, b"free")]


# ---------------------------------------------------------------- garbage handling


def data_frame(**kw):
    args = dict(msg_id=0, tag=1, seq=0, total=10, offset=0, payload=b"0123456789")
    args.update(kw)
    return F.encode(F.DATA, 0, 1, **args)


def patch(buf, offset, fmt, value):
    """``buf`` with one header field overwritten (bypassing ``encode``'s own checks)."""
    b = bytearray(buf)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


@pytest.mark.parametrize("buf,needle", [
    (b"", "truncated"),
    (data_frame()[:63], "truncated"),
    (b"XX" + data_frame()[2:], "magic"),
    (data_frame()[:2] + b"\x09" + data_frame()[3:], "version"),
    (data_frame()[:3] + b"\x07" + data_frame()[4:], "type"),
    (data_frame()[:4] + b"\x80" + data_frame()[5:], "flags"),
    (data_frame()[:-1], "length"),
    (data_frame() + b"!", "length"),
    (patch(data_frame(), 40, "!Q", 5), "exceeds"),  # total smaller than offset + length
    (data_frame(total=1 << 30), "maximum"),
    (F.encode(F.DATA, 0, 7, total=1, payload=b"x"), "rank out of range"),
    (patch(data_frame(), 24, "!q", -5), "negative tag"),
    (patch(data_frame(), 6, "!H", 1), "1 acks"),  # says one ack entry follows: none does
    (patch(data_frame() + bytes(16 * 257), 6, "!H", 257), "at most 256"),
    (patch(F.encode_ack(0, 1, [(1, 0)]) + bytes(16), 6, "!H", 1), "ACK frame with 1"),
    (F.encode(F.DATA, 0, 1, total=9, offset=4), "empty segment"),
    (F.encode(F.ACK, 0, 1, payload=b"x" * 15), "ACK"),
    (data_frame()[:-1] + b"!", None),  # no CRC: a payload byte change is not detectable here
])
def test_decoder_rejects_malformed_frames(buf, needle):
    if needle is None:
        assert F.decode(buf, world_size=2, max_message_bytes=1 << 20).payload == b"012345678!"
        return
    with pytest.raises(F.FrameError, match=needle):
        F.decode(buf, world_size=2, max_message_bytes=1 << 20)


def test_crc_catches_a_flipped_byte_and_can_be_required():
    good = F.encode(F.DATA, 0, 1, total=4, payload=b"abcd", crc=True)
    assert F.decode(good, require_crc=True).payload == b"abcd"
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x10
        with pytest.raises(F.FrameError):
            F.decode(bytes(bad), require_crc=True)
    with pytest.raises(F.FrameError, match="requires"):
        F.decode(F.encode(F.DATA, 0, 1, total=1, payload=b"a"), require_crc=True)


def test_endpoint_rejects_garbage_and_conflicting_segments():
    ep = Endpoint(1, 2, rails=2, segment_bytes=8, max_message_bytes=64)
    ep.receive(0, b"garbage", 0.0)
    ep.receive(1, F.encode(F.DATA, 0, 0, total=1, payload=b"x"), 0.0)  # addressed to rank 0
    ep.receive(0, F.encode(F.DATA, 0, 1, msg_id=0, total=16, payload=b"abcdefgh"), 0.0)
    ep.receive(0, F.encode(F.DATA, 0, 1, msg_id=0, total=16, offset=4, payload=b"xxxxxxxx"), 0.0)
    ep.receive(0, F.encode(F.DATA, 0, 1, msg_id=0, total=17, offset=8, payload=b"ijklmnop"), 0.0)
    ep.receive(0, F.encode(F.DATA, 0, 1, msg_id=5000, total=1, payload=b"x"), 0.0)
    events = ep.events()
    assert len(events) == 5 and all(isinstance(e, FrameRejected) for e in events)
    assert [e.rail for e in events] == [0, 1, 0, 0, 0]
    ep.receive(0, F.encode(F.DATA, 0, 1, msg_id=0, total=16, offset=8, payload=b"ijklmnop"), 0.0)
    (got,) = ep.events()
    assert bytes(got.data) == b"abcdefghijklmnop"
    acks = [F.decode(t.data).acks for t in ep.poll_transmit(0.0)]
    assert sorted(a for batch in acks for a in batch) == [(0, 0), (0, 8)]


def test_send_rejects_bad_arguments():
    ep = Endpoint(0, 2, rails=1, segment_bytes=8, max_message_bytes=16)
    with pytest.raises(ValueError):
        ep.send(1, 0, b"x" * 17)
    with pytest.raises(ValueError):
        ep.send(0, 0, b"to myself")
    with pytest.raises(ValueError):
        ep.send(2, 0, b"nobody")
    with pytest.raises(ValueError):
        ep.send(1, -1, b"bad tag")


# ---------------------------------------------------------------- fuzzing the decoder

# Keep hypothesis' scratch files (constants cache, failure patches) out of the repository.
set_hypothesis_home_dir(f"{tempfile.gettempdir()}/neuron-dist-hypothesis")
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def consistent(frame, buf):
    """A decoded frame is consistent: within limits, and it encodes back to the same bytes."""
    assert frame.type in F.FRAME_TYPES and frame.src < 4 and frame.dst < 4 and frame.tag >= 0
    assert frame.offset + len(frame.payload) <= frame.total <= 4096
    again = F.encode(frame.type, frame.src, frame.dst, msg_id=frame.msg_id, tag=frame.tag,
                     seq=frame.seq, total=frame.total, offset=frame.offset, payload=frame.payload,
                     rail=frame.rail, crc=bool(frame.flags & F.FLAG_CRC))
    assert again == bytes(buf)


def decode_or_frame_error(buf):
    try:
        frame = F.decode(buf, world_size=4, max_message_bytes=4096)
    except F.FrameError:
        return
    consistent(frame, buf)


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(buf):
    decode_or_frame_error(buf)
    decode_or_frame_error(F.MAGIC + bytes([F.VERSION]) + buf)


def _data(src, dst, msg_id, tag, seq, offset, body, extra, rail, crc):
    if not body:  # an empty segment is only valid as a whole 0-byte message
        offset = extra = 0
    return F.encode(F.DATA, src, dst, msg_id=msg_id, tag=tag, seq=seq,
                    total=offset + len(body) + extra, offset=offset, payload=body, rail=rail, crc=crc)


valid_frames = st.one_of(
    st.builds(_data,
        st.integers(0, 3), st.integers(0, 3), st.integers(0, 2**64 - 1), st.integers(0, 2**63 - 1),
        st.integers(0, 2**64 - 1), st.integers(0, 2000), st.binary(max_size=100),
        st.integers(0, 1000), st.integers(0, 255), st.booleans()),
    st.builds(lambda src, dst, entries, crc: F.encode_ack(src, dst, entries, crc=crc),
              st.integers(0, 3), st.integers(0, 3),
              st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
                       min_size=1, max_size=20), st.booleans()),
    st.builds(lambda src, dst, ids, total, expected, crc: F.encode_refuse(
                  src, dst, *ids, total, expected % total, crc=crc),
              st.integers(0, 3), st.integers(0, 3),
              st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**63 - 1),
                        st.integers(0, 2**64 - 1)),
              st.integers(1, 3000), st.integers(0, 3000), st.booleans()))


@FUZZ
@given(valid_frames, st.lists(st.tuples(st.integers(0, 300), st.integers(0, 255)), max_size=4),
       st.one_of(st.none(), st.integers(0, 300)), st.binary(max_size=8))
def test_fuzz_mutated_valid_frames(buf, flips, cut, tail):
    decode_or_frame_error(buf)
    mutated = bytearray(buf)
    for pos, value in flips:
        if mutated:
            mutated[pos % len(mutated)] = value
    if cut is not None:
        mutated = mutated[:cut]
    decode_or_frame_error(bytes(mutated))
    decode_or_frame_error(bytes(mutated) + tail)


@settings(FUZZ, max_examples=150)
@given(st.lists(st.one_of(valid_frames, st.binary(max_size=120)), max_size=20))
def test_fuzz_endpoint_never_raises_on_wire_input(bufs):
    ep = Endpoint(1, 4, rails=2, segment_bytes=64, max_message_bytes=4096,
                  max_reassembly_bytes=8192)
    for i, buf in enumerate(bufs):
        ep.receive(i % 2, buf, float(i))
        ep.poll_transmit(float(i))
    for e in ep.events():
        assert isinstance(e, (FrameRejected, MessageReceived))
    assert 0 <= ep.reassembly_bytes <= 8192 + 4096 * 4


def test_tiny_unexpected_messages_are_charged_to_the_peers_memory_budget():
    """Finding: only a message's bytes counted against the budget, so 0-byte messages on
    new tags (a stream and an early entry each) grew memory without bound. Now at most
    ``max_held_messages`` are held per peer; the rest are dropped before anything is built
    for them (the sender resends once receives take the held ones)."""
    ep = Endpoint(1, 2, rails=1, segment_bytes=64, max_message_bytes=1024,
                  max_reassembly_bytes=1 << 20, max_held_messages=10)
    for i in range(50):  # each due next on a new tag, as a flood would send them
        f = F.encode(F.DATA, 0, 1, msg_id=i, tag=1000 + i, seq=0, total=0, payload=b"")
        if not _whole(ep, f):
            ep.receive(0, f, 0.0)
    held = [e for e in ep.events() if isinstance(e, MessageReceived)]
    assert len(held) == 10 and ep.stats["dropped_full"] == 40
    assert len(ep._peers[0].streams) == 10  # nothing built for the dropped ones
    for e in held:  # taking them frees the room
        assert ep.take_early(0, e.tag) == bytearray()
    f = F.encode(F.DATA, 0, 1, msg_id=10, tag=1010, seq=0, total=0, payload=b"")
    ep.receive(0, f, 0.0)
    assert [e.tag for e in ep.events() if isinstance(e, MessageReceived)] == [1010]
    # a message that is not due next may fill only half the count (like the bytes)
    ep = Endpoint(1, 2, rails=1, segment_bytes=64, max_message_bytes=1024,
                  max_reassembly_bytes=1 << 20, max_held_messages=10)
    for i in range(20):
        f = F.encode(F.DATA, 0, 1, msg_id=i, tag=7, seq=i + 1, total=1, payload=b"x")
        ep.receive(0, f, 0.0)  # position 0 of tag 7 never comes: all wait behind it
    assert ep._peers[0].held_messages == 5 and ep.stats["dropped_full"] == 15


# ---------------------------------------------------------------- refusal (issue 53, item 7)


def _refusal_net(kind, eps):
    if kind == "stream":
        return StreamNet(eps, seed=21, stall=(0.0, 0.01), whole=0.5)
    if kind == "lossy":
        return Net(eps, seed=22, drop=0.3, dup=0.2)
    return Net(eps, seed=23)


@pytest.mark.parametrize("kind", ["clean", "lossy", "stream"])
def test_an_oversized_message_is_refused_at_once_on_both_sides_and_the_stream_goes_on(kind):
    """Finding 7: a message larger than both its posted receive and the receiver's
    ``max_reassembly_bytes`` was dropped unacked: the receive never completed and the
    sender resent it until it declared the peer failed. Now the receiver refuses it on its
    first frame (MessageRefused, the buffer untouched), the sender learns it within a round
    trip (SendRefused, never SendCompleted), and the next message of the same (peer, tag)
    lands in the next receive, in both directions."""
    a, b = make(2, rails=2, segment_bytes=256, max_reassembly_bytes=1000, rto=1.0,
                max_rto=2.0, window_bytes=1 << 20)
    net = _refusal_net(kind, [a, b])
    small, after = bytearray(100), bytearray(50)
    b.post_recv(0, 3, small)
    b.post_recv(0, 3, after)
    tiny, back = bytearray(10), bytearray(4)
    a.post_recv(1, 4, tiny)
    a.post_recv(1, 4, back)
    big = a.send(1, 3, bytes(range(250)) * 20)  # 5000 bytes: 20 segments
    nxt = a.send(1, 3, b"n" * 50)
    big_back = b.send(0, 4, b"\x07" * 3000)
    nxt_back = b.send(0, 4, b"back")

    def refused_both_ways():
        return net.of(0, SendRefused) and net.of(1, SendRefused) and \
            net.of(0, MessageRefused) and net.of(1, MessageRefused)
    net.run(refused_both_ways, max_time=30)
    if kind != "lossy":  # within a round trip, long before any resend
        assert net.now < 0.1 and a.stats["retransmits"] == b.stats["retransmits"] == 0
    net.run(lambda: len(net.of(1, MessageReceived)) == len(net.of(0, MessageReceived)) == 1
            and len(net.of(0, SendCompleted)) == len(net.of(1, SendCompleted)) == 1, 30)
    for _ in range(300):  # late copies and resends of the refused messages come and go
        net.step()
    assert net.of(1, MessageRefused) == [MessageRefused(0, 3, big, 5000, 100)]
    assert net.of(0, SendRefused) == [SendRefused(1, big, 3, 5000, 100)]
    assert net.of(0, MessageRefused) == [MessageRefused(1, 4, big_back, 3000, 10)]
    assert net.of(1, SendRefused) == [SendRefused(0, big_back, 4, 3000, 10)]
    assert [e.msg_id for e in net.of(0, SendCompleted)] == [nxt]
    assert [e.msg_id for e in net.of(1, SendCompleted)] == [nxt_back]
    (got,) = net.of(1, MessageReceived)
    assert got.posted and got.tag == 3 and got.data.obj is after
    (got,) = net.of(0, MessageReceived)
    assert got.posted and got.tag == 4 and got.data.obj is back
    # (StreamNet overwrites a buffer once its receive completed, and keeps what came)
    landed = sorted(net.results) if kind == "stream" else sorted([bytes(after), bytes(back)])
    assert landed == [b"back", b"n" * 50]
    assert small == bytearray(100) and tiny == bytearray(10)  # no refused byte landed
    assert a.inflight_bytes(1) == b.inflight_bytes(0) == 0 and not a.mid_transfer()
    assert a.reassembly_bytes == b.reassembly_bytes == 0
    assert a.stats["rejected"] == b.stats["rejected"] == 0
    assert not net.of(0, PeerFailed) and not net.of(1, PeerFailed)
    assert b.stats["refused"] == a.stats["refused"] == 1


def test_a_message_that_came_before_its_too_small_receive_is_refused_when_it_is_posted():
    """The first frames of an oversized message arrive before any receive is posted: they
    are dropped (held back, as before). The receive posted later is too small: the message
    is refused at once, in post_recv, not at the sender's next resend. A receive large
    enough, posted for the next such message, takes it (it is not refused)."""
    a, b = make(2, rails=1, segment_bytes=256, max_reassembly_bytes=1000, rto=1.0,
                max_rto=2.0, window_bytes=1 << 20)
    net = Net([a, b], seed=24)
    first = a.send(1, 3, b"\x01" * 3000)
    second = a.send(1, 3, b"\x02" * 2000)
    for _ in range(40):  # 0.08 s: everything arrived once, nothing is resent yet
        net.step()
    assert b.stats["dropped_full"] > 0 and not net.events[1] and a.stats["retransmits"] == 0
    small = bytearray(10)
    b.post_recv(0, 3, small)
    assert b.events() == [MessageRefused(0, 3, first, 3000, 10)]
    posted_at = net.now
    net.run(lambda: net.of(0, SendRefused), max_time=posted_at + 0.1)
    assert net.of(0, SendRefused) == [SendRefused(1, first, 3, 3000, 10)]
    assert a.stats["retransmits"] == 0 and small == bytearray(10)
    large = bytearray(2000)
    b.post_recv(0, 3, large)
    assert b.events() == []  # it fits: it lands there when it is resent
    net.run(lambda: net.of(0, SendCompleted), max_time=10)
    assert bytes(large) == b"\x02" * 2000 and [e.msg_id for e in net.of(0, SendCompleted)] \
        == [second]
    assert b.stats["refused"] == 1 and b.stats["rejected"] == 0


def test_refusals_that_do_not_fit_what_was_sent_are_garbage_and_late_ones_are_ignored():
    """A REFUSE naming a message never sent, or other than the one sent, or one of which a
    segment was acknowledged, is rejected (FrameRejected); one for a message finished
    already (a late copy) changes nothing; the decoder rejects malformed ones. A refused
    message's later frames are answered with the refusal again, never acknowledged."""
    for bad in (F.encode(F.REFUSE, 0, 1, msg_id=0, tag=1, total=10, offset=10),  # buffer >= message
                F.encode(F.REFUSE, 0, 1, msg_id=0, tag=1, total=10, offset=0, payload=b"x"),
                F.encode_refuse(0, 1, 0, 1, 0, 10, 2) + b"!"):
        with pytest.raises(F.FrameError):
            F.decode(bad, world_size=2, max_message_bytes=1 << 20)
    with pytest.raises(ValueError):
        F.encode_refuse(0, 1, 0, 1, 0, 10, 10)
    a = Endpoint(0, 2, rails=1, segment_bytes=8, max_message_bytes=1 << 20)
    done = a.send(1, 1, b"done")
    a.poll_transmit(0.0)
    a.receive(0, F.encode_ack(1, 0, [(done, 0)]), 0.0)
    assert a.events() == [SendCompleted(1, done)]
    multi = a.send(1, 1, b"x" * 20)  # 3 segments
    open_ = a.send(1, 2, b"y" * 30)
    a.poll_transmit(0.0)
    a.receive(0, F.encode_ack(1, 0, [(multi, 8)]), 0.0)  # one segment acknowledged
    for frame in (F.encode_refuse(1, 0, 99, 2, 0, 30, 5),  # never sent
                  F.encode_refuse(1, 0, open_, 5, 0, 30, 5),  # another tag
                  F.encode_refuse(1, 0, open_, 2, 1, 30, 5),  # another position
                  F.encode_refuse(1, 0, open_, 2, 0, 31, 5),  # another size
                  F.encode_refuse(1, 0, multi, 1, 1, 20, 5)):  # partly acknowledged
        a.receive(0, frame, 0.0)
    events = a.events()
    assert len(events) == 5 and all(isinstance(e, FrameRejected) for e in events), events
    a.receive(0, F.encode_refuse(1, 0, done, 1, 0, 4, 1), 0.0)  # finished: ignored
    assert a.events() == [] and a.inflight_bytes(1) > 0
    a.receive(0, F.encode_refuse(1, 0, open_, 2, 0, 30, 5), 0.0)
    a.receive(0, F.encode_refuse(1, 0, open_, 2, 0, 30, 5), 0.0)  # a copy: ignored
    assert a.events() == [SendRefused(1, open_, 2, 30, 5)]
    later = [F.decode(tx.data) for tx in a.poll_transmit(100.0)]  # long after any deadline
    assert later and all(f.msg_id != open_ for f in later)  # never resent
    # the receiving end: a refused message's resends get the refusal, never an ack
    b = Endpoint(1, 2, rails=2, segment_bytes=8, max_message_bytes=1 << 20,
                 max_reassembly_bytes=16)
    b.post_recv(0, 2, bytearray(5))
    seg = F.encode(F.DATA, 0, 1, msg_id=0, tag=2, seq=0, total=30, offset=8, payload=b"y" * 8)
    b.receive(1, seg, 0.0)
    assert b.events() == [MessageRefused(0, 2, 0, 30, 5)]
    for rail in (0, 1, 1):
        b.receive(rail, seg, 0.0)
    out = [(tx.rail, F.decode(tx.data)) for tx in b.poll_transmit(0.0)]
    assert [(rail, f.type, f.msg_id, f.offset) for rail, f in out] == [(1, F.REFUSE, 0, 5)]
    assert b.events() == [] and b.stats["rejected"] == 0
