"""The log-depth algorithms between nodes, run for 2 to 1024 ranks over the simulated network.

Every algorithm of collectives/net_*.py is a generator over a ``NetCall``; the simulator
(bench/netsim.py) runs the same code for every rank in this process and fails
on a deadlock, a size mismatch, a message nobody receives or a call that returns with
something still posted. Checked here: results equal the exact references of
helpers/cases.py (small integers: exact in every order) for every dtype and every op the
network phases take (AVG and PREMUL_SUM never reach them: reduce_ops.phase_specs), sizes
not divisible by the ranks and zero elements, at N = 2..9 and 16, with the ranks of the
exchange a scattered subset of the group's; results bit-identical on every rank; every
rank heard (through some chain) from every other; and the counts the simulator saw match
the cost model's (collectives/net_cost.py), which the selection tables price.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import torch

from bench.netsim import SimError, Simulation
from neuron_dist.collectives import (net_binomial, net_bruck, net_cost, net_dissemination,
                                     net_halving, net_rabenseifner, net_recursive_doubling,
                                     net_ring, net_tree)
from neuron_dist.collectives.reduce_ops import ReduceSpec

from helpers.cases import ALL_DTYPES, make, ops_for, reduce_ref

pytestmark = pytest.mark.timeout(120)

ALL_REDUCE = {"recursive_doubling": net_recursive_doubling.all_reduce,
              "rabenseifner": net_rabenseifner.all_reduce, "ring": net_ring.all_reduce,
              "tree": net_tree.all_reduce}
RANKS = [2, 3, 4, 5, 6, 7, 8, 9, 16]
SIZES = [0, 1, 37, 300]


def _network_ops(dtype):
    return [op for op in ops_for(dtype) if op not in ("AVG", "PREMUL_SUM")]


def _peers(size: int, seed: int) -> tuple:
    """A scattered subset of a larger group's ranks (in order), as a column of nodes is."""
    group = size * 2 + 1
    peers = sorted(random.Random(seed).sample(range(group), size))
    return group, peers


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("algo", list(ALL_REDUCE))
@pytest.mark.parametrize("size", RANKS)
def test_all_reduce_every_dtype_op_and_size(algo, size):
    fails = []
    for dtype in ALL_DTYPES:
        for op in _network_ops(dtype):
            for n in SIZES:
                group, peers = _peers(size, n)
                sim = Simulation(group)
                inputs = [make(i, n, dtype, op=op) for i in range(size)]
                bufs = [t.clone() for t in inputs]
                spec = ReduceSpec(op)
                sim.run({p: ALL_REDUCE[algo](sim.nets[p], bufs[i], peers, i, spec)
                         for i, p in enumerate(peers)})
                want = reduce_ref(inputs, op, dtype)
                if not torch.equal(bufs[0], want) and not (
                        dtype.is_floating_point and torch.allclose(
                            bufs[0].double(), want.double(), equal_nan=True)):
                    fails.append(f"{dtype} {op} n={n}: {bufs[0][:4]} != {want[:4]}")
                if len({_bits(b) for b in bufs}) != 1:
                    fails.append(f"{dtype} {op} n={n}: ranks differ")
                if not all(sim.heard(p) >= set(peers) for p in peers):
                    fails.append(f"{dtype} {op} n={n}: a rank never heard from some rank")
    assert not fails, fails[:10]


@pytest.mark.parametrize("size", RANKS)
def test_reduce_scatter_by_halving(size):
    fails = []
    for dtype in ALL_DTYPES:
        for op in _network_ops(dtype):
            for m in (0, 1, 5):
                group, peers = _peers(size, m + 7)
                sim = Simulation(group)
                works = [make(i, size * m, dtype, op=op) for i in range(size)]
                ref = reduce_ref(works, op, dtype)
                outs = [torch.full((m,), 3, dtype=dtype) for _ in range(size)]
                scratch = [w.clone() for w in works]
                sim.run({p: net_halving.reduce_scatter(sim.nets[p], outs[i], scratch[i], peers,
                                                       i, ReduceSpec(op))
                         for i, p in enumerate(peers)})
                for i in range(size):
                    if not torch.equal(outs[i], ref[i * m:(i + 1) * m]):
                        fails.append(f"{dtype} {op} m={m} rank {i}: {outs[i]} != "
                                     f"{ref[i * m:(i + 1) * m]}")
    assert not fails, fails[:10]


ALL_GATHER = {"bruck": net_bruck.all_gather,
              "recursive_doubling": net_recursive_doubling.all_gather}


