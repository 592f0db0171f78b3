"""The main job with replicated data parallelism, and its recovery when a replica dies.

``launch/train.py --dp-mode replicate`` keeps a whole copy of the model (tensor-parallel
over ``tp`` as usual) on every coordinate of ``dp``: each replica trains on its slice of
the global batch and the replicas all-reduce their gradients (one flat buffer per step,
the loss in its last element) before the optimiser step, as DDP does.

``--kill-replica R --kill-at-step S`` makes every rank of replica ``R`` SIGKILL itself at
the start of step ``S`` (it first stores the time, for the measurement below). The other
replicas' gradient all-reduce then fails with ``PeerDiedError`` naming a rank of ``R``;
each survivor reports the ranks of the replica that rank belongs to, and:

1. ``neuron_dist.shrink_group(report)`` replaces the world by the surviving ranks (they
   agree on the union of their reports, see ``neuron_dist/survivors.py``);
2. the device mesh is rebuilt on the new world (``dp`` one smaller, the same ``tp``), a
   fresh model is tensor-parallelised on it, and every parameter's and AdamW state's local
   shard is copied from the old model: a survivor keeps its ``tp`` coordinate (replicas
   are blocks of ``tp`` consecutive ranks, and ranks keep their order), so its shards are
   exactly the ones it had;
3. step ``S`` is run again (the failed step never reached the optimiser), and training
   goes on with the dead replica's rows dropped from every later global batch (the
   survivors keep their own slices: the batch is ``batch_size * (dp - 1) / dp`` rows).

Rank 0 prints how long after the death the failure was seen, the shrink finished, and
the first step after recovery completed. ``launch/reference.py``'s
``reference_losses(cfg, drop_replica=(R, S, dp))`` is the single-process run that drops
the same rows from the same step.

Under torchrun, a replica's ranks must be a whole node other than node 0: torchrun's agent
stops every worker of a node as soon as one fails, and node 0's agent hosts the store the
survivors agree through. The surviving agents then wait in torchrun's exit barrier for the
lost node's agent (up to 300 s) after their workers have finished.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

KILLED_AT_KEY = "neuron-recovery/killed_at"


def replicated_step(model, optimizer, inputs, targets, dp_group, dp: int, loss_fn) -> float:
    """Forward/backward, all-reduce gradients and loss over the replicas, step; the mean loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [_local(p.grad).reshape(-1) for p in params]
    flat = torch.cat(grads + [loss.detach().reshape(1)])
    if dp > 1:
        dist.all_reduce(flat, group=dp_group)
        flat /= dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()])
        offset += g.numel()
    optimizer.step()
    return float(flat[-1])


def maybe_die(cfg, step: int, dp_rank: int, store) -> None:
    """SIGKILL this rank if it belongs to the replica the configuration kills at ``step``."""
    if cfg.kill_replica == dp_rank and cfg.kill_at_step == step:
        store.set(KILLED_AT_KEY, repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


class Replicas:
    """The replicated model on its mesh, rebuilt among the survivors after a death."""

    def __init__(self, cfg, build_model, apply_tp, make_optimizer):
        self.cfg = cfg
        self._build, self._apply_tp, self._make_optimizer = build_model, apply_tp, make_optimizer
        self.tp = cfg.tp
        self.dp = dist.get_world_size() // self.tp
        self.mesh = self._mesh()
        self.dp_coord = self.mesh.get_local_rank("dp")  # the batch slice; kept after a death
        self.model = self._parallel(self._build(cfg))
        self.optimizer = self._make_optimizer(self.model, cfg)

    def _mesh(self):
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh("cpu", (self.dp, self.tp), mesh_dim_names=("dp", "tp"))

    def _parallel(self, model):
        if self.tp > 1:
            self._apply_tp(model, self.mesh["tp"], self.cfg.sequence_parallel)
        return model

    @property
    def dp_group(self):
        return self.mesh.get_group("dp")

    def failed_ranks(self, error) -> list[int]:
        """Global ranks of every replica that a rank named by ``error`` belongs to."""
        dead = [dist.get_global_rank(self.dp_group, k) for k in getattr(error, "ranks", ())]
        replicas = sorted({g // self.tp for g in dead})
        return [r * self.tp + t for r in replicas for t in range(self.tp)]

    def recover(self, error) -> list[int]:
        """Shrink the world to the survivors and rebuild mesh, model and optimiser on it."""
        import neuron_dist
        excluded = self.failed_ranks(error)
        neuron_dist.shrink_group(excluded)
        self.dp = dist.get_world_size() // self.tp
        self.mesh = self._mesh()
        model = self._parallel(self._build(self.cfg))
        optimizer = self._make_optimizer(model, self.cfg)
        old = list(self.model.parameters())
        new = list(model.parameters())
        with torch.no_grad():
            for p_old, p_new in zip(old, new):
                _local(p_new).copy_(_local(p_old))
                state = self.optimizer.state.get(p_old)
                if state:
                    optimizer.state[p_new] = {k: _rewrap(v, p_new) for k, v in state.items()}
        self.model, self.optimizer = model, optimizer
        return excluded


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rewrap(value, like):
    """An optimiser state tensor of the old model, as the same local shard on ``like``'s mesh."""
    if hasattr(value, "to_local"):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(value.to_local().clone(), like.device_mesh, value.placements,
                                  run_check=False)
    return value.clone() if isinstance(value, torch.Tensor) else value


def seconds_since_death(store) -> Optional[float]:
    """Seconds since the killed replica stored its time of death (None if it did not)."""
    try:
        if not store.check([KILLED_AT_KEY]):
            return None
        return time.time() - float(store.get(KILLED_AT_KEY).decode())
    except Exception:  # noqa: BLE001 - a measurement only
        return None
