"""Unit tests: reduction kernels, segment math, descriptors, settings, mailboxes and p2p matching."""

from __future__ import annotations

import pytest
import torch

import threading
import time

from neuron_dist.collectives.context import Context, partition, steps_for
from neuron_dist.collectives.descriptor import LONG, Call, CollectiveMismatch, decode, digest
from neuron_dist.collectives.p2p import P2P, P2PError, Request
from neuron_dist.collectives.reduce_ops import ReduceSpec, Scratch, check_supported, reduce_into, stage
from neuron_dist.config import Settings, parse_bytes
from neuron_dist.transport.shm.channel import ShmChannel
from neuron_dist.transport.shm.layout import Layout
from neuron_dist.transport.shm.segment import Segment, new_segment_name


def test_bf16_sums_accumulate_in_fp32_and_round_once():
    # 1 + 8 * 2^-9: in bf16 (8 bits of mantissa) each partial sum 1 + 2^-9 rounds back to 1,
    # so a bf16 accumulator returns 1.0; fp32 accumulation gives 1 + 2^-6, exact in bf16.
    inputs = [torch.tensor([1.0], dtype=torch.bfloat16)] + [torch.tensor([2 ** -9], dtype=torch.bfloat16)] * 8
    out = torch.empty(1, dtype=torch.bfloat16)
    reduce_into(out, inputs, ReduceSpec("SUM"), len(inputs), Scratch())
    assert out.item() == 1 + 2 ** -6


