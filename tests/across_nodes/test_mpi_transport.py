"""The MPI transport and ``init_process_group`` under mpiexec, as real MPI jobs.

* ``mpi_job_transport.py`` (3 ranks): MpiTransport send/recv of 0..8 MiB, per-tag order,
  messages sent before their receive, tags beyond MPI_TAG_UB, size mismatch, timeout,
  callbacks, a subgroup, close() failing pending requests, a group creation a member never
  joins (a PeerTimeout, and the other transports keep working); at MPI thread levels MULTIPLE
  and SERIALIZED (and FUNNELED, where a transport must refuse to start).
* ``mpi_job_withdraw.py`` (2 ranks, one job a case): ``cancel`` of a receive MPI has
  matched, or of a send it has started, whose peer is stuck mid-message ends the job with
  MPI_Abort and a message naming the request instead of handing the buffer back; one whose
  peer goes on within the grace completes with the right bytes (issue 53, finding 9).
* ``mpi_job_init.py`` (4 ranks, 2 virtual nodes): ``init_process_group("neuron")`` with the
  rendezvous variables taken from MPI (no torchrun), then collectives and send/recv across
  the nodes; once with ``env_from_mpi()``, once through the env:// hook, once with the
  MPI transport between the nodes; and once with a partly pre-set environment, which must
  fail on every rank.

mpiexec runs with Hydra's fork launcher on localhost, and MPI's UCX layer is limited to
shared memory (``UCX_TLS=self,sm``), so nothing but loopback is used. Each job runs in its
own session and is killed as a whole on timeout; the test then checks that no process of
the session is left and no shared-memory file of MPI (``mpich_shm_*``) or ours
(``neuron-*``) outlives it (one left by a failed job is removed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None,
                                reason="mpi4py is not installed")

# Variables a job must not inherit: it has to get them from MPI.
_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
          "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "NEURON_DIST_NODE_NAME",
          "TORCHELASTIC_RUN_ID", "PMI_RANK", "PMI_SIZE", "PMI_FD", "OMPI_COMM_WORLD_RANK",
          "PMIX_RANK")


def _mpiexec() -> str | None:
    here = Path(sys.executable).with_name("mpiexec")
    return str(here) if here.exists() else shutil.which("mpiexec")


def _shm_files() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(("mpich_shm", "neuron-"))}
    except OSError:
        return set()


def _mapped_by_anyone(name: str) -> bool:
    """True if some process maps or holds /dev/shm/``name`` (so it is not a leftover)."""
    path = f"/dev/shm/{name}"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                if path in f.read():
                    return True
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                    return True
        except OSError:
            continue
    return False


def run_mpi(n: int, script: str, *args: str, timeout: float = 100.0,
            expect_fail: bool = False) -> tuple[str, str, float]:
    """Run ``mpiexec -n n python script args`` on loopback; (stdout, stderr, seconds).

    Fails the test on a non-zero exit (with ``expect_fail``: on a zero exit) or a timeout
    (after killing the whole job), and if a process or a shared-memory file of the job is
    left behind (after a failed job, its files are removed first).
    """
    exe = _mpiexec()
    if exe is None:
        pytest.skip("no mpiexec next to python or on PATH (pip install mpich)")
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env.update(UCX_TLS="self,sm", UCX_NET_DEVICES="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    cmd = [exe, "-launcher", "fork", "-hosts", "localhost", "-iface", "lo", "-n", str(n),
           sys.executable, str(HERE / script), *args]
    before = _shm_files()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=env, cwd=str(REPO),
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - start
    # nothing of the job may outlive it: no process in its session ...
    end = time.monotonic() + 10
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > end:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"processes of the mpiexec job {cmd} outlived it")
        time.sleep(0.1)
    # ... and no shared-memory file nobody maps any more. (MPICH always names its segment
    # /dev/shm/mpich_shm_<random>: a file that appeared while the job ran and that no
    # process maps is taken for the job's. After a failure (ours, killed or aborted) they
    # are removed; after a success they are only reported, in case another MPI job on
    # this machine left them.)
    leaked = sorted(n for n in _shm_files() - before if not _mapped_by_anyone(n))
    failed = timed_out or proc.returncode != 0
    if failed:
        for name in leaked:
            try:
                os.unlink(f"/dev/shm/{name}")
            except OSError:
                pass
    tail = f"\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-8000:]}"
    if timed_out:
        pytest.fail(f"{script} {' '.join(args)} did not finish in {timeout:.0f} s (killed){tail}")
    if expect_fail:
        assert proc.returncode != 0, f"{script} {' '.join(args)} exited 0{tail}"
        return out, err, seconds
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}{tail}"
    assert not leaked, f"shared-memory files left behind: {leaked}{tail}"
    return out, err, seconds


def _report(out: str, prefix: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"expected one {prefix!r} line in:\n{out}"
    return json.loads(lines[0][len(prefix):])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", ["multiple", "serialized", "funneled"])
def test_mpi_transport(level):
    """All checks at MPI_THREAD_MULTIPLE (mpi4py's default) and SERIALIZED (one lock for
    every transport); at FUNNELED a transport must refuse to start."""
    out, err, seconds = run_mpi(3, "mpi_job_transport.py", level, timeout=100)
    report = _report(out, "@@mpi-transport ")
    print(f"\nmpi transport ({level}): {report} (job {seconds:.1f} s)")
    assert report["thread_level"] == level, report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,what,cause", [
    ("receive", "receive from rank 0 (67108864 bytes, tag 5)",
     "PeerTimeout: withdrawn by the test"),
    ("send", "send to rank 1 (67108864 bytes, tag 6)", "PeerTimeout: withdrawn by the test"),
    ("close", "receive from rank 0 (67108864 bytes, tag 8)",
     "TransportError: closed by the test")])
def test_mpi_cancel_ends_the_job_rather_than_hand_back_a_buffer_mpi_owns(case, what, cause):
    """Issue 53, finding 9: ``cancel`` of a receive MPI has matched (``receive``), or of a
    send it has started (``send``), whose peer is stopped mid-message never returns (its
    caller would take back a buffer MPI writes into or reads), nor does ``close(error)``
    with such a receive pending (``close``): after the grace the job ends
    by MPI_Abort, with a message on stderr naming the request and saying why. No process
    and none of MPI's shared-memory files of the job are left (run_mpi removes the files
    MPI_Abort leaves; the stopped rank must be gone too)."""
    out, err, seconds = run_mpi(2, "mpi_job_withdraw.py", case, timeout=45, expect_fail=True)
    print(f"\nmpi withdraw ({case}): job {seconds:.1f} s\n{err.strip()}")
    assert "@@cancel-returned" not in out, (
        f"cancel returned, handing back a buffer MPI owned:\n{out}\n{err}")
    fatal = [line for line in err.splitlines() if line.startswith("neuron_dist FATAL")]
    assert len(fatal) == 1, err
    msg = fatal[0]
    assert f"MPI still owns the buffer of a {what}" in msg, msg
    assert "MPI cannot withdraw a matched receive or a started send" in msg, msg
    assert ("read from" if case == "send" else "write into") in msg, msg
    assert cause in msg, msg  # what ended the request
    assert "MPI_Abort" in msg and "MPI_Abort" in err.split(msg, 1)[1], err  # MPI's own note
    assert seconds < 30, seconds
    pids = [int(pid) for _, pid in re.findall(r"@@pid (\d) (\d+)", out)]  # (lines may mix)
    assert len(pids) == 2, out
    for pid in pids:  # the rank stopped mid-message too (run_mpi waited for the session)
        assert not os.path.exists(f"/proc/{pid}"), f"rank process {pid} outlived the job"


@pytest.mark.timeout(60)
def test_mpi_cancel_returns_false_when_the_stalled_peer_goes_on_within_the_grace():
    """Issue 53, finding 9: a matched receive whose sender is stopped, and let go on during
    the cancel's grace, completes: ``cancel`` returns False and the buffer holds exactly
    the bytes sent."""
    out, err, seconds = run_mpi(2, "mpi_job_withdraw.py", "resume", timeout=45)
    report = _report(out, "@@mpi-withdraw ")
    print(f"\nmpi withdraw (resume): {report} (job {seconds:.1f} s)")
    assert report["resume_cancel"] is False, report
    assert report["resume_error"] == "None", report
    assert report["resume_wrong_bytes"] == 0, report


@pytest.mark.timeout(60)
def test_mpi_abort_notice_fails_a_matched_receive_only_once_mpi_is_done_with_it():
    """Issue 53, finding 9: a peer's abort notice fails a receive MPI has matched only once
    MPI has completed it (its sender, stopped mid-message, goes on within the grace), so
    nothing lands in the buffer after the receive failed."""
    out, err, seconds = run_mpi(2, "mpi_job_withdraw.py", "notice", timeout=45)
    report = _report(out, "@@mpi-withdraw ")
    print(f"\nmpi withdraw (notice): {report} (job {seconds:.1f} s)")
    assert report["notice_receive"] == "failed: PeerAborted", report
    assert report["notice_bytes_written_after_failure"] == 0, report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["explicit", "hook", "mpi-transport"])
def test_init_process_group_under_mpiexec(mode):
    out, err, seconds = run_mpi(4, "mpi_job_init.py", mode, timeout=100)
    report = _report(out, "@@mpi-init ")
    print(f"\nmpi init ({mode}): {report} (job {seconds:.1f} s)")
    assert report["mode"] == mode
    assert report["transport"] == ("MpiTransport" if mode == "mpi-transport" else "RdmTransport")
    if mode != "hook":
        assert report["set"]["MASTER_ADDR"] == "127.0.0.1", report
        assert set(report["set"]) == {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                      "MASTER_ADDR", "MASTER_PORT"}, report


@pytest.mark.timeout(120)
def test_env_from_mpi_takes_all_from_mpi_or_none():
    """Ranks whose environment already sets some rendezvous variables to other values than
    MPI's: every rank fails naming them, instead of some ranks mixing sources."""
    out, err, seconds = run_mpi(4, "mpi_job_init.py", "clash", timeout=100)
    report = _report(out, "@@mpi-init ")
    print(f"\nmpi init (clash): {report['error']} (job {seconds:.1f} s)")


