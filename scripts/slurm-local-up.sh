#!/usr/bin/env bash
# Start a real, throw-away SLURM cluster on the local host: munged, one controller (slurmctld) and two
# emulated compute nodes (`slurmd -N node1`, `slurmd -N node2`), with config, state, logs and PID files
# in one folder. For the `slurm` tests (tests/cluster/test_slurm_cluster.py) and for trying
# `megatron-hetero slurm --submit` by hand. Needs root (the daemons run as root, SlurmUser=root).
# Stop it with scripts/slurm-local-down.sh DIR.
#
# Environment:
#   MH_SLURM_DIR        folder for everything (default: a new mktemp -d /tmp/mh-slurm.XXXXXX); must not
#                       hold a running cluster
#   MH_SLURM_CPUS       CPUs each emulated node declares (default 8; more than the real cores is fine)
#   MH_SLURM_GPUS       fake GPUs per node, char devices in DIR for --gpus-per-node (default 4; 0 = none)
#   MH_SLURM_NO_INSTALL set to 1 to fail instead of `apt-get install`ing missing Debian packages
#   MH_SLURM_TIMEOUT    seconds to wait for both nodes to become idle (default 60)
#
# On success the last line on stdout is `MH_SLURM_DIR=<dir>` and DIR/env holds the one variable clients
# need (`. DIR/env` then sbatch/srun/squeue/scontrol talk to this cluster):
#   SLURM_CONF=<dir>/slurm.conf
# Node names resolve inside jobs through a hosts file bind-mounted over /etc/hosts in the daemons' own
# mount namespace (`unshare -m`); the machine's /etc/hosts is never touched.
# Exit codes: 0 up; 3 cannot run here (not root, packages unavailable: the reason on stderr); 1 a daemon
# failed (its log tail on stderr; everything started so far is stopped again).
set -euo pipefail

die_env() { echo "slurm-local-up: cannot start: $*" >&2; exit 3; }

[ "$(id -u)" = 0 ] || die_env "needs root (the daemons run as SlurmUser=root); running as uid $(id -u)"

packages=(slurmctld slurmd slurm-client munge)
need_install=0
for bin in slurmctld slurmd sbatch srun scontrol munged; do
  command -v "$bin" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$bin" >/dev/null 2>&1 || need_install=1
done
if [ "$need_install" = 1 ]; then
  [ "${MH_SLURM_NO_INSTALL:-0}" = 1 ] && die_env "Debian packages ${packages[*]} are not installed and MH_SLURM_NO_INSTALL=1"
  command -v apt-get >/dev/null 2>&1 || die_env "Debian packages ${packages[*]} are missing and there is no apt-get"
  echo "slurm-local-up: installing ${packages[*]} (apt-get)" >&2
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >&2; then
    { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >&2; } \
      || die_env "apt-get install ${packages[*]} failed"
  fi
fi
export PATH="$PATH:/usr/sbin:/sbin"
command -v unshare >/dev/null 2>&1 || die_env "unshare (util-linux) is missing"

dir=${MH_SLURM_DIR:-}
if [ -z "$dir" ]; then
  dir=$(mktemp -d /tmp/mh-slurm.XXXXXX)
else
  mkdir -p "$dir"
