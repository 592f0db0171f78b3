"""Which algorithm a collective runs: every selection table of the backend, in one place.

How selection works
-------------------
Each table is an ordered list of rows ``(algorithm, condition)``. ``Selection.select``
returns the algorithm of the first row whose condition holds for the call *and* that can
run in it (``RUNS``: e.g. single copy needs cross-memory attach; ``RUNS_IN``: what an
algorithm needs in one table only, e.g. all_to_all's single copy the call's first step);
every table ends with a row that always holds and always runs. The algorithm modules ask
(``ctx.selection.select("all_reduce", ...)``) instead of comparing thresholds themselves,
and ``bench/costmodel.py`` asks the same tables for the algorithm it models. Each module
runs the name it is given from its registry (name -> function: ``ALGORITHMS``,
``LAYOUTS``, ``NETWORK``), so adding an algorithm is a row here and an entry there; no
module outside this one compares algorithm names (tests/units/test_selection.py). Every
phase of a collective asks its own table: the all_gather that ends a hierarchical
all_reduce chooses as an all_gather of its size would.

A collective has one table per stage it goes through:

``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``
    inside a node, over shared memory (``collectives/<x>.py``); ``nbytes`` is the message
    (all_reduce), the largest contribution (all_gather), the largest block a rank
    reduces (reduce_scatter) or the largest block a rank sends another (all_to_all, asked
    once the first step told every rank every size); ``ranks`` the node's ranks in the call.
``<x>/nodes``
    a group that spans nodes (``collectives/<x>_net.py``): how the node phases and the
    network combine; ``nbytes`` is the message (all_reduce) or the largest block.
``<x>/network``
    the exchange among the nodes of a collective across nodes: one rank per node (a
    column of ranks with the same local index, or the nodes' leaders); ``nbytes`` is the
    buffer each rank exchanges (its slice in the hierarchical all-reduce; the block of one
    rank in all_gather and reduce_scatter), ``ranks`` the nodes. Where several algorithms
    can serve, rows marked ``_modelled`` pick the one the cost model (net_cost.py) predicts
    fastest for this many nodes and bytes on the group's ``Link`` (``NEURON_DIST_NET_COST``,
    by default the measured one) with the group's ``crowd`` (ranks per core where its
    cores are most crowded: neuron_dist/topology.py's ``crowding``; where ranks share
    cores, the CPU all of them spend decides, and trees win over recursive doubling).

``LANES`` has tables of the same rows for what is not an algorithm but a path: which calls
a lane serves (``express/nodes``: the express lane of a group that spans nodes), asked by
``Selection.serves`` and out of the overrides' reach.

Every rank of a call must choose the same algorithm: conditions only read what every rank
of the call agrees on (sizes, dtypes, the node layout, what the node's ranks agreed about
cross-memory attach, the group's settings).

Overrides
---------
``NEURON_DIST_ALGO`` (parsed by ``neuron_dist/config.py`` with ``parse_overrides``) puts rows
in front of the tables: ``all_reduce=ring`` forces the ring wherever it can run,
``all_reduce:0-64K=direct`` only for 0 <= nbytes < 64 KiB (the bytes of the table holding the
algorithm), ``all_reduce/network=direct`` in that one table, a bare ``leader`` every table
that has a ``leader``. Entries are separated by
commas; ``auto`` (the default) adds none. An override never makes a call wrong: where its
algorithm cannot run (``RUNS``), the table's own rows decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from . import net_cost, net_mpi
from .net import PIGGYBACK_BYTES

if TYPE_CHECKING:
    from typing import TypedDict

    from typing_extensions import Unpack

# ------------------------------------------------------------------------ thresholds
# Single copy (single_copy.py) from this block size: below it, memmove through a slot that
# stays in cache is faster than process_vm_readv, which pins the peer's pages one by one
# (docs/design.md, "Thresholds and why").
SINGLE_COPY_BYTES = 1 << 20
MAX_ADDRESSES = 8  # single copy: the spare words of a call descriptor hold this many addresses
# all_reduce across nodes of equal size is hierarchical from this many elements per local rank
HIERARCHICAL_MIN_ELEMENTS = 64
# all_reduce inside a node: one step (every rank reads every peer's whole slot) as long as a
# rank reads at most this much of its peers' slots; two steps read about 2/N as much but
# synchronise twice, which costs more while each peer's part fits its slot (docs/design.md,
# "Thresholds and why").
ONE_STEP_PEER_BYTES = 3 << 20
# Network all-reduce between two peers: halves from here, else direct. Halves does half the
# additions in two dependent phases, direct one phase; halves pays only once the additions
# outweigh the second phase (docs/design.md, "Thresholds and why").
HALVES_BYTES = 5 << 20


class Situation:
    """What a table's conditions read: ``nbytes`` and ``ranks`` (see the module docstring),
    ``numel`` (elements of the buffer), ``block`` (bytes of the largest per-rank block),
    ``cma`` (the node's ranks can read each other's memory), ``first`` (the algorithm
    begins with the call's first step: all_to_all), ``even`` (nodes of equal size),
    ``addresses`` (tensors a single-copy algorithm must publish), ``uniform`` (every rank's block has the
    same size), ``native`` (the network phase's ranks are a column the transport runs its
    own collectives on: net_mpi.serves), and the group's ``small_bytes``, ``slot_bytes``,
    ``link`` (net_cost.Link) and ``crowd`` (ranks per core, net_cost.py)."""

    __slots__ = ("nbytes", "ranks", "numel", "block", "cma", "first", "even", "addresses",
                 "uniform", "native", "small_bytes", "slot_bytes", "link", "crowd")

    def __init__(self, nbytes: int, ranks: int, numel: int = 0, block: int = 0,
                 cma: bool = False, first: bool = True, even: bool = True, addresses: int = 1,
                 uniform: bool = True, native: bool = False, small_bytes: int = 64 << 10,
                 slot_bytes: int = 1 << 20, link: net_cost.Link = net_cost.MEASURED,
                 crowd: float = 0.0):
        self.nbytes, self.ranks, self.numel, self.block = nbytes, ranks, numel, block
        self.cma, self.first, self.even, self.addresses = cma, first, even, addresses
        self.uniform, self.native = uniform, native
        self.small_bytes, self.slot_bytes, self.link = small_bytes, slot_bytes, link
        self.crowd = crowd


if TYPE_CHECKING:
    class Fields(TypedDict, total=False):
        """The fields of ``Situation`` a caller names as keywords (``Selection.select``,
        ``Selection.serves``, ``can_run``); the group's settings come from its
        ``Selection``."""

        numel: int
        block: int
        cma: bool
        first: bool
        even: bool
        addresses: int
        uniform: bool
        native: bool

    # A row's condition, and whether an algorithm can run (``RUNS``): read the situation.
    Condition = Callable[[Situation], bool]
    Row = tuple[str, Condition]  # (algorithm, condition)


def _always(s: Situation) -> bool:
    return True


def _modelled(table: str, algorithm: str) -> Condition:
    """A row's condition: ``algorithm`` is the one of ``table``'s ``_modelled`` rows that
    can run here (``RUNS``) and that the cost model predicts fastest."""
    def holds(s: Situation) -> bool:
        candidates = [name for name, cond in TABLES[table]
                      if getattr(cond, "modelled", False) and _runs(table, name)(s)]
        return net_cost.cheapest(collective(table), candidates, s.ranks, s.nbytes,
                                 s.link, s.crowd) == algorithm
    holds.modelled = True  # type: ignore[attr-defined]  # (marks the row: read by getattr)
    return holds


# ------------------------------------------------------------------------ the tables
# table -> rows (algorithm, condition), first match wins; the last row always holds.
TABLES: dict[str, tuple[Row, ...]] = {
    "all_reduce": (
        # every rank stages the message and reduces all slots itself: one step
        ("one_step", lambda s: s.nbytes <= s.slot_bytes and (
            s.nbytes <= s.small_bytes or s.nbytes * (s.ranks - 1) <= ONE_STEP_PEER_BYTES)),
        ("one_step", lambda s: s.ranks == 1),  # (alone: one step per slot-sized chunk)
        ("single_copy", lambda s: s.block >= SINGLE_COPY_BYTES),
        # two ranks: one step per chunk moves as many bytes as two steps, with half the
        # synchronisations
        ("one_step", lambda s: s.ranks == 2),
        ("two_step", _always),  # reduce-scatter + all-gather per slot-sized chunk
    ),
    "all_gather": (
        ("single_copy", lambda s: s.nbytes >= SINGLE_COPY_BYTES),
        ("slots", _always),
    ),
    "reduce_scatter": (
        ("single_copy", lambda s: s.nbytes >= SINGLE_COPY_BYTES),
        ("slots", _always),
    ),
    "all_to_all": (
        ("single_copy", lambda s: s.nbytes >= SINGLE_COPY_BYTES),
        ("slots", _always),
    ),
    "all_reduce/nodes": (
        ("hierarchical", lambda s: s.numel >= HIERARCHICAL_MIN_ELEMENTS * s.ranks),
        ("leader", _always),
    ),
    "all_gather/nodes": (
        ("columns", _always),
        ("leader", _always),
    ),
    "reduce_scatter/nodes": (
        ("columns", _always),
        ("leader", _always),
    ),
    "all_reduce/network": (
        # under mpiexec with the MPI transport: the cluster's MPI (net_mpi.py)
        ("mpi", _always),
        # two nodes: one exchange (direct) or, for large buffers, in halves (measured)
        ("halves", lambda s: s.ranks == 2 and s.nbytes >= HALVES_BYTES),
        ("direct", lambda s: s.ranks == 2),
        ("direct", _modelled("all_reduce/network", "direct")),
        ("recursive_doubling", _modelled("all_reduce/network", "recursive_doubling")),
        # (where ranks share cores: fewer messages in all, net_tree.py)
        ("tree", _modelled("all_reduce/network", "tree")),
        ("rabenseifner", _modelled("all_reduce/network", "rabenseifner")),
        ("ring", _modelled("all_reduce/network", "ring")),
        ("direct", _always),
    ),
    "all_gather/network": (
        ("mpi", _always),
        ("direct", _modelled("all_gather/network", "direct")),
        # (before bruck: as fast for a power of two, and with the peers of the other
        # log-depth algorithms, so no rails of its own)
        ("recursive_doubling", _modelled("all_gather/network", "recursive_doubling")),
        ("bruck", _modelled("all_gather/network", "bruck")),
        ("direct", _always),
    ),
    "reduce_scatter/network": (
        ("mpi", _always),
        ("direct", _modelled("reduce_scatter/network", "direct")),
        ("halving", _modelled("reduce_scatter/network", "halving")),
        ("direct", _always),
    ),
    "broadcast/network": (
        # only data that rides in the descriptor gather: beyond it the gather plus MPI's
        # Ibcast take 2-3x the binomial tree over MPI's messages (docs/design.md,
        # "Thresholds and why")
        ("mpi", lambda s: s.nbytes <= net_mpi.SLOT_DATA),
        ("binomial", _always),
    ),
    "reduce/network": (("binomial", _always),),
    "barrier/network": (
        ("mpi", _always),
        # (before dissemination: as fast for a power of two, and with the peers of the other
        # log-depth algorithms; among other counts dissemination has fewer rounds)
        ("recursive_doubling", _modelled("barrier/network", "recursive_doubling")),
        ("dissemination", _modelled("barrier/network", "dissemination")),
        # (where ranks share cores: fewer messages in all, net_tree.py)
        ("tree", _modelled("barrier/network", "tree")),
        ("dissemination", _always),
    ),
}

# ------------------------------------------------------------------------ the lanes
# Which path runs a call, where a lane could: not an algorithm (a lane runs the general
# path's own algorithm, without the set-up a repeated call does not need), so no
# NEURON_DIST_ALGO override reaches these; ``Selection.serves`` asks them. Rows as above.
LANES: dict[str, tuple[Row, ...]] = {
    # a group that spans nodes (neuron_dist/express_net.py): data that travels with its
    # call's descriptor, in one message per peer; beyond it the transfer, not the set-up the
    # lane saves, is the call's time
    "express/nodes": (
        ("express", lambda s: s.nbytes <= PIGGYBACK_BYTES),
        ("general", _always),
    ),
}

# algorithm -> can it run in this situation (absent: always). A row whose algorithm cannot
# run is skipped, overrides included.
RUNS: dict[str, Condition] = {
    # (the addresses travel in the call descriptor or, in a later phase, in a slot:
    # single_copy.py; the descriptor holds MAX_ADDRESSES)
    "single_copy": lambda s: s.cma and s.ranks > 1 and s.addresses <= MAX_ADDRESSES,
    "hierarchical": lambda s: s.even,
    "columns": lambda s: s.even,
    "ring": lambda s: s.ranks >= 2 and s.numel >= s.ranks,
    "halves": lambda s: s.ranks == 2,
    "bruck": lambda s: s.uniform,  # (blocks of one size: they travel packed)
    "recursive_doubling": lambda s: s.uniform,
    "halving": lambda s: s.uniform,
    "mpi": lambda s: s.native and s.uniform,
}

# table -> algorithm -> what else it needs in that table only
RUNS_IN: dict[str, dict[str, Condition]] = {
    # all_to_all decides after its first step (once every rank knows every size), and its
    # single copy reads the addresses every rank posted with that step: it can run only
    # in a call that began there (alltoall.py)
    "all_to_all": {"single_copy": lambda s: s.first},
}


def _runs(table: str, algorithm: str) -> Condition:
    """Can ``table``'s ``algorithm`` run in a situation (``RUNS`` and ``RUNS_IN``)?"""
    anywhere = RUNS.get(algorithm, _always)
    here = RUNS_IN.get(table, {}).get(algorithm)
    if here is None:
        return anywhere
    return lambda s: anywhere(s) and here(s)


def can_run(table: str, algorithm: str, ranks: int, **situation: Unpack[Fields]) -> bool:
    """Can ``table``'s ``algorithm`` run among ``ranks`` ranks (``RUNS``, ``RUNS_IN``; the
    other fields of ``Situation`` as keywords)? For an algorithm that must prepare in the call's first
    step what it needs if the table picks it later (all_to_all's single copy: the
    addresses)."""
    return _runs(table, algorithm)(Situation(0, ranks, **situation))


def collective(table: str) -> str:
    """The collective a table belongs to (``"all_reduce/network"`` -> ``"all_reduce"``)."""
    return table.split("/", 1)[0]


def algorithms(table: str) -> list[str]:
    """The algorithms of ``table``, in the order its rows first name them."""
    return list(dict.fromkeys(name for name, _ in TABLES[table]))


@dataclass(frozen=True)
class Override:
    """A row ``NEURON_DIST_ALGO`` puts in front of ``table``: ``algorithm`` for
    ``lo <= nbytes < hi``."""

    table: str
    algorithm: str
    lo: int = 0
    hi: int | None = None


def parse_overrides(text: str, parse_bytes: Callable[[str], int]) -> tuple[Override, ...]:
    """``NEURON_DIST_ALGO``'s text -> its override rows (see the module docstring).

    Raises
    ------
    ValueError
        An unknown collective or algorithm, or a bad size range (the message names it).
    """
    out: list[Override] = []
    for entry in (e.strip() for e in text.lower().split(",")):
        if not entry or entry == "auto":
            continue
        name, eq, algorithm = entry.rpartition("=")
        algorithm = algorithm.strip()
        if not eq:  # a bare algorithm: every table that has it
            tables = [t for t in TABLES if algorithm in algorithms(t)]
            if not tables:
                raise ValueError(f"NEURON_DIST_ALGO: no collective has an algorithm "
                                 f"{algorithm!r} ({_known()})")
            out += [Override(t, algorithm) for t in tables]
            continue
        coll, colon, span = (p.strip() for p in name.partition(":"))
        # a collective names all its tables, a table (as the error lists them) itself
        mine = [t for t in TABLES if collective(t) == coll or t == coll]
        if not mine:
            raise ValueError(f"NEURON_DIST_ALGO: unknown collective {coll!r} in {entry!r} "
                             f"({_known()})")
        tables = [t for t in mine if algorithm in algorithms(t)]
        if not tables:
            raise ValueError(f"NEURON_DIST_ALGO: {coll} has no algorithm {algorithm!r} in "
                             f"{entry!r} ({_known(mine)})")
        lo, hi = 0, None
        if colon:
            a, dash, b = (p.strip() for p in span.partition("-"))
            try:
                if not dash:
                    raise ValueError
                lo = parse_bytes(a) if a else 0
                hi = parse_bytes(b) if b else None
            except ValueError:
                raise ValueError(f"NEURON_DIST_ALGO: bad size range {span!r} in {entry!r} "
                                 f"(expected LO-HI, e.g. 0-64K or 4M-)") from None
            if lo < 0 or (hi is not None and hi <= lo):
                raise ValueError(f"NEURON_DIST_ALGO: empty size range {span!r} in {entry!r}")
        out += [Override(t, algorithm, lo, hi) for t in tables]
    return tuple(out)


def _known(tables: Iterable[str] | None = None) -> str:
    return "; ".join(f"{t}: {', '.join(algorithms(t))}" for t in (tables or TABLES))


class Selection:
    """A group's selection: the tables above with its overrides in front, and its settings
    (``small_bytes``: NEURON_DIST_SMALL_BYTES, ``slot_bytes``: the shared-memory slot,
    ``link``: the network's costs, NEURON_DIST_NET_COST, ``crowd``: ranks per core where
    the group's cores are most crowded, the same on every rank: topology.crowding)."""

    __slots__ = ("small_bytes", "slot_bytes", "link", "crowd", "_rows", "_memo")

    def __init__(self, small_bytes: int = 64 << 10, slot_bytes: int = 1 << 20,
                 overrides: tuple[Override, ...] = (),
                 link: net_cost.Link = net_cost.MEASURED, crowd: float = 0.0):
        self.small_bytes, self.slot_bytes, self.link = small_bytes, slot_bytes, link
        self.crowd = crowd
        # table -> rows (algorithm, condition, can it run)
        self._rows: dict[str, tuple[tuple[str, Condition, Condition], ...]] = {}
        for table, rows in {**TABLES, **LANES}.items():
            front = tuple((o.algorithm, _in_range(o.lo, o.hi)) for o in overrides
                          if o.table == table)
            self._rows[table] = tuple((algorithm, holds, _runs(table, algorithm))
                                      for algorithm, holds in front + rows)
        # (table, nbytes, ranks, situation) -> algorithm: the rows are pure functions of
        # these, and a dict lookup costs less than building a Situation and its rows' calls
        self._memo: dict[tuple[object, ...], str] = {}

    def select(self, table: str, nbytes: int, ranks: int, **situation: Unpack[Fields]) -> str:
        """The algorithm ``table`` picks for a call of ``nbytes`` among ``ranks`` ranks
        (the other fields of ``Situation`` as keywords)."""
        key = (table, nbytes, ranks, *situation.items())
        algorithm = self._memo.get(key)
        if algorithm is None:
            algorithm = self._select(table, nbytes, ranks, situation)
            if len(self._memo) >= _MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = algorithm
        return algorithm

    def serves(self, lane: str, nbytes: int, ranks: int, **situation: Unpack[Fields]) -> bool:
        """Does ``lane`` (a table of ``LANES``) serve a call of ``nbytes`` among ``ranks``
        ranks (the other fields of ``Situation`` as keywords)?"""
        return self.select(lane, nbytes, ranks, **situation) == "express"

    def _select(self, table: str, nbytes: int, ranks: int, situation: Fields) -> str:
        s = Situation(nbytes, ranks, small_bytes=self.small_bytes, slot_bytes=self.slot_bytes,
                      link=self.link, crowd=self.crowd, **situation)
        for algorithm, holds, runs in self._rows[table]:
            if holds(s) and runs(s):
                return algorithm
        raise AssertionError(f"selection table {table} has no row for {nbytes} B")  # pragma: no cover


_MEMO_ENTRIES = 4096  # choices a Selection remembers (then it starts again)


def _in_range(lo: int, hi: int | None) -> Condition:
    if hi is None:
        return lambda s: s.nbytes >= lo
    return lambda s: lo <= s.nbytes < hi


DEFAULT = Selection()  # the default settings, no overrides (the cost model's)
