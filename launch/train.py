"""Main job of neuron-dist: train a small Llama-style decoder with FSDP2 + TP.

This is a self-contained training recipe (plain PyTorch, CPU tensors, no
downloads) used to exercise a ``torch.distributed`` backend end to end.  The
model is a tiny Llama-style decoder (token embedding, ``--layers`` blocks of
RMSNorm -> causal multi-head self-attention with RoPE -> residual -> RMSNorm
-> SwiGLU MLP -> residual, final RMSNorm, output projection).  It is
parallelised TorchTitan-style on a 2-D device mesh ``(dp, tp)``:

* tensor parallel (``parallelize_module``) inside every block: ``wq/wk/wv``
  and ``w1/w3`` column-wise, ``wo/w2`` row-wise, so attention heads and MLP
  hidden units are split across the ``tp`` ranks; norms use
  ``SequenceParallel`` unless ``--no-sequence-parallel`` is given;
* FSDP2 (``fully_shard``) over the ``dp`` mesh dimension for every block and
  for the root module.

Data are generated on the fly from a fixed random Markov chain over a small
vocabulary (each token has ``--branching`` possible successors), so the loss
falls quickly from ``ln(vocab)`` towards ``ln(branching)``.  Step ``s`` uses a
deterministic global batch; data-parallel rank ``r`` trains on its own slice of
it and all tensor-parallel ranks of one dp rank see the same slice.  Each rank
minimises the mean loss over its slice and FSDP averages gradients over ``dp``,
so the optimised (and printed) loss is the mean over the global batch, which
is what :mod:`launch.reference` computes in a single process.

Rank 0 prints, per step, the loss, tokens/s and the share of the step spent in
communication: from ``neuron_dist.comm_stats()['blocked_seconds']`` when the
``neuron`` backend is in use and provides it, otherwise from a
``torch.profiler`` trace of a single step (``--profile-step``), and ``n/a``
for the other steps.  A summary follows the last step.

How to run (from the repository root)::

    # 4 ranks, dp=2 x tp=2, with the neuron backend (the default)
    timeout 300 torchrun --standalone --nproc-per-node 4 launch/train.py

    # the same with gloo, e.g. while the neuron backend is being developed
    timeout 300 torchrun --standalone --nproc-per-node 4 launch/train.py \\
        --backend gloo

    # a single process (torchrun not required)
    timeout 300 python3 launch/train.py --backend gloo

The backend is selected only by name: ``dist.init_process_group(backend)``;
the ``neuron`` backend is expected to autoload through its entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import socket
import sys
import time
import warnings
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class TrainConfig:
    """All settings of a training run (model, data, optimiser, parallelism).

    Attributes
    ----------
    dim, layers, heads, vocab, seq_len : int
        Model width, number of blocks, attention heads, vocabulary size and
        sequence length.
    batch_size : int
        Global batch size (sequences per step over all dp ranks); must be
        divisible by ``dp``.
    steps : int
        Number of optimiser steps.
    lr : float
        AdamW learning rate (constant).
    dp, tp : int or None
        Data- and tensor-parallel degrees; ``None`` means derive from the world
        size (``tp = 2`` if the world size is even else 1, ``dp = world/tp``).
    seed : int
        Seed for the model initialisation and the data.
    backend : str
        Name passed to ``dist.init_process_group``.
    threads : int
        ``torch.set_num_threads`` per rank.
    rope : bool
        Use rotary position embeddings in attention.
    sequence_parallel : bool
        Use ``SequenceParallel`` for the norms (needs ``seq_len % tp == 0``).
    branching : int
        Successors per token in the synthetic Markov chain.
    mixed_precision : str
        ``"none"`` (fp32) or ``"bf16"`` (FSDP2 ``MixedPrecisionPolicy`` with
        bf16 parameters and fp32 gradient reduction).
    grad_divide_factor : float or None
        If set, passed to ``FSDPModule.set_gradient_divide_factor`` (a factor
        other than ``dp`` makes FSDP2 use ``ReduceOp.PREMUL_SUM``).
    force_sum_reduction : bool
        Call ``FSDPModule.set_force_sum_reduction_for_comms(True)`` (reduce
        with ``SUM`` and divide locally instead of ``AVG``).
    profile_step : int
        1-based step measured with ``torch.profiler`` when
        ``neuron_dist.comm_stats`` is unavailable; ``0`` disables profiling.
    metrics_out : str or None
        If set, rank 0 writes a JSON file with losses and metrics there.
    dp_mode : str
        ``"fsdp"``: FSDP2 shards the model over ``dp``; ``"replicate"``: every dp
        coordinate holds a whole (tensor-parallel) replica and gradients are
        all-reduced, as DDP does (:mod:`launch.recovery`).
    kill_replica, kill_at_step : int or None
        With ``dp_mode="replicate"``: every rank of replica ``kill_replica``
        SIGKILLs itself at the start of step ``kill_at_step``; the others shrink
        the world to themselves and finish training (:mod:`launch.recovery`).
    """

    dim: int = 64
    layers: int = 2
    heads: int = 4
    vocab: int = 128
    seq_len: int = 64
    batch_size: int = 16
    steps: int = 20
    lr: float = 3e-3
    dp: Optional[int] = None
    tp: Optional[int] = None
    seed: int = 0
    backend: str = "neuron"
    threads: int = 1
    rope: bool = True
    sequence_parallel: bool = True
    branching: int = 2
    mixed_precision: str = "none"
    grad_divide_factor: Optional[float] = None
    force_sum_reduction: bool = False
    profile_step: int = 2
    metrics_out: Optional[str] = None
    dp_mode: str = "fsdp"
    kill_replica: Optional[int] = None
    kill_at_step: Optional[int] = None

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.heads

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU hidden width: about ``8/3 * dim``, rounded up to 32."""
        return 32 * math.ceil(8 * self.dim / 3 / 32)


