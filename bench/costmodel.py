"""All-reduce cost model: ``python -m bench.costmodel [--json OUT] [--results-dir results]``.

An alpha-beta(-gamma) model of every all_reduce algorithm neuron has (and two it has not),
fitted by least squares to the committed measurements, checked against them, and used to
predict all_reduce time from 8 to 1024 ranks across nodes.

Inputs (in ``--results-dir``)
    bench-n2.json, bench-n4.json  single node, 2 and 4 ranks (``python -m bench``):
                                  neuron / gloo / MPICH per op and size, median and min time.
    internode-veth.json           2 virtual nodes x 1 rank over a veth link
                                  (``python -m bench.internode``): p2p (one
                                  direction, windowed) and all_reduce for neuron 1 rail,
                                  neuron 4 rails and gloo.
    link-veth.json (optional)     raw TCP streams over a veth pair (``bench.link``): shown
                                  as the link's own ceiling.

Parameters (all fitted by relative least squares, i.e. minimising sum((pred/meas - 1)^2),
constrained >= 0; a parameter that would go negative is pinned at 0 and reported so)
    intra-node, per bench file (world L):
        alpha_call[op]  fixed cost of one collective call (c10d dispatch, Python, descriptor)
        alpha_step      one step-channel synchronisation
        beta            per byte copied by one rank (stage into / copy out of shared memory)
        gamma           per byte of one binary reduction (reduce of k inputs of m bytes =
                        (k-1) m gamma), i.e. the CPU's reduce speed
        from neuron's all_reduce, reduce_scatter and all_gather points; the steps and bytes
        each rank moves are counted from the code (collectives/allreduce.py,
        reduce_scatter.py, allgather.py: one-step all_reduce up to 64 KiB, two-step
        reduce-scatter + all-gather per 1 MiB slot chunk above).
    inter-node, per transport (neuron 1 rail, neuron 4 rails, gloo):
        alpha_net       per message (the p2p benchmark keeps a window of messages in flight,
                        so this is the per-message cost of the sender/receiver software,
                        not the wire latency)
        beta_net        per byte through one link in one direction (1 / GB/s)
        from the p2p points, time per message = alpha_net + n beta_net;
        lat             latency of one dependent network phase (a ring step, a direct
                        exchange): the p2p window hides it, so it is calibrated on the
                        inter-node all_reduce points <= 32 KiB (least squares, everything else
                        fixed); the larger all_reduce points stay held out.

Models (n = bytes per rank, N nodes, L ranks per node, P = N L; x_L = n / L)
    single-node   neuron on one node: one step (n <= 64 KiB) or two steps per 1 MiB chunk.
    hier+direct   neuron, nodes of equal size (collectives/allreduce_net.py): local
                  reduce-scatter -> each local rank exchanges its slice x_L *directly* with
                  the same local rank of the N-1 other nodes (N-1 sends and N-1 receives of
                  x_L, plus a call descriptor per peer; reduce N slices) -> local all-gather.
                  Node link per direction: L ranks x (N-1) x x_L = (N-1) n.
                  A rank alone on its node (L = 1) exchanges the whole buffer the same way.
    hier+ring     neuron, the same with a *ring* among the N nodes (each local rank runs a
                  ring over its slice): 2(N-1) dependent steps of x_L / N, node link per
                  direction 2(N-1)/N n instead of (N-1) n. Between two nodes this is the
                  exchange in halves (two dependent phases of x_L / 2, half the additions).
    leader        neuron, any nodes: local all-reduce -> the node leader all-reduces the
                  full buffer with the N-1 other leaders (directly, or in a ring / halves as
                  below) -> local broadcast. Node link per direction: (N-1) n, one rank.
    flat ring     reference, not implemented: the textbook ring over all P ranks on the
                  network, 2(P-1) alpha_net + 2(P-1)/P n beta_net + (P-1)/P n gamma. Ranks
                  in node order, so one ring edge leaves each node: the node link carries
                  n/P per step, like every rank.
    neuron        what allreduce_net.all_reduce runs (``neuron_choice``), asked of the code's
                  own selection tables (collectives/selection.py: ``all_reduce/nodes``,
                  ``all_reduce/network``; by default leader below 64 L elements, else
                  hierarchical; among 3+ nodes the exchange collectives/net_cost.py prices cheapest (3+
                  nodes), halves from HALVES_BYTES (2 nodes), else direct). The local
                  phases follow the ``all_reduce`` table the same way.
    A network phase costs  lat + (messages the rank sends) x alpha_net
                         + max(bytes of the rank x beta_rank, bytes of its node x beta_link)
    (one direction; a direct exchange is one phase with 2(N-1) messages: a call descriptor
    and the payload per peer, or N-1 when the payload carries the descriptor, up to
    collectives.net.PIGGYBACK_BYTES; a ring step is one phase with one message). beta_rank = beta_link = the fitted beta_net by default (one rank drives the
    veth link as fast as it goes); ``--link-gbs`` makes the node link faster than one rank.
    Reductions after the network cost gamma per byte, like the local ones.

Assumptions
    * Links are full duplex: a rank that sends and receives B bytes at once needs B beta, not
      2B beta (the check also shows the half-duplex variant: on this 2-core box both
      directions of a veth link are copied by the same two cores).
    * No congestion beyond the node link: the switch / fabric is non-blocking; ring and
      direct-exchange traffic only meet at the node links.
    * One node link is shared by the L ranks of a node: the bytes all of them send at once go
      through it at 1 / beta_link; each rank alone is also limited to 1 / beta_rank.
    * Per-message software overheads (Python, torch dispatch, frames, acknowledgements) are
      inside alpha_net and alpha_call / alpha_step; messages a rank sends are paid one after
      the other (its sender runs in its own thread); a ring step waits for the previous one.
    * Latency is one term per dependent network phase (lat), calibrated on the 2 nodes x 1
      rank all_reduce points up to 32 KiB; it decides the ring-vs-direct question for small
      messages (a ring pays it 2(N-1) times, a direct exchange once), so the output also
      shows lat = 0.
    * Reduce and copy speeds (gamma, beta) are this 2-core box's (torch's vectorised kernels,
      float32); ranks of a node do not slow each other down in memory, and every rank has a
      core of its own (L = 4 on 2 cores is oversubscribed: its own fit is shown, and the
      L = 2 fit scaled by L / cores is checked against it, but predictions use the L = 2 fit).
    * alpha_step does not grow with L (each rank waits for the slowest peer: true only with
      little jitter); the shared-memory slot is 1 MiB and the one-step limit 64 KiB (the
      defaults); float32 elements.
    * The local phases are counted as the slot algorithms run them at every size: the
      single-copy (cross-memory attach) algorithms the code uses from 256 KiB per rank
      (collectives/single_copy.py) are not modelled, so large local phases are fitted, not
      counted from the code.
    * Steps are not overlapped with copies except where the code double-buffers (the model
      adds every step's cost); network phases do not overlap local phases.
    * Connection counts are not modelled: direct exchange opens rails to N-1 peers (4 TCP
      connections per peer and rank with 4 rails; no thread per rail); its receive
      buffers hold (N-1) x n bytes per node ('!' in the tables where that passes 64 GiB).

Output: fitted parameters with their fit error; the check (predicted vs measured for every
point fitted and for held-out points: broadcast, 4 ranks on 2 cores from the 2-rank fit,
gloo's ring over loopback and over veth, the inter-node all_reduce), with a summary per
group and plain statements of where the model is poor; the prediction tables (P = 8..1024,
L = 8 and 2), who wins where, what-ifs (a faster node link, lat = 0) and the size from which
a ring among nodes beats the direct exchange, next to the size from which the code runs
it; these assumptions. ``--json OUT`` writes all
of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from neuron_dist.collectives.context import ALIGN_BYTES
from neuron_dist.collectives import net_cost
from neuron_dist.collectives.selection import (DEFAULT, HALVES_BYTES, HIERARCHICAL_MIN_ELEMENTS,
                                     Selection)
from neuron_dist.collectives.net import PIGGYBACK_BYTES
from neuron_dist.config import Settings
from .sweep import human_size, parse_size

# The settings the measurements ran with: the defaults (neuron_dist/config.py).
_DEFAULTS = Settings.from_env({})
SLOT_BYTES = _DEFAULTS.slot_bytes        # NEURON_DIST_SHM_SLOT_BYTES
SMALL_BYTES = _DEFAULTS.small_bytes      # NEURON_DIST_SMALL_BYTES
# Which algorithm the code runs is asked of its selection tables (collectives/selection.py),
# never restated here; tests/tools/test_costmodel.py runs the code's own all_reduce on a
# grid of sizes and layouts and checks that ``neuron_choice`` names what it ran.
ELEM = 4                      # float32, as benchmarked
MEM_FLAG_BYTES = 64 << 30     # '!' when direct-exchange receive buffers pass this per node

INTRA_OPS = ("all_reduce", "reduce_scatter", "all_gather")
NET_BACKENDS = ("neuron-1rail", "neuron-4rails", "gloo")

ALGOS = ("hier+direct", "hier+ring", "hier+log-depth", "leader", "flat ring")
IMPLEMENTED = ("hier+direct", "hier+ring", "hier+log-depth", "leader")


# ============================================================================ data

def link_reference(path: str) -> dict | None:
    """The raw-TCP numbers of ``bench.link --where veth`` (None if the file is missing).

    Returns ``{"path", "streams": {S: GB/s}, "best": {...} | None, "command", "time"}``;
    "streams" is the best TCP variant per stream count S.
    """
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        return {"path": path, "error": f"{type(exc).__name__}: {exc}"}
    summ = doc.get("summary") or {}
    streams = {}
    for s, cell in (summ.get("tcp_best") or {}).items():
        try:
            streams[int(s)] = {"gbps": float(cell["gbps"]), "variant": cell.get("variant")}
        except (KeyError, TypeError, ValueError):
            continue
    if not streams:  # older or different layout: take the tcp rows themselves
        for r in doc.get("results") or []:
            if r.get("mode") == "tcp" and "gbps" in r and "streams" in r:
                cur = streams.get(int(r["streams"]))
                if cur is None or r["gbps"] > cur["gbps"]:
                    streams[int(r["streams"])] = {"gbps": float(r["gbps"]),
                                                  "variant": r.get("variant")}
    meta = doc.get("meta") or {}
    return {"path": path, "streams": dict(sorted(streams.items())),
            "best": summ.get("baseline"), "command": meta.get("command"),
            "time": meta.get("time"), "where": meta.get("where")}


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def bench_points(doc: dict, backend: str, ops, stat: str = "time_us") -> list[dict]:
    """Rows of a ``bench-n*.json`` for one backend and some ops: op, world, bytes, seconds."""
    out = []
    for r in doc.get("results", []):
        if r.get("status") != "ok" or r.get("backend") != backend or r.get("op") not in ops:
            continue
        out.append({"op": r["op"], "world": int(r["world"]), "bytes": int(r["bytes"]),
                    "t": float(r[stat]) * 1e-6})
    return sorted(out, key=lambda p: (p["op"], p["bytes"]))


def internode_points(doc: dict, op: str, backend: str, stat: str = "time_us") -> list[dict]:
    out = []
    for r in doc.get("results", []):
        if r.get("kind", "row") != "row" or r.get("status") != "ok":
            continue
        if r.get("op") == op and r.get("backend") == backend:
            out.append({"op": op, "bytes": int(r["bytes"]), "t": float(r[stat]) * 1e-6,
                        "window": r.get("window"), "world": int(r.get("world", 2))})
    return sorted(out, key=lambda p: p["bytes"])


# ============================================================================ fitting

@dataclass
class Fit:
    """A relative least-squares fit: values, 1-sigma errors, and how well it fits."""

    names: list
    values: list
    stderr: list
    pinned: list
    rel: list           # pred / meas - 1 for every point, in input order
    n_points: int
    cov: list = field(default_factory=list)   # covariance of the values (0 where pinned)

    @property
    def rms(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.rel)))) if self.rel else float("nan")

    @property
    def max_abs(self) -> float:
        return float(np.max(np.abs(self.rel))) if self.rel else float("nan")

    def __getitem__(self, name: str) -> float:
        return self.values[self.names.index(name)]

    def stderr_of_sum(self, *names: str) -> float:
        """1-sigma error of the sum of some parameters (correlations included)."""
        idx = [self.names.index(n) for n in names]
        c = np.asarray(self.cov, dtype=float)
        return float(np.sqrt(max(0.0, c[np.ix_(idx, idx)].sum()))) if c.size else float("nan")

    def as_dict(self) -> dict:
        return {"params": {n: {"value": v, "stderr": e, "pinned_at_zero": p}
                           for n, v, e, p in zip(self.names, self.values, self.stderr, self.pinned)},
                "points": self.n_points, "rms_rel_err": self.rms, "max_abs_rel_err": self.max_abs}


def fit_relative(X, y, names) -> Fit:
    """Least squares of ``X @ p ~ y`` in relative terms (each row divided by y), p >= 0.

    A parameter whose unconstrained value is negative is pinned at 0 and the rest refitted
    (repeatedly, most negative first). Standard errors come from the residual variance.
    """
    X = np.asarray(X, dtype=float)
    y = np.asarray(y, dtype=float)
    if X.ndim != 2 or X.shape[0] != y.shape[0] or X.shape[1] != len(names):
        raise ValueError("X must be points x parameters, y one value per point")
    if np.any(y <= 0):
        raise ValueError("measured values must be positive")
    A = X / y[:, None]
    ones = np.ones(len(y))
    active = [j for j in range(X.shape[1]) if np.any(A[:, j] != 0)]
    while True:
        sol = np.linalg.lstsq(A[:, active], ones, rcond=None)[0] if active else np.zeros(0)
        neg = [(v, j) for v, j in zip(sol, active) if v < 0]
        if not neg:
            break
        active.remove(min(neg)[1])
    p = np.zeros(X.shape[1])
    p[active] = sol
    rel = (X @ p) / y - 1.0
    err = np.full(X.shape[1], float("nan"))
    full = np.full((X.shape[1], X.shape[1]), float("nan"))
    dof = len(y) - len(active)
    if active and dof > 0:
        s2 = float(np.sum(rel ** 2)) / dof
        Aa = A[:, active]
        try:
            cov = s2 * np.linalg.inv(Aa.T @ Aa)
            err[active] = np.sqrt(np.clip(np.diag(cov), 0, None))
            full = np.zeros_like(full)
            full[np.ix_(active, active)] = cov
        except np.linalg.LinAlgError:
            pass
    pinned = [j not in active for j in range(X.shape[1])]
    return Fit(list(names), [float(v) for v in p], [float(e) for e in err], pinned,
               [float(r) for r in rel], len(y), full.tolist())


def fit_alpha_beta(sizes, times) -> Fit:
    """time = alpha + n beta (seconds, bytes), relative least squares."""
    sizes = np.asarray(sizes, dtype=float)
    return fit_relative(np.c_[np.ones_like(sizes), sizes], times, ["alpha", "beta"])


# ============================================================================ parameters

@dataclass(frozen=True)
class Intra:
    """Shared-memory costs of one rank (seconds; per byte where it says so)."""

    a_call: float                 # alpha_call of all_reduce: once per collective call
    a_step: float                 # alpha_step
    b: float                      # beta: per byte copied
    g: float                      # gamma: per byte reduced (one binary op)
    calls: dict = field(default_factory=dict)   # alpha_call per op (for the check)

    def scaled(self, k: float) -> "Intra":
        return Intra(self.a_call * k, self.a_step * k, self.b * k, self.g * k,
                     {o: v * k for o, v in self.calls.items()})


@dataclass(frozen=True)
class Net:
    """Network costs (seconds, per byte in one direction)."""

    alpha: float                  # per message sent (software cost, paid one after another)
    beta_rank: float              # what one rank's transport does
    beta_link: float              # one node's link, shared by its L ranks
    lat: float = 0.0              # latency of one dependent network phase (ring step, exchange)
    duplex: bool = True           # False: sending and receiving share one budget


@dataclass(frozen=True)
class Machine:
    intra: Intra
    net: Net
    slot: int = SLOT_BYTES
    small: int = SMALL_BYTES
    # data up to this size carries the call descriptor itself (collectives.net.PIGGYBACK_BYTES)
    piggyback: int = PIGGYBACK_BYTES


@dataclass(frozen=True)
class Work:
    """What one rank does in a local phase: channel steps, bytes copied, bytes reduced."""

    steps: float = 0
    copied: float = 0
    reduced: float = 0

    def __add__(self, o: "Work") -> "Work":
        return Work(self.steps + o.steps, self.copied + o.copied, self.reduced + o.reduced)

    def time(self, c: Intra) -> float:
        return self.steps * c.a_step + self.copied * c.b + self.reduced * c.g


def _ceil(a: float, b: float) -> int:
    return max(1, math.ceil(a / b)) if b > 0 else 1


def slice_bytes(n: int, parts: int, align: int = ALIGN_BYTES) -> int:
    """Largest piece of ``collectives.context.partition`` (bytes; starts aligned)."""
    el = -(-(n // ELEM) // parts)
    a = max(1, align // ELEM)
    return -(-el // a) * a * ELEM


def reduce_work(k: int, m: float) -> Work:
    """``reduce_into`` of k inputs of m bytes: a copy if k == 1, else k-1 binary ops."""
    return Work(copied=m) if k == 1 else Work(reduced=(k - 1) * m)


# Local phases, counted from collectives/*.py (one rank; the largest slice where uneven).

def _selection(slot: int, small: int) -> Selection:
    if slot == SLOT_BYTES and small == SMALL_BYTES:
        return DEFAULT
    return Selection(small, slot)


def allreduce_work(n: int, L: int, slot: int = SLOT_BYTES, small: int = SMALL_BYTES) -> Work:
    """What the ``all_reduce`` table picks (single copy is not modelled: as without CMA)."""
    algo = _selection(slot, small).select("all_reduce", n, L, numel=n // ELEM,
                                          block=-(-(n // ELEM) // L) * ELEM, cma=False)
    if algo == "one_step":   # stage, step, reduce L slots: once, or per slot-sized chunk
        return Work(_ceil(n, slot), n) + reduce_work(L, n)
    k = _ceil(n, slot)                              # _two_step, per chunk c:
    # stage the L-1 slices peers reduce, step, reduce mine from L slots, step, copy all out
    return Work(2 * k, n * (L - 1) / L + n) + reduce_work(L, n / L)


def reduce_scatter_work(n: int, L: int, slot: int = SLOT_BYTES) -> Work:
    """n = the whole input of a rank (L blocks of n / L); output n / L."""
    per = (slot // L) // ALIGN_BYTES * ALIGN_BYTES
    block = slice_bytes(n, L) if L > 1 else n
    return Work(_ceil(block, per), n) + reduce_work(L, block)


def all_gather_work(n: int, L: int, slot: int = SLOT_BYTES) -> Work:
    """n = the whole output of a rank (L pieces of n / L)."""
    piece = slice_bytes(n, L) if L > 1 else n
    return Work(_ceil(piece, slot), piece + n)


def broadcast_work(n: int, L: int, slot: int = SLOT_BYTES) -> Work:
    """The root stages n, the others copy n out (double buffered: counted once)."""
    return Work(_ceil(n, slot), n)


# ============================================================================ models

def net_phase(x: float, peers: int, sharers: int, m: Machine, msgs: int | None = None) -> float:
    """One rank sends x bytes to each of ``peers`` and receives as much from each, while
    ``sharers`` ranks of its node (itself included) do the same through the node link."""
    if peers <= 0:
        return 0.0
    net = m.net
    msgs = peers if msgs is None else msgs
    t_bytes = max(peers * x * net.beta_rank, sharers * peers * x * net.beta_link)
    if not net.duplex:
        t_bytes *= 2
    return net.lat + msgs * net.alpha + t_bytes


_SELECTIONS: dict = {}  # product_link(m) -> its Selection (Selection keeps a memo)


def _selection_for(m: Machine) -> Selection:
    link = product_link(m)
    selection = _SELECTIONS.get(link)
    if selection is None:
        selection = _SELECTIONS[link] = Selection(link=link)
    return selection


def exchange_choice(x: float, N: int, selection: Selection = DEFAULT) -> str:
    """What ``allreduce_net._exchange_reduce`` runs for x bytes (float32) among N ranks: the
    ``all_reduce/network`` table's choice (ring, halves: a two-rank ring, or direct)."""
    x = int(x)
    return selection.select("all_reduce/network", x, N, numel=x // ELEM)


def product_link(m: Machine) -> net_cost.Link:
    """``m``'s network as collectives/net_cost.py's ``Link`` (what NEURON_DIST_NET_COST
    would say for it): the same alpha; the product also charges a received message alpha,
    so its ``lat`` is this model's less one alpha."""
    return net_cost.Link(alpha=m.net.alpha, lat=max(m.net.lat - m.net.alpha, 0.0),
                         beta=m.net.beta_link, gamma=m.intra.g)


def exchange_reduce(x: float, N: int, sharers: int, m: Machine) -> float:
    """``allreduce_net._exchange_reduce`` as the code runs it on ``m`` (``exchange_choice``,
    with the group's link set to ``m``'s network: ``product_link``)."""
    algo = exchange_choice(x, N, _selection_for(m))
    if algo == "direct":
        return direct_exchange(x, N, sharers, m)
    if algo in LOG_DEPTH:
        return log_depth(x, N, sharers, m, algo)
    return ring_among(x, N, sharers, m)


LOG_DEPTH = ("recursive_doubling", "rabenseifner")  # the log-depth all_reduce exchanges


def log_depth(x: float, N: int, sharers: int, m: Machine, algo: str | None = None) -> float:
    """A log-depth exchange among N ranks (``algo``, or the cheaper of ``LOG_DEPTH`` on
    ``m``: what the product's cost model, collectives/net_cost.py, chooses on a link with
    ``m``'s costs): its critical path counted by ``net_cost.shape``, priced here as every
    network phase is (``lat`` per dependent round, ``alpha`` per message sent, bytes
    through the rank and its node link, gamma per byte reduced), plus what a message above
    the transport's eager size adds: the ACK frame its receiver sends (alpha) and its
    sender's wait for it (lat)."""
    if N <= 1:
        return 0.0
    if algo is None:
        return min(log_depth(x, N, sharers, m, a) for a in LOG_DEPTH)
    sh = net_cost.shape("all_reduce", algo, N, int(x))
    net = m.net
    t_bytes = max(sh.bytes * net.beta_rank, sharers * sh.bytes * net.beta_link)
    if not net.duplex:
        t_bytes *= 2
    return ((sh.rounds + sh.acked) * net.lat + (sh.sent + sh.acks - sh.acked) * net.alpha
            + t_bytes + sh.reduced * m.intra.g)


def direct_exchange(x: float, N: int, sharers: int, m: Machine) -> float:
    """The direct exchange of ``allreduce_net._exchange_reduce`` among N ranks: descriptor +
    payload to each of N-1 peers (one message if the payload is small enough to carry the
    descriptor), then reduce N buffers of x (in place for N = 2, else into a scratch and
    copied back)."""
    if N <= 1:
        return 0.0
    per_peer = 1 if x <= m.piggyback else 2
    t = net_phase(x, N - 1, sharers, m, msgs=per_peer * (N - 1))
    t += reduce_work(N, x).time(m.intra)
    if N > 2:
        t += x * m.intra.b
    return t


def ring_among(x: float, N: int, sharers: int, m: Machine, descriptors: bool = True) -> float:
    """Ring all-reduce of x bytes among N ranks (one per node), ``sharers`` such rings
    running at once through each node link: 2(N-1) dependent steps of x / N
    (``allreduce_net._ring_all_reduce``; for N = 2 the same cost as ``allreduce_net._halves``)."""
    if N <= 1:
        return 0.0
    chunk = x / N
    step = net_phase(chunk, 1, sharers, m)
    t = 2 * (N - 1) * step + (N - 1) * chunk * m.intra.g
    if descriptors and chunk > m.piggyback:
        t += m.net.alpha               # the call descriptor to the next rank of the ring
    return t


def t_single(n: int, L: int, m: Machine) -> float:
    """neuron on one node (collectives/allreduce.py)."""
    if L <= 1:
        return m.intra.a_call + Work(1).time(m.intra)
    return m.intra.a_call + allreduce_work(n, L, m.slot, m.small).time(m.intra)


def _local_rs_ag(n: int, L: int, m: Machine) -> tuple[float, int]:
    s = slice_bytes(n, L)
    rs = reduce_scatter_work(n, L, m.slot)
    ag = all_gather_work(n, L, m.slot) + Work(copied=s)    # + the copy of my slice
    return (rs + ag).time(m.intra), s


def _hierarchical(n: int, N: int, L: int, m: Machine, exchange) -> float:
    """allreduce_net._hierarchical with ``exchange`` among the nodes; a rank alone on its node
    (L = 1) goes straight to the network with the whole buffer, in place."""
    if N <= 1:
        return t_single(n, L, m)
    if L == 1:
        return m.intra.a_call + Work(1).time(m.intra) + exchange(n, N, 1, m)
    local, s = _local_rs_ag(n, L, m)
    return m.intra.a_call + local + exchange(s, N, L, m)


def t_alone(n: int, N: int, m: Machine) -> float:
    """A rank alone on its node, as the code runs it (direct, halves or ring)."""
    return _hierarchical(n, N, 1, m, exchange_reduce)


def t_hier_direct(n: int, N: int, L: int, m: Machine) -> float:
    """Hierarchical, always exchanging directly among the nodes (the code does below
    where the tables pick it, or HALVES_BYTES between two nodes; whatever n: the code itself
    switches to leader below 64 L elements, see ``neuron_choice``)."""
    return _hierarchical(n, N, L, m, direct_exchange)


def t_hier_log_depth(n: int, N: int, L: int, m: Machine) -> float:
    """Hierarchical, always running a log-depth exchange among the nodes
    (recursive doubling or Rabenseifner: ``log_depth``)."""
    return _hierarchical(n, N, L, m, log_depth)


def t_hier_ring(n: int, N: int, L: int, m: Machine) -> float:
    """Hierarchical, always running a ring among the nodes (the code does where the tables pick it
    per slice among 3+ nodes, from HALVES_BYTES between two)."""
    return _hierarchical(n, N, L, m, ring_among)


def t_leader(n: int, N: int, L: int, m: Machine) -> float:
    if N <= 1:
        return t_single(n, L, m)
    if L == 1:
        return t_alone(n, N, m)
    local = allreduce_work(n, L, m.slot, m.small) + broadcast_work(n, L, m.slot)
    return m.intra.a_call + local.time(m.intra) + exchange_reduce(n, N, 1, m)


def t_flat_ring(n: int, N: int, L: int, m: Machine) -> float:
    """Textbook ring over all P = N L ranks, every edge on the network:
    2(P-1) alpha + 2(P-1)/P n beta + (P-1)/P n gamma (beta = the slower of a rank and its
    node link's share; in node order one ring edge leaves each node)."""
    P = N * L
    if P <= 1:
        return 0.0
    return ring_among(n, P, 1, m, descriptors=False)


MODELS = {"hier+direct": t_hier_direct, "hier+ring": t_hier_ring,
          "hier+log-depth": t_hier_log_depth, "leader": t_leader, "flat ring": t_flat_ring}


def neuron_choice(n: int, N: int, L: int, selection: Selection = DEFAULT) -> str:
    """What allreduce_net.all_reduce runs for n bytes (float32) on N equal nodes of L ranks
    with ``selection`` (default: NEURON_DIST_ALGO=auto), named as in ``MODELS`` (or
    "single-node"): the ``all_reduce/nodes`` table's layout; a rank alone on its node
    exchanges the whole buffer, else (hierarchical) rank 0's slice, with the
    ``all_reduce/network`` table's exchange (halves between two nodes cost as a two-rank
    ring)."""
    if N <= 1:
        return "single-node"
    layout = selection.select("all_reduce/nodes", n, L, numel=n // ELEM, even=True)
    if L > 1 and layout == "leader":
        return "leader"
    x = n if L == 1 else slice_bytes(n, L)
    return exchange_model(exchange_choice(x, N, selection))


def exchange_model(algo: str) -> str:
    """The ``MODELS`` name of a hierarchical all-reduce whose exchange is ``algo``."""
    if algo == "direct":
        return "hier+direct"
    return "hier+log-depth" if algo in LOG_DEPTH else "hier+ring"


def code_ring_from(N: int, L: int, selection: Selection = DEFAULT, hi: int = 1 << 40) -> int | None:
    """Smallest size (bytes, float32) from which ``neuron_choice`` runs a ring (or halves)
    among the N nodes, found by asking the tables (None: not up to ``hi``, or the choice
    does not grow leader -> direct -> ring with the size, as among 3 nodes)."""
    lo_el, hi_el = 1, hi // ELEM
    if neuron_choice(hi_el * ELEM, N, L, selection) != "hier+ring":
        return None
    while lo_el < hi_el:  # the choice grows leader -> direct -> ring with the size
        mid = (lo_el + hi_el) // 2
        if neuron_choice(mid * ELEM, N, L, selection) == "hier+ring":
            hi_el = mid
        else:
            lo_el = mid + 1
    return lo_el * ELEM


def predict(n: int, N: int, L: int, m: Machine) -> dict:
    """Every algorithm's time (s) for n bytes on N nodes x L ranks, and who wins."""
    times = {a: f(n, N, L, m) for a, f in MODELS.items()}
    choice = neuron_choice(n, N, L)
    neuron = t_single(n, L, m) if choice == "single-node" else times[choice]
    best = min(times, key=times.get)
    return {"n": n, "N": N, "L": L, "P": N * L, "times": times, "neuron_auto": choice,
            "neuron_auto_s": neuron, "best": best,
            "direct_over_ring": times["hier+direct"] / times["hier+ring"] if N > 1 else 1.0,
            "recv_buffers_per_node": (N - 1) * n}


LAT_MAX_BYTES = 32 << 10      # inter-node all_reduce points up to this size calibrate lat
CLIFF_BYTES = 32 << 20        # from here on the veth box's p2p and all_reduce fall off


def internode_model(backend: str, n: int, net: Net, intra: Intra) -> float:
    """The 2 nodes x 1 rank all_reduce that internode-veth.json measures."""
    m = Machine(intra, net)
    if backend == "gloo":
        return t_flat_ring(n, 2, 1, m)
    return t_alone(n, 2, m)


def calibrate_latency(points: list[dict], backend: str, net: Net,
                      intra: Intra) -> tuple[float, list]:
    """The ``lat`` minimising sum((model / measured - 1)^2) (the model is linear in it), >= 0."""
    m0 = np.array([internode_model(backend, p["bytes"], replace(net, lat=0.0), intra)
                   for p in points])
    k = np.array([internode_model(backend, p["bytes"], replace(net, lat=1.0), intra)
                  for p in points]) - m0
    y = np.array([p["t"] for p in points])
    lat = max(0.0, float(np.sum(k * (y - m0) / y ** 2) / np.sum(k ** 2 / y ** 2)))
    return lat, [float(r) for r in (m0 + lat * k) / y - 1]


# ============================================================================ fitting the data

def intra_features(op: str, n: int, L: int, slot: int = SLOT_BYTES, small: int = SMALL_BYTES):
    work = {"all_reduce": lambda: allreduce_work(n, L, slot, small),
            "reduce_scatter": lambda: reduce_scatter_work(n, L, slot),
            "all_gather": lambda: all_gather_work(n, L, slot),
            "broadcast": lambda: broadcast_work(n, L, slot)}[op]()
    return [1.0 if op == o else 0.0 for o in INTRA_OPS] + [work.steps, work.copied, work.reduced]


INTRA_NAMES = [f"alpha_call[{o}]" for o in INTRA_OPS] + ["alpha_step", "beta", "gamma"]


def fit_intra(points: list[dict]) -> Fit:
    X = [intra_features(p["op"], p["bytes"], p["world"]) for p in points]
    return fit_relative(X, [p["t"] for p in points], INTRA_NAMES)


def intra_from_fit(f: Fit) -> Intra:
    calls = {o: f[f"alpha_call[{o}]"] for o in INTRA_OPS}
    return Intra(calls["all_reduce"], f["alpha_step"], f["beta"], f["gamma"], calls)


def intra_predict(op: str, n: int, L: int, c: Intra) -> float:
    """Single-node time of a benchmarked op (broadcast borrows all_gather's call cost)."""
    call = c.calls.get(op, c.calls.get("all_gather", c.a_call))
    if op == "all_reduce":
        return t_single(n, L, Machine(c, Net(0, 0, 0)))
    work = {"reduce_scatter": reduce_scatter_work, "all_gather": all_gather_work,
            "broadcast": broadcast_work}[op](n, L)
    return call + work.time(c)


# ============================================================================ the run

def _gbs(beta: float) -> float:
    return 1e-9 / beta if beta > 0 else float("inf")


def fmt_t(s: float) -> str:
    if s != s:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


def fmt_err(e: float) -> str:
    return "-" if e != e else f"{100 * e:+.0f}%"


def _err_summary(rel: list) -> dict:
    rel = [r for r in rel if r == r]
    if not rel:
        return {"points": 0}
    return {"points": len(rel), "rms_rel_err": float(np.sqrt(np.mean(np.square(rel)))),
            "max_abs_rel_err": float(np.max(np.abs(rel))),
            "median_rel_err": float(statistics.median(rel))}


def _verdict(s: dict) -> str:
    if not s.get("points"):
        return "no points"
    rms, bias = s["rms_rel_err"], s["median_rel_err"]
    q = "good" if rms < 0.15 else "fair" if rms < 0.35 else "poor"
    side = "under" if bias < 0 else "over"
    if abs(bias) >= 0.5:
        factor = (1 + bias) if bias > 0 else 1 / (1 + bias)
        return f"{q}: {side}-predicts, typically {factor:.1f}x"
    return f"{q}: median error {100 * bias:+.0f}%"


class Report:
    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        self.lines.append(text)

    def table(self, header: list, rows: list, align=None) -> None:
        cols = len(header)
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(cols)]
        align = align or ["<"] + [">"] * (cols - 1)
        fmt = "  ".join(f"{{:{a}{w}}}" for a, w in zip(align, widths))
        self(fmt.format(*[str(h) for h in header]))
        self("-" * (sum(widths) + 2 * (cols - 1)))
        for r in rows:
            self(fmt.format(*[str(x) for x in r]))


def _assumptions_text() -> list[str]:
    doc = __doc__ or ""
    start = doc.find("\nAssumptions\n")
    end = doc.find("\nOutput:", start)
    block = doc[start:end].strip().splitlines()[1:] if start >= 0 else []
    return [ln[4:] if ln.startswith("    ") else ln for ln in block]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.costmodel",
        description="Fit an alpha-beta-gamma model of every all_reduce algorithm to the "
                    "committed measurements, check it, and predict 8..1024 ranks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--results-dir", default="results", help="where the bench JSON files are")
    p.add_argument("--json", metavar="OUT", help="write parameters, check and predictions")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="which measured time to fit: the median or the fastest iteration")
    p.add_argument("--transport", choices=NET_BACKENDS, default="neuron-4rails",
                   help="inter-node parameters used for the predictions")
    p.add_argument("--link-gbs", type=float, default=0.0,
                   help="node link GB/s for the predictions (0: = one rank's fitted p2p rate)")
    p.add_argument("--whatif-link-gbs", type=float, default=12.5,
                   help="extra winners table with this node link (0: none); 12.5 = 100 Gb/s")
    p.add_argument("--sizes", default="64K,1M,64M,1G", help="all_reduce sizes to predict")
    p.add_argument("--ranks", default="8,16,32,64,128,256,512,1024", help="P values")
    p.add_argument("--ppn", default="8,2", help="ranks per node L (one table set each)")
    return p


