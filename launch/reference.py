"""Single-process reference for the training recipe in :mod:`launch.train`.

Builds the same model (same seed, same deterministic initialisation), the same
AdamW optimiser and the same global batches as the distributed recipe, but
trains it un-parallelised in one process on the whole global batch.  Because
the distributed run minimises the mean loss over the global batch, its
per-step losses should match :func:`reference_losses` up to floating-point
rounding (fp32 run; bf16 mixed precision will differ more), whatever the
``dp x tp`` layout.

Typical use in a test::

    from launch.reference import reference_losses, losses_match
    from launch.train import TrainConfig

    cfg = TrainConfig(steps=5, backend="gloo")
    expected = reference_losses(cfg)
    # ... run ``torchrun ... launch/train.py --steps 5 --metrics-out m.json``
    # and compare json.load(open("m.json"))["losses"] with ``expected``.

It can also be run directly (no process group needed)::

    python3 -m launch.reference --steps 5
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

try:
    from .train import (TrainConfig, build_model, global_batch, loss_fn,
                        make_optimizer, markov_successors, parse_config)
except ImportError:  # run as a plain script: python3 launch/reference.py
    from train import (TrainConfig, build_model, global_batch, loss_fn,  # type: ignore
                       make_optimizer, markov_successors, parse_config)


def reference_losses(cfg: TrainConfig, steps: Optional[int] = None,
                     drop_replica: Optional[tuple[int, int, int]] = None) -> list[float]:
    """Train the un-parallelised model in this process and return its losses.

    Parameters
    ----------
    cfg : TrainConfig
        Same configuration as the distributed run (``dp``, ``tp``,
        ``backend`` and the other parallelism settings are ignored;
        ``batch_size`` is the global batch).
    steps : int, optional
        Number of steps; defaults to ``cfg.steps``.
    drop_replica : (replica, step, dp), optional
        From 1-based ``step`` on, leave out the rows data-parallel replica
        ``replica`` of ``dp`` trains on (the run of ``launch/train.py
        --dp-mode replicate --kill-replica R --kill-at-step S``, whose survivors
        go on with their own slices).

    Returns
    -------
    list of float
        Mean loss over the global batch at each step (before that step's
        update), in step order.
    """
    steps = cfg.steps if steps is None else steps
    model = build_model(cfg)
    optimizer = make_optimizer(model, cfg)
    successors = markov_successors(cfg)
    losses = []
    for step in range(steps):
        inputs, targets = global_batch(cfg, step, successors)
        if drop_replica is not None and step + 1 >= drop_replica[1]:
            replica, _, dp = drop_replica
            rows = cfg.batch_size // dp
            keep = [r for r in range(cfg.batch_size) if r // rows != replica]
            inputs, targets = inputs[keep], targets[keep]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def losses_match(actual: Sequence[float], expected: Sequence[float],
                 rtol: float = 1e-4, atol: float = 1e-4) -> bool:
    """Whether two loss curves agree element-wise within tolerances.

    Parameters
    ----------
    actual, expected : sequence of float
        Loss curves; only the common prefix is compared, and it must be
        non-empty.
    rtol, atol : float
        Relative and absolute tolerance as in :func:`math.isclose`.

    Returns
    -------
    bool
        ``True`` if every compared pair is close.
    """
    n = min(len(actual), len(expected))
    return n > 0 and all(math.isclose(a, e, rel_tol=rtol, abs_tol=atol)
                         for a, e in zip(actual[:n], expected[:n]))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Print the reference losses for the recipe's command-line flags.

    Parameters
    ----------
    argv : sequence of str, optional
        Same flags as ``launch/train.py`` (default: ``sys.argv[1:]``).
    """
    cfg = parse_config(argv)
    torch.set_num_threads(cfg.threads)
    for step, loss in enumerate(reference_losses(cfg), start=1):
        print(f"step {step:4d} | loss {loss:8.4f}")


if __name__ == "__main__":
    main()