def resolve_parallel_dims(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """Work out ``(dp, tp)`` for a world size.

    Parameters
    ----------
    cfg : TrainConfig
        Run configuration; its ``dp``/``tp`` may be ``None``.
    world_size : int
        Number of ranks.

    Returns
    -------
    tuple of int
        ``(dp, tp)`` with ``dp * tp == world_size``.

    Raises
    ------
    ValueError
        If the degrees do not multiply to the world size.
    """
    dp, tp = cfg.dp, cfg.tp
    if tp is None and dp is None:
        tp = 2 if world_size % 2 == 0 else 1
    if tp is None:
        tp = world_size // dp
    if dp is None:
        dp = world_size // tp
    if dp * tp != world_size:
        raise ValueError(f"dp={dp} x tp={tp} != world size {world_size}")
    return dp, tp


def validate_config(cfg: TrainConfig, dp: int, tp: int) -> None:
    """Check that the model and batch shapes can be split as requested.

    Parameters
    ----------
    cfg : TrainConfig
        Run configuration.
    dp, tp : int
        Data- and tensor-parallel degrees.

    Raises
    ------
    ValueError
        On the first shape that does not divide evenly.
    """
    checks = [
        (cfg.dim % cfg.heads == 0, "dim must be divisible by heads"),
        (cfg.head_dim % 2 == 0, "head_dim must be even for RoPE"),
        (cfg.heads % tp == 0, "heads must be divisible by tp"),
        (cfg.ffn_hidden % tp == 0, "ffn hidden width must be divisible by tp"),
        (cfg.vocab % tp == 0, "vocab must be divisible by tp"),
        (cfg.batch_size % dp == 0, "batch size must be divisible by dp"),
        (not cfg.sequence_parallel or cfg.seq_len % tp == 0,
         "seq_len must be divisible by tp with sequence parallel"),
        (cfg.mixed_precision in ("none", "bf16"), "mixed precision: none|bf16"),
        (cfg.dp_mode in ("fsdp", "replicate"), "dp mode: fsdp|replicate"),
        ((cfg.kill_replica is None) == (cfg.kill_at_step is None),
         "--kill-replica and --kill-at-step go together"),
        (cfg.kill_replica is None or cfg.dp_mode == "replicate",
         "--kill-replica needs --dp-mode replicate (an FSDP shard lives on one rank only)"),
        (cfg.kill_replica is None or 0 < cfg.kill_replica < dp,
         "--kill-replica must be a replica other than 0 (node 0 holds the store) below dp"),
        (cfg.kill_at_step is None or 1 <= cfg.kill_at_step <= cfg.steps,
         "--kill-at-step must be a step of the run"),
        (cfg.dp_mode != "replicate" or cfg.mixed_precision == "none",
         "--dp-mode replicate runs in fp32"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


# ----------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square layer norm written with elementwise ops (DTensor-safe)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension and scale it."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_table(seq_len: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Precompute rotary embedding angles.

    Parameters
    ----------
    seq_len : int
        Maximum sequence length.
    head_dim : int
        Width of one attention head (even).
    base : float
        RoPE frequency base.

    Returns
    -------
    torch.Tensor
        ``(seq_len, head_dim // 2, 2)`` holding ``cos`` and ``sin``.
    """
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` (``batch, seq, heads, head_dim``)."""
    seq_len = x.shape[1]
    cos = table[:seq_len, :, 0].to(x.dtype)[None, :, None, :]
    sin = table[:seq_len, :, 1].to(x.dtype)[None, :, None, :]
    pairs = x.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    """Causal multi-head self-attention.

    Head counts are inferred from the projection output (``view(..., -1,
    head_dim)``), so after column-wise tensor parallelism each rank runs only
    its own ``heads / tp`` heads.
    """

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor]) -> torch.Tensor:
        """Attend causally over the sequence; ``rope`` may be ``None``."""
        bsz, seq_len, _ = x.shape
        q, k, v = (w(x).view(bsz, seq_len, -1, self.head_dim)
                   for w in (self.wq, self.wk, self.wv))
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual."""

    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg.dim, cfg.head_dim)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor]) -> torch.Tensor:
        """Run the block."""
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Small Llama-style decoder-only language model."""

    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        table = rope_table(cfg.seq_len, cfg.head_dim) if cfg.rope else None
        self.register_buffer("rope", table, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministically initialise all weights from ``seed``.

    Parameters
    ----------
    model : nn.Module
        An un-parallelised :class:`Decoder`.
    seed : int
        Seed; the same seed always gives the same weights.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02, generator=gen)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


def build_model(cfg: TrainConfig) -> Decoder:
    """Build the full (un-parallelised) model with deterministic weights.

    Parameters
    ----------
    cfg : TrainConfig
        Run configuration (model shape and seed).

    Returns
    -------
    Decoder
        The model on CPU in fp32.
    """
    model = Decoder(cfg)
    init_weights(model, cfg.seed)
    return model


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Create the AdamW optimiser used by both the recipe and the reference."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                             eps=1e-8, weight_decay=0.0)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions of the batch."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------


def markov_successors(cfg: TrainConfig) -> torch.Tensor:
    """Successor table of the synthetic Markov chain.

    Parameters
    ----------
    cfg : TrainConfig
        Uses ``vocab``, ``branching`` and ``seed``.

    Returns
    -------
    torch.Tensor
        ``(vocab, branching)`` int64; token ``t`` is followed by one of
        ``table[t]`` chosen uniformly.
    """
    gen = torch.Generator().manual_seed(10_007 + cfg.seed)
    return torch.randint(cfg.vocab, (cfg.vocab, cfg.branching), generator=gen)


def global_batch(cfg: TrainConfig, step: int,
                 successors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic global batch for one step.

    Parameters
    ----------
    cfg : TrainConfig
        Uses ``batch_size``, ``seq_len``, ``vocab``, ``branching``, ``seed``.
    step : int
        0-based step index.
    successors : torch.Tensor
        Table from :func:`markov_successors`.

    Returns
    -------
    tuple of torch.Tensor
        ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64, with
        ``targets`` the inputs shifted by one token.
    """
    gen = torch.Generator().manual_seed(1_000_003 * (cfg.seed + 1) + step)
    rows = cfg.batch_size
    tokens = torch.empty(rows, cfg.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab, (rows,), generator=gen)
    choices = torch.randint(cfg.branching, (rows, cfg.seq_len), generator=gen)
    for t in range(cfg.seq_len):
        tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def local_batch(cfg: TrainConfig, step: int, successors: torch.Tensor,
                dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slice of the global batch that data-parallel rank ``dp_rank`` trains on.

    Parameters
    ----------
    cfg, step, successors
        As for :func:`global_batch`.
    dp_rank : int
        Coordinate of this rank on the ``dp`` mesh dimension.
    dp : int
        Data-parallel degree.

    Returns
    -------
    tuple of torch.Tensor
        ``(inputs, targets)`` of ``batch_size // dp`` rows each.
    """
    inputs, targets = global_batch(cfg, step, successors)
    rows = cfg.batch_size // dp
    part = slice(dp_rank * rows, (dp_rank + 1) * rows)
    return inputs[part].contiguous(), targets[part].contiguous()


# ----------------------------------------------------------------------------
# Parallelisation
# ----------------------------------------------------------------------------


def apply_tensor_parallel(model: Decoder, tp_mesh, sequence_parallel: bool) -> None:
    """Shard the model over the ``tp`` mesh (TorchTitan layout).

    Parameters
    ----------
    model : Decoder
        Un-parallelised model, modified in place.
    tp_mesh : DeviceMesh
        1-D tensor-parallel mesh.
    sequence_parallel : bool
        Shard norms and residual stream along the sequence dimension.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
        parallelize_module)

    stream = Shard(1) if sequence_parallel else Replicate()
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=stream),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(stream, None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward": PrepareModuleInput(input_layouts=(stream,),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)


def apply_fsdp(model: Decoder, dp_mesh, cfg: TrainConfig) -> None:
    """Wrap every block and the root with FSDP2 over the ``dp`` mesh.

    Parameters
    ----------
    model : Decoder
        Model (possibly already tensor-parallel), modified in place.
    dp_mesh : DeviceMesh
        1-D data-parallel mesh.
    cfg : TrainConfig
        Uses ``mixed_precision``, ``grad_divide_factor`` and
        ``force_sum_reduction``.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if cfg.mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                  reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    # These setters act on one FSDP module's parameter group, not recursively.
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        if cfg.grad_divide_factor is not None:
            module.set_gradient_divide_factor(cfg.grad_divide_factor)
        if cfg.force_sum_reduction:
            module.set_force_sum_reduction_for_comms(True)


def parallelize(model: Decoder, mesh, cfg: TrainConfig) -> Decoder:
    """Apply tensor parallel (if ``tp > 1``) and then FSDP2 to ``model``.

    Parameters
    ----------
    model : Decoder
        Un-parallelised model.
    mesh : DeviceMesh
        2-D mesh with dimension names ``("dp", "tp")``.
    cfg : TrainConfig
        Run configuration.

    Returns
    -------
    Decoder
        The same module object, now sharded.
    """
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"], cfg.sequence_parallel)
    apply_fsdp(model, mesh["dp"], cfg)
    return model


# ----------------------------------------------------------------------------
# Communication share
# ----------------------------------------------------------------------------

_COMM_EVENT = re.compile(
    r"c10d|nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|broadcast|"
    r"all_to_all|alltoall|wait_tensor|record_param_comms|neuron", re.I)


def neuron_blocked_seconds_reader() -> Optional[Callable[[], Optional[float]]]:
    """Return a reader of ``neuron_dist.comm_stats()['blocked_seconds']``.

    The lookup is defensive: ``None`` is returned unless ``neuron_dist`` is
    importable, the default process group uses the ``neuron`` backend, and
    ``comm_stats()`` currently yields a number under ``'blocked_seconds'``.

    Returns
    -------
    callable or None
        A function returning the cumulative blocked seconds (or ``None`` if a
        later call fails).
    """
    try:
        import neuron_dist  # noqa: F401 - optional, may not exist yet
        stats_fn = getattr(neuron_dist, "comm_stats", None)
        if not callable(stats_fn) or str(dist.get_backend()) != "neuron":
            return None
    except Exception:
        return None

    def read() -> Optional[float]:
        try:
            return float(stats_fn()["blocked_seconds"])
        except Exception:
            return None

    return read if read() is not None else None


def profiled_comm_seconds(prof, window: tuple[float, float]) -> float:
    """Time covered by communication events in a ``torch.profiler`` trace.

    Parameters
    ----------
    prof : torch.profiler.profile
        Finished profiler of one training step.
    window : tuple of float
        ``(start_us, end_us)`` of the step in the profiler's clock; intervals
        are clipped to it.

    Returns
    -------
    float
        Seconds in the union of the intervals of collective/wait events (any
        thread), excluding FSDP's wrapper regions that also do copies.
    """
    intervals = []
    for event in prof.events():
        name = event.name
        if name.startswith("FSDP::") or not _COMM_EVENT.search(name):
            continue
        start = max(event.time_range.start, window[0])
        end = min(event.time_range.end, window[1])
        if end > start:
            intervals.append((start, end))
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total / 1e6


def step_window(prof) -> tuple[float, float]:
    """``(start_us, end_us)`` of the ``train_step`` region in a trace."""
    for event in prof.events():
        if event.name == "train_step":
            return event.time_range.start, event.time_range.end
    return 0.0, float("inf")


# ----------------------------------------------------------------------------
# Training loop
# ----------------------------------------------------------------------------


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One forward/backward/optimiser step; returns the detached local loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def global_mean_loss(loss: torch.Tensor, dp_mesh, dp: int) -> float:
    """Average the per-dp-rank mean losses into the global-batch mean (SUM/dp)."""
    if dp > 1:
        loss = loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=dp_mesh.get_group())
        loss = loss / dp
    return float(loss)


def run_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, dp_mesh,
             dp: int, blocked_reader, profile: bool) -> tuple[float, float, Optional[float]]:
    """Run and time one step, measuring its communication share if possible.

    Parameters
    ----------
    model, optimizer
        The parallelised model and its optimiser.
    batch : tuple of torch.Tensor
        This rank's ``(inputs, targets)``.
    dp_mesh : DeviceMesh
        Data-parallel mesh (for averaging the loss).
    dp : int
        Data-parallel degree.
    blocked_reader : callable or None
        From :func:`neuron_blocked_seconds_reader`.
    profile : bool
        Run this step under ``torch.profiler`` to estimate the share.

    Returns
    -------
    tuple
        ``(global_loss, seconds, comm_share_or_None)``.
    """
    before = blocked_reader() if blocked_reader else None
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    start = time.perf_counter()
    with torch.profiler.record_function("train_step"):
        loss = train_step(model, optimizer, *batch)
        loss_value = global_mean_loss(loss, dp_mesh, dp)
    seconds = time.perf_counter() - start
    share = None
    if prof is not None:
        prof.__exit__(None, None, None)
        share = profiled_comm_seconds(prof, step_window(prof)) / seconds
    elif before is not None:
        after = blocked_reader()
        if after is not None:
            share = (after - before) / seconds
    return loss_value, seconds, share


def format_step(step: int, loss: float, tokens_per_s: float, share: Optional[float],
                source: str) -> str:
    """One per-step log line."""
    comm = "n/a" if share is None else f"{100 * share:5.1f}% ({source})"
    return (f"step {step:4d} | loss {loss:8.4f} | tokens/s {tokens_per_s:9.0f} "
            f"| comm {comm}")


def summarize(cfg: TrainConfig, losses: Sequence[float], rates: Sequence[float],
              shares: Sequence[Optional[float]], dp: int, tp: int, world: int,
              profiled_step: int = 0) -> dict:
    """Collect the end-of-run summary (first/last loss, mean tokens/s, config).

    Parameters
    ----------
    cfg : TrainConfig
        Run configuration.
    losses, rates, shares : sequence
        Per-step global loss, tokens/s and communication share (or ``None``).
    dp, tp, world : int
        Parallel degrees and world size.
    profiled_step : int
        1-based step run under ``torch.profiler`` (0: none).

    Returns
    -------
    dict
        Summary; its mean tokens/s skips step 1 (warm-up) and the profiled
        step, unless no other step is left.
    """
    skip = {0, profiled_step - 1}
    kept = [r for i, r in enumerate(rates) if i not in skip] or list(rates)
    measured = [s for s in shares if s is not None]
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "mean_tokens_per_s": sum(kept) / len(kept),
        "mean_comm_share": sum(measured) / len(measured) if measured else None,
        "losses": list(losses),
        "tokens_per_s": list(rates),
        "comm_share": list(shares),
        "world_size": world, "dp": dp, "tp": tp,
        "config": dataclasses.asdict(cfg),
    }


