"""Which ranks average on their node first (``cluster.node_reduce``, the cpu backend): pure.

Ranks whose hellos name the same host form a node group; its lowest rank leads it (sums the members' snapshots
into one partial, hands each its update: rank/node_relay.py). A node with one rank, or a rank whose host is
unknown, has no group and answers the coordinator directly, as every rank does without ``node_reduce``. The
leader's socket is named from the job (``prefix``) and the leader, so two jobs on one node never share one.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from flodl_exp.protocol.messages import NodeGroup


@dataclass(frozen=True)
class NodeGroups:
    members: dict[int, list[int]] = field(default_factory=dict)
    """Leader -> its group's ranks, ascending (the leader first)."""

    def leader_of(self, r: int) -> Optional[int]:
        for leader, ranks in self.members.items():
            if r in ranks:
                return leader
        return None

    def messages(self, prefix: str) -> list[tuple[int, NodeGroup]]:
        """The ``NodeGroup`` each grouped rank is sent, as (rank, message)."""
        out: list[tuple[int, NodeGroup]] = []
        for leader, ranks in sorted(self.members.items()):
            msg = NodeGroup(leader=leader, members=list(ranks), address=f"{prefix}-{leader}")
            out.extend((r, msg) for r in ranks)
        return out


def node_groups(hosts: Mapping[int, Optional[str]]) -> NodeGroups:
    """Group ranks by host name; groups of one are left out."""
    by_host: dict[str, list[int]] = {}
    for r, host in sorted(hosts.items()):
        if host and host != "unknown":
            by_host.setdefault(host, []).append(r)
    return NodeGroups({ranks[0]: ranks for ranks in by_host.values() if len(ranks) > 1})


def relay_prefix(job_dir: str, attempt: int) -> str:
    """The job's node-leader socket prefix: a digest of its folder and attempt (a requeued attempt binds anew,
    and jobs sharing a node never meet)."""
    digest = hashlib.sha1(f"{job_dir}\0{attempt}".encode()).hexdigest()[:16]
    return f"flodl-{digest}"