def _blocks(size: int, b: int, layout: str) -> list[torch.Tensor]:
    """A rank's output blocks: tensors of their own ("apart"), or views end to end of one
    tensor that starts inside a larger storage ("one_tensor", as all_gather_into_tensor's)."""
    if layout == "apart":
        return [torch.zeros(b, dtype=torch.uint8) for _ in range(size)]
    whole = torch.zeros(size * b + 10, dtype=torch.uint8)[3:3 + size * b]
    return [whole[k * b:(k + 1) * b] for k in range(size)]


@pytest.mark.parametrize("layout", ["apart", "one_tensor"])
@pytest.mark.parametrize("algo", list(ALL_GATHER))
@pytest.mark.parametrize("size", RANKS)
def test_all_gather(algo, size, layout):
    for b in (0, 1, 13):
        for in_place in (True, False):
            group, peers = _peers(size, b)
            sim = Simulation(group)
            mine = [torch.randint(0, 256, (b,), dtype=torch.uint8) for _ in range(size)]
            outs = [_blocks(size, b, layout) for _ in range(size)]
            if in_place:  # the input is this rank's own output block
                for i in range(size):
                    outs[i][i].copy_(mine[i])
            sim.run({p: ALL_GATHER[algo](sim.nets[p], outs[i], outs[i][i] if in_place
                                         else mine[i], peers, i)
                     for i, p in enumerate(peers)})
            for i in range(size):
                for k in range(size):
                    assert torch.equal(outs[i][k], mine[k]), (b, in_place, i, k)


@pytest.mark.parametrize("size", RANKS)
def test_binomial_broadcast_and_reduce_from_every_root(size):
    for root in range(size):
        group, peers = _peers(size, root)
        sim = Simulation(group)
        bufs = [torch.full((11,), float(i), dtype=torch.float64) for i in range(size)]
        sim.run({p: net_binomial.broadcast(sim.nets[p], bufs[i], peers, i, root)
                 for i, p in enumerate(peers)})
        assert all(torch.equal(b, torch.full((11,), float(root), dtype=torch.float64))
                   for b in bufs), root
        for dtype, op in ((torch.int32, "SUM"), (torch.int64, "BXOR"), (torch.float32, "MAX"),
                          (torch.bfloat16, "SUM"), (torch.bool, "BOR")):
            sim = Simulation(group)
            inputs = [make(i, 9, dtype, op=op) for i in range(size)]
            bufs = [t.clone() for t in inputs]
            sim.run({p: net_binomial.reduce(sim.nets[p], bufs[i], peers, i, root,
                                            ReduceSpec(op))
                     for i, p in enumerate(peers)})
            assert torch.equal(bufs[root], reduce_ref(inputs, op, dtype)), (root, dtype, op)
            assert sim.heard(peers[root]) >= set(peers)


@pytest.mark.parametrize("size", RANKS)
def test_barriers_hear_from_everyone(size):
    for barrier in (net_dissemination.barrier, net_recursive_doubling.barrier,
                    net_tree.barrier):
        group, peers = _peers(size, 1)
        sim = Simulation(group)
        sim.run({p: barrier(sim.nets[p], peers, i) for i, p in enumerate(peers)})
        assert all(sim.heard(p) >= set(peers) for p in peers), barrier


def test_a_power_of_two_of_ranks_talks_to_log2_peers():
    """Among 2^k ranks every log-depth algorithm pairs a rank with rank ^ 2^j: together
    they open rails to k peers, not to every rank."""
    size = 32
    spec = ReduceSpec("SUM")
    for root in (0, 5):
        sim = Simulation(size)
        peers = list(range(size))
        runs = []
        for r in peers:
            net = sim.nets[r]

            def everything(net=net, r=r):
                yield from net_recursive_doubling.all_reduce(net, torch.ones(3), peers, r, spec)
                yield from net_rabenseifner.all_reduce(net, torch.ones(700), peers, r, spec)
                outs = [torch.zeros(2, dtype=torch.uint8) for _ in peers]
                yield from net_recursive_doubling.all_gather(net, outs, outs[r], peers, r)
                yield from net_halving.reduce_scatter(net, torch.ones(2), torch.ones(64),
                                                      peers, r, spec)
                yield from net_binomial.broadcast(net, torch.ones(4), peers, r, root)
                yield from net_binomial.reduce(net, torch.ones(4), peers, r, root, spec)
                yield from net_recursive_doubling.barrier(net, peers, r)
                yield from net_tree.all_reduce(net, torch.ones(3), peers, r, spec)
                yield from net_tree.barrier(net, peers, r)
            runs.append(everything())
        sim.run(runs)
        for r in peers:
            assert sim.nets[r].stats.peers == {r ^ (1 << j) for j in range(5)}, (root, r)


