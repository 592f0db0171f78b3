"""The express lane (small synchronous all_reduce, broadcast, all_gather_into_tensor,
reduce_scatter_tensor and evenly split all_to_all_single run in the caller's thread).

It must be indistinguishable from the general path: the two interoperate step for step,
keep issue order behind queued async work, report mismatches and failures the same way,
appear in the flight recorder, and recycle a Work only when nothing else holds it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.harness import run_ranks
from neuron_dist.flight_recorder import recorder


def _pg():
    return dist.distributed_c10d._get_default_group()


def _mismatch_naming(msg: str, *calls: str) -> None:
    assert msg.startswith("CollectiveMismatchError"), msg
    for call in calls:
        assert call in msg, msg


def _expected(op, fold, values):
    """What reducing ``values`` (one per rank) with ``op`` gives."""
    if op == dist.ReduceOp.PRODUCT:
        out = 1
        for v in values:
            out *= v
        return out
    if op == dist.ReduceOp.AVG:
        return sum(values) / len(values)
    return fold(values)


def mixed_paths(rank, world):
    """Ranks alternate between the express lane and the general (async) path, with every
    dtype and op the lane serves, and results must be exact."""
    fails = []
    ops = [(dist.ReduceOp.SUM, sum), (dist.ReduceOp.MAX, max), (dist.ReduceOp.MIN, min),
           (dist.ReduceOp.PRODUCT, None), (dist.ReduceOp.AVG, None)]
    for i in range(60):
        op, fold = ops[i % len(ops)]
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            if op == dist.ReduceOp.AVG and dtype == torch.int64:
                continue
            t = torch.full((3,), rank + 1 + i % 3, dtype=dtype)
            expect = _expected(op, fold, [k + 1 + i % 3 for k in range(world)])
            if (i + rank) % 2:  # ranks disagree on the path for every other call
                dist.all_reduce(t, op=op, async_op=True).wait()
            else:
                dist.all_reduce(t, op=op)
            if not torch.equal(t, torch.full((3,), expect, dtype=dtype)):
                fails.append((i, str(op), str(dtype), t.tolist(), expect))
    return fails


def test_express_and_general_paths_interoperate():
    results = run_ranks(mixed_paths, 3, timeout=120)
    assert all(v == [] for v in results.values()), results


def keeps_issue_order(rank, world):
    """A sync all_reduce issued behind a queued async one must run after it."""
    big = torch.full((4_000_000,), float(rank + 1))
    small = torch.full((2,), float(rank + 1))
    work = dist.all_reduce(big, async_op=True)
    dist.all_reduce(small)  # engine busy: takes the general path, queued behind `big`
    work.wait()
    return big[:3].tolist(), small.tolist()


def test_sync_call_behind_async_work_keeps_issue_order():
    results = run_ranks(keeps_issue_order, 2, timeout=120)
    for big, small in results.values():
        assert big == [3.0] * 3 and small == [3.0, 3.0]


def recycling(rank, world):
    pg = _pg()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    a, b = torch.ones(2), torch.ones(2) * 2
    kept = pg.allreduce([a], opts)
    again = pg.allreduce([b], opts)  # `kept` is still referenced: a new Work
    fut = again.get_future()
    third = pg.allreduce([torch.ones(2)], opts)
    del kept
    return (again is not third, fut.value()[0].tolist(), again.result()[0].tolist(),
            a.tolist())


def test_a_work_someone_holds_is_never_recycled():
    results = run_ranks(recycling, 2, timeout=60)
    for distinct, fut_value, result, a in results.values():
        assert distinct
        assert fut_value == [4.0, 4.0] and result == [4.0, 4.0]
        assert a == [2.0, 2.0]


def mismatch(rank, world):
    t = torch.ones(2 if rank == 0 else 3)
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
    else:
        msg = "no error"
    dist.all_reduce(torch.ones(1))  # the group is still usable afterwards (one node)
    records = [r for r in recorder._ring if r.op == "all_reduce"]
    return msg, [(r.seq, r.state) for r in records[-2:]]


def test_express_mismatch_names_both_calls_and_is_recorded():
    results = run_ranks(mismatch, 2, timeout=60)
    for rank, (msg, records) in results.items():
        assert msg.startswith("CollectiveMismatchError"), msg
        assert "all_reduce(float32, 2 elements, SUM)" in msg
        assert "all_reduce(float32, 3 elements, SUM)" in msg
        assert records == [(1, "failed"), (2, "completed")], records


def broadcast_mixed_paths(rank, world):
    """Broadcasts from every root, dtype and shape (0-d too, and one above the 64 KiB of
    NEURON_DIST_SMALL_BYTES: the lane serves up to a slot), ranks alternating between the
    express lane (sync) and the general path (async): the root's values everywhere."""
    fails = []
    shapes = [(), (3,), (2, 5), (256, 257), (7,)]
    for i in range(36):
        root = i % world
        shape = shapes[i % len(shapes)]
        for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
            value = (root + 1 + i) % 7 if dtype is not torch.bool else bool((root + i) % 2)
            t = torch.full(shape, value if rank == root else 0, dtype=dtype)
            if (i + rank) % 2:
                dist.broadcast(t, root, async_op=True).wait()
            else:
                dist.broadcast(t, root)
            if not torch.equal(t, torch.full(shape, value, dtype=dtype)):
                fails.append((i, root, str(dtype), t.tolist(), value))
    plans = [k for k, plan in _pg()._express._entries.items()
             if k[0] == "broadcast" and plan is not None]
    records = [r for r in recorder._ring if r.op == "broadcast"]
    return fails, len(plans), len(records), {(r.state, r.algo) for r in records}