@dataclass
class _Run:
    """What the sections of one run share: inputs, fits, the report and the JSON."""

    args: argparse.Namespace
    stat: str                                   # "time_us" (median) or "min_us"
    paths: dict
    docs: dict
    link: dict | None
    cores: int
    out: Report = field(default_factory=Report)
    js: dict = field(default_factory=dict)
    intra_pts: dict = field(default_factory=dict)      # L -> points
    intra_fits: dict = field(default_factory=dict)     # L -> Fit
    net_fits: dict = field(default_factory=dict)       # transport -> (Fit, p2p points)
    lats: dict = field(default_factory=dict)           # transport -> calibrated lat
    gloo_lo: Fit | None = None
    groups: dict = field(default_factory=dict)         # check group -> rows
    eff: dict = field(default_factory=dict)

    @property
    def intra2(self) -> Intra:
        return intra_from_fit(self.intra_fits[2])

    def net(self, transport: str) -> Net:
        f = self.net_fits[transport][0]
        return Net(f["alpha"], f["beta"], f["beta"], lat=self.lats[transport]["lat"])

    def machine(self) -> Machine:
        return Machine(self.intra2, self.net(self.args.transport))

    def add(self, group: str, rows: list) -> None:
        self.groups.setdefault(group, []).extend(rows)


