#!/usr/bin/env bash
# Install, then run the main job: a small Llama-style decoder trained with FSDP2 + TP on a
# 2-D (dp x tp) mesh over the neuron backend, 4 ranks on this machine.
# Extra args go to launch/train.py (e.g. --steps 50 --dim 128 --layers 4 --tp 2).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NEURON_DIST_EXTRAS="" source "$repo/scripts/setup_env.sh"
cd "$repo"
nproc="${NPROC:-4}"
exec timeout "${MAIN_JOB_TIMEOUT:-900}" torchrun --standalone --nproc-per-node "$nproc" \
    launch/train.py --backend neuron "$@"
