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
    """A peer process died while this rank waited for it.

    ``ranks``: the group ranks found dead, when this rank saw the death itself (empty when
    it heard of it from a peer's abort notice).
    """

    ranks: tuple = ()


class GroupAbortedError(NeuronDistError):
    """The group failed earlier (on this rank or a peer) or was aborted/destroyed."""


class ExcludedError(GroupAbortedError):
    """The survivors of a failure excluded this rank from the group (``shrink_group``)."""
