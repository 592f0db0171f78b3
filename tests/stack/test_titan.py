"""TorchTitan's llama3 debugmodel trained on CPU over ``neuron`` through ``launch/titan.py``.

* FSDP2 x TP (2 x 2): 4 ranks under ``python -m torch.distributed.run`` for a few steps.
* Pipeline parallelism x FSDP2 (pp 2 x dp_shard 2): 4 ranks on 2 virtual nodes, so the two
  pipeline ranks sit on different nodes (TorchTitan's mesh puts ``pp`` outermost and the
  nodes hold consecutive ranks): every send/recv of the pipeline crosses the inter-node
  transport while FSDP2 stays inside a node. Its losses must equal gloo's run of the same
  configuration (one node) to 1e-5 (they agree bit for bit).
* Pipeline parallelism x FSDP2 x TP (pp 2 x dp_shard 2 x tp 2): 8 ranks on 2 virtual nodes
  x 4, the same way.

A short sequence, a small batch, a tokenizer and dataset the launcher generates (no
download, built once for the module). The losses TorchTitan reports must be finite and
fall, every process group of the mesh must be a ``neuron`` group and every step must have
moved data through it. The pipeline runs go through ``titan_p2p_probe.py``, which counts
each rank's send/recv and how many took the network. The shim that lets TorchTitan's
trainer hand torch 2.13's schedules its own microbatches is also checked on its own
against a single process.

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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STEPS = 5
PP_STEPS = 3
PP8_STEPS = 2  # the 8-rank run: one fall is enough there, each step costs ~5 s
SEQ_LEN = "64"
PROBE = "tests/stack/titan_p2p_probe.py"
# One launch: 4 interpreters importing torch + TorchTitan on 2 cores (~20 s), a first step
# of ~6 s, then ~3 s per step on an idle machine (8 ranks: ~35 s, then ~5 s per step).
# The bound leaves room for a loaded one.
LAUNCH_TIMEOUT = 240
GLOO_RTOL = 1e-5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The generated tokenizer and dataset, built once (by the first launch) for all tests."""
    return tmp_path_factory.mktemp("titan-assets")


def _torchrun(nproc: int, args: list[str]) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "launch/titan.py", *args]
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
    return stdout


def _on_two_nodes(nproc_per_node: int, args: list[str], p2p_dir: Path) -> str:
    """``launch/titan.py`` (through the send/recv probe) on 2 virtual nodes, each in its own
    network namespace where that works (else on loopback, still as separate nodes)."""
    from launch import vnodes

    p2p_dir.mkdir()
    res = vnodes.run(2, nproc_per_node, [PROBE, *args], netns=vnodes.netns_available(),
                     timeout=LAUNCH_TIMEOUT, cwd=str(ROOT),
                     env={"OMP_NUM_THREADS": "1", "TITAN_P2P_DIR": str(p2p_dir)})
    text = "\n".join(res.outputs)
    assert res.returncode == 0, f"2 virtual nodes: {' '.join(args)}: exit {res.returncode}:\n" \
                                f"{text[-8000:]}"
    return text


def _shape(metrics: dict) -> tuple:
    return metrics["world_size"], metrics["pp"], metrics["dp_shard"], metrics["tp"]


