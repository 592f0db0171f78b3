"""The one-node collective algorithms, run by threads over the fake step channel.

Every algorithm a one-node group runs (collectives/allreduce.py, allgather.py,
reduce_scatter.py, broadcast.py, rooted.py, alltoall.py, barrier.py, and single_copy.py's
when ranks may read each other's memory) runs on N ranks as threads of this process
(helpers/fake_channel.py: no processes, no shared memory), for world sizes 1 to 8, dtypes,
reduce ops, roots and sizes on both sides of the slot and chunk boundaries, against
references computed in plain torch from every rank's input (helpers/cases.py: small
integers, so every sum is exact; results must also be bit-identical on every rank). Slots
are small (``SLOT`` bytes) so that modest tensors take the multi-step paths, and each world
runs its whole matrix as consecutive calls on one group, as a process group does, so slots
and descriptors are reused from call to call.
"""

from __future__ import annotations

import math
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from neuron_dist.collectives import (allgather, allreduce, alltoall, barrier, broadcast,
                                     reduce_scatter, rooted, single_copy)
from neuron_dist.collectives.context import Context
from neuron_dist.collectives.descriptor import Call, CollectiveMismatch, digest
from neuron_dist.collectives.reduce_ops import ReduceSpec
from neuron_dist.collectives.selection import SINGLE_COPY_BYTES, parse_overrides
from neuron_dist.config import parse_bytes
from neuron_dist.transport.errors import StepDeferred

from helpers.cases import close, make, ops_for, premul_factor, reduce_ref
from helpers.fake_channel import FakeGroup

pytestmark = pytest.mark.timeout(240)

SLOT = 1024  # bytes per slot: 256 float32
SMALL = 256  # all_reduce up to this many bytes takes the one-step path
WORLDS = [1, 2, 3, 5, 8]
REDUCE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                 torch.uint8, torch.int32, torch.int64, torch.bool]
FEW_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def spec(op: str) -> ReduceSpec:
    return ReduceSpec(op, premul_factor() if op == "PREMUL_SUM" else None)


def random_bytes(n: int, *seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(seed) & 0x7FFFFFFF)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def run(world: int, body, cma: bool = False, algo: str = "") -> tuple[FakeGroup, list]:
    group = FakeGroup(world, SLOT, cma=cma, small_bytes=SMALL,
                      overrides=parse_overrides(algo, parse_bytes))
    return group, group.run(body, timeout=180)


def check_reduced(failures: list, label: str, results: list, ref, dtype) -> None:
    """Every rank's result equals ``ref`` and rank 0's, bit for bit."""
    for r, got in enumerate(results):
        if not close(got, ref, dtype):
            failures.append(f"{label}: rank {r} {first_difference(got, ref)}")
        elif not torch.equal(got, results[0]):
            failures.append(f"{label}: rank {r}'s result differs from rank 0's")


