#!/usr/bin/env bash
# Offline install check: the README's two set-up commands work on a fresh clone whose only
# package source is a local directory of wheels holding the CPU build of torch (and no
# other torch), with this machine's own pip settings ignored.
#
# What it does, in a temporary directory that it removes at the end:
#   1. the wheel directory: --wheels DIR if it holds wheels, else it is filled (DIR, or a
#      temporary one) by `pip download --only-binary=:all:` with the machine's usual pip
#      settings -- the one step that reads an index -- for the torch that setup_env.sh pins
#      (NEURON_DIST_TORCH overrides it), pyproject's dependencies, every extra and the build
#      requirements. It must hold exactly one torch wheel, a +cpu one, and nothing of
#      CUDA's (nvidia-*, triton), else the check stops.
#   2. a fresh `git clone` of this repository's HEAD (commit what you want checked);
#   3. in it, with every PIP_* variable unset, then PIP_CONFIG_FILE=/dev/null (pip reads no
#      configuration file), PIP_NO_INDEX=1, PIP_FIND_LINKS=<the wheel directory>, a new
#      empty HOME (no pip cache, no user configuration) and no NEURON_DIST_* variable but
#      NEURON_DIST_TESTS_REQUIRE_ALL: each command of the README's set-up block, exactly as
#      written there (the main job, then the whole test suite), then the README test
#      (`bash scripts/test.sh tests/stack/test_readme.py`), which runs every other block of
#      the README against the clone's .venv.
# It fails if any of them fails, if the clone's venv has a torch other than the wheel
# directory's, if a process started in the clone outlives its command, or if a neuron-*
# shared-memory segment whose creator has exited appears in /dev/shm during the run.
#
#   bash scripts/offline_install_check.sh                  # everything: the suite's time + ~10 min
#   bash scripts/offline_install_check.sh --quick          # main job + README test (~6 min on 2 cores)
#   bash scripts/offline_install_check.sh --wheels DIR     # reuse (or fill and keep) DIR
#   NEURON_DIST_TESTS_REQUIRE_ALL=1 bash scripts/offline_install_check.sh  # no skips, as CI
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheels="" quick=0
while [ "$#" -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

work="$(mktemp -d "${TMPDIR:-/tmp}/neuron-offline-check.XXXXXX")"
running=""  # the session id of the command running now, if any
cleanup() {
  if [ -n "$running" ] && kill -0 "$running" 2>/dev/null; then
    kill -KILL -- "-$running" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
say() { printf '[offline-check] %s\n' "$*" >&2; }

# ---------------------------------------------------------------- 1. the wheel directory
if [ -z "$wheels" ]; then
  wheels="$work/wheels"
fi
mkdir -p "$wheels"
wheels="$(cd "$wheels" && pwd)"
if ! compgen -G "$wheels/*.whl" >/dev/null; then
  torch_req="${NEURON_DIST_TORCH:-$(sed -n 's/.*NEURON_DIST_TORCH:-\([^}]*\)}.*/\1/p' "$repo/scripts/setup_env.sh")}"
  [ -n "$torch_req" ] || { say "cannot read the pinned torch from scripts/setup_env.sh"; exit 1; }
  python3 - "$repo/pyproject.toml" "$torch_req" >"$work/requirements.txt" <<'EOF'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    p = tomllib.load(f)
reqs = [sys.argv[2], *p["project"]["dependencies"], *p["build-system"]["requires"]]
for extra in p["project"].get("optional-dependencies", {}).values():
    reqs += extra
print("\n".join(dict.fromkeys(reqs)))
EOF
  say "filling $wheels with wheels for: $(tr '\n' ' ' <"$work/requirements.txt")"
  python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
    -d "$wheels" -r "$work/requirements.txt"
fi
torches=$(cd "$wheels" && ls | grep -i '^torch-[0-9]' || true)
cuda=$(cd "$wheels" && ls | grep -i -E '^(nvidia[-_]|triton-)' || true)
if [ "$(printf '%s\n' "$torches" | grep -c .)" != 1 ] || ! printf '%s' "$torches" | grep -q '+cpu-'; then
  say "$wheels must hold exactly one torch wheel, a CPU (+cpu) build; it holds: ${torches:-none}"
  exit 1
fi
if [ -n "$cuda" ]; then
  say "$wheels holds CUDA packages: $cuda"; exit 1
fi
say "wheel directory $wheels: $(ls "$wheels" | wc -l) wheels, torch: $torches"

# ---------------------------------------------------------------- 2. a fresh clone
clone="$work/clone"
git clone -q "$repo" "$clone"
say "fresh clone of $(git -C "$clone" rev-parse --short HEAD) in $clone"
mkdir -p "$work/home"

# ---------------------------------------------------------------- 3. the commands, offline
fresh_env=(env)
for name in $(compgen -e); do
  case "$name" in
    PIP_*|VIRTUAL_ENV|PYTHONPATH|PYTHONHOME|XDG_CONFIG_HOME|XDG_CACHE_HOME|XDG_DATA_HOME) fresh_env+=(-u "$name") ;;
    NEURON_DIST_TESTS_REQUIRE_ALL) ;;
    NEURON_DIST_*) fresh_env+=(-u "$name") ;;
  esac
