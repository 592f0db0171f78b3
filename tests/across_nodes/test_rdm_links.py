"""Rails shared by the groups of two processes (transport/rdm/links.py).

Every transport here lives in this one process, as the ranks of several groups would live
in two: the first group to talk opens the link, later groups join it in band.
"""

import logging
import os
import socket
import threading
import time

import numpy as np
import pytest

from neuron_dist.transport.errors import PeerAborted, PeerTimeout, PeerUnreachable
from neuron_dist.transport.rdm import frames as F
from neuron_dist.transport.rdm import handshake, links, progress
from neuron_dist.transport.rdm.driver import RdmTransport

pytestmark = pytest.mark.timeout(60)
KEY = os.urandom(32)


def _group(name: bytes, rails=3, key=KEY, **kw):
    """Ranks 0 and 1 of group ``name``, addresses known, no rail open yet."""
    ts = [RdmTransport(r, 2, host="127.0.0.1", rails=rails, key=key, group=name, rto=0.5, **kw)
          for r in range(2)]
    addrs = {r: t.address for r, t in enumerate(ts)}
    for t in ts:
        t.connect(addrs, time.monotonic() + 10)
    return ts


def _until(cond, seconds=10.0):
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.002)


def _exchange(ts, n, tag=1, seed=0):
    """Rank 0 and rank 1 send each other ``n`` bytes at once; both arrive intact."""
    rng = np.random.default_rng(seed)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(2)]
    got = [np.zeros(n, np.uint8) for _ in range(2)]
    recvs = [ts[r].irecv(1 - r, tag, got[r]) for r in range(2)]
    sends = [ts[r].isend(1 - r, tag, data[r]) for r in range(2)]
    for req in recvs + sends:
        req.wait(time.monotonic() + 30)
    for r in range(2):
        assert np.array_equal(got[r], data[1 - r])


def _sockets():
    """The rail sockets the process's engine holds (both ends: they are all here)."""
    return len(progress._ENGINE._handlers) if progress._ENGINE else 0


def _close(*groups):
    for ts in groups:
        for t in ts:
            t.close()


def test_a_second_group_joins_the_rails_of_the_first():
    g1, g2 = _group(b"first"), _group(b"second")
    try:
        _exchange(g1, 1000)
        assert _sockets() == 2 * 3
        _exchange(g2, 1000)
        assert _sockets() == 2 * 3  # no connection of its own
        ends = {id(g1[0].opening.link_of[1]), id(g1[1].opening.link_of[0])}
        assert {id(g2[0].opening.link_of[1]), id(g2[1].opening.link_of[0])} == ends  # one end each
        # both groups at once, large and small messages, both ways: every byte where it belongs
        threads = [threading.Thread(target=_exchange, args=(g, n, tag, seed))
                   for seed, (g, n, tag) in enumerate([(g1, 6 << 20, 1), (g2, 6 << 20, 1),
                                                       (g1, 333, 2), (g2, 100_001, 2)])]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not any(th.is_alive() for th in threads)
        for _ in range(20):
            _exchange(g2, 64, tag=3)
            _exchange(g1, 64, tag=3)
    finally:
        _close(g1, g2)
    assert _sockets() == 0


def test_the_group_that_opened_the_link_can_close_and_the_others_go_on():
    g1, g2, g3 = _group(b"opener"), _group(b"joiner"), _group(b"third")
    try:
        _exchange(g1, 1000)
        _exchange(g2, 1000)
        _exchange(g3, 1000)
        assert _sockets() == 2 * 3
        _close(g1)
        _exchange(g2, 3 << 20)
        _exchange(g3, 5000)
        assert _sockets() == 2 * 3
        _close(g2)
        _exchange(g3, 3 << 20)
    finally:
        _close(g1, g2, g3)
    assert _sockets() == 0  # the last group closed the connections


@pytest.mark.parametrize("how", ["close", "abort"])
def test_a_group_that_closes_on_one_side_fails_its_peer_there_and_nothing_else(how):
    """Its peer's requests fail as when a connection closes (or with the abort's reason);
    the other group, on the same rails, does not notice."""
    g1, g2 = _group(b"stays"), _group(b"goes")
    try:
        _exchange(g1, 1000)
        _exchange(g2, 1000)
        waiting = g2[1].irecv(0, 9, np.zeros(10, np.uint8))
        if how == "close":
            g2[0].close()
            error, match = PeerUnreachable, "rank 0"
        else:
            g2[0].abort("rank 0 gave up")
            error, match = PeerAborted, "rank 0 gave up"
        with pytest.raises(error, match=match):
            waiting.wait(time.monotonic() + 10)
        with pytest.raises(error):
            g2[1].isend(0, 9, np.zeros(10, np.uint8))
        _exchange(g1, 2 << 20)
        assert _sockets() == 2 * 3
    finally:
        _close(g1, g2)