def run(args) -> tuple[str, dict]:
    """The whole report for parsed ``args``: (text, JSON document)."""
    r = _load_inputs(args)
    _header(r)
    _fit_intra_section(r)
    _fit_net_section(r)
    _check_section(r)
    _predictions_section(r)
    r.out("== 4. assumptions (module docstring)")
    for ln in _assumptions_text():
        r.out(ln)
    r.js["assumptions"] = _assumptions_text()
    r.js["parameters_used"] = _machine_dict(r.machine())
    return "\n".join(r.out.lines) + "\n", r.js


def _load_inputs(args) -> _Run:
    d = args.results_dir
    paths = {k: os.path.join(d, f) for k, f in (
        ("n2", "bench-n2.json"), ("n4", "bench-n4.json"),
        ("internode", "internode-veth.json"), ("link", "link-veth.json"))}
    docs = {k: _load(v) for k, v in paths.items() if k != "link" and os.path.exists(v)}
    for k in ("n2", "internode"):
        if k not in docs:
            raise SystemExit(f"costmodel: {paths[k]} is missing")
    cores = int(docs["n2"]["meta"].get("cores") or os.cpu_count() or 1)
    return _Run(args, "time_us" if args.stat == "median" else "min_us", paths, docs,
                link_reference(paths["link"]), cores)