def test_reduce_ops_on_ints_and_bools():
    s = Scratch()
    a, b = torch.tensor([6, -7], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    out = torch.empty(2, dtype=torch.int32)
    reduce_into(out, [a, b], ReduceSpec("AVG"), 2, s)
    assert out.tolist() == [4, -2]  # truncation toward zero
    reduce_into(out, [a, b], ReduceSpec("BXOR"), 2, s)
    assert out.tolist() == [6 ^ 3, -7 ^ 2]
    x, y = torch.tensor([True, False, True]), torch.tensor([True, False, False])
    o = torch.empty(3, dtype=torch.bool)
    reduce_into(o, [x, y], ReduceSpec("SUM"), 2, s)
    assert o.tolist() == [True, False, True]
    reduce_into(o, [x, y], ReduceSpec("MIN"), 2, s)
    assert o.tolist() == [True, False, False]


def test_premul_sum_scales_before_sharing():
    dst = torch.empty(3)
    stage(dst, torch.tensor([2.0, 4.0, 6.0]), ReduceSpec("PREMUL_SUM", 0.5))
    assert dst.tolist() == [1.0, 2.0, 3.0]
    stage(dst, torch.tensor([2.0, 4.0, 6.0]), ReduceSpec("PREMUL_SUM", torch.tensor(0.25)))
    assert dst.tolist() == [0.5, 1.0, 1.5]


@pytest.mark.parametrize("kind,dtype", [("BAND", torch.float32), ("AVG", torch.bool),
                                        ("PREMUL_SUM", torch.int64), ("MAX", torch.complex64)])
def test_unsupported_combinations_are_named(kind, dtype):
    with pytest.raises(ValueError, match=kind):
        check_supported(ReduceSpec(kind), dtype)


def test_partition_covers_range_with_aligned_starts():
    for n in (0, 1, 7, 100, 1001):
        for parts in (1, 2, 3, 8):
            pieces = partition(n, parts, 16)
            assert len(pieces) == parts
            assert sum(length for _, length in pieces) == n
            pos = 0
            for start, length in pieces:
                assert length == 0 or (start == pos and start % 16 == 0)
                pos = start + length if length else pos
    assert steps_for(0, 10) == 1 and steps_for(10, 10) == 1 and steps_for(11, 10) == 2


def test_descriptor_round_trip_and_text():
    call = Call("reduce_scatter", torch.bfloat16, 1024, root=-1, reduce="PREMUL_SUM", extra=digest([1, 2]))
    seq, back = Call.from_words(call.words(42))
    assert seq == 42 and back == call
    assert call.describe().startswith("reduce_scatter(bfloat16, 1024 elements")
    # all_to_all's element counts may differ between ranks: not compared, not named
    assert Call("all_to_all", torch.float32, 0).describe() == "all_to_all(float32)"
    with pytest.raises(ValueError, match="dtype"):
        Call("all_reduce", torch.quint8, 1).words(1)
    # A peer that never entered a collective left all-zero words: still describable (the
    # timeout error names what that rank last did from them).
    seq, nothing = Call.from_words((0,) * 7)
    assert seq == 0 and nothing.describe().startswith("<unknown op 0>(")


def test_a_call_fits_one_code_word_or_is_long():
    """Every field round-trips through ``Call.code``, up to each field's limit; past one (or
    with a size digest) the call is LONG and posts its words after the head."""
    calls = [Call("all_reduce", torch.float32, 1, reduce="SUM"),
             Call("broadcast", torch.uint64, (1 << 33) - 1, root=65534),
             Call("barrier"), Call("reduce", torch.float8_e5m2, 0, root=0, reduce="BXOR"),
             Call("all_to_all", torch.int8, 7)]
    for call in calls:
        assert call.code > 0 and call.rest == () and decode(call.code) == call.tail, call
    for call in (Call("broadcast", torch.float32, 1 << 33, root=0),
                 Call("broadcast", torch.float32, 4, root=65535),
                 Call("all_to_all", torch.float32, 0, extra=digest([1, 2]))):
        assert call.code == LONG and call.rest == call.tail, call
    assert len({c.code for c in calls}) == len(calls)


def _first_steps(calls, world=2):
    """Each rank's first step of ``calls[rank]`` over one real shared-memory segment (a
    thread per rank): what each raised, or None."""
    layout = Layout(world, 4096, 4096)
    seg = Segment.create(new_segment_name(), layout.total_bytes, directory="/dev/shm")
    segs = [seg] + [Segment.attach(seg.name, layout.total_bytes, directory="/dev/shm")
                    for _ in range(world - 1)]
    seg.unlink()
    chans = [ShmChannel(segs[r], layout, r, spin=0) for r in range(world)]
    errors = [None] * world

    def rank(r):
        for seq, call in enumerate(calls[r], 1):
            ctx = Context(chans[r], call, seq, time.monotonic() + 20, None, None, None)
            try:
                ctx.step()
            except CollectiveMismatch as exc:
                errors[r] = str(exc)
                return

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
    finally:
        for c in chans:
            c.close()
    return errors


def test_first_steps_over_shared_memory_compare_short_and_long_calls():
    """Equal calls pass, short or long, two in a row (both parities); any difference, the
    size digest of a long call included, fails on every rank, naming both calls."""
    same = [Call("all_reduce", torch.float32, 5, reduce="SUM"),
            Call("all_to_all", torch.float32, 0, extra=digest([1, 2]))] * 2
    assert _first_steps([same, same]) == [None, None]
    for mine, theirs, named in [
            (Call("all_reduce", torch.float32, 5, reduce="SUM"),
             Call("all_reduce", torch.float32, 6, reduce="SUM"), "6 elements"),
            (Call("broadcast", torch.float32, 4, root=1),
             Call("broadcast", torch.float32, 1 << 33, root=1), f"{1 << 33} elements"),
            (Call("all_to_all", torch.float32, 0, extra=digest([1, 2])),
             Call("all_to_all", torch.float32, 0, extra=digest([2, 1])), "sizes#")]:
        errors = _first_steps([[same[0], mine], [same[0], theirs]])
        for error in errors:
            assert error and "collective mismatch" in error and named in error, errors
            assert mine.describe() in error and theirs.describe() in error, errors


def test_settings_parse_and_reject(monkeypatch):
    assert parse_bytes("4M") == 4 << 20 and parse_bytes("64KiB") == 64 << 10 and parse_bytes("100") == 100
    monkeypatch.setenv("NEURON_DIST_SHM_SLOT_BYTES", "1000")
    with pytest.raises(ValueError, match="4096"):
        Settings.from_env()
    monkeypatch.setenv("NEURON_DIST_SHM_SLOT_BYTES", "2M")
    monkeypatch.setenv("NEURON_DIST_DEBUG", "loud")
    with pytest.raises(ValueError, match="NEURON_DIST_DEBUG"):
        Settings.from_env()


@pytest.fixture
def two_endpoints():
    """Two P2P engines (ranks 0 and 1) over one real segment, in this process."""
    layout = Layout(2, 4096, 4096)
    seg = Segment.create(new_segment_name(), layout.total_bytes, directory="/dev/shm")
    peer = Segment.attach(seg.name, layout.total_bytes, directory="/dev/shm")
    seg.unlink()
    chans = [ShmChannel(seg, layout, 0, spin=0), ShmChannel(peer, layout, 1, spin=0)]
    eps = [P2P(r, 2, (lambda r: lambda k: chans[r].mailbox(r, k))(r),
               (lambda r: lambda k: chans[r].mailbox(k, r))(r)) for r in (0, 1)]
    yield eps
    for c in chans:
        c.close()


def _pump(eps, reqs, rounds=10_000):
    for _ in range(rounds):
        for ep in eps:
            ep.progress()
        if all(r.done for r in reqs):
            return
    raise AssertionError("p2p did not complete")


def test_p2p_streams_messages_larger_than_the_mailbox(two_endpoints):
    a, b = two_endpoints
    data = torch.arange(10_000, dtype=torch.int64).view(torch.uint8)  # 80 KB through a 4 KiB ring
    got = torch.empty_like(data)
    s, r = Request(1, 5, data, True, 1e18), Request(0, 5, got, False, 1e18)
    a.post_send(s)
    b.post_recv(r)
    _pump([a, b], [s, r])
    assert torch.equal(got, data) and r.source == 0 and r.error is None


def test_p2p_unexpected_messages_keep_order_per_tag(two_endpoints):
    a, b = two_endpoints
    sends = [Request(1, tag, torch.full((100,), tag * 10 + i, dtype=torch.uint8), True, 1e18)
             for i, tag in enumerate([1, 2, 1])]
    for s in sends:
        a.post_send(s)
    _pump([a, b], sends)  # all arrive before any receive is posted: unexpected queue
    bufs = [torch.empty(100, dtype=torch.uint8) for _ in range(3)]
    recvs = [Request(None, 1, bufs[0], False, 1e18), Request(0, 2, bufs[1], False, 1e18),
             Request(0, 1, bufs[2], False, 1e18)]
    for r in recvs:
        b.post_recv(r)
    _pump([a, b], recvs)
    assert [int(x[0]) for x in bufs] == [10, 21, 12]


def test_a_message_written_just_before_its_sender_died_is_still_received(two_endpoints):
    # The receiver drains its rings, finds nothing, then checks its peers' liveness; the
    # sender writes its last message and exits in between. The message must be delivered,
    # not the receive failed with PeerDied.
    from neuron_dist.p2p_engine import P2PEngine
    from neuron_dist.transport.errors import PeerDied

    a, b = two_endpoints
    msg = torch.arange(8, dtype=torch.uint8)

    class DiesAfterSending:
        rank, size = 1, 2

        def check_peers(self, peers, deadline, any_suffices=False):
            assert a.send_now(1, 3, msg.data_ptr(), msg.numel())
            raise PeerDied(0, 12345, "exited")

    engine = P2PEngine(b, DiesAfterSending(), "test", lambda exc, what: exc)
    got = torch.zeros(8, dtype=torch.uint8)
    r = Request(0, 3, got, False, 1e18)
    b.post_recv(r)
    engine._progress_locked()
    assert r.done and r.error is None and torch.equal(got, msg), r.error


def test_p2p_a_receive_naming_the_source_goes_before_an_older_one_from_any_rank(two_endpoints):
    # The rule of transport/matching.py, as the network transports follow it: the first
    # message goes to the named receive though the one from any rank was posted first,
    # the next (no named receive waits) to the receive from any rank.
    a, b = two_endpoints
    anyone = Request(None, 6, torch.zeros(8, dtype=torch.uint8), False, 1e18)
    named = Request(0, 6, torch.zeros(8, dtype=torch.uint8), False, 1e18)
    b.post_recv(anyone)
    b.post_recv(named)
    sends = [Request(1, 6, torch.full((8,), v, dtype=torch.uint8), True, 1e18) for v in (1, 2)]
    for s in sends:
        a.post_send(s)
    _pump([a, b], sends + [anyone, named])
    assert named.data.tolist() == [1] * 8 and anyone.data.tolist() == [2] * 8
    assert anyone.source == 0 and anyone.error is None and named.error is None


def test_p2p_a_receive_whose_claim_fails_takes_nothing(two_endpoints):
    # A receive from any rank that the network may satisfy too (neuron_dist/p2p_any.py):
    # once the network has the token, this one binds nothing and the message stays for
    # the next receive, whether it arrives after the receive was posted or before.
    from neuron_dist.transport.errors import Claimed
    a, b = two_endpoints
    calls = []

    def lost():
        calls.append(1)
        return False

    r1 = Request(None, 2, torch.zeros(8, dtype=torch.uint8), False, 1e18)
    r1.claim = lost
    b.post_recv(r1)
    s1 = Request(1, 2, torch.full((8,), 5, dtype=torch.uint8), True, 1e18)
    a.post_send(s1)
    _pump([a, b], [s1, r1])
    assert isinstance(r1.error, Claimed) and not r1.data.any()
    r2 = Request(None, 2, torch.zeros(8, dtype=torch.uint8), False, 1e18)
    r2.claim = lost
    b.post_recv(r2)  # the message is unexpected now
    assert r2.done and isinstance(r2.error, Claimed) and not r2.data.any()
    assert len(calls) == 2
    r3 = Request(None, 2, torch.zeros(8, dtype=torch.uint8), False, 1e18)
    r3.claim = lambda: True
    b.post_recv(r3)
    assert r3.done and r3.error is None and r3.source == 0 and r3.data.tolist() == [5] * 8


def test_p2p_receive_now_takes_only_a_whole_message_nothing_comes_before(two_endpoints):
    # recv_now reads a message straight from the ring into memory, without a request, only
    # when it is whole at the ring's head and no posted receive or queued message could
    # take it first; otherwise it changes nothing and the request path decides (order,
    # sizes, corrupt frames).
    a, b = two_endpoints
    got = torch.zeros(40, dtype=torch.uint8)
    addr = got.data_ptr()
    assert not b.recv_now(0, 7, addr, 40)  # nothing there
    wrap = torch.arange(200, dtype=torch.uint8).repeat(20)  # 4000 bytes: the next frame wraps
    assert a.send_now(1, 9, wrap.data_ptr(), wrap.numel())
    assert b.recv_now(0, 9, torch.empty_like(wrap).data_ptr(), wrap.numel())
    msgs = [torch.full((40,), v, dtype=torch.uint8) for v in (1, 2, 3, 4)]
    for tag, m in zip((7, 7, 8, 7), msgs):
        assert a.send_now(1, tag, m.data_ptr(), m.numel())
    assert not b.recv_now(0, 7, addr, 32)  # a size mismatch is the request path's to report
    assert not b.recv_now(0, 8, addr, 40)  # another tag at the head
    assert b.recv_now(0, 7, addr, 40) and got.tolist() == [1] * 40  # (it wrapped the ring)
    early = Request(0, 7, torch.zeros(40, dtype=torch.uint8), False, 1e18)
    b.post_recv(early)  # a receive posted first takes the next message of its tag
    assert not b.recv_now(0, 7, addr, 40) and got.tolist() == [1] * 40
    _pump([a, b], [early])
    assert early.data.tolist() == [2] * 40
    assert not b.recv_now(0, 7, addr, 40)  # the tag-8 message is at the head now
    r8 = Request(0, 8, torch.zeros(40, dtype=torch.uint8), False, 1e18)
    b.post_recv(r8)
    _pump([a, b], [r8])
    assert r8.data.tolist() == [3] * 40
    assert b.recv_now(0, 7, addr, 40) and got.tolist() == [4] * 40
    # a message drained into the unexpected queue comes before one still in the ring
    for v in (5, 6):
        m = torch.full((40,), v, dtype=torch.uint8)
        assert a.send_now(1, 7, m.data_ptr(), m.numel())
        if v == 5:
            b.progress()
    assert not b.recv_now(0, 7, addr, 40) and got.tolist() == [4] * 40
    later = [Request(0, 7, torch.zeros(40, dtype=torch.uint8), False, 1e18) for _ in range(2)]
    for r in later:
        b.post_recv(r)
    _pump([a, b], later)
    assert [r.data.tolist() for r in later] == [[5] * 40, [6] * 40]
    assert not b.pending()


def test_p2p_whole_messages_wait_in_the_ring_until_it_is_half_full(two_endpoints):
    # The helper thread drains rings nobody asked for only once a sender may be stuck
    # (pending()); below half full, messages wait for their receive (recv_now).
    a, b = two_endpoints
    m = torch.ones(1000, dtype=torch.uint8)  # frames of 1024 bytes in a 4096-byte ring
    assert a.send_now(1, 1, m.data_ptr(), m.numel())
    assert not b.pending()
    assert a.send_now(1, 1, m.data_ptr(), m.numel())
    assert b.pending()  # half full: drain
    b.progress()  # one message drained into the unexpected queue
    assert not b.pending()  # the other waits in the ring
    first, second = torch.zeros(1000, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)
    r = Request(0, 1, first, False, 1e18)
    b.post_recv(r)
    assert r.done and first.tolist() == [1] * 1000
    assert b.recv_now(0, 1, second.data_ptr(), 1000) and second.tolist() == [1] * 1000


def test_p2p_size_mismatch_fails_only_that_receive(two_endpoints):
    a, b = two_endpoints
    s1 = Request(1, 0, torch.ones(64, dtype=torch.uint8), True, 1e18)
    s2 = Request(1, 0, torch.ones(8, dtype=torch.uint8), True, 1e18)
    r1 = Request(0, 0, torch.empty(32, dtype=torch.uint8), False, 1e18)
    r2 = Request(0, 0, torch.empty(8, dtype=torch.uint8), False, 1e18)
    for s in (s1, s2):
        a.post_send(s)
    for r in (r1, r2):
        b.post_recv(r)
    _pump([a, b], [s1, s2, r1, r2])
    assert isinstance(r1.error, P2PError) and "64 bytes" in str(r1.error)
    assert r2.error is None and r2.data.tolist() == [1] * 8


def test_cores_crowded_counts_ranks_of_one_kernel_whose_cores_overlap():
    from neuron_dist.topology import core_rivals, cpu_identity

    def cores_crowded(mine, everyone):  # (rendezvous._spin's verdict: no spinning)
        ranks, cores = core_rivals(mine, everyone)
        return ranks > cores
    a, b = "host/boot-a", "host/boot-b"
    two = [[a, 0b01], [a, 0b10]]  # two ranks, a core each
    assert not cores_crowded(two[0], two)
    three = two + [[a, 0b11]]  # a third on both: 3 ranks, 2 cores
    assert cores_crowded(three[0], three)
    assert not cores_crowded([a, 0b01], [[a, 0b01], [b, 0b01]])  # another kernel: no rival
    assert cores_crowded([a, 0b01], [[a, 0b01], [a, 0b01]])  # one core shared by two
    # pinned apart on a 4-core machine: each pair has its own 2 cores
    apart = [[a, 0b0011], [a, 0b0011], [a, 0b1100], [a, 0b1100]]
    assert not cores_crowded(apart[0], apart)
    kernel, mask = mine = cpu_identity()
    assert mask and kernel and not cores_crowded(mine, [mine])


def test_crowding_is_the_most_crowded_cores_ranks_per_core_the_same_on_every_rank():
    from neuron_dist.topology import crowding
    a, b = "host/boot-a", "host/boot-b"
    assert crowding([[a, 0b01], [a, 0b10]]) == 1.0  # a core each
    assert crowding([[a, 0b11]] * 16) == 8.0  # 16 virtual nodes on one 2-core machine
    # two machines: one crowded (3 ranks on 2 cores), one not; the crowded one counts
    assert crowding([[a, 0b11]] * 3 + [[b, 0b1111]] * 2) == 1.5
    # pinned apart: each pair of ranks on its own 2 cores
    assert crowding([[a, 0b0011], [a, 0b0011], [a, 0b1100], [a, 0b1100]]) == 1.0
    # a rank on cores 0-1 joins the ranks on 0 and on 1: 3 ranks on 2 cores
    assert crowding([[a, 0b01], [a, 0b10], [a, 0b11]]) == 1.5
    # the answer does not depend on the order (every rank computes it from the same list)
    big = [[f"host/{k % 7}", 1 << (k % 3)] for k in range(4096)]  # (196 on the fullest core)
    assert crowding(big) == crowding(list(reversed(big))) == 196.0


def test_async_collectives_are_held_for_the_caller_only_when_no_core_is_spare():
    import pytest

    from neuron_dist import rendezvous
    from neuron_dist.config import Settings
    from neuron_dist.topology import core_rivals
    a = "host/boot-a"
    assert core_rivals([a, 0b01], [[a, 0b01], [a, 0b10]]) == (1, 1)
    assert core_rivals([a, 0b11], [[a, 0b11], [a, 0b11]]) == (2, 2)
    auto = Settings.from_env({})
    assert rendezvous._hold(auto, (2, 2), False) == rendezvous.HOLD_SECONDS > 0  # no spare core
    assert rendezvous._hold(auto, (3, 2), False) == rendezvous.HOLD_SECONDS
    assert rendezvous._hold(auto, (2, 4), False) == 0  # the engine thread has a core of its own
    assert rendezvous._hold(auto, (4, 2), True) == 0  # across nodes: the network's waits
    assert rendezvous._spin(auto, (2, 2)) > 0 and rendezvous._spin(auto, (3, 2)) == 0
    forced = Settings.from_env({"NEURON_DIST_ASYNC_HOLD": "0.25"})
    assert rendezvous._hold(forced, (2, 4), False) == rendezvous._hold(forced, (2, 4), True) == 0.25
    assert rendezvous._hold(Settings.from_env({"NEURON_DIST_ASYNC_HOLD": "0"}), (4, 2), False) == 0
    for bad in ("-1", "nan", "5000", "5ms"):
        with pytest.raises(ValueError, match="NEURON_DIST_ASYNC_HOLD"):
            Settings.from_env({"NEURON_DIST_ASYNC_HOLD": bad})


def test_an_abort_heard_through_shared_memory_is_passed_on_to_the_other_nodes():
    """A rank that hears of a node-mate's abort through shared memory tells its network
    peers too, with the same kind: one of them may be waiting on this rank and would
    otherwise see only its rails close when this process exits (a mismatch between two
    ranks of one node reached the other node as PeerDiedError, 1 run in 3-5)."""
    from unittest import mock
    from neuron_dist.errors import CollectiveMismatchError
    from neuron_dist.failures import Failures
    from neuron_dist.transport.errors import ABORTED_MISMATCH, PeerAborted
    local = [10, 11, 12, 13]  # (the group ranks of this node's channel ranks 0-3)
    group = Failures(mock.Mock(), mock.Mock(), local, lambda: "5 s")
    error, fatal = group.translate(
        PeerAborted(1, "collective mismatch: ...", ABORTED_MISMATCH), "all_reduce #1")
    assert fatal and isinstance(error, CollectiveMismatchError)
    assert "rank 11 aborted the group: collective mismatch" in str(error)
    group._net.abort.assert_called_once_with(str(error), ABORTED_MISMATCH)
    group._channel.abort.assert_not_called()  # (this node knows already)
    # heard from another node: told to this node, not sent back over the network
    group = Failures(mock.Mock(), mock.Mock(), local, lambda: "5 s")
    group.translate(PeerAborted(3, "x", ABORTED_MISMATCH, network=True), "w")
    group._channel.abort.assert_called_once()
    group._net.abort.assert_not_called()


def test_attaching_a_segment_without_the_magic_word_is_refused():
    """Finding: the layout's MAGIC was written by the creator but never checked on attach,
    so a file that is not a node segment of this layout was used as one."""
    from neuron_dist.transport.shm.segment import ShmSetupError

    layout = Layout(2, 4096, 4096)
    seg = Segment.create(new_segment_name(), layout.total_bytes, directory="/dev/shm")
    try:
        peer = Segment.attach(seg.name, layout.total_bytes, directory="/dev/shm")
        with pytest.raises(ShmSetupError, match="not a neuron node segment"):
            ShmChannel(peer, layout, 1, spin=0)  # (the creator has not set it up)
        peer.close()  # (nothing of the refused channel holds the map)
        creator = ShmChannel(seg, layout, 0, spin=0)
        peer = Segment.attach(seg.name, layout.total_bytes, directory="/dev/shm")
        ShmChannel(peer, layout, 1, spin=0).close()
        creator.close()
    finally:
        seg.unlink()
