"""Deferred async collectives between nodes (net.py, "Deferring the wait of an async call";
engine.try_now).

Every rank is alone on its virtual node, so each collective goes over the rdm transport. An
async all_reduce, all_gather or reduce_scatter posts its messages in the caller's thread and
returns; if a peer is late, the rest runs when someone looks at its Work. The cases of the
one-node tests (one_node/test_async.py) run here too, plus what only the network has: a
deferred call is finished from what its first run posted, and one whose algorithm may
have to run again from the start, and cannot run twice, must go to the engine thread
before it posts anything.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from helpers.harness import run_ranks
from one_node.test_async import (LATE, check_deferred, check_held, deferred,
                                 deferred_then_other_group, engine_threads, held,
                                 held_then_other_group)


def _nodes(world):
    return lambda rank: {"NEURON_DIST_NODE_NAME": f"node{rank}"}


@pytest.mark.timeout(120)
def test_a_deferred_collective_between_nodes_completes_however_it_is_looked_at():
    # as on one node: rank 0 (on time) returned at once, ran the rest itself when it
    # waited, and no engine thread was ever started for its group
    check_deferred(run_ranks(deferred, 2, timeout=100, env=_nodes(2)))


@pytest.mark.timeout(90)
def test_a_deferred_collective_between_nodes_never_holds_back_a_peer():
    res = run_ranks(deferred_then_other_group, 2, timeout=80, env=_nodes(2))
    assert res[0][0] == res[1][0] == [3.0] * 4, res
    state, algo = res[0][1]
    assert state == "completed", res[0][1]
    # named once although the call was deferred
    parts = algo.split("+")
    assert len(parts) == len(set(parts)), algo


@pytest.mark.timeout(120)
def test_held_collectives_between_nodes_start_however_they_are_looked_at():
    # held only when asked for between nodes (NEURON_DIST_ASYNC_HOLD), and then as on one node
    env = lambda rank: {"NEURON_DIST_NODE_NAME": f"node{rank}", "NEURON_DIST_ASYNC_HOLD": "3600"}
    check_held(run_ranks(held, 2, timeout=100, env=env))
    hold = 0.5
    env = lambda rank: {"NEURON_DIST_NODE_NAME": f"node{rank}", "NEURON_DIST_ASYNC_HOLD": str(hold)}
    res = run_ranks(held_then_other_group, 2, hold, timeout=60, pg_timeout=20, env=env)
    assert res[0][1] == res[1][1] == 3.0, res
    assert hold * 0.9 < res[1][0] < 15, res


def three_ranks_one_late(rank, world):
    """Rank 2 is late; ranks 0 and 1 defer, wait, and must see every rank's data. Then the
    three ops (in place, AVG) issued back to back and waited in reverse order: the first
    defers, the others queue behind it and wake the engine thread."""
    out = {}
    late = rank == world - 1
    dist.barrier()
    t = torch.arange(6.0) + 100 * rank
    if late:
        time.sleep(LATE)
    t0 = time.perf_counter()
    w = dist.all_reduce(t, async_op=True)
    out["returned"] = time.perf_counter() - t0
    w.wait()
    out["all_reduce"] = t.tolist()
    out["threads"] = engine_threads()
    dist.barrier()
    if late:
        time.sleep(LATE)
    a = torch.full((4,), float(rank + 1))
    ag = torch.empty(2 * world)
    mine = ag[2 * rank:2 * rank + 2]
    mine.copy_(torch.tensor([rank, -rank], dtype=torch.float32))
    rs_in = torch.arange(3.0 * world) * (rank + 1)
    rs_out = rs_in[3 * rank:3 * rank + 3]  # in place: the output is this rank's input block
    works = [dist.all_reduce(a, op=dist.ReduceOp.AVG, async_op=True),
             dist.all_gather_into_tensor(ag, mine, async_op=True),
             dist.reduce_scatter_tensor(rs_out, rs_in, async_op=True)]
    for w in reversed(works):
        w.wait()
    out["avg"], out["ag"], out["rs"] = a.tolist(), ag.tolist(), rs_out.tolist()
    return out


@pytest.mark.timeout(120)
def test_three_nodes_with_a_late_rank():
    # (the direct exchange: one round, so deferred; where ranks share cores the tables
    # pick the tree, which has rounds after the first and starts on the engine thread, as
    # test_log_depth's late rank checks)
    res = run_ranks(three_ranks_one_late, 3, timeout=100,
                    env=lambda rank: {**_nodes(3)(rank),
                                      "NEURON_DIST_ALGO": "all_reduce/network=direct"})
    total = sum(100.0 * r for r in range(3))
    for rank, out in res.items():
        assert out["all_reduce"] == [3 * i + total for i in range(6)], (rank, out)
        assert out["avg"] == [2.0] * 4, (rank, out)
        assert out["ag"] == [0.0, 0.0, 1.0, -1.0, 2.0, -2.0], (rank, out)
        # reduce_scatter of arange * (r + 1) over r: block k of the sum is arange * 6
        assert out["rs"] == [6.0 * (3 * rank + i) for i in range(3)], (rank, out)
    for rank in (0, 1):
        assert res[rank]["returned"] < LATE / 3, res[rank]  # it did not wait for rank 2
        assert res[rank]["threads"] == [], res[rank]


def premul_in_place(rank, world):
    """PREMUL_SUM in place scales its input before it sends it: that cannot run twice, so
    the call goes to the engine thread (before anything is posted) and is right."""
    dist.barrier()
    t = torch.arange(4.0) + rank
    if rank == 1:
        time.sleep(LATE)
    op = dist._make_nccl_premul_sum(0.5)
    w = dist.all_reduce(t, op=op, async_op=True)
    w.wait()
    return t.tolist(), engine_threads()


@pytest.mark.timeout(90)
def test_a_call_that_cannot_run_twice_goes_to_the_engine_thread():
    res = run_ranks(premul_in_place, 2, timeout=80, env=_nodes(2))
    for rank, (t, _) in res.items():
        assert t == [0.5 * (2 * i + 1) for i in range(4)], (rank, t)
    assert res[0][1], res[0]  # rank 0's engine thread ran it


def mismatch_while_deferred(rank, world):
    """Rank 0's async all_reduce is deferred; rank 1 calls all_gather instead. Rank 0's
    wait must name both calls, not hang or return wrong data."""
    dist.barrier()
    if rank == 1:
        time.sleep(LATE)
        try:
            dist.all_gather_into_tensor(torch.empty(8), torch.ones(4))
        except Exception as e:  # noqa: BLE001 - what it says is the result
            return type(e).__name__, str(e)
        return None
    w = dist.all_reduce(torch.ones(4), async_op=True)
    try:
        w.wait()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


@pytest.mark.timeout(90)
def test_a_mismatch_found_after_deferral_names_both_calls():
    res = run_ranks(mismatch_while_deferred, 2, timeout=80, env=_nodes(2), pg_timeout=20)
    name, text = res[0]
    assert name == "CollectiveMismatchError", res[0]
    assert "all_reduce" in text and "all_gather" in text, text
    assert res[1] is not None and "all_gather" in res[1][1], res[1]


def coalesced_late_peer(rank, world):
    """allreduce_coalesced concatenates its tensors afresh each time it runs, so it cannot
    run again with the messages of a first run: it must not be deferred that way."""
    import warnings

    dist.barrier()
    a, b = torch.full((3,), float(rank + 1)), torch.full((5,), float(10 * (rank + 1)))
    if rank == 1:
        time.sleep(LATE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (deprecated in c10d, still served)
        dist.all_reduce_coalesced([a, b], async_op=True).wait()
    return a.tolist(), b.tolist()


@pytest.mark.timeout(90)
def test_allreduce_coalesced_with_a_late_peer():
    res = run_ranks(coalesced_late_peer, 2, timeout=80, env=_nodes(2))
    for rank, (a, b) in res.items():
        assert a == [3.0] * 3 and b == [30.0] * 5, (rank, a, b)


def non_contiguous_late_peer(rank, world):
    """Deferred async collectives on non-contiguous tensors: each runs on a contiguous copy,
    and the copy back into the caller's tensor must happen when the deferred call is
    finished (NetCall.resume), not only when it runs through."""
    dist.barrier()
    t = (torch.arange(12.0).reshape(3, 4) + 10 * rank).t()  # 4 x 3, not contiguous
    ag = torch.zeros(3, 2 * world).t()  # (2 * world) x 3, not contiguous
    if rank == 1:
        time.sleep(LATE)
    works = [dist.all_reduce(t, async_op=True),
             dist.all_gather_into_tensor(ag, torch.full((2, 3), float(rank + 1)),
                                         async_op=True)]
    for w in works:
        w.wait()
    return t.tolist(), ag.tolist()


@pytest.mark.timeout(90)
def test_deferred_collectives_on_non_contiguous_tensors():
    res = run_ranks(non_contiguous_late_peer, 2, timeout=80, env=_nodes(2))
    want_t = (2 * torch.arange(12.0).reshape(3, 4) + 10).t().tolist()
    want_ag = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)]).tolist()
    for rank, (t, ag) in res.items():
        assert t == want_t, (rank, t)
        assert ag == want_ag, (rank, ag)
