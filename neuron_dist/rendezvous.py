"""Set-up of a group through the c10d store: who shares a node, shared memory, network rails.

1. Every rank publishes its node identity (topology.node_identity), its CPU
   architecture and the settings that choose algorithms or frame network messages
   (``selection_settings``: ranks choosing differently would compute garbage or fail
   later with a misleading error, so a difference fails every rank, naming it); ranks
   with equal identities form a node (topology.Topology).
   A node of several ranks on a CPU that is not x86-64 is refused on every rank (the
   shared-memory protocol relies on x86-64's store ordering: transport/shm/ordering.py).
2. Per node, the node's first rank sweeps leftover segments of dead jobs, creates the
   node's segment and publishes its (unguessable) name; the node's other ranks attach
   (refusing anything but a private segment of this user: transport/shm/segment.py).
   Every rank counts itself in (or counts a refusal, which fails every rank naming it);
   all wait for the count, then the creator unlinks the name, so the memory disappears
   with the last process even after SIGKILL.
3. If the group spans nodes, every rank also opens an inter-node transport (the MPI one
   with ``NEURON_DIST_TRANSPORT=mpi``, else rdm): it listens on the
   chosen interface (topology.choose_address), publishes ``host:port``, and connects
   ``NEURON_DIST_RAILS`` authenticated rails to every other rank. First it makes room for
   those connections within its file-descriptor limit (transport/rdm/fd_budget.py); a
   rank that cannot publishes why instead of an address, and every rank fails naming it. The job key is
   ``NEURON_DIST_AUTH_KEY`` or 32 random bytes group rank 0 puts in the store. With
   ``NEURON_DIST_AUTH_KEY`` (or ``NEURON_DIST_NET_MAC=1``) every frame on a rail is
   authenticated with the rail's session key (transport/rdm/railmac.py).

With ``NEURON_DIST_AUTH_KEY`` set, every value a rank reads in these steps (node
identities, the segment's name, the CMA probe's pids and answers, the group nonce, peers'
addresses, MPI ranks) carries an HMAC tag bound to the key name (generation included), its
writer's rank and this set-up's fresh session, checked before use (store_auth.py).

Keys carry a generation number drawn from a store counter, so re-initialising a group on
the same store (after destroy_process_group) never reads a previous generation's keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta

from .transport.base import NetTransport
from .transport.errors import DescriptorLimit
from .transport.rdm import fd_budget
from .transport.rdm.driver import RdmTransport
from .transport.rdm.handshake import derive_key
from .transport.shm import cma
from .transport.backoff import SPIN_POLLS
from .transport.shm.channel import ShmChannel
from .transport.shm.layout import Layout
from .transport.shm.ordering import machine, shares_memory_safely
from .transport.shm.segment import (Segment, ShmSetupError, new_segment_name,
                                     sweep_leftovers)
from .store_auth import StoreAuth, StoreAuthError
from .topology import (Topology, choose_addresses, core_rivals, cpu_identity, crowding,
                       node_identity)

log = logging.getLogger("neuron_dist")


@dataclass(frozen=True)
class StoreRecord:
    """Where one generation of a group is kept in the store: ``key`` prefixes its keys,
    ``auth`` checks what is read there, ``topo`` says which node keys it wrote
    (``forget_group`` removes them). shrink.py agrees on a group's survivors through it."""

    store: object
    key: str
    auth: StoreAuth | None
    topo: Topology


@dataclass
class GroupLinks:
    """What a group talks through: this node's shared memory and, across nodes, the network."""

    channel: ShmChannel
    topo: Topology
    net: NetTransport | None  # RdmTransport or MpiTransport; None on one node
    key: str = ""  # prefix of this generation's keys in the store
    auth: StoreAuth | None = None  # the group's store values, checked with the job key
    hold: float = 0.0  # seconds an async collective waits for its caller (engine.py)
    crowd: float = 0.0  # ranks per core where the group's cores are most crowded (crowding)


