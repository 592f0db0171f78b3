"""``--plot F.png``: bus bandwidth against message size, one subplot per op.

One line per backend and world size (colour = backend, line style = world size), log2 size
axis, log busbw axis; n/a rows are left out. matplotlib is imported only here and only when
a plot is asked for, with the non-interactive Agg canvas; without it ``save`` raises
``PlotUnavailable`` with the install hint, which the CLI prints instead of failing the run.
"""

from __future__ import annotations

import math

from .sweep import human_size

COLOURS = {"neuron": "tab:red", "gloo": "tab:blue", "mpi": "tab:green"}
STYLES = ["-", "--", ":", "-."]


class PlotUnavailable(RuntimeError):
    pass


def save(path: str, rows: list[dict], ops: list[str], title: str = "") -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(f"matplotlib is not installed ({exc}); "
                              "pip install matplotlib (or 'neuron-dist[bench]') for --plot") from None
    ops = [op for op in ops if any(r["op"] == op for r in rows)]
    if not ops:
        raise PlotUnavailable("nothing to plot: no result rows")
    worlds = sorted({r["world"] for r in rows})
    ncols = min(3, len(ops))
    nrows = math.ceil(len(ops) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        lines = {}
        for r in rows:
            if r["op"] == op and r["status"] == "ok" and r["busbw_gbs"] and r["busbw_gbs"] > 0:
                lines.setdefault((r["backend"], r["world"]), []).append((r["bytes"], r["busbw_gbs"]))
        order = list(COLOURS)
        for (backend, world), pts in sorted(lines.items(), key=lambda kv: (
                order.index(kv[0][0]) if kv[0][0] in order else len(order), kv[0][1])):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".",
                    color=COLOURS.get(backend), linestyle=STYLES[worlds.index(world) % len(STYLES)],
                    label=f"{backend} n={world}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("message bytes per rank")
        ax.set_ylabel("busbw GB/s")
        ax.grid(True, which="both", alpha=0.3)
        sizes = [p[0] for pts in lines.values() for p in pts]
        if sizes:
            lo, hi = int(math.log2(min(sizes))), math.ceil(math.log2(max(sizes)))
            ticks = [2 ** e for e in range(lo, hi + 1, max(1, (hi - lo + 7) // 8))]
            ax.set_xticks(ticks)
            ax.set_xticklabels([human_size(t).replace(" ", "") for t in ticks],
                               rotation=45, fontsize=7)
        if lines:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
