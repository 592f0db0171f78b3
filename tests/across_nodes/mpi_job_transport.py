"""One rank of the MpiTransport check, run by tests/across_nodes/test_mpi_transport.py under
``mpiexec -n 3 python tests/across_nodes/mpi_job_transport.py [THREAD_LEVEL]``. Every rank
runs the same phases in order (MPI barriers between them); any failure raises, and the rank
exits non-zero (which ends the whole job). THREAD_LEVEL (mpi4py.rc.thread_level, default
"multiple"): "serialized" runs everything with one process-wide lock; "funneled" only
checks that a transport refuses to start.

Prints ``@@mpi-transport {json}`` from rank 0 at the end: thread level, timings.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import mpi4py
import numpy as np

MODE = sys.argv[1] if len(sys.argv) > 1 else "multiple"
mpi4py.rc.thread_level = MODE  # before MPI is initialised (by the import below)

from mpi4py import MPI  # noqa: E402

# The repository's transport package itself (not through neuron_dist, whose __init__
# imports torch): this also checks that the transport imports no torch.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transport.errors import (ABORTED_TIMEOUT, ChannelClosed, PeerAborted,  # noqa: E402
                              PeerTimeout, TransportError)
from transport.mpi import MpiTransport, mpi_lock, thread_level  # noqa: E402

import mpi_job_common as common  # noqa: E402

assert "torch" not in sys.modules, "the MPI transport imported torch"
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
assert SIZE == 3, SIZE
SIZES = [0, 1, 7, 4096, 65535, 1 << 20, (1 << 20) + 3, 8 << 20]
BIG_TAG = (1 << 32) + 5  # like send/recv's tags: beyond MPI_TAG_UB, so mapped
report: dict = {"thread_level": thread_level()}
# Our own MPI calls are made under this (one call at a time): at SERIALIZED, transports'
# progress threads may be inside MPI at any moment, and MPI must never be entered twice.
MPI_LOCK = mpi_lock()


def deadline(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


_BASE = np.random.default_rng(1234).integers(0, 256, SIZES[-1] + 4096, dtype=np.uint8)


def pattern(n: int, seed: int) -> np.ndarray:
    """``n`` pseudo-random bytes that depend on ``seed`` (a view: no time spent making it)."""
    start = (seed * 7919) % 4096
    return _BASE[start:start + n]


def wait_mpi(req) -> None:
    common.wait_mpi(req, MPI_LOCK)


def barrier() -> None:
    common.barrier(MPI_LOCK)


def phase(name: str) -> None:
    barrier()
    if RANK == 0:
        print(f"[mpi-transport] {name}", file=sys.stderr, flush=True)


def check_sizes(t: MpiTransport) -> None:
    """Every size 0..8 MiB to every peer, both directions at once, on two tags."""
    start = time.monotonic()
    sends, recvs = [], []
    for peer in range(SIZE):
        if peer == RANK:
            continue
        for tag in (3, BIG_TAG):
            for n in SIZES:
                src = pattern(n, RANK * 1000 + peer * 10 + n % 97 + tag % 5)
                sends.append((t.isend(peer, tag, src), src))
                dst = np.zeros(n, np.uint8)
                recvs.append((t.irecv(peer, tag, dst), dst,
                              pattern(n, peer * 1000 + RANK * 10 + n % 97 + tag % 5)))
    for req, _ in sends:
        req.wait(deadline())
    for req, dst, want in recvs:
        req.wait(deadline())
        assert req.test()
        assert np.array_equal(dst, want), f"wrong bytes from rank {req.peer} ({dst.size} B)"
    report.setdefault("sizes_seconds", time.monotonic() - start)


def check_order_and_early(t: MpiTransport) -> None:
    """Many messages per tag arrive in order; sent before the receives are posted."""
    n_msgs = 50
    if RANK == 0:
        for k in range(n_msgs):
            for tag in (7, BIG_TAG, BIG_TAG + 1):
                t.isend(1, tag, np.full(10 + k, k + tag % 3, np.uint8))
    barrier()  # everything was sent before rank 1 posts anything ("early" messages)
    if RANK == 1:
        time.sleep(0.2)
        got = {tag: [] for tag in (7, BIG_TAG, BIG_TAG + 1)}
        for tag in (BIG_TAG + 1, 7, BIG_TAG):  # other order than sent: tags are independent
            for k in range(n_msgs):
                buf = np.zeros(10 + k, np.uint8)
                t.irecv(0, tag, buf).wait(deadline())
                got[tag].append(buf)
        for tag, bufs in got.items():
            for k, buf in enumerate(bufs):
                assert (buf == k + tag % 3).all(), f"tag {tag}: message {k} out of order"
        assert t.stats()["notes_received"] >= 2
    barrier()


def check_mismatch(t: MpiTransport) -> None:
    """A receive of the wrong size fails with ValueError naming both sizes; the next one of
    the same (peer, tag) gets the next message."""
    if RANK == 2:
        for n in (100, 50, 9, 12):
            t.isend(0, 11, np.full(n, n, np.uint8)).wait(deadline())
    if RANK == 0:
        cases = [(64, "100", "64"), (64, "50", "64"), (None, None, None), (10, "12", "10")]
        for size, sent, expected in cases:
            size = 9 if size is None else size
            buf = np.zeros(size, np.uint8)
            req = t.irecv(2, 11, buf)
            if sent is None:
                req.wait(deadline())
                assert (buf == 9).all()
                continue
            try:
                req.wait(deadline())
            except ValueError as e:
                assert f"{sent} bytes" in str(e) and expected in str(e), e
                assert "rank 2" in str(e), e
            else:
                raise AssertionError("size mismatch was not reported")
        assert t.stats()["size_mismatches"] == 3
    barrier()


def check_timeout(t: MpiTransport) -> None:
    """A receive nobody sends to times out with PeerTimeout naming the peer; it stays
    posted, and completes when the message comes after all."""
    if RANK == 1:
        buf = np.zeros(16, np.uint8)
        req = t.irecv(2, 21, buf)
        start = time.monotonic()
        try:
            req.wait(time.monotonic() + 0.3)
        except PeerTimeout as e:
            waited = time.monotonic() - start
            assert e.ranks == [2] and e.network is True, (e.ranks, e)
            assert 0.25 < waited < 5.0, waited
        else:
            raise AssertionError("no timeout")
        assert not req.test()
        with MPI_LOCK:
            go = WORLD.Isend([b"go", MPI.BYTE], 2)
        wait_mpi(go)
        req.wait(deadline())
        assert (buf == 21).all()
    elif RANK == 2:
        box = bytearray(2)
        with MPI_LOCK:
            go = WORLD.Irecv([box, MPI.BYTE], 1)
        wait_mpi(go)
        assert box == b"go", box
        t.isend(1, 21, np.full(16, 21, np.uint8)).wait(deadline())
    barrier()


def check_collectives() -> None:
    """MPI's own collectives on a column (here every rank): each gives the right bytes;
    one a member starts late times out on the others naming the collective, stays MPI's,
    and completes once that member starts it."""
    t = MpiTransport(RANK, SIZE, list(range(SIZE)), label="columns", deadline=deadline(),
                     column=list(range(SIZE)))
    assert t.column == list(range(SIZE))
    assert t.reduces("float32", "SUM") and t.reduces("int64", "BXOR")
    assert not t.reduces("float32", "BAND") and not t.reduces("bfloat16", "SUM")
    n = 1000
    out = np.zeros(SIZE * n, np.uint8)
    t.iallgather(np.full(n, RANK + 1, np.uint8), out).wait(deadline())
    assert (out.reshape(SIZE, n) == np.arange(1, SIZE + 1, dtype=np.uint8)[:, None]).all()
    x = np.full(n, RANK + 1.5, np.float32)
    t.iallreduce(x, "float32", "SUM").wait(deadline())
    assert (x == sum(k + 1.5 for k in range(SIZE))).all(), x[:4]
    send = np.arange(SIZE * n, dtype=np.int64) * (RANK + 1)
    got = np.zeros(n, np.int64)
    t.ireduce_scatter(send, got, "int64", "SUM").wait(deadline())
    assert (got == np.arange(RANK * n, (RANK + 1) * n) * sum(range(1, SIZE + 1))).all()
    blocks = np.repeat(np.arange(SIZE, dtype=np.uint8) + 10 * RANK, n)
    got = np.zeros(SIZE * n, np.uint8)
    t.ialltoall(blocks, got).wait(deadline())
    assert (got.reshape(SIZE, n) == (RANK + 10 * np.arange(SIZE))[:, None]).all()
    b = np.full(n, RANK, np.uint8)
    t.ibcast(b, 1).wait(deadline())
    assert (b == 1).all()
    try:
        t.ibcast(b, SIZE)
    except ValueError as e:
        assert "root" in str(e), e
    else:
        raise AssertionError("a root outside the column was accepted")
    late = np.zeros(SIZE, np.uint8)
    if RANK != 2:
        req = t.iallgather(np.full(1, RANK, np.uint8), late)
        try:
            req.wait(time.monotonic() + 0.3)
        except PeerTimeout as e:
            assert "all_gather" in str(e) and "column" in str(e), e
        else:
            raise AssertionError("a collective a member had not started completed")
    barrier()
    if RANK == 2:
        req = t.iallgather(np.full(1, RANK, np.uint8), late)
    req.wait(deadline())  # (still MPI's after the timeout: it completes now)
    assert list(late) == list(range(SIZE)), late
    t.close()


def check_callbacks(t: MpiTransport) -> None:
    """Callbacks run off the caller's thread, may post new requests, see failures too."""
    if RANK in (0, 1):
        peer = 1 - RANK
        seen, done = [], threading.Event()
        out = np.full(1000, RANK + 1, np.uint8)
        second = np.zeros(10, np.uint8)

        def on_first(req):
            seen.append(("first", threading.current_thread().name, req.error))
            # posting from a callback must not deadlock (callbacks run outside the lock)
            t.irecv(peer, 32, second, callback=lambda r: (seen.append(("second", r.error)),
                                                          done.set()))

        buf = np.zeros(1000, np.uint8)
        t.irecv(peer, 31, buf, callback=on_first)
        t.isend(peer, 31, out).wait(deadline())
        t.isend(peer, 32, np.full(10, 9, np.uint8)).wait(deadline())
        assert done.wait(30), seen
        assert seen[0][0] == "first" and seen[0][2] is None, seen
        assert seen[0][1] != threading.current_thread().name
        assert seen[1] == ("second", None), seen
        assert (buf == peer + 1).all() and (second == 9).all()
    barrier()


