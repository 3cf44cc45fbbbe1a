#!/usr/bin/env bash
# Stop the cluster that scripts/slurm-local-up.sh started in DIR (argument, else $MH_SLURM_DIR):
# cancel its jobs (bounded wait), then stop slurmd x2, slurmctld and munged by their PID files
# (TERM, then KILL after a few seconds). Only processes named in DIR's PID files are signalled.
# Removes DIR afterwards unless MH_SLURM_KEEP=1. Safe to run twice, or on a half-started cluster.
set -uo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

dir=${1:-${MH_SLURM_DIR:-}}
if [ -z "$dir" ]; then
  echo "usage: slurm-local-down.sh DIR   (or set MH_SLURM_DIR)" >&2
  exit 2
fi
if [ ! -d "$dir" ]; then
  echo "slurm-local-down: $dir does not exist; nothing to stop" >&2
  exit 0
fi
dir=$(cd "$dir" && pwd)

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Jobs first, while slurmctld and slurmd can still clean up their steps.
if [ -f "$dir/slurm.conf" ] && alive "$dir/slurmctld.pid"; then
  export SLURM_CONF="$dir/slurm.conf"
  mapfile -t jobs < <(squeue -h -o %i 2>/dev/null)
  if [ "${#jobs[@]}" -gt 0 ]; then
    scancel --full "${jobs[@]}" 2>/dev/null || true
    for _ in $(seq 40); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.25
    done
  fi
fi

stop() {  # PIDFILE...: TERM them all, wait up to 5 s, then KILL what is left
  local pidfile pid pids=() _
  for pidfile in "$@"; do
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    fi
  done
  for _ in $(seq 50); do
    alive_pids=()
    for pid in ${pids[@]+"${pids[@]}"}; do kill -0 "$pid" 2>/dev/null && alive_pids+=("$pid"); done
    [ "${#alive_pids[@]}" -eq 0 ] && break
    sleep 0.1
  done
  for pid in ${pids[@]+"${pids[@]}"}; do
    if kill -0 "$pid" 2>/dev/null; then
      echo "slurm-local-down: $pid ignored TERM for 5 s; sending KILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$@"
}

# the daemons together (each takes ~2 s to exit), munged last: they talk to it while shutting down
stop "$dir"/slurmd.*.pid "$dir/slurmctld.pid"
stop "$dir/munged.pid"

if [ "${MH_SLURM_KEEP:-0}" = 1 ]; then
  echo "slurm-local-down: stopped; kept $dir" >&2
else
  rm -rf "$dir"
  echo "slurm-local-down: stopped; removed $dir" >&2
fi