def _falls(losses: list[float], steps: int) -> None:
    assert len(losses) == steps, losses
    assert all(math.isfinite(x) for x in losses), losses
    # Fixed seed: every step lowers the loss.
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def _pipeline_crossed_nodes(metrics: dict, p2p_dir: Path, world: int) -> None:
    """The pp group of the reporting rank has one rank on each node, the others none
    between nodes, and every rank's send/recv all went over the network."""
    layouts = metrics["mesh_layouts"]
    assert layouts["pp"].startswith("2 nodes") and "rdm rail" in layouts["pp"], layouts
    for name in ("fsdp", "tp"):
        if name in layouts:
            assert layouts[name].startswith("1 node"), layouts
    counts = {p.name: json.loads(p.read_text()) for p in sorted(p2p_dir.glob("rank*.json"))}
    assert len(counts) == world, counts
    for c in counts.values():
        assert c["send"] > 0 and c["recv"] > 0, counts
        assert c["net"] == c["send"] + c["recv"], counts


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_presplit_step_shim_matches_single_process(schedule):
    """Shim 7's ``step(arg_mbs=..., target_mbs=...)`` on a single-stage and a looped
    schedule (2 ranks, tests/stack/test_pipeline.py's MLP): the losses, gradients and
    parameters of the whole-batch reference."""
    from helpers.harness import run_ranks
    from stack.test_pipeline import _check, pipeline

    _check(run_ranks(pipeline, 2, schedule, True, timeout=150))


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_titan_llama3_fsdp2_tp_trains_on_neuron(tmp_path, assets):
    out = tmp_path / "metrics.json"
    stdout = _torchrun(4, ["--steps", str(STEPS), "--dp-shard", "2", "--tp", "2",
                           "--seq-len", SEQ_LEN, "--batch-size", "4",
                           "--assets-dir", str(assets), "--metrics-out", str(out)])

    metrics = json.loads(out.read_text())
    # The neuron backend carried everything: the default group and each mesh group.
    assert metrics["backend"] == "neuron" and metrics["mesh_backends"] == ["neuron"], metrics
    assert "backend=neuron" in stdout
    assert _shape(metrics) == (4, 1, 2, 2)
    assert metrics["flavor"] == "debugmodel" and metrics["reported_by"] == 0
    assert all(s["comm_calls"] > 0 and s["comm_bytes"] > 0 for s in metrics["steps"]), metrics

    losses = metrics["losses"]
    _falls(losses, STEPS)
    # Over 5 steps it falls by well over 0.5.
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_titan_pp_fsdp2_across_two_nodes_equals_gloo(tmp_path, assets):
    """pp 2 x dp_shard 2: pipeline rank 0 (Interleaved1F1B's stages 0, 2) on node 0 (ranks
    0, 1), pipeline rank 1 (stages 1, 3) on node 1 (ranks 2, 3)."""
    args = ["--steps", str(PP_STEPS), "--pp", "2", "--dp-shard", "2", "--tp", "1",
            "--seq-len", SEQ_LEN, "--batch-size", "4", "--assets-dir", str(assets)]
    out, gloo_out = tmp_path / "metrics.json", tmp_path / "gloo.json"
    text = _on_two_nodes(2, args + ["--metrics-out", str(out)], tmp_path / "p2p")
    metrics = json.loads(out.read_text())
    assert metrics["backend"] == "neuron" and metrics["mesh_backends"] == ["neuron"], metrics
    assert _shape(metrics) == (4, 2, 2, 1)
    assert metrics["reported_by"] == 2, metrics   # the first rank holding the last stage
    assert "pp_step=pre-split" in metrics["shims"] and "Interleaved1F1B" in text
    _pipeline_crossed_nodes(metrics, tmp_path / "p2p", 4)
    _falls(metrics["losses"], PP_STEPS)

    # gloo (one node; FSDP2 reduces with SUM there, see titan_shims shim 8): same losses.
    _torchrun(4, args + ["--backend", "gloo", "--metrics-out", str(gloo_out)])
    gloo = json.loads(gloo_out.read_text())
    assert gloo["backend"] == "gloo" and gloo["reported_by"] == 2, gloo
    pair = (metrics["losses"], gloo["losses"])
    assert len(pair[1]) == PP_STEPS
    assert all(math.isclose(a, b, rel_tol=GLOO_RTOL) for a, b in zip(*pair)), pair


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_titan_pp_fsdp2_tp_eight_ranks_across_two_nodes(tmp_path, assets):
    """pp 2 x dp_shard 2 x tp 2: pipeline rank 0 on node 0 (ranks 0-3), pipeline rank 1 on
    node 1 (ranks 4-7); FSDP2 and TP inside each node."""
    out = tmp_path / "metrics.json"
    _on_two_nodes(4, ["--steps", str(PP8_STEPS), "--pp", "2", "--dp-shard", "2", "--tp", "2",
                      "--seq-len", SEQ_LEN, "--batch-size", "4", "--assets-dir", str(assets),
                      "--metrics-out", str(out)], tmp_path / "p2p")
    metrics = json.loads(out.read_text())
    assert metrics["backend"] == "neuron" and metrics["mesh_backends"] == ["neuron"], metrics
    assert _shape(metrics) == (8, 2, 2, 2)
    assert metrics["reported_by"] == 4, metrics
    assert all(s["comm_calls"] > 0 and s["comm_bytes"] > 0 for s in metrics["steps"]), metrics
    _pipeline_crossed_nodes(metrics, tmp_path / "p2p", 8)
    _falls(metrics["losses"], PP8_STEPS)