def open_group(store, rank: int, size: int, settings, timeout: timedelta,
               label: str = "") -> GroupLinks:
    """Rendezvous through ``store``; return the group's channel, topology and transport.

    With ``NEURON_DIST_AUTH_KEY`` set, every value read from the store is authenticated
    (store_auth.py) before it is used: a value not written by the rank it should come
    from, with this key, for this group and this set-up, fails with ``StoreAuthError``.
    """
    job_key = derive_key(settings.auth_key) if settings.auth_key else None
    auth = StoreAuth(store, job_key, f"group of {size}", rank)
    gen = (store.add("neuron/generation", 1) - 1) // size
    key = f"neuron/{gen}"
    mine = [node_identity(settings), machine(), selection_settings(settings), cpu_identity()]
    if auth.enabled:
        mine.append(secrets.token_hex(16))  # freshness: the session binds every rank's
    auth.set(f"{key}/node/{rank}", json.dumps(mine))
    raws = auth.get_all([f"{key}/node/{k}" for k in range(size)], list(range(size)))
    if auth.enabled:
        if json.loads(raws[rank]) != mine:
            raise StoreAuthError(f"store key '{key}/node/{rank}' (written by this rank, "
                                 f"{rank}) came back changed: someone else writes the store")
        auth.bind(hashlib.sha256(b"".join(len(r).to_bytes(4, "big") + r
                                          for r in raws)).digest())
    nodes = [json.loads(r)[:4] for r in raws]
    check_same_selection(rank, [node[2] for node in nodes])
    load = _core_load([node[3] for node in nodes], rank)
    crowd = crowding([node[3] for node in nodes])
    spin = _spin(settings, load)
    nodes = [node[:2] for node in nodes]
    topo = Topology.from_names(rank, [name for name, _ in nodes])
    check_memory_model(topo, [arch for _, arch in nodes])
    local = topo.local
    channel = _open_node_channel(auth.for_rank(local.index(rank), local),
                                 f"{key}/n{topo.my_node}", local.index(rank), len(local),
                                 settings, timeout, spin)
    if len(topo.nodes) == 1:
        return GroupLinks(channel, topo, None, key, auth, _hold(settings, load, False), crowd)
    try:
        if settings.transport == "mpi":
            net = _open_mpi(auth, key, rank, size, timeout, label, topo.column())
        else:
            net = _open_network(auth, key, rank, size, size - len(topo.local), settings,
                                timeout, label, spin)
    except BaseException:
        channel.close()
        raise
    log.info("neuron: group rank %d/%d spans %d nodes (%s); %s from %s",
             rank, size, len(topo.nodes), topo.describe(),
             "MPI" if settings.transport == "mpi" else f"{settings.rails} rail(s) per peer",
             net.address)
    return GroupLinks(channel, topo, net, key, auth, _hold(settings, load, True), crowd)


_load = (0, 1)  # (ranks, cores) of the most crowded cores any group of this process showed

# How long an async collective waits for its caller when no core is spare (engine.py,
# "Held"): the caller runs it when it waits, unless this passes first.
HOLD_SECONDS = 0.005


def _core_load(cpus: list, rank: int) -> tuple:
    """``(ranks, cores)``: the ranks competing for this rank's cores and the cores they
    share (``topology.core_rivals``; ``cpus``: every rank's ``topology.cpu_identity``,
    ranks of other nodes on the same kernel count: virtual nodes and containers share the
    machine's cores). The most crowded verdict is kept for the process's later groups,
    which see only some of the ranks (the default group, made first, sees them all)."""
    global _load
    ranks, cores = core_rivals(cpus[rank], cpus)
    if ranks * _load[1] > _load[0] * cores:
        _load = (ranks, cores)
    return _load


def _spin(settings, load: tuple) -> int:
    """Polls a waiting rank of this group makes before it yields (``NEURON_DIST_SPIN``; by
    default ``SPIN_POLLS``, or none when ranks outnumber their cores: ``_core_load``)."""
    if settings.spin is not None:
        return settings.spin
    return 0 if load[0] > load[1] else SPIN_POLLS


def _hold(settings, load: tuple, spans_nodes: bool) -> float:
    """Seconds an async collective of this group waits for its caller before the engine
    thread starts it (``NEURON_DIST_ASYNC_HOLD``; by default ``HOLD_SECONDS`` in a one-node
    group when no core is spare for the engine thread, as many ranks as cores or more, else
    none). A group that spans nodes starts them at once: much of its time is a wait for
    the network, which the caller's compute can fill even without a spare core (holding
    them too gains the main job nothing and costs CPU: docs/design.md, "Tried and dropped")."""
    if settings.async_hold is not None:
        return settings.async_hold
    return HOLD_SECONDS if load[0] >= load[1] and not spans_nodes else 0.0


