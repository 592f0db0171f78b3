"""The collectives benchmark (``python -m bench``) runs end to end on a tiny sweep.

One run of the real command line (-b 8 -e 64K -f 8, 2 ranks, 3 iterations, --check) over
neuron, gloo and null (the do-nothing group: the dispatch floor), plus MPI when mpi4py and
mpiexec are there; its JSON, CSV and PNG must exist and hold a row for every op and backend,
checked for every backend but null, with neuron's time as a multiple of null's. The plot is only asserted when
matplotlib is installed (it belongs to the ``bench`` extra, not to ``test``). A few unit
tests pin the nccl-tests conventions (sizes, rounding, bus bandwidth factors), and a second
small run checks ``--rounds`` (MPI and the torch backends take turns at going first; a row
is the median of the rounds).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys

import pytest

from bench import mpi_runner
from bench.sweep import (OPS, bandwidths, combine_rounds, element_count,
                                     make_row, ops_per_sample, parse_size, plan, size_range,
                                     time_iterations)

OP_NAMES = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv"]


def test_sweep_conventions():
    assert parse_size("256M") == 256 << 20 and parse_size("64K") == 65536 and parse_size("8") == 8
    assert size_range(8, 65536, 8) == [8, 64, 512, 4096, 32768]
    assert size_range(8, 64, 2) == [8, 16, 32, 64]
    # chunked ops round to whole chunks, never below one element per rank
    assert element_count("all_gather", 8, 4, 4) == 4 and element_count("all_gather", 100, 4, 4) == 24
    assert element_count("all_reduce", 8, 4, 4) == 2
    assert plan("all_to_all", [8, 16], 4, 4) == [4]          # both sizes round to 16 bytes
    alg, bus = bandwidths("all_reduce", 10**9, 1.0, 4)
    assert alg == 1.0 and bus == pytest.approx(1.5)
    assert OPS["all_gather"].bus_factor(4) == pytest.approx(0.75)
    assert OPS["broadcast"].bus_factor(8) == OPS["send_recv"].bus_factor(2) == 1.0


def test_samples_time_batches_of_operations():
    """Small sizes time several operations per barrier (the same count on every rank: it
    depends on the size only); a sample is their mean."""
    assert ops_per_sample(8) == 16 and ops_per_sample(256 << 10) == 16
    assert ops_per_sample(1 << 20) == 4 and ops_per_sample(4 << 20) == 1
    assert ops_per_sample(1 << 30) == 1 and ops_per_sample(8, max_batch=1) == 1
    calls = {"run": 0, "barrier": 0, "prepare": 0}

    def count(name):
        return lambda: calls.__setitem__(name, calls[name] + 1)
    samples = time_iterations(count("run"), count("barrier"), 3, count("prepare"), batch=4)
    assert len(samples) == 3 and calls == {"run": 12, "barrier": 3, "prepare": 3}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One run of the command line shared by the tests below."""
    tmp_path = tmp_path_factory.mktemp("bench")
    backends = ["neuron", "gloo", "null", "shmfloor"]
    if mpi_runner.unavailable_reason() is None:
        backends.append("mpi")
    files = {k: tmp_path / f"bench.{k}" for k in ("json", "csv", "png")}
    cmd = [sys.executable, "-m", "bench", "-b", "8", "-e", "64K", "-f", "8",
           "-n", "2", "--iters", "3", "--warmup", "1", "--check", "--ops", ",".join(OP_NAMES),
           "--backends", ",".join(backends), "--json", str(files["json"]),
           "--csv", str(files["csv"]), "--plot", str(files["png"]),
           "--timeout", "90", "--stall-timeout", "60", "--pg-timeout", "30"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    return proc, files, backends


def test_bench_tiny_sweep(bench_run):
    proc, files, backends = bench_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    # stdout: the table; stderr: one progress line per (op, size)
    assert "busbw GB/s" in proc.stdout and "# check:" in proc.stdout
    assert "0 FAIL" in proc.stdout, proc.stdout
    assert "[all_reduce 8 B n=2] neuron" in proc.stderr, proc.stderr

    doc = json.loads(files["json"].read_text())
    rows = doc["results"]
    assert not doc["errors"], doc["errors"]
    for op in OP_NAMES:
        for b in backends:
            mine = [r for r in rows if r["op"] == op and r["backend"] == b]
            assert len(mine) == 5, (op, b, mine)   # 8, 64, 512, 4K, 32K bytes
            for r in mine:  # (in-place ops repeat on their results: checked apart)
                assert r["status"] == "ok" and r["check"] == ("-" if b == "null" else "OK"), r
                assert r["time_us"] > 0 and r["busbw_gbs"] >= 0 and r["world"] == 2
                assert r["batch"] == 16, r
            if b == "gloo":
                assert all(r["vs_gloo"] == pytest.approx(1.0) for r in mine)
            if b == "null":
                assert all(r["x_null"] is None and r["vs_gloo"] is None for r in mine)
            else:  # every table shows the floor: the other backends as multiples of it
                assert all(r["x_null"] > 0 for r in mine), mine
    assert " x null " in proc.stdout and " null " in proc.stdout

    with open(files["csv"], newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows) == len(OP_NAMES) * len(backends) * 5
    assert {(r["op"], r["backend"]) for r in csv_rows} == {(o, b) for o in OP_NAMES for b in backends}
    assert all(r["check"] == ("-" if r["backend"] == "null" else "OK") for r in csv_rows)
    assert all(r["x_null"] for r in csv_rows if r["backend"] == "neuron")

    from bench.summary import summarise
    text = summarise([("bench.json", doc)])
    assert "smallest: neuron over the null floor" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| all_reduce | 2 |"))
    assert "null" in line and "x (" in line.split("|")[-2], line
    assert "; shmfloor " in line.split("|")[-2], line  # the shared-memory floor beside it


def test_bench_plot(bench_run):
    proc, files, _ = bench_run
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in proc.stderr, proc.stderr
        pytest.skip("matplotlib not installed: plot not checked (pip install 'neuron-dist[bench]')")
    assert proc.returncode == 0, proc.stderr
    png = files["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_rounds_combine_into_the_median_of_their_medians():
    """A row of several rounds: the median of the rounds' medians, the fastest sample of
    any round, bandwidth from the combined time, the spread; a round that failed a check
    or could not run the op decides the row."""
    def row(t_us, backend="neuron", check="OK", op="all_reduce"):
        s = t_us / 1e6
        return make_row(op, 2, backend, 256, "float32", 5, check=check,
                        times={"median_s": s, "min_s": s / 2, "mean_s": s * 1.5})
    rounds = [[row(10.0), row(100.0, "mpi", "-")], [row(30.0), row(50.0, "mpi", "-")],
              [row(20.0), row(70.0, "mpi", "-")]]
    rows = {r["backend"]: r for r in combine_rounds(rounds)}
    ours, mpi = rows["neuron"], rows["mpi"]
    assert ours["time_us"] == 20.0 and ours["min_us"] == 5.0 and ours["mean_us"] == 30.0
    assert ours["rounds_us"] == [10.0, 30.0, 20.0] and ours["spread"] == 3.0
    assert ours["busbw_gbs"] == pytest.approx(bandwidths("all_reduce", 1024, 20e-6, 2)[1])
    assert mpi["time_us"] == 70.0 and mpi["check"] == "-" and mpi["spread"] == 2.0
    from bench import report
    report.add_ratios(list(rows.values()))
    assert ours["vs_mpi"] == 3.5 and mpi["vs_mpi"] is None
    assert " vs mpi " in report.table([ours, mpi]) and "spread" in report.table([ours])

    failed = combine_rounds([[row(10.0)], [row(12.0, check="FAIL")], [row(11.0)]])[0]
    assert failed["check"] == "FAIL" and failed["time_us"] == 11.0
    na = make_row("all_reduce", 2, "neuron", 256, "float32", 5, note="rank 1: boom")
    missing = combine_rounds([[row(10.0)], [na]])[0]
    assert missing["status"] == "n/a" and missing["note"] == "rank 1: boom"
    assert missing["rounds_us"] is None and missing["time_us"] is None
    partial = combine_rounds([[row(10.0)], [], [row(30.0)]])[0]  # round 2's run failed
    assert partial["time_us"] == 20.0 and partial["rounds_us"] == [10.0, 30.0]
    assert partial["note"] == "in 2 of 3 rounds"


@pytest.mark.timeout(150)
def test_bench_rounds_alternate_who_goes_first(tmp_path):
    """``--rounds 2``: MPI runs after the torch backends in round 1 and before them in
    round 2, and every row holds both rounds' medians."""
    if mpi_runner.unavailable_reason() is not None:
        pytest.skip(f"MPI: {mpi_runner.unavailable_reason()}")
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "-b", "8", "-e", "64", "-f", "8", "-n", "2",
         "--iters", "2", "--warmup", "1", "--ops", "all_reduce,send_recv", "--rounds", "2",
         "--backends", "neuron,mpi", "--json", str(out), "--timeout", "90",
         "--stall-timeout", "60", "--pg-timeout", "30"],
        capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    starts = [ln for ln in proc.stderr.splitlines() if ln.startswith("== n=2")]
    assert [("mpi" in ln, ln.rsplit("(round ", 1)[1]) for ln in starts] == [
        (False, "1 of 2)"), (True, "1 of 2)"), (True, "2 of 2)"), (False, "2 of 2)")], starts
    doc = json.loads(out.read_text())
    assert doc["meta"]["rounds"] == 2 and "taking turns" in doc["meta"]["timing"]
    rows = doc["results"]
    assert len(rows) == 2 * 2 * 2  # ops x sizes x backends
    for r in rows:
        assert r["status"] == "ok" and len(r["rounds_us"]) == 2, r
        assert r["time_us"] == pytest.approx(sum(r["rounds_us"]) / 2, rel=1e-3)
        assert (r["vs_mpi"] is None) == (r["backend"] == "mpi"), r
    assert " spread " in proc.stdout and " vs mpi " in proc.stdout
    from bench.summary import summarise
    text = summarise([("r.json", doc)])
    assert "Neuron against MPI from 64 KiB" not in text  # (no size reaches 64 KiB here)


def test_mpi_baseline_uses_torch_memory():
    """MPI's buffers are torch's memory (numpy's allocator would give arrays of 4 MiB and
    more transparent huge pages, which no torch backend gets), filled as the pattern says."""
    import torch
    case = mpi_runner._Case(None, None, "all_gather", 1 << 20, 1, 2, "float32")
    for buf in (case.inp, case.out):
        assert isinstance(buf.base, torch.Tensor) and buf.dtype.name == "float32"
    assert case.inp.size == case.p.in_count and case.out.size == case.p.out_count
    case.reset()
    assert case.check() is not None  # (nothing gathered: the check names a mismatch)


def test_summary_against_mpi_from_64k():
    """The summary's MPI table: neuron's ratio to MPI at every size from 64 KiB, with the
    rounds' spread, the floor's ratio where it ran, how many points are at MPI's level, and
    which reach MPI's fastest round."""
    from bench import report
    from bench.summary import summarise
    rows = []
    for nbytes, ours, theirs, floor, best in ((32 << 10, 50.0, 10.0, 5.0, 9.0),
                                              (64 << 10, 40.0, 20.0, 25.0, 15.0),
                                              (256 << 10, 50.0, 100.0, 40.0, 45.0)):
        for backend, t in (("neuron", ours), ("mpi", theirs), ("shmfloor", floor)):
            rows.append({"op": "broadcast", "world": 2, "bytes": nbytes, "backend": backend,
                         "status": "ok", "time_us": t, "busbw_gbs": 1.0, "spread": 1.25,
                         "rounds_us": [t, best, t] if backend == "mpi" else [t] * 3})
    report.add_ratios(rows)
    meta = {"command": "c", "cores": 2, "torch": "t", "mpi": {"mpi_library": "MPICH"},
            "rounds": 3}
    text = summarise([("r.json", {"meta": meta, "results": rows})])
    assert ("| broadcast | 2 | 64 KiB 0.50 / 1.25 (0.80), 256 KiB 2.00 / 1.25 (2.50) "
            "| 1 of 2 | 1 of 2 |") in text, text
    assert "At MPI's level at 1 of 2 points." in text and "median of 3 rounds" in text
    assert "shmfloor is at 1 of the 2 points where it ran." in text, text
    # 256 KiB: MPI's median is 100 but its fastest round 45, faster than neuron's 50
    assert "neuron's median is at its level at 0 of 2." in text, text


@pytest.mark.timeout(120)
def test_layers_times_every_layer_of_the_express_lane(tmp_path):
    """``bench.layers`` times each layer of the small-collective path, and ``null`` beside
    them, for both ops; the layers nest (each loop calls the one below), so the whole
    call takes longer than its step alone, and the report lists every layer."""
    from bench.layers import LAYERS, report
    for world in (1, 2):
        path = tmp_path / f"layers{world}.json"
        out = subprocess.run([sys.executable, "-m", "bench.layers", "-n",
                              str(world), "--calls", "300", "--rounds", "2", "--json",
                              str(path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        doc = json.loads(path.read_text())
        assert doc["world"] == world and sorted(doc["us_per_call"]) == ["all_reduce", "broadcast"]
        for op, times in doc["us_per_call"].items():
            assert set(times) == set(LAYERS) | {"null"}, times
            assert all(v > 0 for v in times.values()), times
            assert times["whole"] > times["channel"] and times["whole"] > times["null"], times
        assert report(doc["us_per_call"], world) in out.stdout


def test_hotloop_runs_and_summarises(tmp_path):
    for nodes in (1, 2):  # 2: virtual nodes, so the inter-node transport on loopback
        out = subprocess.run([sys.executable, "-m", "bench.hotloop", "-n", "2",
                              "--nodes", str(nodes), "--seconds", "0.3", "--thread-cpu"],
                             capture_output=True, text=True, timeout=100)
        assert out.returncode == 0, out.stderr
        assert f"neuron all_reduce 8 B, 2 rank(s) on {nodes} node(s):" in out.stdout
        assert "us per operation" in out.stdout
        for rank in (0, 1):
            lines = [x for x in out.stdout.splitlines()
                     if x.startswith(f"rank {rank} CPU per operation")]
            assert len(lines) == 1, out.stdout
            line = lines[0]
            assert "MainThread " in line, line
            if nodes == 2:  # the waiting thread reads the rails itself: no reader threads
                assert "neuron-rdm-r" not in line, line
    # --threads 0: torch's default thread count, as a script that sets nothing gets
    out = subprocess.run([sys.executable, "-m", "bench.hotloop", "-n", "2",
                          "--threads", "0", "--bytes", "262144", "--seconds", "0.3"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "neuron all_reduce 262144 B, 2 rank(s) on 1 node(s):" in out.stdout
    from bench.hotloop import _cpu_line, thread_cpu
    assert "MainThread" in thread_cpu()
    line = _cpu_line(3, {"a": (1.0, 0.5)}, {"a": (1.2, 0.6), "b": (0.0, 0.1), "c": (0, 0)}, 1000)
    assert line == "rank 3 CPU per operation, user+system us by thread: a 200+100, b 0+100"
    raw = tmp_path / "prof.txt"
    raw.write_text("main (x.py:1);_rank (bench/hotloop.py:62);f (a.py:3) 3\n"
                   "main (x.py:1);_rank (bench/hotloop.py:62);g (b.py:4) 1\n"
                   "main (x.py:1);import (z.py:9) 5\n")  # outside the loop: not counted
    from bench.hotloop import summarise
    text = summarise(str(raw))
    assert text.startswith("4 samples in the loop")
    assert " 75.0%  f (a.py:3)" in text and " 25.0%  g (b.py:4)" in text


def test_null_floor_ratios_and_summary_without_null():
    """x_null is a row's time over null's for the same (op, world, bytes); a run without
    null (the committed results) summarises as before, with no floor column."""
    from bench import report
    from bench.summary import summarise

    def row(backend, t):
        return {"op": "all_reduce", "world": 2, "bytes": 8, "backend": backend, "status": "ok",
                "time_us": t, "busbw_gbs": 0.001}
    rows = [row("neuron", 12.0), row("gloo", 240.0), row("null", 3.0)]
    report.add_ratios(rows)
    ratios = {r["backend"]: (r["vs_gloo"], r["x_null"]) for r in rows}
    assert ratios == {"neuron": (20.0, 4.0), "gloo": (1.0, 80.0), "null": (None, None)}
    meta = {"command": "c", "cores": 2, "torch": "t", "mpi": None}
    with_null = summarise([("r.json", {"meta": meta, "results": rows})])
    assert "4.0x (12 us = null 3.0 us + 9 us)" in with_null
    without = summarise([("r.json", {"meta": meta, "results": rows[:2]})])
    assert "null" not in without and without.splitlines()[2].count("|") == 6


def test_summary_into_docs_performance_matches_results(tmp_path):
    """docs/performance.md's tables are what ``summary --into`` makes from the committed
    results (the command that file quotes), and a file without the markers is refused."""
    from pathlib import Path

    from bench import summary
    root = Path(__file__).resolve().parents[2]
    doc = root / "docs" / "performance.md"
    command = ("python -m bench.summary --into docs/performance.md "
               "results/bench-n2.json results/bench-n4.json")
    assert command in doc.read_text(), "docs/performance.md no longer quotes its command"
    copy = tmp_path / "performance.md"
    copy.write_text(doc.read_text())
    summary.main(["--into", str(copy), str(root / "results/bench-n2.json"),
                  str(root / "results/bench-n4.json")])
    # the tables name the result files as passed: compare with the repository-relative names
    assert copy.read_text().replace(f"{root}/", "") == doc.read_text(), \
        "docs/performance.md's tables differ from the committed results: rerun the command"
    bare = tmp_path / "bare.md"
    bare.write_text("no markers here\n")
    with pytest.raises(SystemExit, match="has no <!-- perf:start -->"):
        summary.main(["--into", str(bare), str(root / "results/bench-n2.json")])


def _shm_floor_checks(rank, world, slot_bytes):
    import glob

    import torch
    import torch.distributed as dist

    from bench import shm_floor_pg
    shm_floor_pg.SLOT_BYTES = slot_bytes  # (small: the single-copy paths from 4 KiB on)
    shm_floor_pg.register()
    g = dist.new_group(backend=shm_floor_pg.BACKEND_NAME)
    got = {"sums": [], "bcast": [], "gather": [], "rs": [], "a2a": [], "p2p": []}
    for i in range(5):  # both slots, each used again
        x = torch.full((3,), float(rank + 1 + i))
        dist.all_reduce(x, group=g)
        got["sums"].append(x.tolist())
    for root in range(world):
        b = torch.full((4,), float(rank * 10))
        dist.broadcast(b, root, group=g)
        got["bcast"].append(b.tolist())
    n = 1 << 16  # 256 KiB of float32 per rank: more than a cache line, less than a slot
    for i in range(3):
        out = torch.empty(world * n)
        dist.all_gather_into_tensor(out, torch.full((n,), float(rank + i)), group=g)
        got["gather"].append([out[k * n:(k + 1) * n].unique().tolist() for k in range(world)])
        inp = torch.arange(world * n, dtype=torch.float32) + rank * i
        rs = torch.empty(n)
        dist.reduce_scatter_tensor(rs, inp, group=g)
        got["rs"].append(bool(torch.equal(
            rs, world * torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32)
            + i * world * (world - 1) / 2)))
        a2a = torch.empty(world * 5)
        dist.all_to_all_single(a2a, torch.arange(world * 5, dtype=torch.float32) + 100 * rank,
                               group=g)
        got["a2a"].append(a2a.tolist())
    if rank < 2:  # a ping-pong of 3 messages, the mailbox used again each time
        peer = 1 - rank
        for i in range(3):
            t = torch.full((n,), float(10 * i + rank))
            if rank == 0:
                dist.send(t, peer, group=g)
                dist.recv(t, peer, group=g)
            else:
                dist.recv(t, peer, group=g)
                got["p2p"].append(t.unique().tolist())
                dist.send(t + 1, peer, group=g)
            if rank == 0:
                got["p2p"].append(t.unique().tolist())
    big = torch.arange(world * n + 3, dtype=torch.float32) * (rank + 1)  # uneven blocks
    dist.all_reduce(big, group=g)
    got["big_sum"] = bool(torch.equal(
        big, torch.arange(world * n + 3, dtype=torch.float32) * (world * (world + 1) / 2)))
    dist.barrier(group=g)
    try:
        dist.all_reduce(torch.ones(4, 4).t(), group=g)
    except ValueError as exc:
        got["strided"] = str(exc)
    left = glob.glob("/dev/shm/neuron-shmfloor-*")
    dist.destroy_process_group(g)
    return got, left


@pytest.mark.timeout(90)
@pytest.mark.parametrize("slot_bytes", [1 << 20, 4096], ids=["slots", "single-copy"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_shared_memory_floor_moves_the_right_bytes(world, slot_bytes):
    """bench/shm_floor_pg.py: the benchmarks' one-node floor is a real (if minimal) backend."""
    from helpers.harness import run_ranks
    for rank, (got, left) in run_ranks(_shm_floor_checks, world, slot_bytes,
                                       timeout=80).items():
        base = world * (world + 1) / 2
        assert got["sums"] == [[base + world * i] * 3 for i in range(5)], (rank, got)
        assert got["bcast"] == [[root * 10.0] * 4 for root in range(world)], (rank, got)
        assert got["gather"] == [[[float(k + i)] for k in range(world)] for i in range(3)], got
        assert got["rs"] == [True] * 3, (rank, got["rs"])
        want = [float(5 * rank + j + 100 * k) for k in range(world) for j in range(5)]
        assert got["a2a"] == [want] * 3, (rank, got["a2a"])
        if rank == 0:  # what came back: rank 1 added one to what it got
            assert got["p2p"] == [[10.0 * i + 1] for i in range(3)], got["p2p"]
        if rank == 1:
            assert got["p2p"] == [[10.0 * i] for i in range(3)], got["p2p"]
        assert got["big_sum"], rank
        assert "contiguous tensors only" in got["strided"], got  # a clear error
        assert left == [], left  # unlinked once every rank had mapped it


def test_mainjob_names_why_a_run_failed():
    from bench.mainjob import failure_reason
    torchrun = ["[vnode1] Root Cause (first observed failure):", "[vnode1] [0]:",
                "[vnode1]   exitcode  : -6 (pid: 9031)  (SIGABRT)",
                "[vnodes] vnode1 failed first; exit codes: vnode0=-9, vnode1=1"]
    assert failure_reason(torchrun) == "exitcode : -6 (pid: 9031) (SIGABRT)"
    raised = ["[vnode0] Traceback (most recent call last):", '[vnode0]   File "x.py", line 1',
              "[vnode0] neuron_dist.errors.PeerTimeoutError: all_reduce #3 timed out",
              "[vnodes] vnode0 failed first"]
    assert failure_reason(raised) == "neuron_dist.errors.PeerTimeoutError: all_reduce #3 timed out"
    assert failure_reason(["[vnode0] step 1 | loss 4.8"]) == ""


def _job_floor_checks(rank, world):
    import torch
    import torch.distributed as dist

    from bench import job_floor_pg
    job_floor_pg.register()
    # ranks 0, 1 on node "a", rank 2 on "b": [0, 1] is a shared-memory group, the others TCP
    whole = dist.new_group(backend=job_floor_pg.BACKEND_NAME)
    pair = dist.new_group([0, 1], backend=job_floor_pg.BACKEND_NAME)
    cross = dist.new_group([1, 2], backend=job_floor_pg.BACKEND_NAME)
    kinds = {name: type(g).__name__  # (a Python process group is the group itself)
             for name, g in (("whole", whole), ("pair", pair), ("cross", cross))
             if rank in dist.get_process_group_ranks(g)}
    got = {"kinds": kinds}
    for name, g in (("whole", whole), ("pair", pair), ("cross", cross)):
        members = dist.get_process_group_ranks(g)
        if rank not in members:
            continue
        n_g, me = len(members), members.index(rank)
        res = got[name] = {}
        x = torch.full((5,), float(rank + 1))
        dist.all_reduce(x, group=g)
        res["sum"] = x.tolist()
        n = 1 << 16  # 256 KiB per rank: more than the sockets take without a reader
        for i in range(2):
            out = torch.empty(n_g * n)
            dist.all_gather_into_tensor(out, torch.full((n,), float(rank + i)), group=g)
            res.setdefault("gather", []).append(
                [out[k * n:(k + 1) * n].unique().tolist() for k in range(n_g)])
            inp = torch.arange(n_g * n, dtype=torch.float32) + rank
            rs = torch.empty(n)
            dist.reduce_scatter_tensor(rs, inp, group=g)
            res.setdefault("rs", []).append(bool(torch.equal(
                rs, n_g * torch.arange(me * n, (me + 1) * n, dtype=torch.float32)
                + sum(members))))
        outs = [torch.empty(3) for _ in range(n_g)]
        dist.all_gather(outs, torch.full((3,), float(rank)), group=g)
        res["list"] = [o.tolist() for o in outs]
        outs2 = [torch.empty(2 * n_g), torch.empty(n_g)]
        dist.all_gather_into_tensor(outs2[0], torch.full((2,), float(rank)), group=g)
        with dist._coalescing_manager(group=g):
            a, b = torch.full((4,), 1.0 + rank), torch.full((2,), 2.0 * rank)
            dist.all_reduce(a, group=g)
            dist.all_reduce(b, group=g)
        res["coalesced"] = [a.tolist(), b.tolist()]
        b = torch.full((4,), float(rank * 10))
        dist.broadcast(b, members[-1], group=g)
        res["bcast"] = b.tolist()
        sc = torch.empty(2)
        dist.scatter(sc, [torch.full((2,), float(k)) for k in range(n_g)]
                     if rank == members[0] else None, src=members[0], group=g)
        res["scatter"] = sc.tolist()
        dist.barrier(group=g)
        try:
            dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX, group=g)
        except ValueError as exc:
            res["max"] = str(exc)
    for name in ("pair", "cross"):
        g = {"pair": pair, "cross": cross}[name]
        if rank in dist.get_process_group_ranks(g):
            dist.destroy_process_group(g)
    dist.destroy_process_group(whole)
    return got


def _job_floor_halves(rank, world):
    import torch
    import torch.distributed as dist

    from bench import job_floor_pg
    job_floor_pg.register()
    got = {}
    for backend in (job_floor_pg.INSIDE, job_floor_pg.BETWEEN):
        # ranks 0, 1 on node "a", rank 2 on "b": [0, 1] is inside a node, the others between
        groups = {"whole": dist.new_group(backend=backend),
                  "pair": dist.new_group([0, 1], backend=backend),
                  "cross": dist.new_group([1, 2], backend=backend)}
        for name, g in groups.items():
            members = dist.get_process_group_ranks(g)
            if rank not in members:
                continue
            x = torch.full((3,), float(rank + 1))
            dist.all_reduce(x, group=g)
            out = torch.empty(len(members) * 2)
            dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), group=g)
            got[(backend, name)] = (type(g).__name__, x.tolist(), out.tolist())
        for name in ("pair", "cross", "whole"):
            if rank in dist.get_process_group_ranks(groups[name]):
                dist.destroy_process_group(groups[name])
    return got


@pytest.mark.timeout(90)
def test_the_main_jobs_floor_halves_pick_the_floor_for_one_kind_of_group_only():
    """``floor_inside`` (the floor for groups inside a node, neuron for the others) and
    ``floor_between`` (the other way round): each group gets the right kind, and works."""
    from helpers.harness import run_ranks
    nodes = ["a", "a", "b"]
    results = run_ranks(_job_floor_halves, 3, timeout=80,
                        env=lambda r: {"NEURON_DIST_NODE_NAME": nodes[r]})
    groups = {"whole": [0, 1, 2], "pair": [0, 1], "cross": [1, 2]}
    kinds = {("floor_inside", "pair"): "ShmJobFloor",
             ("floor_inside", "whole"): "ProcessGroupNeuron",
             ("floor_inside", "cross"): "ProcessGroupNeuron",
             ("floor_between", "pair"): "ProcessGroupNeuron",
             ("floor_between", "whole"): "TcpJobFloor",
             ("floor_between", "cross"): "TcpJobFloor"}
    for rank, got in results.items():
        want = {key: kind for key, kind in kinds.items() if rank in groups[key[1]]}
        assert {key: v[0] for key, v in got.items()} == want, (rank, got)
        for (backend, name), (_, total, gathered) in got.items():
            members = groups[name]
            assert total == [float(sum(m + 1 for m in members))] * 3, (rank, backend, name)
            assert gathered == [float(m) for m in members for _ in range(2)], (rank, name)


@pytest.mark.timeout(90)
def test_the_main_jobs_floor_moves_the_right_bytes():
    """bench/job_floor_pg.py (bench.mainjob's ``floor``): shared memory for a group inside a
    node, TCP for one across nodes, the collectives the main job calls on both."""
    from helpers.harness import run_ranks
    nodes = ["a", "a", "b"]
    results = run_ranks(_job_floor_checks, 3, timeout=80,
                        env=lambda r: {"NEURON_DIST_NODE_NAME": nodes[r]})
    groups = {"whole": [0, 1, 2], "pair": [0, 1], "cross": [1, 2]}
    for rank, got in results.items():
        want_kind = {"whole": "TcpJobFloor", "pair": "ShmJobFloor", "cross": "TcpJobFloor"}
        assert got["kinds"] == {k: v for k, v in want_kind.items() if rank in groups[k]}, got
        for name, members in groups.items():
            if rank not in members:
                continue
            res, n_g = got[name], len(members)
            assert res["sum"] == [float(sum(m + 1 for m in members))] * 5, (rank, name, res)
            assert res["gather"] == [[[float(m + i)] for m in members] for i in range(2)], res
            assert res["rs"] == [True, True], (rank, name)
            assert res["list"] == [[float(m)] * 3 for m in members], (rank, name, res)
            assert res["coalesced"] == [[float(sum(1 + m for m in members))] * 4,
                                        [float(sum(2 * m for m in members))] * 2], res
            assert res["bcast"] == [members[-1] * 10.0] * 4, (rank, name, res)
            assert res["scatter"] == [float(members.index(rank))] * 2, (rank, name, res)
            assert "sums only" in res["max"], (rank, name, res)


def _floor_tree_checks(rank, world):
    import torch
    import torch.distributed as dist

    from bench import floor_pg
    floor_pg.register(2)
    g = dist.new_group(backend=floor_pg.BACKEND_NAME)
    got = {}
    for n in (2, 3 << 18):  # one word; 3 MiB of floats (cut over both connections)
        x = torch.arange(n, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(x, group=g)
        got[f"sum{n}"] = bool(torch.equal(
            x, torch.arange(n, dtype=torch.float32) * sum(range(1, world + 1))))
        for root in (0, world - 2):
            y = torch.full((n,), float(rank))
            dist.broadcast(y, root, group=g)
            got[f"bcast{n}/{root}"] = bool(torch.equal(y, torch.full((n,), float(root))))
    dist.barrier(group=g)
    return got


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [3, 5])
def test_the_network_floor_runs_its_trees_right(world):
    """bench/floor_pg.py among more than two ranks: binomial-tree all_reduce, broadcast
    from any root and barrier give every rank the right bytes."""
    from helpers.harness import run_ranks
    for rank, got in run_ranks(_floor_tree_checks, world, timeout=80).items():
        assert got and all(got.values()), (rank, got)
