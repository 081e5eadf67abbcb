"""Hierarchical cpu averaging (``cluster.node_reduce``), the rank's side: the ranks of a node meet their leader.

The coordinator tells each rank of a node its group (:class:`~flodl_exp.protocol.messages.NodeGroup`). The
leader binds a Linux *abstract* unix socket (``"\\0" + address``): node-local by construction, per network
namespace, and gone with the process (nothing to unlink, nothing a crashed run leaves behind). Each member
dials it and says who it is with the coordinator's own challenge-response over the job token
(protocol/wire.py), so a process that does not hold the token, or a rank not in the group, is refused, and
every frame after it is MACed as on the coordinator's connections. Frames are the protocol's (codec), never
pickles.

* :class:`LeaderRelay` (the leader): sums its node's snapshots of a reduce into one
  :class:`~flodl_exp.protocol.messages.NodePartial` (node_average.py) for the coordinator, hands each member its
  ``Update`` of the coordinator's :class:`~flodl_exp.protocol.messages.NodeUpdate`, and reads out their drift
  (:class:`~flodl_exp.protocol.messages.NodeDrift`).
* :class:`MemberRelay` (the others): sends its snapshots to the leader and feeds the leader's updates to the
  rank's inbox, where the main thread handles them as any coordinator frame.

Failure is local and one-way: a member whose relay cannot connect, or whose connection ends, is ``down`` and
answers the coordinator directly from then on (re-sending the snapshot of a reduce the leader had not answered);
the leader leaves it out of later partials and no partial waits for it. The coordinator de-duplicates, and
sends the update directly to the members of a node whose leader died (a rank ignores an update of a version it
adopted already, rank/control.py). A rank that freezes with its socket open is not noticed here: the coordinator
declares it dead by its heartbeat and says so (:class:`~flodl_exp.protocol.messages.NodeDrop`), and the leader stops
waiting for it (:meth:`LeaderRelay.drop`) or the member answers directly (:meth:`MemberRelay.leader_gone`). Every
other wait has a deadline or ends with the process.
"""
from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Optional, Union

from flodl_exp.node_average import member_update, node_drift, node_partial
from flodl_exp.protocol import wire
from flodl_exp.protocol.codec import decode, encode
from flodl_exp.protocol.errors import WireError
from flodl_exp.protocol.messages import NodeDrift, NodeGroup, NodeUpdate, Payload, Snapshot, Update

log = logging.getLogger("flodl_exp.rank")

RELAY_TIMEOUT_S = 30.0
"""Default bound on a member's connect retries and on the leader's wait for members that never connected."""
RETRY_S = 0.05
"""A member re-tries connecting this often while the leader has not bound its socket yet."""
HANDSHAKE_S = 10.0
"""One handshake's bound (both ends)."""
STALL_S = wire.DEFAULT_STALL_TIMEOUT
"""A peer that accepts no byte of a frame (or sends none mid-frame) for this long is dropped."""
JOIN_S = 2.0
"""How long :meth:`LeaderRelay.close` / :meth:`MemberRelay.close` wait for each thread they stop."""
_POLL_S = 0.1
"""The leader's accept loop looks at its deadline and its close flag this often."""


def _socket_name(address: str) -> str:
    """The abstract socket name for ``address`` (a leading NUL: no file, released with the last descriptor)."""
    return "\0" + address


def _snapshot_copy(s: Snapshot) -> Snapshot:
    """A snapshot that owns its tensors. A cpu replica's snapshot aliases the live parameters (``.to`` of a float32
    CPU tensor is the tensor itself) and a CUDA one views a staging buffer the next snapshot rewrites; one kept past
    its send (summed later, measured for drift after adoption, re-sent after a relay broke) must be a copy."""
    return replace(s, tensors={k: t.detach().clone() for k, t in s.tensors.items()})


