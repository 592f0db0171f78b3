"""Every NEURON_DIST_* setting, read from the environment here and nowhere else.

Two kinds:

* per group: ``Settings.from_env()``, read each time torch creates a neuron group (so a
  program may change a variable between ``new_group`` calls), checked, and handed down:
  the transports never read the environment themselves;
* per process: ``flight_recorder_size()`` and ``flight_recorder_dir()`` (the flight
  recorder is one ring per process).

``environment()`` returns the variables that are set, for benchmark records. The README's
settings table lists every variable with its meaning and default; tests/units/test_config.py
checks that it lists exactly the ones read here, with the same defaults, that no other
module reads one, and that every ``Settings`` field is used.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from .collectives.net_cost import MEASURED, Link, parse as parse_link
from .collectives.selection import parse_overrides

PREFIX = "NEURON_DIST_"
_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


def parse_bytes(text: str) -> int:
    """'4M' -> 4194304; plain integers are bytes."""
    t = text.strip().lower().rstrip("ib").rstrip("b")
    if t and t[-1] in _UNITS:
        return int(float(t[:-1]) * _UNITS[t[-1]])
    return int(t)


def _env(name: str, default: str | None = None, env: Mapping | None = None) -> str | None:
    """The raw value of ``name`` in ``env`` (the process environment if None), ``default``
    when unset: the only place settings are read from."""
    return (os.environ if env is None else env).get(name, default)


def _flag(name: str, default: str, env: Mapping | None = None) -> bool:
    return _env(name, default, env).strip().lower() not in ("0", "", "false", "no", "off")


SECRET = "NEURON_DIST_AUTH_KEY"  # never written anywhere: environment() leaves it out
MIN_AUTH_KEY_CHARS = 16


def environment() -> dict[str, str]:
    """The NEURON_DIST_* variables set in this process, as text (for benchmark records),
    the job's secret key left out (only whether one is set)."""
    out = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
    if SECRET in out:
        out[SECRET] = "(set)"
    return out


def _auth_key(key: str | None) -> str | None:
    if key is not None and len(key) < MIN_AUTH_KEY_CHARS:
        raise ValueError(f"{SECRET} must be at least {MIN_AUTH_KEY_CHARS} characters (it has "
                         f"{len(key)}): anyone who can read the store could guess a short one "
                         f"offline. Use e.g. the output of `openssl rand -hex 32`")
    return key