def _header(r: _Run) -> None:
    out, args = r.out, r.args
    r.js["meta"] = {"command": args.command, "stat": args.stat, "inputs": {},
                    "slot_bytes": SLOT_BYTES, "small_bytes": SMALL_BYTES,
                    "dtype": "float32", "cores_of_measuring_machine": r.cores,
                    "descriptor_piggyback_bytes": PIGGYBACK_BYTES,
                    "selection_thresholds": {
                        "ring_from_3_nodes_alone": code_ring_from(3, 1),
                        "HALVES_BYTES": HALVES_BYTES,
                        "PIGGYBACK_BYTES": PIGGYBACK_BYTES,
                        "hierarchical_min_elements_per_rank": HIERARCHICAL_MIN_ELEMENTS}}
    out(f"# {args.command}")
    out(f"# all_reduce cost model, fitted to the {args.stat} times of:")
    for k, path in r.paths.items():
        if k == "link":
            status = "not present" if r.link is None else (r.link.get("command") or "present")
            out(f"#   {path}: {status}")
            r.js["meta"]["inputs"][path] = status
        elif k in r.docs:
            meta = r.docs[k]["meta"]
            out(f"#   {path}: `{meta.get('command')}` ({meta.get('started', '?')}, "
                f"{meta.get('cores', '?')} cores)")
            r.js["meta"]["inputs"][path] = {"command": meta.get("command"),
                                            "started": meta.get("started")}
        else:
            out(f"#   {path}: not present")
    out(f"# neuron's algorithm choice from collectives/selection.py: among 3+ nodes the "
        f"cheapest exchange by collectives/net_cost.py, halves between two from HALVES_BYTES "
        f"= {human_size(HALVES_BYTES)}, descriptor inside the data up to PIGGYBACK_BYTES = "
        f"{human_size(PIGGYBACK_BYTES)}, hierarchical from {HIERARCHICAL_MIN_ELEMENTS} L elements")
    out("# units: us / ms / s; GB/s = 1e9 B/s; err = predicted / measured - 1")
    out()


