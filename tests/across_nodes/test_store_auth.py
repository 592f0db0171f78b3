"""Someone who can write the rendezvous store, against a job with and without a key.

Two ranks set up a group in this process (threads calling ``rendezvous.open_group``) over
an in-memory store that an "attacker" writes to: when a rank publishes a chosen key, the
attacker replaces the value. Without ``NEURON_DIST_AUTH_KEY`` the replaced value is used
(the README says the store is trusted then: a relay the attacker put in rank 1's place
sees the traffic); with a key the rank that reads it fails at once with a
``StoreAuthError`` naming the key and the rank that should have written it.
Network traffic stays on loopback; every segment, socket and thread is closed.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch.distributed as dist

from neuron_dist import survivors
from neuron_dist.config import Settings
from neuron_dist.rendezvous import open_group
from neuron_dist.store_auth import MAGIC, StoreAuth, StoreAuthError
from neuron_dist.transport.shm.layout import Layout
from neuron_dist.transport.shm.segment import Segment, ShmSetupError, new_segment_name

from helpers.relay import Relay

pytestmark = pytest.mark.timeout(60)
SHM = "/dev/shm"


class AttackedStore:
    """A HashStore whose value under ``target`` is replaced by ``forge(real_value)`` as soon
    as a rank writes it (what someone with write access to the store can do)."""

    def __init__(self, target: str | None = None, forge=None):
        self.inner, self.target, self.forge = dist.HashStore(), target, forge
        self.real = None

    def set(self, key, value):
        if key == self.target:
            self.real = value if isinstance(value, bytes) else str(value).encode()
            value = self.forge(self.real)
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def multi_get(self, keys):
        return self.inner.multi_get(keys)

    def add(self, key, n):
        return self.inner.add(key, n)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)


def _settings(node: str, key: str | None, **extra) -> Settings:
    env = {"NEURON_DIST_NODE_NAME": node, "NEURON_DIST_SOCKET_IFNAME": "lo",
           "NEURON_DIST_RAILS": "1", "NEURON_DIST_SHM_SLOT_BYTES": "64K",
           "NEURON_DIST_SHM_MAILBOX_BYTES": "64K", "NEURON_DIST_CMA": "1", **extra}
    if key:
        env["NEURON_DIST_AUTH_KEY"] = key
    return Settings.from_env(env)


def _set_up(store, nodes, key, timeout=4.0):
    """open_group on every rank (one thread each); {rank: GroupLinks or the exception}."""
    out = {}

    def run(rank):
        try:
            out[rank] = open_group(store, rank, len(nodes), _settings(nodes[rank], key),
                                   timedelta(seconds=timeout), f"rank {rank}")
        except BaseException as exc:  # noqa: BLE001
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 20)
    assert not any(t.is_alive() for t in threads), "set-up hung"
    return out


def _close(links):
    for link in links.values():
        if isinstance(link, BaseException):
            continue
        if link.net is not None:
            link.net.close()
        link.channel.close()


def _leftover_segments():
    return {n for n in os.listdir(SHM) if n.startswith("neuron")}


@pytest.fixture
def no_leftovers():
    before = _leftover_segments()
    yield
    assert _leftover_segments() <= before


# ---------------------------------------------------------------- the module itself

def test_tag_binds_key_name_writer_and_session():
    key = os.urandom(32)
    a = StoreAuth(None, key, "group of 2", 1)
    sealed = a.seal("neuron/0/addr/1", "127.0.0.1:5")
    assert a.open("neuron/0/addr/1", sealed, 1) == b"127.0.0.1:5"
    with pytest.raises(StoreAuthError, match=r"'neuron/0/addr/1'.*rank 0"):
        a.open("neuron/0/addr/1", sealed, 0)  # another writer
    with pytest.raises(StoreAuthError, match="neuron/1/addr/1"):
        a.open("neuron/1/addr/1", sealed, 1)  # another generation
    with pytest.raises(StoreAuthError):
        StoreAuth(None, os.urandom(32), "group of 2", 1).open("neuron/0/addr/1", sealed, 1)
    with pytest.raises(StoreAuthError):
        StoreAuth(None, key, "group of 3", 1).open("neuron/0/addr/1", sealed, 1)
    bound = StoreAuth(None, key, "group of 2", 1, session=b"s" * 32)
    with pytest.raises(StoreAuthError):
        bound.open("neuron/0/addr/1", sealed, 1)  # another set-up
    tampered = sealed[:-1] + b"6"
    with pytest.raises(StoreAuthError, match="failed authentication"):
        a.open("neuron/0/addr/1", tampered, 1)
    with pytest.raises(StoreAuthError, match="without an authentication tag"):
        a.open("neuron/0/addr/1", b"127.0.0.1:5", 1)
    plain = StoreAuth(None, None, "group of 2", 1)  # no key: values as they are
    assert plain.seal("x", "v") == b"v" and plain.open("x", b"anything", 0) == b"anything"



def test_every_rank_s_value_is_read_in_one_round_trip_and_checked():
    """Set-up reads every rank's value at once (``get_all``: the store's multi_get); each
    is checked against its own writer, and ranks that never wrote are named."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.3))
    key = os.urandom(32)
    writers = [StoreAuth(store, key, "group of 3", r) for r in range(3)]
    names = [f"neuron/0/node/{r}" for r in range(3)]
    for r in (0, 2):
        writers[r].set(names[r], f"value {r}")
    with pytest.raises(dist.DistStoreError, match=r"1 rank\(s\) of this group of 3 .*rank\(s\) 1\."):
        writers[0].get_all(names, [0, 1, 2])
    writers[1].set(names[1], "value 1")
    assert writers[0].get_all(names, [0, 1, 2]) == [b"value 0", b"value 1", b"value 2"]
    with pytest.raises(StoreAuthError, match=r"'neuron/0/node/1'.*not written by rank 2"):
        writers[0].get_all(names, [0, 2, 1])  # (rank 1's value taken for rank 2's)


