#!/usr/bin/env bash
# Creates ./.venv (if needed) with the pinned CPU torch and this project installed.
# Sourced by scripts/test.sh and scripts/main_job.sh; prints where it installed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${NEURON_DIST_VENV:-$repo/.venv}"
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