@dataclass(frozen=True)
class Settings:
    """A group's settings (see the README's settings table for what each one does)."""

    slot_bytes: int
    mailbox_bytes: int
    small_bytes: int
    spin: int | None
    async_hold: float | None
    shm_dir: str
    node_name: str | None
    debug: str
    cma: bool = True
    rails: int = 4
    net_segment_bytes: int = 8 << 20
    socket_ifname: str | None = None
    auth_key: str | None = None
    net_crc: bool = False
    net_mac: bool = False
    net_link_timeout: float = 10.0
    net_max_unexpected_bytes: int = 512 << 20
    algo: tuple = ()  # NEURON_DIST_ALGO: selection.Override rows, in front of the tables
    net_cost: Link = MEASURED  # NEURON_DIST_NET_COST: the network's costs the tables price
    transport: str = "rdm"
    master_addr: str | None = None  # torchrun's MASTER_ADDR: where the rendezvous host is
    port_range: tuple | None = None  # NEURON_DIST_PORT_RANGE: (first, last) listening port

    @classmethod
    def from_env(cls, env: Mapping | None = None) -> "Settings":
        """Read and check the group settings from ``env`` (default: the process environment;
        ``from_env({})`` gives the defaults).

        Raises
        ------
        ValueError
            A variable holds a value it cannot take (the message names it).
        """
        spin = _env("NEURON_DIST_SPIN", "auto", env)
        hold = _env("NEURON_DIST_ASYNC_HOLD", "auto", env)
        settings = cls(
            slot_bytes=parse_bytes(_env("NEURON_DIST_SHM_SLOT_BYTES", "1M", env)),
            mailbox_bytes=parse_bytes(_env("NEURON_DIST_SHM_MAILBOX_BYTES", "4M", env)),
            small_bytes=parse_bytes(_env("NEURON_DIST_SMALL_BYTES", "64K", env)),
            spin=None if spin == "auto" else int(spin),
            async_hold=None if hold == "auto" else _seconds("NEURON_DIST_ASYNC_HOLD", hold),
            shm_dir=_env("NEURON_DIST_SHM_DIR", "/dev/shm", env),
            node_name=_env("NEURON_DIST_NODE_NAME", None, env) or None,
            debug=_env("NEURON_DIST_DEBUG", "WARN", env).upper(),
            cma=_flag("NEURON_DIST_CMA", "1", env),
            rails=int(_env("NEURON_DIST_RAILS", "4", env)),
            net_segment_bytes=parse_bytes(_env("NEURON_DIST_NET_SEGMENT_BYTES", "8M", env)),
            socket_ifname=_env("NEURON_DIST_SOCKET_IFNAME", None, env) or None,
            auth_key=_auth_key(_env("NEURON_DIST_AUTH_KEY", None, env) or None),
            net_crc=_flag("NEURON_DIST_NET_CRC", "0", env),
            net_mac=_flag("NEURON_DIST_NET_MAC", "0", env),
            net_link_timeout=float(_env("NEURON_DIST_NET_LINK_TIMEOUT", "10", env)),
            net_max_unexpected_bytes=parse_bytes(
                _env("NEURON_DIST_NET_MAX_UNEXPECTED_BYTES", "512M", env)),
            algo=parse_overrides(_env("NEURON_DIST_ALGO", "auto", env), parse_bytes),
            net_cost=parse_link(_env("NEURON_DIST_NET_COST", "auto", env)),
            transport=_env("NEURON_DIST_TRANSPORT", "rdm", env).lower(),
            master_addr=_env("MASTER_ADDR", None, env) or None,
            port_range=parse_port_range(_env("NEURON_DIST_PORT_RANGE", None, env)),
        )
        settings._check()
        return settings

    def _check(self) -> None:
        if self.transport not in ("rdm", "mpi"):
            raise ValueError(f"NEURON_DIST_TRANSPORT must be rdm or mpi, got {self.transport!r}")
        if not 1 <= self.rails <= 64:
            raise ValueError(f"NEURON_DIST_RAILS must be 1..64, got {self.rails}")
        for name in ("slot_bytes", "mailbox_bytes"):
            value = getattr(self, name)
            if value < 4096 or value % 4096:
                raise ValueError(f"NEURON_DIST_SHM_{name.split('_')[0].upper()}_BYTES must be a "
                                 f"multiple of 4096 and at least 4096, got {value}")
        if self.net_link_timeout <= 0:
            raise ValueError(f"NEURON_DIST_NET_LINK_TIMEOUT must be > 0 seconds, got "
                             f"{self.net_link_timeout}")
        if self.async_hold is not None and not 0 <= self.async_hold <= 3600:
            raise ValueError(f"NEURON_DIST_ASYNC_HOLD must be auto or 0..3600 seconds, got "
                             f"{self.async_hold}")
        if self.debug not in ("WARN", "INFO", "TRACE"):
            raise ValueError(f"NEURON_DIST_DEBUG must be WARN, INFO or TRACE, got {self.debug!r}")


def parse_port_range(text: str | None) -> tuple | None:
    """``NEURON_DIST_PORT_RANGE``'s text (``40000-40100``, both ends included; empty: any
    free port) -> ``(first, last)`` or None.

    Raises
    ------
    ValueError
        Not two port numbers ``first-last`` with ``1 <= first <= last <= 65535``.
    """
    text = (text or "").strip()
    if not text:
        return None
    first, dash, last = text.partition("-")
    try:
        if not dash:
            raise ValueError
        lo, hi = int(first), int(last)
        if not 1 <= lo <= hi <= 65535:
            raise ValueError
    except ValueError:
        raise ValueError(f"NEURON_DIST_PORT_RANGE must be FIRST-LAST, two ports with "
                         f"1 <= FIRST <= LAST <= 65535 (e.g. 40000-40100), got {text!r}") from None
    return lo, hi


def _seconds(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be auto or a number of seconds, got {text!r}") from None


def flight_recorder_size() -> int:
    """``NEURON_DIST_FR_SIZE``: collectives the flight recorder keeps (0: it is off)."""
    size = int(_env("NEURON_DIST_FR_SIZE", "2000"))
    if size < 0:
        raise ValueError(f"NEURON_DIST_FR_SIZE must be >= 0, got {size}")
    return size


def flight_recorder_dir() -> str:
    """``NEURON_DIST_FR_DIR``: where flight-recorder dumps go (default: the temp directory)."""
    return _env("NEURON_DIST_FR_DIR") or tempfile.gettempdir()
