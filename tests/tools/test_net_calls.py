"""The between-nodes calls tool (``python -m bench.net_calls``): one tiny real run
(network namespaces: root needed, else skipped; required in CI)."""

from __future__ import annotations

import pytest

from bench import net_calls
from neuron_dist.launch import vnodes

needs_netns = pytest.mark.skipif(not vnodes.netns_available(),
                                 reason="needs root and working ip netns/veth/bridge")


@needs_netns
@pytest.mark.timeout(300)
def test_every_rank_reports_its_calls_and_cpu_per_collective(capsys):
    """Both backends, one table each: every rank's calls, CPU (user + system, and each
    apart: they add up), wake-ups and wall time per call."""
    assert net_calls.main(["--nodes", "3", "--calls", "40", "--timeout", "120"]) == 0
    tables, current = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("# ") and line[2:] in ("neuron", "floor"):
            current = tables[line[2:]] = []
        elif line and not line.startswith("#") and not line.lstrip().startswith("rank"):
            current.append(line.split())
    assert sorted(tables) == ["floor", "neuron"], tables
    for backend, rows in tables.items():
        assert [int(r[0]) for r in rows] == [0, 1, 2], (backend, rows)
        for r in rows:
            calls, cpu, user, system, wakeups, wall = map(float, r[1:])
            assert calls >= 10 and cpu > 0 and wall > 0, (backend, r)  # (a send, a receive)
            assert abs(user + system - cpu) <= 0.2 * cpu + 5, (backend, r)
            assert wakeups >= 0, (backend, r)
    # neuron's path (descriptors, matching, acknowledgements) makes more calls than the
    # floor's, which moves the same messages with nothing else
    assert min(float(r[1]) for r in tables["neuron"]) > max(float(r[1]) for r in tables["floor"])