def test_a_rail_that_breaks_is_lost_to_every_group_and_no_byte_is_lost():
    g1, g2 = _group(b"one"), _group(b"two")
    try:
        _exchange(g1, 1000)
        _exchange(g2, 1000)
        link = g1[0].opening.link_of[1]
        link.rails[1].sock.shutdown(socket.SHUT_RDWR)
        _until(lambda: not g1[1].opening.link_of[0].rails[1].alive)
        for g in (g1, g2):
            _exchange(g, 4 << 20, seed=3)
        assert g1[0].opening.link_of[1] is link and g2[0].opening.link_of[1] in (link, g1[1].opening.link_of[0])
    finally:
        _close(g1, g2)


def test_a_rail_that_breaks_heals_for_every_group_on_the_link():
    g1, g2 = _group(b"one"), _group(b"two")
    try:
        _exchange(g1, 1000)
        _exchange(g2, 1000)
        link = g1[0].opening.link_of[1]
        assert _sockets() == 2 * 3
        link.rails[2].sock.shutdown(socket.SHUT_RDWR)
        _until(lambda: all(t.stats().get("rails_restored", 0) == 1 for t in g1 + g2))
        _until(lambda: all(r.alive for r in link.rails) and all(
            r.alive for r in g1[1].opening.link_of[0].rails))
        assert _sockets() == 2 * 3  # (the broken connection is gone, its successor in place)
        for g in (g1, g2):
            assert g[0].ep._peers[1].rails == g[1].ep._peers[0].rails == [True] * 3
            _exchange(g, 4 << 20, seed=5)
        # whole again, the link is offered to groups that come later
        g3 = _group(b"three")
        try:
            _exchange(g3, 1000)
            assert g3[0].opening.link_of[1] in (link, g1[1].opening.link_of[0]) and _sockets() == 2 * 3
        finally:
            _close(g3)
    finally:
        _close(g1, g2)


def test_a_join_with_a_wrong_proof_is_ignored(caplog):
    caplog.set_level(logging.ERROR, logger="neuron_dist.rdm")
    g1, g2 = _group(b"real"), _group(b"target")
    try:
        _exchange(g1, 1000)
        link = g1[0].opening.link_of[1]
        with g1[0].lock:
            for rail in link.rails:
                link.send_block(rail, links.JOIN, 0, 1, g2[1].context, os.urandom(32))
        _until(lambda: "ignored a JOIN" in caplog.text)
        with g2[1].lock:
            assert 0 not in g2[1].opening._links and 0 not in g2[1]._up
            assert all(c != g2[1].context for c, _ in g1[1].opening.link_of[0].members)
        _exchange(g2, 1000)  # the real rank 0 joins as usual
        _exchange(g1, 1000)
    finally:
        _close(g1, g2)


def test_frames_of_a_group_that_is_not_there_are_read_and_dropped():
    g1 = _group(b"here")
    try:
        _exchange(g1, 1000)
        link = g1[0].opening.link_of[1]
        stray = links.prefix_of(12345) + F.encode(F.DATA, 0, 1, tag=1,
                                                  payload=os.urandom(200_000))
        with g1[0].lock:
            for rail in link.rails:
                rail.out.append(memoryview(stray))
                link.flush(rail)
        for seed in range(3):  # the same rails and tags carry the group's own bytes intact
            _exchange(g1, 300_000, seed=seed)
        assert all(r.alive for r in link.rails)
    finally:
        _close(g1)


def test_a_join_whose_link_breaks_opens_rails_of_its_own(monkeypatch):
    g1, g2 = _group(b"breaks"), _group(b"redials")
    real = links.Link.send_block

    def no_joins(self, rail, kind, *args):
        if kind != links.JOIN:
            real(self, rail, kind, *args)
    try:
        _exchange(g1, 1000)
        link = g1[0].opening.link_of[1]
        monkeypatch.setattr(links.Link, "send_block", no_joins)
        got = np.zeros(100, np.uint8)
        r = g2[1].irecv(0, 1, got)
        sender = threading.Thread(target=lambda: g2[0].isend(1, 1, np.full(100, 7, np.uint8)))
        sender.start()
        _until(lambda: 1 in g2[0].opening._joins)  # joining, and never answered
        with g1[0].lock:
            link.rail_down(link.rails[0], "cut by the test")
        sender.join(10)
        r.wait(time.monotonic() + 10)
        assert (got == 7).all()
        assert g2[0].opening.link_of[1] is not link
        _until(lambda: _sockets() == 2 * 3 + 2 * 3 - 2)  # (the far end of the cut sees it)
    finally:
        _close(g1, g2)