def check_subgroup(world_t: MpiTransport) -> None:
    """A second transport over ranks [2, 0] (order swapped): ranks map, tags don't collide."""
    if RANK == 1:
        barrier()
        return
    members = [2, 0]
    me = members.index(RANK)
    sub = MpiTransport(me, 2, members, label="subgroup", deadline=deadline())
    try:
        sub.connect({1 - me: "unused"}, deadline())
        peer_world = members[1 - me]
        a, b = np.zeros(8, np.uint8), np.zeros(8, np.uint8)
        ra = sub.irecv(1 - me, 3, a)             # same tag on both transports
        rb = world_t.irecv(peer_world, 3, b)
        sub.isend(1 - me, 3, np.full(8, 100 + RANK, np.uint8)).wait(deadline())
        world_t.isend(peer_world, 3, np.full(8, 200 + RANK, np.uint8)).wait(deadline())
        ra.wait(deadline())
        rb.wait(deadline())
        assert (a == 100 + peer_world).all() and (b == 200 + peer_world).all(), (a, b)
    finally:
        sub.close()
    barrier()


def check_any_source(t: MpiTransport) -> None:
    """irecv_any: the source is reported; messages kept while nobody asked go out in
    arrival order; a receive naming the source goes first; large tags; timeout."""
    def three(v):
        return np.full(3, v, np.uint8)

    early = t.irecv_any(50, np.zeros(3, np.uint8)) if RANK == 0 else None
    barrier()  # posted before anything is sent
    if RANK == 2:
        t.isend(0, 50, three(2)).wait(deadline())
    if RANK == 0:
        early.wait(deadline())
        assert early.source == 2 and early.peer is None and early.buf.tolist() == [2, 2, 2]
    barrier()
    if RANK == 1:
        t.isend(0, 50, three(1)).wait(deadline())
    barrier()  # rank 1's message is in before rank 2 sends
    if RANK == 2:
        t.isend(0, 50, three(9)).wait(deadline())
    barrier()
    if RANK == 0:
        got = []
        for _ in range(2):
            r = t.irecv_any(50, np.zeros(3, np.uint8))
            r.wait(deadline())
            got.append((r.source, int(r.buf[0])))
        assert got == [(1, 1), (2, 9)], got
        anyone = t.irecv_any(51, np.zeros(3, np.uint8))
        named = t.irecv(2, 51, np.zeros(3, np.uint8))
    barrier()
    if RANK == 2:
        t.isend(0, 51, three(5)).wait(deadline())
    barrier()
    if RANK == 0:
        named.wait(deadline())  # the receive naming rank 2 took rank 2's message ...
        assert named.buf.tolist() == [5, 5, 5] and not anyone.test()
    barrier()
    if RANK == 1:
        t.isend(0, 51, three(6)).wait(deadline())
        t.isend(0, BIG_TAG + 7, three(7)).wait(deadline())
    if RANK == 0:
        anyone.wait(deadline())  # ... the one from any rank waited for the next
        assert anyone.source == 1 and anyone.buf.tolist() == [6, 6, 6]
        big = t.irecv_any(BIG_TAG + 7, np.zeros(3, np.uint8))
        big.wait(deadline())
        assert big.source == 1 and big.buf.tolist() == [7, 7, 7]
        lonely = t.irecv_any(52, np.zeros(3, np.uint8))
        try:
            lonely.wait(time.monotonic() + 0.2)
        except PeerTimeout as e:
            assert "any rank" in str(e) and e.ranks == [] and e.network, e
        else:
            raise AssertionError("a receive from any rank nobody sends to did not time out")
    barrier()
    if RANK == 2:
        t.isend(0, 52, three(8)).wait(deadline())  # for the timed-out receive, still posted
    if RANK == 0:
        lonely.wait(deadline())
        assert lonely.source == 2
    barrier()


