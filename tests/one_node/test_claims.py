"""What docs/collectives.md claims about dtypes, ops and tensor shapes, each checked by a test.

docs/collectives.md, "Reduce ops and dtypes": complex64/128 reduce with SUM/AVG/PRODUCT/PREMUL_SUM;
integers wrap around; every rank gets bit-identical results (each slice reduced once, in
rank order); zero-element, odd-sized and non-contiguous tensors work; from 256 KiB the
single-copy algorithms run (collectives/single_copy.py). Every result is compared with a
reference computed here, in this file, from the inputs every rank can regenerate.

One forked job per world size / layout runs every case and reports every mismatch, so
the whole file costs a few process start-ups, not one per case.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

from helpers.cases import ALL_DTYPES, close, make, ops_for, reduce_ref, torch_op
from helpers.harness import cma_expected, run_ranks
from one_node.test_collectives import SMALL_SLOTS
from across_nodes.test_multinode import _env

COMPLEX = [torch.complex64, torch.complex128]
COMPLEX_OPS = ["SUM", "AVG", "PRODUCT", "PREMUL_SUM"]
SINGLE_COPY_BYTES = 1 << 20  # collectives/selection.SINGLE_COPY_BYTES, as docs/collectives.md states it


def big_n(dtype) -> int:
    """An odd element count whose bytes reach the single-copy threshold."""
    n = SINGLE_COPY_BYTES // dtype.itemsize + 3
    return n if n % 2 else n + 1


# ---------------------------------------------------------------- inputs and references

def gen(rank: int, n: int, dtype, salt: int = 0, op: str = "SUM") -> torch.Tensor:
    """cases.make, extended to complex (real and imaginary parts drawn independently)."""
    if dtype.is_complex:
        re = make(rank, n, torch.float64, salt=salt, op=op)
        im = make(rank, n, torch.float64, salt=salt + 7919, op=op)
        return torch.complex(re, im).to(dtype)
    return make(rank, n, dtype, salt=salt, op=op)


def ref(inputs, op: str, dtype) -> torch.Tensor:
    """The exact reduction of ``inputs`` (one per rank); complex computed in complex128."""
    if not dtype.is_complex:
        return reduce_ref(inputs, op, dtype)
    x = torch.stack([t.to(torch.complex128) for t in inputs])
    if op == "PREMUL_SUM":
        x = x * 0.5  # cases.premul_factor()
    out = {"SUM": lambda: x.sum(0), "PREMUL_SUM": lambda: x.sum(0),
           "AVG": lambda: x.sum(0) / len(inputs), "PRODUCT": lambda: x.prod(0)}[op]()
    return out.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor, dtype) -> bool:
    if dtype.is_complex:
        return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    return close(a, b, dtype)


def strided(values: torch.Tensor, fill=7):
    """A non-contiguous view (stride 2) holding ``values``, and the buffer around it, whose
    other elements hold ``fill`` and must still hold it after the collective."""
    base = torch.full((values.numel(), 2), fill, dtype=values.dtype)
    view = base[:, 0]
    view.copy_(values.reshape(-1))
    assert not view.is_contiguous() or values.numel() <= 1
    return view, base


def gaps_ok(base: torch.Tensor, fill=7) -> bool:
    return bool((base[:, 1] == torch.tensor(fill, dtype=base.dtype)).all())


class Paths:
    """Counts the calls of the single-copy algorithms in this rank (ranks are forked, so
    patching the module here changes nothing in the test process). The algorithm
    registries (``ALGORITHMS``, ``INTO``) hold the functions themselves: their entries are
    replaced too."""

    def __init__(self):
        from neuron_dist.collectives import allgather, allreduce, reduce_scatter, single_copy
        registries = [getattr(m, r) for m in (allgather, allreduce, reduce_scatter)
                      for r in ("ALGORITHMS", "INTO") if hasattr(m, r)]
        self.calls = {}
        for name in ("all_reduce", "reduce_scatter", "all_gather"):
            fn = getattr(single_copy, name)

            def counted(*a, _fn=fn, _name=name, **kw):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _fn(*a, **kw)
            setattr(single_copy, name, counted)
            for registry in registries:
                for key, value in list(registry.items()):
                    if value is fn:
                        registry[key] = counted

    def take(self, name: str) -> int:
        return self.calls.pop(name, 0)


# ---------------------------------------------------------------- the cases

def backend():
    """The default group's neuron backend itself (below torch's frontend checks)."""
    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))


def reducing(rank, world, fails, dtype, op, n, paths=None, salt=0):
    """Every collective that reduces, ``n`` elements per rank (per block for the scatters)."""
    what = f"{dtype} {op} n={n}"
    full = [gen(k, world * n, dtype, salt=salt, op=op) for k in range(world)]
    want = ref(full, op, dtype)
    mine = slice(rank * n, (rank + 1) * n)
    single = cma_expected() and n * dtype.itemsize >= SINGLE_COPY_BYTES and paths is not None

    # torch's all_reduce refuses PRODUCT on complex tensors and hands the backend the
    # others as real views (torch.view_as_real): the backend's own complex all_reduce is
    # called directly as well, with every op
    calls = ["frontend", "backend"] if dtype.is_complex else ["frontend"]
    if dtype.is_complex and op == "PRODUCT":
        calls = ["backend"]
    # all_reduce takes the single-copy path when each rank's block (1/world of the tensor)
    # reaches the threshold: in the single-copy sweep it reduces the whole ``full``.
    m = world * n if single else n
    for how in calls:
        t = full[rank][:m].clone()
        if how == "frontend":
            dist.all_reduce(t, op=torch_op(op))
        else:
            opts = dist.AllreduceOptions()
            opts.reduceOp = torch_op(op)
            backend().allreduce([t], opts).wait()
        if not same(t, want if single else ref([f[:n] for f in full], op, dtype), dtype):
            fails.append(f"all_reduce ({how}) {what}")
        if single and paths.take("all_reduce") != 1:
            fails.append(f"all_reduce ({how}) {what}: single-copy path not taken")

    root = (n + salt) % world
    t = full[rank][:n].clone()
    dist.reduce(t, dst=root, op=torch_op(op))
    if rank == root and not same(t, ref([f[:n] for f in full], op, dtype), dtype):
        fails.append(f"reduce {what} root={root}")

    out = torch.empty(n, dtype=dtype)
    dist.reduce_scatter_tensor(out, full[rank], op=torch_op(op))
    if not same(out, want[mine], dtype):
        fails.append(f"reduce_scatter_tensor {what}")
    if single and paths.take("reduce_scatter") != 1:
        fails.append(f"reduce_scatter_tensor {what}: single-copy path not taken")

    out = torch.empty(n, dtype=dtype)
    dist.reduce_scatter(out, list(full[rank].split(n)) if n else [torch.empty(0, dtype=dtype)] * world,
                        op=torch_op(op))
    if not same(out, want[mine], dtype):
        fails.append(f"reduce_scatter list {what}")
    if single and paths.take("reduce_scatter") != 1:
        fails.append(f"reduce_scatter list {what}: single-copy path not taken")

    # coalesced: the whole buffer as a 2-D tensor, a block, and a 0-dim tensor
    for how in (calls if n else []):
        ts = [full[rank].clone().view(world, n), full[rank][n:2 * n].clone(),
              full[rank][:1].clone().reshape(())]
        if how == "frontend":
            dist.all_reduce_coalesced(ts, op=torch_op(op))
        else:
            opts = dist.AllreduceCoalescedOptions()
            opts.reduceOp = torch_op(op)
            backend().allreduce_coalesced(ts, opts).wait()
        wants = [want.view(world, n), want[n:2 * n], ref([f[:1] for f in full], op, dtype).reshape(())]
        for i, (t, w) in enumerate(zip(ts, wants)):
            if not same(t, w, dtype):
                fails.append(f"all_reduce_coalesced ({how}) {what} tensor {i}")
    if paths is not None:
        paths.calls.clear()  # the coalesced call may take either path (its total decides)


def moving(rank, world, fails, dtype, n, paths):
    """The data-movement collectives that have a single-copy algorithm, ``n`` per rank."""
    what = f"{dtype} n={n}"
    ins = [gen(k, n, dtype, salt=3) for k in range(world)]
    single = cma_expected() and n * dtype.itemsize >= SINGLE_COPY_BYTES
    big = torch.empty(world * n, dtype=dtype)
    dist.all_gather_into_tensor(big, ins[rank])
    if not torch.equal(big, torch.cat(ins)):
        fails.append(f"all_gather_into_tensor {what}")
    outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
    dist.all_gather(outs, ins[rank])
    if not all(torch.equal(o, i) for o, i in zip(outs, ins)):
        fails.append(f"all_gather {what}")
    if single and paths.take("all_gather") != 2:
        fails.append(f"all_gather {what}: single-copy path not taken")
    a2a = [gen(k, world * n, dtype, salt=4) for k in range(world)]
    out = torch.empty(world * n, dtype=dtype)
    dist.all_to_all_single(out, a2a[rank])
    if not torch.equal(out, torch.cat([a[rank * n:(rank + 1) * n] for a in a2a])):
        fails.append(f"all_to_all_single {what}")
    paths.calls.clear()


def complex_and_big(rank, world, big):
    """complex64/128 with every op they support, in every reducing collective, small and
    from 1 MiB per rank; with ``big``, every dtype and op from 1 MiB too."""
    fails, paths = [], Paths()
    for dtype in COMPLEX:
        for op in COMPLEX_OPS:
            for n in (0, 1, 7, 1001) + ((big_n(dtype),) if big else ()):
                reducing(rank, world, fails, dtype, op, n, paths)
        moving(rank, world, fails, dtype, 5, paths)
    # a tensor PREMUL_SUM factor on complex
    t = gen(rank, 33, torch.complex64)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor(0.25)))
    if not same(t, sum(gen(k, 33, torch.complex64) * 0.25 for k in range(world)), torch.complex64):
        fails.append("all_reduce complex64 PREMUL_SUM tensor factor")
    if big:
        for dtype in ALL_DTYPES:
            for op in ops_for(dtype):
                reducing(rank, world, fails, dtype, op, big_n(dtype), paths, salt=1)
        for dtype in ALL_DTYPES + COMPLEX:
            moving(rank, world, fails, dtype, big_n(dtype), paths)
    return fails


def noncontiguous(rank, world):
    """Every collective and p2p call with strided (non-contiguous) inputs and outputs; the
    elements between a view's elements must be left alone."""
    fails = []

    def check(ok, what):
        if not ok:
            fails.append(what)

    for dtype, n in ((torch.float32, 5), (torch.int64, 1001), (torch.complex64, 7),
                     (torch.float32, big_n(torch.float32))):
        w = f"{dtype} n={n}"
        ins = [gen(k, n, dtype, salt=5) for k in range(world)]
        t, b = strided(ins[rank])
        dist.all_reduce(t)
        check(torch.equal(t, ref(ins, "SUM", dtype)) and gaps_ok(b), f"all_reduce {w}")
        t, b = strided(ins[rank])
        dist.reduce(t, dst=world - 1)
        check(rank != world - 1 or torch.equal(t, ref(ins, "SUM", dtype)), f"reduce {w}")
        check(gaps_ok(b), f"reduce gaps {w}")
        t, b = strided(ins[rank])
        dist.broadcast(t, src=1)
        check(torch.equal(t, ins[1]) and gaps_ok(b), f"broadcast {w}")
        # all_gather: strided input, strided outputs
        src, bs = strided(ins[rank])
        outs = [strided(torch.zeros(n, dtype=dtype)) for _ in range(world)]
        dist.all_gather([o for o, _ in outs], src)
        check(all(torch.equal(o, i) and gaps_ok(ob) for (o, ob), i in zip(outs, ins)) and gaps_ok(bs),
              f"all_gather {w}")
        out, ob = strided(torch.zeros(world * n, dtype=dtype))
        dist.all_gather_into_tensor(out, src)
        check(torch.equal(out, torch.cat(ins)) and gaps_ok(ob), f"all_gather_into_tensor {w}")
        # reduce_scatter: strided inputs and output
        full = [gen(k, world * n, dtype, salt=6) for k in range(world)]
        want = ref(full, "SUM", dtype)[rank * n:(rank + 1) * n]
        src, bs = strided(full[rank])
        out, ob = strided(torch.zeros(n, dtype=dtype))
        dist.reduce_scatter_tensor(out, src)
        check(torch.equal(out, want) and gaps_ok(ob) and gaps_ok(bs), f"reduce_scatter_tensor {w}")
        pieces = [strided(p) for p in full[rank].split(n)]
        out, ob = strided(torch.zeros(n, dtype=dtype))
        dist.reduce_scatter(out, [p for p, _ in pieces])
        check(torch.equal(out, want) and gaps_ok(ob), f"reduce_scatter list {w}")
        # gather / scatter (root 0)
        src, _ = strided(ins[rank])
        gl = [strided(torch.zeros(n, dtype=dtype)) for _ in range(world)] if rank == 0 else None
        dist.gather(src, [g for g, _ in gl] if gl else None, dst=0)
        check(rank != 0 or all(torch.equal(g, i) and gaps_ok(gb) for (g, gb), i in zip(gl, ins)),
              f"gather {w}")
        sl = [strided(gen(0, n, dtype, salt=10 + k))[0] for k in range(world)]
        out, ob = strided(torch.zeros(n, dtype=dtype))
        dist.scatter(out, sl if rank == 0 else None, src=0)
        check(torch.equal(out, gen(0, n, dtype, salt=10 + rank)) and gaps_ok(ob), f"scatter {w}")
        # all_to_all: single tensor and list
        a2a = [gen(k, world * n, dtype, salt=7) for k in range(world)]
        wa = torch.cat([a[rank * n:(rank + 1) * n] for a in a2a])
        src, bs = strided(a2a[rank])
        out, ob = strided(torch.zeros(world * n, dtype=dtype))
        dist.all_to_all_single(out, src)
        check(torch.equal(out, wa) and gaps_ok(ob), f"all_to_all_single {w}")
        outs = [strided(torch.zeros(n, dtype=dtype)) for _ in range(world)]
        dist.all_to_all([o for o, _ in outs], [strided(p)[0] for p in a2a[rank].split(n)])
        check(torch.equal(torch.cat([o for o, _ in outs]), wa) and all(gaps_ok(ob) for _, ob in outs),
              f"all_to_all list {w}")
        # coalesced all_reduce: one strided, one transposed 2-D
        two = torch.stack([ins[rank], ins[rank]])  # 2 x n
        t, b = strided(ins[rank])
        tt = two.t()
        dist.all_reduce_coalesced([t, tt])
        s = ref(ins, "SUM", dtype)
        check(torch.equal(t, s) and gaps_ok(b) and torch.equal(tt, torch.stack([s, s]).t()),
              f"all_reduce_coalesced {w}")
        # coalesced all_gather (torch's list of lists) and the coalescing manager's
        # all_gather_into_tensor / reduce_scatter_tensor
        src, _ = strided(ins[rank])
        src2, _ = strided(ins[rank][: n // 2 + 1])
        outs = [[strided(torch.zeros(n, dtype=dtype)), strided(torch.zeros(n // 2 + 1, dtype=dtype))]
                for _ in range(world)]
        dist.all_gather_coalesced([[o for o, _ in per] for per in outs], [src, src2])
        check(all(torch.equal(per[0][0], i) and torch.equal(per[1][0], i[: n // 2 + 1])
                  and gaps_ok(per[0][1]) and gaps_ok(per[1][1]) for per, i in zip(outs, ins)),
              f"all_gather_coalesced {w}")
        ag, agb = strided(torch.zeros(world * n, dtype=dtype))
        rs, rsb = strided(torch.zeros(n, dtype=dtype))
        rs_in, _ = strided(full[rank])
        ag2, agb2 = strided(torch.zeros(world * (n // 2 + 1), dtype=dtype))
        rs2 = torch.zeros(1, dtype=dtype)  # a contiguous one in the same batch
        rs_in2 = full[rank][:world].clone()
        with dist._coalescing_manager(async_ops=True) as cm:  # one kind per batch (torch)
            dist.all_gather_into_tensor(ag, src)
            dist.all_gather_into_tensor(ag2, src2)
        cm.wait()
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.reduce_scatter_tensor(rs, rs_in)
            dist.reduce_scatter_tensor(rs2, rs_in2)
        cm.wait()
        check(torch.equal(ag, torch.cat(ins)) and gaps_ok(agb), f"coalesced all_gather_into_tensor {w}")
        check(torch.equal(ag2, torch.cat([i[: n // 2 + 1] for i in ins])) and gaps_ok(agb2),
              f"coalesced all_gather_into_tensor (2nd) {w}")
        check(torch.equal(rs, want) and gaps_ok(rsb), f"coalesced reduce_scatter_tensor {w}")
        check(torch.equal(rs2, ref([f[:world] for f in full], "SUM", dtype)[rank:rank + 1]),
              f"coalesced reduce_scatter_tensor (2nd) {w}")
        # p2p: blocking send/recv between ranks 0 and 1; isend/irecv and batch_isend_irecv
        # around the ring
        if rank in (0, 1):
            t, b = strided(ins[rank])
            if rank == 0:
                dist.send(t, dst=1)
                r, rb = strided(torch.zeros(n, dtype=dtype))
                dist.recv(r, src=1)
                check(torch.equal(r, ins[1]) and gaps_ok(rb) and gaps_ok(b), f"send/recv {w}")
            else:
                r, rb = strided(torch.zeros(n, dtype=dtype))
                dist.recv(r, src=0)
                dist.send(t, dst=0)
                check(torch.equal(r, ins[0]) and gaps_ok(rb), f"send/recv {w}")
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        t, _ = strided(ins[rank])
        r, rb = strided(torch.zeros(n, dtype=dtype))
        works = [dist.isend(t, dst=nxt), dist.irecv(r, src=prv)]
        for wk in works:
            wk.wait()
        check(torch.equal(r, ins[prv]) and gaps_ok(rb), f"isend/irecv {w}")
        r, rb = strided(torch.zeros(n, dtype=dtype))
        for wk in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, r, prv)]):
            wk.wait()
        check(torch.equal(r, ins[prv]) and gaps_ok(rb), f"batch_isend_irecv {w}")
    dist.barrier()
    return fails


UNEVEN_DTYPES = [torch.int32, torch.bfloat16, torch.float64, torch.complex64, torch.int8]


def uneven(rank, world):
    """Sizes that do not divide by the world size, odd lengths, per-rank sizes that differ
    (list forms, all_to_all splits), in dtypes other than float32; small and large."""
    fails = []
    for dtype in UNEVEN_DTYPES:
        for base in (1, 333, big_n(dtype)):
            w = f"{dtype} base={base}"
            # an odd length that no world size divides evenly
            n = base * world + 1
            ins = [gen(k, n, dtype, salt=8) for k in range(world)]
            t = ins[rank].clone()
            dist.all_reduce(t)
            if not same(t, ref(ins, "SUM", dtype), dtype):
                fails.append(f"all_reduce n={n} {w}")
            big = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(big, ins[rank])
            if not torch.equal(big, torch.cat(ins)):
                fails.append(f"all_gather_into_tensor n={n} {w}")
            full = [gen(k, world * n, dtype, salt=9) for k in range(world)]
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, full[rank])
            if not same(out, ref(full, "SUM", dtype)[rank * n:(rank + 1) * n], dtype):
                fails.append(f"reduce_scatter_tensor n={n} {w}")
            # per-rank sizes that differ: rank k's block has base + 2k + 1 elements
            sizes = [base + 2 * k + 1 for k in range(world)]
            mine = [gen(k, sizes[k], dtype, salt=11) for k in range(world)]
            outs = [torch.empty(s, dtype=dtype) for s in sizes]
            dist.all_gather(outs, mine[rank])
            if not all(torch.equal(o, m) for o, m in zip(outs, mine)):
                fails.append(f"all_gather uneven {w}")
            blocks = [gen(rank, s, dtype, salt=20 + k) for k, s in enumerate(sizes)]
            out = torch.empty(sizes[rank], dtype=dtype)
            dist.reduce_scatter(out, blocks)
            want = ref([gen(k, sizes[rank], dtype, salt=20 + rank) for k in range(world)], "SUM", dtype)
            if not same(out, want, dtype):
                fails.append(f"reduce_scatter uneven {w}")
            # all_to_all_single: rank r sends base + r + 2j + 1 elements to rank j
            def cnt(src, dst):
                return base + src + 2 * dst + 1
            send = [gen(rank, cnt(rank, j), dtype, salt=30 + j) for j in range(world)]
            out = torch.empty(sum(cnt(k, rank) for k in range(world)), dtype=dtype)
            dist.all_to_all_single(out, torch.cat(send), [cnt(k, rank) for k in range(world)],
                                   [cnt(rank, j) for j in range(world)])
            want = torch.cat([gen(k, cnt(k, rank), dtype, salt=30 + rank) for k in range(world)])
            if not torch.equal(out, want):
                fails.append(f"all_to_all_single uneven {w}")
            outs = [torch.empty(cnt(k, rank), dtype=dtype) for k in range(world)]
            dist.all_to_all(outs, send)
            if not torch.equal(torch.cat(outs), want):
                fails.append(f"all_to_all list uneven {w}")
    return fails


WRAP_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


def wrap_inputs(rank, n, dtype):
    """Values near the top of ``dtype``'s range (and, signed, near the bottom), so that
    sums over two or more ranks overflow in both directions."""
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(4242 + rank + n)
    off = torch.randint(0, 50, (n,), generator=g, dtype=torch.int64)
    top = torch.full((n,), info.max, dtype=dtype) - off.to(dtype)
    if info.min == 0:
        return top
    bottom = torch.full((n,), info.min, dtype=dtype) + off.to(dtype)
    return torch.where(torch.arange(n) % 3 == 0, bottom, top)


def wrap_ref(inputs):
    """SUM as torch computes it in the tensors' own dtype (two's complement wrap-around)."""
    acc = inputs[0].clone()
    for t in inputs[1:]:
        acc += t
    return acc


def wraparound(rank, world):
    """Integer SUM that overflows must wrap like torch's own additions, in every reducing
    collective, small and from 256 KiB."""
    fails = []
    for dtype in WRAP_DTYPES:
        for n in (7, 1001, big_n(dtype)):
            w = f"{dtype} n={n}"
            full = [wrap_inputs(k, world * n, dtype) for k in range(world)]
            want = wrap_ref(full)
            # the reference must itself have wrapped (else this checks nothing)
            exact = sum(int(f[1]) for f in full)
            if exact == int(want[1]) or not (torch.iinfo(dtype).min <= int(want[1]) <= torch.iinfo(dtype).max):
                fails.append(f"reference did not wrap {w}")
            t = full[rank][:n].clone()
            dist.all_reduce(t)
            if not torch.equal(t, want[:n]):
                fails.append(f"all_reduce {w}")
            t = full[rank][:n].clone()
            dist.reduce(t, dst=world - 1)
            if rank == world - 1 and not torch.equal(t, want[:n]):
                fails.append(f"reduce {w}")
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, full[rank])
            if not torch.equal(out, want[rank * n:(rank + 1) * n]):
                fails.append(f"reduce_scatter_tensor {w}")
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(out, list(full[rank].split(n)))
            if not torch.equal(out, want[rank * n:(rank + 1) * n]):
                fails.append(f"reduce_scatter list {w}")
            ts = [full[rank][:n].clone(), full[rank][n:2 * n].clone()]
            dist.all_reduce_coalesced(ts)
            if not (torch.equal(ts[0], want[:n]) and torch.equal(ts[1], want[n:2 * n])):
                fails.append(f"all_reduce_coalesced {w}")
            # AVG divides the wrapped sum (docs/collectives.md: sum, then divide truncating toward zero)
            t = full[rank][:n].clone()
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            avg = torch.div(want[:n].long(), world, rounding_mode="trunc").to(dtype)
            if not torch.equal(t, avg):
                fails.append(f"all_reduce AVG {w}")
    return fails


def spread(rank, n, dtype, salt=0):
    """Values of magnitudes 2**-e .. 2**e with both signs (e = 20, 8 for float16, which
    must not overflow): the result of a float sum depends on the order of the additions."""
    e = 8 if dtype is torch.float16 else 20
    g = torch.Generator().manual_seed(777 + 31 * rank + n + salt)
    v = torch.randn(n, generator=g, dtype=torch.float64)
    v = v * torch.pow(2.0, torch.randint(-e, e + 1, (n,), generator=g).double())
    return v.to(dtype)


def fold(inputs, op, dtype, wide_result=False):
    """docs/collectives.md's order: v0 + v1 + ... + vN-1, left to right; float16/bfloat16 widened to
    float32 (after PREMUL_SUM's factor, applied in the input dtype) and rounded once."""
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    xs = [(t * 0.5 if op == "PREMUL_SUM" else t).to(wide) for t in inputs]
    acc = xs[0].clone()
    for x in xs[1:]:
        acc += x
    if op == "AVG":
        acc /= len(inputs)
    return acc if wide_result else acc.to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


BIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def bit_identical(rank, world, exact_order):
    """Float SUM/AVG/PREMUL_SUM of order-sensitive values: returns (fails, {case: sha256 of
    the result}); the test compares the hashes across ranks. With ``exact_order`` (one
    node) the result must equal the rank-order fold bit for bit."""
    fails, hashes = [], {}
    for dtype in BIT_DTYPES:
        for op in ("SUM", "AVG", "PREMUL_SUM"):
            for n in (1, 101, 40_003, big_n(dtype) + 2):
                w = f"{dtype} {op} n={n}"
                ins = [spread(k, n, dtype) for k in range(world)]
                want = fold(ins, op, dtype)
                # (float16/bfloat16: the order must matter in the float32 accumulator)
                if world >= 3 and n > 100 and torch.equal(fold(ins[::-1], op, dtype, True),
                                                          fold(ins, op, dtype, True)):
                    fails.append(f"inputs do not make the order matter {w}")
                results = {}
                t = ins[rank].clone()
                dist.all_reduce(t, op=torch_op(op))  # synchronous: the express lane when small
                results["all_reduce"] = t
                t = ins[rank].clone()
                dist.all_reduce(t, op=torch_op(op), async_op=True).wait()  # the general path
                results["all_reduce async"] = t
                ts = [ins[rank][:n // 2 + 1].clone(), ins[rank][n // 2 + 1:].clone()]
                dist.all_reduce_coalesced(ts, op=torch_op(op))
                results["all_reduce_coalesced"] = torch.cat(ts)
                t = ins[rank].clone()
                dist.reduce(t, dst=0, op=torch_op(op))
                t = t if rank == 0 else torch.empty_like(t)
                dist.broadcast(t, src=0)
                results["reduce"] = t
                m = -(-n // world)  # reduce_scatter over the input padded to world * m
                full = [torch.cat([x, torch.zeros(world * m - n, dtype=dtype)]) for x in ins]
                out = torch.empty(m, dtype=dtype)
                dist.reduce_scatter_tensor(out, full[rank], op=torch_op(op))
                whole = torch.empty(world * m, dtype=dtype)
                dist.all_gather_into_tensor(whole, out)
                results["reduce_scatter_tensor"] = whole[:n]
                scale = sum(x.double().abs() for x in ins) * (0.5 if op == "PREMUL_SUM" else 1)
                if op == "AVG":
                    scale = scale / world
                # across nodes a node's partial sum travels in the tensor's dtype, so
                # float16/bfloat16 round once per level (not once, as on one node)
                tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
                for what, got in results.items():
                    hashes[f"{what} {w}"] = digest(got)
                    if exact_order:
                        if not torch.equal(got, want):
                            fails.append(f"{what} {w}: not the rank-order result")
                    elif not bool(((got.double() - want.double()).abs() <= tol * scale + 1e-30).all()):
                        fails.append(f"{what} {w}: off the reference")
    return fails, hashes



def claims(rank, world, big, exact_order):
    """Every case of this file in one job: returns (mismatches, {case: sha256})."""
    fails = complex_and_big(rank, world, big)
    fails += noncontiguous(rank, world)
    fails += uneven(rank, world) + wraparound(rank, world)
    bit_fails, hashes = bit_identical(rank, world, exact_order)
    return fails + bit_fails, hashes


def check(results):
    fails = {r: f for r, (f, _) in results.items() if f}
    assert not fails, fails
    hashes = [h for _, h in results.values()]
    assert len(hashes[0]) > 100 and all(h.keys() == hashes[0].keys() for h in hashes)
    differ = sorted(k for k in hashes[0] if len({h[k] for h in hashes}) > 1)
    assert not differ, f"results differ between ranks: {differ}"


@pytest.mark.timeout(330)
@pytest.mark.parametrize("world", [2, 3])
def test_one_node(world):
    """Every rank on one node, with 64 KiB slots (sizes under 1 MiB take several chunks);
    from 1 MiB every dtype and op (the single-copy path)."""
    check(run_ranks(claims, world, True, True, env=SMALL_SLOTS, timeout=300))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("names", [["a", "a", "b"], ["a", "b", "a", "b"]], ids=["2+1", "2x2"])
def test_two_nodes(names):
    """The same cases across two virtual nodes (shared memory inside, TCP rails between);
    the every-dtype single-copy sweep, a one-node path, is left to test_one_node. Float
    results must be the same bits on every rank, within the reference's rounding."""
    check(run_ranks(claims, len(names), False, False, env=_env(names), timeout=120))
