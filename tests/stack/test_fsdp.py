"""FSDP2 (``fully_shard``) over ``neuron`` trains exactly like one process on the whole batch.

Each rank trains a sharded copy of a tiny MLP on its slice of every global batch; the
reference trains the same MLP (same seed) in one process on the whole batch with the same
optimiser. After a few steps the full (unsharded) parameters must agree within fp32
rounding (bf16 mixed precision: within bf16 rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.harness import run_ranks

STEPS = 3
BATCH = 8
LR = 0.1


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def reference(lr=LR, steps=STEPS):
    """Parameters and losses of one process training on the whole batch."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def reference_grads():
    model = mlp()
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def trace_reduce_ops(log):
    """Record (method, reduce op) of every reduce-scatter this rank issues."""
    from neuron_dist import ProcessGroupNeuron

    for name in ("reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter",
                 "reduce_scatter_single_coalesced"):
        orig = ProcessGroupNeuron.__dict__[name]

        def wrapper(self, *args, _name=name, _orig=orig):
            opts = args[-1] if args and hasattr(args[-1], "reduceOp") else None
            op = None
            if opts is not None:
                op = str(getattr(opts.reduceOp, "op", opts.reduceOp)).rsplit(".", 1)[-1]
            log.append((_name, op))
            return _orig(self, *args)

        setattr(ProcessGroupNeuron, name, wrapper)


def shard(model, mesh, **kw):
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def full_params(model):
    return {k: v.full_tensor().float().tolist() for k, v in model.state_dict().items()}


def fsdp_train(rank, world, mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    log = []
    trace_reduce_ops(log)
    kw = {}
    if mode == "no_reshard":
        kw["reshard_after_forward"] = False
    if mode == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    model = shard(mlp(), mesh, **kw)
    info = {}
    p = model[0].weight
    info["sharded"] = (isinstance(p, DTensor) and p.placements == (Shard(0),)
                       and tuple(p.to_local().shape) == (16 // world, 8))
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if mode == "divide_factor":
        for m in fsdp_modules:  # not recursive in torch: set it on every FSDP module
            m.set_gradient_divide_factor(4.0)
    if mode == "force_sum":
        for m in fsdp_modules:
            m.set_force_sum_reduction_for_comms(True)
    compute_dtypes = []
    model[2].register_forward_pre_hook(lambda mod, args: compute_dtypes.append(args[0].dtype))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    n = BATCH // world
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step == 0:
            info["grads"] = {k: q.grad.full_tensor().float().tolist()
                             for k, q in model.named_parameters()}
            info["grad_dtype"] = str(model[0].weight.grad.dtype)
        opt.step()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    info["params"] = full_params(model)
    info["losses"] = losses
    info["ops"] = sorted(set(log))
    info["compute_dtype"] = str(compute_dtypes[0])
    return info


def _assert_close(got, want, tol):
    for k, w in want.items():
        g = torch.tensor(got[k])
        assert torch.allclose(g, w, rtol=tol, atol=tol), (k, (g - w).abs().max().item())


@pytest.mark.parametrize("mode", ["reshard", "no_reshard", "force_sum"])
def test_fsdp2_matches_single_process(mode):
    want, want_losses = reference()
    res = run_ranks(fsdp_train, 2, mode, timeout=120)
    ref_grads = reference_grads()
    for rank, info in res.items():
        assert info["sharded"]
        _assert_close(info["params"], want, 1e-5)
        _assert_close(info["grads"], ref_grads, 1e-5)
        assert torch.allclose(torch.tensor(info["losses"]), torch.tensor(want_losses), atol=1e-5)
        ops = {op for _, op in info["ops"]}
        assert ops == ({"SUM"} if mode == "force_sum" else {"AVG"}), info["ops"]


def test_fsdp2_mixed_precision_bf16_params_fp32_reduce():
    want, _ = reference()
    res = run_ranks(fsdp_train, 2, "bf16", timeout=120)
    for info in res.values():
        assert info["compute_dtype"] == "torch.bfloat16"
        assert info["grad_dtype"] == "torch.float32"  # sharded grads stay fp32
        assert {op for _, op in info["ops"]} == {"AVG"}
        _assert_close(info["params"], want, 2e-2)
    # Both ranks hold the same (replicated) full parameters.
    for k in want:
        assert res[0]["params"][k] == res[1]["params"][k]


def test_fsdp2_gradient_divide_factor_uses_premul_sum():
    """Factor 4 on 2 ranks: FSDP2 reduce-scatters with PREMUL_SUM(1/4) (gloo has no
    PREMUL_SUM). Gradients are sum/4 = half the mean, so SGD with lr matches the
    reference with lr/2."""
    want, _ = reference(lr=LR * 2 / 4)
    ref_grads = {k: g * 2 / 4 for k, g in reference_grads().items()}
    res = run_ranks(fsdp_train, 2, "divide_factor", timeout=120)
    for info in res.values():
        assert {op for _, op in info["ops"]} == {"PREMUL_SUM"}, info["ops"]
        _assert_close(info["grads"], ref_grads, 1e-5)
        _assert_close(info["params"], want, 1e-5)


def fsdp_accumulate(rank, world, micro):
    """``micro`` micro-batches per step; only the last one reduce-scatters gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    log = []
    trace_reduce_ops(log)
    model = shard(mlp(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    n = BATCH // world
    m = n // micro
    unsynced_reductions = 0
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad()
        for k in range(micro):
            last = k == micro - 1
            model.set_requires_gradient_sync(last)
            before = len(log)
            xs, ys = x[k * m:(k + 1) * m], y[k * m:(k + 1) * m]
            (nn.functional.mse_loss(model(xs), ys) / micro).backward()
            if not last:
                unsynced_reductions += len(log) - before
        opt.step()
    return {"params": full_params(model), "unsynced_reductions": unsynced_reductions,
            "reductions": len(log)}


def test_fsdp2_gradient_accumulation_without_sync():
    want, _ = reference()
    res = run_ranks(fsdp_accumulate, 2, 2, timeout=120)
    for info in res.values():
        assert info["unsynced_reductions"] == 0
        assert info["reductions"] == STEPS * 3  # one reduce-scatter per FSDP unit with params
        _assert_close(info["params"], want, 1e-5)


def fsdp_tp(rank, world):
    """FSDP2 over dp x ColwiseParallel/RowwiseParallel over tp on a 2 x 2 mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = mlp()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                           "4": ColwiseParallel(use_local_output=False)})
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp_rank, n = mesh.get_local_rank("dp"), BATCH // 2
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]
        opt.zero_grad()
        out = model(x).full_tensor()  # last layer colwise: gather the feature shards
        nn.functional.mse_loss(out, y).backward()
        opt.step()
    return {"params": full_params(model),
            "placements": [type(p).__name__ for p in model[0].weight.placements]}


def test_fsdp2_with_tensor_parallel_on_2d_mesh():
    want, _ = reference()
    res = run_ranks(fsdp_tp, 4, timeout=150)
    for info in res.values():
        assert len(info["placements"]) == 2, info["placements"]  # (dp, tp) 2-D DTensor
        _assert_close(info["params"], want, 1e-5)
