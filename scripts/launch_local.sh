#!/usr/bin/env bash
# Local multi-process run on loopback: N processes x D simulated CPU devices each.
#
#   scripts/launch_local.sh N_PROCESSES DEVICES_PER_PROCESS -- <scripts/train.py args>
#   scripts/launch_local.sh 2 4 -- --config configs/tiny.py --workdir /tmp/tiny2x4
#
# Every process runs scripts/train.py with GEM_JAX_COORDINATOR=127.0.0.1:PORT,
# GEM_JAX_NUM_PROCESSES=N, GEM_JAX_PROCESS_ID=i (see gem_jax/parallel/distributed.py)
# and XLA_FLAGS=--xla_force_host_platform_device_count=D. This is how multi-host
# runs are simulated (and tested) on one machine; on a cluster use
# scripts/slurm/train.sbatch.
#
# Environment:
#   PYTHON          interpreter (default: python3)
#   GEM_JAX_PORT    coordinator port (default: a free one)
#   GEM_JAX_SCRIPT  entry script (default: scripts/train.py)
#   GEM_JAX_LOG_DIR if set, process i's stderr goes to $GEM_JAX_LOG_DIR/process_i.log
#   GEM_JAX_HEARTBEAT_TIMEOUT_S, GEM_JAX_INIT_TIMEOUT_S, GEM_JAX_SHUTDOWN_TIMEOUT_S:
#                   failure detection bounds (defaults here: 20, 120, 30)
#   GEM_JAX_STEP_TIMEOUT_S passes through unchanged (unset: the trainer's default,
#                   900 s with several processes; keep it below the heartbeat
#                   timeout for the watchdog to name a hung process)
#
# The launcher writes "launch_local: process I: pid P" to its stderr for each process
# (to signal one of them: SIGTERM = preemption, SIGSTOP = a hang, as the tests do).
#
# Exit status: 0 if every process succeeded, else the first non-zero status. When
# one process fails the others stop by themselves (heartbeat / collective errors,
# step watchdog); after GEM_JAX_KILL_AFTER_S more seconds (default 120) any left
# are killed. Ctrl-C / SIGTERM is forwarded to all processes.
set -uo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 N_PROCESSES DEVICES_PER_PROCESS -- <train args>" >&2
  exit 2
fi
n=$1
d=$2
shift 2
[[ "${1:-}" == "--" ]] && shift

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
script="${GEM_JAX_SCRIPT:-$root/scripts/train.py}"
port="${GEM_JAX_PORT:-$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
kill_after="${GEM_JAX_KILL_AFTER_S:-120}"

pids=()
cleanup() {
  # SIGTERM first (JAX's preemption notifier takes it), SIGKILL for what is left.
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  sleep "${GEM_JAX_TERM_GRACE_S:-5}"
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
}
trap 'cleanup; exit 130' INT TERM

for ((i = 0; i < n; i++)); do
  env GEM_JAX_COORDINATOR="127.0.0.1:$port" GEM_JAX_NUM_PROCESSES="$n" GEM_JAX_PROCESS_ID="$i" \
    GEM_JAX_HEARTBEAT_TIMEOUT_S="${GEM_JAX_HEARTBEAT_TIMEOUT_S:-20}" \
    GEM_JAX_INIT_TIMEOUT_S="${GEM_JAX_INIT_TIMEOUT_S:-120}" \
    GEM_JAX_SHUTDOWN_TIMEOUT_S="${GEM_JAX_SHUTDOWN_TIMEOUT_S:-30}" \
    JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$d" \
    "$py" "$script" "$@" 2> >(if [[ -n "${GEM_JAX_LOG_DIR:-}" ]]; then
                               mkdir -p "$GEM_JAX_LOG_DIR"; cat > "$GEM_JAX_LOG_DIR/process_$i.log"
                             else cat >&2; fi) &
  pids+=($!)
  echo "launch_local: process $i: pid $!" >&2
done

status=0
failed_at=""
remaining=${#pids[@]}
declare -A done_pids=()
while ((remaining > 0)); do
  for p in "${pids[@]}"; do
    [[ -n "${done_pids[$p]:-}" ]] && continue
    if ! kill -0 "$p" 2>/dev/null; then
      wait "$p"
      rc=$?
      done_pids[$p]=1
      remaining=$((remaining - 1))
      if ((rc != 0 && status == 0)); then
        status=$rc
        failed_at=$SECONDS
        echo "launch_local: process pid $p exited with status $rc" >&2
      fi
    fi
  done
  if [[ -n "$failed_at" ]] && ((SECONDS - failed_at > kill_after)); then
    echo "launch_local: killing processes still running ${kill_after}s after a failure" >&2
    cleanup
    failed_at=""
  fi
  ((remaining > 0)) && sleep 0.2
done
exit "$status"
