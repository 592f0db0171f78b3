#!/usr/bin/env bash
# Install everything the tests need, then run the whole suite, or the test files and pytest
# options given as arguments (e.g. tests/one_node/test_p2p.py -k order).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/setup_env.sh"
cd "$repo"
if [ "$#" -eq 0 ] || ! printf '%s\n' "$@" | grep -q '^tests'; then
  set -- tests "$@"  # no test path given: the whole suite
fi
exec python -m pytest -q -rs -p no:cacheprovider --durations=15 "$@"
