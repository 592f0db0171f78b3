"""Nothing outlives a job: no ``neuron-*`` name in /dev/shm and no process, however it ends.

Each scenario runs one whole job in a fresh interpreter (``python job.py``): the job
imports torch once, then ``os.fork``s its ranks. A forked rank runs its part and then
*falls off the end of the script*, so it exits through the normal interpreter shutdown
(atexit handlers, joining of non-daemon threads, ``__del__``), unlike the ranks of
``harness.run_ranks`` which leave with ``os._exit``. The job's parent:

* records every ``neuron-<uid>-<pid of one of its ranks>-*`` name it sees in the shm
  directory while the ranks run, with its mode (polled every few ms);
* reaps the ranks, SIGKILLing any still alive after a deadline (reported as "hung");
* writes all of that to ``job.json``.

Every process of a job carries a unique tag in its environment; after the job the test
scans /proc for that tag, so a leftover rank, or a process a rank started, is found even
after it was re-parented to init.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
import uuid

import pytest

JOB_DEADLINE = 40.0       # the job's parent SIGKILLs ranks still running after this
SUBPROCESS_TIMEOUT = 90   # the test kills the whole job after this

JOB = r'''
import json, os, signal, stat, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist

mode, world, out, pg_timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
deadline_s = float(sys.argv[5])
shm_dir = os.environ.get("NEURON_DIST_SHM_DIR", "/dev/shm")
VICTIM = 1


def report(rank, **kv):
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(kv, f)
    os.replace(path + ".tmp", path)


def rank_main(rank):
    store = dist.FileStore(os.path.join(out, "store"), world)
    if mode == "destroy" and rank == world - 1:
        # Rank 0 keeps the segment's name until every rank attached. Delaying init would not
        # widen that window (rank 0 creates the segment only once all ranks posted their
        # node identity), so this rank attaches 1 s late and the parent can see the name.
        import neuron_dist.rendezvous as rv

        class SlowAttach(rv.Segment):
            @classmethod
            def attach(cls, name, size, **kwargs):
                time.sleep(1.0)
                return super().attach(name, size, **kwargs)

        assert callable(getattr(rv.Segment, "attach", None))
        rv.Segment = SlowAttach
    dist.init_process_group("neuron", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    assert dist.get_backend() == "neuron"
    if mode == "sigkill" and rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.full((1000,), float(rank + 1))
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
    except Exception as exc:
        report(rank, error=f"{type(exc).__name__}: {exc}", took=time.monotonic() - t0)
        raise  # the failure kills the script, as it would a user's
    got = t[0].item()
    if mode == "exception":
        if rank == VICTIM:
            report(rank, sum=got)
            raise RuntimeError(f"boom from rank {rank}")
        t0 = time.monotonic()
        try:
            dist.barrier()  # the victim never comes: it died of its exception
        except Exception as exc:
            report(rank, sum=got, error=f"{type(exc).__name__}: {exc}", took=time.monotonic() - t0)
            raise
        report(rank, sum=got, error=None)
        return
    if mode == "destroy":
        dist.destroy_process_group()
        assert not dist.is_initialized()
    report(rank, sum=got)
    # mode "exit": leave without destroy_process_group


pids = []
for r in range(world):
    pid = os.fork()
    if pid == 0:
        rank_main(r)
        sys.exit(0)  # a normal interpreter exit (an exception above exits through it too)
    pids.append(pid)

with open(os.path.join(out, "pids.json"), "w") as f:
    json.dump(pids, f)
prefixes = tuple(f"neuron-{os.getuid()}-{p}-" for p in pids)
seen = {}
status = {}
hung = []
deadline = time.monotonic() + deadline_s
while len(status) < world:
    try:
        for name in os.listdir(shm_dir):
            if name.startswith(prefixes) and name not in seen:
                try:
                    seen[name] = stat.S_IMODE(os.stat(os.path.join(shm_dir, name)).st_mode)
                except FileNotFoundError:
                    pass
    except OSError:
        pass
    for r, p in enumerate(pids):
        if r in status:
            continue
        got, st = os.waitpid(p, os.WNOHANG)
        if got:
            status[r] = os.waitstatus_to_exitcode(st)
    if time.monotonic() > deadline:
        for r, p in enumerate(pids):
            if r not in status:
                hung.append(r)
                os.kill(p, signal.SIGKILL)
                status[r] = os.waitstatus_to_exitcode(os.waitpid(p, 0)[1])
    time.sleep(0.003)

with open(os.path.join(out, "job.json"), "w") as f:
    json.dump({"status": status, "hung": hung, "seen": seen, "pids": pids}, f)
'''


def _neuron_names(d="/dev/shm"):
    try:
        return {n for n in os.listdir(d) if n.startswith("neuron-")}
    except OSError:
        return set()


def _tagged_processes(tag: str) -> list[str]:
    """Live processes (not zombies) whose environment carries ``tag``."""
    found = []
    needle = f"NEURON_TEST_JOB_TAG={tag}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                st = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            state = st[st.rindex(b")") + 2:st.rindex(b")") + 3]
            if state not in (b"Z", b"X"):
                found.append(f"pid {entry}: {st[:st.rindex(b')') + 3].decode(errors='replace')}")
    return found


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("NEURON_DIST_") and k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_job(tmp_path, mode: str, world: int = 2, pg_timeout: float = 10.0, shm_dir=None):
    """Run one job; return (job.json, {rank: rank json}, stderr). Checks nothing survived.
    ``shm_dir``: the job's NEURON_DIST_SHM_DIR (default /dev/shm)."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / f"out-{mode}"
    out.mkdir()
    tag = uuid.uuid4().hex
    before = _neuron_names()
    try:
        proc = subprocess.run(
            [sys.executable, str(script), mode, str(world), str(out), str(pg_timeout),
             str(JOB_DEADLINE)],
            env=_clean_env(NEURON_TEST_JOB_TAG=tag, NEURON_DIST_FR_DIR=str(tmp_path),
                           **({"NEURON_DIST_SHM_DIR": str(shm_dir)} if shm_dir else {})),
            capture_output=True, text=True,
            timeout=SUBPROCESS_TIMEOUT)
    finally:
        # whatever happened, nothing of the job may still run
        deadline = time.monotonic() + 5
        left = _tagged_processes(tag)
        while left and time.monotonic() < deadline:  # exiting processes may need a moment
            time.sleep(0.05)
            left = _tagged_processes(tag)
        for line in left:
            try:
                os.kill(int(line.split()[1].rstrip(":")), 9)
            except OSError:
                pass
    assert not left, f"{mode}: processes of the job still running after it ended: {left}"
    assert proc.returncode == 0, f"{mode}: job parent failed ({proc.returncode}):\n{proc.stderr}"
    job = json.loads((out / "job.json").read_text())
    job["status"] = {int(k): v for k, v in job["status"].items()}
    assert not job["hung"], (f"{mode}: ranks {job['hung']} did not exit within {JOB_DEADLINE} s "
                             f"(SIGKILLed by the job):\n{proc.stderr[-4000:]}")
    ranks = {}
    for r in range(world):
        f = out / f"rank{r}.json"
        if f.exists():
            ranks[r] = json.loads(f.read_text())
    uid = os.getuid()
    mine = {n for n in _neuron_names() if any(n.startswith(f"neuron-{uid}-{p}-") for p in job["pids"])}
    assert not mine, f"{mode}: segments of this job left in /dev/shm: {sorted(mine)}"
    new = _neuron_names() - before
    assert not new, f"{mode}: new neuron-* names in /dev/shm after the job: {sorted(new)}"
    for name, mode_bits in job["seen"].items():
        assert mode_bits == 0o600, f"{mode}: segment {name} had mode {oct(mode_bits)}, expected 0o600"
    return job, ranks, proc.stderr


