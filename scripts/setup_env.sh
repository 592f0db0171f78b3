#!/usr/bin/env bash
# Creates ./.venv (if needed) with the pinned CPU torch and this project installed.
# Sourced by scripts/test.sh and scripts/main_job.sh; prints where it installed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${NEURON_DIST_VENV:-$repo/.venv}"
# Virtual nodes in network namespaces (tests, the main job) need iproute2's `ip` and `tc`.
# As root with apt-get, it is installed, saying so first; otherwise the command is printed
# and virtual nodes run on loopback.
if ! command -v ip >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing iproute2 system-wide (apt-get install -y iproute2): network namespaces" \
         "for virtual nodes need ip and tc" >&2
    (apt-get install -y -q iproute2 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 &&
      apt-get install -y -q iproute2 >/dev/null 2>&1; }) || echo "could not install iproute2" >&2
  else
    echo "note: iproute2 (ip, tc) is missing, so virtual nodes run on loopback without" \
         "network namespaces; to add it, as root: apt-get install -y iproute2" >&2
  fi
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# The CPU build of torch, chosen explicitly: an index without it (plain PyPI) fails here
# instead of fetching the multi-GB CUDA build of the same version. Point pip at PyTorch's
# CPU wheel index (PIP_EXTRA_INDEX_URL) or a local wheel directory (PIP_FIND_LINKS), or
# set NEURON_DIST_TORCH to another requirement. pyproject declares the tested range.
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${NEURON_DIST_TORCH:-torch==2.13.0+cpu}"
extras="${NEURON_DIST_EXTRAS-test}"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$repo${extras:+[$extras]}"
export PATH="$venv/bin:$PATH"
echo "neuron-dist installed in $venv" >&2
