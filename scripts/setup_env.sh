#!/usr/bin/env bash
# Creates ./.venv (if needed) with the pinned CPU torch and this project installed.
# Sourced by scripts/test.sh and scripts/main_job.sh; prints where it installed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${NEURON_DIST_VENV:-$repo/.venv}"
# Virtual nodes in network namespaces (tests, the main job) need iproute2's `ip` and `tc`.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q iproute2 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 &&
    apt-get install -y -q iproute2 >/dev/null 2>&1; }) || echo "could not install iproute2" >&2
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# torch is pinned here (not in pyproject) because an unpinned resolve pulls a multi-GB CUDA
# build; the package itself declares the lowest torch it is tested with.
"$venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
extras="${NEURON_DIST_EXTRAS-test}"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$repo${extras:+[$extras]}"
export PATH="$venv/bin:$PATH"
echo "neuron-dist installed in $venv" >&2