def test_groups_whose_ranks_open_rails_at_once_agree_on_one_link():
    """Both ranks of a new group send first, at once, many times: whichever JOIN (or dial)
    wins, each rank ends on one end of the same connections and every message arrives."""
    g1 = _group(b"base")
    groups = []
    try:
        _exchange(g1, 1000)
        for i in range(15):
            g = _group(b"racer-%d" % i)
            groups.append(g)
            _exchange(g, 10_000 * (i + 1), seed=i)
            a, b = g[0].opening.link_of[1], g[1].opening.link_of[0]
            assert a is not b
            assert [r.sock.getsockname() for r in a.rails] == [r.sock.getpeername() for r in b.rails]
        assert _sockets() == 2 * 3
    finally:
        _close(g1, *groups)


def test_groups_with_another_key_or_rail_count_do_not_share():
    g1, g2, g3 = _group(b"k1"), _group(b"k2", rails=2), _group(b"k3", frame_mac=True)
    try:
        for g in (g1, g2, g3):
            _exchange(g, 1000)
        assert _sockets() == 2 * (3 + 2 + 3)
    finally:
        _close(g1, g2, g3)


def test_join_proofs_name_the_connection_the_ranks_and_the_group():
    s = os.urandom(32)
    p = handshake.join_proof(KEY, b"g", s, 0, 1, 2)
    assert p != handshake.join_proof(KEY, b"g", os.urandom(32), 0, 1, 2)
    assert p != handshake.join_proof(KEY, b"g", s, 1, 0, 2)
    assert p != handshake.join_proof(KEY, b"g", s, 0, 1, 1)
    assert p != handshake.join_proof(KEY, b"h", s, 0, 1, 2)
    assert p != handshake.join_proof(os.urandom(32), b"g", s, 0, 1, 2)


def test_joining_a_group_closed_at_the_peer_fails_at_once():
    g1, g2 = _group(b"open"), _group(b"gone")
    try:
        _exchange(g1, 1000)
        g2[1].close()
        start = time.monotonic()
        with pytest.raises(PeerUnreachable, match="closed or aborted this group"):
            g2[0].isend(1, 1, np.zeros(10, np.uint8))
        assert time.monotonic() - start < 5
        _exchange(g1, 1000)
    finally:
        _close(g1, g2)


def test_a_join_that_comes_before_the_peer_knows_its_group_waits_for_it():
    g1 = _group(b"known")
    ts = [RdmTransport(r, 2, host="127.0.0.1", rails=3, key=KEY, group=b"late", rto=0.5)
          for r in range(2)]
    try:
        _exchange(g1, 1000)
        addrs = {r: t.address for r, t in enumerate(ts)}
        ts[0].connect(addrs, time.monotonic() + 10)  # rank 1 has not called connect() yet
        sender = threading.Thread(target=lambda: ts[0].isend(1, 1, np.full(10, 3, np.uint8)))
        sender.start()
        _until(lambda: ts[1].opening._early_joins)
        ts[1].connect(addrs, time.monotonic() + 10)
        got = np.zeros(10, np.uint8)
        ts[1].irecv(0, 1, got).wait(time.monotonic() + 10)
        sender.join(10)
        assert (got == 3).all() and _sockets() == 2 * 3
    finally:
        _close(g1, ts)


def test_a_join_and_a_dial_that_cross_keep_the_higher_ranks_choice(monkeypatch):
    """As for two dials (handshake.py, CROSSED): the higher rank's way of opening is kept.
    A joining rank answers a lower rank's dial with CROSSED and gives up its join for a
    higher rank's dial; a dialing rank ignores a lower rank's JOIN and takes a higher
    rank's (its own dial will be answered CROSSED)."""
    g1, g2 = _group(b"linked"), _group(b"crossing")
    real = links.Link.send_block
    monkeypatch.setattr(links.Link, "send_block",  # (JOINs stay here: decided by hand below)
                        lambda self, rail, kind, *a: None if kind == links.JOIN else
                        real(self, rail, kind, *a))
    try:
        _exchange(g1, 1000)
        lo, hi = g2
        link_lo, link_hi = lo.opening._joinable(1), hi.opening._joinable(0)
        with hi.lock:
            hi.opening._start_join(0, link_hi)
            assert hi.opening.may_dial(0, 0) is handshake.CROSSED  # the lower rank's dial yields
            lo.opening._start_join(1, link_lo)
            assert lo.opening.may_dial(1, 0) is True  # the higher rank's dial wins over our join
            assert 1 not in lo.opening._joins and (lo.context, 0) not in link_lo.members
            lo.opening.release(1, 0)
            hi.opening._abandon_join(0)
            # a dialing rank and a JOIN: the lower one takes the higher one's JOIN ...
            lo.opening._links[1] = "dialing"
            rail = link_lo.rails[0]
            lo.opening.on_join(link_lo, rail, 1, handshake.join_proof(KEY, b"crossing", rail.session,
                                                              1, 0, 0))
            assert lo.opening._links[1] == "joining" and lo.opening._joins[1].heard == {0}
            lo.opening._abandon_join(1)
            # ... the higher one ignores the lower one's
            hi.opening._links[0] = "dialing"
            rail = link_hi.rails[0]
            hi.opening.on_join(link_hi, rail, 0, handshake.join_proof(KEY, b"crossing", rail.session,
                                                              0, 1, 0))
            assert hi.opening._links[0] == "dialing" and 0 not in hi.opening._joins
            del hi.opening._links[0]
        monkeypatch.undo()
        _exchange(g2, 1000)  # and the pair still opens its rails and talks
        _exchange(g1, 1000)
    finally:
        _close(g1, g2)