def check_tag_conflict(t: MpiTransport) -> None:
    """Two large tags on one MPI tag: the sender refuses the second towards the same peer;
    a receiver fails a receive whose MPI tag the peer announced for another tag."""
    t1 = BIG_TAG + 100
    t2 = t1 + t.matcher.modulus
    assert t.matcher.mpi_tag(t1) == t.matcher.mpi_tag(t2)
    if RANK == 0:
        t.isend(1, t1, b"abc").wait(deadline())
        try:
            t.isend(1, t2, b"abc")
        except TransportError as e:
            assert str(t1) in str(e) and str(t2) in str(e), e
        else:
            raise AssertionError("two tags on one MPI tag towards one peer")
        t.isend(2, t1, b"xyz").wait(deadline())
    if RANK == 1:
        buf = bytearray(3)
        t.irecv(0, t1, buf).wait(deadline())
        assert buf == b"abc"
    if RANK == 2:
        wrong = t.irecv(0, t2, bytearray(3))
        try:
            wrong.wait(deadline())
        except TransportError as e:
            assert str(t1) in str(e) and str(t2) in str(e), e
        else:
            raise AssertionError("a receive took a message of another tag")
        buf = bytearray(3)
        t.irecv(0, t1, buf).wait(deadline())
        assert buf == b"xyz"
    barrier()


