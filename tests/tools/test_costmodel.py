"""The all_reduce cost model (``python -m bench.costmodel``): fits, formulas, CLI.

Fast and pure: the fits must recover known parameters from synthetic data, the models must
follow their documented formulas and behave sanely (monotone in size and in nodes, node
link shared by its ranks, half duplex doubling the byte term), the model's algorithm choice
must be the one ``collectives/allreduce_net.py`` makes (its selection code is run on a range of
sizes with the data movement stubbed out), and the command must run on the committed
results and print every section. Nothing here moves data between processes.
"""

from __future__ import annotations

import json
import math
import functools
import os
import shutil
import subprocess
import sys

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bench import costmodel as cm
from neuron_dist.collectives import allreduce_net
from neuron_dist.collectives.selection import (DEFAULT, HALVES_BYTES, Selection,
                                              parse_overrides)
from neuron_dist.config import parse_bytes
from neuron_dist.collectives.context import ALIGN_BYTES, Plans
from neuron_dist.collectives.net import PIGGYBACK_BYTES
from neuron_dist.topology import Topology

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "results")
def needs_results(fn):
    """The committed measurements are part of the repository: their absence is a failure."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        missing = [f for f in ("bench-n2.json", "bench-n4.json", "internode-veth.json")
                   if not os.path.exists(os.path.join(RESULTS, f))]
        assert not missing, f"committed results missing: {missing}"
        return fn(*args, **kwargs)
    return wrapped

# Parameters close to the committed fit (seconds, seconds per byte).
INTRA = cm.Intra(a_call=50e-6, a_step=85e-6, b=0.15e-9, g=0.12e-9,
                 calls={"all_reduce": 50e-6, "reduce_scatter": 140e-6, "all_gather": 120e-6})
NET = cm.Net(alpha=700e-6, beta_rank=0.84e-9, beta_link=0.84e-9, lat=1.5e-3)
M = cm.Machine(INTRA, NET)
SIZES = [2 ** k for k in range(3, 31)]           # 8 B .. 1 GiB


# ----------------------------------------------------------------------------- fits

@pytest.mark.timeout(60)
def test_fit_recovers_alpha_beta_exactly():
    alpha, beta = 250e-6, 1 / 1.5e9
    n = np.array([2 ** k for k in range(16, 29)], dtype=float)
    f = cm.fit_alpha_beta(n, alpha + n * beta)
    assert f["alpha"] == pytest.approx(alpha, rel=1e-9)
    assert f["beta"] == pytest.approx(beta, rel=1e-9)
    assert f.rms < 1e-9 and f.max_abs < 1e-9 and not any(f.pinned)


@pytest.mark.timeout(60)
def test_fit_recovers_alpha_beta_with_noise():
    rng = np.random.default_rng(7)
    alpha, beta = 400e-6, 1 / 1.2e9
    n = np.repeat(np.array([2 ** k for k in range(14, 29)], dtype=float), 5)
    t = (alpha + n * beta) * rng.lognormal(0.0, 0.05, n.size)
    f = cm.fit_alpha_beta(n, t)
    assert f["alpha"] == pytest.approx(alpha, rel=0.15)
    assert f["beta"] == pytest.approx(beta, rel=0.05)
    assert 0.02 < f.rms < 0.1
    # the truth lies within a few standard errors
    assert abs(f["alpha"] - alpha) < 4 * f.stderr[0]
    assert abs(f["beta"] - beta) < 4 * f.stderr[1]


@pytest.mark.timeout(60)
def test_fit_pins_a_negative_parameter_at_zero():
    n = np.array([2 ** k for k in range(16, 26)], dtype=float)
    t = n * 1e-9 - 20e-6 + 20e-6 * (n == n.min())   # unconstrained alpha < 0
    f = cm.fit_alpha_beta(n, t)
    assert f.pinned == [True, False]
    assert f["alpha"] == 0.0 and f["beta"] > 0


@pytest.mark.timeout(60)
def test_intra_fit_recovers_known_parameters():
    pts = [{"op": op, "bytes": n, "world": L, "t": cm.intra_predict(op, n, L, INTRA)}
           for L in (2, 4) for op in cm.INTRA_OPS for n in (8, 512, 32768, 131072, 2 << 20,
                                                             8 << 20, 32 << 20)]
    f = cm.fit_intra(pts)
    got = cm.intra_from_fit(f)
    assert got.a_call == pytest.approx(INTRA.a_call, rel=1e-6)
    assert got.a_step == pytest.approx(INTRA.a_step, rel=1e-6)
    assert got.b == pytest.approx(INTRA.b, rel=1e-6)
    assert got.g == pytest.approx(INTRA.g, rel=1e-6)
    for op in cm.INTRA_OPS:
        assert got.calls[op] == pytest.approx(INTRA.calls[op], rel=1e-6)
    assert f.rms < 1e-6


@pytest.mark.timeout(60)
def test_latency_calibration_recovers_lat():
    truth = cm.replace(NET, lat=2e-3)
    pts = [{"bytes": n, "t": cm.internode_model("neuron-4rails", n, truth, INTRA)}
           for n in (8, 128, 2048, 32768)]
    lat, rel = cm.calibrate_latency(pts, "neuron-4rails", NET, INTRA)
    assert lat == pytest.approx(2e-3, rel=1e-9)
    assert max(abs(r) for r in rel) < 1e-9


# ----------------------------------------------------------------------------- formulas

@pytest.mark.timeout(60)
def test_flat_ring_is_the_textbook_formula():
    net = cm.Net(alpha=50e-6, beta_rank=1e-9, beta_link=1e-9, lat=0.0)
    m = cm.Machine(INTRA, net)
    for P, L in ((2, 1), (16, 8), (1024, 8)):
        n = 64 << 20
        want = 2 * (P - 1) * net.alpha + 2 * (P - 1) / P * n * net.beta_rank \
            + (P - 1) / P * n * INTRA.g
        assert cm.t_flat_ring(n, P // L, L, m) == pytest.approx(want, rel=1e-12)
    # lat adds to every one of the 2(P-1) steps
    m2 = cm.Machine(INTRA, cm.replace(net, lat=1e-3))
    assert cm.t_flat_ring(1 << 20, 4, 8, m2) - cm.t_flat_ring(1 << 20, 4, 8, m) \
        == pytest.approx(2 * 31 * 1e-3)


@pytest.mark.timeout(60)
def test_single_node_counts_follow_the_code():
    L, S = 4, cm.SLOT_BYTES
    assert cm.allreduce_work(64 << 10, L) == cm.Work(1, 64 << 10, 3 * (64 << 10))
    w = cm.allreduce_work(8 << 20, L)                 # 8 chunks, 2 steps each
    assert w.steps == 16
    assert w.copied == pytest.approx((8 << 20) * (2 * L - 1) / L)
    assert w.reduced == pytest.approx((8 << 20) * (L - 1) / L)
    rs = cm.reduce_scatter_work(8 << 20, L)            # blocks of S / L per step
    assert rs.steps == math.ceil((2 << 20) / (S // L))
    ag = cm.all_gather_work(8 << 20, L)
    assert ag.steps == 2 and ag.copied == (2 << 20) + (8 << 20)


@pytest.mark.timeout(60)
def test_node_link_is_shared_by_the_ranks_of_a_node():
    x, N, L = 8 << 20, 5, 8
    # link as fast as one rank: L ranks through one link take L times one rank's time
    slow = cm.Machine(INTRA, cm.replace(NET, lat=0.0, alpha=0.0))
    assert cm.net_phase(x, N - 1, L, slow) == pytest.approx(L * (N - 1) * x * NET.beta_rank)
    # a link 100x faster: each rank's own rate is the limit
    fast = cm.Machine(INTRA, cm.replace(slow.net, beta_link=NET.beta_rank / 100))
    assert cm.net_phase(x, N - 1, L, fast) == pytest.approx((N - 1) * x * NET.beta_rank)
    # hierarchical: each of L ranks sends its slice n / L to N-1 peers, so the node link
    # carries (N-1) n per direction whatever L; the ring among nodes 2(N-1)/N n
    n = 64 << 20
    for L_ in (2, 8):
        s = cm.slice_bytes(n, L_)
        assert cm.net_phase(s, N - 1, L_, slow) == pytest.approx((N - 1) * n * NET.beta_link)
        ring = cm.ring_among(s, N, L_, slow, descriptors=False) - (N - 1) * s / N * INTRA.g
        assert ring == pytest.approx(2 * (N - 1) / N * n * NET.beta_link)


@pytest.mark.timeout(60)
def test_half_duplex_doubles_the_byte_term():
    x, peers = 4 << 20, 3
    full = cm.Machine(INTRA, cm.replace(NET, lat=0.0, alpha=0.0))
    half = cm.Machine(INTRA, cm.replace(full.net, duplex=False))
    assert cm.net_phase(x, peers, 1, half) == pytest.approx(2 * cm.net_phase(x, peers, 1, full))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", sorted(cm.MODELS))
def test_models_are_monotone_in_size_and_nodes(algo):
    f = cm.MODELS[algo]
    for L in (1, 2, 8):
        for N in (1, 2, 4, 16, 128):
            times = [f(n, N, L, M) for n in SIZES]
            assert all(b >= a for a, b in zip(times, times[1:])), (algo, L, N)
            if N * L > 1:
                assert all(t > 0 for t in times)
        for n in (8, 1 << 20, 1 << 30):
            times = [f(n, N, L, M) for N in (1, 2, 4, 8, 32, 128)]
            assert all(b >= a for a, b in zip(times, times[1:])), (algo, L, n)


@pytest.mark.timeout(60)
def test_sanity_between_algorithms():
    # one node: every two-level algorithm is the single-node one
    for algo in cm.IMPLEMENTED:
        assert cm.MODELS[algo](1 << 20, 1, 8, M) == cm.t_single(1 << 20, 8, M)
    # many nodes, large messages: the ring among nodes moves (N-1)/(2(N-1)/N) times fewer
    # bytes through each node link than the direct exchange
    n, L = 1 << 30, 8
    for N in (8, 32, 128):
        assert cm.t_hier_ring(n, N, L, M) < cm.t_hier_direct(n, N, L, M) / (N / 4)
    # leader sends the whole buffer through one rank: never faster than what the code runs
    for N in (2, 8, 64):
        code = cm.MODELS[cm.neuron_choice(64 << 20, N, L)]
        assert cm.t_leader(64 << 20, N, L, M) >= code(64 << 20, N, L, M)
    # the crossover exists and shrinks as nodes grow
    c = [cm.crossover(N, L, M) for N in (4, 16, 128)]
    assert all(c) and c[0] >= c[1] >= c[2]


@pytest.mark.timeout(60)
def test_neuron_choice_follows_allreduce_net():
    assert cm.neuron_choice(1 << 20, 1, 8) == "single-node"
    assert cm.neuron_choice(8, 3, 1) == "hier+direct"            # alone on its node
    assert cm.neuron_choice(64 * 8 * 4 - 4, 4, 8) == "leader"    # < 64 L elements
    assert cm.neuron_choice(64 * 8 * 4, 3, 8) == "hier+direct"
    assert cm.neuron_choice(8 * (4 << 20), 3, 8) == "hier+ring"        # slices of 4 MiB
    assert cm.neuron_choice(8 * HALVES_BYTES, 2, 8) == "hier+ring"     # halves between two
    assert cm.neuron_choice(8 * (4 << 20), 16, 8) == "hier+log-depth"  # many nodes
    assert cm.neuron_choice(8, 16, 1) == "hier+log-depth"              # alone: the whole buffer


# (nodes, ranks per node) and sizes around every threshold of allreduce_net.all_reduce
LAYOUTS = [(2, 1), (3, 1), (2, 2), (3, 2), (4, 8), (2, 8), (8, 4), (16, 1), (5, 2)]


def _sizes_to_check(L: int) -> list[int]:
    around = {4, 1 << 10, 64 * 4 * L, 4 << 20, L * (4 << 20), HALVES_BYTES,
              L * HALVES_BYTES, 1 << 30}
    sizes = {2 ** k for k in range(2, 31)}
    for x in around:
        sizes |= {max(4, x - 4), x, x + 4, max(4, x - ALIGN_BYTES * L), x + ALIGN_BYTES * L}
    return sorted(s - s % 4 for s in sizes)


class _Chosen(Exception):
    """Raised by the stubs at the first network action: which algorithm the code took."""


def _code_choice(n_bytes: int, N: int, L: int, monkeypatch, selection=DEFAULT) -> str:
    """Run allreduce_net.all_reduce for group rank 0 (a node leader, local index 0) on a meta
    tensor, with every data-moving function stubbed; return the algorithm it ran, named as
    the cost model names it."""
    from neuron_dist.collectives.reduce_ops import SUM, ReduceSpec

    local = []

    def record(name):
        def stub(*args, **kwargs):
            local.append(name)
        return stub

    def network(name):
        def stub(*args, **kwargs):
            raise _Chosen(name)
        return stub

    monkeypatch.setattr(allreduce_net.rs, "reduce_scatter", record("hierarchical"))
    monkeypatch.setattr(allreduce_net.allreduce, "all_reduce", record("leader"))
    for name in allreduce_net.NETWORK:
        monkeypatch.setitem(allreduce_net.NETWORK, name, network(name))
    for name in allreduce_net.GENERATORS:  # (what a plan runs directly, alone on its node)
        monkeypatch.setitem(allreduce_net.GENERATORS, name, network(name))
    topo = Topology.from_names(0, [f"node{k // L}" for k in range(N * L)])
    net_call = SimpleNamespace(topo=topo, buffer=network("direct"), deferrable=lambda: None,
                               net=SimpleNamespace(column=None), run=list)
    ctx = SimpleNamespace(net_call=net_call, rank=0, size=L, finish=lambda: None,
                          selection=selection, chose=lambda name: None, plans=Plans())
    buf = torch.empty(n_bytes // 4, dtype=torch.float32, device="meta")
    with pytest.raises(_Chosen) as chosen:
        allreduce_net.all_reduce(ctx, buf, buf, ReduceSpec(SUM))
    path = local[0] if local else "hierarchical"     # alone on its node: no local phase
    if path == "leader":
        return "leader"
    return cm.exchange_model(chosen.value.args[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("N,L", LAYOUTS)
def test_neuron_choice_is_what_allreduce_net_runs(N, L, monkeypatch):
    """The cost model's "neuron" column is the algorithm the shipped code runs, for sizes
    from 4 B to 1 GiB and around each of its thresholds (HALVES_BYTES, 64 L
    elements): both ask collectives/selection.py, and this runs the code itself, so either
    one deciding on its own fails here."""
    wrong = []
    for n in _sizes_to_check(L):
        code, model = _code_choice(n, N, L, monkeypatch), cm.neuron_choice(n, N, L)
        if code != model:
            wrong.append(f"{n} B: code {code}, model {model}")
    assert not wrong, f"N={N} L={L}: " + "; ".join(wrong[:10])
    assert {cm.neuron_choice(n, N, L) for n in (4, 1 << 30)} != {"hier+direct"}  # not constant


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", ["all_reduce=ring", "all_reduce=leader", "all_reduce=direct",
                                  "all_reduce:0-1M=ring,all_reduce=halves",
                                  "all_reduce:64K-=leader,all_reduce:-8M=direct"])
def test_neuron_choice_follows_overrides(text, monkeypatch):
    """With NEURON_DIST_ALGO overrides too, the model names what the code runs."""
    selection = Selection(overrides=parse_overrides(text, parse_bytes))
    wrong, changed = [], 0
    for N, L in LAYOUTS:
        for n in _sizes_to_check(L)[::3]:
            code = _code_choice(n, N, L, monkeypatch, selection)
            model = cm.neuron_choice(n, N, L, selection)
            changed += model != cm.neuron_choice(n, N, L)
            if code != model:
                wrong.append(f"N={N} L={L} {n} B: code {code}, model {model}")
    assert not wrong, "; ".join(wrong[:10])
    assert changed, "the override changed no choice"


@pytest.mark.timeout(60)
def test_code_ring_from_is_the_table_threshold():
    assert cm.code_ring_from(2, 1) == HALVES_BYTES
    # among 3 nodes alone on their node: where the cost model prices the ring cheapest
    ring = cm.code_ring_from(3, 1)
    assert DEFAULT.select("all_reduce/network", ring, 3, numel=ring // 4) == "ring"
    assert DEFAULT.select("all_reduce/network", ring - 4, 3, numel=ring // 4 - 1) != "ring"
    # L ranks per node: rank 0's slice reaches that size (aligned partition)
    n = cm.code_ring_from(3, 8)
    assert cm.slice_bytes(n, 8) >= ring > cm.slice_bytes(n - 4, 8)
    assert cm.code_ring_from(3, 8, Selection(overrides=parse_overrides("all_reduce=direct",
                                                                       parse_bytes))) is None


# ----------------------------------------------------------------------------- the command

def _run_main(capsys, *argv):
    assert cm.main(list(argv)) == 0
    return capsys.readouterr().out


@needs_results
@pytest.mark.timeout(60)
def test_cli_on_committed_results(tmp_path, capsys):
    out_json = tmp_path / "cm.json"
    text = _run_main(capsys, "--results-dir", RESULTS, "--json", str(out_json))
    assert text.startswith("# python -m bench.costmodel --results-dir ")
    for section in ("== 1. fitted parameters", "== 2. check", "== 3. predictions",
                    "== 4. assumptions", "who wins (P ranges):", "2g. check summary",
                    "where the model is poor:", "ring among nodes vs direct exchange"):
        assert section in text, section
    for name in cm.INTRA_NAMES + ["neuron-1rail", "neuron-4rails", "gloo"]:
        assert name in text
    for header in ("L=8 ranks per node, 1 MiB:", "L=8 ranks per node, 64 MiB:",
                   "L=8 ranks per node, 1 GiB:", "L=2 ranks per node, 1 GiB:"):
        assert header in text
    assert "P       N  hier+direct" in text
    doc = json.loads(out_json.read_text())
    assert set(doc) >= {"meta", "intra", "internode_p2p", "check", "predictions",
                        "assumptions", "parameters_used", "ring_crossover_bytes"}
    # every point measured is in the check: 36 + 36 intra, 21 p2p, 42 inter-node all_reduce
    groups = doc["check"]["groups"]
    count = lambda prefix: sum(g["points"] for k, g in groups.items() if k.startswith(prefix))
    assert count("fitted: intra L=2") == 36 and count("fitted: intra L=4") == 36
    assert count("fitted: p2p") == 21
    inter = count("calibrated lat: inter-node") + sum(
        g["points"] for k, g in groups.items()
        if k.startswith("held out: inter-node") and not k.endswith("half duplex"))
    assert inter == 42
    rows = doc["predictions"]["rows"]
    assert len(rows) == 2 * 4 * 8
    assert {r["P"] for r in rows} == {8, 16, 32, 64, 128, 256, 512, 1024}
    for r in rows:
        assert r["best"] in cm.ALGOS
        assert all(t > 0 for t in r["times"].values())
    p = doc["parameters_used"]
    assert p["intra"]["b"] > 0 and p["net"]["beta_rank"] > 0 and p["net"]["lat"] >= 0
    assert doc["assumptions"] and doc["assumptions"][0].startswith("* Links are full duplex")


@needs_results
@pytest.mark.timeout(60)
def test_cli_uses_a_link_reference_when_present(tmp_path, capsys):
    d = tmp_path / "results"
    d.mkdir()
    for f in ("bench-n2.json", "bench-n4.json", "internode-veth.json"):
        shutil.copy(os.path.join(RESULTS, f), d / f)
    (d / "link-veth.json").write_text(json.dumps({
        "meta": {"where": "veth", "time": "2000-01-01T00:00:00", "command": "link stand-in"},
        "summary": {"tcp_best": {"1": {"gbps": 2.0, "variant": "tcp-def"},
                                 "4": {"gbps": 4.0, "variant": "tcp-4m"}}}}))
    text = _run_main(capsys, "--results-dir", str(d), "--sizes", "1M", "--ranks", "16,64",
                     "--ppn", "8", "--link-gbs", "12.5", "--whatif-link-gbs", "0")
    assert "raw TCP over a veth pair (link-veth.json), one direction: 1 stream 2.00 GB/s, " \
           "4 streams 4.00 GB/s" in text
    assert "node link 12.5 GB/s" in text
    assert "what if the node link" not in text


@pytest.mark.timeout(60)
def test_cli_fails_clearly_without_results(tmp_path, capsys):
    with pytest.raises(SystemExit, match="bench-n2.json is missing"):
        cm.main(["--results-dir", str(tmp_path)])


@needs_results
@pytest.mark.timeout(60)
def test_module_runs_as_a_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.costmodel", "--results-dir",
                        RESULTS, "--sizes", "64M", "--ranks", "8,1024"],
                       capture_output=True, text=True, timeout=55)
    assert r.returncode == 0, r.stderr
    assert "L=8 ranks per node, 64 MiB:" in r.stdout and "== 4. assumptions" in r.stdout


@pytest.mark.timeout(60)
def test_piggybacked_descriptors_save_one_message_per_peer():
    x, N = 8 << 10, 9
    separate = cm.Machine(INTRA, NET, piggyback=0)
    together = cm.Machine(INTRA, NET, piggyback=64 << 10)
    saved = cm.direct_exchange(x, N, 1, separate) - cm.direct_exchange(x, N, 1, together)
    assert saved == pytest.approx((N - 1) * NET.alpha)
    big = 1 << 20                                   # above the threshold: no change
    assert cm.direct_exchange(big, N, 1, separate) == cm.direct_exchange(big, N, 1, together)
    assert cm.Machine(INTRA, NET).piggyback == PIGGYBACK_BYTES      # the code's threshold
