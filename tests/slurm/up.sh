#!/usr/bin/env bash
# Bring up a real SLURM cluster (with slurmdbd accounting).
#
#   bash tests/slurm/up.sh [STATE_DIR]            # one node on 127.0.0.1; default $FLODL_SLURM_DIR or /tmp/flodl-slurm
#   bash tests/slurm/up.sh --nodes 2 [STATE_DIR]  # two nodes, each a network namespace (default /tmp/flodl-slurm2)
#   source STATE_DIR/env.sh                       # exports SLURM_CONF for sbatch/srun/sinfo/submitit
#
# --nodes N > 1: node i is the network namespace ${CLUSTER}-n<i> (cluster flodl<N>): its own host name
# (UTS namespace, `hostname -s` = the node name), its own address <subnet>.(10+i) on a bridge this script
# creates (<subnet>.1 on the root side, FLODL_SLURM_SUBNET, default 10.213.<N>), its own slurmd, spool,
# pid and log file. munged, mariadbd and slurmdbd run in the root namespace on 127.0.0.1 as for one node;
# slurmctld runs as host flodl<N>-head (own UTS namespace) and binds only the bridge's root-side address
# (CommunicationParameters=NoCtldInAddrAny), so SLURM traffic stays on the bridge. The shared file system is the same disk. Without --nodes, the topology is
# the one STATE_DIR was brought up with (one node for a new dir).
#
# Idempotent: installs packages only when missing, starts only daemons that are not running,
# returns at once when the cluster is already up. Stop it with tests/slurm/down.sh.
# Exit codes: 0 up; 1 bring-up failed (daemon log tails printed); 2 not root;
# 3 packages missing and cannot be installed; 4 the container forbids network namespaces, veths or
# bridges (--nodes > 1; the failing command and its error are printed) (callers may skip on 2, 3, 4 only).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) [ $# -ge 2 ] || { echo "[flodl-slurm] --nodes needs a value" >&2; exit 1; }; export FLODL_SLURM_NODES="$2"; shift 2 ;;
    --nodes=*) export FLODL_SLURM_NODES="${1#--nodes=}"; shift ;;
    -*) echo "[flodl-slurm] unknown option $1 (usage: up.sh [--nodes N] [STATE_DIR])" >&2; exit 1 ;;
    *) _dir="$1"; shift ;;
  esac
done
# shellcheck source=common.sh
source "$HERE/common.sh" "$_dir"

READY_TIMEOUT="${FLODL_SLURM_READY_TIMEOUT:-60}"
# Bump when the generated configs change: a cluster running older configs takes the slow path.
CONF_MARK="# flodl-slurm-config 2 cred_expire=$CRED_EXPIRE"
HOST="$(hostname -s)"
if [ "$NODES" -eq 1 ]; then
  NODE_NAMES=("$HOST")
else
  CONF_MARK="$CONF_MARK nodes=$NODES subnet=$SUBNET"
fi
T0=$(date +%s.%N)

fail() { log "ERROR: $*"; tail_logs; exit 1; }
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }

finish() {
  printf 'export SLURM_CONF=%q\n' "$SLURM_CONF" >"$D/env.sh.tmp"
  printf 'export FLODL_SLURM_DIR=%q\n' "$D" >>"$D/env.sh.tmp"
  mv -f "$D/env.sh.tmp" "$D/env.sh"
  add_lease "$(lease_pid)"
  if [ "$NODES" -eq 1 ]; then
    log "cluster '$CLUSTER' up on $HOST ($1, $(elapsed)s); source $D/env.sh or:"
  else
    log "cluster '$CLUSTER' up: nodes ${NODE_NAMES[*]} at ${NODE_ADDRS[*]}, slurmctld on $HEAD_ADDR:$CTLD_PORT ($BRIDGE) ($1, $(elapsed)s); source $D/env.sh or:"
  fi
  echo "export SLURM_CONF=$SLURM_CONF"
  exit 0
}

if [ "$(id -u)" -ne 0 ]; then
  log "must run as root (starts munged/mariadbd/slurm daemons, may apt-get install)"
  exit 2
fi

take_lock

# Compact state, e.g. "idle", "mix", "idle*" (not responding), "down*", "drain".
node_state() { timeout 10 sinfo -h -N -n "${1:-$HOST}" -o %t 2>/dev/null | head -n1 | tr -d ' '; }
node_usable() {  # every node (or node $1)
  local n
  for n in "${@:-${NODE_NAMES[@]}}"; do
    case "$(node_state "$n")" in idle | mix | alloc | comp) ;; *) return 1 ;; esac
  done
}

