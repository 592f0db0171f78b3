"""torchrun --max-restarts: after a rank dies, the survivors fail fast with a clear error,
torchrun restarts every worker, and the new attempt builds a fresh neuron group and runs.
The survivors hold off the agent's SIGTERM until they have reported their error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "restart_job.py")


@pytest.mark.timeout(180)
def test_torchrun_max_restarts_recovers(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", "1", "--monitor-interval", "3", JOB, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Both survivors of the first attempt reported (they ignore the agent's SIGTERM until
    # they have), each failing with the dead rank named.
    for rank in (0, 2):
        path = tmp_path / f"attempt0-rank{rank}.json"
        assert path.exists(), f"survivor rank {rank} of the first attempt did not report"
        rep = json.loads(path.read_text())
        assert rep["error"] and "PeerDiedError" in rep["error"] and "rank 1 (pid" in rep["error"], rep
    for r in range(3):
        rep = json.loads((tmp_path / f"attempt1-rank{r}.json").read_text())
        assert rep == {"sum": 6.0, "world": 3}, rep