def test_a_join_nobody_answers_fails_like_a_stalled_handshake(monkeypatch):
    from neuron_dist.transport.rdm import opening
    monkeypatch.setattr(opening, "HANDSHAKE_TIMEOUT", 0.5)
    real = links.Link.send_block
    monkeypatch.setattr(links.Link, "send_block",  # (the peer never hears it: stalled)
                        lambda self, rail, kind, *a: None if kind == links.JOIN else
                        real(self, rail, kind, *a))
    g1, g2 = _group(b"alive"), _group(b"stalled")
    try:
        _exchange(g1, 1000)
        start = time.monotonic()
        with pytest.raises(PeerTimeout, match="did not answer rank 0's JOIN"):
            g2[0].isend(1, 1, np.zeros(10, np.uint8))
        assert time.monotonic() - start < 5
        monkeypatch.undo()
        _exchange(g1, 1000)  # the link and its first group are untouched
    finally:
        _close(g1, g2)


def test_a_send_that_fails_with_its_peer_leaves_nothing_queued_that_reads_its_buffer(
        monkeypatch):
    """Fault: the frames of a large send still queued on a rail kept views of the user's
    buffer after the send failed with its peer. Before the rails were shared, failing the
    peer closed them and dropped the queue; a shared link stays open for the other groups,
    and would have written those bytes from the user's tensor afterwards."""
    g1, g2 = _group(b"keeps"), _group(b"fails")
    real = links._send_some
    try:
        _exchange(g1, 1000)
        _exchange(g2, 1000)
        rails = g2[0].opening.link_of[1].rails  # (rank 0's end of the link g2 uses)
        held = {r.sock for r in rails}
        monkeypatch.setattr(links, "_send_some", lambda sock, views: (
            (_ for _ in ()).throw(BlockingIOError()) if sock in held else real(sock, views)))
        buf = np.full(4 << 20, 5, np.uint8)
        send = g2[0].isend(1, 7, buf)  # (too large to be copied: its frames are views)
        with g2[0].lock:
            assert any(v.obj is buf for r in rails for v in r.out)
        g2[1].abort("rank 1 gave up")  # (rank 1's own sockets still write: rank 0 hears it)
        with pytest.raises(PeerAborted, match="rank 1 gave up"):
            send.wait(time.monotonic() + 10)
        with g2[0].lock:
            assert all(r.alive for r in rails)  # (g1 still uses them)
            assert not any(v.obj is buf for r in rails for v in r.out)
        monkeypatch.setattr(links, "_send_some", real)
        _exchange(g1, 3 << 20)  # the link, and what it still had queued, go on
    finally:
        monkeypatch.setattr(links, "_send_some", real)
        _close(g1, g2)


def test_sends_failed_by_a_withdrawal_leave_nothing_queued_that_reads_their_buffers(
        monkeypatch):
    """Withdrawing a receive fails the peer, and with it every other pending request with
    that peer, while the rails stay open: a large send's frames queued on them must not
    read its buffer afterwards (nor may the protocol send more of it)."""
    g = _group(b"withdraws")
    real = links._send_some
    try:
        _exchange(g, 1000)
        rails = g[0].opening.link_of[1].rails
        held = {r.sock for r in rails}
        monkeypatch.setattr(links, "_send_some", lambda sock, views: (
            (_ for _ in ()).throw(BlockingIOError()) if sock in held else real(sock, views)))
        buf = np.full(4 << 20, 5, np.uint8)
        send = g[0].isend(1, 7, buf)
        pending = g[0].irecv(1, 8, np.zeros(10, np.uint8))
        with g[0].lock:
            assert any(v.obj is buf for r in rails for v in r.out)
        assert g[0].cancel(pending, PeerTimeout([1], 0, "gave up"))
        with pytest.raises(PeerTimeout, match="gave up"):
            send.wait(time.monotonic() + 10)
        with g[0].lock:
            assert all(r.alive for r in rails)
            assert not any(v.obj is buf for r in rails for v in r.out)
            assert not g[0].ep.mid_transfer()  # (nothing more of it to send)
    finally:
        monkeypatch.setattr(links, "_send_some", real)
        _close(g)
