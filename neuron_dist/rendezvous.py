"""Set-up of a group's shared memory through the c10d store.

1. Every rank publishes its node identity; all must match (one node per group until the
   inter-node transport lands), otherwise a clear error names the differing ranks.
2. Group rank 0 sweeps leftover segments of dead jobs, creates the segment and publishes
   its (unguessable) name; the others attach.
3. Every rank counts itself in; rank 0 waits for the count and unlinks the name, so the
   memory disappears with the last process even after SIGKILL.

Keys carry a generation number drawn from a store counter, so re-initialising a group on
the same store (after destroy_process_group) never reads a previous generation's keys.
"""

from __future__ import annotations

import time
from datetime import timedelta

from .transport.shm.backoff import default_spin
from .transport.shm.channel import ShmChannel
from .transport.shm.layout import Layout
from .transport.shm.segment import Segment, new_segment_name, sweep_leftovers
from .topology import node_identity


def open_group_channel(store, rank: int, size: int, settings, timeout: timedelta) -> ShmChannel:
    """Create (rank 0) or attach (others) the group's segment; return its channel."""
    gen = (store.add("neuron/generation", 1) - 1) // size
    key = f"neuron/{gen}"
    me = node_identity(settings.node_name)
    store.set(f"{key}/node/{rank}", me)
    nodes = [store.get(f"{key}/node/{k}").decode() for k in range(size)]
    others = [k for k, n in enumerate(nodes) if n != me]
    if others:
        raise NotImplementedError(
            f"ranks {others} run on another node than rank {rank} ({nodes[others[0]]!r} vs "
            f"{me!r}); this neuron build only connects ranks that share memory on one node")
    layout = Layout(size, settings.slot_bytes, settings.mailbox_bytes)
    if rank == 0:
        sweep_leftovers()
        segment = Segment.create(new_segment_name(), layout.total_bytes, layout.eager_ranges())
        store.set(f"{key}/segment", segment.name)
    else:
        segment = Segment.attach(store.get(f"{key}/segment").decode(), layout.total_bytes)
    spin = settings.spin if settings.spin is not None else default_spin(size)
    channel = ShmChannel(segment, layout, rank, spin)
    store.add(f"{key}/attached", 1)
    if rank == 0:
        deadline = time.monotonic() + timeout.total_seconds()
        while store.add(f"{key}/attached", 0) < size:
            if time.monotonic() > deadline:
                segment.unlink()
                raise TimeoutError(f"only {store.add(f'{key}/attached', 0)} of {size} ranks "
                                   f"attached the shared-memory segment within {timeout}")
            time.sleep(0.001)
        segment.unlink()
    return channel
