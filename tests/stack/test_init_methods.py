"""``init_process_group("neuron")`` works however the job is started.

* torchrun (env://) with a script that never imports neuron_dist: torch's ``torch.backends``
  entry point registers the backend at ``import torch``;
* ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``: a clear "Unknown backend" error without the import,
  success after an explicit ``import neuron_dist`` (world size 1, file://);
* ``torch.multiprocessing.spawn`` (spawn start method: children re-import the script) with
  tcp:// and then, in the same processes after destroy_process_group, file://.

Every launch re-imports torch (seconds each on a small machine), so there are few of them
and each checks several things. Each rank checks ``get_backend()``, one all_reduce, one
all_gather_object and a barrier, and writes its findings to a JSON file the test reads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

LAUNCH_TIMEOUT = 120

# Shared by the scripts below: one round of checks on an initialised default group.
CHECK = '''
def check_group(tag):
    import torch
    import torch.distributed as dist
    r, w = dist.get_rank(), dist.get_world_size()
    t = torch.full((4,), float(r + 1))
    dist.all_reduce(t)
    objs = [None] * w
    dist.all_gather_object(objs, {"rank": r, "pid": os.getpid(), "tag": tag})
    dist.barrier()
    return {"tag": tag, "rank": r, "world": w, "backend": dist.get_backend(),
            "pg_backend": dist.get_backend(dist.group.WORLD), "all_reduce": t.tolist(),
            "gathered": [(o["rank"], o["tag"]) for o in objs],
            "distinct_pids": len({o["pid"] for o in objs})}
'''


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("NEURON_DIST_") and k not in (
               "TORCH_DEVICE_BACKEND_AUTOLOAD", "MASTER_ADDR", "MASTER_PORT", "RANK",
               "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _run(cmd, env, cwd):
    try:
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as exc:  # subprocess.run killed it
        pytest.fail(f"{cmd} did not finish within {LAUNCH_TIMEOUT} s\nstdout:\n{exc.stdout}\n"
                    f"stderr:\n{exc.stderr}")


def _expect_round(res, tag, rank, world):
    expected_sum = float(world * (world + 1) // 2)
    assert res["tag"] == tag and res["rank"] == rank and res["world"] == world, res
    assert res["backend"] == "neuron" and res["pg_backend"] == "neuron", res
    assert res["all_reduce"] == [expected_sum] * 4, res
    assert res["gathered"] == [[k, tag] for k in range(world)], res
    assert res["distinct_pids"] == world, res


# ----------------------------------------------------------------------- torchrun
TORCHRUN_SCRIPT = '''
import json, os, sys

import torch
import torch.distributed as dist
''' + CHECK + '''
autoloaded = "neuron_dist" in sys.modules   # torch's entry point did it, not us
dist.init_process_group("neuron")            # env:// from torchrun
res = check_group("env")
res["autoloaded"] = autoloaded
res["env_rank"] = int(os.environ["RANK"])
dist.destroy_process_group()
sys.stdout.write("NEURON-RESULT " + json.dumps(res) + "\\n")  # one write: lines never interleave
sys.stdout.flush()
'''


def test_torchrun_env_init_without_importing_neuron_dist(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    assert "neuron_dist" not in TORCHRUN_SCRIPT.replace('"neuron_dist" in sys.modules', "")
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", "--max-restarts", "0", str(script)],
                _env(), tmp_path)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    results = [json.loads(m) for m in re.findall(r"^NEURON-RESULT (.*)$", proc.stdout, re.M)]
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout
    for res in results:
        _expect_round(res, "env", res["rank"], 2)
        assert res["env_rank"] == res["rank"], res
        assert res["autoloaded"], "neuron_dist was not autoloaded at import torch"


# ----------------------------------------- autoload off: explicit import, world size 1
NO_AUTOLOAD_SCRIPT = '''
import json, os, sys
from datetime import timedelta

import torch
import torch.distributed as dist
''' + CHECK + '''
out = sys.argv[1]
res = {"autoloaded": "neuron_dist" in sys.modules}
try:
    dist.init_process_group("neuron", init_method="file://" + os.path.join(out, "store0"),
                            rank=0, world_size=1, timeout=timedelta(seconds=30))
    res["error"] = None
except Exception as exc:
    res["error"] = f"{type(exc).__name__}: {exc}"
res["initialized_after_error"] = dist.is_initialized()

import neuron_dist  # noqa: E402  - registers the backend explicitly

dist.init_process_group("neuron", init_method="file://" + os.path.join(out, "store1"),
                        rank=0, world_size=1, timeout=timedelta(seconds=30))
res["round"] = check_group("file-ws1")
dist.destroy_process_group()
res["initialized_after_destroy"] = dist.is_initialized()
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump(res, f)
'''


def test_autoload_disabled_needs_explicit_import_and_world_size_one(tmp_path):
    script = tmp_path / "noauto.py"
    script.write_text(NO_AUTOLOAD_SCRIPT)
    proc = _run([sys.executable, str(script), str(tmp_path)],
                _env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"), tmp_path)
    assert proc.returncode == 0, f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["autoloaded"] is False, res
    # without the import: a clear error that names the backend
    err = res["error"]
    assert err is not None, "init_process_group('neuron') worked without registering the backend"
    assert "Unknown backend" in err and "neuron" in err, err
    assert res["initialized_after_error"] is False, res
    # with it: a working world-size-1 group
    _expect_round(res["round"], "file-ws1", 0, 1)
    assert res["initialized_after_destroy"] is False, res


# -------------------------------------------- mp.spawn: tcp://, then file:// in the same ranks
SPAWN_SCRIPT = '''
import json, os, socket, sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
''' + CHECK + '''

def worker(rank, world, port, out):
    # a spawned child re-imported this file as __mp_main__ to find this function
    results = []
    dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    results.append(check_group("tcp"))
    dist.destroy_process_group()
    dist.init_process_group("neuron", init_method="file://" + os.path.join(out, "filestore"),
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    results.append(check_group("file"))
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"results": results, "main": __name__}, f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    out = sys.argv[1]
    for attempt in (1, 2):  # a free port can be taken before rank 0 binds it: retry once
        try:
            mp.spawn(worker, args=(2, free_port(), out), nprocs=2, join=True,
                     start_method="spawn")
            break
        except mp.ProcessRaisedException as exc:
            if attempt == 2 or "address already in use" not in str(exc).lower():
                raise
            for name in os.listdir(out):
                os.unlink(os.path.join(out, name))
    print("spawn ok", attempt)
'''


def test_mp_spawn_with_tcp_then_file_init(tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(SPAWN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = _run([sys.executable, str(script), str(out)], _env(), tmp_path)
    assert proc.returncode == 0, f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    for rank in (0, 1):
        data = json.loads((out / f"rank{rank}.json").read_text())
        assert data["main"] == "__mp_main__", data
        tcp, file_ = data["results"]
        _expect_round(tcp, "tcp", rank, 2)
        _expect_round(file_, "file", rank, 2)


# ------------------------------------------------------------------ import order
def test_import_neuron_dist_before_torch_is_silent(tmp_path):
    code = textwrap.dedent('''
        import neuron_dist
        import torch.distributed as dist
        assert "neuron" in dist.Backend.backend_list
        print("ok")
    ''')
    proc = _run([sys.executable, "-W", "error", "-c", code], _env(), tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
