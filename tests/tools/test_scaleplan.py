"""The scale plan (bench/scaleplan.py): the table's all_reduce among P nodes,
simulated, against a ring and a tree."""

from __future__ import annotations

import json

import pytest

from bench import scaleplan


@pytest.mark.timeout(120)
def test_scaleplan_runs_and_log_depth_wins(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert scaleplan.main(["--nodes", "8,64", "--sizes", "8,1M", "--ring-sim-max", "8",
                           "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["nodes"], r["nbytes"]) for r in rows} == {(8, 8), (64, 8), (8, 1 << 20),
                                                        (64, 1 << 20)}
    for r in rows:
        assert r["neuron"]["source"] == "simulated"
        assert r["ring"]["source"] == ("simulated" if r["nodes"] <= 8 else "cost model")
        assert r["neuron"]["time_s"] < r["ring"]["time_s"], r
        assert r["neuron"]["peers"] == r["nodes"].bit_length() - 1  # log2 P peers
    small = {r["nodes"]: r for r in rows if r["nbytes"] == 8}
    assert small[64]["neuron_algorithm"] == "recursive_doubling"
    assert small[64]["neuron"]["hops"] == 6 and small[64]["ring"]["hops"] == 126
    assert png.stat().st_size > 10_000
    assert "ring/neuron" in capsys.readouterr().out
