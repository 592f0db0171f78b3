"""Issue 13's between-nodes goals, checked cell by cell against a ``bench.internode`` run.

``python -m bench.internode_goals [--into FILE] [--backend NAME] results/internode-veth.json``

How it works
------------
For every (op, size) the run measured, the table gives neuron's time (the 4-rail group by
default), gloo's and the floor's (``bench/floor_pg.py``: raw TCP, no protocol) from that one
run, neuron's speed over gloo's (gloo's time / neuron's) and the floor's, and the goal:
2x gloo for the 64-byte send/recv round trip and the 8-byte all_reduce, 1.5x everywhere
else. A cell that misses its goal says whether the floor, measured in the same cell,
reached it: where it did not, no backend moving the bytes through the kernel's TCP from
Python could on this machine that day. A second table checks large send/recv (64 MiB and
more) against the floor's raw TCP over as many streams as rails (goal 0.9). A closing line
counts the cells. ``--into FILE`` replaces the text between ``<!-- internode-goals:start -->``
and ``<!-- internode-goals:end -->`` in FILE, so docs/performance.md's table always comes
from the committed result file; without it the tables are printed.
"""

from __future__ import annotations

import argparse
import json

from .summary import _size, replace_section

START, END = "<!-- internode-goals:start -->", "<!-- internode-goals:end -->"
OPS = ("pingpong", "p2p", "all_reduce", "all_gather", "reduce_scatter")
NAMES = {"pingpong": "send/recv round trip", "p2p": "send/recv, one direction",
         "all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
         "reduce_scatter": "reduce_scatter_tensor"}
LARGE_P2P = 64 << 20  # send/recv from this size is also held against raw TCP ...
LINK_GOAL = 0.9  # ... and must reach this share of it


def goal(op: str, nbytes: int) -> float:
    """Issue 13's goal for a cell: neuron's speed over gloo's."""
    if (op, nbytes) in (("pingpong", 64), ("all_reduce", 8)):
        return 2.0
    return 1.5


def _times(rows: list) -> dict:
    """(op, bytes, backend) -> time_us of the rows that ran ok."""
    return {(r["op"], r["bytes"], r["backend"]): r["time_us"] for r in rows
            if r.get("kind") == "row" and r.get("status") == "ok" and r.get("time_us")}


def goals_table(doc: dict, backend: str = "neuron-4rails") -> str:
    """Markdown: every cell of the run against its goal (see the module docstring)."""
    times = _times(doc["results"])
    lines = [f"| op | size | {backend} µs | gloo µs | floor µs | vs gloo | floor vs gloo | goal |"
             " verdict |", "|---|---|---|---|---|---|---|---|---|"]
    met = missed = floor_short = 0
    for op in OPS:
        for nbytes in sorted({b for (o, b, _) in times if o == op}):
            mine, gloo = times.get((op, nbytes, backend)), times.get((op, nbytes, "gloo"))
            if mine is None or gloo is None:
                continue
            floor = times.get((op, nbytes, "floor"))
            want, ratio = goal(op, nbytes), gloo / mine
            floor_ratio = gloo / floor if floor else None
            if ratio >= want:
                verdict, met = "met", met + 1
            else:
                missed += 1
                verdict = "missed"
                if floor_ratio is not None and floor_ratio < want:
                    verdict, floor_short = "missed; the floor too", floor_short + 1
            lines.append(
                f"| {NAMES[op]} | {_size(nbytes)} | {mine:.1f} | {gloo:.1f} | "
                f"{f'{floor:.1f}' if floor else '-'} | {ratio:.2f}x | "
                f"{f'{floor_ratio:.2f}x' if floor_ratio is not None else '-'} | {want:g}x | "
                f"{verdict} |")
    link = [f"| size | {backend} GB/s | floor GB/s | share of the floor | goal |",
            "|---|---|---|---|---|"]
    for nbytes in sorted({b for (o, b, _) in times if o == "p2p" and b >= LARGE_P2P}):
        mine, floor = times.get(("p2p", nbytes, backend)), times.get(("p2p", nbytes, "floor"))
        if mine is None or floor is None:
            continue
        share = floor / mine
        link.append(f"| {_size(nbytes)} | {nbytes / mine / 1e3:.2f} | {nbytes / floor / 1e3:.2f} "
                    f"| {share:.2f} ({'met' if share >= LINK_GOAL else 'missed'}) | "
                    f"{LINK_GOAL:g} |")
    total = met + missed
    summary = (f"Goal met at {met} of {total} cells; of the {missed} missed, the floor (raw "
               f"TCP, no protocol, same cell) missed it too at {floor_short}.")
    parts = ["\n".join(lines), summary]
    if len(link) > 2:
        parts.append("Large send/recv against raw TCP over as many streams as rails:\n\n"
                     + "\n".join(link))
    return "\n\n".join(parts)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="a bench.internode --json file")
    p.add_argument("--backend", default="neuron-4rails",
                   help="the neuron group held against the goals (default: neuron-4rails)")
    p.add_argument("--into", metavar="FILE",
                   help="Markdown file whose internode-goals markers get the tables, in place")
    args = p.parse_args(argv)
    with open(args.json) as f:
        doc = json.load(f)
    body = f"Generated from `{args.json}` by `bench.internode_goals`:\n\n" + goals_table(
        doc, args.backend)
    if not args.into:
        print(body)
        return
    with open(args.into) as f:
        text = f.read()
    with open(args.into, "w") as f:
        f.write(replace_section(text, body, args.into, START, END))


if __name__ == "__main__":
    main()
