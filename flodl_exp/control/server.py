"""The coordinator's side of the wire: accept, authenticate, and read rank connections.

One accept thread and one reader thread per connection turn the sockets into
events on a single queue consumed by the coordinator's event loop:
``("join", rank, hello)``, ``("msg", rank, Message)``, ``("closed", rank, reason)``.
A peer that fails the handshake (wrong token, random bytes, an oversized or
malformed frame) is closed with a log line; the run goes on.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Optional

from .. import wire
from ..wire import Connection, Message

log = logging.getLogger("flodl_exp.coordinator")


class RankServer:
    def __init__(self, host: str, token: str, world_size: int, events: queue.Queue[tuple], handshake_timeout: float = 10.0) -> None:
        self.host = host
        self.token = token
        self.world_size = world_size
        self.events = events
        self.handshake_timeout = handshake_timeout
        self.listener = wire.listen(host, 0)
        self.port = self.listener.getsockname()[1]
        self.conns: dict[int, Connection] = {}
        self.rejected = 0
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="coord-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = wire.accept(self.listener, timeout=0.5)
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="coord-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            hello = wire.server_handshake(conn, self.token, timeout=self.handshake_timeout)
            rank = int(hello.get("rank", -1))
            with self._lock:
                problem = (f"rank {rank} outside [0, {self.world_size})" if not (0 <= rank < self.world_size)
                           else f"rank {rank} already connected" if rank in self.conns else None)
            if problem:
                wire.server_reject(conn, problem)
                raise wire.WireError(problem)
            wire.server_accept(conn, {"world_size": self.world_size})
            conn.max_frame_bytes = wire.frame_ceiling(int(hello.get("model_bytes", 0)))
            with self._lock:
                self.conns[rank] = conn
        except Exception as e:
            self.rejected += 1
            log.warning("rejected connection from %s: %s", getattr(conn, "peer", "?"), e)
            conn.close()
            return
        self.events.put(("join", rank, hello))
        try:
            while True:
                self.events.put(("msg", rank, conn.recv()))
        except Exception as e:
            reason = "closed" if isinstance(e, wire.ConnectionClosed) else f"{type(e).__name__}: {e}"
            if not isinstance(e, wire.ConnectionClosed):
                log.warning("rank %d connection broken: %s", rank, reason)
            conn.close()
            self.events.put(("closed", rank, reason))

    def send(self, rank: int, msg: Message) -> bool:
        conn = self.conns.get(rank)
        if conn is None:
            return False
        try:
            conn.send(msg)
            return True
        except Exception as e:
            log.warning("send %s to rank %d failed: %s", msg.kind, rank, e)
            return False

    def close(self) -> None:
        self._closed = True
        try:
            self.listener.close()
        except OSError:
            pass
        for c in list(self.conns.values()):
            c.close()


def start_store(host: str, world_size: int) -> Optional[Any]:
    """The torch.distributed TCPStore the collective backend rendezvouses on (hosted here,
    so a dead rank never takes the store with it)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size=None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