done
fresh_env+=(HOME="$work/home" PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_FIND_LINKS="$wheels")

shm_orphans() {  # neuron-* segments in /dev/shm whose creator (3rd field: its pid) has exited
  local n pid
  for n in $(ls /dev/shm 2>/dev/null | grep '^neuron-' || true); do
    pid=$(printf '%s' "$n" | cut -d- -f3)
    case "$pid" in ''|*[!0-9]*) echo "$n"; continue ;; esac
    kill -0 "$pid" 2>/dev/null || [ -d "/proc/$pid" ] || echo "$n"
  done | sort
}
shm_before="$(shm_orphans)"

run() {  # run one command in the clone's root, in a session of its own, offline
  say "running: $1"
  local start=$SECONDS rc=0
  (cd "$clone" && exec setsid "${fresh_env[@]}" bash -euo pipefail -c "$1") &
  running=$!
  wait "$running" || rc=$?
  kill -KILL -- "-$running" 2>/dev/null || true  # whatever it left in its session
  running=""
  say "exit $rc after $((SECONDS - start)) s: $1"
  local left p
  left=$(pgrep -f -- "$clone" || true)
  for p in /proc/[0-9]*; do  # and any whose working directory is in the clone
    case "$(readlink "$p/cwd" 2>/dev/null)" in "$clone"|"$clone"/*) left="$left ${p#/proc/}" ;; esac
  done
  left=$(echo $left)
  if [ -n "$left" ]; then
    say "processes started in the clone outlived it:"; ps -o pid,args -p "$(echo $left | tr ' ' ',')" >&2 || true
    rc=1
  fi
  return "$rc"
}

# The README's set-up block: the one after the "one of the two set-up commands" marker.
mapfile -t setup_commands < <(awk '
  /readme-test: skip \(one of the two set-up commands\)/ { armed = 1; next }
  armed && /^```/ { if (inside) exit; inside = 1; next }
  inside { sub(/[ \t]+#.*$/, ""); if ($0 ~ /[^ \t]/) print }' "$clone/README.md")
[ "${#setup_commands[@]}" = 2 ] || { say "README set-up block not found (got: ${setup_commands[*]:-nothing})"; exit 1; }

"${fresh_env[@]}" python3 -m pip config list | sed 's/^/[offline-check] pip config: /' >&2  # nothing expected

failed=()
for cmd in "${setup_commands[@]}"; do
  if [ "$quick" = 1 ] && [ "$cmd" = "bash scripts/test.sh" ]; then
    say "--quick: skipping $cmd"; continue
  fi
  run "$cmd" || failed+=("$cmd")
  if [ "$cmd" = "${setup_commands[0]}" ]; then
    installed=$("$clone/.venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | awk 'tolower($1) == "torch" {print $2}')
    say "torch in the clone's venv: ${installed:-none}"
    printf '%s' "$torches" | grep -q -- "-${installed:-none}-" || { say "not the wheel directory's torch"; failed+=("torch $installed"); }
  fi
done
run "bash scripts/test.sh tests/stack/test_readme.py" || failed+=("the README test")

shm_new=$(comm -13 <(printf '%s\n' "$shm_before") <(shm_orphans) | grep . || true)
if [ -n "$shm_new" ]; then
  say "shared-memory segments left in /dev/shm by exited processes: $shm_new"; failed+=("/dev/shm")
fi
if [ "${#failed[@]}" -gt 0 ]; then
  say "FAILED: ${failed[*]}"; exit 1
fi
say "passed: the README's set-up commands$([ "$quick" = 1 ] && echo ' (main job only: --quick)') and the README test, offline from $wheels"
