"""Asynchronous collectives: the engine's thread overlaps communication with compute."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from helpers.harness import run_ranks


def overlap(rank, world):
    """Rank 1 joins late; rank 0 computes meanwhile if its all_reduce is asynchronous."""
    torch.set_num_threads(1)
    x = torch.ones(1_000_000)
    a = torch.randn(300, 300)

    reps = [30]

    def compute():
        y = a
        for _ in range(reps[0]):
            y = torch.tanh(a @ y)
        return y

    compute()
    dist.all_reduce(x)
    t0 = time.perf_counter()
    compute()
    t_compute = time.perf_counter() - t0
    # ~0.2 s of compute, the same on both ranks (rank 0 decides), and a peer that is late by
    # as much: synchronous ~ late + compute, asynchronous ~ max(late, compute)
    scale = torch.tensor([max(1.0, 0.2 / t_compute)])
    dist.broadcast(scale, 0)
    reps[0] = int(reps[0] * scale.item())
    t0 = time.perf_counter()
    compute()
    late = time.perf_counter() - t0
    dist.broadcast(lateness := torch.tensor([late]), 0)
    late = lateness.item()
    rounds = []
    for _ in range(ROUNDS):
        timings = {}
        for mode in ("sync", "async"):
            dist.barrier()
            if rank == 1:
                time.sleep(late)
                dist.all_reduce(x)
                continue
            t0 = time.perf_counter()
            if mode == "sync":
                dist.all_reduce(x)
                returned = time.perf_counter() - t0
                compute()
            else:
                w = dist.all_reduce(x, async_op=True)
                returned = time.perf_counter() - t0
                compute()
                w.wait()
            timings[mode] = (time.perf_counter() - t0, returned)
        rounds.append(timings)
    return rounds, late


ROUNDS = 3


def test_async_returns_at_once_and_overlaps():
    # The best of a few rounds: one stall of a loaded machine must not decide. A synchronous
    # all_reduce fails every round (it returns only after the late peer, ~0.2 s).
    rounds, late = run_ranks(overlap, 2, timeout=180)[0]
    returned = min(r["async"][1] for r in rounds)
    assert returned < 0.01, rounds  # async_op returns before the peer even arrived
    # the compute ran while the engine waited for the late peer
    best = min(r["async"][0] / r["sync"][0] for r in rounds)
    assert best < 0.8, rounds


def future_callbacks(rank, world):
    t = torch.ones(4) * (rank + 1)
    fut = dist.all_reduce(t, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    # a callback that issues (and waits for) another collective must not deadlock
    def nested(f):
        u = torch.ones(1)
        dist.all_reduce(u)
        return u.item()
    nested_fut = dist.all_reduce(torch.ones(1), async_op=True).get_future().then(nested)
    return chained.wait().tolist(), nested_fut.wait()


def test_future_callbacks_and_nested_collectives():
    res = run_ranks(future_callbacks, 2, timeout=60)
    for chained, nested in res.values():
        assert chained == [6.0] * 4 and nested == 2.0


def oversubscribed(rank, world):
    torch.set_num_threads(1)
    t = torch.ones(2)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ok_small = True
    t0 = time.perf_counter()
    for i in range(200):
        t.fill_(float(rank + i))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ok_small &= t[0].item() == world - 1 + i
    small = (time.perf_counter() - t0) / 200
    big = torch.ones(1_000_000)
    for _ in range(3):
        dist.all_reduce(big)
    return small, ok_small, big[0].item() == world ** 3


def test_eight_ranks_on_two_cores_stay_responsive():
    res = run_ranks(oversubscribed, 8, timeout=120)
    assert all(ok_small and ok_big for _, ok_small, ok_big in res.values()), res
    worst = max(r[0] for r in res.values())
    # gloo needs ~1.1 ms per tiny all_reduce at 4 ranks on 2 cores; a spin-wait collapse
    # would take tens of ms per op here. This is a sanity bound, not the benchmark.
    assert worst < 0.02, worst


def wait_with_timeout(rank, world):
    from datetime import timedelta

    if rank == 1:
        time.sleep(1.0)
        dist.all_reduce(torch.ones(3))
        return None
    w = dist.all_reduce(torch.ones(3), async_op=True)
    t0 = time.monotonic()
    try:
        w.wait(timedelta(seconds=0.2))
        first = "no error"
    except Exception as exc:  # noqa: BLE001
        first = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    w.wait()  # the collective itself goes on and completes once rank 1 arrives
    return first, took, w.get_future().value()[0].tolist()


def test_work_wait_timeout_raises_and_the_op_still_completes():
    first, took, value = run_ranks(wait_with_timeout, 2, timeout=60)[0]
    assert first.startswith("PeerTimeoutError") and "Timed out after 0.200 s in Work.wait" in first, first
    assert 0.15 < took < 0.8, took
    assert value == [2.0, 2.0, 2.0]


# --- deferred async collectives (engine.py: try_now) ----------------------------------------
# A small async collective whose peer is late publishes its part and returns; the rest runs
# when someone looks at its Work. Rank 1 is late for every call below, so each one defers.

LATE = 0.3


def engine_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("neuron-engine")]


def deferred(rank, world):
    out = {}
    late = rank == 1
    # 1. waited for: runs in the waiting thread, and no engine thread is ever started
    dist.barrier()
    inp = torch.arange(4.0) + 10 * rank
    ag = torch.empty(4 * world)
    if late:
        time.sleep(LATE)
        dist.all_gather_into_tensor(ag, inp)
    else:
        t0 = time.perf_counter()
        w = dist.all_gather_into_tensor(ag, inp, async_op=True)
        out["returned"] = time.perf_counter() - t0
        w.wait()
        out["threads"] = engine_threads()
    out["all_gather"] = ag.tolist()
    # 2. in place, polled with is_completed until done
    dist.barrier()
    t = torch.full((5,), float(rank + 1))
    if late:
        time.sleep(LATE)
        dist.all_reduce(t)
    else:
        w = dist.all_reduce(t, async_op=True)
        t0 = time.monotonic()
        while not w.is_completed():
            assert time.monotonic() - t0 < 20, "is_completed never became true"
            time.sleep(0.01)
    out["polled"] = t.tolist()
    # 3. a future's callback, the Work never waited on: the engine thread completes it
    dist.barrier()
    rs = torch.empty(3)
    src = torch.arange(3.0 * world) * (rank + 1)
    if late:
        time.sleep(LATE)
        dist.reduce_scatter_tensor(rs, src)
        out["future"] = rs.tolist()
    else:
        fut = dist.reduce_scatter_tensor(rs, src, async_op=True).get_future()
        value = fut.then(lambda f: f.value()[0].sum().item()).wait()
        out["future"] = (rs.tolist(), value)
    # 4. never waited on: the group's next (synchronous) collective runs it first
    dist.barrier()
    a, b = torch.ones(2) * (rank + 1), torch.ones(3) * (rank + 2)
    if late:
        time.sleep(LATE)
        dist.all_reduce(a)
        dist.all_reduce(b)
    else:
        w = dist.all_reduce(a, async_op=True)
        dist.all_reduce(b)
        out["done_before_next"] = w.is_completed()
    out["next_sync"] = (a.tolist(), b.tolist())
    return out


def test_a_deferred_async_collective_completes_however_it_is_looked_at():
    check_deferred(run_ranks(deferred, 2, timeout=90))


def check_deferred(res):
    """What ``deferred`` must return on each rank (also across nodes: test_async_net.py)."""
    for rank, out in res.items():
        assert out["all_gather"] == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0], (rank, out)
        assert out["polled"] == [3.0] * 5, (rank, out)
        assert out["next_sync"] == ([3.0, 3.0], [5.0, 5.0, 5.0]), (rank, out)
    # rank 0 (on time) returned at once and ran the rest itself when it waited
    assert res[0]["returned"] < LATE / 3, res[0]
    assert res[0]["threads"] == [], res[0]
    assert res[0]["done_before_next"] is True
    # reduce_scatter of rank r's arange * (r + 1): rank 0 gets [0, 1, 2] * (1 + 2)
    assert res[1]["future"] == [9.0, 12.0, 15.0], res[1]
    assert res[0]["future"] == ([0.0, 3.0, 6.0], 9.0), res[0]


def deferred_then_other_group(rank, world):
    """Rank 0's async all_reduce on ``a`` defers (rank 1 is late), then rank 0 blocks in a
    collective of another group that rank 1 joins only after its own all_reduce on ``a``:
    what rank 0 published must let rank 1 through, or both would wait for ever."""
    a = dist.new_group([0, 1])
    b = dist.new_group([0, 1])
    dist.barrier(group=a)
    dist.barrier(group=b)
    t = torch.ones(4) * (rank + 1)
    if rank == 1:
        time.sleep(LATE)
        dist.all_reduce(t, group=a)
        dist.barrier(group=b)
        return t.tolist(), None
    w = dist.all_reduce(t, group=a, async_op=True)
    dist.barrier(group=b)
    w.wait()
    from neuron_dist.flight_recorder import recorder

    rec = [r.as_dict() for r in recorder._ring if r.as_dict()["op"] == "all_reduce"][-1]
    return t.tolist(), (rec["state"], rec["algo"])


def test_a_deferred_collective_never_holds_back_a_peer():
    res = run_ranks(deferred_then_other_group, 2, timeout=60)
    assert res[0][0] == res[1][0] == [3.0] * 4, res
    # one record, completed, naming its algorithm once (the call ran twice)
    assert res[0][1] == ("completed", "one_step"), res[0][1]


def deferred_two_steps(rank, world):
    """As above, with a call of two steps (forced): rank 1's second step needs rank 0's,
    so rank 0's deferred call must go on without anyone looking at its Work."""
    b = dist.new_group([0, 1])
    dist.barrier(group=b)
    t = torch.arange(8.0) * (rank + 1)
    if rank == 1:
        time.sleep(LATE)
        dist.all_reduce(t)
        dist.barrier(group=b)
        return t.tolist()
    w = dist.all_reduce(t, async_op=True)
    dist.barrier(group=b)
    w.wait()
    return t.tolist()