fi
dir=$(cd "$dir" && pwd)
for pidfile in "$dir"/*.pid; do
  [ -e "$pidfile" ] || continue
  if kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "slurm-local-up: $dir already holds a running daemon ($pidfile); stop it with scripts/slurm-local-down.sh $dir" >&2
    exit 1
  fi
done
chmod 755 "$dir"
cpus=${MH_SLURM_CPUS:-8}
gpus=${MH_SLURM_GPUS:-4}
timeout_s=${MH_SLURM_TIMEOUT:-60}
host=$(hostname -s)

# Free TCP ports for slurmctld and the two slurmd (other clusters or jobs may share the host).
used_ports=" "
free_port() {
  local p
  for _ in $(seq 200); do
    p=$((40000 + RANDOM % 9000))
    case "$used_ports" in *" $p "*) continue ;; esac
    if [ -z "$(ss -Htln "sport = :$p" 2>/dev/null)" ]; then
      used_ports="$used_ports$p "
      echo "$p"
      return 0
    fi
  done
  echo "slurm-local-up: no free TCP port found in 40000-48999" >&2
  return 1
}
ctld_port=$(free_port)
node1_port=$(free_port)
node2_port=$(free_port)

first_job_id=$((1000 + (RANDOM * 32768 + RANDOM) % 1000000))

mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
chmod 700 "$dir/munge"            # munged: key dir 700
chmod 755 "$dir/spool"

# munge: its own key, socket in DIR (socket dir 755).
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1 count=1024 status=none
chmod 400 "$dir/munge/munge.key"

gres_node=""
gres_types=""
if [ "$gpus" -gt 0 ]; then
  gres_types="GresTypes=gpu"
  gres_node="Gres=gpu:$gpus"
  : > "$dir/gres.conf"
  echo "AutoDetect=off" >> "$dir/gres.conf"
  for i in $(seq 0 $((gpus - 1))); do
    # char devices (plain files schedule but leave CUDA_VISIBLE_DEVICES unset); same major/minor as /dev/null
    [ -e "$dir/fakegpu$i" ] || mknod "$dir/fakegpu$i" c 1 3
  done
  echo "Name=gpu File=$dir/fakegpu[0-$((gpus - 1))]" >> "$dir/gres.conf"
fi

cat > "$dir/slurm.conf" <<EOF
# Written by scripts/slurm-local-up.sh: a throw-away cluster for tests.
ClusterName=mhlocal
# a random first job id: jobs derive their rendezvous port from it (20000 + id % 20000), so two clusters
# on one host (concurrent test sessions) do not meet on the same port
FirstJobId=$first_job_id
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=30
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MessageTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
$gres_types
NodeName=node1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$node1_port CPUs=$cpus RealMemory=4096 $gres_node State=UNKNOWN
NodeName=node2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$node2_port CPUs=$cpus RealMemory=4096 $gres_node State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
[ "$gpus" -gt 0 ] || rm -f "$dir/gres.conf"
printf 'SLURM_CONF=%s\n' "$dir/slurm.conf" > "$dir/env"
export SLURM_CONF="$dir/slurm.conf"

# Hosts file seen by the daemons and every job step: the emulated node names resolve to the local host.
{ cat /etc/hosts; echo "127.0.0.1 node1 node2"; } > "$dir/hosts"

fail() {
  echo "slurm-local-up: $1" >&2
  for log in "$dir/munged.log" "$dir/slurmctld.log" "$dir/slurmd.node1.log" "$dir/slurmd.node2.log"; do
    [ -f "$log" ] && { echo "--- tail $log" >&2; tail -n 15 "$log" >&2; }
  done
  MH_SLURM_KEEP=1 bash "$(dirname "$0")/slurm-local-down.sh" "$dir" >&2 || true
  exit 1
}

wait_pidfile() {  # FILE SECONDS: wait until FILE names a live process
  local end=$((SECONDS + $2))
  while [ "$SECONDS" -lt "$end" ]; do
    if [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; then return 0; fi
    sleep 0.2
  done
  return 1
}

munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/munge.seed" \
  >>"$dir/munged.log" 2>&1 || fail "munged did not start"
wait_pidfile "$dir/munged.pid" 10 || fail "munged did not write its PID file"

# The daemons run in their own mount namespace where DIR/hosts is /etc/hosts; they daemonize, so the
# unshare'd shell returns at once and the namespace lives on with them.
# shellcheck disable=SC2016  # $1 and $@ belong to the inner sh
in_ns() { unshare -m sh -c 'mount --bind "$1" /etc/hosts && shift && exec "$@"' sh "$dir/hosts" "$@"; }

in_ns slurmctld -f "$dir/slurm.conf" >>"$dir/slurmctld.log" 2>&1 || fail "slurmctld did not start"
wait_pidfile "$dir/slurmctld.pid" 20 || fail "slurmctld did not write its PID file"
for node in node1 node2; do
  mkdir -p "$dir/spool/$node"
  in_ns slurmd -f "$dir/slurm.conf" -N "$node" >>"$dir/slurmd.$node.log" 2>&1 || fail "slurmd -N $node did not start"
done
for node in node1 node2; do
  wait_pidfile "$dir/slurmd.$node.pid" 20 || fail "slurmd -N $node did not write its PID file"
done

end=$((SECONDS + timeout_s))
while :; do
  states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ' || true)
  case "$states" in
    "node1 idle node2 idle ") break ;;
  esac
  [ "$SECONDS" -lt "$end" ] || fail "nodes not idle after ${timeout_s}s (sinfo: ${states:-no answer})"
  sleep 0.5
done
echo "slurm-local-up: cluster up in $dir (slurmctld :$ctld_port, node1 :$node1_port, node2 :$node2_port); clients: . $dir/env" >&2
echo "MH_SLURM_DIR=$dir"
