"""All-reduce between nodes from 8 to 4096 nodes, simulated: ``python -m bench.scaleplan``.

How it works
------------
For each node count P and size, the all-reduce the selection tables choose among P nodes
(collectives/selection.py, ``all_reduce/network``, one rank per node) runs as its own code
for all P ranks in this process over the simulated network of ``netsim.py``, on meta
tensors (the code runs, nothing is allocated). Next to it, two references: a **ring**
(net_ring.py, what gloo runs) and a **tree** (net_binomial.py's reduce to rank 0 then
broadcast). For each: messages a rank sends (the busiest), bytes through its link, dependent
rounds (``hops``), distinct peers of a rank, and the time predicted with the link figures
of collectives/net_cost.py (``MEASURED``: this machine's veth link, fitted offline). A
ring among more than ``--ring-sim-max`` ranks (2 (P-1) rounds of P ranks: slow to simulate)
is priced by net_cost.shape, whose counts tests/units/test_net_algorithms.py checks against
the simulator up to 64 ranks.

``--json FILE`` writes every row, ``--plot FILE.png`` draws predicted time against nodes
(log-log, one panel per size; ``--from-json FILE`` draws it from an earlier ``--json``
without simulating again); the text goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from neuron_dist.collectives import net_binomial, net_cost, net_ring
from neuron_dist.collectives import net_rabenseifner, net_recursive_doubling
from neuron_dist.collectives.reduce_ops import ReduceSpec
from neuron_dist.collectives.selection import DEFAULT
from .netsim import Simulation
from .sweep import human_size, parse_size

_SUM = ReduceSpec("SUM")
_GENERATORS = {"recursive_doubling": net_recursive_doubling.all_reduce,
               "rabenseifner": net_rabenseifner.all_reduce, "ring": net_ring.all_reduce}


def _tree(net, buf, peers, me, spec):
    yield from net_binomial.reduce(net, buf, peers, me, 0, spec)
    yield from net_binomial.broadcast(net, buf, peers, me, 0)


def simulate(algorithm: str, size: int, nbytes: int) -> dict:
    """One all-reduce of ``nbytes`` (float32) among ``size`` ranks, simulated."""
    sim = Simulation(size, device="meta")
    peers = list(range(size))
    make = _tree if algorithm == "tree" else _GENERATORS[algorithm]
    n = max(1, nbytes // 4)
    st = sim.run([make(sim.nets[r], torch.empty(n, device="meta"), peers, r, _SUM)
                  for r in peers])
    return {"sent": st.sent, "bytes": st.bytes, "hops": st.hops, "peers": st.peers,
            "time_s": st.time, "source": "simulated"}


def priced(algorithm: str, size: int, nbytes: int) -> dict:
    """The same from net_cost.shape (no simulation)."""
    sh = net_cost.shape("all_reduce", algorithm, size, nbytes)
    return {"sent": sh.sent, "bytes": sh.bytes, "hops": sh.rounds, "peers": 2,
            "time_s": sh.time(net_cost.MEASURED), "source": "cost model"}


def plot(path: str, rows: list, link: str) -> None:
    """Predicted time against nodes, neuron / ring / tree, one panel per size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = sorted({r["nbytes"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.8), squeeze=False)
    for ax, nbytes in zip(axes.flat, sizes):
        mine = [r for r in rows if r["nbytes"] == nbytes]
        nodes = [r["nodes"] for r in mine]
        for key, label, colour in (("neuron", "neuron (table's choice)", "tab:red"),
                                   ("ring", "ring", "tab:blue"), ("tree", "tree", "tab:green")):
            ax.plot(nodes, [r[key]["time_s"] * 1e3 for r in mine], "o-", color=colour,
                    label=label, markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("nodes (1 rank each)")
        ax.set_ylabel("predicted ms")
        ax.set_title(f"all_reduce {human_size(nbytes)}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"simulated all_reduce between nodes; link {link}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="8,16,32,64,128,256,512,1024,2048,4096")
    p.add_argument("--sizes", default="8,64K,1M")
    p.add_argument("--ring-sim-max", type=int, default=256)
    p.add_argument("--json")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--from-json", metavar="FILE", help="plot an earlier --json, no simulation")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            done = json.load(f)
        if args.plot:
            plot(args.plot, done["rows"], done["link"])
        return 0
    nodes = [int(x) for x in args.nodes.split(",")]
    sizes = [parse_size(x) for x in args.sizes.split(",")]
    rows = []
    print(f"# python -m bench.scaleplan --nodes {args.nodes} --sizes {args.sizes}")
    print(f"# link: {net_cost.MEASURED.describe()} (collectives/net_cost.py MEASURED); float32;"
          f" one rank per node; per rank: messages sent, bytes through its link, peers")
    print(f"{'size':>6} {'nodes':>5} | {'neuron':>18} {'msgs':>5} {'MiB':>7} {'hops':>5} "
          f"{'peers':>5} {'time':>9} | {'ring msgs':>9} {'hops':>5} {'time':>9} | "
          f"{'tree msgs':>9} {'hops':>5} {'time':>9} | ring/neuron")
    for nbytes in sizes:
        for size in nodes:
            t0 = time.monotonic()
            choice = DEFAULT.select("all_reduce/network", nbytes, size, numel=max(1, nbytes // 4))
            if choice == "direct":  # (few nodes only; priced, not simulated)
                mine = priced("direct", size, nbytes)
            else:
                mine = simulate(choice, size, nbytes)
            ring = (simulate("ring", size, nbytes) if size <= args.ring_sim_max
                    else priced("ring", size, nbytes))
            tree = simulate("tree", size, nbytes)
            row = {"nbytes": nbytes, "nodes": size, "neuron_algorithm": choice, "neuron": mine,
                   "ring": ring, "tree": tree, "wall_s": time.monotonic() - t0}
            rows.append(row)
            print(f"{human_size(nbytes):>6} {size:>5} | {choice:>18} {mine['sent']:>5} "
                  f"{mine['bytes'] / 2**20:>7.2f} {mine['hops']:>5} {mine['peers']:>5} "
                  f"{mine['time_s'] * 1e3:>7.2f}ms | {ring['sent']:>9} {ring['hops']:>5} "
                  f"{ring['time_s'] * 1e3:>7.2f}ms | {tree['sent']:>9} {tree['hops']:>5} "
                  f"{tree['time_s'] * 1e3:>7.2f}ms | {ring['time_s'] / mine['time_s']:>6.1f}x",
                  flush=True)
    if args.plot:
        plot(args.plot, rows, net_cost.MEASURED.describe())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m bench.scaleplan " + " ".join(
                argv if argv is not None else sys.argv[1:]),
                "link": net_cost.MEASURED.describe(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
