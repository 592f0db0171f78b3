"""Frames after the handshake are authenticated with the rail's session key (railmac.py).

Two transports in this process; rank 1 reaches rank 0 through a relay on loopback that
passes the handshake untouched and then alters one byte of the first frame's header (its
tag). Without frame authentication the altered frame is believed (the message lands on
the wrong tag); with it the rail is closed and the message arrives, intact and on its own
tag, over the other rail. Plus transfers of every size with headers and payloads
authenticated, and the tag arithmetic itself.
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from neuron_dist.transport.rdm import frames as F
from neuron_dist.transport.rdm import handshake
from neuron_dist.transport.rdm.driver import RdmTransport
from neuron_dist.transport.rdm.protocol import Transmit
from neuron_dist.transport.rdm.railmac import TAG, RailMac

from helpers.relay import Relay

pytestmark = pytest.mark.timeout(60)
KEY, GROUP = os.urandom(32), b"frame-auth-group"
PROOF_BYTES = struct.calcsize("!4sIHI16s32s32s")  # the dialer's handshake bytes


def _connect(ts, addrs):
    threads = [threading.Thread(target=t.connect, args=(addrs, time.monotonic() + 10))
               for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def _through_relay(relay, **kw):
    ts = [RdmTransport(r, 2, host="127.0.0.1", rails=2, key=KEY, group=GROUP, rto=0.5, **kw)
          for r in range(2)]
    relay.target = ts[0].address
    _connect(ts, {0: relay.address, 1: ts[1].address})  # rank 1 dials rank 0 via the relay
    return ts


# last byte of the first frame's tag field (offset 24..31 of its header, after the prefix)
TAG_BYTE = PROOF_BYTES + F.LINK_PREFIX + 31


def test_altered_header_is_believed_without_frame_authentication():
    """Today's behaviour without a key (documented: the network is trusted then)."""
    relay = Relay(tamper=(TAG_BYTE, 0x01))
    ts = _through_relay(relay)
    try:
        data = np.arange(100, dtype=np.uint8)
        wrong, right = np.zeros(100, np.uint8), np.zeros(100, np.uint8)
        r_wrong = ts[0].irecv(1, 2, wrong)
        ts[0].irecv(1, 3, right)
        ts[1].isend(0, 3, data)
        r_wrong.wait(time.monotonic() + 10)  # tag 3 became 2 on the way
        assert bytes(wrong) == bytes(data)
    finally:
        for t in ts:
            t.close(RuntimeError("test over"))
        relay.close()


@pytest.mark.parametrize("payload_mac", [False, True], ids=["headers", "payload"])
def test_altered_header_is_rejected_with_frame_authentication(payload_mac, caplog):
    caplog.set_level(logging.ERROR, logger="neuron_dist.rdm")
    relay = Relay(tamper=(TAG_BYTE, 0x01))
    ts = _through_relay(relay, frame_mac=True, payload_mac=payload_mac)
    try:
        data = np.arange(100, dtype=np.uint8)
        wrong, right = np.zeros(100, np.uint8), np.zeros(100, np.uint8)
        r_wrong = ts[0].irecv(1, 2, wrong)
        r_right = ts[0].irecv(1, 3, right)
        ts[1].isend(0, 3, data)
        r_right.wait(time.monotonic() + 10)  # resent on the rail the relay left alone
        assert bytes(right) == bytes(data)
        assert not r_wrong.done() and not wrong.any()
        assert "failed authentication" in caplog.text
    finally:
        for t in ts:
            t.close(RuntimeError("test over"))
        relay.close()


def test_altered_payload_is_rejected_in_payload_mode(caplog):
    """Payload mode: a byte of the payload altered on the way (past TCP's checksum) closes
    the rail; the message arrives intact over the other one."""
    caplog.set_level(logging.ERROR, logger="neuron_dist.rdm")
    relay = Relay(tamper=(PROOF_BYTES + F.LINK_PREFIX + F.HEADER_SIZE + TAG + 10, 0xFF))
    ts = _through_relay(relay, frame_mac=True, payload_mac=True)
    try:
        data = np.arange(100, dtype=np.uint8)
        got = np.zeros(100, np.uint8)
        r = ts[0].irecv(1, 3, got)
        ts[1].isend(0, 3, data)
        r.wait(time.monotonic() + 10)
        assert bytes(got) == bytes(data)
        assert "failed authentication" in caplog.text
    finally:
        for t in ts:
            t.close(RuntimeError("test over"))
        relay.close()


