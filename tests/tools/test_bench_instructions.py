"""The instruction-count benchmark (``python -m bench.instructions``) runs for real.

One tiny run of the command line (null and neuron on one node, loops of 20 and 60
all_reduces, 2 rounds) under valgrind: its table and JSON must hold both rows with positive
figures, null's below neuron's, and null's rounds must agree (instructions do not depend on
load; null never waits for its peer).
The parsing of callgrind's files is pinned on hand-written ones.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.instructions import parse_dump, per_op, plan, read_dumps


@pytest.mark.timeout(260)
def test_instructions_tiny_run(tmp_path):
    out = tmp_path / "instr.json"
    cmd = [sys.executable, "-m", "bench.instructions", "--run", "1:null,neuron",
           "--ops", "all_reduce", "--counts", "20,60", "--rounds", "2", "--timeout", "200",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.startswith("# python -m bench.instructions --run 1:null,neuron")
    doc = json.loads(out.read_text())
    assert doc["meta"]["command"] == proc.stdout.splitlines()[0][2:]
    assert doc["meta"]["counts"] == [20, 60] and doc["meta"]["valgrind"].startswith("valgrind")
    rows = {r["backend"]: r for r in doc["results"]}
    assert set(rows) == {"null", "neuron"} and all(r["op"] == "all_reduce" for r in rows.values())
    null, neuron = rows["null"], rows["neuron"]
    for r in (null, neuron):
        assert r["nodes"] == 1 and len(r["rounds"]) == 2, r
        assert r["instr_per_op"] == min(r["rounds"]) > 1000, r
    # counted instructions: null's rounds agree whatever the load (neuron's may differ by how
    # often its rank polled for the other one, which does depend on timing)
    assert null["spread"] < 0.03, null
    # torch's dispatch alone is thousands of instructions; neuron does real work above it
    assert 1000 < null["instr_per_op"] < neuron["instr_per_op"]
    assert null["x_null"] == pytest.approx(1.0)
    assert neuron["x_null"] == pytest.approx(neuron["instr_per_op"] / null["instr_per_op"])
    line = next(x for x in proc.stdout.splitlines()
                if x.split()[:3] == ["1", "neuron", "all_reduce"])
    assert f"{neuron['x_null']:.2f}x" in line, line


def _dump(label, ir):
    return (f"version: 1\ncreator: callgrind-3.19.0\npid: 7\ncmd: python\npart: 3\n\n"
            f"desc: I1 cache: \ndesc: Timerange: Basic block 1 - 2\n"
            f"desc: Trigger: Client Request: {label}\n\npositions: line\nevents: Ir\n"
            f"summary: {ir}\n\n\nfl=(1) x.c\nfn=(1) f\n3 {ir}\n\ntotals: {ir}\n")


def test_parse_callgrind_dumps(tmp_path):
    assert parse_dump(_dump("null all_reduce 20 r0", 4000)) == ("null all_reduce 20 r0", 4000)
    end = _dump("x", 5).replace("Client Request: x", "Program termination")
    assert parse_dump(end) == (None, 5)
    with pytest.raises(ValueError):
        parse_dump("events: Ir\n")
    loops = plan(["null", "floor"], ["all_reduce", "broadcast"], (10, 30), 2)
    assert [x[0] for x in loops if x[4] == 0] == [
        "null all_reduce 10 r0", "null all_reduce 30 r0", "floor all_reduce 10 r0",
        "floor all_reduce 30 r0", "null broadcast 10 r0", "null broadcast 30 r0"]  # floor: none
    # dump files <prefix>.<dump>-<thread>: the calling thread is 1; "-" dumps are skipped
    irs = {"null all_reduce 10 r0": 1000, "null all_reduce 30 r0": 1400,
           "null all_reduce 10 r1": 1010, "null all_reduce 30 r1": 1450}
    for i, (label, ir) in enumerate([("-", 99), *irs.items()], start=1):
        (tmp_path / f"cg.{i}-01").write_text(_dump(label, ir))
    (tmp_path / "cg.3-02").write_text(_dump("null all_reduce 30 r0", 123))
    (tmp_path / "cg-01").write_text(end)  # the dump at the end: no number, not read
    dumps = read_dumps(str(tmp_path / "cg"))
    assert dumps["null all_reduce 30 r0"] == {1: 1400, 2: 123} and "-" not in dumps
    rows = per_op(dumps, [x for x in plan(["null"], ["all_reduce"], (10, 30), 2)], (10, 30))
    assert len(rows) == 1 and rows[0]["rounds"] == [20.0, 22.0]
    assert rows[0]["instr_per_op"] == 20.0 and rows[0]["spread"] == pytest.approx(0.1)
    with pytest.raises(RuntimeError, match="no callgrind dump"):
        per_op(dumps, plan(["neuron"], ["all_reduce"], (10, 30), 1), (10, 30))
