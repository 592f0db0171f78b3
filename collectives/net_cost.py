"""What an algorithm between nodes costs: the model the selection tables choose by.

How it works
------------
Each algorithm's critical path is counted from its code (``shape``): the dependent rounds,
the messages the busiest rank sends and receives, the bytes through its link in one
direction, the bytes it reduces and the bytes it copies. The simulator
(bench/netsim.py) runs the algorithms' own code and its tests check these
counts against what the code did, for 2 to 1024 ranks. A ``Link`` prices them::

    time = rounds x lat + (sent + received) x alpha + bytes x beta + (reduced + copied) x gamma

``alpha`` is the CPU a rank spends on one message it sends or receives (Python, frames,
acknowledgements); ``lat`` is what a dependent round adds beyond that (the wire and the
wake-up of the waiting thread); ``beta`` is per byte through one link in one direction
(links are full duplex); ``gamma`` per byte of a binary reduction or a copy. A message
above ``PIGGYBACK_BYTES`` to a new peer of the call has its call descriptor sent apart
(net.py): one message more. A message above ``ACKED_BYTES`` is not eager: the receiver
answers it with an ACK frame of its own and the sender's call waits for that ack, so each
costs its receiver an ack sent and its sender an ack received (``acks``, alpha each) and a
wait more (``acked``, lat each)::

    time += acks x alpha + acked x lat

(without it the model took a recursive doubling of 392 KiB last round for cheaper than
every rank sending to every other at 8 ranks, where it was a fifth slower: docs/design.md,
"Thresholds and why").

Ranks that share cores (``crowd``: ranks per core where the group's cores are most
crowded, topology.crowding) take turns on them, and then a call takes at least the CPU
all its ranks spend, shared out over the cores::

    time = max(critical path, crowd x the average rank's time)

The average rank (``Shape.mean``) is priced by the same formula: its messages, the
rounds it waits in (each a wake-up, CPU on a crowded host), its bytes and its additions.
Where every rank does the same (recursive doubling, the ring, ...) that is the critical
path again, so only the crowd scales it; a tree's leaves do far less than its root, and
on crowded cores a tree (net_tree.py: 2 (P - 1) messages in all, where recursive doubling
sends P log2 P) is the cheaper all-reduce and barrier. With a core for every rank
(``crowd`` <= 1) the critical path alone decides.

The link's figures (``MEASURED``) come from the benchmark, measured offline over a veth
link between two network namespaces and fitted by the lab's cost model
(``python -m bench.costmodel``, results/costmodel.json,
``parameters_used``): alpha = its per-message cost (50.0 us), beta its per-byte cost
(0.485 ns/B, 2.06 GB/s), gamma the reduction speed on one node (0.039 ns/B, 25.6 GB/s).
Its ``lat`` (112.6 us) was calibrated on 2-node all_reduce points with one message sent
per phase and nothing charged for receiving; here a received message costs alpha too, so
lat = 112.6 - 50.0 = 62.6 us. ``NEURON_DIST_NET_COST`` overrides any of them for a
cluster whose links differ (e.g. ``alpha=20us,lat=10us,gbs=12``; parsed by ``parse``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

from .net import ACKED_BYTES, PIGGYBACK_BYTES


@dataclass(frozen=True)
class Link:
    """A link's costs, in seconds (see the module docstring)."""

    alpha: float
    lat: float
    beta: float
    gamma: float

    def describe(self) -> str:
        return (f"alpha={self.alpha * 1e6:g}us,lat={self.lat * 1e6:g}us,"
                f"gbs={1e-9 / self.beta:g},reduce_gbs={1e-9 / self.gamma:g}")


MEASURED = Link(alpha=50.0e-6, lat=62.6e-6, beta=0.4847e-9, gamma=0.03907e-9)