class LeaderRelay:
    """The node leader's end: one listener, one reader thread per member, the partial of each reduce.

    ``address``: the NodeGroup's socket name. ``rank``: the leader's own. ``members``: the group's ranks (the
    leader's included). ``token``: the job token (authenticates members). ``send``: a payload to the coordinator on
    the leader's own connection, thread-safe (a partial completes on whichever thread brought its last snapshot).
    ``gamma``: the mode's mass exponent (the control loop's ``gamma``). ``join_timeout_s``: how long a member that
    has not connected is waited for (then it answers the coordinator directly, and a late connection is refused).
    ``max_frame_bytes``: the frame ceiling once a member is authenticated (the model's, wire.frame_ceiling).

    Binds in the constructor (an ``OSError`` when the name is taken: the leader then answers directly);
    :meth:`start` starts the accept thread."""

    def __init__(self, address: str, *, rank: int, members: Sequence[int], token: Union[str, bytes],
                 send: Callable[[Payload], None], gamma: float, join_timeout_s: float = RELAY_TIMEOUT_S,
                 max_frame_bytes: int = wire.frame_ceiling(0), handshake_timeout_s: float = HANDSHAKE_S,
                 stall_timeout_s: float = STALL_S) -> None:
        self.address = address
        self.rank = int(rank)
        self.others: list[int] = sorted({int(r) for r in members} - {self.rank})
        """The members other than the leader: the ranks that may connect."""
        self._token = token
        self._send = send
        self.gamma = float(gamma)
        self._join_deadline = time.monotonic() + max(0.0, join_timeout_s)
        self._max_frame = max_frame_bytes
        self._hs_timeout = handshake_timeout_s
        self._stall = stall_timeout_s
        self._lock = threading.Lock()
        self._conns: dict[int, wire.Connection] = {}
        """Members connected and authenticated (their relay is up)."""
        self._gone: set[int] = set()
        """Members whose relay ended, or that never connected in time: they answer the coordinator directly."""
        self._pending: dict[int, dict[int, Snapshot]] = {}
        """Version -> the snapshots in so far (by rank, the leader's own included) of a partial not sent yet."""
        self._sent_version = -1
        """The newest version whose partial went out: a snapshot for it or an older one comes too late."""
        self._last: tuple[int, dict[int, Snapshot]] | None = None
        """The version and snapshots of the last partial sent (the drift's replicas), until its NodeUpdate."""
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self.partials_sent = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(_socket_name(address))
            self._listener.listen(max(8, len(self.others) + 4))
        except OSError:
            self._listener.close()
            raise

    # -- life ------------------------------------------------------------------
    def start(self) -> LeaderRelay:
        """Start accepting members (until each is connected or written off, the join deadline, or :meth:`close`)."""
        self._spawn(self._accept_loop, "node-relay-accept")
        return self

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    @property
    def down(self) -> bool:
        """No member can answer through this relay any more (every one is gone, or the relay is closed): the leader
        answers the coordinator directly."""
        with self._lock:
            return self._closed.is_set() or set(self.others) <= self._gone

    def connected(self) -> list[int]:
        """The members whose relay is up now (tests, logs)."""
        with self._lock:
            return sorted(self._conns)

    def close(self) -> None:
        """Stop accepting, close every member's connection (their readers end), join the threads (bounded).
        Idempotent; the abstract name goes with the listener (nothing to unlink)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            log.info("node relay %s: %d partial(s) sent; members %s, %s answering directly", self.address,
                     self.partials_sent, self.others, sorted(self._gone) or "none")
            conns = list(self._conns.values())
            self._conns.clear()
            self._pending.clear()
            self._last = None
            threads = list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.close()
        for c in conns:
            c.close()
        for t in threads:
            if t is not threading.current_thread():
                t.join(JOIN_S)

    # -- members joining -----------------------------------------------------
    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        try:
            while not self._closed.is_set():
                with self._lock:
                    waiting = [r for r in self.others if r not in self._conns and r not in self._gone]
                if not waiting:
                    return  # every member is in or written off: nobody else may join
                left = self._join_deadline - time.monotonic()
                if left <= 0:
                    log.warning("node relay %s: member(s) %s did not connect within the join timeout: they answer the "
                                "coordinator directly", self.address, waiting)
                    for r in waiting:
                        self._drop(r, None, "never connected")
                    return
                if not poller.poll(math.ceil(min(_POLL_S, left) * 1000)):
                    continue
                try:
                    sock, _ = self._listener.accept()
                except OSError:
                    if self._closed.is_set():
                        return
                    continue
                self._spawn(self._serve, "node-relay-member", sock)
        finally:
            with contextlib.suppress(OSError):
                self._listener.close()

    def _serve(self, sock: socket.socket) -> None:
        """One member's connection: the handshake (its rank must be a member still expected), then its reader."""
        try:
            conn = wire.Connection(sock, peer=f"node relay {self.address} member", send_stall_timeout=self._stall,
                                   stall_timeout=self._stall)
        except BaseException:
            sock.close()
            raise
        try:
            hello = wire.server_handshake(conn, self._token, self._hs_timeout)
        except (WireError, OSError) as e:
            log.warning("node relay %s: a connection failed its handshake: %s", self.address, e)
            conn.close()
            return
        said = hello.get("rank")
        r = said if type(said) is int else -1
        with self._lock:
            why = ("the relay is closed" if self._closed.is_set()
                   else f"not a member of this node's group ({said!r:.20})" if r not in self.others
                   else "for another relay" if hello.get("relay") != self.address
                   else f"rank {r} is connected already" if r in self._conns
                   else f"rank {r} was written off (it answers the coordinator directly)" if r in self._gone
                   else "")
            if not why:
                self._conns[r] = conn
        if why:
            log.warning("node relay %s: refused a member: %s", self.address, why)
            wire.server_reject(conn, why)
            conn.close()
            return
        try:
            wire.server_accept(conn, {"leader": self.rank})
        except (WireError, OSError) as e:
            self._drop(r, conn, f"welcome failed: {e}")
            return
        conn.max_frame_bytes = self._max_frame
        self._read(r, conn)

    def _read(self, r: int, conn: wire.Connection) -> None:
        """Member ``r``'s snapshots, until its connection ends (or it sends what it must not)."""
        why = "its connection ended"
        while not self._closed.is_set():
            try:
                msg = conn.recv()
            except (WireError, OSError) as e:
                why = f"its connection ended ({e})"
                break
            try:
                p = decode(msg)
            except WireError as e:  # ProtocolError
                why = f"it sent a malformed {msg.kind!r:.40}: {e}"
                break
            if not isinstance(p, Snapshot) or p.version is None:
                why = f"it sent {msg.kind!r:.40}, not a versioned snapshot"
                break
            if not self._on_snapshot(r, p):
                why = f"its snapshot for reduce {p.version} came after that reduce's partial"
                break
        self._drop(r, conn, why)

    # -- the partial -----------------------------------------------------------
    def contribute(self, snap: Snapshot) -> bool:
        """The leader's own snapshot of reduce ``snap.version`` (the control loop's RequestParams handler). True: the
        relay answers the reduce (a NodePartial, once every member still up answered it); False: the relay is down,
        send the snapshot to the coordinator directly."""
        if snap.version is None:
            raise ValueError("a node relay needs the snapshot's version (RequestParams.version)")
        if self.down:
            return False
        own = _snapshot_copy(snap)
        with self._lock:
            if self._closed.is_set() or set(self.others) <= self._gone or snap.version <= self._sent_version:
                return False
            self._pending.setdefault(snap.version, {})[self.rank] = own
            ready, stale = self._take_ready_locked()
        self._emit(ready, stale)
        return True

    submit = contribute
    """The control loop's one name for both relays' 'answer this reduce' (:meth:`MemberRelay.submit`)."""

    def _on_snapshot(self, r: int, snap: Snapshot) -> bool:
        """Member ``r``'s snapshot; False when it cannot be summed (its reduce's partial went out without it, or a
        second one for a version): the caller drops ``r``, which then re-sends it to the coordinator directly."""
        v = snap.version
        assert v is not None
        with self._lock:
            if self._closed.is_set() or r not in self._conns or v <= self._sent_version or r in self._pending.get(v, {}):
                return False
            self._pending.setdefault(v, {})[r] = snap
            ready, stale = self._take_ready_locked()
        self._emit(ready, stale)
        return True

    def _take_ready_locked(self) -> tuple[Optional[tuple[int, dict[int, Snapshot]]], list[int]]:
        """The oldest pending version that is complete (the leader's own snapshot and one from each member not gone),
        taken out of :attr:`_pending`, and the members whose snapshots of an older version can no longer be summed."""
        for v in sorted(self._pending):
            snaps = self._pending[v]
            if self.rank not in snaps or any(o not in snaps and o not in self._gone for o in self.others):
                continue
            del self._pending[v]
            stale: set[int] = set()
            for u in [u for u in self._pending if u < v]:
                stale.update(self._pending.pop(u))
            self._sent_version = v
            return (v, snaps), sorted(stale - {self.rank})
        return None, []

    def _emit(self, ready: Optional[tuple[int, dict[int, Snapshot]]], stale: list[int]) -> None:
        """Send a complete version's partial (called without the lock). If the sum fails (a member's tensors do not
        fit the leader's), the leader answers alone and the members are dropped, so each answers directly."""
        for r in stale:
            self._drop(r, None, "its snapshot was for a reduce that was not answered through the relay")
        if ready is None:
            return
        v, snaps = ready
        ranks = sorted(snaps)
        try:
            partial = node_partial(v, ranks, [snaps[r] for r in ranks], self.gamma)
        except Exception as e:
            log.error("node relay %s: reduce %d's partial of ranks %s failed (%s): each answers the coordinator directly",
                      self.address, v, ranks, e)
            for r in ranks:
                if r != self.rank:
                    self._drop(r, None, "the node's partial failed")
            self._to_coordinator(snaps[self.rank])
            return
        with self._lock:
            self._last = (v, snaps)
            self.partials_sent += 1
        self._to_coordinator(partial)

    def _to_coordinator(self, p: Payload) -> None:
        try:
            self._send(p)
        except Exception as e:  # the coordinator's connection broke: the rank's reader thread reports that
            log.warning("node relay %s: sending %s to the coordinator failed: %s", self.address, p.KIND.value, e)

    # -- the update ----------------------------------------------------------
    def on_node_update(self, m: NodeUpdate) -> Optional[Update]:
        """The coordinator's consensus for this node (the control loop's NodeUpdate handler): each member of
        ``m.ranks`` but the leader gets its ``Update`` (version ``m.version``) over its relay (one whose relay is gone
        is skipped: the coordinator must answer it directly), the coordinator gets the members' drift
        (:class:`NodeDrift`, measured on the snapshots the partial summed, before anyone adopts), and the leader's own
        ``Update`` is returned for the control loop to adopt (None when the leader is not in ``m.ranks``)."""
        with self._lock:
            last = self._last
            snaps = last[1] if last is not None and last[0] == m.version else {}
            if last is not None and last[0] <= m.version:
                self._last = None  # the drift is read once; the replicas are not kept past it
            conns = {r: self._conns.get(r) for r in m.ranks if r != self.rank}
        for r, conn in conns.items():
            if conn is None:
                log.warning("node relay %s: rank %d's relay is gone: its update for reduce %d is the coordinator's to "
                            "send", self.address, r, m.version)
                continue
            try:
                conn.send(encode(replace(member_update(m, r), version=m.version)))
            except (WireError, OSError) as e:
                self._drop(r, conn, f"sending its update failed: {e}")
        ranks = [r for r in m.ranks if r in snaps]
        if len(ranks) < len(m.ranks):
            log.warning("node relay %s: no snapshot of ranks %s for reduce %d's drift", self.address,
                        [r for r in m.ranks if r not in snaps], m.version)
        drift = node_drift([snaps[r] for r in ranks], m) if ranks else []
        self._to_coordinator(NodeDrift(version=m.version, ranks=ranks, drift=drift))
        if self.rank not in m.ranks:
            return None
        return replace(member_update(m, self.rank), version=m.version)

    # -- members leaving -------------------------------------------------------
    def drop(self, r: int) -> None:
        """The coordinator declared member ``r`` dead (NodeDrop): the partials stop waiting for it, even when its
        socket stays open (a frozen process)."""
        if r != self.rank:
            self._drop(r, None, "the coordinator declared it dead")

    def _drop(self, r: int, conn: Optional[wire.Connection], why: str) -> None:
        """Member ``r`` answers the coordinator directly from now on: its connection closed, its snapshots taken out
        of the partials not sent yet, which stop waiting for it (one may be complete now: sent)."""
        with self._lock:
            current = self._conns.get(r)
            # a reduce under way through the relay: r's leaving is news (else a rank ending with the run, as a rule)
            waited = any(self.rank in snaps or r in snaps for snaps in self._pending.values())
            if conn is not None and current is not conn:
                current = None  # an older connection of r ending: r's state is not its to change
                known = False
            else:
                known = r not in self._gone
                self._conns.pop(r, None)
                self._gone.add(r)
                for snaps in self._pending.values():
                    snaps.pop(r, None)
            ready, stale = self._take_ready_locked() if not self._closed.is_set() else (None, [])
        if conn is not None:
            conn.close()
        if current is not None and current is not conn:
            current.close()
        if known and not self._closed.is_set():
            log.log(logging.WARNING if waited else logging.INFO,
                    "node relay %s: rank %d dropped (%s): it answers the coordinator directly", self.address, r, why)
        self._emit(ready, stale)


