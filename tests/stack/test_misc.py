"""ZeroRedundancyOptimizer, torch.distributed.checkpoint and torch.profiler over ``neuron``.

Also what needs the group to answer for a per-device backend (``_device_types``,
``_get_backend``): dcp.async_save, FSDP2 allocating from the process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from helpers.harness import run_ranks

BATCH = 8
LR = 0.05

def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def reference(steps, opt_cls=torch.optim.Adam):
    model = mlp()
    opt = opt_cls(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_close(got, want, tol=1e-5):
    assert set(got) == set(want), (set(got), set(want))
    for k, w in want.items():
        g = torch.tensor(got[k])
        assert torch.allclose(g, w, rtol=tol, atol=tol), (k, (g - w).abs().max().item())


def _local(x, rank, world):
    n = BATCH // world
    return x[rank * n:(rank + 1) * n]


# ------------------------------------------------------------- ZeroRedundancyOptimizer
def zero(rank, world):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    model = DDP(mlp())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(_local(x, rank, world)), _local(y, rank, world)).backward()
        opt.step()
    # Each rank holds the Adam state of its own partition only.
    owned = sum(1 for p in model.parameters() if p in opt.optim.state)
    opt.consolidate_state_dict(to=0)
    full_state = len(opt.state_dict()["state"]) if rank == 0 else None
    return {"params": {k: v.tolist() for k, v in model.module.state_dict().items()},
            "owned": owned, "full_state": full_state}


def test_zero_redundancy_optimizer():
    want = reference(3)
    res = run_ranks(zero, 2, timeout=120)
    n_params = len(want)
    assert 0 < res[0]["owned"] < n_params and res[0]["owned"] + res[1]["owned"] == n_params
    assert res[0]["full_state"] == n_params
    for info in res.values():
        _assert_close(info["params"], want)


# ------------------------------------------------------------------ distributed checkpoint
def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, opt, steps, rank, world, first=0):
    for step in range(first, first + steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(_local(x, rank, world)), _local(y, rank, world)).backward()
        opt.step()


def _full(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.tolist() for k, v in sd.items()}


def dcp_save_then_resume(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp(mlp(), mesh)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    _train(model, opt, 2, rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = _full(model)
    _train(model, opt, 1, rank, world, first=2)  # the un-interrupted run goes on
    cont = _full(model)

    # A fresh model (other initialisation, no optimiser state) resumes from the checkpoint.
    model2 = _fsdp(mlp(seed=1), mesh)
    opt2 = torch.optim.Adam(model2.parameters(), lr=LR)
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full(model2)
    _train(model2, opt2, 1, rank, world, first=2)
    resumed = _full(model2)
    return {"saved": saved, "loaded": loaded, "cont": cont, "resumed": resumed}


def dcp_load_resharded(rank, world, path):
    """Load the 2-rank checkpoint's model into a 4-rank FSDP2 model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    model = _fsdp(mlp(seed=2), init_device_mesh("cpu", (world,)))
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    return _full(model)


def test_dcp_save_load_fsdp2_and_reshard(tmp_path):
    path = str(tmp_path / "ckpt")
    want2, want3 = reference(2), reference(3)
    res = run_ranks(dcp_save_then_resume, 2, path, timeout=150)
    for info in res.values():
        _assert_close(info["saved"], want2)  # FSDP2 + Adam == one process
        _assert_close(info["loaded"], info_tensors(info["saved"]), tol=0)  # bit-exact restore
        _assert_close(info["cont"], want3)
        _assert_close(info["resumed"], info_tensors(info["cont"]), tol=0)  # optimiser state too
    res4 = run_ranks(dcp_load_resharded, 4, path, timeout=150)
    for full in res4.values():
        _assert_close(full, info_tensors(res[0]["saved"]), tol=0)


def info_tensors(d):
    return {k: torch.tensor(v) for k, v in d.items()}


def dcp_async(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    model = _fsdp(mlp(), init_device_mesh("cpu", (world,)))
    fut = dcp.async_save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    fut.result(timeout=60)
    model2 = _fsdp(mlp(seed=1), init_device_mesh("cpu", (world,)))
    state = {"model": get_model_state_dict(model2)}
    dcp.load(state, checkpoint_id=path)
    return True


def test_dcp_async_save(tmp_path):
    res = run_ranks(dcp_async, 2,
                        str(tmp_path / "ckpt"))
    assert all(res.values())


# --------------------------------------------------------- the per-device backend face
def device_backend(rank, world):
    from torch.distributed.distributed_c10d import _get_pg_default_device

    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    return {"device_types": [str(d) for d in pg._device_types],
            "default_device": str(_get_pg_default_device(pg)),
            "tensor_alloc": bool(backend.supports_tensor_alloc(torch.device("cpu")))}


def test_process_group_exposes_cpu_backend():
    res = run_ranks(device_backend, 2)
    for info in res.values():
        assert info["device_types"] == ["cpu"] and info["default_device"] == "cpu"


def fsdp_pg_alloc(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    torch.set_num_threads(1)
    model = _fsdp(mlp(), init_device_mesh("cpu", (world,)))
    for module in model.modules():  # per FSDP module (the root itself holds no parameter)
        if isinstance(module, FSDPModule):
            module.set_allocate_memory_from_process_group_for_comm(True)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    _train(model, opt, 2, rank, world)
    return _full(model)


def test_fsdp2_allocate_memory_from_process_group():
    want = reference(2)
    res = run_ranks(fsdp_pg_alloc, 2)
    for full in res.values():
        _assert_close(full, want)


# ------------------------------------------------------------------------------ profiler
def profiled(rank, world, functional):
    import torch.distributed._functional_collectives as fc
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    x = torch.ones(8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if functional:
            y = fc.all_reduce(x, "sum", dist.group.WORLD)
            y = fc.all_gather_single(y, 0, dist.group.WORLD)
            y = fc.reduce_scatter_single(y, "sum", 0, dist.group.WORLD)
            y = fc.all_to_all_single(y, None, None, dist.group.WORLD)
            float(y.sum())
        else:
            dist.all_reduce(x)
            dist.all_gather_into_tensor(torch.empty(8 * world), x)
            dist.reduce_scatter_tensor(torch.empty(8 // world), x)
            dist.broadcast(x, 0)
            dist.all_to_all_single(torch.empty(8), x)
            dist.barrier()
            if rank == 0:
                dist.send(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
    return sorted({e.name for e in prof.events()})


COLLECTIVES = ["allreduce", "allgather", "reducescatter", "alltoall"]


def _missing(names, wanted):
    flat = [n.lower().replace("_", "") for n in names]
    return [w for w in wanted if not any(w in n for n in flat)]


def test_profiler_names_functional_collectives():
    res = run_ranks(profiled, 2, True, timeout=60)
    for names in res.values():
        assert not _missing(names, COLLECTIVES), names


def test_profiler_names_c10d_collectives():
    res = run_ranks(profiled, 2, False, timeout=60)
    wanted = COLLECTIVES + ["broadcast", "barrier"]
    for rank, names in res.items():
        assert not _missing(names, wanted + (["send"] if rank == 0 else ["recv"])), names
