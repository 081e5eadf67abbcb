# Shared by up.sh and down.sh (sourced, not executed).
# Layout of the state dir and helpers to manage the daemons by their PID files.

FLODL_SLURM_DIR="${1:-${FLODL_SLURM_DIR:-/tmp/flodl-slurm}}"
case "$FLODL_SLURM_DIR" in /*) ;; *) FLODL_SLURM_DIR="$(pwd)/$FLODL_SLURM_DIR" ;; esac
D="$FLODL_SLURM_DIR"

# Ports (all bound to 127.0.0.1). Override to run next to another cluster.
CTLD_PORT="${FLODL_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${FLODL_SLURM_SLURMD_PORT:-6818}"
DBD_PORT="${FLODL_SLURM_DBD_PORT:-6819}"
DB_PORT="${FLODL_SLURM_DB_PORT:-3307}"
NODE_CPUS="${FLODL_SLURM_CPUS:-4}"
NODE_MEM_MB="${FLODL_SLURM_MEM_MB:-8000}"
CLUSTER="${FLODL_SLURM_CLUSTER:-flodl}"
CRED_EXPIRE="${FLODL_SLURM_CRED_EXPIRE:-10}"  # also the delay before a requeued job restarts

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
  "slurmd|$RUN_DIR/slurmd.pid|$LOG_DIR/slurmd.log|slurmd"
)

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