def selection_settings(settings) -> str:
    """The settings every rank must share, as text: those that choose algorithms
    (collectives/selection.py), and the network's (which transport, how many rails to a
    peer, how messages are cut into frames and checked: a rank that differs would only
    show up later as a malformed frame or an unreachable peer)."""
    algo = ",".join(f"{o.table}:{o.lo}-{'' if o.hi is None else o.hi}={o.algorithm}"
                    for o in settings.algo) or "auto"
    return (f"NEURON_DIST_ALGO={algo} NEURON_DIST_SMALL_BYTES={settings.small_bytes} "
            f"NEURON_DIST_SHM_SLOT_BYTES={settings.slot_bytes} "
            f"NEURON_DIST_NET_COST={settings.net_cost.describe()} "
            f"NEURON_DIST_TRANSPORT={settings.transport} NEURON_DIST_RAILS={settings.rails} "
            f"NEURON_DIST_NET_SEGMENT_BYTES={settings.net_segment_bytes} "
            f"NEURON_DIST_NET_CRC={int(settings.net_crc)} "
            f"NEURON_DIST_NET_MAC={int(settings.net_mac)}")


def check_same_selection(rank: int, choices: list) -> None:
    """Fail (every rank alike) if the ranks' ``selection_settings`` differ."""
    if len(set(choices)) > 1:
        raise ValueError(
            f"neuron: rank {rank}: the ranks of a group must share the settings that choose "
            f"algorithms and frame the network's messages; rank 0 has {choices[0]!r}, "
            + ", ".join(f"rank {k} {c!r}" for k, c in enumerate(choices) if c != choices[0]))


def forget_group(store, key: str, topo: Topology) -> None:
    """Delete the keys ``open_group`` wrote under ``key`` (every rank's, dead ones' too).

    Called once a group is replaced (shrink.py); nothing reads a generation's keys after
    its set-up, so this only keeps a long job's store from growing.
    """
    size = sum(len(node) for node in topo.nodes)
    keys = [f"{key}/{k}" for k in ("secret", "nonce")]
    for k in range(size):
        keys += [f"{key}/node/{k}", f"{key}/addr/{k}", f"{key}/mpi/{k}"]
    for n, node in enumerate(topo.nodes):
        nk = f"{key}/n{n}"
        keys += [f"{nk}/segment", f"{nk}/attached", f"{nk}/refused"]
        for local in range(len(node)):
            keys += [f"{nk}/cma/addr/{local}", f"{nk}/cma/ok/{local}"]
    for k in keys:
        store.delete_key(k)


def check_memory_model(topo: Topology, archs: list) -> None:
    """Refuse (on every rank alike) a node whose ranks would share memory on a CPU the
    shared-memory protocol is not correct on; ``archs[k]`` is group rank k's architecture."""
    for ranks in topo.nodes:
        bad = sorted({archs[k] for k in ranks if not shares_memory_safely(archs[k])})
        if len(ranks) > 1 and bad:
            raise ShmSetupError(
                f"group ranks {list(ranks)} share a node whose CPU is {'/'.join(bad)}: neuron's "
                f"shared-memory protocol relies on x86-64's store ordering and would give wrong "
                f"results on a weakly ordered CPU. Make every rank its own node, so ranks talk "
                f"over the network transport (TCP on loopback): set NEURON_DIST_NODE_NAME to a "
                f"different value in each rank, e.g. "
                f"os.environ['NEURON_DIST_NODE_NAME'] = f\"{{socket.gethostname()}}-"
                f"{{os.environ['LOCAL_RANK']}}\" before init_process_group")


def _open_mpi(auth: StoreAuth, key: str, rank: int, size: int, timeout: timedelta,
              label: str, column: list):
    """The group's MPI transport: ranks publish their MPI_COMM_WORLD rank, then build the
    group's communicator together, and each ``column`` (the ranks MPI's own collectives run
    among: collectives/net_mpi.py) its own."""
    from .transport.mpi import MpiTransport, world_rank  # mpi4py (and MPI_Init) only here
    auth.set(f"{key}/mpi/{rank}", str(world_rank()))
    world_ranks = [int(raw) for raw in
                   auth.get_all([f"{key}/mpi/{k}" for k in range(size)], list(range(size)))]
    deadline = time.monotonic() + timeout.total_seconds()
    net = MpiTransport(rank, size, world_ranks, label=label or f"rank {rank}", deadline=deadline,
                       column=column)
    try:
        net.connect(range(size), deadline)
    except BaseException:
        net.close()
        raise
    return net


_REFUSED = 1 << 40  # added to the attach count by a rank that refused the segment
_REFUSED_ADDRESS = "!"  # published instead of an address by a rank that cannot connect