def test_the_simulator_catches_what_a_network_would_hang_on():
    sim = Simulation(2)

    def waits_forever(net):
        net.recv(1, torch.zeros(1))
        yield

    def silent(net):
        return
        yield

    with pytest.raises(SimError, match="deadlock"):
        sim.run({0: waits_forever(sim.nets[0]), 1: silent(sim.nets[1])})

    sim = Simulation(2)

    def sends(net, n):
        net.send(1, torch.zeros(n))
        yield

    def receives(net, n):
        net.recv(0, torch.zeros(n))
        yield

    with pytest.raises(SimError, match="expected 8 B from rank 0, which sent 4 B"):
        sim.run({0: sends(sim.nets[0], 1), 1: receives(sim.nets[1], 2)})

    sim = Simulation(2)

    def sends_no_wait(net):
        net.send(1, torch.zeros(1))
        return
        yield

    with pytest.raises(SimError, match="posted after its last yield"):
        sim.run({0: sends_no_wait(sim.nets[0]), 1: receives(sim.nets[1], 1)})


def _simulate(collective: str, algorithm: str, size: int, nbytes: int, device="cpu"):
    """Run one call of ``algorithm`` among ``size`` ranks, float32 (uint8 for all_gather)."""
    sim = Simulation(size, device=device)
    peers = list(range(size))
    spec = ReduceSpec("SUM")
    n = nbytes // 4

    def t(numel, dtype=torch.float32):
        return torch.ones(numel, dtype=dtype, device=device)

    if collective == "all_reduce":
        gens = [ALL_REDUCE[algorithm](sim.nets[r], t(n), peers, r, spec) for r in peers]
    elif collective == "all_gather":
        outs = [[t(nbytes, torch.uint8) for _ in peers] for _ in peers]
        gens = [ALL_GATHER[algorithm](sim.nets[r], outs[r], outs[r][r], peers, r)
                for r in peers]
    elif collective == "reduce_scatter":
        gens = [net_halving.reduce_scatter(sim.nets[r], t(n), t(size * n), peers, r, spec)
                for r in peers]
    elif collective == "broadcast":
        gens = [net_binomial.broadcast(sim.nets[r], t(n), peers, r, 0) for r in peers]
    elif collective == "reduce":
        gens = [net_binomial.reduce(sim.nets[r], t(n), peers, r, 0, spec) for r in peers]
    elif algorithm == "dissemination":
        gens = [net_dissemination.barrier(sim.nets[r], peers, r) for r in peers]
    elif algorithm == "tree":
        gens = [net_tree.barrier(sim.nets[r], peers, r) for r in peers]
    else:
        gens = [net_recursive_doubling.barrier(sim.nets[r], peers, r) for r in peers]
    return sim, sim.run(gens)


MODELLED = [("all_reduce", "recursive_doubling"), ("all_reduce", "rabenseifner"),
            ("all_reduce", "ring"), ("all_gather", "bruck"), ("all_gather", "recursive_doubling"),
            ("reduce_scatter", "halving"), ("broadcast", "binomial"), ("reduce", "binomial"),
            ("barrier", "dissemination"), ("barrier", "recursive_doubling"),
            ("all_reduce", "tree"), ("barrier", "tree")]


# the busiest rank receives everything before it sends anything: its bytes one way and the
# other add up on the critical path (elsewhere a rank sends and receives at once)
ONE_WAY_THEN_THE_OTHER = {("all_reduce", "tree")}


