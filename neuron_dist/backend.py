"""Registration of the ``neuron`` backend with torch.distributed."""

from __future__ import annotations

import logging

import torch.distributed as dist

from .config import Settings
from .process_group import ProcessGroupNeuron

BACKEND_NAME = "neuron"


def _create(dist_opts, pg_options=None) -> ProcessGroupNeuron:
    """Creator torch calls with ``_DistributedBackendOptions`` for every new group."""
    settings = Settings.from_env()
    configure_logging(settings.debug)
    return ProcessGroupNeuron(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                              dist_opts.timeout, settings)


def register() -> None:
    """Register ``neuron`` with torch.distributed (idempotent)."""
    from .mpi_launch import install_env_hook
    install_env_hook()  # under mpiexec without torchrun, env:// learns rank/world from MPI
    if BACKEND_NAME in dist.Backend.backend_list or hasattr(dist.Backend, BACKEND_NAME.upper()):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])


def configure_logging(level: str) -> None:
    """Apply ``NEURON_DIST_DEBUG`` (``Settings.debug``: WARN, INFO or TRACE) to the
    ``neuron_dist`` logger; INFO and TRACE also give it a handler on stderr (once)."""
    logger = logging.getLogger("neuron_dist")
    logger.setLevel({"TRACE": logging.DEBUG, "INFO": logging.INFO}.get(level, logging.WARNING))
    if level in ("INFO", "TRACE") and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
