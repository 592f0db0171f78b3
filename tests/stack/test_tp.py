"""Tensor parallel (``torch.distributed.tensor.parallel``) over ``neuron``.

Every rank gets the whole batch (TP splits the weights, not the data); outputs, losses,
gradients and the parameters after a few SGD steps must equal the un-parallelised model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helpers.harness import run_ranks

STEPS = 3
LR = 0.1


class Block(nn.Module):
    """norm -> up (colwise) -> gelu -> down (rowwise) -> head (colwise, vocab-sharded)."""

    def __init__(self, dim=8, hidden=16, vocab=12):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        h = self.norm(x)
        h = x + self.down(F.gelu(self.up(h)))
        return self.head(h)


def block():
    torch.manual_seed(0)
    return Block()


def data(step, seq=4):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(2, seq, 8, generator=g), torch.randint(0, 12, (2, seq), generator=g)


def ce(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference():
    model = block()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        x, t = data(step)
        opt.zero_grad()
        loss = ce(model(x), t)
        loss.backward()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def tp_train(rank, world, style):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, loss_parallel,
                                                   parallelize_module)

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = block()
    if style == "colwise_rowwise":
        # Replicated activations between blocks; the head's output is gathered.
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel(),
                "head": ColwiseParallel(output_layouts=Replicate())}
    elif style == "sequence_parallel":
        # Norm and residual stream sharded on the sequence dim (Shard(1)).
        plan = {"norm": SequenceParallel(),
                "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1)),
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    else:  # loss_parallel: the logits stay sharded on the vocab dim into the loss
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel(),
                "head": ColwiseParallel(use_local_output=False)}
    parallelize_module(model, mesh, plan)
    placements = {k: str(getattr(p, "placements", "plain")) for k, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        x, t = data(step)
        if style == "sequence_parallel":
            x = x.chunk(world, 1)[rank]  # SequenceParallel takes this rank's sequence slice
        opt.zero_grad()
        out = model(x)
        if style == "loss_parallel":
            with loss_parallel():
                loss = F.cross_entropy(out.flatten(0, 1), t.reshape(-1))
                loss.backward()
        else:
            loss = ce(out, t)
            loss.backward()
        if step == 0:
            grads = {k: _full(p.grad).tolist() for k, p in model.named_parameters()}
        opt.step()
        losses.append(_full(loss).item())
    params = {k: _full(v).tolist() for k, v in model.state_dict().items()}
    return {"params": params, "losses": losses, "grads": grads, "placements": placements}


def _check(res, tol=1e-5):
    want, want_losses, want_grads = reference()
    for rank, info in res.items():
        assert torch.allclose(torch.tensor(info["losses"]), torch.tensor(want_losses),
                              atol=tol), (rank, info["losses"], want_losses)
        for k, w in want_grads.items():
            assert torch.allclose(torch.tensor(info["grads"][k]), w, atol=tol), ("grad", k)
        for k, w in want.items():
            assert torch.allclose(torch.tensor(info["params"][k]), w, atol=tol), ("param", k)


def test_colwise_rowwise_parallel():
    res = run_ranks(tp_train, 2, "colwise_rowwise", timeout=120)
    pl = res[0]["placements"]
    assert "Shard(dim=0)" in pl["up.weight"] and "Shard(dim=1)" in pl["down.weight"]
    assert "Replicate" in pl["down.bias"] and pl["norm.weight"] == "plain"
    _check(res)


def test_sequence_parallel():
    res = run_ranks(tp_train, 2, "sequence_parallel", timeout=120)
    assert "Replicate" in res[0]["placements"]["norm.weight"]
    _check(res)


def test_loss_parallel():
    res = run_ranks(tp_train, 2, "loss_parallel", timeout=120)
    assert "Shard(dim=0)" in res[0]["placements"]["head.weight"]
    _check(res)


def test_tensor_parallel_four_ranks():
    res = run_ranks(tp_train, 4, "sequence_parallel", timeout=150)
    _check(res)