@pytest.mark.parametrize("collective,algorithm", MODELLED, ids=[f"{c}-{a}" for c, a in MODELLED])
def test_the_cost_model_counts_what_the_code_does(collective, algorithm):
    """net_cost.shape (what the selection tables price) against what the simulator saw the
    algorithm's own code do: messages exactly (call descriptors sent apart above
    PIGGYBACK_BYTES included, and the ACK frames of those above ACKED_BYTES), dependent rounds within one where ranks fold in, bytes
    within 2% on powers of two (for buffers of 1 KiB per rank and more: below that,
    regions aligned to cache lines leave some ranks nothing to do). Meta tensors: the code
    runs, nothing is allocated."""
    for size in (2, 3, 4, 5, 7, 8, 12, 16, 33, 64):
        for nbytes in (1024 * size, 1 << 20):
            _, st = _simulate(collective, algorithm, size, nbytes, device="meta")
            sh = net_cost.shape(collective, algorithm, size, nbytes)
            where = f"{size} ranks, {nbytes} B"
            assert (st.sent, st.received) == (sh.sent, sh.received), where
            assert (st.acks, st.acked) == (sh.acks, sh.acked), where
            pof2 = size & (size - 1) == 0
            assert st.hops == sh.rounds if pof2 else abs(st.hops - sh.rounds) <= 1, where
            tolerance = 0.02 if pof2 else 0.2
            through = st.bytes
            if (collective, algorithm) in ONE_WAY_THEN_THE_OTHER:
                through = max(r.bytes_sent + r.bytes_received for r in st.ranks)
            assert abs(through - sh.bytes) <= tolerance * sh.bytes + 256, where
            assert abs(st.reduced - sh.reduced) <= tolerance * sh.reduced + 256, where


@pytest.mark.parametrize("collective,algorithm", MODELLED, ids=[f"{c}-{a}" for c, a in MODELLED])
def test_the_cost_model_counts_the_average_rank(collective, algorithm):
    """net_cost.Shape.mean (what a call costs where ranks share cores: the average rank,
    net_cost.py) against the simulator's average rank: messages sent and received, the
    rounds it waits in, bytes through its link ((sent + received) / 2) and bytes reduced.
    A shape without ``mean`` says every rank does what the critical path does: checked on
    powers of two, where no rank folds in; a tree's mean at every count."""
    for size in (2, 3, 4, 5, 7, 8, 12, 16, 33, 64):
        for nbytes in (1024 * size, 1 << 20):
            sh = net_cost.shape(collective, algorithm, size, nbytes)
            pof2 = size & (size - 1) == 0
            if sh.mean is None and not pof2:
                continue
            want = sh.mean or sh
            _, st = _simulate(collective, algorithm, size, nbytes, device="meta")
            got, where = st.mean(), f"{size} ranks, {nbytes} B"
            assert got["sent"] == pytest.approx(want.sent), where
            assert got["received"] == pytest.approx(want.received), where
            assert got["waits"] == pytest.approx(want.rounds, rel=0.2, abs=0.5), where
            assert got["bytes"] == pytest.approx(want.bytes, rel=0.02, abs=256), where
            assert got["reduced"] == pytest.approx(want.reduced, rel=0.02, abs=256), where
            assert got["acks"] == pytest.approx(want.acks), where
            assert got["acked"] == pytest.approx(want.acked), where


def test_where_ranks_share_cores_the_trees_are_chosen():
    """With a core for every rank the critical path decides (recursive doubling for small
    all-reduces and barriers among a power of two); where 16 ranks share 2 cores the CPU all
    ranks spend decides, and the tree, 2 (P - 1) messages in all, is predicted faster. Two
    nodes choose as before either way."""
    from neuron_dist.collectives.selection import Selection
    for crowd in (0.0, 0.5, 1.0):
        s = Selection(crowd=crowd)
        for ranks in (4, 8, 16, 32):
            assert s.select("all_reduce/network", 8, ranks, numel=2) == "recursive_doubling"
            assert s.select("barrier/network", 0, ranks) == "recursive_doubling"
    s = Selection(crowd=8.0)
    for ranks in (3, 4, 8, 16, 32):
        assert s.select("all_reduce/network", 8, ranks, numel=2) == "tree", ranks
        assert s.select("barrier/network", 0, ranks) == "tree", ranks
    assert s.select("all_reduce/network", 8, 2, numel=2) == "direct"
    assert s.select("barrier/network", 0, 2) == "recursive_doubling"
    rd = net_cost.shape("all_reduce", "recursive_doubling", 16, 8)
    tree = net_cost.shape("all_reduce", "tree", 16, 8)
    link = net_cost.MEASURED
    assert rd.time(link) < tree.time(link)
    assert tree.time(link, 8.0) < rd.time(link, 8.0) / 1.8  # (8 message ends a rank against 3.75)


