"""The main-job benchmark (``python -m bench.mainjob``): its arithmetic, and one
tiny real run (network namespaces: root needed, else skipped; required in CI)."""

from __future__ import annotations

import json
import math
import os
import sys
from types import SimpleNamespace

import pytest

from bench import mainjob

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "launch"))
import vnodes  # noqa: E402

needs_netns = pytest.mark.skipif(not vnodes.netns_available(),
                                 reason="needs root and working ip netns/veth/bridge")


def test_report_compares_with_gloo_and_counts_communication_above_the_floor():
    args = SimpleNamespace(argv=[], nodes=2, nproc_per_node=2, steps=(6, 30), reps=1,
                           train_args="--dim 128")
    res = {"neuron": {"tokens_s": 1800, "cpu_per_step_s": 1.25, "threads": 5, "sockets": 6},
           "gloo": {"tokens_s": 1500, "cpu_per_step_s": 1.5, "threads": 11, "sockets": 9},
           "null": {"tokens_s": 3000, "cpu_per_step_s": 1.0}}
    text = mainjob.report(res, args)
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.split() and line.split()[0] in res}
    assert rows["neuron"][2] == "1.20x" and rows["null"][2] == "2.00x"
    assert rows["neuron"][4] == "0.250" and rows["gloo"][4] == "0.500"
    assert rows["null"][4] == "-"
    assert rows["neuron"][5:7] == ["5", "6"] and rows["gloo"][5:7] == ["11", "9"]
    assert rows["null"][5:7] == ["-", "-"]  # (not reported by that run)
    assert "null (no communication at all) reaches 2.00x gloo's tokens/s" in text
    res["floor"] = {"tokens_s": 2000, "cpu_per_step_s": 1.2}
    text = mainjob.report(res, args)
    assert "floor (every collective's bytes moved, nothing else) reaches 1.33x gloo's " \
           "tokens/s; neuron 0.90x the floor's" in text
    res["floor_inside"] = {"tokens_s": 1875, "cpu_per_step_s": 1.22}
    res["floor_between"] = {"tokens_s": 1920, "cpu_per_step_s": 1.21}
    text = mainjob.report(res, args)
    assert "# floor_inside (the floor for the groups inside a node, neuron for the others): " \
           "neuron reaches 0.96x its tokens/s" in text
    assert "# floor_between (the floor for the groups between nodes, neuron for the " \
           "others): neuron reaches 0.94x its tokens/s" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.split() and line.split()[0] in res}
    assert rows["floor_between"][1:3] == ["1920", "1.28x"], rows


@needs_netns
def test_mainjob_tiny_run(tmp_path):
    out = tmp_path / "mainjob.json"
    assert mainjob.main(["--backends", "null", "--steps", "1,2", "--timeout", "240",
                         "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    null = doc["results"]["null"]
    assert null["tokens_s"] > 0 and math.isfinite(null["cpu_per_step_s"])
    (r,) = null["rounds"]
    assert r["short"]["cpu_s"] > 0 and r["long"]["cpu_s"] > 0  # every process was counted
    # rank 0 said what it held after its last step: its threads, and sockets (the store's)
    assert null["threads"] >= 1 and null["sockets"] >= 1
    assert r["long"]["threads"] == null["threads"]


def test_a_failed_run_is_run_again_and_reported(monkeypatch):
    calls = []

    def run_once(backend, steps, args):
        calls.append((backend, steps))
        if backend == "gloo" and len([c for c in calls if c[0] == "gloo"]) == 1:
            raise RuntimeError("main job with gloo (--steps 6) failed (exit -6):\nabort")
        return {"tokens_s": 1000, "cpu_s": float(steps), "wall_s": 1.0}

    monkeypatch.setattr(mainjob, "run_once", run_once)
    args = SimpleNamespace(argv=[], backends=["neuron", "gloo"], steps=(6, 30), reps=1,
                           retries=1, nodes=2, nproc_per_node=2, train_args="")
    res = mainjob.measure(args)
    assert calls.count(("gloo", 6)) == 2 and calls.count(("neuron", 6)) == 1
    assert res["gloo"]["failures"] == ["main job with gloo (--steps 6) failed (exit -6):\nabort"]
    assert res["neuron"]["failures"] == []
    assert "# gloo: a run failed and was run again: main job with gloo" in mainjob.report(res, args)

    def always_fails(backend, steps, args):
        raise RuntimeError(f"main job with {backend} failed")

    monkeypatch.setattr(mainjob, "run_once", always_fails)
    with pytest.raises(RuntimeError, match="main job with neuron failed"):
        mainjob.measure(args)
    with pytest.raises(SystemExit):  # (argparse names the problem on stderr)
        mainjob.main(["--retries", "-1"])
