"""Every NEURON_DIST_* setting, parsed in one place. The README's settings table mirrors this."""

from __future__ import annotations

import os
from dataclasses import dataclass

_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


def parse_bytes(text: str) -> int:
    """'4M' -> 4194304; plain integers are bytes."""
    t = text.strip().lower().rstrip("ib").rstrip("b")
    if t and t[-1] in _UNITS:
        return int(float(t[:-1]) * _UNITS[t[-1]])
    return int(t)


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


@dataclass(frozen=True)
class Settings:
    """Backend settings; see ``from_env`` for the variables and their defaults."""

    slot_bytes: int
    mailbox_bytes: int
    small_bytes: int
    spin: int | None
    shm_dir: str
    node_name: str | None
    debug: str
    rails: int = 4
    net_segment_bytes: int = 8 << 20
    socket_ifname: str | None = None
    auth_key: str | None = None
    net_crc: bool = False
    net_link_timeout: float = 10.0
    net_max_unexpected_bytes: int = 512 << 20
    algo: str = "auto"
    transport: str = "rdm"

    @classmethod
    def from_env(cls) -> "Settings":
        """Read the environment.

        NEURON_DIST_SHM_SLOT_BYTES     1M    bytes per rank per collective step (x2 buffers)
        NEURON_DIST_SHM_MAILBOX_BYTES  1M    send/recv ring per ordered rank pair (on first use)
        NEURON_DIST_SMALL_BYTES        64K   all_reduce up to this size uses one step
        NEURON_DIST_SPIN               auto  polls before a wait yields (0 when oversubscribed)
        NEURON_DIST_SHM_DIR            /dev/shm
        NEURON_DIST_NODE_NAME          hostname+boot id: ranks with equal names share memory
        NEURON_DIST_DEBUG              WARN  WARN, INFO or TRACE
        NEURON_DIST_RAILS              4     TCP connections ("rails") per pair of ranks on
                                             different nodes; each takes traffic once the
                                             ones before it hold 4 MiB unacknowledged
        NEURON_DIST_NET_SEGMENT_BYTES  8M    largest piece of a message on one rail
        NEURON_DIST_SOCKET_IFNAME      auto  interface(s) for inter-node traffic, comma-
                                             separated (eth0,eth1: rails alternate between
                                             them); default: the one that routes to the
                                             rendezvous host
        NEURON_DIST_NET_LINK_TIMEOUT   10    seconds a rail may hold unacknowledged bytes at
                                             the TCP level before it is declared broken (a
                                             lost link or NIC); its traffic moves to the
                                             other rails
        NEURON_DIST_NET_MAX_UNEXPECTED_BYTES  512M  memory per peer for messages that arrive
                                             before their receive is posted; past it the
                                             peer is held back (not acknowledged)
        NEURON_DIST_AUTH_KEY           -     job secret for rail authentication (default: a
                                             random key shared through the c10d store)
        NEURON_DIST_NET_CRC            0     1: CRC-32 on every inter-node frame
        NEURON_DIST_ALGO               auto  multi-node groups: auto, hierarchical or leader
        NEURON_DIST_TRANSPORT          rdm   between nodes: rdm (TCP rails) or mpi (mpi4py;
                                             ranks started by one mpiexec)

        The flight recorder reads NEURON_DIST_FR_SIZE (2000) and NEURON_DIST_FR_DIR (default:
        the temp directory) itself (neuron_dist/flight_recorder.py): it is process-wide, not
        per group.
        """
        spin = _env("NEURON_DIST_SPIN", "auto")
        settings = cls(
            slot_bytes=parse_bytes(_env("NEURON_DIST_SHM_SLOT_BYTES", "1M")),
            mailbox_bytes=parse_bytes(_env("NEURON_DIST_SHM_MAILBOX_BYTES", "1M")),
            small_bytes=parse_bytes(_env("NEURON_DIST_SMALL_BYTES", "64K")),
            spin=None if spin == "auto" else int(spin),
            shm_dir=_env("NEURON_DIST_SHM_DIR", "/dev/shm"),
            node_name=os.environ.get("NEURON_DIST_NODE_NAME") or None,
            debug=_env("NEURON_DIST_DEBUG", "WARN").upper(),
            rails=int(_env("NEURON_DIST_RAILS", "4")),
            net_segment_bytes=parse_bytes(_env("NEURON_DIST_NET_SEGMENT_BYTES", "8M")),
            socket_ifname=os.environ.get("NEURON_DIST_SOCKET_IFNAME") or None,
            auth_key=os.environ.get("NEURON_DIST_AUTH_KEY") or None,
            net_crc=_env("NEURON_DIST_NET_CRC", "0") not in ("0", "", "false", "no"),
            net_link_timeout=float(_env("NEURON_DIST_NET_LINK_TIMEOUT", "10")),
            net_max_unexpected_bytes=parse_bytes(
                _env("NEURON_DIST_NET_MAX_UNEXPECTED_BYTES", "512M")),
            algo=_env("NEURON_DIST_ALGO", "auto").lower(),
            transport=_env("NEURON_DIST_TRANSPORT", "rdm").lower(),
        )
        if settings.transport not in ("rdm", "mpi"):
            raise ValueError(f"NEURON_DIST_TRANSPORT must be rdm or mpi, got {settings.transport!r}")
        if not 1 <= settings.rails <= 64:
            raise ValueError(f"NEURON_DIST_RAILS must be 1..64, got {settings.rails}")
        if settings.algo not in ("auto", "hierarchical", "leader"):
            raise ValueError(f"NEURON_DIST_ALGO must be auto, hierarchical or leader, got "
                             f"{settings.algo!r}")
        for name in ("slot_bytes", "mailbox_bytes"):
            value = getattr(settings, name)
            if value < 4096 or value % 4096:
                raise ValueError(f"NEURON_DIST_SHM_{name.split('_')[0].upper()}_BYTES must be a "
                                 f"multiple of 4096 and at least 4096, got {value}")
        if settings.net_link_timeout <= 0:
            raise ValueError(f"NEURON_DIST_NET_LINK_TIMEOUT must be > 0 seconds, got "
                             f"{settings.net_link_timeout}")
        if settings.debug not in ("WARN", "INFO", "TRACE"):
            raise ValueError(f"NEURON_DIST_DEBUG must be WARN, INFO or TRACE, got {settings.debug!r}")
        return settings