def test_a_deferred_call_with_more_steps_goes_on_by_itself():
    res = run_ranks(deferred_two_steps, 2, timeout=60, pg_timeout=20,
                    env={"NEURON_DIST_ALGO": "all_reduce=two_step"})
    assert res[0] == res[1] == [3.0 * i for i in range(8)], res


# --- held async collectives (engine.py: "held"; NEURON_DIST_ASYNC_HOLD) -----------------
# With no core spare for the engine thread, an async collective is left to its caller for a
# while. Each way of looking at its Work must start it, and so must the time limit.

BIG = 1 << 19  # float32 elements: 2 MiB, more than a slot (no deferred path)


def held(rank, world):
    out = {}
    # 1. waited for: nothing runs it before, the waiting thread runs it
    x = torch.full((BIG,), float(rank + 1))
    dist.barrier()
    t0 = time.perf_counter()
    w = dist.all_reduce(x, async_op=True)
    out["returned"] = time.perf_counter() - t0
    time.sleep(0.2)  # (compute)
    out["held"] = not w.finished and x[0].item() == rank + 1  # (is_completed would start it)
    w.wait()
    out["waited"] = (x[0].item(), x[-1].item())
    # 2. polled with is_completed: the poll has the engine thread start it
    x.fill_(rank + 1)
    dist.barrier()
    w = dist.all_reduce(x, async_op=True)
    t0 = time.monotonic()
    while not w.is_completed():
        assert time.monotonic() - t0 < 20, "is_completed never became true"
        time.sleep(0.01)
    out["polled"] = (x[0].item(), x[-1].item())
    # 3. a future: completes by itself
    x.fill_(rank + 1)
    dist.barrier()
    out["future"] = dist.all_reduce(x, async_op=True).get_future().wait()[0][-1].item()
    # 4. the group's next collective, synchronous: runs the held one first
    x.fill_(rank + 1)
    y = torch.ones(3) * (rank + 2)
    dist.barrier()
    w = dist.all_reduce(x, async_op=True)
    dist.all_reduce(y)
    out["next_sync"] = (w.is_completed(), x[-1].item(), y.tolist())
    w.wait()
    return out


