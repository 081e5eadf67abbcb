"""The torch.distributed TCPStore the collective backend rendezvouses on, hosted by the job's task 0.

Task 0 hosts it, not the coordinator: task 0 trains rank 0 and imports torch for it anyway, while the
coordinator of the nccl backend then needs no torch at all (its import was about 2 s of CPU on the cores the
ranks start on; docs/reference/measurements.md, start-up). The store lives as long as it is of use: a dead rank
other than 0 never takes it along, and a lost task 0 ends the run whoever hosts the store (the coordinator is
its child and dies with it, jobs/job.py).

The listening socket is bound before the coordinator starts, so the coordinator writes its port into the
rendezvous file at once; a rank that dials it before the store serves waits in the socket's backlog. torch
would listen on every interface (``host`` names the server only for clients), so the socket is made here,
bound to ``host`` only, and handed over with ``master_listen_fd``; the store owns (and closes) it from then
on. The store itself has no authentication: the process groups' key prefixes come from the job token
(store_names.group_prefix).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Mapping

from flodl_exp.config import ClusterConfig, cluster_size
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.wire import listen


@dataclass
class StoreHandle:
    """The TCPStore and the address its listening socket is bound to."""

    store: Any
    host: str
    port: int
    fd: int = field(repr=False)
    """The listening socket's descriptor (owned and closed by the store)."""


def needs_store(config: Mapping[str, Any], cluster: ClusterConfig) -> bool:
    """The run's ranks may form a process group: two ranks or more, and a collective backend configured or
    ``mode=auto`` (its choice may land on one whatever its fallback, and so may a resumed choice)."""
    mode = config["mode"]
    return cluster_size(cluster) > 1 and (bool(mode.get("auto")) or Mode.parse(mode["policy"], mode["backend"]).is_nccl)


def bind_store_socket(host: str) -> socket.socket:
    """The store's listening socket on ``host``, a free port (stdlib only: before torch is imported)."""
    return listen(host, 0)


def serve_store(sock: socket.socket) -> StoreHandle:
    """The TCPStore on ``sock`` (imports torch.distributed); the socket is the store's from here, even when
    this raises (it is closed then)."""
    from datetime import timedelta

    import torch.distributed as dist

    host, port = sock.getsockname()[:2]
    try:
        store = dist.TCPStore(host, port, world_size=None, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store closes the descriptor with itself: never close it from here too
    return StoreHandle(store, host, port, fd)


def start_store(host: str) -> StoreHandle:
    """Bind and serve in one step (tests, and a host that needs no port before torch loads)."""
    return serve_store(bind_store_socket(host))