def first_difference(got, ref) -> str:
    """Where ``got`` first differs from ``ref``, for a failure message."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"got {got.dtype} {tuple(got.shape)}, expected {ref.dtype} {tuple(ref.shape)}"
    g, e = got.flatten().double(), ref.flatten().double()
    bad = (~torch.isclose(g, e, rtol=1e-2, atol=1e-2)).nonzero()
    i = int(bad[0]) if len(bad) else 0
    return f"got {g[i].item()} at [{i}] of {g.numel()}, expected {e[i].item()}"


def report(failures: list) -> None:
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])


# --------------------------------------------------------------------------- all_reduce
def all_reduce_cases():
    for dtype in REDUCE_DTYPES:
        cap, small = SLOT // dtype.itemsize, SMALL // dtype.itemsize
        shapes = [(0,), (1,), (2, 3), (small,), (small + 1,), (cap - 1,), (cap,), (cap + 1,),
                  (3, cap // 2 + 1), (2 * cap + 3,)]
        for op in ops_for(dtype):
            for shape in shapes:
                yield dtype, op, shape


@pytest.mark.parametrize("world,algo", [(w, "") for w in WORLDS] + [
    (2, "all_reduce=two_step"), (3, "all_reduce=one_step")])  # (what the defaults don't pick)
def test_all_reduce(world, algo):
    cases = list(all_reduce_cases())

    def body(ch):
        outs = []
        for i, (dtype, op, shape) in enumerate(cases):
            n = math.prod(shape)
            inp = make(ch.rank, n, dtype, salt=i, op=op).view(shape)
            out = inp if i % 2 else torch.zeros_like(inp)  # in place, and not
            allreduce.all_reduce(ch.context(Call("all_reduce", dtype, n, reduce=op)),
                                 out, inp, spec(op))
            outs.append(out)
        return outs

    group, results = run(world, body, algo=algo)
    if algo:  # (the table's choice, as every rank's context asked it)
        assert allreduce.choose(group.selection, group, 2 * SLOT, 1) == algo.split("=")[1]
    failures = []
    for i, (dtype, op, shape) in enumerate(cases):
        n = math.prod(shape)
        ref = reduce_ref([make(r, n, dtype, salt=i, op=op) for r in range(world)], op, dtype)
        check_reduced(failures, f"all_reduce {dtype} {op} {shape}",
                      [res[i] for res in results], ref.view(shape), dtype)
    report(failures)


# ---------------------------------------------------------------------- reduce_scatter
def per_block(world: int, es: int = 1, header: int = 0) -> int:
    """Elements of one rank's block in a slot cut into ``world`` 64-byte aligned blocks."""
    return ((SLOT - header) // world) // 64 * 64 // es


def split_patterns(world: int, per: int) -> list[list[int]]:
    return [[0] * world, [1] * world, [per - 1] * world, [per] * world, [per + 1] * world,
            [2 * per + 3] * world, [k * per // 2 + k for k in range(world)]]


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter(world):
    cases = [(dtype, op, sizes) for dtype in FEW_DTYPES + [torch.int8]
             for op in ops_for(dtype)
             for sizes in split_patterns(world, per_block(world, dtype.itemsize))]

    def inputs(rank, i, dtype, op, sizes):
        return [make(rank, m, dtype, salt=64 * i + k, op=op) for k, m in enumerate(sizes)]

    def body(ch):
        outs = []
        for i, (dtype, op, sizes) in enumerate(cases):
            out = torch.zeros(sizes[ch.rank], dtype=dtype)
            call = Call("reduce_scatter", dtype, sum(sizes), reduce=op, extra=digest(sizes))
            reduce_scatter.reduce_scatter(ch.context(call), out,
                                          inputs(ch.rank, i, dtype, op, sizes), spec(op))
            outs.append(out)
        return outs

    _, results = run(world, body)
    failures = []
    for i, (dtype, op, sizes) in enumerate(cases):
        ins = [inputs(j, i, dtype, op, sizes) for j in range(world)]
        for r in range(world):
            ref = reduce_ref([ins[j][r] for j in range(world)], op, dtype)
            if not close(results[r][i], ref, dtype):
                failures.append(f"reduce_scatter {dtype} {op} {sizes}: rank {r} "
                                f"{first_difference(results[r][i], ref)}")
    report(failures)


# --------------------------------------------------------------------------- all_gather
@pytest.mark.parametrize("world", WORLDS)
def test_all_gather(world):
    cases = split_patterns(world, SLOT) + [
        [2 * SLOT + 5 if k == world - 1 else 0 for k in range(world)],
        [3 * SLOT + 7 if k == 0 else 1 for k in range(world)]]

    def body(ch):
        outs = []
        for i, sizes in enumerate(cases):
            outs.append([torch.full((m,), 0x5A, dtype=torch.uint8) for m in sizes])
            call = Call("all_gather", torch.uint8, sum(sizes), extra=digest(sizes))
            allgather.all_gather(ch.context(call), outs[-1],
                                 random_bytes(sizes[ch.rank], ch.rank, i))
        return outs

    _, results = run(world, body)
    failures = [f"all_gather {sizes}: rank {r}'s block from rank {k} is wrong"
                for i, sizes in enumerate(cases) for r in range(world) for k in range(world)
                if not torch.equal(results[r][i][k], random_bytes(sizes[k], k, i))]
    report(failures)


# ---------------------------------------------------------------------------- broadcast
@pytest.mark.parametrize("world", WORLDS)
def test_broadcast(world):
    cases = [(n, root) for n in (0, 1, SLOT - 1, SLOT, SLOT + 1, 3 * SLOT + 7)
             for root in range(world)]

    def body(ch):
        outs = []
        for i, (n, root) in enumerate(cases):
            buf = random_bytes(n, ch.rank, i)  # the root's is the one that counts
            broadcast.broadcast(ch.context(Call("broadcast", torch.uint8, n, root)), buf, root)
            outs.append(buf)
        return outs

    _, results = run(world, body)
    failures = [f"broadcast of {n} bytes from {root}: rank {r} differs"
                for i, (n, root) in enumerate(cases) for r in range(world)
                if not torch.equal(results[r][i], random_bytes(n, root, i))]
    report(failures)


# ------------------------------------------------------------- rooted: reduce, gather, scatter
@pytest.mark.parametrize("world", WORLDS)
def test_reduce(world):
    cases = [(dtype, op, n, root) for dtype in FEW_DTYPES for op in ops_for(dtype)
             for n in (0, 1, SLOT // dtype.itemsize - 1, SLOT // dtype.itemsize,
                       SLOT // dtype.itemsize + 1, 2 * SLOT // dtype.itemsize + 3)
             for root in sorted({0, world - 1})]
    untouched = 7

    def body(ch):
        outs = []
        for i, (dtype, op, n, root) in enumerate(cases):
            out = torch.full((n,), untouched, dtype=dtype)
            rooted.reduce(ch.context(Call("reduce", dtype, n, root, reduce=op)), out,
                          make(ch.rank, n, dtype, salt=i, op=op), spec(op), root)
            outs.append(out)
        return outs

    _, results = run(world, body)
    failures = []
    for i, (dtype, op, n, root) in enumerate(cases):
        ref = reduce_ref([make(r, n, dtype, salt=i, op=op) for r in range(world)], op, dtype)
        label = f"reduce {dtype} {op} {n} to {root}"
        if not close(results[root][i], ref, dtype):
            failures.append(f"{label}: the root {first_difference(results[root][i], ref)}")
        unchanged = torch.full((n,), untouched, dtype=dtype)
        failures += [f"{label}: rank {r}'s output was written" for r in range(world)
                     if r != root and not torch.equal(results[r][i], unchanged)]
    report(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_gather(world):
    cases = [(n, root) for n in (0, 1, SLOT - 1, SLOT, SLOT + 1, 2 * SLOT + 3)
             for root in range(world)]

    def body(ch):
        outs = []
        for i, (n, root) in enumerate(cases):
            mine = [torch.full((n,), 0x5A, dtype=torch.uint8) for _ in range(world)] \
                if ch.rank == root else []
            rooted.gather(ch.context(Call("gather", torch.uint8, n, root)), mine,
                          random_bytes(n, ch.rank, i), root)
            outs.append(mine)
        return outs

    _, results = run(world, body)
    failures = [f"gather of {n} bytes to {root}: block of rank {k} is wrong"
                for i, (n, root) in enumerate(cases) for k in range(world)
                if not torch.equal(results[root][i][k], random_bytes(n, k, i))]
    report(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_scatter(world):
    per = per_block(world)
    cases = [(n, root) for n in (0, 1, per - 1, per, per + 1, 2 * per + 3)
             for root in range(world)]

    def body(ch):
        outs = []
        for i, (n, root) in enumerate(cases):
            ins = [random_bytes(n, root, k, i) for k in range(world)] if ch.rank == root else []
            out = torch.full((n,), 0x5A, dtype=torch.uint8)
            rooted.scatter(ch.context(Call("scatter", torch.uint8, n, root)), out, ins, root)
            outs.append(out)
        return outs

    _, results = run(world, body)
    failures = [f"scatter of {n} bytes from {root}: rank {r}'s block is wrong"
                for i, (n, root) in enumerate(cases) for r in range(world)
                if not torch.equal(results[r][i], random_bytes(n, root, r, i))]
    report(failures)


# --------------------------------------------------------------------------- all_to_all
def a2a_patterns(world: int) -> list[list[list[int]]]:
    """Split matrices: ``S[i][j]`` bytes go from rank i to rank j."""
    header = -(-16 * world // 64) * 64
    per = per_block(world, header=header)
    rng = random.Random(world)
    fixed = [[[m] * world for _ in range(world)] for m in (0, 1, per, per + 1)]
    uneven = [[rng.randrange(3 * per) for _ in range(world)] for _ in range(world)]
    one_big = [[4 * per + 5 if (i, j) == (0, world - 1) else 0 for j in range(world)]
               for i in range(world)]
    return fixed + [uneven, one_big]


def run_all_to_all(ch, i: int, splits) -> list:
    ins = [random_bytes(splits[ch.rank][j], ch.rank, j, i) for j in range(ch.size)]
    outs = [torch.full((splits[j][ch.rank],), 0x5A, dtype=torch.uint8) for j in range(ch.size)]
    alltoall.all_to_all(ch.context(Call("all_to_all", torch.uint8, 0)), outs, ins, 1)
    return outs


def check_all_to_all(results, cases, world, failures, label="all_to_all") -> None:
    for i, splits in enumerate(cases):
        for j in range(world):
            for k in range(world):
                if not torch.equal(results[j][i][k], random_bytes(splits[k][j], k, j, i)):
                    failures.append(f"{label} {splits}: rank {j}'s block from rank {k} is wrong")


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all(world):
    cases = a2a_patterns(world)
    _, results = run(world, lambda ch: [run_all_to_all(ch, i, s) for i, s in enumerate(cases)])
    failures = []
    check_all_to_all(results, cases, world, failures)
    report(failures)


def test_all_to_all_sizes_that_disagree_fail_on_every_rank_and_the_group_goes_on():
    world = 3

    def body(ch):
        ins = [torch.zeros(4, dtype=torch.uint8) for _ in range(world)]
        outs = [torch.zeros(5 if (ch.rank, j) == (2, 0) else 4, dtype=torch.uint8)
                for j in range(world)]  # rank 2 expects 5 bytes from rank 0, which sends 4
        try:
            alltoall.all_to_all(ch.context(Call("all_to_all", torch.uint8, 0)), outs, ins, 1)
            error = None
        except CollectiveMismatch as exc:
            error = str(exc)
        return error, run_all_to_all(ch, 0, a2a_patterns(world)[-2])

    _, results = run(world, body)
    errors = {e for e, _ in results}
    assert len(errors) == 1 and None not in errors, errors
    assert "rank 0 sends 4 elements to rank 2 but rank 2 expects 5" in errors.pop()
    failures = []
    check_all_to_all([[outs] for _, outs in results], [a2a_patterns(world)[-2]], world,
                     failures, "the all_to_all after the failed one")
    report(failures)


# ------------------------------------------------------------------------------ barrier
@pytest.mark.parametrize("world", WORLDS)
def test_barrier_lets_no_rank_through_before_all_arrived(world):
    arrived, lock = [], threading.Lock()

    def body(ch):
        seen = []
        for i in range(3):
            time.sleep(0.002 * ((ch.rank + i) % world))
            with lock:
                arrived.append((i, ch.rank))
            barrier.barrier(ch.context(Call("barrier")))
            with lock:
                seen.append(sum(1 for j, _ in arrived if j == i))
        return seen

    _, results = run(world, body)
    assert all(seen == [world] * 3 for seen in results), results


def test_ranks_calling_different_collectives_fail_together_and_the_group_goes_on():
    world = 3

    def body(ch):
        n = 5 if ch.rank == 1 else 4
        x = torch.ones(n)
        try:
            allreduce.all_reduce(ch.context(Call("all_reduce", torch.float32, n, reduce="SUM")),
                                 x, x, spec("SUM"))
            error = None
        except CollectiveMismatch as exc:
            error = str(exc)
        y = torch.full((3,), float(ch.rank))
        allreduce.all_reduce(ch.context(Call("all_reduce", torch.float32, 3, reduce="SUM")),
                             y, y, spec("SUM"))
        return error, y

    _, results = run(world, body)
    assert all(e and "collective mismatch" in e and "5 elements" in e for e, _ in results), results
    assert all(torch.equal(y, torch.full((3,), 3.0)) for _, y in results), results


# -------------------------------------------------------------------- single copy (CMA)
BIG = SINGLE_COPY_BYTES  # from here the single-copy algorithms run
CHUNK = single_copy.CHUNK_BYTES


@pytest.mark.parametrize("world", [2, 3, 4])
def test_single_copy_algorithms(world):
    reduces = [(torch.float32, op) for op in ("SUM", "AVG", "MAX", "PREMUL_SUM")] + \
        [(torch.bfloat16, "SUM"), (torch.int64, "PRODUCT")]
    ar_cases = [(dtype, op, n) for dtype, op in reduces
                for n in (BIG // dtype.itemsize, world * (CHUNK // dtype.itemsize) + 37)]
    rs_cases = [(dtype, op, [BIG // dtype.itemsize + 3 * k for k in range(world)])
                for dtype, op in reduces]
    ag_cases = [[BIG + 5 * k for k in range(world)], [BIG if k == 0 else 0 for k in range(world)]]
    a2a_cases = [[[0 if (i + j) % 3 == 0 else BIG + 100 * i + j for j in range(world)]
                  for i in range(world)]]

    def body(ch):
        r = ch.rank
        ar = []
        for i, (dtype, op, n) in enumerate(ar_cases):
            inp = make(r, n, dtype, salt=i, op=op)
            out = inp if i % 2 else torch.zeros_like(inp)
            allreduce.all_reduce(ch.context(Call("all_reduce", dtype, n, reduce=op)),
                                 out, inp, spec(op))
            ar.append(out)
        rs = []
        for i, (dtype, op, sizes) in enumerate(rs_cases):
            out = torch.zeros(sizes[r], dtype=dtype)
            ins = [make(r, m, dtype, salt=64 * i + k, op=op) for k, m in enumerate(sizes)]
            call = Call("reduce_scatter", dtype, sum(sizes), reduce=op, extra=digest(sizes))
            reduce_scatter.reduce_scatter(ch.context(call), out, ins, spec(op))
            rs.append(out)
        ag = []
        for i, sizes in enumerate(ag_cases):
            ag.append([torch.zeros(m, dtype=torch.uint8) for m in sizes])
            call = Call("all_gather", torch.uint8, sum(sizes), extra=digest(sizes))
            allgather.all_gather(ch.context(call), ag[-1], random_bytes(sizes[r], r, i))
        a2a = [run_all_to_all(ch, i, s) for i, s in enumerate(a2a_cases)]
        return ar, rs, ag, a2a

    group, results = run(world, body, cma=True)
    assert group.reads > 0, "the single-copy algorithms did not run"
    failures = []
    for i, (dtype, op, n) in enumerate(ar_cases):
        ref = reduce_ref([make(r, n, dtype, salt=i, op=op) for r in range(world)], op, dtype)
        check_reduced(failures, f"single-copy all_reduce {dtype} {op} {n}",
                      [res[0][i] for res in results], ref, dtype)
    for i, (dtype, op, sizes) in enumerate(rs_cases):
        for r in range(world):
            ref = reduce_ref([make(j, sizes[r], dtype, salt=64 * i + r, op=op)
                              for j in range(world)], op, dtype)
            if not close(results[r][1][i], ref, dtype):
                failures.append(f"single-copy reduce_scatter {dtype} {op}: rank {r} "
                                f"{first_difference(results[r][1][i], ref)}")
    for i, sizes in enumerate(ag_cases):
        failures += [f"single-copy all_gather {sizes}: rank {r}'s block from {k} is wrong"
                     for r in range(world) for k in range(world)
                     if not torch.equal(results[r][2][i][k], random_bytes(sizes[k], k, i))]
    check_all_to_all([res[3] for res in results], a2a_cases, world, failures,
                     "single-copy all_to_all")
    report(failures)


def test_all_to_all_runs_the_algorithm_its_table_picks():
    """all_to_all asks the ``all_to_all`` table (NEURON_DIST_ALGO overrides included): the
    algorithm it names is the one that moves the bytes (single copy reads peers' memory),
    a forced single copy that cannot run falls back to slots, and a rank on the even-split
    plan keeps step with peers that single-copy among themselves."""
    world = 3
    big = [[BIG + 7 * i + j for j in range(world)] for i in range(world)]
    mid = [[5000 + 7 * i + j for j in range(world)] for i in range(world)]  # > a slot's block
    # rank 0 sends and receives 16 B (the even-split plan); ranks 1 and 2 exchange 5000 B
    mixed = [[16] * 3, [16, 16, 5000], [16, 5000, 16]]
    cases = [  # (NEURON_DIST_ALGO, cma, splits, the algorithm each rank names)
        ("auto", True, big, ["single_copy"] * 3),
        ("all_to_all=slots", True, big, ["slots"] * 3),
        ("all_to_all=single_copy", True, mid, ["single_copy"] * 3),
        ("auto", True, mid, ["slots"] * 3),
        ("all_to_all=single_copy", False, mid, ["slots"] * 3),  # cannot run: slots
        ("all_to_all:4K-=single_copy", True, mixed, ["slots", "single_copy", "single_copy"]),
    ]
    failures = []
    for text, cma, splits, names in cases:
        def body(ch):
            ins = [random_bytes(splits[ch.rank][j], ch.rank, j, 0) for j in range(world)]
            outs = [torch.full((splits[j][ch.rank],), 0x5A, dtype=torch.uint8)
                    for j in range(world)]
            ctx = ch.context(Call("all_to_all", torch.uint8, 0))
            ctx.record = SimpleNamespace(algo=None)
            alltoall.all_to_all(ctx, outs, ins, 1)
            return outs, ctx.record.algo, ch.plans.get(("all_to_all", 16)) is not None

        group = FakeGroup(world, SLOT, cma=cma, small_bytes=SMALL,
                          overrides=parse_overrides(text, parse_bytes))
        results = group.run(body, timeout=120)
        label = f"{text} cma={cma} {splits}"
        check_all_to_all([[outs] for outs, _, _ in results], [splits], world, failures, label)
        got = [algo for _, algo, _ in results]
        if got != names:
            failures.append(f"{label}: algorithms named {got}, expected {names}")
        if (group.reads > 0) != ("single_copy" in names):
            failures.append(f"{label}: {group.reads} single-copy reads")
        if splits is mixed and not results[0][2]:
            failures.append(f"{label}: rank 0 did not take the even-split plan")
    report(failures)


# ---------------------------------------------------------- a deferred first step (engine.py)
def deferring(ch, gates, i: int, call, fn, *args) -> bool:
    """``fn(ctx, *args)`` as ``CollectiveEngine.try_now`` runs a small async collective:
    rank 0 first with ``defer_once`` while the others are held back, so its first step is
    published and deferred, then the call again from the start (same sequence number);
    the others start once rank 0 has deferred. True if rank 0's call was deferred."""
    if ch.rank:
        gates[i].wait(60)
        fn(ch.context(call), *args)
        return False
    ctx = ch.context(call)
    ch.defer_once = True
    try:
        fn(ctx, *args)
        deferred = False
    except StepDeferred:
        deferred = True
    finally:
        ch.defer_once = False
        gates[i].set()
    if deferred:
        fn(Context(ch, call, ctx.seq, ctx.deadline, ch.scratch, ch.group.selection, ch.plans),
           *args)
    return deferred


@pytest.mark.parametrize("world,cma", [(2, False), (3, False), (5, False), (2, True), (3, True)])
def test_a_call_run_again_after_its_first_step_was_deferred_gives_the_same_results(world, cma):
    # Every algorithm of one node, run again after a deferred first step, stages the same
    # bytes (the fake channel fails a published slot that changes), posts nothing twice,
    # and computes what it computes when run once: all_reduce (one and two steps, in place
    # and not), reduce_scatter, all_gather, broadcast, reduce, gather, scatter, all_to_all
    # (even and uneven), and with cma the single-copy algorithms too.
    f32 = torch.float32
    big = BIG // 4 if cma else 0
    ar = [(dtype, op, n) for dtype in (f32, torch.int64) for op in ("SUM", "MAX")
          for n in (1, SMALL // dtype.itemsize + 1, 2 * SLOT // dtype.itemsize + 3)]
    ar += [(f32, "PREMUL_SUM", 5), (f32, "AVG", 9)] + ([(f32, "SUM", big)] if cma else [])
    sizes = [[SLOT // 2 + k for k in range(world)]]
    sizes += [[BIG + k for k in range(world)]] if cma else []
    a2a = a2a_patterns(world)[2:] + ([[[BIG + i + j for j in range(world)] for i in range(world)]]
                                     if cma else [])
    roots = sorted({0, world - 1})
    n_calls = len(ar) + 2 * len(sizes) + 4 * len(roots) + len(a2a)
    gates = [threading.Event() for _ in range(n_calls)]

    def body(ch):
        r, out, i = ch.rank, {}, iter(range(n_calls))
        deferred = []

        def call(c, fn, *args):
            deferred.append(deferring(ch, gates, next(i), c, fn, *args))

        for j, (dtype, op, n) in enumerate(ar):
            inp = make(r, n, dtype, salt=j, op=op)
            res = inp if j % 2 else torch.zeros_like(inp)
            call(Call("all_reduce", dtype, n, reduce=op), allreduce.all_reduce, res, inp, spec(op))
            out["ar", j] = res
        for j, s in enumerate(sizes):
            res = torch.zeros(s[r])
            ins = [make(r, m, f32, salt=64 * j + k, op="SUM") for k, m in enumerate(s)]
            call(Call("reduce_scatter", f32, sum(s), reduce="SUM", extra=digest(s)),
                 reduce_scatter.reduce_scatter, res, ins, spec("SUM"))
            out["rs", j] = res
            outs = [torch.zeros(m, dtype=torch.uint8) for m in s]
            call(Call("all_gather", torch.uint8, sum(s), extra=digest(s)), allgather.all_gather,
                 outs, random_bytes(s[r], r, j))
            out["ag", j] = outs
        for root in roots:
            buf = random_bytes(SLOT - 3, r, root)
            call(Call("broadcast", torch.uint8, SLOT - 3, root), broadcast.broadcast, buf, root)
            out["bc", root] = buf
            red = torch.zeros(7)
            call(Call("reduce", f32, 7, root, reduce="SUM"), rooted.reduce, red,
                 make(r, 7, f32, salt=root, op="SUM"), spec("SUM"), root)
            out["red", root] = red
            mine = [torch.zeros(11, dtype=torch.uint8) for _ in range(world)] if r == root else []
            call(Call("gather", torch.uint8, 11, root), rooted.gather, mine,
                 random_bytes(11, r, root), root)
            out["ga", root] = mine
            ins = [random_bytes(13, root, k) for k in range(world)] if r == root else []
            sc = torch.zeros(13, dtype=torch.uint8)
            call(Call("scatter", torch.uint8, 13, root), rooted.scatter, sc, ins, root)
            out["sc", root] = sc
        for j, splits in enumerate(a2a):
            ins = [random_bytes(splits[r][k], r, k, j) for k in range(world)]
            outs = [torch.zeros(splits[k][r], dtype=torch.uint8) for k in range(world)]
            call(Call("all_to_all", torch.uint8, 0), alltoall.all_to_all, outs, ins, 1)
            out["a2a", j] = outs
        return out, deferred

    group, results = run(world, body, cma=cma)
    assert all(results[0][1]), f"rank 0 did not defer every call: {results[0][1]}"
    if cma:
        assert group.reads > 0, "the single-copy algorithms did not run"
    failures = []
    for j, (dtype, op, n) in enumerate(ar):
        ref = reduce_ref([make(k, n, dtype, salt=j, op=op) for k in range(world)], op, dtype)
        check_reduced(failures, f"all_reduce {dtype} {op} {n}",
                      [res[0]["ar", j] for res in results], ref, dtype)
    for j, s in enumerate(sizes):
        for r in range(world):
            ref = reduce_ref([make(k, s[r], f32, salt=64 * j + r, op="SUM")
                              for k in range(world)], "SUM", f32)
            if not close(results[r][0]["rs", j], ref, f32):
                failures.append(f"reduce_scatter {s}: rank {r}")
            failures += [f"all_gather {s}: rank {r}'s block from {k}" for k in range(world)
                         if not torch.equal(results[r][0]["ag", j][k], random_bytes(s[k], k, j))]
    for root in roots:
        ref = reduce_ref([make(k, 7, f32, salt=root, op="SUM") for k in range(world)], "SUM", f32)
        if not close(results[root][0]["red", root], ref, f32):
            failures.append(f"reduce to {root}")
        for r in range(world):
            if not torch.equal(results[r][0]["bc", root], random_bytes(SLOT - 3, root, root)):
                failures.append(f"broadcast from {root}: rank {r}")
            if not torch.equal(results[r][0]["sc", root], random_bytes(13, root, r)):
                failures.append(f"scatter from {root}: rank {r}")
            if not torch.equal(results[root][0]["ga", root][r], random_bytes(11, r, root)):
                failures.append(f"gather to {root}: block of rank {r}")
    check_all_to_all([[res[0]["a2a", j] for j in range(len(a2a))] for res in results], a2a,
                     world, failures)
    report(failures)


# --- a call between nodes run again after its last wait was deferred (net.py) ---------------

class _FakeNetRequest:
    def __init__(self):
        self.finished = False

    def done(self):
        return self.finished

    def wait(self, deadline):
        assert self.finished, "a wait that would block"


class _FakeNet:
    """Two ranks' ends of a network that matches sends and receives per (src, dst) in order
    and moves bytes at once; ``posts`` counts what each rank posted."""

    def __init__(self):
        self.sends, self.recvs, self.posts = {}, {}, {0: 0, 1: 0}
        self.cancelled = []

    def end(self, rank):
        net = self

        class End:
            column = None

            def isend(self, peer, tag, data):
                net.posts[rank] += 1
                req = _FakeNetRequest()
                recvs = net.recvs.get((rank, peer))
                if recvs:
                    buf, rreq = recvs.pop(0)
                    memoryview(buf).cast("B")[:] = memoryview(data).cast("B")
                    rreq.finished = req.finished = True
                else:
                    net.sends.setdefault((rank, peer), []).append((bytes(data), req))
                return req

            def irecv(self, peer, tag, buf):
                net.posts[rank] += 1
                req = _FakeNetRequest()
                sends = net.sends.get((peer, rank))
                if sends:
                    data, sreq = sends.pop(0)
                    memoryview(buf).cast("B")[:] = data
                    sreq.finished = req.finished = True
                else:
                    net.recvs.setdefault((peer, rank), []).append((buf, req))
                return req

            def cancel(self, req, error):
                for key in list(net.recvs):
                    net.recvs[key] = [(b, r) for b, r in net.recvs[key] if r is not req]
                req.finished, req.error = True, error
                net.cancelled.append(req)
                return True

        return End()


def _exchange(nc, peer, buf, got, done=None):
    nc.deferrable()
    nc.recv(peer, got)
    nc.send(peer, buf)
    nc.wait_then(lambda: done.append(got.clone()) if done is not None else None)


@pytest.mark.parametrize("nbytes", [16, 256 << 10], ids=["with-descriptor", "own-message"])
def test_a_deferred_net_call_is_finished_from_what_its_first_run_posted(nbytes):
    """An async call whose peer is late posts everything and defers its wait with the rest
    of the call; ``resume`` waits for what was posted and runs that rest, once: nothing
    is posted twice and nothing of the call runs again."""
    from neuron_dist.collectives.net import NetCall
    from neuron_dist.transport.errors import StepDeferred

    net = _FakeNet()
    call = Call("all_reduce", torch.float32, nbytes // 4)
    ncs = [NetCall(net.end(r), SimpleNamespace(rank=r), call, 7, math.inf) for r in (0, 1)]
    bufs = [torch.full((nbytes // 4,), float(r + 1)) for r in (0, 1)]
    gots = [torch.zeros(nbytes // 4) for _ in (0, 1)]
    done = [[], []]
    # rank 0 runs first, with defer_once: its peer has sent nothing, so the wait defers
    ncs[0].defer_once = True
    with pytest.raises(StepDeferred) as deferred:
        _exchange(ncs[0], 1, bufs[0], gots[0], done[0])
    assert deferred.value.last and deferred.value.resumes
    ncs[0].defer_once = False
    assert ncs[0].deferred() and done[0] == []  # the rest is kept, not run
    posted = net.posts[0]
    assert not ncs[0].peers_published()
    _exchange(ncs[1], 0, bufs[1], gots[1], done[1])  # rank 1 completes from what rank 0 posted
    assert gots[1].eq(1.0).all() and len(done[1]) == 1
    assert ncs[0].peers_published()
    ncs[0].again(7, math.inf)
    ncs[0].resume()
    assert net.posts[0] == posted  # nothing posted twice
    assert len(done[0]) == 1 and done[0][0].eq(2.0).all()  # the rest ran once, after the data
    assert not ncs[0].deferred()


def test_a_net_call_whose_peers_are_in_finishes_in_its_first_run():
    from neuron_dist.collectives.net import NetCall

    net = _FakeNet()
    call = Call("all_reduce", torch.float32, 4)
    ncs = [NetCall(net.end(r), SimpleNamespace(rank=r), call, 3, math.inf) for r in (0, 1)]
    done = [[], []]
    ncs[1].recv(0, torch.zeros(4))  # rank 1 is there before rank 0 runs
    ncs[1].send(0, torch.full((4,), 2.0))
    ncs[0].defer_once = True
    _exchange(ncs[0], 1, torch.ones(4), torch.zeros(4), done[0])
    assert len(done[0]) == 1 and done[0][0].eq(2.0).all() and not ncs[0].deferred()


def test_a_descriptor_box_is_reused_only_once_its_receive_is_done_with_it():
    """The buffer a descriptor and its data land in is kept across calls (fresh memory
    costs more than the message), but belongs to one receive at a time: it goes back to
    the pool only after ``check`` has copied the data out, and a withdrawn receive never
    gives it back (a late message may still be on its way to it)."""
    from neuron_dist.collectives.net import PIGGYBACK_BYTES, NetCall

    n = PIGGYBACK_BYTES  # the largest that travels with the descriptor
    net, scratch = _FakeNet(), {}
    call = Call("all_gather", torch.uint8, 2 * n)
    boxes = []
    for seq, value in ((1, 3), (2, 5)):
        nc = NetCall(net.end(0), SimpleNamespace(rank=0), call, seq, math.inf, scratch=scratch)
        peer = NetCall(net.end(1), SimpleNamespace(rank=1), call, seq, math.inf)
        got = torch.zeros(n, dtype=torch.uint8)
        assert nc.recv(1, got) is None  # (it travels with the descriptor)
        box = nc._heard[1][0]
        boxes.append(box)
        assert all(box is not b for kept in scratch.get("boxes", {}).values() for b in kept)
        peer.send(0, torch.full((n,), value, dtype=torch.uint8))
        nc.check()
        assert got.eq(value).all()
        assert any(box is b for b in scratch["boxes"][len(box)])  # given back after the copy
    assert boxes[0] is boxes[1]  # the second call reused the first one's
    # a receive that is withdrawn keeps its box: the pool has none to hand out meanwhile
    nc = NetCall(net.end(0), SimpleNamespace(rank=0), call, 3, math.inf, scratch=scratch)
    nc.recv(1, torch.zeros(n, dtype=torch.uint8))
    nc.withdraw(RuntimeError("going away"))
    assert net.cancelled and scratch["boxes"][len(boxes[0])] == []


def test_a_net_call_not_said_deferrable_defers_before_posting_anything():
    from neuron_dist.collectives.net import NetCall
    from neuron_dist.transport.errors import StepDeferred

    net = _FakeNet()
    nc = NetCall(net.end(0), SimpleNamespace(rank=0), Call("broadcast", torch.float32, 4), 1,
                 math.inf)
    nc.defer_once = True
    for attempt in (lambda: nc.send(1, torch.ones(4)), lambda: nc.recv(1, torch.ones(4)),
                    lambda: nc.buffer("x", 4, torch.float32), nc.wait, nc.check,
                    lambda: nc.wait_then(lambda: None)):
        with pytest.raises(StepDeferred) as deferred:
            attempt()
        assert not deferred.value.last
    assert net.posts[0] == 0


def test_a_deferred_call_that_will_not_be_finished_withdraws_its_messages_first():
    """A group going away fails a deferred call without finishing it: its receives,
    posted into the caller's buffers, are withdrawn before its Work fails, so no late
    message lands in a tensor whose Work has already ended."""
    from neuron_dist.collectives.net import NetCall
    from neuron_dist.engine import CollectiveEngine
    from neuron_dist.errors import GroupAbortedError
    from neuron_dist.work import NeuronWork

    from neuron_dist.collectives.net import PIGGYBACK_BYTES

    net = _FakeNet()
    n = 2 * PIGGYBACK_BYTES  # above it: the data is received straight into ``got``
    nc = NetCall(net.end(0), SimpleNamespace(rank=0), Call("all_gather", torch.uint8, 2 * n),
                 0, math.inf)
    buf, got = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    work = NeuronWork([got], "all_gather")
    seen = []
    real_cancel = net.end(0).cancel

    def cancel(req, error):
        seen.append(work.finished)  # the Work has not ended yet
        return real_cancel(req, error)

    nc.net.cancel = cancel
    engine = CollectiveEngine("test", lambda exc, what: (exc, True))
    assert engine.try_now(lambda seq, rec: (nc.again(seq, math.inf),
                                            _exchange(nc, 1, buf, got)), work, "all_gather", nc)
    # (posted: the descriptor's and the data's receives, the descriptor and the data)
    assert not work.finished and net.posts[0] == 4 and not net.cancelled
    engine.stop()
    assert seen and not any(seen), seen  # withdrawn first ...
    assert net.recvs.get((1, 0)) == [] and len(net.cancelled) >= 1
    with pytest.raises(GroupAbortedError):  # ... then the Work failed
        work.wait()
    late = net.end(1)  # the peer's call, late: its descriptor, then its data, land nowhere
    late.isend(0, 1, bytes(nc._words()))
    late.isend(0, 1, bytes([7]) * n)
    assert got.eq(0).all()