def test_normal_exit_without_destroy_leaves_nothing(tmp_path):
    job, ranks, err = run_job(tmp_path, "exit")
    assert job["status"] == {0: 0, 1: 0}, (job, err[-4000:])
    assert ranks == {0: {"sum": 3.0}, 1: {"sum": 3.0}}, ranks


def test_destroy_leaves_nothing_and_segment_is_private_while_it_exists(tmp_path):
    job, ranks, err = run_job(tmp_path, "destroy")
    assert job["status"] == {0: 0, 1: 0}, (job, err[-4000:])
    assert ranks == {0: {"sum": 3.0}, 1: {"sum": 3.0}}, ranks
    # rank 1 attached 1 s late, so the job saw rank 0's segment under its name
    uid, creator = os.getuid(), job["pids"][0]
    assert len(job["seen"]) == 1, job["seen"]
    name, mode_bits = next(iter(job["seen"].items()))
    assert re.fullmatch(rf"neuron-{uid}-{creator}-[0-9]+-[0-9]+-[0-9a-f]{{16}}", name), name
    assert mode_bits == 0o600, oct(mode_bits)


def test_exception_that_kills_a_rank_leaves_nothing_and_peers_fail(tmp_path):
    job, ranks, err = run_job(tmp_path, "exception", pg_timeout=10.0)
    assert job["status"] == {0: 1, 1: 1}, (job, err[-4000:])
    assert "RuntimeError: boom from rank 1" in err, err[-4000:]
    assert ranks[1] == {"sum": 3.0}, ranks
    # rank 0 was in a barrier when rank 1 died: it fails by name, long before its timeout
    assert ranks[0]["sum"] == 3.0 and ranks[0]["error"], ranks
    e = ranks[0]["error"]
    assert ("PeerDiedError" in e or "GroupAbortedError" in e) and "rank 1" in e, ranks[0]
    assert ranks[0]["took"] < 10.0, ranks[0]