@pytest.mark.timeout(30)
def test_env_from_mpi_is_a_no_op_outside_mpi(monkeypatch):
    """Without an MPI launcher's variables nothing happens and MPI is not touched; the
    env:// hook then passes straight through to torch's handler."""
    import neuron_dist.mpi_launch as m

    for name in _SCRUB:
        monkeypatch.delenv(name, raising=False)
    assert not m.launched_by_mpi()
    assert m.env_from_mpi() is None
    assert "RANK" not in os.environ
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert m.launched_by_mpi()
    assert m.env_from_mpi() is None  # RANK and WORLD_SIZE already set: left alone
    assert not m._wants_mpi_env("env://")  # RANK set
    monkeypatch.delenv("RANK")
    assert m._wants_mpi_env("env://")
    assert not m._wants_mpi_env("env://?rank=0&world_size=1")  # rank given by the caller


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,n", [("3x1", 3), ("2x2", 4), ("uneven", 3)])
def test_mpi_collectives_between_nodes(layout, n):
    """With the MPI transport the network phases are MPI's own collectives (net_mpi.py):
    every dtype and op right, the same bits on every rank, ``mpi`` in the flight recorder,
    and a call another rank did not make fails on every rank (see mpi_job_collectives.py)."""
    out, err, seconds = run_mpi(n, "mpi_job_collectives.py", layout, timeout=280)
    report = _report(out, "@@mpi-coll ")
    print(f"\nmpi collectives ({layout}): {report} (job {seconds:.1f} s)")
    assert report["layout"] == layout