class MemberRelay:
    """A node member's end: its snapshots to the leader, the leader's updates into the rank's inbox.

    ``address``: the NodeGroup's socket name; ``rank``/``leader``: this rank's and the leader's. ``token``: the job
    token. ``deliver``: puts a frame from the leader into the rank's inbox (``ControlInbox.put``; it is never
    handed an exception: a relay that ends is no lost coordinator). ``send``: a payload to the coordinator
    (thread-safe; the reader thread re-sends a snapshot with it when the relay ends mid-reduce).
    ``connect_timeout_s``: how long :meth:`connect` re-tries while the leader's socket is not there yet."""

    def __init__(self, address: str, *, rank: int, leader: int, token: Union[str, bytes],
                 deliver: Callable[[wire.Message], None], send: Callable[[Payload], None],
                 connect_timeout_s: float = RELAY_TIMEOUT_S, retry_s: float = RETRY_S,
                 max_frame_bytes: int = wire.frame_ceiling(0), handshake_timeout_s: float = HANDSHAKE_S,
                 stall_timeout_s: float = STALL_S) -> None:
        self.address = address
        self.rank = int(rank)
        self.leader = int(leader)
        self._token = token
        self._deliver = deliver
        self._send = send
        self._connect_timeout = max(0.0, connect_timeout_s)
        self._retry = max(0.001, retry_s)
        self._max_frame = max_frame_bytes
        self._hs_timeout = handshake_timeout_s
        self._stall = stall_timeout_s
        self._lock = threading.Lock()
        self._conn: Optional[wire.Connection] = None
        self._down = False
        self._pending: Optional[Snapshot] = None
        """The snapshot the leader has, of a reduce whose update has not come back yet (re-sent if the relay ends)."""
        self._closed = threading.Event()
        self._reader: Optional[threading.Thread] = None
        self.resent: list[int] = []
        """Versions whose snapshot was re-sent to the coordinator after the relay ended (tests, logs)."""

    @property
    def down(self) -> bool:
        """The relay is not (or no longer) usable: the rank answers the coordinator directly."""
        with self._lock:
            return self._down or self._conn is None

    def connect(self) -> bool:
        """Dial the leader (re-trying every ``retry_s`` while its socket is not bound, up to ``connect_timeout_s``) and
        handshake; True once the relay is up (its reader runs). A refusal is final: False, the relay is down."""
        deadline = time.monotonic() + self._connect_timeout
        tries = max(1, math.ceil(self._connect_timeout / self._retry) + 1)
        last: object = None
        for _ in range(tries):
            if self._closed.is_set():
                break
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(0.05, min(self._hs_timeout, deadline - time.monotonic())))
                sock.connect(_socket_name(self.address))
            except OSError as e:  # not bound yet (ECONNREFUSED / ENOENT), or its backlog is full
                sock.close()
                last = e
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._closed.wait(min(self._retry, left))
                continue
            conn = wire.Connection(sock, peer=f"node leader {self.leader}", send_stall_timeout=self._stall,
                                   stall_timeout=self._stall)
            try:
                wire.client_handshake(conn, self._token, {"rank": self.rank, "relay": self.address},
                                      timeout=self._hs_timeout)
            except (WireError, OSError) as e:
                conn.close()
                last = e
                break  # refused or broken mid-handshake: no retry (the leader wrote this rank off, or is not ours)
            conn.max_frame_bytes = self._max_frame
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    break
                self._conn = conn
            self._reader = threading.Thread(target=self._read, args=(conn,), name="node-relay-reader", daemon=True)
            self._reader.start()
            return True
        with self._lock:
            self._down = True
        log.warning("rank %d: no relay to node leader %d (%s): answering the coordinator directly", self.rank,
                    self.leader, last)
        return False

    def submit(self, snap: Snapshot) -> bool:
        """This rank's snapshot of reduce ``snap.version`` to the leader. True: the relay took it (the update comes
        back through the inbox; if the relay ends before it does, the snapshot goes to the coordinator directly);
        False: the relay is down, send it to the coordinator directly."""
        if snap.version is None:
            raise ValueError("a node relay needs the snapshot's version (RequestParams.version)")
        if self.down:
            return False
        keep = _snapshot_copy(snap)
        with self._lock:
            conn = self._conn
            if self._down or conn is None:
                return False
            self._pending = keep
        try:
            conn.send(encode(snap))
        except (WireError, OSError) as e:
            self._fail(f"sending the snapshot failed: {e}")
        return True

    def _read(self, conn: wire.Connection) -> None:
        why = "the leader closed the relay"
        while not self._closed.is_set():
            try:
                msg = conn.recv()
            except (WireError, OSError) as e:
                why = str(e)
                break
            version = msg.fields.get("version") if msg.kind == Update.KIND.value and isinstance(msg.fields, dict) else None
            self._deliver(msg)
            if msg.kind == Update.KIND.value:
                with self._lock:
                    if self._pending is not None and (version is None or version == self._pending.version):
                        self._pending = None
        self._fail(why)

    def leader_gone(self) -> None:
        """The coordinator declared the leader dead (NodeDrop): answer directly from now on, re-sending a snapshot
        the leader never answered (its socket may stay open: a frozen process)."""
        self._fail("the coordinator declared the leader dead")

    def _fail(self, why: str) -> None:
        """The relay ended: down for good, and a snapshot the leader never answered goes to the coordinator."""
        with self._lock:
            if self._down:
                return
            self._down = True
            conn, self._conn = self._conn, None
            pending, self._pending = self._pending, None
        if conn is not None:
            conn.close()
        if self._closed.is_set():
            return
        # nothing pending (a leader that ended with the run, as a rule): no news; a reduce re-sent is
        log.log(logging.WARNING if pending is not None else logging.INFO, "rank %d: relay to node leader %d ended (%s): "
                "answering the coordinator directly%s", self.rank, self.leader, why,
                f" (reduce {pending.version}'s snapshot re-sent)" if pending is not None else "")
        if pending is not None:
            self.resent.append(int(pending.version or 0))
            try:
                self._send(pending)
            except Exception as e:  # the coordinator's connection broke too: the rank's reader thread reports it
                log.warning("rank %d: re-sending snapshot %s to the coordinator failed: %s", self.rank, pending.version, e)

    def close(self) -> None:
        """Close the relay (nothing is re-sent: the rank is ending) and join its reader (bounded). Idempotent."""
        self._closed.set()
        with self._lock:
            self._down = True
            conn, self._conn = self._conn, None
            self._pending = None
        if conn is not None:
            conn.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(JOIN_S)


