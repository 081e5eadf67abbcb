# Shared by up.sh and down.sh (sourced, not executed).
# Layout of the state dir and helpers to manage the daemons by their PID files.
#
# Topology: FLODL_SLURM_NODES (up.sh --nodes N) = 1 (default): one node, everything on 127.0.0.1,
# state in /tmp/flodl-slurm. N > 1: N compute nodes, each a network namespace with its own host
# name (UTS namespace), address on a bridge this script creates, slurmd and spool; slurmctld,
# slurmdbd, mariadbd and munged stay in the root namespace (see up.sh). State in
# /tmp/flodl-slurm<N>, cluster flodl<N>, ports +10: it can run next to the one-node cluster.
# down.sh reads N from the state dir (<dir>/nodes), so `down.sh <dir>` needs no flag.

_arg_dir="${1:-}"
NODES="${FLODL_SLURM_NODES:-}"
if [ -n "$_arg_dir" ]; then
  FLODL_SLURM_DIR="$_arg_dir"
elif [ -n "$NODES" ] && [ "$NODES" != 1 ]; then
  FLODL_SLURM_DIR="${FLODL_SLURM_MULTI_DIR:-/tmp/flodl-slurm$NODES}"
else
  FLODL_SLURM_DIR="${FLODL_SLURM_DIR:-/tmp/flodl-slurm}"
fi
case "$FLODL_SLURM_DIR" in /*) ;; *) FLODL_SLURM_DIR="$(pwd)/$FLODL_SLURM_DIR" ;; esac
D="$FLODL_SLURM_DIR"
if [ -z "$NODES" ]; then  # down.sh: the topology this state dir was brought up with
  NODES="$(tr -dc '0-9' <"$D/nodes" 2>/dev/null || true)"
  NODES="${NODES:-1}"
fi
case "$NODES" in '' | *[!0-9]* | 0) echo "[flodl-slurm] --nodes must be a positive integer (got '$NODES')" >&2; exit 1 ;; esac
[ "$NODES" -le 8 ] || { echo "[flodl-slurm] --nodes $NODES: at most 8 nodes" >&2; exit 1; }

if [ "$NODES" -eq 1 ]; then
  _port_base=0
  CLUSTER="${FLODL_SLURM_CLUSTER:-flodl}"
else
  _port_base=10
  CLUSTER="${FLODL_SLURM_CLUSTER:-flodl$NODES}"
fi
# Ports. One node: all bound to 127.0.0.1. Several: slurmctld binds the bridge's root-side address,
# slurmd the node's own address in its namespace. Override to run next to another cluster.
CTLD_PORT="${FLODL_SLURM_CTLD_PORT:-$((6817 + _port_base))}"
SLURMD_PORT="${FLODL_SLURM_SLURMD_PORT:-$((6818 + _port_base))}"
DBD_PORT="${FLODL_SLURM_DBD_PORT:-$((6819 + _port_base))}"
DB_PORT="${FLODL_SLURM_DB_PORT:-$((3307 + _port_base / 10))}"
NODE_CPUS="${FLODL_SLURM_CPUS:-4}"
NODE_MEM_MB="${FLODL_SLURM_MEM_MB:-8000}"
CRED_EXPIRE="${FLODL_SLURM_CRED_EXPIRE:-10}"  # also the delay before a requeued job restarts
SLURMD_TIMEOUT="${FLODL_SLURM_SLURMD_TIMEOUT:-20}"  # s without a slurmd answer before its node is DOWN

# Several nodes: names (node name = namespace name = host name inside it), the bridge, addresses.
# Interface names stay under 15 characters: the cluster name is at most 8.
SUBNET="${FLODL_SLURM_SUBNET:-10.213.$NODES}"   # a /24: bridge .1, node i .(10+i)
BRIDGE="${CLUSTER}-br"
HEAD_ADDR="$SUBNET.1"
HEAD_NAME="${CLUSTER}-head"  # slurmctld's host name (its own UTS namespace, in the root network namespace)
NODE_NAMES=()
NODE_ADDRS=()
if [ "$NODES" -gt 1 ]; then
  case "$CLUSTER" in *[!a-z0-9]* | ?????????*) echo "[flodl-slurm] cluster name '$CLUSTER': 1-8 of [a-z0-9]" >&2; exit 1 ;; esac
  for ((_i = 0; _i < NODES; _i++)); do
    NODE_NAMES+=("${CLUSTER}-n$_i")
    NODE_ADDRS+=("$SUBNET.$((10 + _i))")
  done
fi
node_veth() { echo "${CLUSTER}-v$1"; }  # root side of node <index>'s veth (its peer is eth0 in the node)

SLURM_CONF="$D/slurm.conf"
export SLURM_CONF

MUNGE_DIR="$D/munge"          # owned by munge
DB_DIR="$D/db"                # owned by mysql (datadir in $DB_DIR/data)
RUN_DIR="$D/run"              # slurm pid files
LOG_DIR="$D/log"              # slurm logs
MUNGE_SOCKET="$MUNGE_DIR/munge.socket.2"
DB_SOCKET="$DB_DIR/mysqld.sock"

# name|pidfile|logfile|expected /proc/<pid>/comm ; in start order (stop in reverse).
DAEMONS=(
  "munged|$MUNGE_DIR/munged.pid|$MUNGE_DIR/munged.log|munged"
  "mariadbd|$DB_DIR/mariadbd.pid|$DB_DIR/mariadbd.log|mariadbd"
  "slurmdbd|$RUN_DIR/slurmdbd.pid|$LOG_DIR/slurmdbd.log|slurmdbd"
  "slurmctld|$RUN_DIR/slurmctld.pid|$LOG_DIR/slurmctld.log|slurmctld"
)
if [ "$NODES" -eq 1 ]; then
  DAEMONS+=("slurmd|$RUN_DIR/slurmd.pid|$LOG_DIR/slurmd.log|slurmd")
  SLURMDS=(slurmd)
else
  SLURMDS=()
  for _n in "${NODE_NAMES[@]}"; do  # SlurmdPidFile/SlurmdLogFile use %n (the node name)
    DAEMONS+=("slurmd@$_n|$RUN_DIR/slurmd-$_n.pid|$LOG_DIR/slurmd-$_n.log|slurmd")
    SLURMDS+=("slurmd@$_n")
  done
fi

log() { echo "[flodl-slurm] $*" >&2; }

# Leases: up.sh records its caller (a pytest session, a shell) in $LEASE_DIR/<pid>; down.sh
# drops its caller's lease and stops the cluster only when no other live caller holds one,
# so one session's teardown does not pull the cluster from under another's tests.
# FLODL_SLURM_LEASE_PID overrides the caller pid; FLODL_SLURM_FORCE_DOWN=1 ignores leases.
LEASE_DIR="$D/leases"
lease_pid() { echo "${FLODL_SLURM_LEASE_PID:-$PPID}"; }
proc_start() {  # the start time of pid $1 (guards against pid reuse); fails when it is gone
  local s
  s="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  s="${s##*) }"  # fields after "pid (comm) ": state ppid ... starttime is the 20th
  set -- $s
  echo "${20}"
}
add_lease() { mkdir -p "$LEASE_DIR" && proc_start "$1" >"$LEASE_DIR/$1" || rm -f "$LEASE_DIR/$1"; }
drop_lease() { rm -f "$LEASE_DIR/$1"; }
live_leases() {  # pids of live lease holders (same pid and start time); removes stale leases
  local f pid
  [ -d "$LEASE_DIR" ] || return 0
  for f in "$LEASE_DIR"/*; do
    [ -e "$f" ] || continue
    pid="${f##*/}"
    if [ "$(proc_start "$pid")" = "$(cat "$f" 2>/dev/null)" ]; then
      echo "$pid"
    else
      rm -f "$f"
    fi
  done
}

