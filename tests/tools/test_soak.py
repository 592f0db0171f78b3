"""The soak under faults (``python -m bench.soak``): its verdict, and a short real run on 4
network-namespace nodes (root needed, else skipped; required in CI) in which rails are cut
and heal, strangers flood the listeners, a rank is stopped and every rank gets SIGUSR1,
and training still ends with the undisturbed run's losses and nothing left behind."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest

from bench import soak

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "launch"))
import vnodes  # noqa: E402

needs_netns = pytest.mark.skipif(not vnodes.netns_available(),
                                 reason="needs root and working ip netns/veth/bridge")


def _runs():
    rep = {"threads": [], "sockets": 0, "shm": []}
    calm = {"returncode": 0, "losses": [2.5, 2.0], "reports": {0: rep, 1: rep},
            "faults": [], "errors": [], "dumps": 0, "stderr": "", "seconds": 1}
    faulted = dict(calm, faults=[{"fault": "cut", "healed_s": 0.2}, {"fault": "flood",
                                 "connections": 9}, {"fault": "stop"}, {"fault": "usr1"}],
                   dumps=2)
    return calm, copy.deepcopy(faulted)


def test_the_verdict_names_every_problem():
    calm, faulted = _runs()
    assert soak.check(calm, faulted, 2) == []
    assert "soak passed" in soak.summary(calm, faulted, [])
    faulted["losses"] = [2.5, 2.0000001]
    faulted["reports"][1] = {"threads": ["neuron-progress"], "sockets": 2, "shm": ["neuron-x"]}
    faulted["faults"] = faulted["faults"][:2]
    faulted["errors"] = ["RuntimeError: rail 10.0.0.1:5 -> 10.0.0.2:6 of pid 7 not back"]
    problems = soak.check(calm, faulted, 2)
    text = "\n".join(problems)
    assert "losses differ" in text and "rank 1 still holds threads ['neuron-progress']" in text
    assert "['stop', 'usr1']" in text and "not back" in text, text
    calm["returncode"] = 1
    assert any("undisturbed run exited 1" in p for p in soak.check(calm, faulted, 2))


@needs_netns
@pytest.mark.timeout(420)
def test_a_short_soak_passes(tmp_path):
    out = tmp_path / "soak.json"
    # (enough steps for all four kinds of fault, a cut before each, at 0.5 s apart)
    code = soak.main(["--nodes", "4", "--steps", "60", "--timeout", "300", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert code == 0, doc["problems"]
    faults = doc["faulted"]["faults"]
    kinds = [f["fault"] for f in faults]
    assert kinds.count("cut") >= 2 and set(kinds) == set(soak.FAULTS), kinds
    assert all(f["healed_s"] < soak.HEAL_SECONDS for f in faults if f["fault"] == "cut")
    assert sum(f.get("connections", 0) for f in faults) > 0
    assert doc["faulted"]["losses"] == doc["undisturbed"]["losses"] and len(
        doc["faulted"]["losses"]) == 60
