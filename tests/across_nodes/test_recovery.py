"""The main job survives the death of a data-parallel replica (launch/recovery.py).

``launch/train.py --dp-mode replicate --kill-replica 1 --kill-at-step 3`` on 2 virtual
nodes x 2 ranks (dp=2 x tp=2: replica 1 is node 1): both ranks of node 1 SIGKILL
themselves at step 3, node 0's ranks see ``PeerDiedError`` naming the rank, shrink the
world to themselves and finish. Their losses must equal the single-process reference that
drops replica 1's rows from step 3 on, to the README's 5e-7; the recovery must be quick;
nothing may be left behind (tests/conftest.py checks /dev/shm and child processes,
launch/vnodes.py removes its namespaces and processes, checked here).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from launch.reference import losses_match, reference_losses  # noqa: E402
from launch.train import parse_config  # noqa: E402

STEPS, KILL_AT, TOLERANCE = 5, 3, 5e-7  # README.md: the main job matches to 5e-7
RECOVERY_BOUND = 10.0  # seconds from the death to training again (measured: under 1 s)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("netns", [True, False], ids=["netns", "loopback"])
def test_survivors_of_a_killed_replica_finish_training_like_the_reference(tmp_path, netns):
    from launch import vnodes
    if netns and not vnodes.netns_available():
        pytest.skip("needs root and working ip netns/veth/bridge")
    out = tmp_path / "metrics.json"
    argv = ["launch/train.py", "--dp-mode", "replicate", "--steps", str(STEPS),
            "--kill-replica", "1", "--kill-at-step", str(KILL_AT), "--metrics-out", str(out)]
    # node 1's agent fails when its ranks die; node 0's survivors must get the time to
    # finish, and once they have written their metrics node 0's agent only waits in
    # torchrun's exit barrier for node 1's agent, so the run is stopped there.
    res = vnodes.run(2, 2, argv, netns=netns, timeout=200, grace=150, cwd=str(ROOT),
                     stop_when=out.exists)
    text = "\n".join(res.outputs)
    assert res.node_returncodes[1] != 0 and res.failed_node == 1, text[-4000:]
    assert out.exists(), text[-5000:]
    # the survivors saw the death as PeerDiedError naming the peer, and excluded replica 1
    failed = re.search(r"recovery: step 3 failed ([0-9.]+) s after the death: PeerDiedError: "
                       r".*rank 1 .*", text)
    assert failed, text[-4000:]
    shrunk = re.search(r"recovery: excluded ranks \[2, 3\]; world shrunk to 2 ranks "
                       r"\(dp=1 tp=2\) ([0-9.]+) s after the death", text)
    assert shrunk and float(shrunk.group(1)) < RECOVERY_BOUND, text[-4000:]
    assert re.search(r"recovery: training again: step 3 done [0-9.]+ s after the death", text)
    metrics = json.loads(out.read_text())
    assert metrics["world_size"] == 2 and metrics["dp"] == 1 and metrics["tp"] == 2
    cfg = parse_config(["--steps", str(STEPS)])
    expected = reference_losses(cfg, drop_replica=(1, KILL_AT, 2))
    assert len(metrics["losses"]) == STEPS
    assert losses_match(metrics["losses"], expected, rtol=TOLERANCE, atol=TOLERANCE), \
        (metrics["losses"], expected)
    # and the drop shows: the run that keeps replica 1 differs from step 3 on
    kept = reference_losses(cfg)
    assert not losses_match(metrics["losses"][KILL_AT - 1:], kept[KILL_AT - 1:],
                            rtol=1e-4, atol=1e-4)
    if netns:
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not [ns for ns in res.namespaces if ns in left], left
