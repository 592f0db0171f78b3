"""Which CPUs the shared-memory protocol is correct on.

The protocol publishes data with plain stores: a rank writes a slot (or a ring's bytes),
then the 8-byte counter that says it is there; a reader loads the counter, then the data
(see layout.py). That is correct only where stores become visible to other cores in
program order and loads are not reordered with older loads: x86-64's TSO. On weakly ordered
CPUs (aarch64, POWER, RISC-V) a reader can see the counter before the data and compute on
stale bytes, a silently wrong answer. There are no fences in the protocol, so ranks of one
node must not share memory there; ranks that are each their own node (one rank per node
name) talk over the network transport and need no ordering from the CPU.
"""

from __future__ import annotations

import platform

ORDERED = frozenset({"x86_64", "amd64"})  # platform.machine(), lower case


def machine() -> str:
    """This CPU's architecture as ``platform.machine()`` names it ('x86_64', 'aarch64')."""
    return platform.machine()


def shares_memory_safely(arch: str) -> bool:
    """True if ranks on a CPU of architecture ``arch`` may run the shared-memory protocol."""
    return arch.lower() in ORDERED
