#!/usr/bin/env bash
# Install everything the tests need, then run the whole suite. Extra args go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/setup_env.sh"
cd "$repo"
exec python -m pytest -q -rs -p no:cacheprovider --durations=15 tests "$@"
