#!/usr/bin/env bash
# Restart time of a supervised mesh, phase by phase (docs/RELIABILITY.md, "Restart time"):
# starts `dsmesh up` on MODEL, SIGKILLs each ROLE in turn once the mesh is ready, waits until
# the supervisor reports it healthy again, and prints the supervisor's line (exit seen ->
# healthy) and the process's own start-up phases (its log's "ready ... after its start" line,
# the first start's and the restart's).
#
#   bash scripts/restart-time.sh MODEL LOG_DIR [ROLES] [-- dsmesh up flags...]
#   bash scripts/restart-time.sh /tmp/v2lite /tmp/restart "decode-0 kv-broker"
#   bash scripts/restart-time.sh /tmp/v2lite /tmp/restart unified-0 -- --prefill 0 --decode 0 --unified 1
#
# Before each kill it waits SETTLE seconds (default 31) after the mesh is ready, so the kill
# finds the process as a real fault would: past the supervisor's 30 s stable-run mark (an
# immediate restart, no back-off) and with its `--standby` spare imported.
# ROLES: supervisor names (default "decode-0 kv-broker"). Runs on the CPU too (tiny model:
# MODEL = "$(python -c 'from dsmesh.engine.model.tiny_model import default_model_dir as d; print(d())')").
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1 logs=$2 roles=${3:-"decode-0 kv-broker"}
shift $(( $# < 3 ? $# : 3 ))
[ "${1:-}" = "--" ] && shift
mkdir -p "$logs"
out="$logs/up.out"
python -m dsmesh --log-level info up --model "$model" --log-dir "$logs" "$@" >"$out" 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
wait_for() {  # PATTERN FILE SECONDS
  for _ in $(seq $(( $3 * 5 ))); do
    grep -qE "$1" "$2" 2>/dev/null && return 0
    kill -0 $up 2>/dev/null || { echo "dsmesh up exited; see $out" >&2; tail -20 "$out" >&2; return 1; }
    sleep 0.2
  done
  echo "timed out waiting for /$1/ in $2" >&2
  return 1
}
wait_for "dsmesh mesh ready" "$out" 900
grep -E "ready at" "$out"
for role in $roles; do
  sleep "${SETTLE:-31}"
  pid=$(grep -oE "^  $role +ready at +[^ ]+ +pid [0-9]+" "$out" | grep -oE "[0-9]+$")
  echo "== SIGKILL $role (pid $pid) at $(date +%T.%N)"
  kill -9 "$pid"
  wait_for "$role restarted at .* after it exited" "$out" 300
  grep -E "$role restarted at" "$out"
  grep -hE "ready [0-9.]+ s after its start" "$logs/$role.log" || true
done