# Serialise up.sh/down.sh on one state dir (fd 9; daemons are started with 9>&- so they
# never inherit the lock).
take_lock() {
  mkdir -p "$D"
  exec 9>"$D/.lock"
  if ! flock -w "${FLODL_SLURM_LOCK_TIMEOUT:-300}" 9; then
    log "another up.sh/down.sh holds $D/.lock"
    exit 1
  fi
}

daemon_field() {  # daemon_field <name> <index 1..3>
  local e
  for e in "${DAEMONS[@]}"; do
    IFS='|' read -r n p l c <<<"$e"
    if [ "$n" = "$1" ]; then
      case "$2" in 1) echo "$p" ;; 2) echo "$l" ;; 3) echo "$c" ;; esac
      return 0
    fi
  done
  return 1
}

# Prints the PID of <name> if its PID file names a live process with the
# expected command name (guards against PID reuse); fails otherwise.
daemon_pid() {
  local pf comm pid
  pf="$(daemon_field "$1" 1)"; comm="$(daemon_field "$1" 3)"
  [ -s "$pf" ] || return 1
  pid="$(tr -dc '0-9' <"$pf")"
  [ -n "$pid" ] || return 1
  [ -r "/proc/$pid/comm" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] || return 1
  # A killed daemon may linger as a zombie until init reaps it: that is not alive.
  local stat
  stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  case "${stat%% *}" in Z | X | x) return 1 ;; esac
  echo "$pid"
}

