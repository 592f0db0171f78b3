#!/usr/bin/env bash
# Install, then run the main job: a small Llama-style decoder trained with FSDP2 + TP on a
# 2-D (dp x tp) mesh over the neuron backend, as 2 virtual nodes x 2 ranks on this machine
# (each node in its own network namespace when run as root, else on loopback), so TP runs
# over shared memory inside a node and FSDP's collectives cross the inter-node transport.
# Extra args go to launch/train.py (e.g. --steps 50 --dim 128 --layers 4 --tp 2).
# NODES / NPROC_PER_NODE / VNODES_NETNS=0 change the layout.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NEURON_DIST_EXTRAS="" source "$repo/scripts/setup_env.sh"
cd "$repo"
netns=""
if [ "${VNODES_NETNS:-1}" = 1 ] && python -c "import sys; sys.path.insert(0, '.'); from launch import vnodes; sys.exit(not vnodes.netns_available())"; then
    netns="--netns"
fi
exec python launch/vnodes.py --nodes "${NODES:-2}" --nproc-per-node "${NPROC_PER_NODE:-2}" \
    $netns --timeout "${MAIN_JOB_TIMEOUT:-900}" -- launch/train.py --backend neuron "$@"
