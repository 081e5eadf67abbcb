#!/usr/bin/env bash
# Stop the cluster started by tests/slurm/up.sh (same STATE_DIR argument / $FLODL_SLURM_DIR),
# unless another live caller of up.sh still holds a lease (see common.sh).
#   bash tests/slurm/down.sh [STATE_DIR]          # the topology is read from STATE_DIR/nodes
#   bash tests/slurm/down.sh --nodes 2            # the default dir of the two-node cluster
# Several nodes: also removes the nodes' namespaces (ending what still runs in them), veths, bridge
# and the nodes' hosts files, by name (so also after a crashed bring-up).
# Cancels this cluster's jobs, then stops each daemon by its PID file (TERM, bounded wait,
# KILL). Touches only processes named in our PID files (checked against /proc/<pid>/comm)
# and slurmstepd processes of this cluster. Idempotent; keeps the state dir (rm -rf it to
# start from scratch).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) [ $# -ge 2 ] || { echo "[flodl-slurm] --nodes needs a value" >&2; exit 1; }; export FLODL_SLURM_NODES="$2"; shift 2 ;;
    --nodes=*) export FLODL_SLURM_NODES="${1#--nodes=}"; shift ;;
    -*) echo "[flodl-slurm] unknown option $1 (usage: down.sh [--nodes N] [STATE_DIR])" >&2; exit 1 ;;
    *) _dir="$1"; shift ;;
  esac
done
# shellcheck source=common.sh
source "$HERE/common.sh" "$_dir"

if [ ! -d "$D" ]; then
  [ "$NODES" -gt 1 ] && net_down  # namespaces and links are named after the cluster, not the dir
  log "nothing to stop ($D does not exist)"
  exit 0
fi

take_lock

drop_lease "$(lease_pid)"
others="$(live_leases | tr '\n' ' ')"
if [ -n "${others// /}" ] && [ "${FLODL_SLURM_FORCE_DOWN:-0}" != "1" ]; then
  log "still used by pid(s) $others(leases in $LEASE_DIR): left up; FLODL_SLURM_FORCE_DOWN=1 stops it anyway"
  exit 0
fi

# Jobs first, so no slurmstepd/job process outlives slurmd.
if daemon_alive slurmctld && [ -f "$SLURM_CONF" ]; then
  jobs="$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ')"
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    timeout 10 scancel $jobs 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
      [ -z "$(timeout 10 squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
fi

for ((k = ${#DAEMONS[@]} - 1; k >= 0; k--)); do
  IFS='|' read -r name pf lf comm <<<"${DAEMONS[$k]}"
  stop_daemon "$name" 20
done

# Job steps that outlived slurmd (e.g. slurmctld was already gone so scancel could not
# reach them): KILL each slurmstepd of this cluster together with its task processes.
stepds="$(our_stepds | tr '\n' ' ')"
if [ -n "${stepds// /}" ]; then
  # shellcheck disable=SC2086
  tree="$(proc_tree $stepds | tr '\n' ' ')"
  log "killing leftover job steps of this cluster: pids $tree"
  # shellcheck disable=SC2086
  kill -KILL $tree 2>/dev/null || true
fi
if [ "$NODES" -gt 1 ]; then
  # What still runs in the nodes' namespaces (by PID: only processes inside namespaces we made), then
  # the namespaces, veths, bridge and hosts files. By name, so also what a crashed bring-up left.
  net_down
  log "removed namespaces ${NODE_NAMES[*]} and bridge $BRIDGE"
fi
rm -f "$D/env.sh"
log "down ($D)"