def test_express_broadcast_interoperates_with_the_general_path():
    results = run_ranks(broadcast_mixed_paths, 3, timeout=120)
    for rank, (fails, plans, records, states) in results.items():
        assert fails == [], (rank, fails)
        assert plans == 15 * 4, plans  # the lane served every (root and shape, dtype) it saw
        # (both paths name the one algorithm)
        assert records == 36 * 4 and states == {("completed", "slots")}, (records, states)


def broadcast_mismatch(rank, world):
    out = []
    for a, b in (("root", None), ("op", None)):
        t = torch.ones(4)
        try:
            if a == "root":
                dist.broadcast(t, 0 if rank == 0 else 1)  # ranks disagree on the root
            elif rank == 0:
                dist.broadcast(t, 0)
            else:
                dist.all_reduce(t)
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
        else:
            out.append("no error")
    dist.broadcast(torch.ones(1), 0)  # the group is still usable afterwards
    return out


def test_express_broadcast_mismatch_names_both_calls():
    results = run_ranks(broadcast_mismatch, 2, timeout=60)
    for rank, (root_msg, op_msg) in results.items():
        _mismatch_naming(root_msg, "broadcast(float32, 4 elements, root=0)",
                         "broadcast(float32, 4 elements, root=1)")
        _mismatch_naming(op_msg, "broadcast(float32, 4 elements, root=0)",
                         "all_reduce(float32, 4 elements, SUM)")


def all_gather_mixed_paths(rank, world):
    """all_gather_into_tensor calls, ranks alternating between the express lane and the
    general path, over dtypes and shapes (0-d too, and one above the 64 KiB of
    NEURON_DIST_SMALL_BYTES: the lane serves up to a slot), plus the in-place form FSDP uses
    (the input is this rank's block of the output)."""
    fails = []
    shapes = [(), (3,), (2, 5), (128, 257), (7,)]
    for i in range(24):
        shape = shapes[i % len(shapes)]
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            inp = torch.full(shape, rank * 10 + i % 5, dtype=dtype)
            out = torch.full((world * inp.numel(),), -1, dtype=dtype)
            if (i + rank) % 2:
                dist.all_gather_into_tensor(out, inp, async_op=True).wait()
            else:
                dist.all_gather_into_tensor(out, inp)
            expect = torch.cat([torch.full((inp.numel(),), k * 10 + i % 5, dtype=dtype)
                                for k in range(world)])
            if not torch.equal(out, expect):
                fails.append((i, str(dtype), out.tolist()))
    out = torch.zeros(world * 4)
    mine = out[rank * 4:(rank + 1) * 4]
    mine.fill_(rank + 1)
    dist.all_gather_into_tensor(out, mine)
    if not torch.equal(out, torch.arange(1, world + 1).float().repeat_interleave(4)):
        fails.append(("in place", out.tolist()))
    plans = [k for k, plan in _pg()._express._entries.items()
             if k[0] == "all_gather" and plan is not None]
    return fails, len(plans)


def test_express_all_gather_interoperates_with_the_general_path():
    results = run_ranks(all_gather_mixed_paths, 3, timeout=120)
    for rank, (fails, plans) in results.items():
        assert fails == [], (rank, fails)
        assert plans == 5 * 3 + 1, plans  # every (shape, dtype) seen, and the in-place call


