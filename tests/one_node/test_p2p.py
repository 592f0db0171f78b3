"""send / recv / isend / irecv with tags, recv from any source, batch_isend_irecv."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from helpers.harness import run_ranks

SMALL_MAILBOX = {"NEURON_DIST_SHM_MAILBOX_BYTES": "8K"}


def ring_exchange(rank, world):
    """Everyone isends a large tensor to the right and irecvs from the left at once."""
    n = 300_001  # far larger than the 8 KiB mailbox: streamed in many pieces
    right, left = (rank + 1) % world, (rank - 1) % world
    out = torch.arange(n, dtype=torch.float64) + rank
    got = torch.empty(n, dtype=torch.float64)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, right),
                                   dist.P2POp(dist.irecv, got, left)])
    for r in reqs:
        r.wait()
    return torch.equal(got, torch.arange(n, dtype=torch.float64) + left)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_ring_exchange_large(world):
    assert all(run_ranks(ring_exchange, world, env=SMALL_MAILBOX).values())


def tags_out_of_order(rank, world):
    """Rank 0 sends tags 1, 2, 3; rank 1 receives them as 3, 1, 2 (unexpected queue)."""
    if rank == 0:
        for tag in (1, 2, 3):
            dist.send(torch.full((1000 * tag,), float(tag)), 1, tag=tag)
        return True
    bufs = {tag: torch.empty(1000 * tag) for tag in (3, 1, 2)}
    for tag, buf in bufs.items():
        dist.recv(buf, 0, tag=tag)
    return all(torch.equal(b, torch.full_like(b, float(t))) for t, b in bufs.items())


def test_tags_matched_out_of_order():
    assert all(run_ranks(tags_out_of_order, 2, env=SMALL_MAILBOX).values())


def same_tag_in_order(rank, world):
    if rank == 0:
        works = [dist.isend(torch.full((50,), float(i)), 1, tag=7) for i in range(20)]
        for w in works:
            w.wait()
        return True
    out = []
    for _ in range(20):
        t = torch.empty(50)
        dist.recv(t, 0, tag=7)
        out.append(t[0].item())
    return out == [float(i) for i in range(20)]


def test_same_tag_non_overtaking():
    assert all(run_ranks(same_tag_in_order, 2, env=SMALL_MAILBOX).values())


def any_source(rank, world):
    if rank == 0:
        senders = set()
        for _ in range(world - 1):
            t = torch.empty(3)
            src = dist.recv(t)  # src=None: any source
            assert torch.equal(t, torch.full((3,), float(src))), (src, t)
            senders.add(src)
        return sorted(senders) == list(range(1, world))
    dist.send(torch.full((3,), float(rank)), 0)
    return True


def test_recv_any_source_reports_sender():
    assert all(run_ranks(any_source, 4).values())


def irecv_before_send(rank, world):
    if rank == 1:
        t = torch.empty(10, dtype=torch.int32)
        w = dist.irecv(t, 0, tag=3)
        dist.barrier()
        w.wait()
        return t.tolist() == list(range(10)) and w.is_completed()
    dist.barrier()
    dist.send(torch.arange(10, dtype=torch.int32), 1, tag=3)
    return True


def test_irecv_posted_before_send():
    assert all(run_ranks(irecv_before_send, 2).values())


def dtypes_and_shapes(rank, world):
    ok = True
    for dtype in (torch.bool, torch.uint8, torch.int64, torch.bfloat16, torch.float16, torch.complex64):
        x = (torch.arange(24) % 5).to(dtype).view(2, 3, 4)
        if rank == 0:
            dist.send(x.transpose(0, 2), 1)  # non-contiguous send
            dist.send(torch.empty(0, dtype=dtype), 1)  # zero elements
        else:
            y = torch.empty(4, 3, 2, dtype=dtype).transpose(0, 2)  # non-contiguous recv
            dist.recv(y, 0)
            # elements travel in logical (row-major) order on both sides
            ok &= torch.equal(y.reshape(-1), x.transpose(0, 2).reshape(-1))
            z = torch.empty(0, dtype=dtype)
            dist.recv(z, 0)
    return bool(ok)


def test_dtypes_noncontiguous_and_empty():
    assert all(run_ranks(dtypes_and_shapes, 2).values())


def size_mismatch(rank, world):
    if rank == 0:
        dist.send(torch.ones(8), 1)
        return "sent"
    try:
        dist.recv(torch.empty(5), 0)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return "no error"


def test_recv_size_mismatch_is_an_error():
    res = run_ranks(size_mismatch, 2)
    assert "32 bytes" in res[1] and "20 bytes" in res[1], res[1]


def p2p_bad_args(rank, world):
    errors = []
    for call in (lambda: dist.send(torch.ones(1), rank),
                 lambda: dist.send(torch.ones(1), world + 3),
                 lambda: dist.recv(torch.ones(1), rank)):
        try:
            call()
            errors.append(None)
        except (ValueError, RuntimeError) as exc:
            errors.append(str(exc))
    return errors


def test_p2p_bad_arguments_raise_before_sending():
    res = run_ranks(p2p_bad_args, 2)
    for errs in res.values():
        assert all(errs), errs
        assert "itself" in errs[0] or "same as the rank" in errs[0], errs[0]
        assert "out of range" in errs[1] or "Invalid" in errs[1] or "not part" in errs[1], errs[1]


def unwaited_requests_progress(rank, world):
    """Requests nobody waits on still complete: a small irecv whose Work is only polled, and
    a sender blocked on a full mailbox while the receiver sits in a collective."""
    if rank == 1:
        dist.recv(torch.zeros(1), 0)  # starts the progress thread, which then lingers
        time.sleep(0.05)
        small = torch.zeros(4)
        work = dist.irecv(small, 0)  # small: posted without waking the lingering thread
        dist.barrier()
        deadline = time.monotonic() + 3
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)  # polled, never waited on
        polled = work.is_completed()
        # 20 small receives (1 KiB each, none big enough to wake the thread at once) for
        # 20 KiB through an 8 KiB mailbox: rank 0's sends block until someone drains it.
        bufs = [torch.zeros(256) for _ in range(20)]
        works = [dist.irecv(b, 0) for b in bufs]
        dist.all_reduce(torch.ones(1))  # rank 0 joins only once its blocking sends are done
        for w in works:
            w.wait()
        return polled and torch.equal(small, torch.full((4,), 7.0)) and \
            all(torch.equal(b, torch.full((256,), float(i))) for i, b in enumerate(bufs))
    dist.send(torch.zeros(1), 1)
    dist.barrier()  # rank 1's irecv is posted by now, and nobody will wait on it
    dist.send(torch.full((4,), 7.0), 1)
    started = time.monotonic()
    for i in range(20):
        dist.send(torch.full((256,), float(i)), 1)
    dist.all_reduce(torch.ones(1))
    return time.monotonic() - started < 2.0  # drained within the lingering period, not later


def test_requests_nobody_waits_on_still_progress():
    assert all(run_ranks(unwaited_requests_progress, 2, env=SMALL_MAILBOX, timeout=60).values())


def big_messages(rank, world):
    """Messages of hundreds of KiB and one larger than the ring: received late (unexpected),
    both ranks sending first, from any source, a size mismatch, and a non-contiguous tensor."""
    n = 200_000  # 800 KB of float32
    peer = 1 - rank
    fails = []
    # both send first (sync), then receive: nobody may wait for the other's receive
    dist.send(torch.full((n,), float(rank)), peer)
    got = torch.empty(n)
    dist.recv(got, peer)
    if not torch.equal(got, torch.full((n,), float(peer))):
        fails.append("send-first exchange")
    # More than the default 4 MiB ring holds, so it wraps and refills: every byte in place.
    big = 2_600_000  # 10.4 MB of float32
    dist.send(torch.arange(big, dtype=torch.float32) + rank, peer)
    got = torch.empty(big)
    dist.recv(got, peer)
    if not torch.equal(got, torch.arange(big, dtype=torch.float32) + peer):
        fails.append("message larger than the ring")
    if rank == 0:
        dist.send(torch.arange(n, dtype=torch.float32), 1, tag=5)
        dist.send(torch.arange(n, dtype=torch.float32).view(400, 500).t(), 1, tag=6)
        dist.send(torch.ones(n), 1, tag=7)  # rank 1 expects another size
        dist.barrier()
    else:
        dist.barrier()  # all three arrived before any receive was posted
        a = torch.empty(n)
        src = dist.recv(a, tag=5)  # any source
        b = torch.empty(500, 400)
        dist.recv(b, 0, tag=6)
        if src != 0 or not torch.equal(a, torch.arange(n, dtype=torch.float32)):
            fails.append("late receive")
        if not torch.equal(b, torch.arange(n, dtype=torch.float32).view(400, 500).t()):
            fails.append("non-contiguous")
        try:
            dist.recv(torch.empty(n - 1), 0, tag=7)
            fails.append("size mismatch not reported")
        except Exception as e:  # noqa: BLE001
            if "sizes of matching send and recv must be equal" not in str(e):
                fails.append(f"size mismatch: {e}")
    return fails


def test_big_messages():
    results = run_ranks(big_messages, 2, timeout=60)
    for rank, fails in results.items():
        assert fails == [], (rank, fails)


def sender_ahead_of_a_busy_receiver(rank, world):
    """Rank 0 sends more than the ring holds while rank 1, with no receive posted, waits in a
    collective for rank 0: rank 1's progress thread drains the ring into its unexpected
    queue, so the blocking sends finish and the collective can start."""
    if rank == 1:
        dist.recv(torch.zeros(1), 0)  # starts the progress thread
        dist.all_reduce(torch.ones(1))
        got = [torch.zeros(1024) for _ in range(6)]
        for i, g in enumerate(got):
            dist.recv(g, 0)
        return all(torch.equal(g, torch.full((1024,), float(i))) for i, g in enumerate(got))
    dist.send(torch.zeros(1), 1)
    for i in range(6):  # 24 KiB through an 8 KiB ring
        dist.send(torch.full((1024,), float(i)), 1)
    dist.all_reduce(torch.ones(1))
    return True


def test_sender_ahead_of_a_receiver_busy_in_a_collective():
    assert all(run_ranks(sender_ahead_of_a_busy_receiver, 2, env=SMALL_MAILBOX, timeout=30,
                         pg_timeout=10).values())


def small_after_big(rank, world):
    """Small sends are written straight into the ring only when nothing to that peer is
    queued: behind a big message still streaming, and once the ring is full, they queue,
    and every message arrives in order."""
    big = torch.arange(100_000, dtype=torch.float32)  # 400 KB through an 8 KiB ring
    if rank == 0:
        works = [dist.isend(big, 1, tag=3)]
        works += [dist.isend(torch.full((16,), float(i)), 1, tag=3) for i in range(40)]
        for w in works:
            w.wait()
        return True
    got = torch.empty(100_000)
    dist.recv(got, 0, tag=3)
    smalls = []
    for _ in range(40):
        s = torch.empty(16)
        dist.recv(s, 0, tag=3)
        smalls.append(s[0].item())
    return torch.equal(got, big) and smalls == [float(i) for i in range(40)]


def test_small_sends_keep_order_behind_queued_ones():
    assert all(run_ranks(small_after_big, 2, env=SMALL_MAILBOX, timeout=60).values())


def kept_send_works(rank, world):
    """A send that completes as it is posted hands back the last such Work again when
    nothing else holds it; one the caller kept, or made a future from, stays its own."""
    first, second = torch.full((4,), 1.0), torch.full((4,), 2.0)
    if rank == 0:
        kept = dist.isend(first, 1)
        kept.wait()
        fut = dist.isend(second, 1).get_future()
        fut.wait()
        for i in range(3):
            dist.send(torch.full((4,), 3.0 + i), 1)
        return (kept.is_completed(), kept.result()[0] is first, fut.value()[0] is second,
                kept is not fut)
    got = []
    for _ in range(5):
        t = torch.empty(4)
        dist.recv(t, 0)
        got.append(t[0].item())
    return got


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_send_work_someone_holds_is_never_reused(nodes):
    env = (lambda r: {"NEURON_DIST_NODE_NAME": f"kept-node{r}"}) if nodes == 2 else None
    results = run_ranks(kept_send_works, 2, env=env, timeout=90)
    assert results[0] == (True, True, True, True), results
    assert results[1] == [1.0, 2.0, 3.0, 4.0, 5.0], results


def receives_of_messages_already_there(rank, world):
    """Rank 1's messages are all in the ring before rank 0 receives: the ones at the ring's
    head are read straight into the tensors, the others take the request path, and the
    order per tag, the sizes and the Works are as always."""
    if rank == 1:
        for tag, v in ((0, 1.0), (1, 2.0), (0, 3.0), (0, 4.0)):
            dist.send(torch.full((4,), v), 0, tag=tag)
        dist.barrier()
        return None
    dist.barrier()
    first = torch.empty(4)
    kept = dist.irecv(first, 1, tag=0)  # at the head: done as it is posted
    done_at_once = kept.is_completed()
    second = torch.empty(4)
    dist.recv(second, 1, tag=0)  # the tag-1 message comes first: the request path
    with pytest.raises(RuntimeError, match="16 bytes"):
        dist.recv(torch.empty(2), 1, tag=0)  # a size mismatch is still named (and consumed)
    third = torch.empty(4)
    dist.recv(third, 1, tag=1)
    return (done_at_once, kept.is_completed(), kept.result()[0] is first, first[0].item(),
            second[0].item(), third[0].item())


def test_receives_of_messages_already_there_keep_order_sizes_and_works():
    results = run_ranks(receives_of_messages_already_there, 2, timeout=60)
    assert results[0] == (True, True, True, 1.0, 3.0, 2.0), results
