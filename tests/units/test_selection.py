"""The selection tables (collectives/selection.py): default choices at their boundaries,
NEURON_DIST_ALGO overrides, and the errors a bad override gives at init."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from neuron_dist.collectives import alltoall, selection as sel
from neuron_dist.collectives.selection import (HALVES_BYTES, HIERARCHICAL_MIN_ELEMENTS,
                                              ONE_STEP_PEER_BYTES,
                                              SINGLE_COPY_BYTES, Selection)
from neuron_dist.config import Settings, parse_bytes

SMALL, SLOT = 64 << 10, 1 << 20
D = Selection(SMALL, SLOT)


def over(text: str, small: int = SMALL, slot: int = SLOT) -> Selection:
    return Selection(small, slot, sel.parse_overrides(text, parse_bytes))


def ar(s: Selection, nbytes: int, ranks: int = 2, cma: bool = False, first: bool = True) -> str:
    return s.select("all_reduce", nbytes, ranks, numel=nbytes // 4,
                    block=-(-(nbytes // 4) // ranks) * 4, cma=cma, first=first)


def net(s: Selection, nbytes: int, peers: int) -> str:
    return s.select("all_reduce/network", nbytes, peers, numel=nbytes // 4)


def test_every_table_ends_with_a_row_that_always_holds_and_runs():
    anything = sel.Situation(0, 0, even=False)
    for table, rows in {**sel.TABLES, **sel.LANES}.items():
        algorithm, holds = rows[-1]
        assert holds(anything) and algorithm not in sel.RUNS, table
        assert algorithm not in sel.RUNS_IN.get(table, {}), table
        assert "/" not in algorithm and algorithm == algorithm.lower()


def test_one_node_all_reduce_defaults():
    assert ar(D, 8) == ar(D, SMALL) == "one_step"
    # one step up to a slot while a rank reads at most ONE_STEP_PEER_BYTES of peers' slots
    assert ar(D, SLOT) == ar(D, SLOT, ranks=4) == "one_step"
    assert ar(D, SLOT, ranks=5) == "two_step"
    most = ONE_STEP_PEER_BYTES // 7 // 4 * 4  # 8 ranks: 7 peers' slots
    assert ar(D, most, ranks=8) == "one_step" and ar(D, most + 4, ranks=8) == "two_step"
    assert ar(D, SMALL, ranks=64) == "one_step"  # up to NEURON_DIST_SMALL_BYTES whatever N
    assert ar(D, 16 << 20, ranks=1) == "one_step"  # alone: one step per chunk
    # beyond a slot: single copy from blocks of 1 MiB; else two ranks take one step per
    # chunk (as many bytes as two steps, half the synchronisations), more ranks two steps
    assert ar(D, 2 * SINGLE_COPY_BYTES, cma=True) == "single_copy"
    assert ar(D, 4 * SINGLE_COPY_BYTES, ranks=4, cma=True) == "single_copy"
    assert ar(D, SLOT + 4) == ar(D, 2 * SINGLE_COPY_BYTES - 8, cma=True) == "one_step"
    assert ar(D, 2 * SINGLE_COPY_BYTES, cma=False) == "one_step"
    # a later phase of a call (a hierarchical all_reduce's) chooses as a call would
    assert ar(D, 2 * SINGLE_COPY_BYTES, cma=True, first=False) == "single_copy"
    assert ar(D, SLOT + 4, ranks=3) == ar(D, 4 * SINGLE_COPY_BYTES, ranks=4) == "two_step"
    # NEURON_DIST_SMALL_BYTES above the slot: one step only up to a slot
    assert ar(Selection(4 << 20, SLOT), SLOT, ranks=8) == "one_step"
    assert ar(Selection(4 << 20, SLOT), SLOT + 4, ranks=8) == "two_step"


def test_one_node_gather_and_scatter_defaults():
    for table in ("all_gather", "reduce_scatter"):
        assert D.select(table, SINGLE_COPY_BYTES - 1, 4, cma=True) == "slots"
        assert D.select(table, SINGLE_COPY_BYTES, 4, cma=True) == "single_copy"
        assert D.select(table, SINGLE_COPY_BYTES, 4, cma=False) == "slots"
        assert D.select(table, SINGLE_COPY_BYTES, 1, cma=True) == "slots"
    assert D.select("reduce_scatter", SINGLE_COPY_BYTES, 9, cma=True, addresses=9) == "slots"


def a2a(s: Selection, nbytes: int, ranks: int = 4, cma: bool = True, first: bool = True) -> str:
    """all_to_all's choice as alltoall.py asks it (``nbytes``: the largest block)."""
    return alltoall.choose(s, SimpleNamespace(size=ranks, cma=cma, slot_bytes=SLOT), nbytes,
                           first)