# ---------------------------------------------------------------- a peer's address

def test_replaced_address_is_used_without_a_key(no_leftovers):
    """Documented: without a key the store is trusted; an attacker's relay sees the data."""
    relay = Relay()

    def forge(real):
        relay.target = real.decode()
        return relay.address

    store = AttackedStore("neuron/0/addr/0", forge)
    links = _set_up(store, ["a", "b"], None)
    try:
        assert not any(isinstance(v, BaseException) for v in links.values()), links
        secret = np.frombuffer(b"tensor bytes the relay should not see" * 10, np.uint8)
        got = np.zeros_like(secret)
        r = links[0].net.irecv(1, 5, got)  # (rank 1 dials rank 0: through the relay)
        links[1].net.isend(0, 5, secret).wait(time.monotonic() + 10)
        r.wait(time.monotonic() + 10)
        assert bytes(got) == bytes(secret)
        assert bytes(secret) in bytes(relay.seen)
    finally:
        _close(links)
        relay.close()


@pytest.mark.parametrize("forgery", ["plain", "forged-tag"])
def test_replaced_address_fails_with_a_key(no_leftovers, forgery):
    relay = Relay()

    def forge(real):
        relay.target = real[len(MAGIC) + 32:].decode()
        value = relay.address.encode()
        return value if forgery == "plain" else MAGIC + os.urandom(32) + value

    store = AttackedStore("neuron/0/addr/0", forge)
    started = time.monotonic()
    links = _set_up(store, ["a", "b"], "job secret for tests", timeout=3.0)
    try:
        assert isinstance(links[1], StoreAuthError), links[1]
        assert "'neuron/0/addr/0'" in str(links[1]) and "rank 0" in str(links[1])
        # Rank 0 opens no connection at set-up (rails open on first use): its group is
        # made, and nothing ever comes from rank 1, which refused the address.
        from neuron_dist.transport.errors import PeerTimeout
        with pytest.raises(PeerTimeout):
            links[0].net.irecv(1, 5, np.zeros(8, np.uint8)).wait(time.monotonic() + 1)
        assert time.monotonic() - started < 15
        assert not relay.seen  # nobody dialled the relay
    finally:
        _close(links)
        relay.close()


def test_replayed_address_from_an_earlier_run_fails(no_leftovers):
    """A tagged value copied from an earlier set-up with the same key (same key name, same
    writer) is refused: every value is bound to the set-up's fresh session."""
    first = AttackedStore("neuron/0/addr/0", lambda real: real)
    links = _set_up(first, ["a", "b"], "job secret for tests")
    _close(links)
    assert not any(isinstance(v, BaseException) for v in links.values()), links
    old = first.real
    links = _set_up(AttackedStore("neuron/0/addr/0", lambda real: old), ["a", "b"],
                    "job secret for tests", timeout=3.0)
    try:
        assert isinstance(links[1], StoreAuthError), links[1]
        assert "'neuron/0/addr/0'" in str(links[1])
    finally:
        _close(links)


# ---------------------------------------------------------------- the segment's name

def _attacker_segment():
    """A segment of the right layout, its magic word written (it is no secret)."""
    import struct

    from neuron_dist.transport.shm.layout import MAGIC

    layout = Layout(2, 64 << 10, 64 << 10)
    seg = Segment.create(new_segment_name(), layout.total_bytes, layout.eager_ranges(),
                         directory=SHM)
    struct.pack_into("q", seg.map, 0, MAGIC)
    return seg


def test_replaced_segment_is_mapped_without_a_key(no_leftovers):
    evil = _attacker_segment()
    store = AttackedStore("neuron/0/n0/segment", lambda real: evil.name)
    links = _set_up(store, ["a", "a"], None)
    try:
        assert not any(isinstance(v, BaseException) for v in links.values()), links
        assert links[1].channel.segment.name == evil.name  # rank 1 mapped the attacker's
    finally:
        _close(links)
        evil.close()


