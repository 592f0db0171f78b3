"""What torch's own distributed tests and users expect of a backend, beyond the matrices:
all_gather_coalesced's list-per-rank layout, sparse COO all_reduce (SUM), and timeout
errors worded like gloo's and NCCL's (" Timed out ") while naming rank, op and sequence.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers.harness import error_of, run_ranks

# torch's tests (distributed_test.py: _test_barrier_timeout) and users' retry logic match this.
TORCH_TIMEOUT_RE = " (Timed out|closed|timeout) "
NODES = {"one-node": None, "2-nodes": ["a", "b", "a"]}


def _node_env(names):
    if names is None:
        return None
    return lambda rank: {"NEURON_DIST_NODE_NAME": names[rank]}


# ------------------------------------------------------------- all_gather_coalesced
def gather_coalesced(rank, world):
    fails = []
    shapes = [(3,), (2, 2), (0,), (5,), ()]  # an empty and a 0-dim tensor among them
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.complex64, torch.bool):
        def value(r, i, shape):
            n = max(1, torch.Size(shape).numel())
            base = torch.arange(n, dtype=torch.float64) + 100 * r + 10 * i
            if dtype == torch.complex64:
                return torch.complex(base, -base).to(dtype)[:torch.Size(shape).numel()].view(shape)
            if dtype == torch.bool:
                base = base.remainder(2 + r)
            return base.to(dtype)[:torch.Size(shape).numel()].view(shape)
        ins = [value(rank, i, s) for i, s in enumerate(shapes)]
        outs = [[torch.full(s, 7, dtype=dtype) if dtype != torch.complex64 else
                 torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(world)]
        dist.all_gather_coalesced(outs, ins)
        for r in range(world):
            for i, s in enumerate(shapes):
                if not torch.equal(outs[r][i], value(r, i, s)):
                    fails.append(f"{dtype} output[{r}][{i}]: {outs[r][i]} != {value(r, i, s)}")
    # async, and a non-contiguous output
    ins = [torch.full((2, 3), float(rank))]
    outs = [[torch.zeros(3, 2).t()] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins, async_op=True).wait()
    for r in range(world):
        if not torch.equal(outs[r][0], torch.full((2, 3), float(r))):
            fails.append(f"non-contiguous output[{r}]: {outs[r][0]}")
    # wrong layouts fail before anything is sent, naming the problem
    errors = [
        error_of(lambda: dist.all_gather_coalesced([[torch.zeros(2)]], [torch.zeros(2)])),
        error_of(lambda: dist.all_gather_coalesced([[torch.zeros(2)] * 2] * world, [torch.zeros(2)])),
        error_of(lambda: dist.all_gather_coalesced([[torch.zeros(3)]] * world, [torch.zeros(2)])),
    ]
    want = ["has 1 entries, expected " + str(world), "output list 0 has 2 tensors, expected one "
            "per input (1)", "output[0][0] (vs input 0) has 3 elements, expected 2"]
    for err, w in zip(errors, want):
        if not (err and err.startswith("ValueError") and w in err):
            fails.append(f"expected ValueError with {w!r}, got {err}")
    dist.all_reduce(torch.ones(1))  # the group is still aligned
    return fails


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes", list(NODES))
def test_all_gather_coalesced_takes_one_list_per_rank(nodes):
    names = NODES[nodes]
    res = run_ranks(gather_coalesced, 3 if names else 2, env=_node_env(names), timeout=100)
    assert not any(res.values()), res


# ----------------------------------------------------------------- sparse all_reduce
def _sparse_input(rank, world, dtype, dense_dims):
    """Rank r holds entries at rows 0..r (overlapping across ranks), some duplicated."""
    rows = torch.arange(rank + 1)
    idx = torch.stack([torch.cat([rows, rows[:1]]), torch.zeros(rank + 2, dtype=torch.long)])
    vals = (torch.arange(rank + 2, dtype=torch.float64) * 0.37 + rank + 1 / 3)
    vals = vals.view(-1, *([1] * dense_dims)).expand(-1, *([2] * dense_dims))
    return torch.sparse_coo_tensor(idx, vals.to(dtype), (world + 1, 3) + (2,) * dense_dims)


def sparse_sum(rank, world):
    fails, digests = [], []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.complex64):
        for dense_dims in (0, 1, 2):
            t = _sparse_input(rank, world, dtype, dense_dims)
            exact = torch.complex128 if dtype.is_complex else torch.float64
            want = sum(_sparse_input(r, world, dtype, dense_dims).to_dense().to(exact)
                       for r in range(world)).to(dtype)
            dist.all_reduce(t)
            if not (t.is_sparse and t.is_coalesced()):
                fails.append(f"{dtype}/{dense_dims}: result is not a coalesced sparse tensor")
            tol = {"atol": 0.1, "rtol": 0.01} if dtype == torch.bfloat16 else {}
            if not torch.allclose(t.to_dense().to(want.dtype), want, **tol):
                fails.append(f"{dtype}/{dense_dims}: {t.to_dense()} != {want}")
            digests.append(t.values().view(-1).view(torch.uint8).tolist() + t.indices().view(-1).tolist())
    # a rank with no entries at all, and async_op
    t = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0), (4,)) \
        if rank == 0 else torch.sparse_coo_tensor([[rank]], [float(rank)], (4,))
    dist.all_reduce(t, async_op=True).wait()
    want = torch.tensor([0.0] + [float(r) if r < world else 0.0 for r in range(1, 4)])
    if not torch.equal(t.to_dense(), want):
        fails.append(f"empty contribution: {t.to_dense()} != {want}")
    # ops other than SUM, and a rank whose shape differs: clear errors, the group goes on
    err = error_of(lambda: dist.all_reduce(_sparse_input(rank, world, torch.float32, 0),
                                       op=dist.ReduceOp.MAX))
    if not (err and "sparse COO tensor supports ReduceOp.SUM only, not MAX" in err):
        fails.append(f"MAX on sparse: {err}")
    err = error_of(lambda: dist.all_gather_into_tensor(torch.zeros(world),
                                                   torch.sparse_coo_tensor([[0]], [1.0], (1,))))
    if not (err and "layout torch.sparse_coo" in err and "all_reduce with SUM only" in err):
        fails.append(f"sparse all_gather: {err}")
    shape = (4,) if rank else (5,)
    err = error_of(lambda: dist.all_reduce(torch.sparse_coo_tensor([[0]], [1.0], shape)))
    if not (err and err.startswith("ValueError") and "differ in shape" in err):
        fails.append(f"shape mismatch: {err}")
    x = torch.ones(2)
    dist.all_reduce(x)
    if x.tolist() != [world] * 2:
        fails.append(f"after the errors: {x}")
    return fails, digests


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes", list(NODES))
def test_sparse_all_reduce_sums_in_rank_order_on_every_rank(nodes):
    names = NODES[nodes]
    res = run_ranks(sparse_sum, 3 if names else 2, env=_node_env(names), timeout=100)
    assert not any(fails for fails, _ in res.values()), res
    digests = [d for _, d in res.values()]
    assert all(d == digests[0] for d in digests), "ranks hold different bits"


# ------------------------------------------------------------------ timeout wording
def timeouts(rank, world):
    """Rank 0 calls collectives alone, in a subgroup and in the whole group."""
    out = {}
    sub = dist.new_group(list(range(world)), timeout=timedelta(seconds=1))
    p2p = dist.new_group(list(range(world)), timeout=timedelta(seconds=1))
    if rank == 0:
        t0 = time.monotonic()
        out["barrier"] = error_of(lambda: dist.barrier(sub))
        out["took"] = time.monotonic() - t0
        out["recv"] = error_of(lambda: dist.recv(torch.zeros(2), 1, group=p2p))
        work = dist.all_reduce(torch.ones(1), async_op=True)
        out["wait"] = error_of(lambda: work.wait(timedelta(seconds=0.2)))
        out["after"] = error_of(work.wait)
    else:
        time.sleep(6)  # past rank 0's last timeout: a dead peer is another error
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes", list(NODES))
def test_timeout_errors_use_torchs_wording_and_name_rank_op_sequence(nodes):
    names = NODES[nodes]
    world = 3 if names else 2
    res = run_ranks(timeouts, world, env=_node_env(names), timeout=100, pg_timeout=1.5)[0]
    for key in ("barrier", "recv", "wait", "after"):
        assert res[key] and re.search(TORCH_TIMEOUT_RE, res[key]), (key, res[key])
        assert res[key].startswith("PeerTimeoutError"), (key, res[key])
    assert f"barrier #1 in group" in res["barrier"] and f"rank 0/{world}" in res["barrier"], res
    assert "never arrived" in res["barrier"] and 0.9 < res["took"] < 3, res
    assert "recv from rank 1" in res["recv"], res
    assert "all_reduce #" in res["after"] and "Timed out after 1.5 s" in res["after"], res


# ------------------------------------------------------------- a send/recv that times out
def p2p_timeout(rank, world):
    """Rank 0's receive from rank 1 times out, then every rank calls an all_reduce."""
    g = dist.new_group(list(range(world)), timeout=timedelta(seconds=1))
    out = {}
    if rank == 0:
        out["recv"] = error_of(lambda: dist.recv(torch.zeros(4), 1, group=g))
    else:
        time.sleep(2.5)  # past rank 0's time-out
    x = torch.full((3,), float(rank + 1))
    t0 = time.monotonic()
    out["all_reduce"] = error_of(lambda: dist.all_reduce(x, group=g))
    out["took"] = time.monotonic() - t0
    dist.barrier()  # (the world group is another group: it goes on)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes", list(NODES))
def test_a_receive_that_times_out_fails_the_group_on_every_rank_itself_included(nodes):
    """The stream with the peer is out of step (its message may still come): the group
    fails as after a collective's time-out, on every rank. Rank 0's own next collective
    fails at once naming the receive; before, on one node, it went through while its
    peers' same collective failed, and across nodes it failed naming an internal tag."""
    names = NODES[nodes]
    world = 3 if names else 2
    res = run_ranks(p2p_timeout, world, env=_node_env(names), timeout=100)
    assert "recv from rank 1" in res[0]["recv"] and "Timed out after 1 s" in res[0]["recv"], res
    first = res[0]["all_reduce"]
    assert first and first.startswith("GroupAbortedError"), res
    assert "unusable after an earlier failure" in first and "recv from rank 1" in first, res
    assert "tag 4294967296" not in first, res
    for rank in range(1, world):
        err = res[rank]["all_reduce"]
        assert err and "rank 0 aborted the group" in err and "recv from rank 1" in err, (rank, res)
    assert all(r["took"] < 1.0 for r in res.values()), res