# ------------------------------------------------------------------ 1. parameters

def _fit_intra_section(r: _Run) -> None:
    out = r.out
    out("== 1. fitted parameters")
    out()
    for k in ("n2", "n4"):
        if k in r.docs:
            pts = bench_points(r.docs[k], "neuron", INTRA_OPS, r.stat)
            L = pts[0]["world"]
            r.intra_pts[L] = pts
            r.intra_fits[L] = fit_intra(pts)
    if 2 not in r.intra_fits:
        raise SystemExit("costmodel: bench-n2.json has no neuron points")
    out("intra-node (shared memory), neuron all_reduce + reduce_scatter + all_gather points:")
    hdr = ["parameter"] + [f"L={L}" + (" (oversubscribed)" if L > r.cores else "")
                           for L in r.intra_fits]
    rows = []
    for i, name in enumerate(INTRA_NAMES):
        row = [name]
        for f in r.intra_fits.values():
            v, e = f.values[i], f.stderr[i]
            if f.pinned[i]:
                row.append("0 (pinned)")
            elif name in ("beta", "gamma"):
                row.append(f"{v * 1e9:.3f} +- {e * 1e9:.3f} ns/B ({_gbs(v):.2f} GB/s)")
            else:
                row.append(f"{v * 1e6:.1f} +- {e * 1e6:.1f} us")
        rows.append(row)
    rows.append(["points; rms / max |err|"] + [f"{f.n_points}; {100 * f.rms:.0f}% / "
                                                 f"{100 * f.max_abs:.0f}%"
                                                 for f in r.intra_fits.values()])
    out.table(hdr, rows, ["<"] * (1 + len(r.intra_fits)))
    f2 = r.intra_fits[2]
    pair = ("alpha_call[all_reduce]", "alpha_step")
    out(f"(L = ranks on the node; this box has {r.cores} cores. Predictions use the L=2 fit. "
        f"Only the sum alpha_call[all_reduce] + alpha_step = {(f2[pair[0]] + f2[pair[1]]) * 1e6:.0f} "
        f"+- {f2.stderr_of_sum(*pair) * 1e6:.0f} us, the one-step all_reduce, is well "
        f"determined; how it splits is not.)")
    out()
    r.js["intra"] = {str(L): f.as_dict() for L, f in r.intra_fits.items()}


