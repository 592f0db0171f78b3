"""Exceptions users see. All are ``torch.distributed.DistBackendError`` (a RuntimeError)."""

from __future__ import annotations

import torch.distributed as dist


class NeuronDistError(dist.DistBackendError):
    """Base class of neuron backend failures."""


class CollectiveMismatchError(NeuronDistError):
    """Ranks called different collectives, or the same one with different arguments."""


class PeerTimeoutError(NeuronDistError):
    """Peers did not reach a collective (or a send/recv did not complete) in time."""


class PeerDiedError(NeuronDistError):
    """A peer process died while this rank waited for it."""


class GroupAbortedError(NeuronDistError):
    """The group failed earlier (on this rank or a peer) or was aborted/destroyed."""