# ---------- fast path: already up ----------------------------------------------------------
all_alive() {
  local e n p l c
  for e in "${DAEMONS[@]}"; do
    IFS='|' read -r n p l c <<<"$e"
    daemon_alive "$n" || return 1
  done
}
# (a cluster started with other settings, e.g. by an older up.sh, goes through the slow path,
# which rewrites the configs and restarts the daemons whose config changed)
if [ -f "$SLURM_CONF" ] && grep -qxF "$CONF_MARK" "$SLURM_CONF" && all_alive && { [ "$NODES" -eq 1 ] || net_ok; } && node_usable; then
  finish "already running"
fi

# ---------- packages ------------------------------------------------------------------------
mkdir -p "$D"
echo "$NODES" >"$D/nodes"  # down.sh's topology, also after a bring-up that died half way
PKGS=(slurm-wlm munge slurmdbd mariadb-server)
[ "$NODES" -eq 1 ] || PKGS+=(iproute2)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  for b in munged mariadbd mariadb-install-db slurmdbd slurmctld slurmd sinfo sacctmgr sacct; do
    command -v "$b" >/dev/null || { missing=("${PKGS[@]}"); break; }
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || { log "packages missing (${missing[*]}) and no apt-get"; exit 3; }
  log "installing ${missing[*]} (apt-get)"
  # Keep the packages' init scripts from starting system-wide daemons during install.
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  rc=0
  apt-get update -q >"$D/apt.log" 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then
    apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$D/apt.log" 2>&1 || rc=$?
  fi
  [ $made_policy -eq 1 ] && rm -f /usr/sbin/policy-rc.d
  if [ $rc -ne 0 ]; then
    tail -n 20 "$D/apt.log" >&2
    log "apt-get failed (rc=$rc); full log: $D/apt.log"
    exit 3
  fi
  rm -f "$D/apt.log"
  log "installed in $(elapsed)s"
fi
for b in munged mariadbd mariadb-install-db mariadb slurmdbd slurmctld slurmd sinfo sacctmgr sacct; do
  command -v "$b" >/dev/null || { log "$b not found after install"; exit 3; }
done
if [ "$NODES" -gt 1 ]; then
  for b in ip unshare nsenter mount getent; do
    command -v "$b" >/dev/null || { log "$b not found (packages iproute2, util-linux, libc-bin)"; exit 3; }
  done
fi
id munge >/dev/null 2>&1 || { log "user munge missing"; exit 3; }
id mysql >/dev/null 2>&1 || { log "user mysql missing"; exit 3; }

# ---------- directories and secrets ---------------------------------------------------------
mkdir -p "$D" "$RUN_DIR" "$LOG_DIR" "$D/state" "$D/spool" "$MUNGE_DIR" "$DB_DIR"
chmod 755 "$D" "$RUN_DIR" "$LOG_DIR"
chmod 700 "$D/state" "$D/spool"
chown munge:munge "$MUNGE_DIR"; chmod 755 "$MUNGE_DIR"
chown mysql:mysql "$DB_DIR"; chmod 750 "$DB_DIR"

if [ ! -s "$MUNGE_DIR/munge.key" ]; then
  dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
fi
chown munge:munge "$MUNGE_DIR/munge.key"; chmod 400 "$MUNGE_DIR/munge.key"

