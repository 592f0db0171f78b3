"""Which ranks share a node (and so may share memory), and where traffic between nodes goes.

``node_identity`` names this process's node; ``Topology`` is how a group's ranks sit on
nodes (built at set-up by rendezvous.py from every rank's identity, then handed to the
between-nodes algorithms); ``choose_addresses`` picks the local addresses for the network.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import cached_property

from .transport.shm.procid import pid_namespace


@dataclass(frozen=True)
class Topology:
    """How a group's ranks sit on nodes.

    Attributes
    ----------
    rank : int
        This process's group rank.
    nodes : tuple of tuple of int
        Group ranks of each node, nodes ordered by their lowest rank.

    The derived properties are computed once (every collective across nodes reads them).
    """

    rank: int
    nodes: tuple

    @classmethod
    def from_names(cls, rank: int, names: list) -> "Topology":
        """The topology of ranks whose node identities are ``names`` (one per group rank)."""
        order: dict = {}
        for k, name in enumerate(names):
            order.setdefault(name, []).append(k)
        return cls(rank, tuple(tuple(v) for v in order.values()))

    @cached_property
    def size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @cached_property
    def _node_index(self) -> dict:
        return {r: i for i, ranks in enumerate(self.nodes) for r in ranks}

    def node_of(self, rank: int) -> int:
        try:
            return self._node_index[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is in no node") from None

    @cached_property
    def my_node(self) -> int:
        return self.node_of(self.rank)

    @cached_property
    def local(self) -> tuple:
        """Group ranks of this node, in local-index order."""
        return self.nodes[self.my_node]

    @cached_property
    def even(self) -> bool:
        return len({len(n) for n in self.nodes}) == 1

    def leader(self, node: int) -> int:
        return self.nodes[node][0]

    @cached_property
    def _speakers(self) -> dict:
        return {}

    def speakers(self, root: int) -> tuple:
        """The group rank that speaks for each node (node order) in a collective rooted
        at ``root``: the root on its node, the leader elsewhere (kept per root: rooted
        collectives read it every call)."""
        got = self._speakers.get(root)
        if got is None:
            root_node = self.node_of(root)
            got = tuple(root if b == root_node else ranks[0]
                        for b, ranks in enumerate(self.nodes))
            self._speakers[root] = got
        return got

    def column(self) -> list:
        """The ranks of this rank's local index on every node that has one, in node order:
        whom it exchanges with in the network phases (the leaders, for local index 0)."""
        j = self.local.index(self.rank)
        return [node[j] for node in self.nodes if len(node) > j]

    def describe(self) -> str:
        return " | ".join(f"node {i}: ranks {list(r)}" for i, r in enumerate(self.nodes))


def node_identity(settings) -> str:
    """A string equal for processes that can map the same shared memory.

    ``settings.node_name`` (``NEURON_DIST_NODE_NAME``) overrides it (virtual nodes on one
    machine). Otherwise it is the hostname, the kernel boot id, the device/inode of the
    shared-memory directory (``settings.shm_dir``) and
    the PID namespace, so two containers or network namespaces with separate /dev/shm never
    look alike, and neither do containers that share /dev/shm but not their pids
    (``--ipc=host``): ranks of a node watch each other's pids, which mean nothing across
    PID namespaces.
    """
    if settings.node_name:
        return settings.node_name
    try:
        st = os.stat(settings.shm_dir)
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "?"
    return f"{socket.gethostname()}/{_boot_id()}/{shm}/{pid_namespace()}"


def _boot_id() -> str:
    """The running kernel's random boot id ("?" if unreadable)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "?"


def cpu_identity() -> list:
    """``[kernel, cpus]``: this process's kernel and the cores it may run on, as a bit mask.
    The kernel is its boot id alone, which no namespace changes (a virtual node or a
    container may have a host name of its own; without a boot id, the host name). Processes
    of one kernel whose masks overlap compete for the same cores, whatever node they count
    as: ``core_rivals`` compares such identities."""
    boot = _boot_id()
    kernel = boot if boot != "?" else f"host {socket.gethostname()}"
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover - non-Linux
        cpus = range(os.cpu_count() or 1)
    return [kernel, sum(1 << c for c in cpus)]


