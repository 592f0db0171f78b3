"""A TCP relay on loopback, standing where an attacker would: between a dialer and its peer.

Every connection it accepts is forwarded to ``target`` (``"host:port"``, set before anyone
dials the relay's ``address``), byte for byte both ways. What the dialers send is kept in
``seen`` (what an eavesdropper learns). With ``tamper=(offset, xor)`` the relay flips
``xor`` into the byte at ``offset`` of the first connection's dialer-to-target stream (what
an active attacker does to a frame). ``close()`` shuts every socket and joins its threads.
"""

from __future__ import annotations

import socket
import threading


class Relay:
    """Forward connections to ``target``; record (and optionally alter) what dialers send."""

    def __init__(self, tamper: tuple[int, int] | None = None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.target = None
        self.tamper = tamper
        self.seen = bytearray()
        self.conns, self.threads, self.accepted = [], [], 0
        self._lock = threading.Lock()
        self._spawn(self._accept)

    def _spawn(self, fn, *args):
        t = threading.Thread(target=fn, args=args, daemon=True)
        self.threads.append(t)
        t.start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            host, _, port = self.target.rpartition(":")
            u = socket.create_connection((host, int(port)), timeout=5)
            u.settimeout(None)
            self.conns += [c, u]
            first = self.accepted == 0
            self._spawn(self._pipe, c, u, True, self.tamper if first else None)
            self._spawn(self._pipe, u, c, False, None)
            self.accepted += 1

    def _pipe(self, a, b, record, tamper):
        seen = 0
        try:
            while data := a.recv(1 << 16):
                if tamper and seen <= tamper[0] < seen + len(data):
                    data = bytearray(data)
                    data[tamper[0] - seen] ^= tamper[1]
                seen += len(data)
                if record:
                    with self._lock:
                        self.seen += data
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self):
        for s in [self.sock, *self.conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self.threads:
            t.join(timeout=5)