if [ ! -s "$D/db.pass" ]; then
  (umask 077; head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$D/db.pass")
fi
DB_PASS="$(cat "$D/db.pass")"

# ---------- configs (rewritten only when they change) ---------------------------------------
write_if_changed() {  # write_if_changed <file> <mode> ; content on stdin; returns 0 if changed
  local f="$1" mode="$2" tmp
  tmp="$(mktemp "$f.XXXXXX")"
  cat >"$tmp"; chmod "$mode" "$tmp"
  if [ -f "$f" ] && cmp -s "$tmp" "$f"; then rm -f "$tmp"; return 1; fi
  mv -f "$tmp" "$f"; return 0
}

changed=0
if [ "$NODES" -eq 1 ]; then
  CONF_TITLE="one node, everything on 127.0.0.1."
  CTLD_ADDR=127.0.0.1
  CTLD_NAME="$HOST"
  SLURMD_FILES="SlurmdSpoolDir=$D/spool
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmdLogFile=$LOG_DIR/slurmd.log"
  NODE_LINES="NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN"
  PART_NODES="$HOST"
else
  CONF_TITLE="$NODES nodes, each a network namespace on bridge $BRIDGE ($SUBNET.0/24); slurmctld on $HEAD_ADDR."
  CTLD_ADDR="$HEAD_ADDR"
  CTLD_NAME="$HEAD_NAME"
  SLURMD_FILES="# %n: the node name (each slurmd its own spool, pid and log file)
SlurmdSpoolDir=$D/spool/%n
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
# slurmctld (host name $HEAD_NAME -> $HEAD_ADDR) binds the bridge only, not every address of this machine
CommunicationParameters=NoCtldInAddrAny"
  NODE_LINES=""
  for ((i = 0; i < NODES; i++)); do
    NODE_LINES+="NodeName=${NODE_NAMES[$i]} NodeHostname=${NODE_NAMES[$i]} NodeAddr=${NODE_ADDRS[$i]} CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN"$'\n'
  done
  NODE_LINES="${NODE_LINES%$'\n'}"
  PART_NODES="$(IFS=,; echo "${NODE_NAMES[*]}")"
fi
write_if_changed "$SLURM_CONF" 600 <<EOF && changed=1 || true
# Generated by tests/slurm/up.sh -- $CONF_TITLE
$CONF_MARK
ClusterName=$CLUSTER
SlurmctldHost=$CTLD_NAME($CTLD_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s);
# 10 s keeps the preemption/time-limit requeue tests short.
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=$CRED_EXPIRE
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
# A node whose slurmd stops answering is DOWN after this (default 300 s): the node-failure test
# (test_e2e_slurm_multinode) stops a node's slurmd and waits for SLURM to notice.
SlurmdTimeout=$SLURMD_TIMEOUT
MinJobAge=3600
MailProg=/bin/true
StateSaveLocation=$D/state
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
$SLURMD_FILES
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# For the slurmdbd plugin this names the munge socket used towards slurmdbd (AuthInfo is not).
AccountingStoragePass=$MUNGE_SOCKET
$NODE_LINES
# Schedule every 2 s (default 60 s) so a requeued job restarts as soon as its BeginTime passes.
SchedulerParameters=sched_interval=2,bf_interval=2
PartitionName=debug Nodes=$PART_NODES Default=YES MaxTime=INFINITE State=UP
EOF

write_if_changed "$D/slurmdbd.conf" 600 <<EOF && changed=1 || true
# Generated by tests/slurm/up.sh
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=$DB_PASS
EOF

if [ $changed -eq 1 ]; then
  for n in "${SLURMDS[@]}" slurmctld slurmdbd; do
    if daemon_alive "$n"; then log "config changed: restarting $n"; stop_daemon "$n"; fi
  done
fi

wait_for() {  # wait_for <secs> <what> <cmd...> ; polls every 0.2 s until a deadline
  local secs="$1" what="$2" end; shift 2
  end=$(($(date +%s) + secs))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || fail "timed out after ${secs}s waiting for $what"
    sleep 0.2
  done
}

# ---------- munged --------------------------------------------------------------------------
if ! daemon_alive munged; then
  log "starting munged"
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
  touch "$MUNGE_DIR/munged.log"; chown munge:munge "$MUNGE_DIR/munged.log"; chmod 640 "$MUNGE_DIR/munged.log"
  runuser -u munge -- /usr/sbin/munged \
    --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed" </dev/null >>"$MUNGE_DIR/munged.log" 2>&1 9>&- \
    || fail "munged did not start"
  wait_for 10 munged daemon_alive munged
fi
wait_for 10 "munge credentials" bash -c "munge -S '$MUNGE_SOCKET' -n | unmunge -S '$MUNGE_SOCKET'"

# ---------- mariadb -------------------------------------------------------------------------
if ! daemon_alive mariadbd; then
  if [ ! -d "$DB_DIR/data/mysql" ]; then
    log "initialising mariadb datadir"
    rm -rf "$DB_DIR/data"
    mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR/data" \
      --auth-root-authentication-method=socket --skip-test-db \
      >"$DB_DIR/install.log" 2>&1 || { tail -n 20 "$DB_DIR/install.log" >&2; fail "mariadb-install-db failed"; }
    chown -R mysql:mysql "$DB_DIR/data"
  fi
  log "starting mariadbd"
  rm -f "$DB_SOCKET"
  touch "$DB_DIR/mariadbd.log"; chown mysql:mysql "$DB_DIR/mariadbd.log"
  setsid mariadbd --no-defaults --user=mysql --datadir="$DB_DIR/data" \
    --socket="$DB_SOCKET" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
    --pid-file="$DB_DIR/mariadbd.pid" --log-error="$DB_DIR/mariadbd.log" \
    --innodb-buffer-pool-size=64M --skip-log-bin \
    </dev/null >>"$DB_DIR/mariadbd.log" 2>&1 9>&- &
  wait_for 30 mariadbd mariadb-admin --no-defaults --socket="$DB_SOCKET" -u root ping
  wait_for 5 "mariadbd pid file" daemon_alive mariadbd
fi
mariadb --no-defaults --socket="$DB_SOCKET" -u root <<EOF || fail "creating the slurm database/user failed"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF

# ---------- slurmdbd + cluster registration -------------------------------------------------
if ! daemon_alive slurmdbd; then
  log "starting slurmdbd"
  slurmdbd </dev/null >>"$LOG_DIR/slurmdbd.log" 2>&1 9>&- || fail "slurmdbd did not start"
  wait_for 10 slurmdbd daemon_alive slurmdbd
fi
wait_for 30 "slurmdbd to answer" timeout 10 sacctmgr -n -P show cluster format=cluster
if ! timeout 10 sacctmgr -n -P show cluster format=cluster | grep -qxF "$CLUSTER"; then
  log "registering cluster $CLUSTER"
  timeout 20 sacctmgr -i add cluster "$CLUSTER" >&2 || fail "sacctmgr add cluster failed"
fi

# ---------- the nodes' network (several nodes) ----------------------------------------------
if [ "$NODES" -gt 1 ]; then
  reset=0
  net_ok || reset=1
  for n in "${SLURMDS[@]}"; do daemon_alive "$n" || reset=1; done
  if [ $reset -eq 1 ]; then
    # From scratch: whatever a dead bring-up or a crashed run left in the namespaces goes with them.
    for n in "${SLURMDS[@]}"; do stop_daemon "$n"; done
    # slurmctld is bound to the bridge's address: it starts again on the rebuilt bridge
    if daemon_alive slurmctld; then log "rebuilding the nodes' network: restarting slurmctld"; stop_daemon slurmctld; fi
    net_down
    log "creating bridge $BRIDGE ($HEAD_ADDR/24) and namespaces ${NODE_NAMES[*]}"
    net_up
  fi
  for n in "${NODE_NAMES[@]}"; do mkdir -p "$D/spool/$n"; chmod 700 "$D/spool/$n"; done
fi

# ---------- slurmctld, slurmd ---------------------------------------------------------------
if ! daemon_alive slurmctld; then
  log "starting slurmctld"
  if [ "$NODES" -eq 1 ]; then
    slurmctld -i </dev/null >>"$LOG_DIR/slurmctld.log" 2>&1 9>&- || fail "slurmctld did not start"
  else
    in_head slurmctld -i </dev/null >>"$LOG_DIR/slurmctld.log" 2>&1 9>&- || fail "slurmctld did not start"
  fi
  wait_for 10 slurmctld daemon_alive slurmctld
fi
if [ "$NODES" -eq 1 ]; then
  if ! daemon_alive slurmd; then
    log "starting slurmd"
    slurmd -N "$HOST" </dev/null >>"$LOG_DIR/slurmd.log" 2>&1 9>&- || fail "slurmd did not start"
    wait_for 10 slurmd daemon_alive slurmd
  fi
else
  for ((i = 0; i < NODES; i++)); do
    n="${NODE_NAMES[$i]}"
    if ! daemon_alive "slurmd@$n"; then
      log "starting slurmd in node $n (${NODE_ADDRS[$i]})"
      in_node "$n" slurmd -N "$n" </dev/null >>"$LOG_DIR/slurmd-$n.log" 2>&1 9>&- || fail "slurmd of $n did not start"
      wait_for 10 "slurmd of $n" daemon_alive "slurmd@$n"
    fi
  done
fi

# ---------- ready? --------------------------------------------------------------------------
deadline=$(($(date +%s) + READY_TIMEOUT))
resumed=0
until node_usable; do
  for node in "${NODE_NAMES[@]}"; do
    node_usable "$node" && continue
    st="$(node_state "$node" || true)"
    if [ $resumed -eq 0 ] && case "${st%%[*~#!%\$@^-]*}" in down | drain | drng | fail | failg) true ;; *) false ;; esac; then
      log "node $node is '$st': resuming it"
      timeout 10 scontrol update nodename="$node" state=resume >&2 || true
    fi
    [ "$(date +%s)" -lt "$deadline" ] || fail "node $node not idle after ${READY_TIMEOUT}s (state '${st:-?}'); sinfo: $(sinfo 2>&1 | tr '\n' ' ')"
  done
  resumed=1
  for n in slurmctld "${SLURMDS[@]}"; do daemon_alive "$n" || fail "$n died"; done
  sleep 0.3
done
until timeout 10 sacct -n -X -S now-1hours >/dev/null 2>&1; do
  [ "$(date +%s)" -lt "$deadline" ] || fail "sacct does not answer after ${READY_TIMEOUT}s"
  sleep 0.3
done
finish "started"