def parse(text: str, base: Link = MEASURED) -> Link:
    """``NEURON_DIST_NET_COST``'s text (``alpha=20us,lat=10us,gbs=12,reduce_gbs=30``; any
    subset, ``auto`` for none) -> the ``Link`` with those figures changed.

    Raises
    ------
    ValueError
        An unknown name or a value that is not a positive number (the message names it).
    """
    units = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    changes = {}
    for entry in (e.strip() for e in text.lower().split(",")):
        if not entry or entry == "auto":
            continue
        name, eq, value = (p.strip() for p in entry.partition("="))
        try:
            if not eq:
                raise ValueError
            if name in ("alpha", "lat"):
                unit = next((u for u in ("ms", "us", "ns", "s") if value.endswith(u)), "s")
                number = float(value[:len(value) - len(unit)] if value.endswith(unit)
                               else value) * units[unit]
                if number < 0 or not math.isfinite(number):
                    raise ValueError
                changes[name] = number
            elif name in ("gbs", "reduce_gbs"):
                gbs = float(value)
                if not gbs > 0 or not math.isfinite(gbs):
                    raise ValueError
                changes["beta" if name == "gbs" else "gamma"] = 1e-9 / gbs
            else:
                raise KeyError(name)
        except KeyError:
            raise ValueError(f"NEURON_DIST_NET_COST: unknown figure {name!r} in {entry!r} "
                             f"(alpha, lat, gbs, reduce_gbs)") from None
        except ValueError:
            raise ValueError(f"NEURON_DIST_NET_COST: bad value in {entry!r} (alpha and lat "
                             f"take a time such as 20us, gbs and reduce_gbs a positive "
                             f"number of GB/s)") from None
    return replace(base, **changes)


@dataclass(frozen=True)
class Shape:
    """The critical path of one call, and ``mean``: the average rank's counts where they
    differ from it (``rounds`` then counts the rounds that rank waits in; see the module
    docstring)."""

    rounds: float
    sent: float
    received: float
    bytes: float
    reduced: float = 0.0
    copied: float = 0.0
    acks: float = 0.0  # ACK frames of messages above ACKED_BYTES, sent or received
    # sends above ACKED_BYTES, each priced as a wait for its ack; the direct exchange counts
    # one (its acks come back while it waits for its receives), the others every such send
    acked: float = 0.0
    mean: Shape | None = None

    def time(self, link: Link, crowd: float = 0.0) -> float:
        """Predicted seconds on ``link`` with ``crowd`` ranks per core (0: unknown, taken as
        a core for every rank)."""
        path = self._priced(link)
        if crowd <= 1.0:
            return path
        return max(path, crowd * (self.mean or self)._priced(link))

    def _priced(self, link: Link) -> float:
        return ((self.rounds + self.acked) * link.lat
                + (self.sent + self.received + self.acks) * link.alpha
                + self.bytes * link.beta + (self.reduced + self.copied) * link.gamma)


def _big(nbytes: float) -> int:
    """1 if a first message of ``nbytes`` to a peer has its descriptor sent apart."""
    return int(nbytes > PIGGYBACK_BYTES)


def _ack(nbytes: float) -> int:
    """1 if a message of ``nbytes`` waits for its ack (an ACK frame of its own)."""
    return int(nbytes > ACKED_BYTES)


def _levels(ranks: int) -> tuple[int, int]:
    """(log2 of the fold's power of two, 1 if some ranks fold in else 0)."""
    pof2 = 1 << (ranks.bit_length() - 1)
    return pof2.bit_length() - 1, int(ranks != pof2)


def _depth(ranks: int) -> int:
    return (ranks - 1).bit_length()  # ceil(log2 ranks)


def _tree_depth(ranks: int) -> int:
    """Depth of a binomial tree of ``ranks``: the most bits set in a number below it."""
    m = ranks - 1
    return m.bit_length() - (1 if (m + 1) & m else 0)


def shape(collective: str, algorithm: str, ranks: int, nbytes: int) -> Shape:
    """The critical path of ``algorithm`` for ``collective`` among ``ranks`` ranks (one per
    node). ``nbytes``: the buffer (all_reduce, broadcast), each rank's block (all_gather,
    reduce_scatter); unused for barrier."""
    P, n = ranks, float(nbytes)
    if P < 2:
        return Shape(0, 0, 0, 0.0)
    price = SHAPES.get((collective, algorithm)) or _ANY_COLLECTIVE.get(algorithm)
    if price is None:
        raise ValueError(f"no cost model for {collective} {algorithm}")
    return price(collective, P, n)