def core_rivals(mine: list, everyone: list) -> tuple[int, int]:
    """``(ranks, cores)``: how many of ``everyone`` (``cpu_identity`` of each rank) compete
    for the cores of ``mine``, and how many cores those ranks have between them. More ranks
    than cores: a waiting rank must not spin (the core it would spin on is one a peer needs
    to answer). As many: no core is spare for a background thread's work either."""
    kernel, cores = mine
    while True:  # the ranks on these cores, then on theirs, ... until no more join
        rivals = [m for k, m in everyone if k == kernel and m & cores]
        reach = cores
        for m in rivals:
            reach |= m
        if reach == cores:
            return len(rivals), bin(cores).count("1")
        cores = reach


def crowding(everyone: list) -> float:
    """Ranks per core where the cores of ``everyone`` (``cpu_identity`` of each rank of a
    group) are most crowded: ``core_rivals`` of every rank, the largest ranks / cores. Above
    1 the ranks take turns on the cores, and a collective's time follows the CPU all of them
    spend rather than its critical path (collectives/net_cost.py). Every rank of the group
    computes it from the same list, so all choose alike."""
    by_kernel: dict = {}
    for kernel, cores in everyone:
        by_kernel.setdefault(kernel, []).append([kernel, cores])
    worst = 0.0
    for same in by_kernel.values():  # (rivals share a kernel: compare within it only)
        for identity in {tuple(i) for i in same}:
            ranks, cores = core_rivals(list(identity), same)
            worst = max(worst, ranks / max(1, cores))
    return worst


def choose_addresses(ifnames: str | None, store=None,
                     master_addr: str | None = None) -> list[str]:
    """The local addresses inter-node traffic should use: one per interface named in
    ``ifnames`` (``NEURON_DIST_SOCKET_IFNAME``, comma-separated), else ``choose_address``'s
    one."""
    names = [n.strip() for n in (ifnames or "").split(",") if n.strip()]
    if not names:
        return [choose_address(None, store, master_addr)]
    return [interface_address(n) for n in names]


def choose_address(ifname: str | None, store=None, master_addr: str | None = None) -> str:
    """The local address inter-node traffic should use.

    ``ifname`` (``NEURON_DIST_SOCKET_IFNAME``) names an interface whose IPv4 address is
    taken. Otherwise: the address of the interface that routes to the rendezvous host
    (the TCPStore's host or ``master_addr``, torchrun's ``MASTER_ADDR`` as read by
    config.py), found by connecting a UDP socket, which
    sends nothing. Our own hostname is never resolved, so hosts whose name does not
    resolve work. With no rendezvous host known, loopback.
    """
    if ifname:
        return interface_address(ifname)
    host = _store_host(store) or master_addr
    if not host:
        return "127.0.0.1"
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
    except OSError:
        return "127.0.0.1"
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def interface_address(ifname: str) -> str:
    """The address of interface ``ifname``: its IPv4 address, else its first global IPv6
    one (ValueError naming the interfaces if it has neither)."""
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", ifname.encode()[:15]))
            return socket.inet_ntoa(packed[20:24])
        except OSError:
            pass
    v6 = _global_ipv6(ifname)
    if v6 is not None:
        return v6
    names = [n for _, n in socket.if_nameindex()]
    raise ValueError(f"NEURON_DIST_SOCKET_IFNAME={ifname!r}: no IPv4 or global IPv6 address on "
                     f"such an interface (interfaces here: {', '.join(names)})")


def _global_ipv6(ifname: str) -> str | None:
    """The first IPv6 address of global scope on ``ifname`` (/proc/net/if_inet6), or None.
    Link-local addresses are left out: they need a scope id on every peer."""
    try:
        with open("/proc/net/if_inet6") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and fields[5] == ifname and fields[3] == "00":
            return socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))
    return None


def _store_host(store) -> str | None:
    seen = 0
    while store is not None and seen < 8:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None