def all_gather_mismatch(rank, world):
    try:
        dist.all_gather_into_tensor(torch.empty(world * (2 + rank)), torch.ones(2 + rank))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_express_all_gather_mismatch_names_both_calls():
    results = run_ranks(all_gather_mismatch, 2, timeout=60)
    for msg in results.values():
        assert msg.startswith("CollectiveMismatchError"), msg
        assert "all_gather(float32, 4 elements)" in msg and "all_gather(float32, 6 elements)" in msg


def all_to_all_mixed_paths(rank, world):
    """Small evenly split all_to_all_single calls, ranks alternating between the express lane
    and the general path, over dtypes and shapes, in place too, and the same call with the
    split sizes spelled out (general path) against the even form on the others."""
    fails = []
    for i in range(24):
        rows = world * (1 + i % 3)
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            inp = (torch.arange(rows * 2, dtype=torch.int64).view(rows, 2) + 100 * rank + i).to(dtype)
            out = torch.full((rows, 2), -1, dtype=dtype)
            if (i + rank) % 3 == 1:
                dist.all_to_all_single(out, inp, async_op=True).wait()
            elif (i + rank) % 3 == 2:
                split = [rows // world] * world
                dist.all_to_all_single(out, inp, split, split)
            else:
                dist.all_to_all_single(out, inp)
            per = rows // world
            expect = torch.cat([(torch.arange(rows * 2, dtype=torch.int64).view(rows, 2)
                                 + 100 * k + i)[rank * per:(rank + 1) * per] for k in range(world)])
            if not torch.equal(out, expect.to(dtype)):
                fails.append((i, str(dtype), out.tolist()))
    big = torch.arange(world * 16384).float() + 1e6 * rank  # 64 KiB blocks: the lane too
    got = torch.empty_like(big)
    dist.all_to_all_single(got, big)
    if not torch.equal(got, torch.cat([big[rank * 16384:(rank + 1) * 16384] - 1e6 * (rank - k)
                                       for k in range(world)])):
        fails.append("64 KiB blocks")
    t = torch.arange(world * 3).float() + 10 * rank
    dist.all_to_all_single(t, t)  # in place
    expect = torch.cat([torch.arange(rank * 3, rank * 3 + 3).float() + 10 * k for k in range(world)])
    if not torch.equal(t, expect):
        fails.append(("in place", t.tolist()))
    plans = [k for k, plan in _pg()._express._entries.items()
             if k[0] == "all_to_all" and plan is not None]
    records = [r for r in recorder._ring if r.op == "all_to_all_single"]
    return fails, len(plans), {r.state for r in records}


def test_express_all_to_all_interoperates_with_the_general_path():
    results = run_ranks(all_to_all_mixed_paths, 3, timeout=120)
    for rank, (fails, plans, states) in results.items():
        assert fails == [], (rank, fails)
        # a rank takes the lane when (i + rank) % 3 == 0: one row count, three dtypes; and
        # the 64 KiB-block and in-place calls
        assert plans == 3 + 2, plans
        assert states == {"completed"}, states


def _outcome(call) -> str:
    """``call()``'s error as "Type: message", or "no error"."""
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def all_to_all_mismatch(rank, world):
    """Rank 0 asks for uneven splits (general path), rank 1 calls the even form (express):
    both fail naming the disagreeing pair; then a call that differs in dtype."""
    inp = torch.ones(4)
    uneven = _outcome(lambda: dist.all_to_all_single(torch.empty(4), inp, [1, 3], [1, 3])
                      if rank == 0 else dist.all_to_all_single(torch.empty(4), inp))
    t = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int64)
    dtype = _outcome(lambda: dist.all_to_all_single(torch.empty_like(t), t))
    return uneven, dtype


def test_express_all_to_all_mismatch_names_the_ranks():
    results = run_ranks(all_to_all_mismatch, 2, timeout=60)
    for rank, (splits, dtype) in results.items():
        _mismatch_naming(splits, "rank 0 sends 3 elements to rank 1 but rank 1 expects 2 from rank 0",
                         "rank 1 sends 2 elements to rank 0 but rank 0 expects 3 from rank 1")
        _mismatch_naming(dtype, "all_to_all(float32", "all_to_all(int64")


