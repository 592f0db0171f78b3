"""Read the flight-recorder dumps of all ranks and say what went wrong.

    python -m neuron_dist.fr_analyze DIR_OR_FILES...

For each process group found in the dumps it prints, per rank, the last collective that
completed and the one it is stuck in (or failed in), each with the algorithm neuron chose
for it when the record names one (``[algo ...]``), then its verdict:

* ranks *behind*: they never issued the sequence number the others are waiting in;
* a *mismatch*: two ranks issued the same sequence number with different calls
  (op, dtype, element count or root);
* ranks whose dump is missing (a process that died before it could write one).

Exit status 0 when everything the dumps show is consistent, 1 when it found a problem.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict


def load(paths: list[str]) -> list[dict]:
    files = []
    for p in paths:
        files += sorted(glob.glob(os.path.join(p, "neuron-fr-*.json"))) if os.path.isdir(p) else [p]
    docs = []
    for f in files:
        with open(f) as fh:
            doc = json.load(fh)
        doc["file"] = f
        docs.append(doc)
    return docs


def analyse(docs: list[dict]) -> tuple[list[str], bool]:
    """Report lines and whether a problem was found."""
    # group -> rank -> {seq: record}
    groups: dict = defaultdict(lambda: defaultdict(dict))
    sizes: dict = {}
    for doc in docs:
        for rec in doc["records"]:
            groups[rec["group"]][rec["rank"]][rec["seq"]] = rec
            sizes[rec["group"]] = rec["size"]
    lines, problem = [], False
    for group in sorted(groups):
        ranks = groups[group]
        size = sizes[group]
        lines.append(f"group {group}: {size} ranks, dumps from ranks {sorted(ranks)}")
        missing = sorted(set(range(size)) - set(ranks))
        for rank in sorted(ranks):
            lines.append("  " + _rank_line(rank, ranks[rank]))
        top = max(max(recs) for recs in ranks.values())
        pending = {r: min((s for s, rec in recs.items() if rec["state"] != "completed"), default=None)
                   for r, recs in ranks.items()}
        for seq in sorted({s for recs in ranks.values() for s in recs}):
            calls = {r: recs[seq]["call"] for r, recs in ranks.items() if seq in recs}
            if len(set(calls.values())) > 1:
                problem = True
                detail = "; ".join(f"rank {r} called {c}" for r, c in sorted(calls.items()))
                lines.append(f"  MISMATCH at #{seq}: {detail}")
        waiting = [s for s in pending.values() if s is not None]
        if waiting:
            stuck_at = min(waiting)
            behind = sorted(r for r, recs in ranks.items() if max(recs) < stuck_at)
            if behind:
                problem = True
                lines.append(f"  BEHIND: rank(s) {behind} never issued #{stuck_at}, which "
                             f"rank(s) {sorted(r for r, s in pending.items() if s == stuck_at)} wait in")
        if missing:
            problem = True
            lines.append(f"  NO DUMP from rank(s) {missing} (died, or never reached a collective)")
        if not problem and top:
            lines.append("  consistent: every rank completed the same collectives")
    return lines, problem


def _what(rec: dict) -> str:
    """A record's call, with the algorithm chosen for it if the record names one."""
    algo = rec.get("algo")  # (absent from dumps written before it was recorded)
    return f"{rec['call']} [algo {algo}]" if algo else rec["call"]


def _rank_line(rank: int, recs: dict) -> str:
    done = [s for s, r in recs.items() if r["state"] == "completed"]
    last = f"last completed #{max(done)} {_what(recs[max(done)])}" if done else "nothing completed"
    open_ = sorted(s for s, r in recs.items() if r["state"] != "completed")
    if not open_:
        return f"rank {rank}: {last}"
    rec = recs[open_[0]]
    if rec["state"] == "failed":
        return f"rank {rank}: {last}; FAILED in #{rec['seq']} {_what(rec)}: {rec['error']}"
    since = rec["t_start"] or rec["t_issue"]
    return f"rank {rank}: {last}; {rec['state']} #{rec['seq']} {_what(rec)} (issued at {since:.3f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Explain neuron flight-recorder dumps.")
    parser.add_argument("paths", nargs="+", help="dump files or directories holding them")
    args = parser.parse_args(argv)
    docs = load(args.paths)
    if not docs:
        print("no flight-recorder dumps found", file=sys.stderr)
        return 2
    lines, problem = analyse(docs)
    print("\n".join(lines))
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