def _fit_net_section(r: _Run) -> None:
    out, args, inter = r.out, r.args, r.docs["internode"]
    out("inter-node (2 nodes x 1 rank over veth): alpha_net, beta_net from p2p (one direction, "
        "time per message = alpha_net + n beta_net);")
    out(f"lat (latency of one dependent network phase) calibrated on the all_reduce points "
        f"<= {human_size(LAT_MAX_BYTES)} (the p2p window hides it):")
    rows = []
    for be in NET_BACKENDS:
        pts = internode_points(inter, "p2p", be, r.stat)
        if len(pts) < 2:
            continue
        f = fit_alpha_beta([p["bytes"] for p in pts], [p["t"] for p in pts])
        r.net_fits[be] = (f, pts)
        small = [p for p in internode_points(inter, "all_reduce", be, r.stat)
                 if p["bytes"] <= LAT_MAX_BYTES]
        lat, lrel = (calibrate_latency(small, be, Net(f["alpha"], f["beta"], f["beta"]), r.intra2)
                     if small else (0.0, []))
        r.lats[be] = {"lat": lat, "rel": lrel, "points": len(small)}
        ls = _err_summary(lrel)
        rows.append([be, f"{f['alpha'] * 1e6:.0f} +- {f.stderr[0] * 1e6:.0f} us",
                     f"{f['beta'] * 1e9:.3f} +- {f.stderr[1] * 1e9:.3f} ns/B",
                     f"{_gbs(f['beta']):.2f}", f"{f.n_points}",
                     f"{100 * f.rms:.0f}% / {100 * f.max_abs:.0f}%",
                     f"{lat * 1e6:.0f} us" if small else "-",
                     f"{len(small)}; {100 * ls['rms_rel_err']:.0f}% / "
                     f"{100 * ls['max_abs_rel_err']:.0f}%" if small else "-"])
    out.table(["transport", "alpha_net", "beta_net", "GB/s", "p2p points", "rms / max |err|",
               "lat", "lat points; rms / max"], rows)
    if args.transport not in r.net_fits:
        raise SystemExit(f"costmodel: no p2p points for {args.transport}")
    out(_link_line(r))
    out()
    r.js["internode_p2p"] = {
        be: {**f.as_dict(), "lat_s": r.lats[be]["lat"], "lat_points": r.lats[be]["points"],
             "lat_rms_rel_err": _err_summary(r.lats[be]["rel"]).get("rms_rel_err")}
        for be, (f, _) in r.net_fits.items()}
    r.js["link_reference"] = r.link
    _gloo_and_sensitivity(r)


def _link_line(r: _Run) -> str:
    link = r.link
    if not (link and link.get("streams")):
        return (f"raw TCP reference: {r.paths['link']} not present (python -m "
                f"bench.link --where veth --json {r.paths['link']})")
    best = max(link["streams"].items(), key=lambda kv: kv[1]["gbps"])
    line = "raw TCP over a veth pair (link-veth.json), one direction: " + ", ".join(
        f"{s} stream{'s' if s != 1 else ''} {c['gbps']:.2f} GB/s"
        for s, c in link["streams"].items())
    if "neuron-4rails" in r.net_fits:
        frac = _gbs(r.net_fits["neuron-4rails"][0]["beta"]) / best[1]["gbps"]
        line += f"; neuron-4rails' fitted rate is {frac:.0%} of the best"
    return line


def _gloo_and_sensitivity(r: _Run) -> None:
    """gloo over loopback (to check the ring formula), and the fits to the other statistic."""
    out, args = r.out, r.args
    gloo_sr = bench_points(r.docs["n2"], "gloo", ("send_recv",), r.stat)
    if len(gloo_sr) >= 2:
        r.gloo_lo = g = fit_alpha_beta([p["bytes"] for p in gloo_sr], [p["t"] for p in gloo_sr])
        out(f"gloo over loopback (bench-n2 send_recv, ping-pong / 2; only used to check the "
            f"ring formula): alpha {g['alpha'] * 1e6:.0f} us, {_gbs(g['beta']):.2f} GB/s, "
            f"rms {100 * g.rms:.0f}% / max {100 * g.max_abs:.0f}%")
        r.js["gloo_loopback"] = g.as_dict()
    other = "min" if args.stat == "median" else "median"
    ostat = "min_us" if r.stat == "time_us" else "time_us"
    f2 = fit_intra(bench_points(r.docs["n2"], "neuron", INTRA_OPS, ostat))
    fn = fit_alpha_beta(*zip(*[(p["bytes"], p["t"]) for p in
                               internode_points(r.docs["internode"], "p2p", args.transport, ostat)]))
    out(f"sensitivity, fitted to the {other} times instead: L=2 alpha_call[all_reduce] "
        f"{f2['alpha_call[all_reduce]'] * 1e6:.0f} us, alpha_step {f2['alpha_step'] * 1e6:.0f} us, "
        f"beta {_gbs(f2['beta']):.2f} GB/s, gamma {_gbs(f2['gamma']):.2f} GB/s (rms "
        f"{100 * f2.rms:.0f}%); {args.transport} alpha_net {fn['alpha'] * 1e6:.0f} us, "
        f"{_gbs(fn['beta']):.2f} GB/s (rms {100 * fn.rms:.0f}%)")
    out()


# ------------------------------------------------------------------ 2. check

def _check_section(r: _Run) -> None:
    r.out("== 2. check: predicted vs measured")
    r.out()
    _check_intra(r)
    _check_p2p(r)
    _check_gloo_ring(r)
    _check_internode_all_reduce(r)
    _check_summary(r)


def _op_table(r: _Run, title: str, pts_by_op: dict, pred_fn, group_of) -> None:
    """Measured vs predicted per size, one column group per op; rows go to the check."""
    r.out(title)
    ops = list(pts_by_op)
    sizes = sorted({p["bytes"] for ps in pts_by_op.values() for p in ps})
    hdr = ["bytes"] + [h for o in ops for h in (f"{o} meas", "pred", "err")]
    rows = []
    for s in sizes:
        row = [human_size(s)]
        for o in ops:
            p = next((p for p in pts_by_op[o] if p["bytes"] == s), None)
            if p is None:
                row += ["", "", ""]
                continue
            pr = pred_fn(o, p)
            e = pr / p["t"] - 1
            extra = {k: v for k, v in p.items() if k not in ("t", "op", "bytes")}
            r.add(group_of(o), [{"op": o, "bytes": s, "measured_s": p["t"], "predicted_s": pr,
                                 "rel_err": e, **extra}])
            row += [fmt_t(p["t"]), fmt_t(pr), fmt_err(e)]
        rows.append(row)
    r.out.table(hdr, rows)
    r.out()


def _check_intra(r: _Run) -> None:
    """2a fitted single-node points (each L with its own fit), 2c broadcast held out, 2d
    4 ranks on 2 cores from the 2-rank fit."""
    for L, f in r.intra_fits.items():
        c = intra_from_fit(f)
        by_op = {o: [p for p in r.intra_pts[L] if p["op"] == o] for o in INTRA_OPS}
        _op_table(r, f"2a. fitted: single node, L={L}, neuron, own fit", by_op,
                  lambda o, p, c=c, L=L: intra_predict(o, p["bytes"], L, c),
                  lambda o, L=L: f"fitted: intra L={L} ({o})")
    for L, f in r.intra_fits.items():
        c = intra_from_fit(f)
        pts = bench_points(r.docs["n2" if L == 2 else "n4"], "neuron", ("broadcast",), r.stat)
        if pts:
            _op_table(r, f"2c. held out: single node broadcast, L={L} (alpha_call taken from "
                      f"all_gather)", {"broadcast": pts},
                      lambda o, p, c=c, L=L: intra_predict(o, p["bytes"], L, c),
                      lambda o, L=L: f"held out: broadcast L={L}")
    if 4 in r.intra_pts:
        k = max(1.0, 4 / r.cores)
        c4 = r.intra2.scaled(k)
        by_op = {o: [p for p in r.intra_pts[4] if p["op"] == o] for o in INTRA_OPS}
        _op_table(r, f"2d. held out: single node L=4 predicted from the L=2 fit x {k:g} "
                  f"(4 ranks on {r.cores} cores)", by_op,
                  lambda o, p: intra_predict(o, p["bytes"], 4, c4),
                  lambda o: "held out: L=4 from the L=2 fit")


def _check_p2p(r: _Run) -> None:
    """2b the fitted inter-node p2p points."""
    r.out("2b. fitted: inter-node p2p (one direction, per message)")
    sizes = sorted({p["bytes"] for _, pts in r.net_fits.values() for p in pts})
    hdr = ["bytes"] + [h for be in r.net_fits for h in (f"{be} meas", "pred", "err")]
    rows = []
    for s in sizes:
        row = [human_size(s)]
        for be, (f, pts) in r.net_fits.items():
            p = next((p for p in pts if p["bytes"] == s), None)
            if p is None:
                row += ["", "", ""]
                continue
            pr = f["alpha"] + s * f["beta"]
            e = pr / p["t"] - 1
            r.add(f"fitted: p2p {be}", [{"op": "p2p", "bytes": s, "measured_s": p["t"],
                                         "predicted_s": pr, "rel_err": e, "window": p["window"]}])
            row += [fmt_t(p["t"]), fmt_t(pr), fmt_err(e)]
        rows.append(row)
    r.out.table(hdr, rows)
    r.out()


