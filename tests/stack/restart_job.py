"""A job for tests/stack/test_restart.py: on its first attempt rank 1 dies mid-run
(SIGKILL), the survivors report the error they got; torchrun (--max-restarts) restarts
every worker and the second attempt must succeed."""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("neuron")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1000)
dist.all_reduce(t)
error = None
if attempt == 0:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    # The agent stops the survivors with SIGTERM once it sees rank 1 gone (it polls every
    # few seconds): a survivor finishes its report first (it then exits with 1 anyway; the
    # agent would SIGKILL it after its 30 s grace).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        time.sleep(0.2)
        dist.all_reduce(t)  # rank 1 is dead: this must fail, not hang
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    with open(os.path.join(args.out, f"attempt{attempt}-rank{rank}.json"), "w") as f:
        json.dump({"error": error}, f)
    raise SystemExit(1)
x = torch.full((4,), float(rank + 1))
dist.all_reduce(x)
with open(os.path.join(args.out, f"attempt{attempt}-rank{rank}.json"), "w") as f:
    json.dump({"sum": x[0].item(), "world": world}, f)
dist.destroy_process_group()
