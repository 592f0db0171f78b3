"""Rails over several NICs: 2 virtual nodes (network namespaces), each with two links
(eth0, eth1 on separate bridges and subnets), ``NEURON_DIST_SOCKET_IFNAME=eth0,eth1``.
The rails alternate between the interfaces, and losing one interface in the middle of a
transfer loses no data: its rails break (``NEURON_DIST_NET_LINK_TIMEOUT``), their
traffic moves to the other interface's rails, and every collective completes exactly."""

from __future__ import annotations

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from launch import vnodes  # noqa: E402

JOB = os.path.join(REPO, "tests", "across_nodes", "nic_cut_job.py")
needs_netns = pytest.mark.skipif(not vnodes.netns_available(),
                                 reason="needs root and working ip netns/veth/bridge")


@needs_netns
@pytest.mark.timeout(240)
def test_losing_one_of_two_nics_mid_transfer_loses_nothing():
    res = vnodes.run(2, 1, [JOB], netns=True, links=2, timeout=200,
                     env={"NEURON_DIST_RAILS": "4", "NEURON_DIST_NET_LINK_TIMEOUT": "2"})
    reports = []
    for text in res.outputs:
        reports += [json.loads(line[len("NIC_JOB "):]) for line in text.splitlines()
                    if line.startswith("NIC_JOB ")]
    assert res.ok and len(reports) == 2, "\n".join(o[-3000:] for o in res.outputs)
    for r in reports:
        assert r["bad"] == [], r
        assert len(r["address"].split(",")) == 2, r  # a listener per interface
        assert len(r["rail_addrs"]) == 2, r  # the rails used both interfaces
        assert r["rails_left"] == 2, r  # the two on eth1 broke, the two on eth0 carry on
        assert r["after_cut_seconds"] < 60, r
    assert not [n for n in vnodes._list_netns() if n.startswith(f"nd{os.getpid()}_")]
