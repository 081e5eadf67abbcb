#!/usr/bin/env bash
# Fail one compute node of the multi-node cluster started by tests/slurm/up.sh --nodes N, as a power loss:
# its link goes down first (its peers hear nothing more, no FIN or RST), then everything running in its
# namespace is SIGKILLed (slurmd, slurmstepd, the job's tasks). SLURM finds out by itself: slurmctld marks
# the node DOWN once its slurmd has not answered for SlurmdTimeout (common.sh, 20 s here).
#   bash tests/slurm/fail_node.sh --nodes 2 [STATE_DIR] NODE      # e.g. NODE=flodl2-n1
# `up.sh` with the same arguments brings the node back (it rebuilds the nodes whenever a slurmd is missing;
# ReturnToService=2 returns it to service once its slurmd registers again).
# Touches only processes inside the named namespace, which up.sh made.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) [ $# -ge 2 ] || { echo "[flodl-slurm] --nodes needs a value" >&2; exit 1; }; export FLODL_SLURM_NODES="$2"; shift 2 ;;
    --nodes=*) export FLODL_SLURM_NODES="${1#--nodes=}"; shift ;;
    -*) echo "[flodl-slurm] unknown option $1 (usage: fail_node.sh [--nodes N] [STATE_DIR] NODE)" >&2; exit 1 ;;
    *) _args+=("$1"); shift ;;
  esac
done
case "${#_args[@]}" in
  1) _dir=""; node="${_args[0]}" ;;
  2) _dir="${_args[0]}"; node="${_args[1]}" ;;
  *) echo "[flodl-slurm] usage: fail_node.sh [--nodes N] [STATE_DIR] NODE" >&2; exit 1 ;;
esac
# shellcheck source=common.sh
source "$HERE/common.sh" "$_dir"

[ "$NODES" -gt 1 ] || { log "fail_node.sh needs a multi-node cluster (--nodes N, N > 1)"; exit 1; }
printf '%s\n' "${NODE_NAMES[@]}" | grep -qxF "$node" || { log "no node '$node' (nodes: ${NODE_NAMES[*]})"; exit 1; }
ns_exists "$node" || { log "node $node has no namespace (is the cluster up?)"; exit 1; }

ip -n "$node" link set eth0 down || { log "could not take $node's link down"; exit 1; }
pids="$(ip netns pids "$node" 2>/dev/null | tr '\n' ' ')"
if [ -n "${pids// /}" ]; then
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
fi
for ((k = 0; k < 100; k++)); do [ -z "$(ip netns pids "$node" 2>/dev/null)" ] && break; sleep 0.1; done
left="$(ip netns pids "$node" 2>/dev/null | tr '\n' ' ')"
[ -z "${left// /}" ] || { log "processes left in $node after SIGKILL: $left"; exit 1; }
log "node $node failed: link down, killed pids ${pids:-none}"
