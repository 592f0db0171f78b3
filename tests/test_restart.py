"""torchrun --max-restarts: after a rank dies, the survivors fail fast with a clear error,
torchrun restarts every worker, and the new attempt builds a fresh neuron group and runs.
The agent polls every 3 s, so the survivors usually see the death before it stops them."""

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
    first = {r: json.loads((tmp_path / f"attempt0-rank{r}.json").read_text()) for r in (0, 2)
             if (tmp_path / f"attempt0-rank{r}.json").exists()}
    # The agent may stop the survivors before they notice (it polls every 3 s); those
    # that noticed must have failed with the dead rank named (tests/test_failures.py
    # checks the detection itself).
    for rank, rep in first.items():
        assert rep["error"] and "PeerDiedError" in rep["error"] and "rank 1" in rep["error"], rep
    for r in range(3):
        rep = json.loads((tmp_path / f"attempt1-rank{r}.json").read_text())
        assert rep == {"sum": 6.0, "world": 3}, rep
