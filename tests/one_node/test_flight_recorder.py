"""The flight recorder dumps on failure and its analyser names the rank that is behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from helpers.harness import run_ranks


def rank_two_skips_a_collective(rank, world, out_dir):
    os.environ["NEURON_DIST_FR_DIR"] = out_dir
    os.environ["RANK"] = str(rank)
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    if rank == 2:
        time.sleep(3)  # never issues collective #4 in time ...
        os.kill(os.getpid(), signal.SIGUSR1)  # ... and is asked for its dump, as a user would
        return None
    try:
        dist.all_gather_into_tensor(torch.empty(3 * world), torch.ones(3))
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__
    return "no error"


def test_timeout_dumps_and_analyser_names_the_rank_behind(tmp_path):
    out = str(tmp_path)
    res = run_ranks(rank_two_skips_a_collective, 3, out, timeout=60, pg_timeout=1.0)
    assert res[0] == res[1] == "PeerTimeoutError"
    dumps = sorted(p for p in os.listdir(out) if p.startswith("neuron-fr-rank"))
    assert {d.split("-pid")[0] for d in dumps} == {"neuron-fr-rank0", "neuron-fr-rank1",
                                                  "neuron-fr-rank2"}, dumps
    proc = subprocess.run([sys.executable, "-m", "neuron_dist.fr_analyze", out],
                          capture_output=True, text=True, timeout=60)
    report = proc.stdout
    assert proc.returncode == 1, report + proc.stderr
    assert "BEHIND: rank(s) [2] never issued #4" in report, report
    assert "FAILED in #4 all_gather(float32, 9 elements)" in report, report
    assert "last completed #3 all_reduce(float32, 4 elements, SUM)" in report, report


def mismatch(rank, world, out_dir, cwd):
    # No NEURON_DIST_FR_DIR: the dumps go to the temp directory (here $TMPDIR), not to the
    # working directory; RANK is wrong on purpose: the dump names the process group's rank.
    os.environ.pop("NEURON_DIST_FR_DIR", None)
    os.environ["TMPDIR"] = out_dir
    tempfile.tempdir = None  # gettempdir() reads $TMPDIR again
    os.environ["RANK"] = "7"
    os.chdir(cwd)
    dist.all_reduce(torch.ones(2))
    try:
        dist.all_reduce(torch.ones(5 if rank else 4))
    except Exception:  # noqa: BLE001
        pass
    from neuron_dist.flight_recorder import recorder
    return recorder.dump("test")


def test_analyser_reports_mismatched_calls(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    paths = run_ranks(mismatch, 2, str(tmp_path), str(cwd), timeout=60)
    assert os.listdir(cwd) == [], "a dump went to the working directory"
    for rank in (0, 1):
        assert os.path.dirname(paths[rank]) == str(tmp_path), paths
        assert os.path.basename(paths[rank]).startswith(f"neuron-fr-rank{rank}-pid"), paths
        with open(paths[rank]) as f:
            assert json.load(f)["rank"] == rank
    proc = subprocess.run([sys.executable, "-m", "neuron_dist.fr_analyze", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "MISMATCH at #2: rank 0 called all_reduce(float32, 4 elements, SUM); " \
           "rank 1 called all_reduce(float32, 5 elements, SUM)" in proc.stdout, proc.stdout
