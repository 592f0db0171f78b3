"""Pipeline parallelism (``torch.distributed.pipelining``) over ``neuron`` send/recv.

A 4-layer MLP is cut into stages (2 ranks: one stage each for GPipe and 1F1B, two each for
interleaved 1F1B; 4 ranks on two virtual nodes: a layer each, so activations and gradients
go through shared memory between the two ranks of a node and over the network between
the nodes, in a group that spans both). With ``n_microbatches`` equal micro-batches and the default
``scale_grads=True``, gradients equal those of the mean loss over the whole batch, so the
per-micro-batch losses, the gradients and the parameters after SGD steps must equal a
single process's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.harness import run_ranks

BATCH = 8
MICRO = 4
STEPS = 2
LR = 0.1


def layers():
    torch.manual_seed(0)
    return nn.ModuleList([nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)])


def batch(step):
    g = torch.Generator().manual_seed(400 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 6, generator=g)


def mse(out, target):
    return nn.functional.mse_loss(out, target)


def reference():
    model = layers()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        h = x
        for layer in model:
            h = layer(h)
        # micro-batch losses, as the last stage reports them
        losses.append([mse(a, b).item() for a, b in zip(h.chunk(MICRO), y.chunk(MICRO))])
        mse(h, y).backward()
        if step == 0:
            grads = {f"{i}.{k}": p.grad.clone() for i, layer in enumerate(model)
                     for k, p in layer.named_parameters()}
        opt.step()
    params = {f"{i}.{k}": v.detach().clone() for i, layer in enumerate(model)
              for k, v in layer.state_dict().items()}
    return params, losses, grads


def count_p2p():
    from neuron_dist import ProcessGroupNeuron

    calls = {"send": 0, "recv": 0}
    for name in calls:
        orig = ProcessGroupNeuron.__dict__[name]

        def wrapper(self, *args, _name=name, _orig=orig, **kw):
            calls[_name] += 1
            return _orig(self, *args, **kw)

        setattr(ProcessGroupNeuron, name, wrapper)
    return calls


def pipeline(rank, world, schedule, presplit=False):
    """One rank's part; with ``presplit`` the schedule's ``step`` is launch/titan_shims.py's
    (shim 7), given the micro-batches ready-made, as TorchTitan's trainer gives them."""
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    calls = count_p2p()
    model = layers()
    cpu = torch.device("cpu")
    if schedule == "interleaved":
        mine = [rank, rank + world]  # stages 0, 2 on rank 0 and 1, 3 on rank 1
        stages = [pipelining.PipelineStage(model[i], i, 4, cpu) for i in mine]
        sched = pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=MICRO, loss_fn=mse)
        mods = {i: model[i] for i in mine}
        last = rank == world - 1
    else:
        per = len(model) // world
        mine = list(range(per * rank, per * (rank + 1)))
        sub = nn.Sequential(*[model[i] for i in mine])
        stage = pipelining.PipelineStage(sub, rank, world, cpu)
        cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
        sched = cls(stage, n_microbatches=MICRO, loss_fn=mse)
        mods = {i: sub[j] for j, i in enumerate(mine)}
        last = rank == world - 1
    if presplit:
        import types

        from launch.titan_shims import _presplit_step
        sched.step = types.MethodType(_presplit_step, sched)
    params = [p for m in mods.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        mb_losses = []
        if presplit:
            sched.step(arg_mbs=[(a,) for a in x.chunk(MICRO)] if rank == 0 else None,
                       target_mbs=list(y.chunk(MICRO)) if last else None,
                       losses=mb_losses if last else None)
        elif rank == 0:
            sched.step(x, target=y if last else None, losses=mb_losses if last else None)
        else:
            sched.step(target=y, losses=mb_losses)
        if step == 0:
            grads = {f"{i}.{k}": p.grad.tolist() for i, m in mods.items()
                     for k, p in m.named_parameters()}
        opt.step()
        losses.append([v.item() for v in mb_losses])
    out = {f"{i}.{k}": v.tolist() for i, m in mods.items() for k, v in m.state_dict().items()}
    return {"params": out, "grads": grads, "losses": losses if last else None,
            "p2p": dict(calls)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pipeline_schedules_match_single_process(schedule):
    _check(run_ranks(pipeline, 2, schedule, timeout=150))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_over_two_nodes_matches_single_process(schedule):
    _check(run_ranks(pipeline, 4, schedule, timeout=150,
                     env=lambda r: {"NEURON_DIST_NODE_NAME": "ab"[r // 2]}))


def _check(res):
    want, want_losses, want_grads = reference()
    seen = set()
    for rank, info in res.items():
        for k, v in info["params"].items():
            seen.add(k)
            assert torch.allclose(torch.tensor(v), want[k], atol=1e-5), ("param", rank, k)
            assert torch.allclose(torch.tensor(info["grads"][k]), want_grads[k],
                                  atol=1e-6), ("grad", rank, k)
        # activations forward and gradients backward went over neuron send/recv
        assert info["p2p"]["send"] >= STEPS * MICRO and info["p2p"]["recv"] >= STEPS * MICRO
    assert seen == set(want)
    got = torch.tensor(res[len(res) - 1]["losses"])
    assert torch.allclose(got, torch.tensor(want_losses), atol=1e-6), (got, want_losses)