def test_messages_that_wait_for_their_ack_are_priced():
    """A message above net.ACKED_BYTES (the rdm transport's eager limit) costs an ACK frame
    at each end and a wait: so among 8 ranks sharing cores, an all-gather of 98 KiB blocks
    (an FSDP2 layer's parameters) is sent to every peer at once, not by recursive doubling,
    whose last round of 392 KiB waits for its ack; with 16 ranks of 64 KiB blocks the
    doubling still wins (the fewer messages outweigh one ack)."""
    from neuron_dist.collectives import net
    from neuron_dist.collectives.selection import Selection
    from neuron_dist.transport.rdm.driver import EAGER_BYTES
    assert net.ACKED_BYTES == EAGER_BYTES
    s = Selection(crowd=4.0)
    assert s.select("all_gather/network", 100480, 8, block=100480) == "direct"
    assert s.select("reduce_scatter/network", 100480, 8, block=100480) == "direct"
    assert Selection(crowd=8.0).select("all_gather/network", 65536, 16, block=65536) == \
        "recursive_doubling"
    rd = net_cost.shape("all_gather", "recursive_doubling", 8, 100480)
    assert (rd.acks, rd.acked) == (2, 1)  # (the 392 KiB round: its ack, sent and received)
    link = net_cost.MEASURED
    priced = rd.time(link) - replace(rd, acks=0, acked=0).time(link)
    assert priced == pytest.approx(2 * link.alpha + link.lat)


@pytest.mark.timeout(60)
def test_1024_ranks_in_the_simulator_under_a_minute():
    """Every algorithm among 1024 ranks with real data, each result checked; log-depth
    counts: 10 rounds and 10 peers where a direct exchange has 1023."""
    start = time.monotonic()
    size = 1024
    peers = list(range(size))
    spec = ReduceSpec("SUM")
    for algo in ("recursive_doubling", "rabenseifner", "tree"):
        sim = Simulation(size)
        bufs = [torch.full((5,), i, dtype=torch.int64) for i in peers]
        st = sim.run([ALL_REDUCE[algo](sim.nets[r], bufs[r], peers, r, spec) for r in peers])
        assert all(torch.equal(b, torch.full((5,), size * (size - 1) // 2)) for b in bufs), algo
        assert st.peers == 10 and st.hops == (10 if algo == "recursive_doubling" else 20), algo
        if algo == "tree":  # (the root handles 20 messages; all ranks together 2 x 1023)
            assert st.messages == 2 * (size - 1) and st.received == 10, st.messages
    sim = Simulation(size)
    outs = [[torch.zeros(2, dtype=torch.uint8) for _ in peers] for _ in peers]
    mine = [torch.tensor([i % 256, i // 256], dtype=torch.uint8) for i in peers]
    st = sim.run([net_bruck.all_gather(sim.nets[r], outs[r], mine[r], peers, r) for r in peers])
    assert all(torch.equal(outs[r][k], mine[k]) for r in (0, 511, 1023) for k in peers)
    assert st.sent == 10
    sim = Simulation(size)
    works = [torch.arange(size, dtype=torch.int64) * (i + 1) for i in peers]
    outs = [torch.zeros(1, dtype=torch.int64) for _ in peers]
    sim.run([net_halving.reduce_scatter(sim.nets[r], outs[r], works[r], peers, r, spec)
             for r in peers])
    assert all(int(outs[r]) == r * size * (size + 1) // 2 for r in peers)
    sim = Simulation(size)
    bufs = [torch.full((3,), i) for i in peers]
    sim.run([net_binomial.broadcast(sim.nets[r], bufs[r], peers, r, 700) for r in peers])
    assert all(torch.equal(b, torch.full((3,), 700)) for b in bufs)
    sim = Simulation(size)
    st = sim.run([net_dissemination.barrier(sim.nets[r], peers, r) for r in peers])
    assert st.hops == 10 and all(sim.heard(r) >= set(peers) for r in (0, 1023))
    assert time.monotonic() - start < 60


def test_blocks_end_to_end_in_one_tensor_are_gathered_in_place():
    """Recursive doubling's all_gather works in the caller's output when its blocks lie
    end to end (``spanned``), and in scratch otherwise (out of order, gaps, apart)."""
    blocks = _blocks(4, 5, "one_tensor")
    whole = net_recursive_doubling.spanned(blocks)
    assert whole is not None and whole.numel() == 20
    assert whole.data_ptr() == blocks[0].data_ptr()
    whole[7] = 9
    assert blocks[1][2] == 9
    assert net_recursive_doubling.spanned(blocks[::-1]) is None
    assert net_recursive_doubling.spanned(blocks[::2]) is None
    assert net_recursive_doubling.spanned(_blocks(4, 5, "apart")) is None
    assert net_recursive_doubling.spanned(_blocks(4, 0, "one_tensor")) is None
    typed = torch.zeros(8)
    assert net_recursive_doubling.spanned([typed[:4], typed[4:]]) is None