def test_one_node_all_to_all_defaults():
    assert a2a(D, SINGLE_COPY_BYTES - 1) == "slots"
    assert a2a(D, SINGLE_COPY_BYTES) == a2a(D, 1 << 30) == "single_copy"
    assert a2a(D, SINGLE_COPY_BYTES, ranks=8) == "single_copy"
    # where single copy cannot run: no CMA, alone, more ranks than the descriptor holds
    # addresses, or after the call's first step
    assert a2a(D, SINGLE_COPY_BYTES, cma=False) == a2a(D, SINGLE_COPY_BYTES, ranks=1) == "slots"
    assert a2a(D, SINGLE_COPY_BYTES, ranks=9) == a2a(D, 1 << 30, first=False) == "slots"
    # the first step posts the addresses exactly where the table may pick single copy
    for ranks, cma, first in ((4, True, True), (8, True, True), (9, True, True),
                              (1, True, True), (4, False, True), (4, True, False)):
        assert sel.can_run("all_to_all", "single_copy", ranks, cma=cma, first=first,
                           addresses=ranks) == (
            a2a(D, 1 << 30, ranks, cma, first) == "single_copy"), (ranks, cma, first)


def test_all_to_all_even_split_plan_follows_the_table():
    channel = SimpleNamespace(size=2, cma=True, slot_bytes=4 << 20)  # blocks up to ~2 MiB
    assert alltoall.even_block(D, channel, SINGLE_COPY_BYTES - 64)
    assert not alltoall.even_block(D, channel, SINGLE_COPY_BYTES)  # single copy
    assert alltoall.even_block(over("all_to_all=slots"), channel, SINGLE_COPY_BYTES)
    assert not alltoall.even_block(over("all_to_all=single_copy"), channel, 8)
    channel.cma = False
    assert alltoall.even_block(D, channel, SINGLE_COPY_BYTES)
    assert alltoall.even_block(over("all_to_all=single_copy"), channel, 8)
    assert not alltoall.even_block(D, channel, 3 << 20)  # more than a slot's block


def test_across_nodes_defaults():
    L = 4
    nodes = "all_reduce/nodes"
    assert D.select(nodes, 0, L, numel=HIERARCHICAL_MIN_ELEMENTS * L) == "hierarchical"
    assert D.select(nodes, 0, L, numel=HIERARCHICAL_MIN_ELEMENTS * L - 1) == "leader"
    assert D.select(nodes, 0, L, numel=1 << 20, even=False) == "leader"
    for table in ("all_gather/nodes", "reduce_scatter/nodes"):
        assert D.select(table, 8, L) == "columns"
        assert D.select(table, 8, L, even=False) == "leader"
    assert net(D, HALVES_BYTES, 2) == "halves" and net(D, HALVES_BYTES - 4, 2) == "direct"
    assert net(D, 1 << 30, 2) == "halves"  # (two nodes: measured, not modelled)
    # more nodes: the cost model's choice, log-depth from a few nodes on
    assert net(D, 8, 3) == "direct"  # one round of 2 messages beats 2 rounds with a fold
    for peers in (16, 64, 1024):
        assert net(D, 8, peers) == "recursive_doubling"
        assert net(D, 1 << 20, peers) == "rabenseifner"
        assert D.select("all_gather/network", 1 << 10, peers) == "recursive_doubling"
        assert D.select("reduce_scatter/network", 1 << 10, peers) == "halving"
        assert D.select("barrier/network", 0, peers) == "recursive_doubling"
    for peers in (12, 100):  # not a power of two: fewer rounds than a fold gives
        assert D.select("all_gather/network", 1 << 10, peers) == "bruck"
        assert D.select("barrier/network", 0, peers) == "dissemination"
    assert D.select("all_gather/network", 1 << 10, 16, uniform=False) == "direct"
    assert D.select("reduce_scatter/network", 1 << 10, 16, uniform=False) == "direct"
    assert D.select("broadcast/network", 1 << 20, 9) == "binomial"


