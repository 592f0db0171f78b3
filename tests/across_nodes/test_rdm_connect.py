"""Rails opened on first use: only between ranks that talk, one set per pair however the
first messages cross, and a prompt error naming the peer when they cannot be opened.

Real TCP rails on loopback between transports of one process (which share the process's
listener, as the groups of a rank do).
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from neuron_dist.transport.errors import PeerAborted, PeerUnreachable
from across_nodes.test_rdm_driver import KEY, _pair
from neuron_dist.transport.rdm.driver import RdmTransport

pytestmark = pytest.mark.timeout(60)


def _closing(ts):
    for t in ts:
        t.close()


def _open_sockets(t) -> list:
    return [r.sock for rails in t._rails.values() for r in rails if r is not None and r.alive]


def _on_threads(ts, fn) -> list:
    """Run ``fn(t)`` for every transport at once, each on a thread; the errors raised."""
    errors = []

    def run(t):
        try:
            fn(t)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=run, args=(t,)) for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return errors


def _consistent(a, b, rails):
    """Rails between ``a`` and ``b``: ``rails`` of them at each end, rail i being one and the
    same connection at both ends."""
    end = time.monotonic() + 10
    while not (b.rank in a._up and a.rank in b._up):
        assert time.monotonic() < end, "rails not up at both ends"
        time.sleep(0.001)
    mine, theirs = a._rails[b.rank], b._rails[a.rank]
    assert len(mine) == len(theirs) == rails
    for i in range(rails):
        assert mine[i].alive and theirs[i].alive, i
        assert mine[i].sock.getsockname() == theirs[i].sock.getpeername(), i
    assert not a.opening._links and not b.opening._links and not a.opening._reserved and not b.opening._reserved


def _first_message_then_traffic_both_ways(ts):
    """Rank 1 gets rank 0's first message (tag 1, ten 1s), then 1 MiB goes from 0 to 1 and
    100 bytes come back, all intact."""
    src = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    first = np.zeros(10, np.uint8)
    ts[1].irecv(0, 1, first).wait(time.monotonic() + 10)
    r = ts[1].irecv(0, 2, dst)
    ts[0].isend(1, 2, src).wait(time.monotonic() + 10)
    r.wait(time.monotonic() + 10)
    assert (first == 1).all() and np.array_equal(src, dst)
    back = np.zeros(100, np.uint8)
    r = ts[0].irecv(1, 3, back)
    ts[1].isend(0, 3, np.full(100, 3, np.uint8))
    r.wait(time.monotonic() + 10)
    assert (back == 3).all()


def test_rails_open_on_the_first_send_and_only_to_that_peer():
    ts = _pair(world=3, open_rails=False)
    try:
        assert not any(_open_sockets(t) for t in ts)
        buf = np.zeros(1000, np.uint8)
        r = ts[2].irecv(0, 1, buf)
        time.sleep(0.05)
        assert not any(_open_sockets(t) for t in ts)  # a receive opens nothing
        ts[0].isend(2, 1, np.full(1000, 5, np.uint8))
        r.wait(time.monotonic() + 10)
        assert (buf == 5).all()
        _consistent(ts[0], ts[2], 3)
        assert not _open_sockets(ts[1]) and list(ts[0]._rails) == [2]
    finally:
        _closing(ts)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_send_to_each_other_at_once_share_one_set_of_rails(world):
    """Every rank sends to every other at the same moment, so dials cross: the pairs still
    end with one set of rails each, and every message arrives intact."""
    for trial in range(10 if world == 2 else 4):
        ts = _pair(world=world, rails=3, open_rails=False)
        try:
            go = threading.Barrier(world)

            def run(t):
                go.wait()
                sends = [t.isend(p, 3, np.full(70_000, t.rank, np.uint8))
                         for p in range(world) if p != t.rank]
                for p in range(world):
                    if p != t.rank:
                        got = np.zeros(70_000, np.uint8)
                        t.irecv(p, 3, got).wait(time.monotonic() + 20)
                        assert (got == p).all(), (t.rank, p)
                for s in sends:
                    s.wait(time.monotonic() + 20)
            errors = _on_threads(ts, run)
            assert not errors, (trial, errors)
            for a in ts:
                for b in ts[a.rank + 1:]:
                    _consistent(a, b, 3)
        finally:
            _closing(ts)


def test_threads_of_one_rank_sending_first_open_the_rails_once():
    ts = _pair(open_rails=False)
    try:
        go = threading.Barrier(4)
        got = [np.zeros(10, np.uint8) for _ in range(4)]
        rs = [ts[1].irecv(0, 10 + k, got[k]) for k in range(4)]

        def send(k):
            go.wait()
            ts[0].isend(1, 10 + k, np.full(10, k, np.uint8))
        threads = [threading.Thread(target=send, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20)
        for k, r in enumerate(rs):
            r.wait(time.monotonic() + 10)
            assert (got[k] == k).all()
        _consistent(ts[0], ts[1], 3)
    finally:
        _closing(ts)


def test_a_peer_whose_group_is_gone_fails_the_first_send_promptly_by_name():
    ts = _pair(open_rails=False)
    ts[1].close()  # (the process's listener stays: it refuses the closed group)
    try:
        start = time.monotonic()
        with pytest.raises(PeerUnreachable, match="rank 1"):
            ts[0].isend(1, 1, np.zeros(10, np.uint8))
        assert time.monotonic() - start < 5
        with pytest.raises(PeerUnreachable, match="rank 1"):  # and stays failed
            ts[0].isend(1, 1, np.zeros(10, np.uint8))
    finally:
        _closing(ts)


def test_a_peer_whose_listener_is_gone_fails_the_first_send_promptly_by_name():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{s.getsockname()[1]}"
    t = RdmTransport(0, 2, host="127.0.0.1", rails=2, key=KEY, group=b"lonely")
    try:
        t.connect({0: t.address, 1: gone}, time.monotonic() + 60)
        start = time.monotonic()
        # the address and the port, and the firewall as a likely cause, not only the peer
        with pytest.raises(PeerUnreachable, match=f"connection refused at {gone}, where rank 1 "
                                                  f"listens: .*firewall rejects that port"):
            t.isend(1, 1, np.zeros(10, np.uint8))
        assert time.monotonic() - start < 10
    finally:
        t.close()


def test_an_abort_reaches_a_peer_this_rank_never_talked_to():
    ts = _pair(open_rails=False)
    try:
        r = ts[1].irecv(0, 1, np.zeros(10, np.uint8))
        # (the default grace gives the rails a quarter second to open: a loaded machine
        # may take longer, and the peer would then hear nothing)
        ts[0].abort("rank 0 gave up", grace=5.0)
        with pytest.raises(PeerAborted, match="rank 0 gave up"):
            r.wait(time.monotonic() + 10)
    finally:
        _closing(ts)


def test_a_withdrawn_receive_is_told_to_a_peer_that_opens_its_rails_later():
    """Rank 1 gives up a receive from rank 0 before they ever talked: rank 0 learns it when
    it opens its rails to send (its later sends fail naming why), and nothing lands."""
    from neuron_dist.transport.errors import PeerTimeout
    ts = _pair(open_rails=False)
    try:
        buf = np.zeros(100, np.uint8)
        req = ts[1].irecv(0, 7, buf)
        assert ts[1].cancel(req, PeerTimeout([0], 0.01, "rank 0 did not send it in time"))
        try:
            ts[0].isend(1, 7, np.full(100, 7, np.uint8))
        except PeerAborted:
            pass
        end = time.monotonic() + 10
        while 1 not in ts[0].failed:
            assert time.monotonic() < end
            time.sleep(0.002)
        with pytest.raises(PeerAborted, match="withdrew a request"):
            ts[0].isend(1, 7, np.ones(3, np.uint8))
        assert not buf.any()
    finally:
        _closing(ts)


def test_a_crossing_dial_that_comes_in_after_the_rails_are_up_is_told_to_wait():
    """Both ranks send first; rank 0's dial reaches rank 1's listener only after rank 1's
    own rails are all up (a slow handshake thread). It must be answered "crossed" (wait for
    the rails you already accepted), not refused: a refusal would fail the pair."""
    ts = _pair(open_rails=False)
    try:
        real = ts[1].opening.may_dial

        def late(rank, rail):
            if rank == 0:
                time.sleep(0.3)
            return real(rank, rail)
        ts[1].opening.may_dial = late
        go = threading.Barrier(2)

        def run(t):
            go.wait()
            if t.rank == 1:
                time.sleep(0.02)  # (rank 0 dials first, so its dial is the late one)
            t.isend(1 - t.rank, 1, np.full(10, t.rank, np.uint8))
            got = np.zeros(10, np.uint8)
            t.irecv(1 - t.rank, 1, got).wait(time.monotonic() + 20)
            assert (got == 1 - t.rank).all()
        errors = _on_threads(ts, run)
        assert not errors, errors
        _consistent(ts[0], ts[1], 3)
    finally:
        _closing(ts)


def test_a_rail_that_breaks_before_the_acceptor_took_the_last_one_costs_only_that_rail():
    """Fault: the dialer holds the rails up once its last dial is answered, and sends; the
    acceptor takes that rail from its listener thread a moment later. A rail that broke in
    between failed the pair at the acceptor ("broke while the rails were being opened"),
    where a moment later it would have cost one rail (seen in the CRC test, under load)."""
    ts = _pair(open_rails=False)
    release = threading.Event()
    try:
        real = ts[1].opening.accepted

        def late(sock, peer, index, session=b""):
            if index == 2:
                release.wait(10)
            return real(sock, peer, index, session)
        ts[1].opening.accepted = late
        ts[0].isend(1, 1, np.full(10, 1, np.uint8))  # rank 0 dials: its rails are up
        end = time.monotonic() + 10
        while None in ts[1]._rails.get(0, [None])[:2]:  # (its threads may finish in any order)
            assert time.monotonic() < end, "rank 1 did not take rails 0 and 1"
            time.sleep(0.002)
        assert 0 not in ts[1]._up and (0, 2) in ts[1].opening._reserved
        ts[0]._rails[1][0].sock.shutdown(socket.SHUT_RDWR)
        while ts[1]._rails[0][0].alive:  # rank 1 sees rail 0 break
            assert time.monotonic() < end, "rank 1 did not see rail 0 break"
            time.sleep(0.002)
        release.set()
        _first_message_then_traffic_both_ways(ts)
        assert 0 in ts[1]._up
        assert not ts[1]._rails[0][0].alive and ts[1]._rails[0][2].alive
    finally:
        release.set()
        _closing(ts)


def test_a_rail_that_breaks_before_the_dialer_took_the_last_one_costs_only_that_rail():
    """Fault (seen once in CI, the rail-cut all_reduce test): the acceptor holds the rails
    up once it has taken the last one, and sends; the dialer takes that rail a moment
    after its handshake was answered. A rail that broke in between failed the pair at
    the dialer ("broke while the rails were being opened"), where a moment later it would
    have cost one rail."""
    ts = _pair(open_rails=False)
    release, taking_last = threading.Event(), threading.Event()
    last = ts[0].nrails - 1
    try:
        real = ts[0].opening.add_rail

        def late(conn, peer, index, dialer):
            if index == last:
                taking_last.set()
                release.wait(10)
            return real(conn, peer, index, dialer)
        ts[0].opening.add_rail = late
        errors = []

        def first_send():
            try:
                ts[0].isend(1, 1, np.full(10, 1, np.uint8))  # rank 0 dials every rail
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        sender = threading.Thread(target=first_send)
        sender.start()
        end = time.monotonic() + 10
        while not (taking_last.is_set() and 0 in ts[1]._up):  # the acceptor holds them up
            assert time.monotonic() < end, "rank 1 did not take every rail"
            time.sleep(0.002)
        assert 1 not in ts[0]._up
        ts[1]._rails[0][0].sock.shutdown(socket.SHUT_RDWR)
        while ts[0]._rails[1][0].alive:  # rank 0 sees rail 0 break while still dialing
            assert time.monotonic() < end, "rank 0 did not see rail 0 break"
            time.sleep(0.002)
        release.set()
        sender.join(10)
        assert not errors, errors
        _first_message_then_traffic_both_ways(ts)
        assert 1 in ts[0]._up
        assert not ts[0]._rails[1][0].alive and ts[0]._rails[1][last].alive
    finally:
        release.set()
        _closing(ts)


def test_a_trickling_acceptor_cannot_hold_a_dial_past_its_deadline():
    """Finding: the dialer's handshake had no overall deadline (each read had the socket's
    timeout), so an acceptor sending a byte now and then held it for minutes."""
    from neuron_dist.transport.rdm import handshake

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    stop = threading.Event()

    def trickle():
        conn, _ = server.accept()
        with conn:
            for byte in handshake.MAGIC + bytes(64):
                if stop.wait(0.2):
                    return
                conn.sendall(bytes([byte]))

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    sock = socket.create_connection(server.getsockname(), timeout=5.0)
    start = time.monotonic()
    try:
        with pytest.raises(handshake.HandshakeError, match="not finished in time"):
            handshake.dial(sock, KEY, b"group", 0, 0, 1, deadline=start + 1.0)
        assert time.monotonic() - start < 2.0
    finally:
        stop.set()
        sock.close()
        t.join(5)
        server.close()


def test_the_accept_loop_survives_a_thread_it_cannot_start(monkeypatch):
    """Finding: the accept loop did not guard ``Thread.start()``: a ``RuntimeError`` at the
    process's thread limit ended it while its socket stayed open, and every later dial
    stalled into a timeout. That connection is dropped; the next is served."""
    from neuron_dist.transport.rdm import handshake, listener as L

    real = threading.Thread
    failed = []

    class AtTheLimit(real):
        def start(self):
            if self.name == "neuron-rdm-handshake" and not failed:
                failed.append(self)
                raise RuntimeError("can't start new thread")
            return super().start()

    monkeypatch.setattr(L.threading, "Thread", AtTheLimit)
    lis = L.Listener("127.0.0.1", lambda gid, rank: None)
    try:
        host, port = lis.address.rsplit(":", 1)
        first = socket.create_connection((host, int(port)), timeout=5)
        assert first.recv(4) == b""  # dropped
        first.close()
        second = socket.create_connection((host, int(port)), timeout=5)
        assert second.recv(4) == handshake.MAGIC  # the loop is alive: its hello comes
        second.close()
        assert failed
    finally:
        lis.close()


def test_a_closed_listener_leaves_no_handshake_thread_behind():
    """Found by the soak (bench/soak.py): a group destroyed while a stranger's connection
    waited in its handshake left that thread and socket alive after the close, until the
    handshake's 10 s deadline. The close now ends them and waits for their threads."""
    from neuron_dist.transport.rdm import listener as L

    lis = L.Listener("127.0.0.1", lambda gid, rank: None)
    host, port = lis.address.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
    try:
        def handshaking():
            return [t for t in threading.enumerate() if t.name == "neuron-rdm-handshake"]

        end = time.monotonic() + 5
        while len(handshaking()) < 3:  # (each idle stranger waits in its own handshake)
            assert time.monotonic() < end
            time.sleep(0.01)
        started = time.monotonic()
        lis.close()
        assert time.monotonic() - started < 2.0
        assert not handshaking() and not lis._handshakes
    finally:
        for sock in idle:
            sock.close()


