"""Functional collectives over ``neuron``: eagerly and under ``torch.compile``.

The same function (all_reduce, all_gather_tensor, reduce_scatter_tensor, all_to_all_single)
runs eagerly, compiled with ``aot_eager`` and compiled with ``inductor`` (which generates
and builds C++ on first use, so it gets one tiny case on two ranks); every result is
checked against what a single process computes from all ranks' inputs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo.testing
import torch._inductor.config as inductor_config
import torch.distributed as dist

from helpers.harness import run_ranks


def _inputs(rank):
    return torch.arange(8.0).reshape(4, 2) + 10 * rank


def _expected(rank, world):
    xs = [_inputs(k) for k in range(world)]
    total = sum(xs)
    gathered0 = torch.cat(xs, 0)
    gathered1 = torch.cat(xs, 1)
    rs = (2 * gathered0).reshape(world, -1, 2)  # every rank feeds 2 * gathered0
    return {
        "sum": total + 1,
        "avg": total / world,
        "max": torch.stack(xs).amax(0),
        "ag0": gathered0,
        "ag1": gathered1,
        "rs0": (world * rs)[rank],
        "rs1": (world * gathered1 * 3).chunk(world, 1)[rank],
        "a2a": torch.cat([gathered0.chunk(world, 0)[rank]] * world, 0),
        "a2a_uneven": torch.cat([torch.arange(float(rank + 1)) + 100 * k for k in range(world)]),
    }


def _program(group, world):
    import torch.distributed._functional_collectives as fc

    def fn(x):
        out = {}
        out["sum"] = fc.all_reduce(x, "sum", group) + 1
        out["avg"] = fc.all_reduce(x, "avg", group)
        out["max"] = fc.all_reduce(x, "max", group)
        g0 = fc.all_gather_tensor(x, 0, group)
        out["ag0"] = g0
        out["ag1"] = fc.all_gather_tensor(x, 1, group)
        out["rs0"] = fc.reduce_scatter_tensor(2 * g0, "sum", 0, group)
        out["rs1"] = fc.reduce_scatter_tensor(3 * out["ag1"], "sum", 1, group)
        out["a2a"] = fc.all_to_all_single(g0, None, None, group)
        return out

    return fn


def _uneven_a2a(rank, world, group):
    """all_to_all_single with per-peer split sizes: rank k receives k+1 values from each."""
    import torch.distributed._functional_collectives as fc

    x = torch.cat([torch.arange(float(k + 1)) + 100 * rank for k in range(world)])
    return fc.all_to_all_single(x, [rank + 1] * world, [k + 1 for k in range(world)], group)


def funcol(rank, world, backend):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    fails = []
    info = {}
    group = dist.group.WORLD
    fn = _program(group, world)
    if backend is not None:
        inductor_config.compile_threads = 1  # no compile worker pool inside a forked rank
        counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
        fn = torch.compile(fn, backend=counter, fullgraph=True)
    x = _inputs(rank)
    got = fn(x)
    if backend is not None:
        got = fn(x + 0)  # second call reuses the compiled graph
        info["frames"] = counter.frame_count
        # Every collective is a node of the one graph (fullgraph=True: no graph break).
        names = [str(n.target) for g in counter.graphs for n in g.graph.nodes]
        info["collectives_in_graph"] = sum("_c10d_functional" in n or "all_reduce" in n or
                                           "all_gather" in n or "reduce_scatter" in n or
                                           "all_to_all" in n for n in names)
    else:
        got["a2a_uneven"] = _uneven_a2a(rank, world, group)
    want = _expected(rank, world)
    for k, v in got.items():
        v = torch.tensor(v.tolist())  # waits for an AsyncCollectiveTensor
        if v.shape != want[k].shape or not torch.allclose(v, want[k]):
            fails.append(f"{k}: {v.tolist()} != {want[k].tolist()}")
    return fails, info


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_functional_collectives(backend):
    res = run_ranks(funcol, 4, backend, timeout=180)
    for rank, (fails, info) in res.items():
        assert not fails, (rank, fails)
        if backend:
            assert info["frames"] == 1 and info["collectives_in_graph"] >= 7, info


def test_functional_collectives_inductor():
    res = run_ranks(funcol, 2, "inductor", timeout=240)
    for rank, (fails, info) in res.items():
        assert not fails, (rank, fails)
        assert info["frames"] == 1 and info["collectives_in_graph"] >= 7, info


def funcol_mesh_and_autograd(rank, world):
    """Groups given as (mesh, dim) and the autograd-aware variants, eagerly."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    fails = []
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    row, col = divmod(rank, 2)
    x = torch.tensor([float(rank)])
    tp_sum = fc.all_reduce(x, "sum", (mesh, 1))
    dp_gather = fc.all_gather_tensor(x, 0, (mesh, 0))
    if tp_sum.item() != 4 * row + 1:
        fails.append(f"tp all_reduce {tp_sum}")
    if dp_gather.tolist() != [float(col), float(col + 2)]:
        fails.append(f"dp all_gather {dp_gather}")
    # Autograd: d/dx sum(all_gather(x) * w) = w[rank block] summed over ranks (reduce_scatter).
    w = torch.arange(1.0, 1.0 + 2 * world)
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    g = fc.all_gather_tensor_autograd(a * (rank + 1), 0, dist.group.WORLD)
    g = fc.wait_tensor(g)
    (g * w).sum().backward()
    want = w.reshape(world, 2)[rank] * world * (rank + 1)
    if not torch.allclose(a.grad, want):
        fails.append(f"all_gather_tensor_autograd grad {a.grad} != {want}")
    return fails


def test_functional_collectives_on_mesh_dims_and_autograd():
    res = run_ranks(funcol_mesh_and_autograd, 4, timeout=120)
    assert not any(res.values()), res