def test_sigkilled_rank_peers_fail_within_timeout_and_leave_nothing(tmp_path):
    pg_timeout = 10.0
    job, ranks, err = run_job(tmp_path, "sigkill", world=3, pg_timeout=pg_timeout)
    assert job["status"][1] == -9, job
    assert job["status"][0] == 1 and job["status"][2] == 1, (job, err[-4000:])
    assert 1 not in ranks, ranks
    for r in (0, 2):
        e = ranks[r]["error"]
        assert ("PeerDiedError" in e or "GroupAbortedError" in e) and "rank 1" in e, (r, e)
        assert ranks[r]["took"] < pg_timeout, (r, ranks[r])


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_leftover_segment_of_dead_creator_is_swept(tmp_path):
    """The next job sweeps a segment whose creator is gone, judged by (PID namespace, pid,
    start time): a dead pid, or a live pid that started at another time (reused), is gone;
    a segment of another PID namespace is never judged (its pids mean nothing here)."""
    from neuron_dist.transport.shm import procid

    uid, ns, me = os.getuid(), procid.pid_namespace(), os.getpid()
    started = procid.start_time(me)
    dead = f"neuron-{uid}-{_dead_pid()}-{ns}-{started}-deadbeefdeadbeef"
    reused = f"neuron-{uid}-{me}-{ns}-{started - 1}-{uuid.uuid4().hex[:16]}"  # our pid, not us
    alive = f"neuron-{uid}-{me}-{ns}-{started}-{uuid.uuid4().hex[:16]}"  # creator (us) runs
    foreign = f"neuron-{uid}-{_dead_pid()}-{ns + 1}-{started}-{uuid.uuid4().hex[:16]}"
    # a directory of its own: other jobs on this machine (older code) sweep /dev/shm too
    shm = tmp_path / "shm"
    shm.mkdir()
    paths = {n: os.path.join(shm, n) for n in (dead, reused, alive, foreign)}
    for p in paths.values():
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.write(fd, b"\0" * 4096)
        os.close(fd)
    try:
        job, ranks, err = run_job(tmp_path, "exit", shm_dir=shm)
        assert job["status"] == {0: 0, 1: 0}, (job, err[-4000:])
        assert not os.path.exists(paths[dead]), f"{dead} (creator pid dead) was not swept"
        assert not os.path.exists(paths[reused]), f"{reused} (pid reused) was not swept"
        assert os.path.exists(paths[alive]), f"{alive} (creator alive) was swept"
        assert os.path.exists(paths[foreign]), f"{foreign} (another PID namespace) was swept"
    finally:
        for p in paths.values():
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def test_process_identity_survives_pid_reuse_and_pid_namespaces():
    """procid: a pid with another start time is not the process; the node identity differs
    between PID namespaces (so ranks never watch pids of another namespace)."""
    import shutil

    from neuron_dist.config import Settings
    from neuron_dist.topology import node_identity
    from neuron_dist.transport.shm import procid

    me = os.getpid()
    assert procid.alive(me) and procid.alive(me, procid.start_time(me))
    assert not procid.alive(me, procid.start_time(me) + 1)
    assert not procid.alive(_dead_pid()) and procid.start_time(_dead_pid()) == 0
    here = node_identity(Settings.from_env())
    assert here.endswith(f"/{procid.pid_namespace()}")
    if os.geteuid() == 0 and shutil.which("unshare"):  # CI runs as root
        code = ("from neuron_dist.config import Settings; "
                "from neuron_dist.topology import node_identity; "
                "from neuron_dist.transport.shm import procid; "
                "print(node_identity(Settings.from_env()), procid.pid_namespace(), "
                "procid.start_time(1))")
        env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                              "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        other, other_ns, _ = out.stdout.split()
        assert int(other_ns) != procid.pid_namespace()
        assert other != here, "two PID namespaces looked like one node"