def test_a_dropped_handshake_is_dialed_again_and_a_refused_one_fails_at_once(monkeypatch):
    """Finding 2: a dial whose connection the listener dropped before answering (it sheds
    unfinished handshakes under a flood) failed the peer (PeerUnreachable); only a refused
    connection was retried. Now it is dialed again, with a growing pause. A refusal (a
    wrong key: the listener answers NO) still fails at once, naming why."""
    from neuron_dist.transport.rdm import driver as D, handshake
    real, calls = handshake.dial, []

    def dropping(sock, *args, **kwargs):  # the first two dials are dropped by the listener
        calls.append(time.monotonic())
        if len(calls) <= 2:
            sock.shutdown(socket.SHUT_RDWR)
        return real(sock, *args, **kwargs)
    monkeypatch.setattr(D.handshake, "dial", dropping)
    ts = _pair(rails=2, open_rails=False)
    try:
        got = np.zeros(10, np.uint8)
        r = ts[1].irecv(0, 1, got)
        ts[0].isend(1, 1, np.full(10, 1, np.uint8))
        r.wait(time.monotonic() + 10)
        assert (got == 1).all() and len(calls) == 4  # two dropped, then one per rail
        _consistent(ts[0], ts[1], 2)
    finally:
        _closing(ts)
    monkeypatch.setattr(D.handshake, "dial", real)
    wrong = RdmTransport(0, 2, host="127.0.0.1", rails=2, key=b"another key" * 3,
                         group=b"test-group")
    right = RdmTransport(1, 2, host="127.0.0.1", rails=2, key=KEY, group=b"test-group")
    try:
        addrs = {0: wrong.address, 1: right.address}
        for t in (wrong, right):
            t.connect(addrs, time.monotonic() + 60)
        start = time.monotonic()
        with pytest.raises(PeerUnreachable, match="refused the handshake: authentication "
                                                  "failed"):
            wrong.isend(1, 1, np.zeros(10, np.uint8))
        assert time.monotonic() - start < 2
    finally:
        _closing([wrong, right])


def test_a_dial_whose_handshakes_are_always_dropped_ends_at_its_deadline():
    """A listener that drops every connection before answering: the dialer dials again
    until its connect deadline, then fails with PeerTimeout saying so, not later."""
    from neuron_dist.transport.errors import PeerTimeout
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    accepted = []

    def drop_all():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(1)
            conn.close()
    th = threading.Thread(target=drop_all)
    th.start()
    t = RdmTransport(0, 2, host="127.0.0.1", rails=1, key=KEY, group=b"dropped")
    try:
        port = server.getsockname()[1]
        t.connect({0: t.address, 1: f"127.0.0.1:{port}"}, time.monotonic() + 1.5)
        start = time.monotonic()
        with pytest.raises(PeerTimeout, match="the handshake was dropped"):
            t.isend(1, 1, np.zeros(10, np.uint8))
        assert 1.0 < time.monotonic() - start < 3.0 and len(accepted) >= 3
    finally:
        t.close()
        stop.set()
        th.join(5)
        server.close()