def process_resources() -> Optional[dict]:
    """Threads and sockets this process holds now (every thread, the backend's included,
    as the kernel counts them); ``None`` where ``/proc`` does not say (not Linux)."""
    try:
        threads = len(os.listdir("/proc/self/task"))
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # (closed meanwhile, or the listing's own descriptor)
    return {"threads": threads, "sockets": sockets}


def print_summary(summary: dict) -> None:
    """Print the summary produced by :func:`summarize`."""
    share = summary["mean_comm_share"]
    print(f"summary: first loss {summary['first_loss']:.4f} | last loss "
          f"{summary['last_loss']:.4f} | mean tokens/s "
          f"{summary['mean_tokens_per_s']:.0f} | mean comm share "
          f"{'n/a' if share is None else f'{100 * share:.1f}%'}")
    res = summary.get("resources")
    if res:
        print(f"resources of rank 0 after the last step: {res['threads']} threads, "
              f"{res['sockets']} sockets")
    print("config: world_size={world_size} dp={dp} tp={tp} ".format(**summary)
          + json.dumps(summary["config"], sort_keys=True))
    sys.stdout.flush()


def train(cfg: TrainConfig) -> Optional[dict]:
    """Train on an initialised process group; rank 0 prints and returns metrics.

    Parameters
    ----------
    cfg : TrainConfig
        Run configuration.

    Returns
    -------
    dict or None
        The summary on rank 0, ``None`` on other ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh

    # The root returns the replicated logits as a view; nothing here modifies
    # them in place, so FSDP2's warning about in-place ops on views is moot.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* view tensor")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, tp = resolve_parallel_dims(cfg, world)
    validate_config(cfg, dp, tp)
    if cfg.dp_mode == "replicate":
        return train_replicated(dataclasses.replace(cfg, dp=dp, tp=tp))
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model = parallelize(build_model(cfg), mesh, cfg)
    optimizer = make_optimizer(model, cfg)
    successors = markov_successors(cfg)
    blocked_reader = neuron_blocked_seconds_reader()
    profiled_step = 0 if blocked_reader else cfg.profile_step
    source = ("neuron_dist.comm_stats" if blocked_reader else
              "profiler" if 1 <= profiled_step <= cfg.steps else "none")
    tokens_per_step = cfg.batch_size * cfg.seq_len
    if rank == 0:
        print(f"neuron-dist train: backend={dist.get_backend()} world={world} "
              f"dp={dp} tp={tp} comm-share source={source}", flush=True)
        if blocked_reader:
            import neuron_dist
            for dim in ("dp", "tp"):
                print(f"  {dim} group of rank 0: {neuron_dist.layout(mesh.get_group(dim))}",
                      flush=True)
    losses, rates, shares = [], [], []
    for step in range(1, cfg.steps + 1):
        batch = local_batch(cfg, step - 1, successors, dp_rank, dp)
        profile = rank == 0 and step == profiled_step
        loss, seconds, share = run_step(model, optimizer, batch, mesh["dp"], dp,
                                        blocked_reader, profile)
        losses.append(loss)
        rates.append(tokens_per_step / seconds)
        shares.append(share)
        if rank == 0:
            print(format_step(step, loss, rates[-1], share, source), flush=True)
    if rank != 0:
        return None
    summary = summarize(cfg, losses, rates, shares, dp, tp, world, profiled_step)
    summary["resources"] = process_resources()  # (every group still open)
    print_summary(summary)
    if cfg.metrics_out:
        with open(cfg.metrics_out, "w") as fh:
            json.dump(summary, fh, indent=1)
    return summary


def train_replicated(cfg: TrainConfig) -> Optional[dict]:
    """:func:`train` with whole replicas over ``dp`` (``--dp-mode replicate``).

    With ``--kill-replica R --kill-at-step S``, replica ``R`` dies at step ``S``
    and the survivors recover and finish (:mod:`launch.recovery`); their losses
    then equal ``reference_losses(cfg, drop_replica=(R, S, dp))``.
    """
    try:
        from . import recovery
    except ImportError:  # run as a script: torchrun launch/train.py
        import recovery  # type: ignore
    import neuron_dist

    store = dist.distributed_c10d._get_default_store()
    dp0 = cfg.dp
    reps = recovery.Replicas(cfg, build_model, apply_tensor_parallel, make_optimizer)
    successors = markov_successors(cfg)
    if dist.get_rank() == 0:
        print(f"neuron-dist train: backend={dist.get_backend()} world={dist.get_world_size()} "
              f"dp={reps.dp} tp={reps.tp} dp-mode=replicate", flush=True)
    losses, rates = [], []
    step, recovered = 1, False
    while step <= cfg.steps:
        recovery.maybe_die(cfg, step, reps.dp_coord, store)
        batch = local_batch(cfg, step - 1, successors, reps.dp_coord, dp0)
        start = time.perf_counter()
        try:
            loss = recovery.replicated_step(reps.model, reps.optimizer, *batch,
                                            reps.dp_group, reps.dp, loss_fn)
        except neuron_dist.PeerDiedError as exc:
            seen = recovery.seconds_since_death(store)
            excluded = reps.recover(exc)
            shrunk = recovery.seconds_since_death(store)
            if dist.get_rank() == 0:
                print(f"recovery: step {step} failed {_secs(seen)} after the death: "
                      f"{type(exc).__name__}: {exc}", flush=True)
                print(f"recovery: excluded ranks {excluded}; world shrunk to "
                      f"{dist.get_world_size()} ranks (dp={reps.dp} tp={reps.tp}) "
                      f"{_secs(shrunk)} after the death", flush=True)
            recovered = True
            continue  # the failed step never reached the optimiser: run it again
        rows = cfg.batch_size // dp0 * reps.dp
        rates.append(rows * cfg.seq_len / (time.perf_counter() - start))
        losses.append(loss)
        if dist.get_rank() == 0:
            print(format_step(step, loss, rates[-1], None, "none"), flush=True)
            if recovered:
                print(f"recovery: training again: step {step} done "
                      f"{_secs(recovery.seconds_since_death(store))} after the death", flush=True)
        recovered = False
        step += 1
    if dist.get_rank() != 0:
        return None
    summary = summarize(cfg, losses, rates, [None] * len(losses), reps.dp, reps.tp,
                        dist.get_world_size())
    print_summary(summary)
    if cfg.metrics_out:
        with open(cfg.metrics_out, "w") as fh:
            json.dump(summary, fh, indent=1)
    return summary


def _secs(seconds: Optional[float]) -> str:
    return "?" if seconds is None else f"{seconds:.2f} s"


# ----------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Command-line parser whose defaults mirror :class:`TrainConfig`."""
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="global batch size (sequences per step, all dp ranks)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--dp", type=int, default=None, help="default: world // tp")
    p.add_argument("--tp", type=int, default=None,
                   help="default: 2 if the world size is even, else 1")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--backend", default=d.backend,
                   help="any registered torch.distributed backend (neuron, gloo, ...)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch.set_num_threads per rank")
    p.add_argument("--no-rope", dest="rope", action="store_false")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel",
                   action="store_false")
    p.add_argument("--branching", type=int, default=d.branching,
                   help="successors per token in the synthetic Markov chain")
    p.add_argument("--mixed-precision", choices=["none", "bf16"],
                   default=d.mixed_precision)
    p.add_argument("--grad-divide-factor", type=float, default=None,
                   help="FSDP2 gradient divide factor (!= dp uses PREMUL_SUM)")
    p.add_argument("--force-sum-reduction", action="store_true",
                   help="FSDP2 reduces with SUM and divides locally")
    p.add_argument("--profile-step", type=int, default=d.profile_step,
                   help="step measured with torch.profiler if neuron_dist."
                        "comm_stats is unavailable (0: never)")
    p.add_argument("--metrics-out", default=None,
                   help="rank 0 writes a JSON summary here")
    p.add_argument("--dp-mode", choices=["fsdp", "replicate"], default=d.dp_mode,
                   help="fsdp: FSDP2 shards over dp; replicate: whole replicas, "
                        "gradients all-reduced (DDP-style)")
    p.add_argument("--kill-replica", type=int, default=None,
                   help="with --dp-mode replicate: this dp replica SIGKILLs itself ...")
    p.add_argument("--kill-at-step", type=int, default=None,
                   help="... at the start of this step; the others shrink and carry on")
    return p


def parse_config(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """Parse command-line arguments into a :class:`TrainConfig`."""
    args = build_parser().parse_args(argv)
    return TrainConfig(**vars(args))


def ensure_rendezvous_env() -> None:
    """Fill in single-process ``env://`` variables when not run by torchrun."""
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Initialise the process group, train, and tear down.

    Parameters
    ----------
    argv : sequence of str, optional
        Command-line arguments (default: ``sys.argv[1:]``).
    """
    cfg = parse_config(argv)
    torch.set_num_threads(cfg.threads)
    ensure_rendezvous_env()
    dist.init_process_group(cfg.backend)
    try:
        train(cfg)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