def _check_gloo_ring(r: _Run) -> None:
    """2e gloo's all_reduce on one node (P = 2, 4) vs the textbook ring with gloo's own
    loopback alpha/beta."""
    if not r.gloo_lo:
        return
    g, rows = r.gloo_lo, []
    for key in ("n2", "n4"):
        if key not in r.docs:
            continue
        for p in bench_points(r.docs[key], "gloo", ("all_reduce",), r.stat):
            P = p["world"]
            k = max(1.0, P / r.cores)
            mg = Machine(r.intra2.scaled(k), Net(g["alpha"] * k, g["beta"] * k, g["beta"] * k))
            pr = t_flat_ring(p["bytes"], 1, P, mg)
            e = pr / p["t"] - 1
            r.add("held out: gloo ring, one node (loopback)",
                  [{"op": "all_reduce", "backend": "gloo", "P": P, "bytes": p["bytes"],
                    "measured_s": p["t"], "predicted_s": pr, "rel_err": e}])
            rows.append([f"P={P}", human_size(p["bytes"]), fmt_t(p["t"]), fmt_t(pr), fmt_err(e)])
    r.out("2e. held out: gloo all_reduce on one node vs the textbook flat ring with gloo's "
          "loopback alpha/beta (P=4: x2 for 4 ranks on 2 cores)")
    r.out.table(["ranks", "bytes", "measured", "ring model", "err"], rows)
    r.out()


def _check_internode_all_reduce(r: _Run) -> None:
    """2f the inter-node all_reduce (2 nodes x 1 rank): points <= LAT_MAX_BYTES calibrated
    lat, the others are held out; full and half duplex."""
    out, inter = r.out, r.docs["internode"]
    out("2f. inter-node all_reduce, 2 nodes x 1 rank over veth (points <= "
        f"{human_size(LAT_MAX_BYTES)} calibrated lat; the others are held out)")
    out("    model = full duplex (the model's assumption); half duplex = both directions share "
        "one budget")
    rows = []
    for be in NET_BACKENDS:
        pts = internode_points(inter, "all_reduce", be, r.stat)
        if be not in r.net_fits or not pts:
            continue
        full = r.net(be)
        half = replace(full, duplex=False)
        tag = "gloo ring" if be == "gloo" else be
        for p in pts:
            n = p["bytes"]
            fd = internode_model(be, n, full, r.intra2)
            hd = internode_model(be, n, half, r.intra2)
            errs = [fd / p["t"] - 1, hd / p["t"] - 1]
            row = {"op": "all_reduce", "backend": be, "bytes": n, "measured_s": p["t"],
                   "predicted_s": fd, "rel_err": errs[0], "predicted_half_duplex_s": hd}
            if n <= LAT_MAX_BYTES:
                use = "calib"
                r.add(f"calibrated lat: inter-node all_reduce {tag} <= {human_size(LAT_MAX_BYTES)}",
                      [row])
            else:
                use = "held out"
                rng = (f"{human_size(LAT_MAX_BYTES * 2)}..{human_size(CLIFF_BYTES // 2)}"
                       if n < CLIFF_BYTES else f">= {human_size(CLIFF_BYTES)}")
                r.add(f"held out: inter-node all_reduce {tag} {rng}", [row])
                if be != "gloo":
                    r.add(f"held out: inter-node all_reduce {tag} {rng}, half duplex",
                          [{**row, "predicted_s": hd, "rel_err": errs[1]}])
            rows.append([be, human_size(n), use, fmt_t(p["t"]), fmt_t(fd), fmt_err(errs[0]),
                         fmt_t(hd), fmt_err(errs[1])])
    out.table(["transport", "bytes", "use", "measured", "model", "err", "half duplex", "err"],
              rows)
    out("    (gloo: the textbook ring over 2 ranks with gloo's own p2p alpha/beta and lat)")
    for be in NET_BACKENDS:
        pts = internode_points(inter, "all_reduce", be, r.stat)
        if len(pts) >= 2 and be in r.net_fits:
            fe = fit_alpha_beta([p["bytes"] for p in pts], [p["t"] for p in pts])
            r.eff[be] = {"alpha_s": fe["alpha"], "gbs": _gbs(fe["beta"]), "rms_rel_err": fe.rms,
                         "p2p_gbs": _gbs(r.net_fits[be][0]["beta"])}
    if r.eff:
        out("    diagnosis: alpha + n beta fitted to these all_reduce points themselves: " + "; ".join(
            f"{be} {v['alpha_s'] * 1e3:.2f} ms + n / {v['gbs']:.2f} GB/s ({v['gbs'] / v['p2p_gbs']:.0%}"
            f" of its p2p rate)" for be, v in r.eff.items()))
    out()


def _check_summary(r: _Run) -> None:
    """2g one line per check group, then where the model is poor."""
    out = r.out
    out("2g. check summary (err = predicted / measured - 1)")
    check: dict = {"groups": {}, "internode_all_reduce_effective": r.eff}
    rows = []
    for g, rows_ in r.groups.items():
        s = _err_summary([x["rel_err"] for x in rows_])
        check["groups"][g] = {**s, "verdict": _verdict(s), "rows": rows_}
        rows.append([g, s["points"], f"{100 * s['rms_rel_err']:.0f}%",
                     f"{100 * s['max_abs_rel_err']:.0f}%", f"{100 * s['median_rel_err']:+.0f}%",
                     _verdict(s)])
    out.table(["group", "n", "rms", "max |err|", "median", "verdict"], rows)
    out()
    for line in _where_poor(r.groups, r.eff, r.cores, r.net_fits):
        out(line)
    out()
    r.js["check"] = check


# ------------------------------------------------------------------ 3. predictions

_SHORT = {"hier+direct": "D", "hier+ring": "R", "hier+log-depth": "G", "leader": "l",
          "single-node": "1 node"}


def _predictions_section(r: _Run) -> None:
    out, args = r.out, r.args
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    ppns = [int(x) for x in args.ppn.split(",") if x.strip()]
    machine = r.machine()
    net = machine.net
    pm = machine
    if args.link_gbs > 0:
        pm = replace(machine, net=replace(net, beta_link=1e-9 / args.link_gbs))
    link_txt = (f"node link {args.link_gbs:g} GB/s" if args.link_gbs > 0 else
                f"node link = one rank's rate ({_gbs(net.beta_link):.2f} GB/s)")
    out("== 3. predictions: all_reduce time, float32, in place")
    out(f"intra: L=2 fit; inter: {args.transport} (alpha_net {net.alpha * 1e6:.0f} us, lat "
        f"{net.lat * 1e6:.0f} us, {_gbs(net.beta_rank):.2f} GB/s per rank), {link_txt}, full "
        f"duplex. neuron = what allreduce_net.all_reduce runs (D = hier+direct, R = hier+ring, "
        f"G = hier+log-depth: recursive doubling or Rabenseifner, l = leader); best over the "
        f"five; direct/ring = hier+direct / hier+ring. '!' = direct "
        f"exchange needs > {MEM_FLAG_BYTES >> 30} GiB of receive buffers per node.")
    out("bytes through each node link per direction: hier+direct (N-1) n (L ranks x N-1 peers"
        " x n/L), hier+ring 2(N-1)/N n (L rings x 2(N-1) steps x n/(L N)), leader (N-1) n "
        "(from one rank), flat ring 2(P-1)/P n (one ring edge leaves the node); network "
        "messages per rank: 2(N-1) in one phase, 2(N-1) + 1 and 2(P-1) in dependent steps"
        f" (call descriptors ride in the data's message up to {human_size(PIGGYBACK_BYTES)}: "
        f"collectives/net.py PIGGYBACK_BYTES; then N-1 and 2(N-1)).")
    out()
    preds, winners = [], {}
    for L in ppns:
        for n in sizes:
            out(f"L={L} ranks per node, {human_size(n)}:")
            rows = []
            for P in ranks:
                if P < L or P % L:
                    continue
                N = P // L
                p = predict(n, N, L, pm)
                preds.append(p)
                winners.setdefault((L, n), []).append((P, p["best"]))
                flag = "!" if p["recv_buffers_per_node"] > MEM_FLAG_BYTES else ""
                t = p["times"]
                rows.append([P, N, fmt_t(t["hier+direct"]) + flag, fmt_t(t["hier+ring"]),
                             fmt_t(t["hier+log-depth"]), fmt_t(t["leader"]) + flag, fmt_t(t["flat ring"]),
                             f"{fmt_t(p['neuron_auto_s'])} {_SHORT[p['neuron_auto']]}", p["best"],
                             f"{p['direct_over_ring']:.2f}x" if N > 1 else "-"])
            out.table(["P", "N", "hier+direct", "hier+ring", "hier+log-depth", "leader",
                       "flat ring", "neuron",
                       "best", "direct/ring"], rows)
            out()
    out("who wins (P ranges):")
    for (L, n), ws in winners.items():
        out(f"  L={L}, {human_size(n):>7}: " + _ranges(ws))
    out()
    r.js["predictions"] = {"machine": _machine_dict(pm), "rows": preds}
    if args.whatif_link_gbs > 0:
        _what_ifs(r, machine, ppns, sizes, ranks)
    _crossover_lines(r, pm, ppns, ranks)


