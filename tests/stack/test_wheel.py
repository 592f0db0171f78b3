"""The built wheel alone is the backend: installed into a fresh venv outside the repository,
``init_process_group("neuron")`` works (torch autoloads it through its entry point) and a
collective between two ranks gives the right answer. Nothing of the clone is on the path,
so a module the wheel forgot, or one that imports the lab (bench/, not installed), fails
here."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

JOB = r"""
import os, sys
import torch, torch.distributed as dist
rank = int(sys.argv[1])
store = dist.FileStore(sys.argv[2], 2)
dist.init_process_group("neuron", store=store, rank=rank, world_size=2)  # (no import of ours)
import neuron_dist
assert str(dist.get_backend()) == "neuron"
where = os.path.dirname(neuron_dist.__file__)
assert where.startswith(sys.prefix), where  # the installed wheel, not the clone
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
assert t.tolist() == [3.0] * 5, t
dist.destroy_process_group()
print("ok", rank, flush=True)
"""


def _clean_env() -> dict:
    """This environment without what would put the clone or a job's rendezvous in view
    (importing the lab puts the clone on PYTHONPATH: pip would then find the clone's
    metadata, take neuron-dist as installed and skip the wheel)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                        "MASTER_PORT") and not k.startswith("NEURON_DIST_")}
    env.update(OMP_NUM_THREADS="1")
    return env


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_the_wheel_installed_alone_runs_init_process_group(tmp_path):
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(wheels), str(REPO)], cwd=tmp_path, timeout=300)
    (wheel,) = wheels.glob("neuron_dist-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"neuron_dist", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                    + ".dist-info"}, tops
    assert not any(n.startswith(("bench/", "neuron_dist/bench/")) for n in names)
    assert any(n.endswith("dist-info/licenses/LICENSE") or n.endswith("dist-info/LICENSE")
               for n in names), "the wheel carries no LICENSE"

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # the same torch as this suite (the CPU build), from wherever this machine's pip gets it
    _run([python, "-m", "pip", "install", "-q", f"torch=={torch.__version__}", str(wheel)],
         cwd=tmp_path, timeout=900)
    env = _clean_env()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    store = tmp_path / "store"
    procs = [subprocess.Popen([python, str(script), str(r), str(store)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {r}" in out, f"rank {r}:\n{out}"