def check_abort() -> None:
    """abort() tells the peers: their requests to or from the aborting rank fail with
    PeerAborted (reason, kind, network=True), later posts too; others carry on."""
    t = MpiTransport(RANK, SIZE, list(range(SIZE)), label="aborting", deadline=deadline())
    t.connect(range(SIZE), deadline())
    pending = None
    if RANK in (1, 2):
        pending = t.irecv(0, 5, np.zeros(4, np.uint8))
        anyone = t.irecv_any(6, np.zeros(4, np.uint8))
    barrier()
    if RANK == 0:
        t.abort("rank 0 gave up", ABORTED_TIMEOUT)
        try:
            t.isend(1, 5, b"late")
        except ChannelClosed:
            pass
        else:
            raise AssertionError("isend after abort")
    else:
        try:
            pending.wait(deadline(10))
        except PeerAborted as e:
            assert e.rank == 0 and e.kind == ABORTED_TIMEOUT and e.network, e
            assert "rank 0 gave up" in str(e), e
        else:
            raise AssertionError("no PeerAborted")
        try:
            t.isend(0, 5, b"x")
        except PeerAborted:
            pass
        else:
            raise AssertionError("isend to an aborted rank")
        other = 3 - RANK  # the other peer can still send to the receive from any rank
        t.isend(other, 6, np.full(4, RANK, np.uint8)).wait(deadline())
        anyone.wait(deadline())
        assert anyone.source == other
        t.close()
    barrier()