# ------------------------------------------------------------- unit level (no job)
def test_segment_create_is_private_exclusive_and_swept(tmp_path):
    import torch  # noqa: F401  (first; see test_init_methods.test_import_neuron_dist_before_torch_is_silent)
    from neuron_dist.transport.shm import segment as seg

    d = str(tmp_path)
    old = os.umask(0)  # the mode must come from the code, not from a restrictive umask
    try:
        s = seg.Segment.create(seg.new_segment_name(), 8192, directory=d)
    finally:
        os.umask(old)
    try:
        path = tmp_path / s.name
        ns, started = seg.procid.pid_namespace(), seg.procid.start_time(os.getpid())
        assert ns and started
        assert re.fullmatch(rf"neuron-{os.getuid()}-{os.getpid()}-{ns}-{started}-[0-9a-f]{{16}}",
                            s.name), s.name
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        assert st.st_size == 8192
        with pytest.raises(seg.ShmSetupError, match="cannot create"):
            seg.Segment.create(s.name, 8192, directory=d)  # O_EXCL: never reuse someone's name
        # the creator is alive: a sweep keeps it
        assert seg.sweep_leftovers(d) == []
        assert path.exists()
        s.unlink()
        assert not path.exists()
    finally:
        s.close()
    assert os.listdir(tmp_path) == []


def test_attach_refuses_what_the_job_did_not_create(tmp_path):
    """A name from the store is only followed to a private segment of this user: an absolute
    path or other directory, a symbolic link, another user's file and a 0666 file of the
    right size are each refused with an error naming the problem, before anything is mapped."""
    import torch  # noqa: F401  (first; see test_init_methods.test_import_neuron_dist_before_torch_is_silent)
    from neuron_dist.transport.shm import segment as seg

    d = str(tmp_path)
    size = 8192
    good = seg.Segment.create(seg.new_segment_name(), size, directory=d)
    try:
        seg.Segment.attach(good.name, size, directory=d).close()  # the real thing attaches

        for name in (str(tmp_path / good.name), f"../{tmp_path.name}/{good.name}",
                     "/etc/passwd", "neuron-0-1-../../x", ""):
            with pytest.raises(seg.ShmSetupError, match="not a name this backend makes"):
                seg.Segment.attach(name, size, directory=d)

        link = seg.new_segment_name()
        os.symlink(tmp_path / good.name, tmp_path / link)
        with pytest.raises(seg.ShmSetupError, match="symbolic link"):
            seg.Segment.attach(link, size, directory=d)

        def planted(mode, uid=None):
            name = seg.new_segment_name()
            fd = os.open(tmp_path / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                os.fchmod(fd, mode)
                if uid is not None:
                    os.fchown(fd, uid, -1)
            finally:
                os.close(fd)
            return name

        with pytest.raises(seg.ShmSetupError, match="mode 0666, expected 0600"):
            seg.Segment.attach(planted(0o666), size, directory=d)
        with pytest.raises(seg.ShmSetupError, match="mode 0640, expected 0600"):
            seg.Segment.attach(planted(0o640), size, directory=d)
        if os.geteuid() == 0:  # only root can plant a file owned by someone else (CI is root)
            with pytest.raises(seg.ShmSetupError, match="owned by uid 65534"):
                seg.Segment.attach(planted(0o600, uid=65534), size, directory=d)
        os.mkfifo(tmp_path / (fifo := seg.new_segment_name()), 0o600)
        with pytest.raises(seg.ShmSetupError, match="not a regular file"):
            seg.Segment.attach(fifo, size, directory=d)
    finally:
        good.close()


def _init_only(rank, world):
    return "initialised"


def test_a_refused_segment_fails_every_rank_at_once(monkeypatch):
    """The creator's segment is made 0666 after creation (as someone loosening it would): the
    other rank refuses it, and both ranks fail at once with that reason (not after the
    group's timeout, and not in the probe that follows the attach)."""
    import torch  # noqa: F401
    from helpers.harness import run_ranks
    from neuron_dist.transport.shm import segment as seg

    create = seg.Segment.create

    def loosened(name, size, *args, **kwargs):
        s = create(name, size, *args, **kwargs)
        os.chmod(s.path, 0o666)
        return s

    monkeypatch.setattr(seg.Segment, "create", loosened)  # inherited by the forked ranks
    start = time.monotonic()
    res = run_ranks(_init_only, 2, timeout=40, pg_timeout=30, expect_errors=True)
    elapsed = time.monotonic() - start
    for rank in (0, 1):
        assert res[rank][0] == "error", res
        assert "mode 0666, expected 0600" in res[rank][2], res[rank]
    assert "a peer refused this node's shared-memory segment" in res[0][2], res[0]
    assert elapsed < 15, f"the refusal took {elapsed:.1f} s to reach every rank"