def test_across_nodes_the_cost_model_chooses():
    """From 3 nodes the network tables pick what net_cost predicts fastest on the group's
    link, among the algorithms that can run; NEURON_DIST_NET_COST's link changes it."""
    from neuron_dist.collectives import net_cost
    for peers in (3, 4, 5, 8, 13, 64):
        for nbytes in (8, 4 << 10, 256 << 10, 4 << 20, 64 << 20):
            can = ["direct", "recursive_doubling", "rabenseifner"] + (
                ["ring"] if nbytes // 4 >= peers else [])
            assert net(D, nbytes, peers) == net_cost.cheapest(
                "all_reduce", can, peers, nbytes, net_cost.MEASURED), (peers, nbytes)
    rounds_only = Selection(SMALL, SLOT, link=net_cost.Link(alpha=0, lat=1, beta=0, gamma=0))
    assert net(rounds_only, 8, 64) == "direct"  # one round
    messages_only = Selection(SMALL, SLOT, link=net_cost.parse("alpha=1s,lat=0s,gbs=1e9"))
    assert net(messages_only, 8, 5) == "recursive_doubling"  # 3 messages where direct has 4
    # 28 messages and 4 ACK frames (net_cost.ACKED_BYTES), where recursive doubling has 24
    # messages, every one of its 1 MiB ones answered by an ACK frame: 12 more
    assert net(messages_only, 1 << 20, 64) == "rabenseifner"
    bytes_only = Selection(SMALL, SLOT, link=net_cost.Link(alpha=0, lat=0, beta=1, gamma=0))
    assert net(bytes_only, 1 << 20, 64) == "rabenseifner"  # 2 (p-1)/p of the buffer


def test_all_to_all_overrides():
    s = over("all_to_all=slots")
    assert a2a(s, 1 << 30) == "slots"
    assert ar(s, 2 * SINGLE_COPY_BYTES, cma=True) == "single_copy"  # other tables keep theirs
    s = over("all_to_all=single_copy")
    assert a2a(s, 8) == a2a(s, 0) == "single_copy"
    assert a2a(s, 8, cma=False) == a2a(s, 8, ranks=9) == a2a(s, 8, first=False) == "slots"
    s = over("all_to_all:4K-=single_copy,all_to_all:64M-=slots")
    assert a2a(s, 4095) == "slots" and a2a(s, 4096) == a2a(s, 1 << 20) == "single_copy"
    assert a2a(s, 1 << 30) == "single_copy"  # the first matching entry wins


def test_overrides_force_an_algorithm_where_it_can_run():
    s = over("all_reduce=ring")
    assert net(s, 12, 3) == net(s, 8, 2) == "ring"  # (12 B: 3 float32 among 3 peers)
    assert net(s, 8, 3) == "direct"  # fewer elements than peers: the table's own rows
    assert net(s, 4 << 20, 3) == "ring"
    assert ar(s, 8) == "one_step"  # other tables keep their rows
    s = over("all_reduce=halves")
    assert net(s, 8, 2) == "halves" and net(s, 8, 3) == "direct"  # halves: two only
    s = over("all_reduce=rabenseifner")
    assert net(s, 8, 2) == net(s, 8, 3) == "rabenseifner"
    s = over("all_reduce=single_copy")
    assert ar(s, 8, cma=True) == "single_copy"
    assert ar(s, 8, cma=False) == ar(s, 8, ranks=1, cma=True) == "one_step"
    assert ar(s, 8, cma=True, first=False) == "single_copy"  # (any phase: single_copy.py)
    s = over("all_reduce=two_step")
    assert ar(s, 8) == ar(s, 8, ranks=1) == "two_step"
    s = over("all_reduce=hierarchical")
    assert s.select("all_reduce/nodes", 0, 4, numel=1) == "hierarchical"
    assert s.select("all_reduce/nodes", 0, 4, numel=1, even=False) == "leader"


def test_override_ranges_and_order():
    s = over("all_reduce:0-64K=two_step, all_reduce:1M-=one_step")
    assert ar(s, 8) == ar(s, (64 << 10) - 4) == "two_step"
    # between the ranges, the default rows (64 ranks: one step only up to small)
    assert ar(s, 64 << 10, ranks=64) == "one_step"
    assert ar(s, (64 << 10) + 4, ranks=64) == "two_step"
    assert ar(s, 1 << 20) == ar(s, 1 << 30) == "one_step"
    s = over("all_reduce:-4K=direct,all_reduce=ring")  # first matching entry wins
    assert net(s, 4092, 3) == "direct" and net(s, 4096, 3) == "ring"
    assert over("auto").select("all_gather/nodes", 8, 2) == "columns"
    assert over("").select("all_gather/nodes", 8, 2) == "columns"


def test_a_bare_name_applies_to_every_table_that_has_it():
    s = over("leader")
    for table in ("all_reduce/nodes", "all_gather/nodes", "reduce_scatter/nodes"):
        assert s.select(table, 1 << 30, 2, numel=1 << 28) == "leader", table
    assert ar(s, 8) == "one_step"
    assert {o.table for o in sel.parse_overrides("single_copy", parse_bytes)} == {
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert {o.table for o in sel.parse_overrides("slots", parse_bytes)} == {
        "all_gather", "reduce_scatter", "all_to_all"}


def test_an_override_may_name_one_table():
    """``all_reduce/network=direct`` (a table, as the error message lists them) forces the
    algorithm in that table only; ``all_reduce=direct`` in every all_reduce table."""
    assert {o.table for o in sel.parse_overrides("all_reduce/network=direct", parse_bytes)} == {
        "all_reduce/network"}
    assert {o.table for o in sel.parse_overrides("all_reduce/nodes=leader", parse_bytes)} == {
        "all_reduce/nodes"}
    assert "all_reduce/network" in {
        o.table for o in sel.parse_overrides("all_reduce=direct", parse_bytes)}
    with pytest.raises(ValueError, match="all_reduce/nodes has no algorithm 'direct'"):
        sel.parse_overrides("all_reduce/nodes=direct", parse_bytes)


@pytest.mark.parametrize("text,words", [
    ("all_reduse=ring", ["unknown collective 'all_reduse'", "all_reduce/network: mpi, halves, direct, recursive_doubling, tree, rabenseifner, ring"]),
    ("all_reduce=rign", ["all_reduce has no algorithm 'rign'", "ring"]),
    ("all_gather=ring", ["all_gather has no algorithm 'ring'", "columns"]),
    ("bogus", ["no collective has an algorithm 'bogus'"]),
    ("all_reduce:64K=ring", ["bad size range '64k'"]),
    ("all_reduce:abc-1M=ring", ["bad size range 'abc-1m'"]),
    ("all_reduce:64K-1K=ring", ["empty size range '64k-1k'"]),
    ("all_reduce:64K-64K=ring", ["empty size range"]),
])
def test_bad_overrides_fail_at_init_naming_the_problem(text, words):
    with pytest.raises(ValueError) as e:
        Settings.from_env({"NEURON_DIST_ALGO": text})
    assert "NEURON_DIST_ALGO" in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_settings_carry_the_parsed_overrides():
    assert Settings.from_env({}).algo == ()
    got = Settings.from_env({"NEURON_DIST_ALGO": "All_Reduce:1K-2M=Ring"}).algo
    assert got == (sel.Override("all_reduce/network", "ring", 1 << 10, 2 << 20),)


def test_the_thresholds_are_defined_only_in_selection_py():
    """No other module keeps its own copy of a threshold the tables use."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    names = {"SINGLE_COPY_BYTES", "MAX_ADDRESSES", "HIERARCHICAL_MIN_ELEMENTS", "RING_BYTES",
             "HALVES_BYTES", "MIN_BYTES", "HIER_MIN_ELEMS_PER_RANK"}
    found = []
    for folder in ("collectives", "neuron_dist", "transport"):
        for path in sorted((repo / folder).rglob("*.py")):
            if path.name == "selection.py" and path.parent.name == "collectives":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assign):
                    found += [f"{path.relative_to(repo)}:{node.lineno} {t.id}"
                              for t in node.targets if isinstance(t, ast.Name) and t.id in names]
    assert not found, found


def test_a_remembered_choice_is_the_choice_for_that_very_situation():
    """Selection remembers its answers: asked again it answers the same, and a question
    that differs in any field (table, size, ranks, a keyword) is answered afresh."""
    s = Selection(SMALL, SLOT)
    big = 4 * SINGLE_COPY_BYTES
    assert ar(s, big, cma=True) == "single_copy"
    assert ar(s, big, cma=False) != "single_copy"  # (cma differs: not the remembered one)
    assert ar(s, big, ranks=1, cma=True) != "single_copy"
    assert ar(s, big, cma=True) == "single_copy"
    assert net(s, 8, 16) == "recursive_doubling" and net(s, 8, 2) == "direct"
    forced = over("all_reduce=two_step")
    assert ar(forced, 8) == "two_step" and ar(s, 8) == "one_step"  # per Selection


def test_net_cost_setting_parses_and_names_what_is_wrong():
    """NEURON_DIST_NET_COST: any subset of alpha, lat (times), gbs, reduce_gbs (GB/s);
    anything else fails at init with an error that names the entry."""
    from neuron_dist.collectives import net_cost
    from neuron_dist.config import Settings

    link = net_cost.parse("alpha=20us, lat=1ms,gbs=12")
    assert (link.alpha, link.lat, link.beta) == pytest.approx((20e-6, 1e-3, 1e-9 / 12))
    assert link.gamma == net_cost.MEASURED.gamma
    assert net_cost.parse("auto") == net_cost.parse("") == net_cost.MEASURED
    again = net_cost.parse(link.describe())  # (the text init compares across ranks)
    assert (again.alpha, again.lat, again.beta, again.gamma) == pytest.approx(
        (link.alpha, link.lat, link.beta, link.gamma), rel=1e-5)
    assert Settings.from_env({"NEURON_DIST_NET_COST": "lat=5us"}).net_cost.lat == \
        pytest.approx(5e-6)
    for text, words in (("alpha=fast", "bad value in 'alpha=fast'"),
                        ("gbs=0", "bad value in 'gbs=0'"), ("lat=-1us", "bad value"),
                        ("beta=3", "unknown figure 'beta'"), ("alpha", "bad value in 'alpha'")):
        with pytest.raises(ValueError) as e:
            Settings.from_env({"NEURON_DIST_NET_COST": text})
        assert "NEURON_DIST_NET_COST" in str(e.value) and words in str(e.value), str(e.value)


def test_mpi_collectives_where_the_transport_has_the_column():
    """The network tables pick MPI's own collectives exactly when the phase's ranks are the
    transport's column (``native``); uneven blocks and overrides keep neuron's own."""
    s = sel.DEFAULT
    for table, nbytes in (("all_reduce/network", 8), ("all_reduce/network", 64 << 20),
                          ("all_gather/network", 1 << 20), ("reduce_scatter/network", 4096),
                          ("broadcast/network", 256), ("barrier/network", 0)):
        for ranks in (2, 3, 16):
            assert s.select(table, nbytes, ranks, numel=max(nbytes // 4, ranks),
                            native=True) == "mpi", (table, nbytes, ranks)
            assert s.select(table, nbytes, ranks, numel=max(nbytes // 4, ranks)) != "mpi"
    assert s.select("all_gather/network", 4096, 5, native=True, uniform=False) == "direct"
    assert s.select("broadcast/network", 257, 5, native=True) == "binomial"
    forced = over("all_reduce=recursive_doubling")
    assert forced.select("all_reduce/network", 8, 8, numel=2, native=True) == "recursive_doubling"


REPO = Path(__file__).resolve().parents[2]


def _registries() -> dict:
    """table -> the registry (name -> what runs it) of the module that runs its algorithms."""
    from neuron_dist.collectives import (allgather, allgather_net, allreduce, allreduce_net,
                                         barrier_net, broadcast_net, reduce_scatter,
                                         reduce_scatter_net, rooted_net)
    return {
        "all_reduce": [allreduce.ALGORITHMS],
        "all_gather": [allgather.ALGORITHMS, allgather.INTO],
        "reduce_scatter": [reduce_scatter.ALGORITHMS],
        "all_to_all": [alltoall.ALGORITHMS],
        "all_reduce/nodes": [allreduce_net.LAYOUTS],
        "all_gather/nodes": [allgather_net.LAYOUTS],
        "reduce_scatter/nodes": [reduce_scatter_net.LAYOUTS],
        "all_reduce/network": [allreduce_net.NETWORK],
        "all_gather/network": [allgather_net.NETWORK],
        "reduce_scatter/network": [reduce_scatter_net.NETWORK],
        "broadcast/network": [broadcast_net.NETWORK],
        "reduce/network": [rooted_net.REDUCE_NETWORK],
        "barrier/network": [barrier_net.NETWORK],
    }


def test_every_algorithm_of_a_table_runs_from_its_modules_registry():
    """Adding an algorithm is a row and a registry entry: each table's algorithms are
    exactly the names its module's registries run, and the cost model prices every
    algorithm of a modelled row."""
    from neuron_dist.collectives import net_cost
    registries = _registries()
    assert set(registries) == set(sel.TABLES)
    for table, regs in registries.items():
        for reg in regs:
            assert set(reg) == set(sel.algorithms(table)), table
        for name, cond in sel.TABLES[table]:
            if getattr(cond, "modelled", False):
                net_cost.shape(sel.collective(table), name, 4, 1024)  # (raises if unpriced)


def _compares_names(source: str, names: set) -> list:
    """The lines where ``source`` compares something with an algorithm name (``==``,
    ``!=``, ``in``, ``not in`` with a name or a tuple, list or set holding one) or with a
    plan's ``ALGORITHM``."""
    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return isinstance(node, ast.Attribute) and node.attr == "ALGORITHM"

    def transport(node) -> bool:  # ("mpi" names a transport too: NEURON_DIST_TRANSPORT)
        return isinstance(node, ast.Attribute) and node.attr == "transport"

    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Compare) and not transport(node.left)
                and any(named(x) for x in [node.left, *node.comparators])):
            found.append(node.lineno)
        if isinstance(node, ast.Match):
            found.append(node.lineno)
    return found