def check_close() -> None:
    """close(error) fails pending receives (and their callbacks) with that error; closed
    transports refuse new requests; close() alone fails them with ChannelClosed."""
    t = MpiTransport(RANK, SIZE, list(range(SIZE)), label="closing", deadline=deadline())
    t.connect(range(SIZE), deadline())
    got = []
    pending = t.irecv((RANK + 1) % SIZE, 5, np.zeros(4, np.uint8), callback=got.append)
    big = t.irecv((RANK + 2) % SIZE, BIG_TAG, np.zeros(4, np.uint8))
    boom = RuntimeError("boom")
    t.close(boom)
    for req in (pending, big):
        try:
            req.wait(deadline(5))
        except RuntimeError as e:
            assert e is boom, e
        else:
            raise AssertionError("close did not fail the pending receive")
    time.sleep(0.05)
    assert got and got[0] is pending, got
    try:
        t.isend(0, 1, b"x")
    except ChannelClosed:
        pass
    else:
        raise AssertionError("isend on a closed transport")
    barrier()
    t2 = MpiTransport(RANK, SIZE, list(range(SIZE)), label="closing2")
    r = t2.irecv((RANK + 1) % SIZE, 5, bytearray(3))
    t2.close()
    try:
        r.wait(deadline(5))
    except ChannelClosed:
        pass
    else:
        raise AssertionError("close() did not fail the pending receive with ChannelClosed")
    barrier()


def check_creation_timeout(t: MpiTransport) -> None:
    """A group whose member comes too late: ranks 0 and 1 get a PeerTimeout naming rank 2 at
    their deadline, and their other transports go on working (at SERIALIZED every
    transport shares one lock with the creation: it must not be held by a call that waits
    for a member that is not there). Rank 2 then arrives: it finds they withdrew and fails
    at once, naming them, instead of waiting forever in MPI_Comm_create_group."""
    if RANK in (0, 1):
        start = time.monotonic()
        try:
            MpiTransport(RANK, SIZE, list(range(SIZE)), label="incomplete",
                         deadline=time.monotonic() + 1.0)
        except PeerTimeout as e:
            assert e.ranks == [2], e.ranks
            assert "group rank(s) [2] (MPI ranks [2]) did not join" in str(e), e
        else:
            raise AssertionError("a transport was created without rank 2")
        waited = time.monotonic() - start
        assert waited < 5, f"the creation took {waited:.1f} s to time out"
    barrier()
    if RANK == 2:
        start = time.monotonic()
        try:
            MpiTransport(RANK, SIZE, list(range(SIZE)), label="incomplete",
                         deadline=time.monotonic() + 20)
        except PeerTimeout as e:
            assert e.ranks == [0, 1], e.ranks
            assert "gave up waiting" in str(e), e
        else:
            raise AssertionError("a transport was created with ranks that had given up")
        waited = time.monotonic() - start
        assert waited < 5, f"the late rank took {waited:.1f} s to fail"
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = np.zeros(4, np.uint8)
    req = t.irecv(prv, 60, got)
    t.isend(nxt, 60, np.full(4, RANK, np.uint8)).wait(deadline(10))
    req.wait(deadline(10))
    assert (got == prv).all(), got
    if RANK in (0, 1):
        # Notes nobody will read (rank 2's arrival, the other's withdrawal): receive them,
        # as MPICH keeps its shared-memory file when a rank finalizes with unread messages.
        for source in (1 - RANK, 2):
            note = bytearray(9)
            with MPI_LOCK:
                req = WORLD.Irecv(note, source=source, tag=0x4E45)  # the driver's _ARRIVE_TAG
            wait_mpi(req)
            assert note.endswith(b"W" if source != 2 else b"A"), (source, note)
    barrier()


