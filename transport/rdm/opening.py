"""Opening a group's rails to its peers: dialing, accepting, joining and losing them.

How it works
------------
Connections are opened on first use: the first time a rank sends to a peer, its transport
asks ``RailOpening.open`` for the peer's rails. When this process has a link to the peer's
process already (another group's rails: links.py), the group joins it with an
authenticated JOIN on every rail; else this rank dials rail 0, 1, ... in turn
(dialing.py), and each connection, authenticated for the group (handshake.py), becomes
rail ``i`` of that pair at both ends. So a rank holds connections only to the ranks it
talks to. When two ranks dial (or join) each other at once, the higher rank's rails are
kept: its listener answers the lower rank's dial with ``Crossed`` (``may_dial``), a JOIN
from the lower rank is not answered, and the lower rank waits for the rails.

A peer's rails are up once every rail is open (or joined) for this group (``up``). A rail
that breaks while they are being opened fails the pair at the acceptor, unless the peer
has dialed every rail and been answered (``_lose_rail``); once they are up it is one rail
lost: the transport's endpoint resends its traffic on the other rails, and the process
that dialed the link dials it again (dialing.py, ``Healer``). A group that stops using its
rails to a peer (``detach``) sends LEAVE on them when other groups keep the link, and the
last group closes them.

Everything here runs under the process's network lock (progress.NET_LOCK) except the
dials themselves. What the transport learns from it comes through a few calls on the
transport: ``check_usable``, ``fail_peer``, ``rail_failed``, ``rail_restored`` and its
abort notices' ``rails_up``; its ``closed`` and ``failed`` say whether it still talks to a peer.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Sequence

from ..errors import PeerTimeout, PeerUnreachable
from . import handshake
from .dialing import Healer, dial, split_address
from .links import CLEAN_EOF, DEAD, JOIN, LEAVE, Link, Rail
from .listener import HANDSHAKE_TIMEOUT
from .railmac import RailMac

if TYPE_CHECKING:
    from .driver import RdmTransport
    from .links import LinkKey

log = logging.getLogger("neuron_dist.rdm")

_DIALING, _ACCEPTING, _JOINING = "dialing", "accepting", "joining"  # how a peer's rails open


class _Join:
    """A group joining a link to one peer (links.py): the rails it has sent its JOIN on and
    heard the peer's on."""

    __slots__ = ("link", "sent", "heard", "deadline")

    def __init__(self, link: Link):
        self.link = link
        self.sent: set[int] = set()
        self.heard: set[int] = set()
        # A live process answers at once (its engine reads rails at least every 100 ms
        # while nobody waits): like a dial's handshake, a join has HANDSHAKE_TIMEOUT.
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT


class RailOpening:
    """The rails of one group's rank (``owner``, its transport) to its peers: which are up,
    which are being opened and how, and the calls of the listener (``may_dial``,
    ``release``, ``accepted``) and of links (``on_join``, ``on_leave``, ``rail_lost``) that
    move them along.

    ``rails`` maps a peer to its rails by index (None: not yet; DEAD: let go of), ``up``
    holds the peers whose rails are all open, ``expected`` the group's other ranks once
    ``connect`` has named them: the transport reads these three on every message.
    """

    def __init__(self, owner: RdmTransport, *, key: bytes, group: bytes, hosts: list[str],
                 mac: tuple[bool, bool], link_timeout: float):
        self.owner = owner
        self.key, self.group = key, group  # (the listener's handshake checks them)
        self.hosts, self.mac, self.link_timeout = hosts, mac, link_timeout
        self.rails: dict[int, Sequence[Rail | None]] = {}
        self.link_of: dict[int, Link] = {}  # peer -> the Link its rails are (once it has rails)
        self.up: set[int] = set()  # peers whose rails are all open
        self.expected: set[int] = set()
        self._addresses: dict[int, str] = {}
        self._joins: dict[int, _Join] = {}  # peer -> _Join while joining a link to it
        self._left: dict[int, set[int]] = {}  # peer -> rails it sent LEAVE on
        # JOINs that came before connect(): handled by it
        self._early_joins: list[tuple[Link, Rail, int, bytes]] = []
        self._links: dict[int, str] = {}  # peer -> _DIALING, _ACCEPTING or _JOINING while rails open
        self._reserved: set[tuple[int, int]] = set()  # (peer, rail) accepted, not yet added
        self._connect_timeout = 300.0
        self._connected = threading.Condition(owner.lock)
        self._healer = Healer(self)

    # ------------------------------------------------------------------ set-up

    def connect(self, peers: dict[int, str], deadline: float) -> None:
        """Learn where the other ranks are (``RdmTransport.connect``)."""
        owner = self.owner
        with owner.lock:
            self.expected.clear()
            self.expected.update(set(peers) - {owner.rank})
            self._addresses = {p: a for p, a in peers.items() if p != owner.rank}
            self._connect_timeout = max(1.0, deadline - time.monotonic())
            for peer, link in self.link_of.items():  # (rails accepted before we knew)
                if None not in link.rails and link.key is None:
                    link.key = self.link_key(peer)
                    owner.engine.publish(link)
            early, self._early_joins = self._early_joins, []
            for args in early:
                if args[1].alive:
                    self.on_join(*args)

    def addresses(self, peer: int) -> list[tuple[str, int]]:
        """Under the lock: where ``peer`` listens, one ``(host, port)`` per interface."""
        return [split_address(a) for a in self._addresses[peer].split(",")]

    def open(self, peer: int, deadline: float | None = None, notice: bool = False) -> None:
        """Return once the rails to ``peer`` are up, opening them if nobody has: joining
        another group's link to the peer's process, or dialing rail 0, 1, ... in turn
        (rail ``i`` goes from this rank's address ``i % n`` to the peer's ``i % m``).

        Raises
        ------
        PeerUnreachable
            The rails could not be opened (the peer's process is gone, refused us, or a
            connection broke while opening); the peer is failed for this transport.
        PeerTimeout
            The peer's rails did not come up by ``deadline``.

        ``notice``: only to tell the peer of an abort, which may follow a withdrawal that
        failed the peer here already (``RdmTransport.abort``).
        """
        owner = self.owner
        if deadline is None:
            deadline = time.monotonic() + self._connect_timeout
        if self._wait(peer, deadline, dial_=True, notice=notice):
            return
        try:
            theirs = self.addresses(peer)
            for rail in range(owner.nrails):
                host, port = theirs[rail % len(theirs)]
                self.add_rail(dial(self, peer, host, port, rail, deadline), peer, rail,
                              dialer=True)
        except handshake.Crossed:
            pass  # the peer opens them: wait below
        except BaseException as e:
            if isinstance(e, (PeerUnreachable, PeerTimeout)):
                error = e
            elif isinstance(e, TimeoutError):  # it took the connection but never answered
                error = PeerTimeout([peer], 0.0, f"rank {peer} did not answer rank "
                                                 f"{owner.rank}'s connection in time "
                                                 f"(stalled?)", network=True)
            elif isinstance(e, handshake.HandshakeError):  # (its listener says why in its log)
                error = PeerUnreachable(peer, f"could not open rails to rank {peer}: it ended "
                                              f"the handshake ({e}): it has closed or aborted "
                                              f"this group, or did not take rank {owner.rank}")
            else:
                error = PeerUnreachable(peer, f"could not open rails to rank {peer}: "
                                              f"{type(e).__name__}: {e}")
            with owner.lock:
                self._link_failed(peer, error)
            raise error from None
        self._wait(peer, deadline, dial_=False, notice=notice)

    def _wait(self, peer: int, deadline: float, dial_: bool, notice: bool = False) -> bool:
        """Wait until ``peer``'s rails are up (True) or, with ``dial_``, until nobody is
        opening them (False: the caller now is, and must dial). While this group joins a
        link, the waiting thread drives the progress engine (the answers come as frames)."""
        owner = self.owner

        def joined() -> bool:
            return peer in self.up or self._links.get(peer) is not _JOINING

        while True:
            with owner.lock:
                if peer in self.up:
                    return True
                if not (notice and owner.notices.waiting_for(peer) and not owner.closed):
                    owner.check_usable(peer)
                if dial_ and peer not in self._links:
                    link = self._joinable(peer)
                    if link is None:
                        self._links[peer] = _DIALING
                        return False
                    self._start_join(peer, link)  # (a link that closes meanwhile: dial)
                    continue
                now = time.monotonic()
                remaining = deadline - now
                join = self._joins.get(peer)
                if join is not None and join.deadline <= now < deadline:
                    error = PeerTimeout([peer], 0.0, f"rank {peer} did not answer rank "
                                                     f"{owner.rank}'s JOIN in time (stalled?)",
                                        network=True)
                    self._link_failed(peer, error)
                    raise error
                if remaining <= 0:  # (half-open rails are no use: the pair is failed)
                    error = PeerTimeout([peer], 0.0, f"the rails between rank {owner.rank} "
                                                     f"and rank {peer} did not come up in time",
                                        network=True)
                    self._link_failed(peer, error)
                    raise error
                if join is None:
                    self._connected.wait(min(remaining, 0.5))
                    continue
                until = min(deadline, join.deadline, now + 0.5)
            owner.engine.drive(joined, until, None, owner.spin)

    def _link_failed(self, peer: int, error: Exception) -> None:
        """Under the lock: opening the rails to ``peer`` failed; so does everything with it."""
        self._links.pop(peer, None)
        self.owner.fail_peer(peer, error)
        self.detach(peer)
        self._connected.notify_all()

    # ------------------------------------------------------------------ shared links

    def link_key(self, peer: int) -> LinkKey | None:
        """What a link to ``peer``'s process must match for this group to use it: the
        addresses at both ends, the number of rails and the frame authentication."""
        address = self._addresses.get(peer)
        return None if address is None else (tuple(self.hosts), address, self.owner.nrails,
                                             self.mac)

    def _joinable(self, peer: int) -> Link | None:
        """Under the lock: a link of another group to ``peer``'s process, or None."""
        key = self.link_key(peer)
        return None if key is None else self.owner.engine.find_link(key, self.owner.context)

    def _start_join(self, peer: int, link: Link) -> None:
        """Under the lock: join ``link`` for ``peer``: a JOIN on every rail (links.py)."""
        owner = self.owner
        self._links[peer] = _JOINING
        self._joins[peer] = join = _Join(link)
        link.add(owner.context, owner.rank, owner, peer)
        for rail in link.rails:  # (a link others may join has every rail)
            self._send_join(link, rail, peer, join)  # type: ignore[arg-type]

    def _send_join(self, link: Link, rail: Rail, peer: int, join: _Join) -> None:
        owner = self.owner
        proof = handshake.join_proof(self.key, self.group, rail.session, owner.rank, peer,
                                     rail.index)
        link.send_block(rail, JOIN, owner.rank, peer, owner.context, proof)
        join.sent.add(rail.index)

    def on_join(self, link: Link, rail: Rail, peer: int, proof: bytes) -> None:
        """Under the lock: ``peer`` sent a JOIN for this group on ``rail`` of ``link``."""
        owner = self.owner
        expect = handshake.join_proof(self.key, self.group, rail.session, peer, owner.rank,
                                      rail.index)
        if (not 0 <= peer < owner.world_size or peer == owner.rank
                or not handshake.same(proof, expect)):
            log.error("neuron %s: ignored a JOIN on rail %d claiming rank %d (wrong proof)",
                      owner.label, rail.index, peer)
            return
        if not self._addresses and not owner.closed:  # (connect() is a moment away)
            self._early_joins.append((link, rail, peer, proof))
            return
        if owner.closed or peer in owner.failed:
            link.send_block(rail, LEAVE, owner.rank, peer, owner.context)  # (it fails at once)
            return
        if peer in self.up:
            return  # (a late JOIN after a crossing)
        key = self.link_key(peer)
        if key is None or not link.reaches(key):
            log.error("neuron %s: ignored a JOIN on rail %d claiming rank %d: the link is not "
                      "to that rank's process", owner.label, rail.index, peer)
            return
        state, join = self._links.get(peer), self._joins.get(peer)
        if join is not None and join.link is not link:  # both joined at once, elsewhere
            if owner.rank > peer:
                return  # ours is kept: the peer takes it when our JOIN reaches it
            self._abandon_join(peer)
            state = join = None
        if state is _ACCEPTING or (state is _DIALING and owner.rank > peer):
            return  # the peer's rails (or ours) are being opened: those are kept
        if join is None:
            if link.closing or link.closed or (owner.context, owner.rank) in link.members:
                return
            self._links[peer] = _JOINING
            self._joins[peer] = join = _Join(link)
            link.add(owner.context, owner.rank, owner, peer)
        join.heard.add(rail.index)
        if rail.index not in join.sent:
            self._send_join(link, rail, peer, join)
        if len(join.heard) == len(join.sent) == owner.nrails:
            del self._joins[peer]
            self.rails[peer] = link.rails
            self.link_of[peer] = link
            self._rail_up(peer)

    def _abandon_join(self, peer: int) -> None:
        """Under the lock: stop joining a link to ``peer`` (its rails are opened otherwise,
        or the link is gone); what was sent on it is ignored by the peer."""
        join = self._joins.pop(peer)
        join.link.remove(self.owner.context, self.owner.rank, self.owner)
        if self._links.get(peer) is _JOINING:
            del self._links[peer]
        self._connected.notify_all()

    def on_leave(self, link: Link, rail: Rail, peer: int) -> None:
        """Under the lock: ``peer`` left this group on ``rail`` (it closed the group, or
        failed this rank) while its process keeps the link for other groups: for this group
        that is the end of the rail, as a connection closing would be."""
        if peer in self._joins and self._joins[peer].link is link:
            self._abandon_join(peer)
            self._link_failed(peer, PeerUnreachable(
                peer, f"could not join the rails to rank {peer}: it has closed or aborted this "
                      f"group, or failed rank {self.owner.rank}"))
            return
        if self.link_of.get(peer) is not link:
            return
        left = self._left.setdefault(peer, set())
        left.add(rail.index)
        if len(left) == self.owner.nrails:
            self.detach(peer, leave=False)
        self._lose_rail(rail, peer, CLEAN_EOF + " (the group closed there)")

    def detach(self, peer: int, leave: bool = True) -> None:
        """Under the lock: this group stops using its rails to ``peer``. Other groups may
        go on using them: the peer is told with a LEAVE on each (``leave``); the last group
        closes them."""
        owner = self.owner
        join = self._joins.pop(peer, None)
        link = self.link_of.pop(peer, None) or (join.link if join else None)
        self._left.pop(peer, None)
        if peer in self.rails:
            self.rails[peer] = [DEAD] * owner.nrails
        if link is None or link.closed:
            return
        others = [m for m in link.members if m != (owner.context, owner.rank)]
        if others and leave:
            for rail in link.rails:
                if rail is not None:
                    link.send_block(rail, LEAVE, owner.rank, peer, owner.context)
        link.remove(owner.context, owner.rank, owner)

    def detach_all(self) -> None:
        """Under the lock: the transport closes: let go of every link and join."""
        for peer in list(self.link_of) + list(self._joins):
            self.detach(peer)
        self._connected.notify_all()

    # ------------------------------------------------------------------ accepting

    def may_dial(self, rank: int, rail: int) -> bool | bytes:
        """May ``rank`` open rail ``rail`` to this rank now (the listener asks)? True,
        False, or ``handshake.CROSSED`` (this rank is dialing ``rank`` too and has the
        higher rank: its own rails are kept)."""
        owner = self.owner
        with owner.lock:
            if (owner.closed or not 0 <= rank < owner.world_size or rank == owner.rank
                    or not 0 <= rail < owner.nrails):
                return False
            link = self.link_of.get(rank)
            if link is not None and rank in self.up and not link.dialer:
                lost = link.rails[rail]
                if (lost is not None and not lost.alive and link.healable()
                        and rail not in link.untrusted and (rank, rail) not in self._reserved):
                    self._reserved.add((rank, rail))  # a rail lost here too: healed (dialing.py)
                    return True
            state = self._links.get(rank)
            if rail == 0 and rank < owner.rank and (state in (_DIALING, _JOINING)
                                                    or rank in self.up):
                return handshake.CROSSED  # (a dial that crossed ours may come in late)
            if rail == 0 and state is _JOINING:  # its dial is kept, not our JOIN
                self._abandon_join(rank)
                state = None
            if ((rank, rail) in self._reserved
                    or self.rails.get(rank, [None] * owner.nrails)[rail] is not None):
                return False
            if rail == 0:
                if rank in self.up or state is _ACCEPTING:
                    return False
                self._links[rank] = _ACCEPTING  # (our own dial, if any, gets Crossed)
            elif state is not _ACCEPTING:
                return False  # rails after the first come from whoever opened rail 0
            self._reserved.add((rank, rail))
            return True

    def release(self, rank: int, rail: int) -> None:
        """The listener granted ``rank`` rail ``rail`` (``may_dial``), then its handshake
        failed: forget the reservation, so that a dial again can be granted. When it was
        the rank's first rail and no other is here or on its way, the link is as if never
        dialed; a later rail lost this way leaves the link half open, and the dialer, whose
        dial failed, fails the pair (its rails break at both ends)."""
        with self.owner.lock:
            self._reserved.discard((rank, rail))
            rails = self.rails.get(rank)
            if (self._links.get(rank) is _ACCEPTING and rank not in self.up
                    and (rails is None or all(r is None for r in rails))
                    and not any(p == rank for p, _ in self._reserved)):
                self._links.pop(rank, None)
                self._connected.notify_all()

    def accepted(self, sock: socket.socket, peer: int, index: int,
                 session: bytes = b"") -> None:
        """An authenticated connection from ``peer`` for rail ``index`` (the listener)."""
        self.add_rail((sock, session), peer, index, dialer=False)

    def add_rail(self, conn: tuple[socket.socket, bytes], peer: int, index: int,
                 dialer: bool) -> None:
        """Make the authenticated connection ``conn`` (socket, session key) rail ``index``
        to ``peer``: the first of a new link, one more of the link being opened, or a lost
        one come back."""
        sock, session = conn
        owner = self.owner
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # a dead link breaks the rail (Linux)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                            max(1, int(self.link_timeout * 1000)))
            # ... also on a rail that only receives: one stalled half way through a payload
            # keeps its claim on that range (see the protocol's "Buffer ownership"), so the
            # resends of the range on other rails are dropped until the rail is found dead.
            # After KEEPIDLE seconds without a byte from the peer, TCP probes it, and a probe
            # unanswered for TCP_USER_TIMEOUT breaks the connection.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE,
                            max(1, int(self.link_timeout / 2)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setblocking(False)
        mac = RailMac(session, dialer, self.mac[1]) if self.mac[0] else None
        with owner.lock:
            self._reserved.discard((peer, index))
            if owner.closed:
                sock.close()
                return
            link = self.link_of.get(peer)
            if link is None:  # this group's first rail to the peer: a new link
                link = self.link_of[peer] = Link(owner.engine, owner.nrails,
                                                 f"{owner.label}, rails to rank {peer}")
                link.dialer = dialer
                link.add(owner.context, owner.rank, owner, peer)
                self.rails[peer] = link.rails
            lost = link.rails[index]
            if lost is not None and (lost.alive or not link.healable()):
                sock.close()  # (a rail healed while the link closed, or lost its last rail)
                return
            rail = Rail(sock, index, link, session, mac)
            link.rails[index] = rail
            owner.engine.register(rail.fd, link, rail, rail.events)
            if lost is not None:
                self._healer.healed(link, index)
            elif None not in link.rails:
                link.key = self.link_key(peer)  # other groups may join it from now on
                owner.engine.publish(link)
                self._rail_up(peer)
            self._connected.notify_all()

    def _rail_up(self, peer: int) -> None:
        """Under the lock: every rail to ``peer`` is open (or joined) for this group."""
        self.up.add(peer)
        self._links.pop(peer, None)
        self.owner.notices.rails_up(peer)
        self._connected.notify_all()

    # ------------------------------------------------------------------ losing rails

    def heal(self, link: Link, peer: int, index: int) -> None:
        """Under the lock: rail ``index`` of ``link`` (dialed by this process) broke while
        another lives: dial it again (dialing.py, ``Healer``)."""
        self._healer.heal(link, peer, index)

    def rail_lost(self, rail: Rail, peer: int, reason: str) -> None:
        """Under the lock: ``rail`` of a link this group uses (or joins) to ``peer`` broke
        (links.py)."""
        join = self._joins.get(peer)
        if join is not None and join.link is rail.link:
            self._abandon_join(peer)  # (whoever waits for the rails dials instead)
            return
        if self.link_of.get(peer) is rail.link:
            self._lose_rail(rail, peer, reason)

    def _lose_rail(self, rail: Rail, peer: int, reason: str) -> None:
        """Under the lock: this group has lost ``rail`` to ``peer``; its traffic moves to the
        peer's other rails.

        While the rails are being opened, a broken one fails the pair at the acceptor,
        unless the peer has dialed every rail and been answered: it holds them up and sends
        already, though the listener's threads may not have handed the last ones over here
        yet (``_answered_all``); then it is one rail lost, as a moment later. At the dialer
        it is one rail lost too: the acceptor may hold every rail up already (its answer to
        the last dial is on its way here) and send on them; the dials left decide. When the
        acceptor failed the pair, it refuses them, and the dialer fails it too.
        """
        owner = self.owner
        if not owner.closed:
            log.log(logging.INFO if reason.startswith(CLEAN_EOF) else logging.WARNING,
                    "neuron %s: rail %d to rank %d failed: %s", owner.label, rail.index,
                    peer, reason)
        if peer not in owner.failed and not owner.closed:
            if (peer not in self.up and not self._answered_all(peer)
                    and self._links.get(peer) is not _DIALING):
                self._link_failed(peer, PeerUnreachable(
                    peer, f"rail {rail.index} to rank {peer} broke while the rails "
                          f"were being opened: {reason}"))
                return
            owner.rail_failed(rail.index, peer)

    def _answered_all(self, peer: int) -> bool:
        """Under the lock: has ``peer`` dialed every rail to this rank and been answered OK
        (each one here, or reserved until the listener's thread hands it over)?"""
        rails = self.rails.get(peer)
        return rails is not None and all(r is not None or (peer, i) in self._reserved
                                         for i, r in enumerate(rails))

    def stop(self) -> None:
        """The transport has closed: stop and join the healers (not under the lock)."""
        self._healer.stop()
