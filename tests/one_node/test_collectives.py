"""Every collective x dtype x reduce op, world sizes 1-8, against exact references.

Each world size is one multi-process job that runs the whole matrix and reports every
mismatch (keeping process start-ups, the slow part, to a minimum). A small slot size
(64 KiB) makes modest tensors take the multi-chunk, pipelined paths.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.cases import ALL_DTYPES, close, make, ops_for, reduce_ref, torch_op
from helpers.harness import run_ranks

SMALL_SLOTS = {"NEURON_DIST_SHM_SLOT_BYTES": "64K", "NEURON_DIST_SMALL_BYTES": "4K",
               "NEURON_DIST_SHM_MAILBOX_BYTES": "16K"}
SIZES = [0, 1, 7, 1000, 40_003]  # 40_003 float32 = 160 KB: three 64 KiB slots


def _check(fails, ok, what):
    if not ok:
        fails.append(what)


def all_reduce_matrix(rank, world):
    fails = []
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            sizes = SIZES if dtype in (torch.float32, torch.bfloat16, torch.int64) else SIZES[:4]
            for n in sizes:
                t = make(rank, n, dtype, op=op)
                dist.all_reduce(t, op=torch_op(op))
                ref = reduce_ref([make(k, n, dtype, op=op) for k in range(world)], op, dtype)
                _check(fails, close(t, ref, dtype), f"all_reduce {dtype} {op} n={n}")
    # non-contiguous, multi-dimensional
    base = torch.stack([make(rank, 30, torch.float32, salt=s) for s in range(4)])  # 4 x 30
    t = base.t()  # 30 x 4, not contiguous
    dist.all_reduce(t)
    ref = sum(torch.stack([make(k, 30, torch.float32, salt=s) for s in range(4)]) for k in range(world)).t()
    _check(fails, torch.equal(t, ref), "all_reduce non-contiguous")
    # a 0-dim tensor
    s = torch.tensor(float(rank + 1))
    dist.all_reduce(s)
    _check(fails, s.item() == world * (world + 1) / 2, "all_reduce 0-dim")
    # PREMUL_SUM with a tensor factor
    t = make(rank, 100, torch.float32)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor(0.25)))
    ref = sum(make(k, 100, torch.float32) * 0.25 for k in range(world))
    _check(fails, torch.allclose(t, ref), "all_reduce PREMUL_SUM tensor factor")
    # coalesced
    ts = [make(rank, 5, torch.float32), make(rank, 9, torch.float32, salt=1).view(3, 3),
          make(rank, 3, torch.float32, salt=2)]
    dist.all_reduce_coalesced(ts)
    for i, (t, n, salt) in enumerate(zip(ts, (5, 9, 3), (0, 1, 2))):
        dt = torch.float32
        ref = reduce_ref([make(k, n, dt, salt=salt) for k in range(world)], "SUM", dt)
        _check(fails, torch.equal(t.reshape(-1), ref), f"allreduce_coalesced tensor {i}")
    return fails


def gather_family_matrix(rank, world):
    fails = []
    for dtype in ALL_DTYPES:
        for n in (SIZES if dtype in (torch.float32, torch.uint8) else SIZES[:4]):
            inputs = [make(k, n, dtype) for k in range(world)]
            # all_gather (list) and into a tensor
            outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, inputs[rank])
            _check(fails, all(torch.equal(o, i) for o, i in zip(outs, inputs)), f"all_gather {dtype} n={n}")
            big = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(big, inputs[rank])
            _check(fails, torch.equal(big, torch.cat(inputs)), f"all_gather_into_tensor {dtype} n={n}")
            # broadcast, gather and scatter from every root
            for root in range(world):
                b = inputs[rank].clone()
                dist.broadcast(b, src=root)
                _check(fails, torch.equal(b, inputs[root]), f"broadcast {dtype} n={n} root={root}")
            root = world - 1
            gl = [torch.empty(n, dtype=dtype) for _ in range(world)] if rank == root else None
            dist.gather(inputs[rank], gl, dst=root)
            if rank == root:
                _check(fails, all(torch.equal(o, i) for o, i in zip(gl, inputs)), f"gather {dtype} n={n}")
            out = torch.empty(n, dtype=dtype)
            pieces = [make(root, n, dtype, salt=k) for k in range(world)]
            dist.scatter(out, pieces if rank == root else None, src=root)
            _check(fails, torch.equal(out, pieces[rank]), f"scatter {dtype} n={n}")
    # uneven all_gather (list form)
    sizes = [k + 1 for k in range(world)]
    outs = [torch.empty(s) for s in sizes]
    dist.all_gather(outs, torch.full((sizes[rank],), float(rank)))
    _check(fails, all(torch.equal(o, torch.full((s,), float(k))) for k, (o, s) in enumerate(zip(outs, sizes))),
           "uneven all_gather")
    # all_gather_into_tensor coalesced
    ins = [make(rank, 6, torch.float32), make(rank, 2, torch.float32, salt=1)]
    outs = [torch.empty(world * 6), torch.empty(world * 2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    _check(fails, torch.equal(outs[0], torch.cat([make(k, 6, torch.float32) for k in range(world)])) and
           torch.equal(outs[1], torch.cat([make(k, 2, torch.float32, salt=1) for k in range(world)])),
           "all_gather_into_tensor coalesced")
    # objects
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "data": list(range(rank))})
    _check(fails, objs == [{"rank": k, "data": list(range(k))} for k in range(world)], "all_gather_object")
    lst = [f"hello {rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    _check(fails, lst == ["hello 0", 0], "broadcast_object_list")
    got = [None] * world if rank == 0 else None
    dist.gather_object(("x", rank), got, dst=0)
    if rank == 0:
        _check(fails, got == [("x", k) for k in range(world)], "gather_object")
    recv = [None]
    dist.scatter_object_list(recv, [k * 10 for k in range(world)] if rank == 0 else None, src=0)
    _check(fails, recv == [rank * 10], "scatter_object_list")
    return fails


def reduce_family_matrix(rank, world):
    fails = []
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for n in ((0, 3, 1000, 20_011) if dtype in (torch.float32, torch.bfloat16) else (3, 1000)):
                full = [make(k, world * n, dtype, op=op) for k in range(world)]
                ref = reduce_ref(full, op, dtype)
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, full[rank], op=torch_op(op))
                _check(fails, close(out, ref[rank * n:(rank + 1) * n], dtype),
                       f"reduce_scatter_tensor {dtype} {op} n={n}")
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(out, list(full[rank].chunk(world)) if n else
                                    [torch.empty(0, dtype=dtype)] * world, op=torch_op(op))
                _check(fails, close(out, ref[rank * n:(rank + 1) * n], dtype),
                       f"reduce_scatter list {dtype} {op} n={n}")
                root = n % world
                t = full[rank][:n].clone()
                dist.reduce(t, dst=root, op=torch_op(op))
                if rank == root:
                    rref = reduce_ref([f[:n] for f in full], op, dtype)
                    _check(fails, close(t, rref, dtype), f"reduce {dtype} {op} n={n} root={root}")
    # reduce_scatter_tensor coalesced (what funcol/DTensor use)
    ins = [make(rank, world * 4, torch.float32), make(rank, world * 3, torch.float32, salt=2)]
    outs = [torch.empty(4), torch.empty(3)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i)
    cm.wait()
    r0 = sum(make(k, world * 4, torch.float32) for k in range(world))[rank * 4:(rank + 1) * 4]
    r1 = sum(make(k, world * 3, torch.float32, salt=2) for k in range(world))[rank * 3:(rank + 1) * 3]
    _check(fails, torch.equal(outs[0], r0) and torch.equal(outs[1], r1), "reduce_scatter coalesced")
    # uneven reduce_scatter (list form)
    sizes = [k + 2 for k in range(world)]
    ins = [make(rank, s, torch.float32, salt=k) for k, s in enumerate(sizes)]
    out = torch.empty(sizes[rank])
    dist.reduce_scatter(out, ins)
    ref = sum(make(k, sizes[rank], torch.float32, salt=rank) for k in range(world))
    _check(fails, torch.equal(out, ref), "uneven reduce_scatter")
    return fails


def alltoall_matrix(rank, world):
    fails = []
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.uint8):
        for per in (0, 1, 5, 9000):
            inp = make(rank, world * per, dtype)
            out = torch.empty(world * per, dtype=dtype)
            dist.all_to_all_single(out, inp)
            ref = torch.cat([make(k, world * per, dtype)[rank * per:(rank + 1) * per] for k in range(world)])
            _check(fails, torch.equal(out, ref), f"all_to_all_single even {dtype} per={per}")
    # uneven: rank r sends (r + k + 1) rows of width 3 to rank k
    def send_rows(src, dst):
        return (src + dst + 1) % 4

    ins = [torch.full((send_rows(rank, k), 3), float(100 * rank + k)) for k in range(world)]
    inp = torch.cat(ins)
    out = torch.empty(sum(send_rows(k, rank) for k in range(world)), 3)
    dist.all_to_all_single(out, inp, output_split_sizes=[send_rows(k, rank) for k in range(world)],
                           input_split_sizes=[send_rows(rank, k) for k in range(world)])
    ref = torch.cat([torch.full((send_rows(k, rank), 3), float(100 * k + rank)) for k in range(world)])
    _check(fails, torch.equal(out, ref), "all_to_all_single uneven")
    # list form
    ins = [torch.full((k + 1,), float(rank)) for k in range(world)]
    outs = [torch.empty(rank + 1) for _ in range(world)]
    dist.all_to_all(outs, ins)
    _check(fails, all(torch.equal(o, torch.full((rank + 1,), float(k))) for k, o in enumerate(outs)),
           "all_to_all list")
    dist.barrier()
    return fails


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("matrix", [all_reduce_matrix, gather_family_matrix,
                                    reduce_family_matrix, alltoall_matrix],
                         ids=["all_reduce", "gather_family", "reduce_family", "alltoall"])
def test_matrix(world, matrix):
    results = run_ranks(matrix, world, env=SMALL_SLOTS, timeout=240)
    fails = {r: f for r, f in results.items() if f}
    assert not fails, fails


def big_all_reduce(rank, world):
    fails = []
    for dtype in (torch.float32, torch.bfloat16):
        n = 3_000_001  # 12 MB of float32: several default (1 MiB) slots, odd length
        t = torch.arange(n, dtype=torch.float32).remainder_(97).to(dtype) * (rank + 1)
        dist.all_reduce(t)
        ref = torch.arange(n, dtype=torch.float32).remainder_(97) * (world * (world + 1) / 2)
        _check(fails, torch.allclose(t.float(), ref, rtol=1e-2), f"big all_reduce {dtype}")
    return fails


@pytest.mark.parametrize("world", [2, 3])
def test_big_all_reduce_default_slots(world):
    results = run_ranks(big_all_reduce, world, timeout=120)
    assert not any(results.values()), results