def test_a_held_async_collective_starts_however_it_is_looked_at():
    check_held(run_ranks(held, 2, timeout=90, env={"NEURON_DIST_ASYNC_HOLD": "3600"}))


def check_held(res):
    """What ``held`` must return on each rank (also across nodes: test_async_net.py)."""
    for rank, out in res.items():
        assert out["returned"] < 0.02, (rank, out)
        assert out["held"], (rank, out)
        assert out["waited"] == out["polled"] == (3.0, 3.0), (rank, out)
        assert out["future"] == 3.0, (rank, out)
        assert out["next_sync"] == (True, 3.0, [5.0] * 3), (rank, out)


def held_then_other_group(rank, world, hold):
    """Rank 0's held all_reduce is never looked at while rank 0 blocks in another group's
    barrier, which rank 1 joins only once that all_reduce has completed on its side: only
    the time limit can start it (held for ever, both would wait until the timeout)."""
    b = dist.new_group([0, 1])
    dist.barrier(group=b)
    store = dist.distributed_c10d._get_default_store()
    x = torch.full((BIG,), float(rank + 1))
    t0 = time.monotonic()
    if rank == 0:
        w = dist.all_reduce(x, async_op=True)
        # rank 1 enters only now: had it entered first, this call would not be held (a
        # peer would be waiting for it)
        store.set("held_issued", "1")
        dist.barrier(group=b)
        w.wait()
    else:
        store.wait(["held_issued"])
        w = dist.all_reduce(x, async_op=True)
        w.wait()
        dist.barrier(group=b)
    return time.monotonic() - t0, x[-1].item()