def test_replaced_segment_fails_with_a_key(no_leftovers):
    evil = _attacker_segment()
    store = AttackedStore("neuron/0/n0/segment", lambda real: evil.name)
    started = time.monotonic()
    links = _set_up(store, ["a", "a"], "job secret for tests")
    try:
        assert isinstance(links[1], StoreAuthError), links[1]
        assert "'neuron/0/n0/segment'" in str(links[1]) and "rank 0 " in str(links[1])
        assert isinstance(links[0], ShmSetupError)  # told at once, not left waiting
        assert "failed authentication" in str(links[0]) or "tag" in str(links[0])
        assert time.monotonic() - started < 3.5
    finally:
        _close(links)
        evil.close()


def test_genuine_set_up_with_a_key_works(no_leftovers):
    links = _set_up(AttackedStore(), ["a", "a", "b"], "job secret for tests")
    try:
        assert not any(isinstance(v, BaseException) for v in links.values()), links
        data = np.arange(100, dtype=np.uint8)
        got = np.zeros_like(data)
        r = links[2].net.irecv(1, 3, got)
        links[1].net.isend(2, 3, data).wait(time.monotonic() + 10)
        r.wait(time.monotonic() + 10)
        assert bytes(got) == bytes(data)
    finally:
        _close(links)


# ---------------------------------------------------------------- a node identity

def _forge_node(real):
    import json
    identity = json.loads(real[len(MAGIC) + 32:] if real.startswith(MAGIC) else real)
    return json.dumps(["a", *identity[1:]])  # rank 1 now claims to share rank 0's node


def test_replaced_node_identity_is_believed_without_a_key(no_leftovers):
    links = _set_up(AttackedStore("neuron/0/node/1", _forge_node), ["a", "b"], None)
    try:
        assert not any(isinstance(v, BaseException) for v in links.values()), links
        assert all(len(link.topo.nodes) == 1 for link in links.values())  # one "node"
    finally:
        _close(links)


def test_replaced_node_identity_fails_with_a_key(no_leftovers):
    links = _set_up(AttackedStore("neuron/0/node/1", _forge_node), ["a", "b"], "job secret for tests")
    try:
        for rank in (0, 1):
            assert isinstance(links[rank], StoreAuthError), links[rank]
            assert "'neuron/0/node/1'" in str(links[rank]) and "rank 1" in str(links[rank])
    finally:
        _close(links)


# ---------------------------------------------------------------- shrink's agreement

def test_forged_shrink_report_is_refused_with_a_key():
    store = dist.HashStore()
    auth = [StoreAuth(store, os.urandom(32), "group of 3", r, session=b"x" * 32)
            for r in range(3)]
    auth = [auth[0], *(auth[0].for_rank(r) for r in (1, 2))]
    store.set("g/shrink/report/2", "[1]")  # someone says rank 2 excluded rank 1
    with pytest.raises(StoreAuthError, match=r"'g/shrink/report/2'.*rank 2"):
        survivors.agree(store, "g/shrink", 0, 3, [], 2.0, auth=auth[0])
    plain = dist.HashStore()  # without a key the report is believed
    plain.set("g/shrink/report/2", "[1]")
    plain.set("g/shrink/report/1", "[]")
    assert survivors.agree(plain, "g/shrink", 0, 3, [], 2.0) == [1]


# ---------------------------------------------------------------- whole jobs with a key

@pytest.mark.timeout(300)
@pytest.mark.parametrize("net_mac", ["0", "1"])
def test_collectives_across_nodes_with_a_key(net_mac):
    """A job with a key (store values, headers and acks authenticated; payloads too with
    NEURON_DIST_NET_MAC=1) gets the exact answers of the multi-node matrix."""
    from helpers.harness import run_ranks
    from across_nodes.test_multinode import LAYOUTS, _env
    from one_node.test_collectives import gather_family_matrix
    names = LAYOUTS["2+1"]
    env = _env(names, NEURON_DIST_AUTH_KEY="job secret for tests", NEURON_DIST_NET_MAC=net_mac)
    results = run_ranks(gather_family_matrix, len(names), env=env, timeout=240)
    assert not any(results.values()), results


@pytest.mark.timeout(120)
def test_shrink_with_a_key():
    """shrink_group's agreement runs on authenticated reports and decision."""
    from helpers.harness import run_ranks
    from across_nodes.test_shrink import TWO_NODES, _die_then_shrink
    world, victim = 4, 2
    env = lambda r: {"NEURON_DIST_NODE_NAME": f"shrink-{TWO_NODES[r]}",  # noqa: E731
                     "NEURON_DIST_AUTH_KEY": "job secret for tests"}
    res = run_ranks(_die_then_shrink, world, victim, env=env, expect_errors=True,
                    timeout=90, pg_timeout=20)
    assert res[victim][:2] == ("error", "Died"), res[victim]
    survivors = {r: v[1] for r, v in res.items() if r != victim}
    assert all(v[0] == "ok" for r, v in res.items() if r != victim), res
    assert all(v["sum"] == 6.0 for v in survivors.values()), survivors