def timings(t: MpiTransport) -> None:
    """Ping-pong latency (8 B) and one-way bandwidth (8 MiB) between ranks 0 and 1."""
    if RANK in (0, 1):
        peer, iters = 1 - RANK, 300
        small, back = np.zeros(8, np.uint8), np.zeros(8, np.uint8)
        start = time.monotonic()
        for _ in range(iters):
            if RANK == 0:
                t.isend(peer, 40, small).wait(deadline())
                t.irecv(peer, 40, back).wait(deadline())
            else:
                t.irecv(peer, 40, back).wait(deadline())
                t.isend(peer, 40, small).wait(deadline())
        rtt = (time.monotonic() - start) / iters
        big = np.ones(8 << 20, np.uint8)
        reps = 10
        start = time.monotonic()
        for _ in range(reps):
            if RANK == 0:
                t.isend(peer, 41, big).wait(deadline())
            else:
                t.irecv(peer, 41, big).wait(deadline())
        ack = np.zeros(1, np.uint8)
        (t.irecv if RANK == 0 else t.isend)(peer, 42, ack).wait(deadline())
        seconds = time.monotonic() - start
        report.update(pingpong_rtt_us=round(rtt * 1e6, 1),
                      bandwidth_MBps=round(reps * big.nbytes / seconds / 1e6, 1))
    barrier()


def main() -> None:
    t0 = time.monotonic()
    report["mode"] = MODE
    if MODE in ("single", "funneled"):
        try:
            MpiTransport(RANK, SIZE, list(range(SIZE)))
        except RuntimeError as e:
            assert "THREAD_MULTIPLE" in str(e), e
        else:
            raise AssertionError(f"a transport started at thread level {MODE}")
        barrier()
        if RANK == 0:
            print("@@mpi-transport " + json.dumps(report), flush=True)
        return
    t = MpiTransport(RANK, SIZE, list(range(SIZE)), label="world", deadline=deadline())
    t.connect({k: "" for k in range(SIZE)}, deadline())
    assert t.address.startswith(f"mpi:{RANK}@")
    for name, fn in [("sizes", check_sizes), ("order+early", check_order_and_early),
                     ("mismatch", check_mismatch), ("timeout", check_timeout),
                     ("callbacks", check_callbacks), ("subgroup", check_subgroup),
                     ("any-source", check_any_source), ("tag-conflict", check_tag_conflict),
                     ("timings", timings)]:
        phase(name)
        fn(t)
    phase("collectives")
    check_collectives()
    phase("close")
    check_close()
    phase("abort")
    check_abort()
    phase("creation-timeout")
    check_creation_timeout(t)
    stats = t.stats()
    t.close()
    assert stats["pending_requests"] == 0 and stats["posted_receives"] == 0, stats
    alive = [th.name for th in threading.enumerate() if th.name.startswith("neuron-mpi")]
    assert not alive, alive
    report["seconds"] = round(time.monotonic() - t0, 2)
    barrier()
    if RANK == 0:
        print("@@mpi-transport " + json.dumps(report), flush=True)


if __name__ == "__main__":
    common.run(main)
