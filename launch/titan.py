"""Run TorchTitan's llama3 ``debugmodel`` with FSDP2, TP and pipeline parallelism on CPU over
the ``neuron`` backend.

How to run (from the repository root; needs ``pip install -e .[titan]``)::

    # 4 ranks on one host: FSDP2 over 2 ranks x tensor parallel over 2 ranks
    torchrun --standalone --nproc-per-node 4 launch/titan.py --steps 10 --dp-shard 2 --tp 2

    # the same on 2 virtual nodes x 2 ranks (launch/vnodes.py; add --netns as root to give
    # each node its own network namespace and /dev/shm): TP inside a node over shared
    # memory, FSDP2's all-gathers / reduce-scatters between the nodes
    python launch/vnodes.py --nodes 2 --nproc-per-node 2 -- launch/titan.py --steps 10

    # pipeline parallelism: 2 stages x FSDP2 over 2 ranks (4 ranks), and x TP 2 (8 ranks)
    torchrun --standalone --nproc-per-node 4 launch/titan.py --steps 10 --pp 2 --tp 1
    torchrun --standalone --nproc-per-node 8 launch/titan.py --steps 10 --pp 2 --tp 2

    # the 8-rank pipeline on 2 virtual nodes x 4 ranks: a stage per node, so the
    # pipeline's send/recv go between the nodes, FSDP2 and TP stay inside each
    python launch/vnodes.py --nodes 2 --nproc-per-node 4 -- launch/titan.py --steps 10 --pp 2

    # any other TorchTitan flag is passed through, e.g.
    torchrun --standalone --nproc-per-node 4 launch/titan.py --steps 5 \\
        --training.max_norm 0.5 --parallelism.fsdp_reshard_after_forward always

What it does, on every rank:

1. applies the shims of ``launch/titan_shims.py`` before TorchTitan's trainer is imported
   (device = CPU instead of CUDA; process-group backend = ``neuron`` instead of
   nccl/gloo; a stub for three GPU-kernel modules' ``import triton``; a CPU attention
   kernel, as torch 2.13's flex_attention cannot run backward on CPU;
   ``set_pg_timeouts`` without ``torch.distributed.set_timeout``; an eager BlockMask;
   pipeline schedules whose ``step`` takes the microbatches TorchTitan splits itself, as
   newer torch's does; with ``--backend gloo`` only, FSDP2 reductions as SUM, since gloo
   has no PREMUL_SUM). Nothing inside TorchTitan's installed files is changed;
2. makes, if missing, a tiny offline tokenizer (a byte-level BPE of at most 2048 tokens,
   trained here with ``tokenizers``) and a tiny C4-like text dataset in ``--assets-dir``:
   the TorchTitan wheel does not ship its ``tests/assets`` (tokenizer, ``c4_test``), and
   nothing may be downloaded;
3. parses TorchTitan's own config, ``--module llama3 --config llama3_debugmodel``, with
   ``--parallelism.data_parallel_shard_degree`` (FSDP2),
   ``--parallelism.tensor_parallel_degree`` (TP) and
   ``--parallelism.pipeline_parallel_degree`` (PP: the debugmodel's schedule,
   Interleaved1F1B, two stages per rank; ``--batch-size`` is split into microbatches of
   ``--parallelism.pipeline_parallel_microbatch_size``, default 1), a short sequence, a
   small batch, a fixed seed, checkpointing off, and three settings chosen for this
   setting (see :func:`titan_args`): ``spmd_backend=partial_dtensor`` (TorchTitan's
   default ``spmd_types`` needs a newer torch's FSDP2), fp32 parameters (bf16 is emulated
   on CPUs without AVX-512 BF16) and no CUDA graphs; then TorchTitan's ``Trainer`` trains
   ``--steps`` steps exactly as ``torchtitan.train`` would;
4. one rank prints one line per step (the global loss TorchTitan computes, grad norm,
   seconds, and that rank's collectives from ``neuron_dist.comm_stats()``) and a summary;
   ``--metrics-out FILE`` also writes them as JSON. That rank is rank 0, or with
   pipeline parallelism the first rank holding the last stage: only those ranks have the
   loss. TorchTitan's mesh puts ``pp`` outermost, so the ranks of one pipeline rank (its
   stages) are ``world/pp`` consecutive ranks (with pp 2 x dp_shard 2: ranks 0-1 hold
   stages 0 and 2, ranks 2-3 stages 1 and 3); rank 0 prints how each of its mesh groups
   spans nodes.

Launcher flags (``--steps``, ``--dp-shard``, ``--tp``, ``--pp``, ``--seq-len``,
``--batch-size``, ``--seed``, ``--backend``, ``--assets-dir``, ``--dump-folder``,
``--metrics-out``, ``--show-titan-log``) are consumed here; every other argument goes to
TorchTitan's ``ConfigManager`` and wins over the launcher's defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Runs as a script (torchrun launch/titan.py) and as neuron_dist.launch.titan.
_HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.insert(0, str(_HERE.parent))
    from launch import titan_shims  # noqa: E402
else:
    from . import titan_shims  # noqa: E402

#: Bump when the generated assets change, so stale ones in --assets-dir are not reused.
ASSETS_VERSION = 1
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
#: TorchTitan's debugmodel has a 2048-token vocabulary; the tokenizer must fit into it.
VOCAB_SIZE = 2048


# ----------------------------------------------------------------------------
# Offline assets: tokenizer + dataset
# ----------------------------------------------------------------------------

_WORDS = {
    "det": ["the", "a", "every", "some", "this", "that", "one", "no"],
    "adj": ["small", "large", "red", "quiet", "fast", "old", "new", "bright", "cold",
            "warm", "green", "heavy", "light", "strange", "simple", "broken"],
    "noun": ["cat", "dog", "river", "machine", "city", "tree", "student", "engine",
             "garden", "house", "teacher", "road", "market", "bridge", "window",
             "cloud", "train", "letter", "kernel", "tensor"],
    "verb": ["sees", "finds", "builds", "moves", "likes", "opens", "follows", "carries",
             "paints", "reads", "crosses", "watches", "repairs", "sends"],
    "prep": ["near", "under", "behind", "over", "beside", "through", "around"],
    "adv": ["slowly", "quickly", "often", "never", "quietly", "again", "today"],
}


def _sentence(rng: random.Random) -> str:
    w = {k: rng.choice(v) for k, v in _WORDS.items()}
    obj = f"{rng.choice(_WORDS['det'])} {rng.choice(_WORDS['adj'])} {rng.choice(_WORDS['noun'])}"
    form = rng.randrange(3)
    if form == 0:
        s = f"{w['det']} {w['adj']} {w['noun']} {w['verb']} {obj}"
    elif form == 1:
        s = f"{w['det']} {w['noun']} {w['adv']} {w['verb']} {obj} {w['prep']} the {w['noun']}"
    else:
        s = f"{w['det']} {w['noun']} {w['prep']} the {w['adj']} {w['noun']} {w['verb']} {obj}"
    return s[0].upper() + s[1:] + "."


def _documents(n_docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(4, 24))) for _ in range(n_docs)]


def _build_assets(dest: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = _documents(3000)
    data = dest / "c4_test"
    data.mkdir(parents=True)
    with open(data / "data.json", "w") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"text": text, "timestamp": "2019-04-25T00:00:00Z",
                                "url": f"local://neuron-titan/{i}"}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE, tok.get_vocab_size()
    tokdir = dest / "tokenizer"
    tokdir.mkdir()
    tok.save(str(tokdir / "tokenizer.json"))
    with open(tokdir / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
                   "add_eos_token": True, "model_max_length": 131072,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)


def ensure_assets(assets_dir: str | os.PathLike) -> Path:
    """Create the tokenizer and dataset under ``assets_dir/v<N>`` once; safe to race.

    Every rank may call this at the same time (before the process group exists): each
    builds into its own temporary directory and renames it into place; the first rename
    wins and the others discard their (identical) copy.
    """
    final = Path(assets_dir) / f"v{ASSETS_VERSION}"
    if (final / "tokenizer" / "tokenizer.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{ASSETS_VERSION}-", dir=final.parent))
    try:
        _build_assets(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "tokenizer" / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description="TorchTitan llama3 debugmodel, FSDP2 + TP + PP, on CPU over the neuron "
                    "backend",
        epilog="Other arguments are passed to TorchTitan (e.g. --training.max_norm 0.5).")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dp-shard", type=int, default=2,
                   help="FSDP2 degree (parallelism.data_parallel_shard_degree)")
    p.add_argument("--tp", type=int, default=2,
                   help="tensor parallel degree (parallelism.tensor_parallel_degree)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline parallel degree (parallelism.pipeline_parallel_degree)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4,
                   help="local batch size per dp rank (with --pp: split into microbatches of "
                        "parallelism.pipeline_parallel_microbatch_size, default 1)")
    p.add_argument("--seed", type=int, default=0, help="TorchTitan's debug.seed")
    p.add_argument("--backend", default=titan_shims.BACKEND,
                   help="process-group backend (default: neuron; gloo only for comparison)")
    p.add_argument("--assets-dir", default=os.path.join(tempfile.gettempdir(),
                                                        "neuron-titan-assets"))
    p.add_argument("--dump-folder", default=None,
                   help="TorchTitan's dump_folder (default: a temporary directory)")
    p.add_argument("--metrics-out", default=None,
                   help="rank 0 (with --pp: the last stage's first rank) writes losses etc. "
                        "as JSON")
    p.add_argument("--show-titan-log", action="store_true",
                   help="keep TorchTitan's own INFO log (default: warnings only)")
    return p.parse_known_args(argv)


def titan_args(args: argparse.Namespace, assets: Path, dump_folder: str,
               extra: list[str]) -> list[str]:
    out = [
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--hf_assets_path", str(assets / "tokenizer"),
        "--dataloader.dataset", "c4_test",
        "--dataloader.dataset_path", str(assets / "c4_test"),
        "--dump_folder", dump_folder,
        "--training.steps", str(args.steps),
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch_size),
        # CPU: no CUDA graphs (TorchTitan would only warn and fall back to eager).
        "--training.disable_cuda_graphs",
        "--parallelism.data_parallel_shard_degree", str(args.dp_shard),
        "--parallelism.tensor_parallel_degree", str(args.tp),
        "--parallelism.pipeline_parallel_degree", str(args.pp),
        # TorchTitan 0.3.0 defaults to spmd_backend=spmd_types: parameters stay plain
        # tensors with spmd_types annotations, which torch 2.13's fully_shard rejects on a
        # multi-axis mesh ("When dp_mesh_dims is provided, all parameters must be
        # DTensors"), whatever the device or backend. partial_dtensor is the DTensor path:
        # TP parameters are DTensors on the tp mesh, FSDP2 shards over the dp_shard mesh.
        "--parallelism.spmd_backend", "partial_dtensor",
        # CPU without bf16 instructions (AVX-512 BF16 / AMX): bf16 matmuls are emulated
        # and ~4x slower than fp32, so FSDP2 keeps fp32 parameters by default (TorchTitan's
        # default is bfloat16; pass --training.mixed_precision_param bfloat16 to use it).
        "--training.mixed_precision_param", "float32",
        "--debug.seed", str(args.seed),
        "--checkpoint.no-enable",
        "--metrics.log_freq", "1",
    ]
    return out + extra  # later flags win in tyro


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------

def _say(show: bool, msg: str) -> None:
    if show:
        print(f"[neuron-titan] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    os.environ.setdefault("LOCAL_RANK", "0")
    # Nothing may be downloaded: make the Hugging Face libraries fail instead of trying.
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")

    t_start = time.perf_counter()
    assets = ensure_assets(args.assets_dir)
    os.environ.setdefault("HF_DATASETS_CACHE", str(assets / "hf_datasets_cache"))
    # With checkpointing off nothing in the dump folder is shared between ranks, so each
    # rank gets its own temporary one unless --dump-folder names one.
    dump_folder = args.dump_folder or tempfile.mkdtemp(prefix="neuron-titan-out-")
    try:
        return _train(args, extra, rank, assets, dump_folder, t_start)
    finally:
        if args.dump_folder is None:
            shutil.rmtree(dump_folder, ignore_errors=True)


def _train(args, extra, rank, assets, dump_folder, t_start) -> int:
    shims = titan_shims.apply(args.backend)   # before TorchTitan's trainer is imported

    import torch
    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    if not args.show_titan_log:   # TorchTitan's warnings from rank 0, errors from all
        logger.setLevel(logging.WARNING if rank == 0 else logging.ERROR)

    config = ConfigManager().parse_args(titan_args(args, assets, dump_folder, extra))
    trainer = config.build()
    titan_shims.check()
    pd = trainer.parallel_dims
    backend = dist.get_backend()
    meshes = pd.get_all_one_dimensional_meshes()
    mesh_backends = sorted({dist.get_backend(m.get_group()) for m in meshes.values()})
    # With pipeline parallelism only the ranks holding the last stage have the loss (the
    # others log TorchTitan's placeholder, -1 summed over the batch group): the first of
    # them reports the steps and writes --metrics-out. Without it, rank 0.
    reporter = _reporting_rank(trainer, rank) if pd.pp_enabled else 0
    layouts = {name: _layout(mesh.get_group()) for name, mesh in meshes.items()}
    _say(rank == 0, f"torchtitan {_version('torchtitan')} llama3 {config.model_spec.flavor} | "
                    f"torch {torch.__version__} | backend={backend} (mesh groups: "
                    f"{','.join(mesh_backends)}) | world={dist.get_world_size()} "
                    f"pp={pd.pp} dp_shard={pd.dp_shard} tp={pd.tp} | "
                    f"seq_len={config.training.seq_len} "
                    f"local_batch={config.training.local_batch_size} | "
                    f"shims: {', '.join(shims)}")
    if pd.pp_enabled:
        _say(rank == 0, f"  pipeline: {config.parallelism.pipeline_parallel_schedule}, "
                        f"{trainer.num_pipeline_parallel_microbatches} microbatches of "
                        f"{config.parallelism.pipeline_parallel_microbatch_size}; "
                        f"rank {reporter} (last stage) reports the loss")
    for name, mesh in meshes.items():
        _say(rank == 0, f"  {name} group of rank 0: {mesh.size()} ranks"
                        + (f", {layouts[name]}" if layouts[name] else ""))
    reports = rank == reporter

    # Record what TorchTitan logs per step: its MetricsProcessor.log receives the global
    # loss. neuron_dist.comm_stats() (this rank's collectives) gives the comm share.
    comm = _comm_reader(backend)
    records: list[dict] = []
    orig_log = trainer.metrics_processor.log
    last = {"t": time.perf_counter(), "comm": comm()}

    def log(step, global_avg_loss, global_max_loss, grad_norm, *a, **kw):
        now, c = time.perf_counter(), comm()
        rec = {"step": int(step), "loss": float(global_avg_loss),
               "max_loss": float(global_max_loss), "grad_norm": float(grad_norm),
               "seconds": now - last["t"]}
        if c is not None:
            rec.update(comm_calls=c["calls"] - last["comm"]["calls"],
                       comm_bytes=c["bytes"] - last["comm"]["bytes"],
                       comm_blocked_seconds=c["blocked_seconds"] - last["comm"]["blocked_seconds"])
        last.update(t=now, comm=c)
        records.append(rec)
        share = (f" | comm {rec['comm_calls']:4d} calls {rec['comm_bytes'] / 2**20:6.1f} MiB "
                 f"{100 * rec['comm_blocked_seconds'] / rec['seconds']:4.1f}% of step"
                 if c is not None else "")
        _say(reports, f"step {rec['step']:4d} | loss {rec['loss']:8.4f} | grad_norm "
                      f"{rec['grad_norm']:7.4f} | {rec['seconds']:6.2f} s{share}")
        return orig_log(step, global_avg_loss, global_max_loss, grad_norm, *a, **kw)

    trainer.metrics_processor.log = log
    t_train = time.perf_counter()
    last.update(t=t_train, comm=comm())
    try:
        trainer.train()
    finally:
        trainer.close()
    train_seconds = time.perf_counter() - t_train

    losses = [r["loss"] for r in records]
    ok = bool(losses) and all(math.isfinite(x) for x in losses)
    if losses:
        blocked = sum(r.get("comm_blocked_seconds", 0.0) for r in records)
        share = (f" | comm {100 * blocked / train_seconds:.1f}% of train time"
                 if "comm_calls" in records[0] else "")
        _say(reports, f"summary: {len(losses)} steps | first loss {losses[0]:.4f} | last "
                      f"loss {losses[-1]:.4f} | train {train_seconds:.1f} s{share} | total "
                      f"{time.perf_counter() - t_start:.1f} s | backend={backend}")
    if reports and args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps({
            "backend": backend, "mesh_backends": mesh_backends,
            "world_size": dist.get_world_size(), "pp": pd.pp, "dp_shard": pd.dp_shard,
            "tp": pd.tp, "reported_by": reporter, "mesh_layouts": layouts,
            "flavor": config.model_spec.flavor, "shims": shims, "steps": records,
            "losses": losses, "train_seconds": train_seconds}, indent=1))
    dist.destroy_process_group()
    return 0 if ok else 1


def _reporting_rank(trainer, rank: int) -> int:
    """The lowest rank that holds the last pipeline stage (where TorchTitan's loss is)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    t = torch.tensor([rank if trainer.pp_has_last_stage else world])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _layout(group) -> str | None:
    """How a neuron group spans nodes (``ProcessGroupNeuron.layout()``); None otherwise."""
    layout = getattr(group, "layout", None)
    return layout() if callable(layout) else None


def _comm_reader(backend: str):
    """This rank's cumulative ``neuron_dist.comm_stats()``, or None under another backend."""
    if backend != titan_shims.BACKEND:
        return lambda: None
    import neuron_dist

    return lambda: dict(neuron_dist.comm_stats())


def _version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