def test_no_module_outside_selection_py_compares_algorithm_names():
    """Algorithm choice is only in the tables: the modules that run algorithms look the
    chosen name up in a registry, and never compare it (no if-chains on names)."""
    names = {name for table in sel.TABLES for name in sel.algorithms(table)} | set(sel.RUNS)
    found = []
    for folder in ("collectives", "neuron_dist", "transport"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == REPO / "collectives" / "selection.py":
                continue
            found += [f"{path.relative_to(REPO)}:{line}"
                      for line in _compares_names(path.read_text(), names)]
    assert not found, found
    # (the check sees what it is for, as the code before the registries had it)
    old = ('if algo == "one_step" and n <= cap:\n    pass\n'
           'x = algo != "direct"\ny = plan.ALGORITHM == algo\n'
           'z = algo in ("mpi", "halves")\n'
           'ok = settings.transport == "mpi"\n')
    assert sorted(_compares_names(old, names)) == [1, 3, 4, 5]


def test_a_later_phase_of_a_two_level_all_reduce_chooses_for_itself(monkeypatch):
    """The all_gather that ends a hierarchical all_reduce asks the all_gather table as an
    all_gather of its size would: after the call's first step (which the reduce_scatter
    phase took) it still runs single copy where the table picks it (single_copy.py
    publishes its addresses through the slots then)."""
    from neuron_dist.collectives import allgather, allreduce_net
    from neuron_dist.collectives.context import Plans
    from neuron_dist.collectives.reduce_ops import SUM, ReduceSpec
    from neuron_dist.topology import Topology

    ran, names = [], []
    for name in allgather.ALGORITHMS:
        monkeypatch.setitem(allgather.ALGORITHMS, name,
                            lambda ctx, outs, inp, name=name: ran.append((name, ctx.checked)))

    def reduce_scatter_phase(ctx, out, inputs, spec):
        ctx.checked = True  # it took the call's first step

    monkeypatch.setattr(allreduce_net.rs, "reduce_scatter", reduce_scatter_phase)
    monkeypatch.setattr(allreduce_net, "_exchange_reduce", lambda *args, **kwargs: None)
    topo = Topology.from_names(0, ["a", "a", "b", "b"])
    net_call = SimpleNamespace(topo=topo, wait=lambda: None,
                               buffer=lambda name, n, dtype: torch.empty(n, dtype=dtype))
    for cma, slice_bytes, want in ((True, SINGLE_COPY_BYTES, "single_copy"),
                                   (True, SINGLE_COPY_BYTES // 2, "slots"),
                                   (False, SINGLE_COPY_BYTES, "slots")):
        ran.clear()
        names.clear()
        ctx = SimpleNamespace(net_call=net_call, rank=0, size=2, checked=False, selection=D,
                              chose=names.append, plans=Plans(),
                              channel=SimpleNamespace(size=2, cma=cma, slot_bytes=SLOT))
        buf = torch.zeros(2 * slice_bytes // 4)  # float32: two slices of slice_bytes
        allreduce_net.all_reduce(ctx, buf, buf, ReduceSpec(SUM))
        assert ran == [(want, True)] and names == ["hierarchical", want], (cma, ran, names)


def test_the_express_lane_between_nodes_serves_what_its_lane_table_says():
    """Which calls the network express lane serves is a row of the ``express/nodes`` lane
    table (data that travels with its descriptor), not a size cap of express_net.py; a
    lane is not an algorithm, so NEURON_DIST_ALGO cannot name it."""
    from neuron_dist.collectives.net import PIGGYBACK_BYTES
    assert D.serves("express/nodes", 8, 4) and D.serves("express/nodes", PIGGYBACK_BYTES, 2)
    assert not D.serves("express/nodes", PIGGYBACK_BYTES + 1, 4)
    assert over("all_reduce=ring").serves("express/nodes", 8, 4)
    for text in ("express", "general", "express/nodes=general"):
        with pytest.raises(ValueError):
            sel.parse_overrides(text, parse_bytes)
    for name in ("express.py", "express_net.py"):
        assert "PIGGYBACK_BYTES" not in (REPO / "neuron_dist" / name).read_text()
