"""Subgroups: any rank subset, singletons, several groups in flight in different orders."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from helpers.harness import run_ranks


def subsets(rank, world):
    fails = []
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    tail = dist.new_group([1, 2, 3])
    singles = [dist.new_group([k]) for k in range(world)]  # every rank creates every group
    mine = evens if rank % 2 == 0 else odds
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=mine)
    expect = 2.0 if rank % 2 == 0 else 4.0
    if t.tolist() != [expect] * 3:
        fails.append(f"parity group all_reduce: {t.tolist()}")
    if rank in (1, 2, 3):
        out = [torch.empty(1) for _ in range(3)]
        dist.all_gather(out, torch.tensor([float(rank)]), group=tail)
        if [o.item() for o in out] != [1.0, 2.0, 3.0]:
            fails.append(f"tail all_gather: {out}")
        b = torch.tensor([float(rank)])
        dist.broadcast(b, src=3, group=tail)  # global rank 3 is tail's group rank 2
        if b.item() != 3.0:
            fails.append(f"tail broadcast {b}")
        if rank == 1:
            dist.send(torch.tensor([7.0]), 3, group=tail)
        if rank == 3:
            r = torch.empty(1)
            dist.recv(r, 1, group=tail)
            if r.item() != 7.0:
                fails.append("tail send/recv")
    s = torch.tensor([float(rank + 1)])
    dist.all_reduce(s, group=singles[rank])
    if s.item() != rank + 1:
        fails.append("singleton group")
    dist.barrier(group=singles[rank])
    return fails


def test_subgroups_and_singletons():
    res = run_ranks(subsets, 4, timeout=120)
    assert not any(res.values()), res


def concurrent_groups(rank, world):
    """Two overlapping groups with async collectives issued in opposite orders per rank."""
    a = dist.new_group([0, 1, 2])
    b = dist.new_group([0, 1, 2], timeout=None)
    n = 200_000
    xa = torch.full((n,), float(rank))
    xb = torch.full((n,), float(10 * rank))
    if rank % 2 == 0:
        wa = dist.all_reduce(xa, group=a, async_op=True)
        wb = dist.all_reduce(xb, group=b, async_op=True)
    else:
        wb = dist.all_reduce(xb, group=b, async_op=True)
        wa = dist.all_reduce(xa, group=a, async_op=True)
    wb.wait()
    wa.wait()
    world_sum = float(sum(range(world)))
    return xa[0].item() == world_sum and xb[-1].item() == 10 * world_sum and \
        bool((xa == world_sum).all()) and bool((xb == 10 * world_sum).all())


def test_concurrent_groups_in_different_orders_do_not_deadlock():
    assert all(run_ranks(concurrent_groups, 3, timeout=120).values())


def many_in_flight(rank, world):
    works, tensors = [], []
    for i in range(40):
        t = torch.full((1000 * (i % 5) + 1,), float(rank + i))
        tensors.append(t)
        works.append(dist.all_reduce(t, async_op=True))
    out = torch.empty(world * 3)
    works.append(dist.all_gather_into_tensor(out, torch.full((3,), float(rank)), async_op=True))
    for w in reversed(works):  # waiting out of order is fine
        w.wait()
    ok = all(bool((t == sum(k + i for k in range(world))).all()) for i, t in enumerate(tensors))
    return ok and out.tolist() == [float(k) for k in range(world) for _ in range(3)]


def test_many_async_ops_in_flight():
    assert all(run_ranks(many_in_flight, 3, timeout=120).values())


def group_timeout(rank, world):
    import time
    g = dist.new_group([0, 1], timeout=__import__("datetime").timedelta(seconds=1))
    if rank == 1:
        time.sleep(3)
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=g)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, time.monotonic() - t0, str(exc)
    return "no error"


def test_new_group_timeout_is_honoured():
    res = run_ranks(group_timeout, 2, timeout=60, pg_timeout=60)
    name, took, msg = res[0]
    assert name == "PeerTimeoutError" and 0.9 < took < 3.0, res[0]
    assert "rank 1 never arrived" in msg


def lowered_timeout(rank, world):
    from datetime import timedelta
    dist.group.WORLD.set_timeout(timedelta(seconds=1))  # as TorchTitan does after step 1
    if rank == 1:
        time.sleep(4)
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, time.monotonic() - t0
    return "no error", 0.0


def test_set_timeout_changes_later_deadlines():
    res = run_ranks(lowered_timeout, 2, timeout=60, pg_timeout=60, expect_errors=True)
    status, (name, took) = res[0]
    assert name == "PeerTimeoutError" and took < 3.0, res[0]
