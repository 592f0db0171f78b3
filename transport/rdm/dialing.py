"""Dialing a rail: connecting to a peer's listener and authenticating, and dialing a lost
rail again.

How it works
------------
``dial`` connects to where a peer listens and runs the handshake (handshake.py) for one
rail. A refused connection is retried for ``_REFUSED_RETRY`` seconds (a listener starting),
and a handshake dropped before it ended (``HandshakeDropped``: the listener sheds
unfinished handshakes under a flood of strangers, listener.py) is dialed again with a
growing pause, both until the deadline. A refusal (the peer answered NO: wrong key, a
group it does not have) and a stalled peer (``HandshakeTimeout``) end the dial at once.

Rails heal (``Healer``): while a link keeps a live rail, the process that dialed it dials
the lost one again from a thread of its own, after a pause that doubles with every failed
attempt (``_HEAL_PAUSE`` up to ``_HEAL_PAUSE_MAX``, with jitter); the peer's listener grants
that dial only for a rail it has lost too (``RailOpening.may_dial``), and the new
connection takes the old one's place for every group on the link
(``RdmTransport.rail_restored``). So a link that flaps keeps its rails, instead of running
down to its last one. A rail closed because its bytes could not be trusted (malformed,
corrupted, unauthenticated) is not dialed again by the end that closed it, nor granted
again to the other end.
"""

from __future__ import annotations

import errno
import logging
import random
import socket
import threading
import time
from typing import TYPE_CHECKING

from ..errors import PeerTimeout, PeerUnreachable
from . import handshake
from .listener import HANDSHAKE_TIMEOUT

if TYPE_CHECKING:
    from .links import Link
    from .opening import RailOpening

log = logging.getLogger("neuron_dist.rdm")

_REFUSED_RETRY = 2.0  # seconds a dial retries a refused connection (a listener starting)
# Pauses before dialing again after a dropped handshake: from the first, doubling up to the
# last (with jitter, so dialers shed together do not come back together).
_DROPPED_PAUSE, _DROPPED_PAUSE_MAX = 0.01, 0.5
# Pauses before dialing a lost rail again: the first lets the peer see the break too (it
# grants a rail it still holds to nobody), then doubling up to the last for as long as the
# link keeps another live rail. One attempt (connect and handshake) may take
# _HEAL_DIAL_SECONDS: a close waits that long at most for a healer in the middle of one.
_HEAL_PAUSE, _HEAL_PAUSE_MAX, _HEAL_DIAL_SECONDS = 0.05, 5.0, 2.0


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def dial(opening: RailOpening, peer: int, host: str, port: int, rail: int,
         deadline: float) -> tuple[socket.socket, bytes]:
    """Connect rail ``rail`` of ``opening``'s rank to ``peer`` at ``host:port`` and
    authenticate it; the connected socket and the rail's session key."""
    refused_until = time.monotonic() + _REFUSED_RETRY
    pause, dropped, silent = _DROPPED_PAUSE, None, False
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    hosts, rank = opening.hosts, opening.owner.rank
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = (f" (the handshake was dropped: {dropped})" if dropped else
                   " (no answer to the connection: a firewall dropping that port, or an "
                   "address this host has no route to; NEURON_DIST_PORT_RANGE sets the "
                   "ports ranks listen on, NEURON_DIST_SOCKET_IFNAME the interface)"
                   if silent else "")
            raise PeerTimeout([peer], 0.0, f"could not connect rail {rail} to rank {peer} "
                                           f"at {where}{why}", network=True)
        source = hosts[rail % len(hosts)]
        try:
            sock = socket.create_connection(
                (host, port), timeout=min(remaining, HANDSHAKE_TIMEOUT),
                source_address=(source, 0) if len(hosts) > 1 else None)
        except ConnectionRefusedError:
            if time.monotonic() > refused_until:  # its listener is gone
                raise PeerUnreachable(peer, f"connection refused at {where}, where rank "
                                            f"{peer} listens: its process has exited or "
                                            f"closed all its groups, or a firewall rejects "
                                            f"that port (NEURON_DIST_PORT_RANGE sets the "
                                            f"ports ranks listen on)") from None
            time.sleep(0.05)
            continue
        except TimeoutError:  # (socket.timeout) no SYN-ACK: dropped on the way
            silent = True
            continue
        except OSError as e:
            if e.errno not in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL):
                raise
            raise PeerUnreachable(peer, f"cannot reach {where}, where rank {peer} listens, "
                                        f"from {source}: {e.strerror} (a wrong interface? "
                                        f"NEURON_DIST_SOCKET_IFNAME names the one to "
                                        f"use)") from None
        try:
            session = handshake.dial(sock, opening.key, opening.group, rank, rail, peer,
                                     min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT))
        except handshake.HandshakeDropped as e:
            sock.close()
            dropped = e
            log.info("neuron %s: rail %d to rank %d: %s; dialing again",
                     opening.owner.label, rail, peer, e)
            time.sleep(min(pause * random.uniform(0.5, 1.0),
                           max(0.0, deadline - time.monotonic())))
            pause = min(_DROPPED_PAUSE_MAX, pause * 2)
            continue
        except BaseException:
            sock.close()
            raise
        return sock, session