@pytest.mark.parametrize("payload_mac", [False, True], ids=["headers", "payload"])
@pytest.mark.parametrize("n", [0, 1, 1000, 1 << 20, 5_000_003])
def test_transfers_with_authenticated_frames(payload_mac, n):
    ts = [RdmTransport(r, 2, host="127.0.0.1", rails=3, key=KEY, group=GROUP,
                       segment_bytes=256 << 10, frame_mac=True, payload_mac=payload_mac)
          for r in range(2)]
    try:
        _connect(ts, {r: t.address for r, t in enumerate(ts)})
        for a, b in ((0, 1), (1, 0)):
            src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
            dst = np.zeros(n, np.uint8)
            r = ts[b].irecv(a, 1, dst)
            s = ts[a].isend(b, 1, src)
            r.wait(time.monotonic() + 30)
            s.wait(time.monotonic() + 30)
            assert np.array_equal(src, dst)
        assert all(t.stats()["rejected"] == 0 for t in ts)
    finally:
        for t in ts:
            t.close()


def test_session_keys_are_per_connection():
    ca, cd = os.urandom(32), os.urandom(32)
    k = handshake.session_key(KEY, GROUP, ca, cd, 1, 0, 0)
    assert k != handshake.session_key(KEY, GROUP, ca, cd, 1, 1, 0)  # another rail
    assert k != handshake.session_key(KEY, GROUP, os.urandom(32), cd, 1, 0, 0)
    assert k != handshake.session_key(os.urandom(32), GROUP, ca, cd, 1, 0, 0)


_PREFIX = bytes.fromhex("0123456789abcdef")  # a group's context on the rail (links.py)
_H = F.LINK_PREFIX + F.HEADER_SIZE + TAG  # prefix, header and its tag


def _frames(mac, *txs):
    """The bytes ``mac`` puts on the wire for ``txs``, frame by frame."""
    out = []
    for tx in txs:
        s = mac.seal(tx, _PREFIX + tx.header)
        out.append(bytes(s.header) + bytes(s.payload) + bytes(s.trailer))
    return out


def test_railmac_checks_order_content_and_direction():
    session = os.urandom(32)
    tx = Transmit(1, 0, F.pack_data_header(1, 0, 0, 3, 0, 5, 0, 5, 0), b"hello")
    ack = Transmit(1, 0, F.pack_ack(1, 0, [(0, 0)], 0))
    sender, receiver = RailMac(session, True, False), RailMac(session, False, False)
    first, second = _frames(sender, tx, ack)
    receiver.check_header(first[:_H])
    receiver.check_header(second[:_H])  # an ACK: its entries are covered
    receiver.check_tail(second[_H:-TAG], second[-TAG:])
    fresh = RailMac(session, False, False)
    with pytest.raises(F.FrameError, match="failed authentication"):
        fresh.check_header(second[:_H])  # out of order (a replay, a drop)
    fresh = RailMac(session, False, False)
    forged = bytearray(first)
    forged[F.LINK_PREFIX + 31] ^= 1  # the tag field
    with pytest.raises(F.FrameError, match="failed authentication"):
        fresh.check_header(forged[:_H])
    fresh = RailMac(session, False, False)
    moved = bytearray(first)
    moved[0] ^= 1  # the prefix: the frame moved to another group
    with pytest.raises(F.FrameError, match="failed authentication"):
        fresh.check_header(moved[:_H])
    fresh = RailMac(session, False, False)
    fresh.check_header(first[:_H])
    fresh.check_header(second[:_H])
    with pytest.raises(F.FrameError, match="failed authentication"):
        fresh.check_tail(second[_H:-TAG][:-1] + b"\x01", second[-TAG:])
    reflected = RailMac(session, True, False)  # the sender's own frames sent back to it
    with pytest.raises(F.FrameError):
        reflected.check_header(first[:_H])
    other_mode = RailMac(session, False, True)  # NEURON_DIST_NET_MAC differs
    with pytest.raises(F.FrameError):
        other_mode.check_header(first[:_H])


def test_cost_benchmark_runs():
    """``python -m bench.frame_auth`` (docs/security.md's way to measure the cost) on a tiny run
    (a fresh process: it forks its ranks before any thread starts)."""
    out = subprocess.run([sys.executable, "-m", "bench.frame_auth", "--reps", "1",
                          "--iters", "5", "--timeout", "60"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(f" {m} " in out.stdout for m in ("off", "headers", "payload")), out.stdout