NodeRelay = Union[LeaderRelay, MemberRelay]
"""Either end; the control loop calls ``submit``, ``down`` and ``close`` on both, ``on_node_update`` on a leader."""


def open_relay(m: NodeGroup, *, rank: int, token: Union[str, bytes], send: Callable[[Payload], None],
               deliver: Callable[[wire.Message], None], gamma: float, timeout_s: float = RELAY_TIMEOUT_S,
               max_frame_bytes: int = wire.frame_ceiling(0)) -> Optional[NodeRelay]:
    """This rank's end of its node's relay for ``m`` (the worker's factory for RankControl): a started LeaderRelay
    when it leads a group of two or more, else a MemberRelay that connected or is down; None when it is no member
    of a group of two, or the leader cannot bind its socket (then everyone answers directly)."""
    members = sorted({int(r) for r in m.members})
    if rank not in members or m.leader not in members or len(members) < 2:
        return None
    if m.leader == rank:
        try:
            return LeaderRelay(m.address, rank=rank, members=members, token=token, send=send, gamma=gamma,
                               join_timeout_s=timeout_s, max_frame_bytes=max_frame_bytes).start()
        except OSError as e:
            log.warning("rank %d: cannot bind node relay %s (%s): the node's ranks answer the coordinator directly",
                        rank, m.address, e)
            return None
    relay = MemberRelay(m.address, rank=rank, leader=m.leader, token=token, deliver=deliver, send=send,
                        connect_timeout_s=timeout_s, max_frame_bytes=max_frame_bytes)
    relay.connect()
    return relay
