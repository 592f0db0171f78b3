"""The contract of a between-nodes transport (``transport/base.py``: ``NetTransport``),
as SPMD cases that every rank of a 3-rank group runs with its own transport.

The same cases run against the rdm transport (three transports in threads of one
process: test_net_contract.py) and the MPI transport (three MPI ranks under mpiexec:
mpi_job_contract.py). ``sync()`` is an out-of-band barrier of the three ranks. Each case
raises AssertionError on a broken promise.
"""

from __future__ import annotations

import time

import numpy as np

from neuron_dist.transport.errors import (MessageSizeMismatch, PeerAborted, PeerTimeout,
                                          TransportError)

WORLD = 3


def _deadline(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def _pattern(n: int, seed: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


def case_order_per_tag_and_early_messages(t, rank, sync):
    """Messages of one (peer, tag) arrive in send order, whatever the sizes, and messages
    sent before their receive is posted are kept until it is."""
    sizes = [0, 1, 100, 70_000, 3 << 20, 5]
    if rank == 0:  # (a large send may complete only once matched, as MPI's rendezvous)
        sends = [t.isend(1, 7, _pattern(n, i)) for i, n in enumerate(sizes)]
        time.sleep(0.2)
    sync()  # everything was sent before rank 1 posts anything
    if rank == 1:
        for i, n in enumerate(sizes):
            buf = np.zeros(n, np.uint8)
            t.irecv(0, 7, buf).wait(_deadline())
            assert np.array_equal(buf, _pattern(n, i)), (i, n)
    if rank == 0:
        for s in sends:
            s.wait(_deadline())
    sync()


def case_tags_do_not_block_each_other(t, rank, sync):
    """A message of tag 2 completes while a receive of tag 1 still waits."""
    if rank == 2:
        t.isend(0, 2, np.full(10, 2, np.uint8)).wait(_deadline())
    if rank == 0:
        r1 = t.irecv(2, 1, np.zeros(10, np.uint8))
        b2 = np.zeros(10, np.uint8)
        t.irecv(2, 2, b2).wait(_deadline())
        assert b2.tolist() == [2] * 10 and not r1.test()
    sync()
    if rank == 2:
        t.isend(0, 1, np.full(10, 1, np.uint8)).wait(_deadline())
    if rank == 0:
        r1.wait(_deadline())
    sync()


def case_size_mismatch_is_typed_and_consumes_the_message(t, rank, sync):
    if rank == 1:
        t.isend(2, 4, _pattern(40, 9)).wait(_deadline())
        t.isend(2, 4, _pattern(8, 3)).wait(_deadline())
    if rank == 2:
        try:
            t.irecv(1, 4, np.zeros(30, np.uint8)).wait(_deadline())
        except MessageSizeMismatch as e:
            assert isinstance(e, ValueError) and (e.sent, e.expected) == (40, 30), e
            assert bytes(e.message)[:8] == _pattern(40, 9).tobytes()[:8]
        else:
            raise AssertionError("a receive of another size did not fail")
        nxt = np.zeros(8, np.uint8)
        t.irecv(1, 4, nxt).wait(_deadline())  # the next message goes to the next receive
        assert np.array_equal(nxt, _pattern(8, 3))
    sync()


def case_any_source(t, rank, sync):
    """A receive from any rank takes a message from whichever rank sends, and says which."""
    if rank in (1, 2):
        t.isend(0, 11, np.full(4, rank, np.uint8)).wait(_deadline())
    if rank == 0:
        got = set()
        for _ in range(2):
            buf = np.zeros(4, np.uint8)
            r = t.irecv_any(11, buf)
            r.wait(_deadline())
            assert buf.tolist() == [r.source] * 4, (buf, r.source)
            got.add(r.source)
        assert got == {1, 2}
    sync()


def case_a_receive_naming_the_source_goes_first(t, rank, sync):
    """Both receives wait: a message goes to the receive naming its source, though one from
    any rank was posted before it (transport/matching.py); the next message, which no
    named receive waits for, goes to the receive from any rank."""
    if rank == 1:
        anyone, named = np.zeros(4, np.uint8), np.zeros(4, np.uint8)
        r_any = t.irecv_any(12, anyone)
        r_named = t.irecv(0, 12, named)
    sync()  # both are posted before anything is sent
    if rank == 0:
        t.isend(1, 12, np.full(4, 1, np.uint8)).wait(_deadline())
        t.isend(1, 12, np.full(4, 2, np.uint8)).wait(_deadline())
    if rank == 1:
        r_named.wait(_deadline())
        r_any.wait(_deadline())
        assert named.tolist() == [1] * 4 and anyone.tolist() == [2] * 4, (named, anyone)
        assert r_any.source == 0
    sync()


def case_callbacks_run_once_off_the_lock(t, rank, sync):
    """A completion callback runs once, may post new requests, for a request that
    completes while nobody waits on it."""
    if rank == 1:
        done = []
        buf = np.zeros(6, np.uint8)

        def again(req):  # posts a new request from inside a callback
            done.append(req.source)
            t.isend(0, 13, np.full(1, 9, np.uint8))
        t.irecv(0, 12, buf, callback=again)
    sync()
    if rank == 0:
        t.isend(1, 12, np.full(6, 5, np.uint8)).wait(_deadline())
        echo = np.zeros(1, np.uint8)
        t.irecv(1, 13, echo).wait(_deadline())
        assert echo.tolist() == [9]
    if rank == 1:
        end = _deadline(10)
        while not done and time.monotonic() < end:
            time.sleep(0.001)
        assert done == [0] and buf.tolist() == [5] * 6, (done, buf)
    sync()


def case_timeout_names_the_peer_and_the_request_stays_posted(t, rank, sync):
    """``wait`` past its deadline raises PeerTimeout naming the peer; the request is still
    posted (and completes when its message comes)."""
    if rank == 2:
        buf = np.zeros(3, np.uint8)
        r = t.irecv(1, 14, buf)
        try:
            r.wait(time.monotonic() + 0.05)
        except PeerTimeout as e:
            assert e.ranks == [1] and "rank 1" in str(e), e
        else:
            raise AssertionError("no timeout")
    sync()
    if rank == 1:
        t.isend(2, 14, np.full(3, 4, np.uint8)).wait(_deadline())
    if rank == 2:
        r.wait(_deadline())
        assert buf.tolist() == [4] * 3
    sync()


def case_cancel_gives_the_buffer_back_and_fails_the_pair(t, rank, sync):
    """A withdrawn receive gets no byte of a message that comes later; later traffic
    between the two ranks fails by name on both sides (the peer is told); a third rank
    is not affected."""
    if rank == 0:
        buf = np.zeros(1000, np.uint8)
        r = t.irecv(1, 15, buf)
        error = PeerTimeout([1], 0.0, "rank 1 did not send it in time")
        assert t.cancel(r, error) and not t.cancel(r, error)
        try:
            r.wait(_deadline())
        except PeerTimeout:
            pass
        else:
            raise AssertionError("a withdrawn receive completed")
    sync()
    if rank == 1:
        try:
            t.isend(0, 15, np.full(1000, 7, np.uint8))
        except TransportError:
            pass  # told already
        end = _deadline(10)
        while time.monotonic() < end:  # told: its traffic with rank 0 now fails by name
            try:
                t.isend(0, 16, np.zeros(1, np.uint8)).wait(_deadline())
            except PeerAborted as e:
                assert "withdrew a request" in str(e), e
                break
            time.sleep(0.01)
        else:
            raise AssertionError("rank 1 was never told that rank 0 withdrew a request")
    if rank == 0:
        time.sleep(0.2)
        assert not buf.any()
        try:
            t.irecv(1, 15, np.zeros(3, np.uint8))
        except PeerTimeout:
            pass
        else:
            raise AssertionError("traffic with a peer after a withdrawn request did not fail")
    sync()
    if rank in (0, 2):  # the third rank still talks to both
        peer = 2 - rank
        out = np.zeros(5, np.uint8)
        r = t.irecv(peer, 17, out)
        t.isend(peer, 17, np.full(5, rank, np.uint8)).wait(_deadline())
        r.wait(_deadline())
        assert out.tolist() == [peer] * 5
    sync()


CASES = [case_order_per_tag_and_early_messages, case_tags_do_not_block_each_other,
         case_size_mismatch_is_typed_and_consumes_the_message, case_any_source,
         case_a_receive_naming_the_source_goes_first, case_callbacks_run_once_off_the_lock,
         case_timeout_names_the_peer_and_the_request_stays_posted,
         case_cancel_gives_the_buffer_back_and_fails_the_pair]  # (last: it breaks a pair)