def test_a_held_async_collective_starts_by_itself_when_nobody_looks():
    hold = 0.5
    res = run_ranks(held_then_other_group, 2, hold, timeout=60, pg_timeout=20,
                    env={"NEURON_DIST_ASYNC_HOLD": str(hold)})
    assert res[0][1] == res[1][1] == 3.0, res
    assert hold * 0.9 < res[1][0] < 15, res  # rank 1 waited for rank 0's time limit


def held_but_awaited(rank, world):
    """Rank 1 is in the all_reduce already when rank 0 issues it asynchronously and goes
    on computing: it is not held (rank 1 would wait for rank 0's compute)."""
    x = torch.full((BIG,), float(rank + 1))
    dist.barrier()
    t0 = time.monotonic()
    if rank == 1:
        dist.all_reduce(x)
        return time.monotonic() - t0, x[-1].item()
    time.sleep(0.3)
    w = dist.all_reduce(x, async_op=True)
    time.sleep(1.5)  # (compute, not looking at the Work)
    w.wait()
    return time.monotonic() - t0, x[-1].item()


def test_an_async_collective_its_peers_wait_for_already_is_not_held():
    res = run_ranks(held_but_awaited, 2, timeout=60, env={"NEURON_DIST_ASYNC_HOLD": "3600"})
    assert res[0][1] == res[1][1] == 3.0, res
    assert res[1][0] < 1.2, res  # not ~1.8 s: rank 0's engine thread ran it at once
