"""``neuron_dist.shrink_group``: carry on with the ranks that survive a failure.

Why not ``torch.distributed.shrink_group`` (torch 2.13, ``distributed_c10d.py``)
--------------------------------------------------------------------------------
torch's function asks the group's per-device ``Backend`` whether it
``supports_shrinking`` and then calls its ``shrink(ranks, flags, options)``; both could be
provided by a Python class. But it then wraps whatever ``shrink`` returned in a new C++
``ProcessGroup`` with ``new_pg._register_backend(device, BackendType.GLOO, new_backend)``
(``_create_shrunk_process_group``), whose pybind signature accepts only a
``c10d::Backend``. A Python backend cannot be one: ``torch._C._distributed_c10d.Backend``
has no Python constructor ("No constructor defined"), which is why ``neuron`` (like every
Python backend) is a ``ProcessGroup`` subclass that torch registers as the group itself
(``_new_process_group_helper``: "If the type is a subclass of ProcessGroup then return this
process group immediately"). Worse, torch destroys the old group *before* that call
(``_cleanup_original_group``), so claiming ``supports_shrinking`` would leave a rank with no
group at all. ``neuron`` therefore keeps ``supports_shrinking`` unset: torch refuses it
up front ("does not support shrinking operations") and this module gives the same
contract.

Contract
--------
* Called by every rank that is to stay (and by nobody else is fine: dead ranks cannot).
* ``ranks_to_exclude`` are ranks of ``group``. Members may pass different lists (each
  knows what it saw fail; a rank that only heard of the failure may pass ``[]``): the
  group excludes the union, agreed through the store (``survivors.py``). A rank no survivor
  names must join; one that does not, within the timeout, fails the shrink on every
  survivor with ``PeerTimeoutError`` naming it. A slow rank is never split off silently.
* The old group is aborted on every survivor (pending work fails with
  ``GroupAbortedError``), which fences off an excluded rank that is still alive: its next
  operation in the old group fails, and its own ``shrink_group`` raises ``ExcludedError``.
* The new group has the survivors in their old order, renumbered ``0..n-1``. When ``group``
  was the default group, the new group becomes the default group, every other group is
  aborted and destroyed (their ranks no longer mean anything), and ``dist.get_rank()`` /
  ``get_world_size()`` answer for the new world; groups made later (``new_group``,
  ``init_device_mesh``) use the new ranks.
* Nothing of the dead rank is left: the node's shared-memory segment has no name once a
  group is set up (it goes with the last process that maps it, and survivors unmap theirs
  here), the survivors' sockets to it are closed with the old group, and the old group's
  keys in the store (its address, node identity, ...) are deleted.
* The store must outlive the failure, and the new group uses fresh keys under the old
  group's prefix, so later groups never meet a name the old world used.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .process_group import ProcessGroupNeuron
from .rendezvous import forget_group
from .survivors import agree

log = logging.getLogger("neuron_dist")


def shrink_group(ranks_to_exclude, group=None, timeout: timedelta | None = None):
    """Replace ``group`` (default: the default group) by a group of its surviving ranks.

    Parameters
    ----------
    ranks_to_exclude : list of int
        Group ranks this rank wants excluded (may be empty); the group excludes the union
        of what the survivors pass (see the module's contract).
    group : ProcessGroup, optional
        A ``neuron`` group this rank belongs to; default: the default group.
    timeout : timedelta, optional
        How long to wait for the other survivors (default: the group's timeout); also the
        new group's timeout.

    Returns
    -------
    ProcessGroup
        The new group (the new default group if ``group`` was the default one).
    """
    is_default = group is None or group == c10d._get_default_group()
    pg = c10d._get_default_group() if is_default else group
    backend = _neuron_backend(pg)
    size, rank = backend.size(), backend.rank()
    report = _check_ranks(ranks_to_exclude, size, rank)
    timeout = timeout or backend.timeout
    started = time.monotonic()
    record = backend.record
    key = f"{record.key}/shrink"
    excluded = agree(record.store, key, rank, size, report, timeout.total_seconds(),
                     auth=record.auth)
    survivors = [k for k in range(size) if k not in excluded]
    reason = (f"group {backend.label()} was shrunk to its ranks {survivors}; rank(s) "
              f"{excluded} excluded")
    backend.abort(reason)  # fences the excluded
    old = _Old(pg, backend, survivors)
    if is_default:
        _tear_down_world(pg)
    else:
        dist.destroy_process_group(pg)
    store = dist.PrefixStore(f"{key}/group/", record.store)
    new = ProcessGroupNeuron(dist.PrefixStore("neuron/", store), survivors.index(rank),
                             len(survivors), timeout, backend.settings)
    _register(new, old, store, is_default)
    if survivors.index(rank) == 0:
        forget_group(record.store, record.key, record.topo)
    log.info("neuron: %s in %.3f s", reason, time.monotonic() - started)
    return new


class _Old:
    """What the new group inherits from the old one, read before the old one is gone."""

    def __init__(self, pg, backend, survivors):
        self.backend_name, _ = c10d._world.pg_map[pg]
        self.config = c10d._world.pg_backend_config.get(pg, "")
        self.name, self.desc = backend.group_name, backend.group_desc
        ranks = c10d.get_process_group_ranks(pg)
        self.globals = [ranks[k] for k in survivors]


def _neuron_backend(pg) -> ProcessGroupNeuron:
    backend = pg if isinstance(pg, ProcessGroupNeuron) else None
    if backend is None:
        try:
            backend = pg._get_backend(torch.device("cpu"))
        except Exception:  # noqa: BLE001 - not ours
            pass
    if not isinstance(backend, ProcessGroupNeuron):
        raise TypeError(f"neuron_dist.shrink_group works on neuron groups, not {pg!r} "
                        f"(use torch.distributed.shrink_group for NCCL)")
    return backend


def _check_ranks(ranks, size: int, rank: int) -> list[int]:
    if not isinstance(ranks, (list, tuple, set)):
        raise TypeError(f"ranks_to_exclude must be a list of group ranks, not {ranks!r}")
    for r in ranks:
        if not isinstance(r, int) or not 0 <= r < size:
            raise ValueError(f"ranks_to_exclude: {r!r} is not a rank of a group of {size}")
    if rank in ranks:
        raise ValueError(f"ranks_to_exclude names this rank ({rank}): only the ranks that stay "
                         f"call shrink_group")
    return sorted(set(ranks))


def _tear_down_world(default_pg) -> None:
    """Abort every group of this process (their ranks mean nothing in the new world), then
    reset torch's registry as destroy_process_group() does (also its group counter)."""
    for pg in list(c10d._world.pg_names):
        if pg is not default_pg:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - already failed or destroyed
                log.debug("neuron: aborting %r during shrink failed", pg, exc_info=True)
    dist.destroy_process_group()


def _register(new, old: _Old, store, is_default: bool) -> None:
    """Enter ``new`` in torch's registry as ``_new_process_group_helper`` would."""
    if is_default:
        name = c10d._process_group_name([], use_hashed_name=False)
        mapping = {k: k for k in range(new.size())}
        desc = "default_pg"
    else:
        name = f"{old.name}-shrunk"
        mapping = {g: k for k, g in enumerate(old.globals)}
        desc = f"{old.desc or old.name}:shrunk"
    new._set_group_name(name)
    new._set_group_desc(desc)
    if is_default:
        c10d._update_default_pg(new)
    c10d._register_pg_in_world(new, backend_name=old.backend_name, store=store,
                               group_name=name, backend_config=old.config,
                               rank_mapping=mapping, add_to_default_tag=True)