def _direct(collective: str, P: int, n: float) -> Shape:
    """Every rank sends to and receives from every other at once."""
    per = P - 1
    msgs = per * (1 + _big(n))
    reduced = per * n if collective in _REDUCING else 0.0
    # (its sends wait for their acks together, in the one wait for every receive)
    return Shape(1, msgs, msgs, per * n, reduced, acks=2 * per * _ack(n), acked=_ack(n))


_REDUCING = frozenset({"all_reduce", "reduce_scatter"})  # collectives that add what comes


def _all_reduce_recursive_doubling(collective: str, P: int, n: float) -> Shape:
    k, f = _levels(P)
    msgs = (k + f) * (1 + _big(n))
    # (the fold-in overlaps the first exchange of the partner that did not fold)
    return Shape(k + f, msgs, msgs, (k + f) * n, (k + f) * n,
                 acks=2 * (k + f) * _ack(n), acked=(k + f) * _ack(n))


def _all_reduce_rabenseifner(collective: str, P: int, n: float) -> Shape:
    k, f = _levels(P)
    p = 1 << k
    desc = sum(_big(n / 2 ** (j + 1)) for j in range(k)) + f * _big(n)
    msgs = 2 * k + f + desc
    acked = 2 * sum(_ack(n / 2 ** (j + 1)) for j in range(k)) + f * _ack(n)
    return Shape(2 * k + 2 * f, msgs, msgs, 2 * n * (p - 1) / p + f * n,
                 n * (p - 1) / p + f * n, acks=2 * acked, acked=acked)


def _all_reduce_ring(collective: str, P: int, n: float) -> Shape:
    msgs = 2 * (P - 1) + _big(n / P)
    acked = 2 * (P - 1) * _ack(n / P)
    return Shape(2 * (P - 1), msgs, msgs, 2 * n * (P - 1) / P, n * (P - 1) / P,
                 acks=2 * acked, acked=acked)


def _all_reduce_halves(collective: str, P: int, n: float) -> Shape:
    msgs = 2 + _big(n / 2)
    return Shape(2, msgs, msgs, n, n / 2, acks=4 * _ack(n / 2), acked=2 * _ack(n / 2))


def _all_gather_recursive_doubling(collective: str, P: int, n: float) -> Shape:
    k, f = _levels(P)
    desc = sum(_big(n * 2 ** j) for j in range(k))
    acked = sum(_ack(n * 2 ** j) for j in range(k))
    return Shape(k + 2 * f, k + f + desc + f * _big(P * n), k + f + desc + f * _big(n),
                 (P - 1) * n + f * P * n, copied=2 * P * n,
                 acks=2 * acked + f * (_ack(n) + _ack(P * n)), acked=acked + f * _ack(P * n))


def _barrier_recursive_doubling(collective: str, P: int, n: float) -> Shape:
    k, f = _levels(P)
    return Shape(k + 2 * f, k + f, k + f, 0.0)


def _all_gather_bruck(collective: str, P: int, n: float) -> Shape:
    d = _depth(P)
    msgs = d + sum(_big(n * min(2 ** j, P - 2 ** j)) for j in range(d))
    acked = sum(_ack(n * min(2 ** j, P - 2 ** j)) for j in range(d))
    return Shape(d, msgs, msgs, (P - 1) * n, copied=2 * P * n, acks=2 * acked, acked=acked)


def _reduce_scatter_halving(collective: str, P: int, n: float) -> Shape:
    k, f = _levels(P)
    p = 1 << k
    total = P * n
    desc = sum(_big(total / 2 ** j) for j in range(1, k + 1))
    acked = sum(_ack(total / 2 ** j) for j in range(1, k + 1))
    return Shape(k + 2 * f, k + f + desc + f * _big(n), k + f + desc + f * _big(total),
                 total * (p - 1) / p + f * total, total * (p - 1) / p + f * total,
                 copied=total, acks=2 * acked + f * (_ack(total) + _ack(n)),
                 acked=acked + f * _ack(n))