def _open_node_channel(auth: StoreAuth, key: str, rank: int, size: int, settings,
                       timeout: timedelta, spin: int) -> ShmChannel:
    """The node's shared memory; ``rank``, ``size``: this rank's index on the node and the
    node's rank count; ``auth`` writes as that index."""
    store = auth.store
    layout = Layout(size, settings.slot_bytes, settings.mailbox_bytes)
    if rank == 0:
        sweep_leftovers(settings.shm_dir)
        segment = Segment.create(new_segment_name(), layout.total_bytes, layout.eager_ranges(),
                                 directory=settings.shm_dir)
        channel = ShmChannel(segment, layout, rank, spin)  # (writes the magic word first)
        auth.set(f"{key}/segment", segment.name)
    else:
        segment = None
        try:
            segment = Segment.attach(auth.get(f"{key}/segment", 0).decode(), layout.total_bytes,
                                     directory=settings.shm_dir)
            channel = ShmChannel(segment, layout, rank, spin)  # (checks the magic word)
        except (ShmSetupError, StoreAuthError) as exc:  # tell the creator, who waits for the count
            if segment is not None:
                segment.close()
            store.set(f"{key}/refused", f"local rank {rank} of the node: {exc}")
            store.add(f"{key}/attached", _REFUSED)
            raise
    store.add(f"{key}/attached", 1)
    try:
        # every rank waits for the count, so that a rank that refused the segment fails
        # them all at once, naming why (instead of leaving them waiting in the probe below)
        deadline = time.monotonic() + timeout.total_seconds()
        while (count := store.add(f"{key}/attached", 0)) != size:
            if count >= _REFUSED:
                raise ShmSetupError(f"a peer refused this node's shared-memory segment: "
                                    f"{store.get(f'{key}/refused').decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {count} of {size} ranks attached the shared-memory "
                                   f"segment within {timeout}")
            time.sleep(0.001)
    except BaseException:
        channel.close()  # (the creator's close unlinks the name)
        raise
    if rank == 0:
        segment.unlink()
    if size > 1:
        channel.cma = cma.probe(auth, key, rank, size, channel.pid_word_address(), settings.cma)
    return channel


def _open_network(auth: StoreAuth, key: str, rank: int, size: int, remote: int, settings,
                  timeout: timedelta, label: str, spin: int) -> RdmTransport:
    """The group's rdm transport, its peers' addresses known; ``remote``: how many ranks of
    the group are on other nodes (the most this rank may open rails to: see driver.py)."""
    store = auth.store
    if settings.auth_key:
        job_key = derive_key(settings.auth_key)
    else:  # (no key: the store is trusted, and carries the random job key in clear)
        if rank == 0:
            store.set(f"{key}/secret", secrets.token_bytes(32))
        job_key = store.get(f"{key}/secret")
    if rank == 0:
        auth.set(f"{key}/nonce", secrets.token_hex(16))
    group = f"{key}/{auth.get(f'{key}/nonce', 0).decode()}".encode()
    net = RdmTransport(rank, size, host=choose_addresses(settings.socket_ifname, store, settings.master_addr),
                       rails=settings.rails, key=job_key, group=group,
                       segment_bytes=settings.net_segment_bytes, crc=settings.net_crc,
                       frame_mac=bool(settings.auth_key), payload_mac=settings.net_mac,
                       link_timeout=settings.net_link_timeout,
                       max_unexpected_bytes=settings.net_max_unexpected_bytes,
                       label=label or f"rank {rank}", spin=spin,
                       port_range=settings.port_range)
    try:
        try:  # room for this group's connections, or every rank is told why not
            fd_budget.reserve(settings.rails * remote,
                              f"{settings.rails} rail(s) to each of {remote} peer(s) on "
                              f"other nodes", f"NEURON_DIST_RAILS=1 needs {remote}")
        except DescriptorLimit as e:
            why = f"rank {rank}: {e}"
            auth.set(f"{key}/addr/{rank}", _REFUSED_ADDRESS + why)
            raise DescriptorLimit(why) from None
        auth.set(f"{key}/addr/{rank}", net.address)
        others = [k for k in range(size) if k != rank]
        peers = {k: raw.decode() for k, raw in
                 zip(others, auth.get_all([f"{key}/addr/{k}" for k in others], others))}
        for address in peers.values():
            if address.startswith(_REFUSED_ADDRESS):
                raise DescriptorLimit(f"a peer cannot open this group's connections: "
                                      f"{address[len(_REFUSED_ADDRESS):]}")
        net.connect(peers, time.monotonic() + timeout.total_seconds())
    except BaseException:
        net.close()
        raise
    return net