class Healer:
    """Dials the lost rails of the links ``opening``'s rank dialed, each from a thread of
    its own, while the link keeps another live rail."""

    def __init__(self, opening: RailOpening):
        self._opening = opening
        self.threads: list[threading.Thread] = []  # joined by stop
        self.healing: set[tuple[Link, int]] = set()  # (link, rail index) with a healer
        self._stopping = threading.Event()

    def heal(self, link: Link, peer: int, index: int) -> None:
        """Under the lock: rail ``index`` of ``link`` (``peer`` is the far end's rank in
        this group) broke while another rail lives: dial it again from a thread of its own
        (``_dial_again``), unless one does already."""
        owner = self._opening.owner
        if owner.closed or (link, index) in self.healing:
            return
        healer = threading.Thread(target=self._dial_again, args=(link, peer, index),
                                  daemon=True, name=f"neuron-rail-heal-{peer}-{index}")
        try:
            healer.start()
        except RuntimeError as e:  # (a thread limit): the link goes on with fewer rails
            log.warning("neuron %s: cannot dial rail %d to rank %d again: %s", owner.label,
                        index, peer, e)
            return
        self.healing.add((link, index))
        self.threads = [t for t in self.threads if t.is_alive()] + [healer]

    def _dial_again(self, link: Link, peer: int, index: int) -> None:
        """Dial rail ``index`` to ``peer`` again until it is back, with a pause before each
        attempt that doubles after each failure; stop when the link, the peer or the
        transport is gone, or the link has no other live rail (its peer has failed)."""
        opening = self._opening
        owner = opening.owner
        pause = _HEAL_PAUSE
        try:
            while not self._stopping.wait(pause * random.uniform(0.5, 1.0)):
                with owner.lock:
                    if (owner.closed or peer in owner.failed or not link.healable()
                            or opening.link_of.get(peer) is not link
                            or link.rails[index].alive):  # type: ignore[union-attr]  # (healable)
                        return
                    theirs = opening.addresses(peer)
                host, port = theirs[index % len(theirs)]
                try:
                    conn = dial(opening, peer, host, port, index,
                                time.monotonic() + _HEAL_DIAL_SECONDS)
                    opening.add_rail(conn, peer, index, dialer=True)
                except Exception as e:  # noqa: BLE001 - the peer may not have seen the break yet
                    log.info("neuron %s: dialing rail %d to rank %d again failed: %s",
                             owner.label, index, peer, e)
                    pause = min(_HEAL_PAUSE_MAX, pause * 2)
        except Exception:  # noqa: BLE001 - never a healer that dies unnoticed
            log.exception("neuron %s: the healer of rail %d to rank %d failed", owner.label,
                          index, peer)
        finally:
            with owner.lock:
                self.healing.discard((link, index))

    def healed(self, link: Link, index: int) -> None:
        """Under the lock: rail ``index`` of ``link`` is connected again: every group on the
        link sends on it again, and other groups may join the link once all its rails are
        up."""
        log.info("neuron %s: rail %d is connected again", link.label, index)
        for t, peer in list(link.members.values()):
            if not t.closed:
                t.rail_restored(index, peer)
        if link.key is not None and all(r is not None and r.alive for r in link.rails):
            self._opening.owner.engine.publish(link)

    def stop(self) -> None:
        """Stop the healers and join them (a healer in the middle of a dial finishes it)."""
        self._stopping.set()
        me = threading.current_thread()
        for t in list(self.threads):
            if t is not me:
                t.join(timeout=2.0)
