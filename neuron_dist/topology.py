"""Which ranks share a node (and so may share memory)."""

from __future__ import annotations

import os
import socket


def node_identity(override: str | None = None) -> str:
    """A string equal for processes that can map the same shared memory.

    ``NEURON_DIST_NODE_NAME`` overrides it (virtual nodes on one machine). Otherwise it is
    the hostname, the kernel boot id and the device/inode of the shared-memory directory,
    so two containers or network namespaces with separate /dev/shm never look alike.
    """
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        st = os.stat(os.environ.get("NEURON_DIST_SHM_DIR", "/dev/shm"))
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "?"
    return f"{socket.gethostname()}/{boot}/{shm}"