def reduce_scatter_mixed_paths(rank, world):
    """Small reduce_scatter_tensor calls, ranks alternating between the express lane and the
    general path, over ops, dtypes and output shapes (the lane takes 1-D outputs, as FSDP's;
    0-d and 2-D ones take the general path): exact results."""
    fails = []
    ops = [(dist.ReduceOp.SUM, sum), (dist.ReduceOp.MAX, max), (dist.ReduceOp.AVG, None),
           (dist.ReduceOp.PRODUCT, None)]
    shapes = [(), (3,), (2, 5)]
    for i in range(24):
        op, fold = ops[i % len(ops)]
        shape = shapes[i % len(shapes)]
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            if op == dist.ReduceOp.AVG and dtype == torch.int64:
                continue
            m = max(1, int(torch.tensor(shape).prod()))
            inp = torch.cat([torch.full((m,), rank + 1 + k + i % 2, dtype=dtype)
                             for k in range(world)])
            out = torch.full(shape, -7, dtype=dtype)
            if (i + rank) % 2:
                dist.reduce_scatter_tensor(out, inp, op=op, async_op=True).wait()
            else:
                dist.reduce_scatter_tensor(out, inp, op=op)
            # rank j's block `rank` holds j + 1 + rank + i % 2
            expect = _expected(op, fold, [j + 1 + rank + i % 2 for j in range(world)])
            if not torch.equal(out, torch.full(shape, expect, dtype=dtype)):
                fails.append((i, str(op), str(dtype), out.tolist(), expect))
    plans = [k for k, plan in _pg()._express._entries.items()
             if k[0] == "reduce_scatter" and plan is not None]
    return fails, sorted({len(k[3]) for k in plans}), len(plans)


def test_express_reduce_scatter_interoperates_with_the_general_path():
    results = run_ranks(reduce_scatter_mixed_paths, 3, timeout=120)
    for rank, (fails, dims, plans) in results.items():
        assert fails == [], (rank, fails)
        assert dims == [1] and plans >= 3, (dims, plans)  # served: 1-D outputs only


def reduce_scatter_mismatch(rank, world):
    n = 2 + rank
    return _outcome(lambda: dist.reduce_scatter_tensor(torch.empty(n), torch.ones(world * n)))


def test_express_reduce_scatter_mismatch_names_both_calls():
    results = run_ranks(reduce_scatter_mismatch, 2, timeout=60)
    for msg in results.values():
        _mismatch_naming(msg, "reduce_scatter(float32, 4 elements, SUM)",
                         "reduce_scatter(float32, 6 elements, SUM)")


def all_to_all_uneven_elsewhere(rank, world):
    """Rank 0 calls the even form (the lane: one step); ranks 1 and 2 spell out splits that
    agree with rank 0's but exchange more than a slot's block between themselves, so they
    take more steps: rank 0 must keep step with them (the next call checks it)."""
    small, big = 4, 100_000  # floats: 16 B each way with rank 0; 400 KB between 1 and 2
    sizes = {0: [small] * 3, 1: [small, small, big], 2: [small, big, small]}[rank]
    inp = torch.cat([torch.full((m,), float(10 * rank + k)) for k, m in enumerate(sizes)])
    out = torch.full((sum(sizes),), -1.0)
    if rank == 0:
        dist.all_to_all_single(out, inp)
    else:
        dist.all_to_all_single(out, inp, sizes, sizes)
    expect = torch.cat([torch.full((m,), float(10 * k + rank)) for k, m in enumerate(sizes)])
    after = torch.ones(1)
    dist.all_reduce(after)  # the group is still in step
    lane = [k for k, e in _pg()._express._entries.items() if k[0] == "all_to_all" and e]
    return torch.equal(out, expect), after.item(), len(lane)


def test_express_all_to_all_keeps_step_when_others_split_unevenly():
    for cma in ("1", "0"):  # (the others' extra step: single copy, or a second slot step)
        results = run_ranks(all_to_all_uneven_elsewhere, 3, timeout=120,
                            env={"NEURON_DIST_CMA": cma})
        assert results[0][2] == 1, results  # rank 0 took the lane
        for rank, (ok, after, _) in results.items():
            assert ok and after == 3.0, (cma, rank, ok, after)


def one_plan(rank, world):
    """A call signature served by the lane and by the engine thread (async) runs one plan."""
    t = torch.ones(5)
    dist.all_reduce(t)
    dist.all_reduce(t, async_op=True).wait()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    pg = _pg()
    entries = [e for k, e in pg._express._entries.items() if k[0] == "all_reduce"]
    plans = [p for k, p in pg._plans._plans.items() if k[0] == "all_reduce"]
    return len(plans), all(e.plan is plans[0] for e in entries), len(entries), t.tolist()


def test_the_lane_and_the_engine_run_the_same_plan():
    for nplans, same, entries, t in run_ranks(one_plan, 2, timeout=60).values():
        assert nplans == 1 and same and entries == 2, (nplans, same, entries)
        assert t == [4.0] * 5