def _what_ifs(r: _Run, machine: Machine, ppns, sizes, ranks) -> None:
    out, args, net = r.out, r.args, machine.net
    wm = replace(machine, net=replace(net, beta_link=1e-9 / args.whatif_link_gbs))
    out(f"what if the node link were {args.whatif_link_gbs:g} GB/s (one rank still "
        f"{_gbs(net.beta_rank):.2f} GB/s, so L ranks together can use more of it): best "
        f"algorithm (P ranges)")
    r.js["predictions_whatif_link"] = {"machine": _machine_dict(wm),
                                       "rows": _best_by_size(out, wm, ppns, sizes, ranks)}
    wl = replace(machine, net=replace(net, lat=0.0))
    out("what if lat were 0 (only the p2p per-message cost alpha_net per ring step): best "
        "algorithm")
    r.js["predictions_whatif_lat0"] = {"machine": _machine_dict(wl),
                                       "rows": _best_by_size(out, wl, ppns, sizes, ranks)}


def _crossover_lines(r: _Run, pm: Machine, ppns, ranks) -> None:
    out = r.out
    out("ring among nodes vs direct exchange: smallest power-of-two size from which hier+ring "
        "is faster than hier+direct (as modelled / with lat = 0); the code (collectives/"
        f"selection.py) picks among 3+ nodes what collectives/net_cost.py prices cheapest "
        f"(a ring among 3 nodes alone from {human_size(code_ring_from(3, 1) or 0)}) and "
        f"runs halves from HALVES_BYTES = {human_size(HALVES_BYTES)} per slice (2 nodes)")
    cross = {}
    for L in ppns:
        parts = []
        for P in ranks:
            if P < L or P % L or P // L < 2:
                continue
            a = crossover(P // L, L, pm)
            b = crossover(P // L, L, replace(pm, net=replace(pm.net, lat=0.0)))
            cross[f"L={L},P={P}"] = {"modelled": a, "lat0": b}
            parts.append(f"P={P}: {human_size(a) if a else 'never'} / "
                         f"{human_size(b) if b else 'never'}")
        ring, halves = code_ring_from(3, L), code_ring_from(2, L)  # (asked of the tables)
        cross[f"L={L},code"] = {"ring_3_nodes": ring, "halves_2_nodes": halves}
        out(f"  L={L} (code: ring from {human_size(ring) if ring else 'never'} among 3 nodes, "
            f"halves from {human_size(halves) if halves else 'never'} between two): "
            + ", ".join(parts))
    out()
    r.js["ring_crossover_bytes"] = cross


def crossover(N: int, L: int, m: Machine, lo: int = 1 << 10, hi: int = 1 << 36) -> int | None:
    """Smallest power of two n in [lo, hi] from which hier+ring beats hier+direct for good."""
    sizes = []
    n = lo
    while n <= hi:
        sizes.append(n)
        n *= 2
    wins = [t_hier_ring(n, N, L, m) < t_hier_direct(n, N, L, m) for n in sizes]
    if not wins[-1]:
        return None
    k = len(wins) - 1
    while k > 0 and wins[k - 1]:
        k -= 1
    return sizes[k]


def _machine_dict(m: Machine) -> dict:
    d = asdict(m)
    d["intra"]["beta_gbs"] = _gbs(m.intra.b)
    d["intra"]["gamma_gbs"] = _gbs(m.intra.g)
    d["net"]["rank_gbs"] = _gbs(m.net.beta_rank)
    d["net"]["link_gbs"] = _gbs(m.net.beta_link)
    return d


def _best_by_size(out, machine, ppns, sizes, ranks) -> list:
    """Print, per ranks-per-node L and size, which algorithm wins over which rank counts P;
    return every prediction made."""
    rows = []
    for L in ppns:
        for n in sizes:
            ws = []
            for P in ranks:
                if P < L or P % L:
                    continue
                r = predict(n, P // L, L, machine)
                rows.append(r)
                ws.append((P, r["best"]))
            out(f"  L={L}, {human_size(n):>7}: " + _ranges(ws))
    out()
    return rows


def _ranges(ws: list) -> str:
    """[(8, 'a'), (16, 'a'), (32, 'b')] -> 'a at P=8..16, b at P=32'."""
    parts = []
    for P, w in ws:
        if parts and parts[-1][0] == w:
            parts[-1][2] = P
        else:
            parts.append([w, P, P])
    return ", ".join(f"{w} at P={a}" + (f"..{b}" if b != a else "") for w, a, b in parts)


def _where_poor(groups: dict, eff: dict, cores: int, net_fits: dict | None = None) -> list[str]:
    """Plain statements of where the model is poor, from the numbers."""
    out = ["where the model is poor:"]
    cliff = None
    rates = {"mid": [], "big": []}
    for be, (_, pts) in (net_fits or {}).items():
        if be.startswith("neuron"):
            for p in pts:
                key = "big" if p["bytes"] >= CLIFF_BYTES else \
                    "mid" if p["bytes"] >= (4 << 20) else None
                if key:
                    rates[key].append(p["bytes"] / p["t"])
    if rates["mid"] and rates["big"]:
        cliff = statistics.median(rates["big"]) / statistics.median(rates["mid"])

    def stats(prefix):
        rel = [r["rel_err"] for g, rows in groups.items() if g.startswith(prefix) for r in rows]
        return _err_summary(rel)

    small = [r for g, rows in groups.items() if g.startswith("fitted: intra L=2") for r in rows]
    if small:
        worst = max(small, key=lambda r: abs(r["rel_err"]))
        out.append(f"  * single node: median times jitter (the worst fitted L=2 point, "
                   f"{worst['op']} {human_size(worst['bytes'])}, is {fmt_err(worst['rel_err'])}); "
                   f"one alpha_step for all ops and sizes blurs cache effects (small messages "
                   f"stay in cache, 32 MiB does not).")
    s4 = stats("held out: L=4")
    if s4.get("points"):
        out.append(f"  * 4 ranks on {cores} cores: scaling the L=2 fit by 4/{cores} gives "
                   f"{_verdict(s4)} (rms {100 * s4['rms_rel_err']:.0f}%): oversubscription "
                   f"costs more than the lost cores (e.g. waits sleep once spinning is off); "
                   f"L > cores is not predicted, only L <= cores.")
    sg = stats("held out: gloo ring")
    if sg.get("points"):
        out.append(f"  * gloo's ring from its own ping-pong alpha/beta: {_verdict(sg)} (rms "
                   f"{100 * sg['rms_rel_err']:.0f}%): the ring formula is the right shape, but "
                   f"per-step costs are not a ping-pong's.")
    for be in ("neuron-1rail", "neuron-4rails", "gloo ring"):
        parts = []
        for g, rows in groups.items():
            if g.startswith(f"held out: inter-node all_reduce {be} "):
                st = _err_summary([r["rel_err"] for r in rows])
                label = g[len(f"held out: inter-node all_reduce {be} "):]
                parts.append(f"{label}: {_verdict(st)}")
        if parts:
            out.append(f"  * inter-node all_reduce, {be}, held out: " + "; ".join(parts) + ".")
    if eff:
        neuron = {k: v for k, v in eff.items() if k.startswith("neuron")}
        if neuron:
            ratio = [v["gbs"] / v["p2p_gbs"] for v in neuron.values()]
            out.append(
                f"    alpha + n beta fitted to the measured neuron all_reduce points moves bytes at "
                f"{min(ratio):.0%}..{max(ratio):.0%} of the p2p rate. Missing from the model: "
                f"(a) on this box both ranks, both directions and every rail thread share "
                f"{cores} cores (half duplex is closer up to 8 MiB)"
                + (f"; (b) a fall-off from {human_size(CLIFF_BYTES)} on that p2p shows too (neuron"
                   f" p2p at >= {human_size(CLIFF_BYTES)} runs at {cliff:.0%} of its 4..16 MiB "
                   f"rate) and the p2p fit averages over it" if cliff and cliff < 0.9 else "")
                + ". So the inter-node terms are optimistic: read"
                " the predictions as ratios between algorithms more than as absolute times.")
    out.append("  * nothing measured has L > 1 and N > 1 at once, or N > 2: the hierarchical, "
               "leader and ring network phases are only checked through their 2-node, "
               "1-rank form.")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command = shlex.join(["python", "-m", "bench.costmodel", *argv])
    text, js = run(args)
    sys.stdout.write(text)
    sys.stdout.flush()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(js, f, indent=1, default=float)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
