"""Results out: the stdout table, the JSON document and the CSV file.

Rows come from ``sweep.make_row``. ``add_ratios`` gives every row ``vs_gloo``: gloo's median
time over this row's median time for the same (op, world, bytes) - equivalently the busbw
ratio - so > 1 means faster than gloo; None when either side is n/a or gloo was not run
(and for the null group, which is no competitor). It also gives ``x_null``: this row's
median time over the null group's (``null_pg``, a group that does nothing) for the same
(op, world, bytes), i.e. how many dispatch floors the op costs; None for null itself or
when null was not run. ``vs_mpi`` is MPI's median time over this row's, as ``vs_gloo``
(None for MPI and null themselves, or when MPI was not run).
The table is sorted by op (in the order asked), world size, bytes, then backend order.
JSON holds ``meta`` (command line, versions, machine, settings), ``results``, ``overlap``,
``shm`` and ``errors``; the CSV holds the result rows only, one per (op, world, bytes,
backend), with n/a cells left empty.
"""

from __future__ import annotations

import csv
import json
import math

CSV_FIELDS = ["op", "world", "bytes", "count", "dtype", "backend", "status", "iters", "batch",
              "time_us", "min_us", "mean_us", "algbw_gbs", "busbw_gbs", "vs_gloo", "vs_mpi",
              "x_null", "spread", "check", "note"]
NULL = "null"
MPI = "mpi"


def _times(rows: list[dict], backend: str) -> dict:
    return {(r["op"], r["world"], r["bytes"]): r["time_us"] for r in rows
            if r["backend"] == backend and r["status"] == "ok" and r["time_us"]}


def add_ratios(rows: list[dict]) -> None:
    """Set ``vs_gloo``, ``vs_mpi`` and ``x_null`` on every row (see the module docstring)."""
    gloo, null, mpi = _times(rows, "gloo"), _times(rows, NULL), _times(rows, MPI)
    for r in rows:
        key = (r["op"], r["world"], r["bytes"])
        ok = r["status"] == "ok" and r["time_us"]
        g, z, m = gloo.get(key), null.get(key), mpi.get(key)
        r["vs_gloo"] = round(g / r["time_us"], 4) if ok and g and r["backend"] != NULL else None
        r["vs_mpi"] = (round(m / r["time_us"], 4)
                       if ok and m and r["backend"] not in (NULL, MPI) else None)
        r["x_null"] = round(r["time_us"] / z, 2) if ok and z and r["backend"] != NULL else None


def sort_rows(rows: list[dict], ops: list[str], backends: list[str]) -> list[dict]:
    def key(r):
        return (ops.index(r["op"]) if r["op"] in ops else len(ops), r["world"], r["bytes"],
                backends.index(r["backend"]) if r["backend"] in backends else len(backends))
    return sorted(rows, key=key)


def _f(v, fmt):
    width = int(fmt.split(".")[0])
    return f"{'n/a':>{width}}" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    """The stdout table; a ``spread`` column (max / min of the rounds' medians) when the rows
    combine several rounds."""
    rounds = any(r.get("spread") for r in rows)
    head = (f"{'op':>14} {'n':>2} {'bytes':>11} {'backend':>7} {'time_us':>11} {'min_us':>11} "
            f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'vs gloo':>7} {'vs mpi':>7} {'x null':>7} "
            + (f"{'spread':>6} " if rounds else "") + f"{'check':>5}")
    lines = [head, "-" * len(head)]
    prev = None
    for r in rows:
        if prev is not None and (r["op"], r["world"]) != prev:
            lines.append("")
        prev = (r["op"], r["world"])
        ratio = "-" if r.get("vs_gloo") is None else f"{r['vs_gloo']:.2f}x"
        vs_mpi = "-" if r.get("vs_mpi") is None else f"{r['vs_mpi']:.2f}x"
        floor = "-" if r.get("x_null") is None else f"{r['x_null']:.1f}x"
        spread = "-" if r.get("spread") is None else f"{r['spread']:.2f}"
        line = (f"{r['op']:>14} {r['world']:>2} {r['bytes']:>11} {r['backend']:>7} "
                f"{_f(r['time_us'], '11.1f')} {_f(r['min_us'], '11.1f')} "
                f"{_f(r['algbw_gbs'], '10.3f')} {_f(r['busbw_gbs'], '10.3f')} {ratio:>7} "
                f"{vs_mpi:>7} {floor:>7} " + (f"{spread:>6} " if rounds else "")
                + f"{r['check']:>5}")
        if r["status"] != "ok" or r["check"] == "FAIL":
            line += f"  {r['note']}"
        lines.append(line)
    if not rows:
        lines.append("(no results)")
    return "\n".join(lines)


def overlap_table(rows: list[dict]) -> str:
    head = (f"{'backend':>7} {'n':>2} {'variant':>8} {'bytes':>10} {'matmuls':>7} "
            f"{'compute_us':>11} {'comm_us':>11} {'serial_us':>11} {'overlap_us':>11} "
            f"{'overlap':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['backend']:>7} {r['world']:>2} {r['variant']:>8} {r['bytes']:>10} "
                     f"{r['matmuls']:>7} {r['compute_us']:11.1f} {r['comm_us']:11.1f} "
                     f"{r['serial_us']:11.1f} {r['overlapped_us']:11.1f} "
                     f"{r['overlap_ratio']:7.2f}" + (f"  {r['note']}" if r.get("note") else ""))
    return "\n".join(lines)


def shm_lines(entries: list[dict]) -> list[str]:
    out = []
    for e in entries:
        name = f"group {e['group'] or '?'}: {e['backend']}, n={e['world']}"
        if e.get("shm_bytes") is None:
            out.append(f"{name}: {e.get('note', 'no segment')}")
        else:
            out.append(f"{name}: {e['shm_bytes']} bytes = {e['shm_bytes'] / 2**20:.2f} MiB "
                       f"(slot {e['slot_bytes'] >> 10} KiB x2, mailbox {e['mailbox_bytes'] >> 10}"
                       f" KiB per peer; README formula {e['readme_formula_bytes'] / 2**20:.2f} MiB)")
    return out


def _clean(v):
    """NaN/inf are not JSON: write them as null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(_clean(doc), f, indent=1, allow_nan=False, default=str)
        f.write("\n")


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
