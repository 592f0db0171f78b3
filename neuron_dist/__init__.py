"""neuron-dist: a torch.distributed backend named ``neuron`` for CPU tensors.

After ``pip install``, ``torch.distributed.init_process_group("neuron")`` works without
importing this package (torch autoloads it through the ``torch.backends`` entry point);
``import neuron_dist`` registers it too, e.g. with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.
"""

# torch first: its entry-point autoload then imports .backend completely before we do,
# instead of finding it half-imported (a circular import, reported as a RuntimeWarning).
import torch  # noqa: F401

from .backend import register
from .errors import (CollectiveMismatchError, ExcludedError, GroupAbortedError, NeuronDistError,
                     PeerDiedError, PeerTimeoutError)
from .process_group import ProcessGroupNeuron
from .shrink import shrink_group
from .stats import comm_stats


def layout(group=None) -> str | None:
    """How a neuron group (default: the world) spans nodes; None for other backends."""
    import torch.distributed as dist
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, ProcessGroupNeuron):
        try:
            pg = pg._get_backend(torch.device("cpu"))
        except Exception:  # noqa: BLE001 - not ours
            return None
    return pg.layout() if isinstance(pg, ProcessGroupNeuron) else None

__version__ = "0.1.0"
__all__ = ["ProcessGroupNeuron", "register", "comm_stats", "layout", "NeuronDistError",
           "CollectiveMismatchError", "PeerTimeoutError", "PeerDiedError", "GroupAbortedError",
           "ExcludedError", "shrink_group"]

register()
