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
    assert net_calls.main(["--nodes", "3", "--calls", "40", "--timeout", "240"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line and not line.startswith("#") and not line.lstrip().startswith("rank")]
    assert [int(r[0]) for r in rows] == [0, 1, 2], rows
    for r in rows:
        calls, cpu, wall = map(float, r[1:])
        assert calls >= 20 and cpu > 0 and wall > 0, r  # (a send and a receive at least)