def _tree_mean(P: int, n: float, reduced: float = 0.0) -> Shape:
    """The average rank of one pass over a tree of P ranks (P - 1 messages of ``n`` bytes,
    each received in a wait of its own)."""
    f = (P - 1) / P
    msgs = f * (1 + _big(n))
    return Shape(f, msgs, msgs, f * n, f * reduced, acks=2 * f * _ack(n), acked=f * _ack(n))


def _broadcast_binomial(collective: str, P: int, n: float) -> Shape:
    """The root sends to its ceil(log2 P) children."""
    d = _depth(P)
    return Shape(_tree_depth(P), d * (1 + _big(n)), 1 + _big(n), d * n, acks=d * _ack(n),
                 acked=d * _ack(n), mean=_tree_mean(P, n))


def _reduce_binomial(collective: str, P: int, n: float) -> Shape:
    d = _depth(P)
    return Shape(_tree_depth(P), 1 + _big(n), d * (1 + _big(n)), d * n, d * n,
                 acks=d * _ack(n), acked=_ack(n), mean=_tree_mean(P, n, n))


def _all_reduce_tree(collective: str, P: int, n: float) -> Shape:
    """A binomial reduce to the first rank, then a binomial broadcast from it: the root
    receives and sends ceil(log2 P) whole buffers, the average rank one of each."""
    d, depth = _depth(P), _tree_depth(P)
    msgs = d * (1 + _big(n))
    once = _tree_mean(P, n, n)
    mean = Shape(2 * once.rounds, 2 * once.sent, 2 * once.received, 2 * once.bytes,
                 once.reduced, acks=2 * once.acks, acked=2 * once.acked)
    return Shape(2 * depth, msgs, msgs, 2 * d * n, d * n, acks=2 * d * _ack(n),
                 acked=d * _ack(n), mean=mean)


def _barrier_tree(collective: str, P: int, n: float) -> Shape:
    """Empty messages up a binomial tree and back down: a rank waits once for all its
    children and once for its parent."""
    d, depth = _depth(P), _tree_depth(P)
    f = (P - 1) / P
    inner = (P - (P + 1) // 2) / P  # (the ranks with children: half of them, rounded down)
    return Shape(2 * depth, d, d, 0.0, mean=Shape(f + inner, 2 * f, 2 * f, 0.0))


def _barrier_dissemination(collective: str, P: int, n: float) -> Shape:
    d = _depth(P)
    return Shape(d, d, d, 0.0)


# (collective, algorithm) -> its critical path ``price(collective, ranks, nbytes)``: adding
# an algorithm to a ``_modelled`` row of selection.py means an entry here
SHAPES = {
    ("all_reduce", "recursive_doubling"): _all_reduce_recursive_doubling,
    ("all_reduce", "rabenseifner"): _all_reduce_rabenseifner,
    ("all_reduce", "ring"): _all_reduce_ring,
    ("all_reduce", "halves"): _all_reduce_halves,
    ("all_gather", "recursive_doubling"): _all_gather_recursive_doubling,
    ("barrier", "recursive_doubling"): _barrier_recursive_doubling,
    ("all_gather", "bruck"): _all_gather_bruck,
    ("reduce_scatter", "halving"): _reduce_scatter_halving,
    ("broadcast", "binomial"): _broadcast_binomial,
    ("reduce", "binomial"): _reduce_binomial,
    ("barrier", "dissemination"): _barrier_dissemination,
    ("all_reduce", "tree"): _all_reduce_tree,
    ("barrier", "tree"): _barrier_tree,
}
# algorithm -> its price in any collective
_ANY_COLLECTIVE = {"direct": _direct}


def cheapest(collective: str, candidates: Iterable[str], ranks: int, nbytes: int,
             link: Link, crowd: float = 0.0) -> str:
    """The candidate with the least predicted time with ``crowd`` ranks per core (the first
    of equals)."""
    best, best_t = None, math.inf
    for name in candidates:
        t = shape(collective, name, ranks, nbytes).time(link, crowd)
        if t < best_t:
            best, best_t = name, t
    return best  # type: ignore[return-value]  # (there are candidates)
