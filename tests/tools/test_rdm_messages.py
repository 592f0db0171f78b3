"""The rdm per-message tool runs and reports every cell (bench/rdm_messages.py)."""

from __future__ import annotations

import re

from bench import rdm_messages


def test_it_reports_cpu_and_calls_per_message_for_every_cell(capsys):
    assert rdm_messages.main(["--sizes", "8,70000", "--rails", "1,2", "--messages", "200",
                              "--calls"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line and not line.startswith("#") and not line.lstrip().startswith("path")]
    cells = {(" ".join(r[:-3]), int(r[-3])) for r in rows}
    assert cells == {(p, n) for p in ("raw TCP", "rdm x1", "rdm x2") for n in (8, 70000)}, rows
    for r in rows:
        cpu, calls = float(r[-2]), float(r[-1])
        assert cpu > 0 and calls >= 1, r
    assert all(re.fullmatch(r"[\d.]+", r[-1]) for r in rows)
