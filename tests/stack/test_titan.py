"""TorchTitan's llama3 debugmodel, FSDP2 x TP (2 x 2), trained on CPU over ``neuron``.

``launch/titan.py`` runs under ``python -m torch.distributed.run`` with 4 ranks
(``data_parallel_shard_degree=2``, ``tensor_parallel_degree=2``) for a few steps with a
short sequence and a small batch, on a tokenizer and dataset it generates (no download).
The losses TorchTitan reports must be finite and fall, every process group of the mesh
must be a ``neuron`` group, and every step must have moved data through it.

Skipped only when TorchTitan is not installed (``pip install -e .[titan]``; the ``test``
extra that CI installs includes it).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
# One launch: 4 interpreters importing torch + TorchTitan on 2 cores (~20 s), a first step
# of ~6 s, then ~3 s per step on an idle machine. The bound leaves room for a loaded one.
LAUNCH_TIMEOUT = 240


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_titan_llama3_fsdp2_tp_trains_on_neuron(tmp_path):
    out = tmp_path / "metrics.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "launch/titan.py", "--steps", str(STEPS), "--dp-shard", "2", "--tp", "2",
           "--seq-len", "64", "--batch-size", "4",
           "--assets-dir", str(tmp_path / "assets"), "--dump-folder", str(tmp_path / "out"),
           "--metrics-out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # Own session, so that on timeout torchrun and all its workers are killed together.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"

    metrics = json.loads(out.read_text())
    # The neuron backend carried everything: the default group and each mesh group.
    assert metrics["backend"] == "neuron" and metrics["mesh_backends"] == ["neuron"], metrics
    assert "backend=neuron" in stdout
    assert (metrics["world_size"], metrics["dp_shard"], metrics["tp"]) == (4, 2, 2)
    assert metrics["flavor"] == "debugmodel"
    assert all(s["comm_calls"] > 0 and s["comm_bytes"] > 0 for s in metrics["steps"]), metrics

    losses = metrics["losses"]
    assert len(losses) == STEPS, losses
    assert all(math.isfinite(x) for x in losses), losses
    # Fixed seed: every step lowers the loss; over 5 steps it falls by well over 0.5.
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.5, losses