daemon_alive() { daemon_pid "$1" >/dev/null; }

# TERM, wait up to <secs>, then KILL. Only the PID from our PID file.
stop_daemon() {
  local name="$1" secs="${2:-15}" pid pf i
  pf="$(daemon_field "$name" 1)"
  if ! pid="$(daemon_pid "$name")"; then
    rm -f "$pf"
    return 0
  fi
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < secs * 10; i++)); do
    daemon_alive "$name" || break
    sleep 0.1
  done
  if daemon_alive "$name"; then
    log "$name (pid $pid) ignored TERM for ${secs}s: KILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do daemon_alive "$name" || break; sleep 0.1; done
  fi
  rm -f "$pf"
}

# slurmstepd processes of jobs of *this* cluster (they carry our SLURM_CONF).
our_stepds() {
  local p
  for p in /proc/[0-9]*; do
    [ "$(cat "$p/comm" 2>/dev/null)" = "slurmstepd" ] || continue
    if tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF"; then
      echo "${p#/proc/}"
    fi
  done
}

# <pid> and all its descendants (by ppid), parents first.
proc_tree() {
  local todo=("$@") p c
  while [ ${#todo[@]} -gt 0 ]; do
    p="${todo[0]}"; todo=("${todo[@]:1}")
    echo "$p"
    for c in /proc/[0-9]*/stat; do
      c="$(cat "$c" 2>/dev/null)" || continue
      # fields after "comm)": state ppid ...
      local rest="${c##*) }" cpid="${c%% *}"
      set -- $rest
      [ "${2:-}" = "$p" ] && todo+=("$cpid")
    done
  done
}

tail_logs() {
  local e n p l c
  for e in "${DAEMONS[@]}"; do
    IFS='|' read -r n p l c <<<"$e"
    if [ -s "$l" ]; then
      echo "----- tail $l -----" >&2
      tail -n 25 "$l" >&2
    fi
  done
}

# ---------- the nodes' network (several nodes only) ---------------------------------------------
# One Linux bridge ($BRIDGE, $HEAD_ADDR/24, in the root namespace) and per node a network namespace
# named like the node, joined to the bridge by a veth (root side $(node_veth i), "eth0" inside), with
# loopback up and no default route: a node reaches the bridge's addresses and nothing else.
# Processes run in a node through in_node: its network namespace, a UTS namespace named like the node
# and a mount namespace where $D/net/<node>.hosts (every node by its bridge address, as a cluster's DNS
# would) is bound over /etc/hosts. Not `ip netns exec`: it remounts /sys, which hides
# /sys/fs/cgroup, and slurmd 22.05 refuses to start without it ("No filesystem mounted on
# /sys/fs/cgroup"). Nothing is written under /etc. Namespace and link names derive from the cluster
# name, so net_down finds what a crashed bring-up left without any state file.
NETNS_ERR_RC=4  # up.sh's exit code when the container forbids namespaces/links (callers may skip)
ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qxF "$1"; }

net_ok() {  # the bridge with its address, every namespace with its address and veth
  local i n
  ip -o -4 addr show dev "$BRIDGE" 2>/dev/null | grep -q " $HEAD_ADDR/24 " || return 1
  for ((i = 0; i < NODES; i++)); do
    n="${NODE_NAMES[$i]}"
    ns_exists "$n" || return 1
    ip -n "$n" -o -4 addr show dev eth0 2>/dev/null | grep -q " ${NODE_ADDRS[$i]}/24 " || return 1
    ip -o link show "$(node_veth "$i")" 2>/dev/null | grep -q "master $BRIDGE .*state UP\|master $BRIDGE state UP" || return 1
    [ -s "$D/net/$n.hosts" ] || return 1
  done
  [ -s "$D/net/head.hosts" ] && [ -s "$D/net/resolv.conf" ] || return 1
}

net_down() {  # idempotent: what runs in our namespaces (by PID), the namespaces, veths, bridge, hosts files
  local i n pids sig k
  for ((i = 0; i < NODES; i++)); do
    n="${NODE_NAMES[$i]}"
    if ns_exists "$n"; then
      for sig in TERM KILL; do
        pids="$(ip netns pids "$n" 2>/dev/null | tr '\n' ' ')"
        [ -n "${pids// /}" ] || break
        log "SIG$sig to processes left in namespace $n: $pids"
        # shellcheck disable=SC2086
        kill -"$sig" $pids 2>/dev/null || true
        for ((k = 0; k < 50; k++)); do [ -z "$(ip netns pids "$n" 2>/dev/null)" ] && break; sleep 0.1; done
      done
      ip netns del "$n" 2>/dev/null || log "could not delete namespace $n: $(ip netns del "$n" 2>&1)"
    fi
    ip link del "$(node_veth "$i")" 2>/dev/null || true
    rm -f "$D/net/$n.hosts"
  done
  rm -f "$D/net/head.hosts" "$D/net/resolv.conf"
  ip link del "$BRIDGE" 2>/dev/null || true
}

net_up() {  # fails with $NETNS_ERR_RC (and the exact error) where the container forbids it
  local i n v out
  if ip -o -4 addr show | grep -v " $BRIDGE " | grep -q " inet $SUBNET\.[0-9]*/"; then
    log "subnet $SUBNET.0/24 is already used on this machine: set FLODL_SLURM_SUBNET (e.g. 10.214.$NODES)"
    ip -o -4 addr show | grep " inet $SUBNET\." >&2
    exit 1
  fi
  net_try() { out="$("$@" 2>&1)" || { log "ERROR: '$*' failed: $out"; log "the container forbids network namespaces/links: cannot build the $NODES-node cluster"; net_down; exit "$NETNS_ERR_RC"; }; }
  mkdir -p "$D/net"
  net_try ip link add "$BRIDGE" type bridge
  net_try ip addr add "$HEAD_ADDR/24" dev "$BRIDGE"
  net_try ip link set "$BRIDGE" up
  for ((i = 0; i < NODES; i++)); do
    n="${NODE_NAMES[$i]}"; v="$(node_veth "$i")"
    net_try ip netns add "$n"
    net_try ip link add "$v" type veth peer name eth0 netns "$n"
    net_try ip link set "$v" master "$BRIDGE"
    net_try ip link set "$v" up
    net_try ip -n "$n" addr add "${NODE_ADDRS[$i]}/24" dev eth0
    net_try ip -n "$n" link set lo up
    net_try ip -n "$n" link set eth0 up
    {
      echo "# Generated by tests/slurm/up.sh for node $n of cluster $CLUSTER (bound over /etc/hosts in the node)"
      echo "127.0.0.1 localhost"
      echo "::1 localhost ip6-localhost ip6-loopback"
      echo "$HEAD_ADDR $HEAD_NAME"
      local j
      for ((j = 0; j < NODES; j++)); do echo "${NODE_ADDRS[$j]} ${NODE_NAMES[$j]}"; done
    } >"$D/net/$n.hosts"
  done
  sed "s/for node $n of/for the head ($HEAD_NAME, slurmctld) of/" "$D/net/$n.hosts" >"$D/net/head.hosts"
  # Names resolve from the hosts file only: a DNS query goes to loopback (refused at once), never out.
  printf '# Generated by tests/slurm/up.sh: the nodes resolve names from /etc/hosts only\nnameserver 127.0.0.1\n' >"$D/net/resolv.conf"
  # a process inside a node sees its host name, resolves it to its bridge address and reaches the
  # bridge (also proves that nsenter/unshare/mount work here)
  n="${NODE_NAMES[$((NODES - 1))]}"
  net_try in_node "$n" sh -c '[ "$(hostname -s)" = "$1" ] && getent hosts "$1" | grep -q "^$2 " && ip -o -4 addr show dev eth0 | grep -q " $2/"' sh "$n" "${NODE_ADDRS[$((NODES - 1))]}"
}

# Runs "$@" as the head: the root network namespace (it reaches the bridge and 127.0.0.1), a UTS
# namespace named $HEAD_NAME, the head's hosts file. With CommunicationParameters=NoCtldInAddrAny,
# slurmctld binds what its host name resolves to: $HEAD_NAME -> $HEAD_ADDR, the bridge only (with the
# machine's own name it would bind 127.0.0.1, which the nodes cannot reach).
in_head() {
  unshare --mount --uts --propagation slave -- \
    sh -c 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"' "$HEAD_NAME" "$D/net/head.hosts" "$@"
}

# Runs "$@" inside node <name>: its network namespace, a UTS namespace with the node's host name, and
# a mount namespace with the node's hosts file over /etc/hosts and a resolv.conf that sends no DNS
# query out (the rest of the file system is shared).
in_node() {
  local n="$1"; shift
  nsenter --net="/run/netns/$n" -- unshare --mount --uts --propagation slave -- \
    sh -c 'mount --bind "$1" /etc/hosts && { [ ! -e /etc/resolv.conf ] || mount --bind "$2" /etc/resolv.conf; } && hostname "$0" && shift 2 && exec "$@"' \
    "$n" "$D/net/$n.hosts" "$D/net/resolv.conf" "$@"
}
