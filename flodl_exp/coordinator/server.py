"""The coordinator's side of the wire: accept, authenticate, and read rank connections.

Three kinds of thread turn the sockets into events on a single queue consumed by
the coordinator's event loop: ``("join", rank, Hello)``, ``("msg", rank, Message)``,
``("closed", rank, reason)`` (at most one ``closed`` per rank):

* one accept thread;
* one short-lived thread per connection *during its handshake* (at most
  ``max_handshakes`` at once; more are closed at once);
* one read thread for every authenticated connection: a selector (epoll) over their
  sockets, one non-blocking ``recv`` per ready socket and turn, every complete frame in
  it checked and queued in order (``Connection.read_ready``); the good frames before a
  bad one are queued before that rank's ``closed``. A thread per rank would
  make a thousand ranks a thousand threads taking turns on the GIL with the event loop;
  one reader takes several frames per system call and keeps the loop's share of the
  interpreter (bench: experiments/bench_coordinator.py).

A peer that fails the handshake (wrong token, random bytes, an oversized or
malformed frame) is closed with a log line; the run goes on. An authenticated hello
whose values do not fit (:meth:`~flodl_exp.protocol.hello.Hello.from_dict`: a rank that is no int in
range, a model size that is no sane int) is refused with its reason (``server_reject``) before
anything is reserved; the event loop gets the checked :class:`~flodl_exp.protocol.hello.Hello`. A rank id
is reserved under the lock before the welcome goes out, so two clients can never both be
accepted as one rank.

The accept thread outlives a failed ``accept`` (descriptors exhausted, a connection
aborted in the backlog): it logs once, backs off (:data:`ACCEPT_BACKOFF_S`) and accepts
again, so a brief descriptor shortage does not shut the door on every later rank. It
ends only when the server closes.

Every frame after the handshake is MACed (protocol/wire.py): a forged, tampered or
replayed frame closes that rank's connection (``FrameAuthError``), reported like
any other broken connection, as is a rank silent mid-frame for the connection's
``stall_timeout``. Sends carry a stall deadline (``send_stall_timeout``): a rank that
stops reading is closed and reported as ``closed`` with a reason naming the stall,
so it cannot hold the event loop (beacons, liveness, signals) for longer than that.
A dropped connection leaves ``conns`` at once, with any partial frame it held.
The selector is changed by the read thread only: the others hand it new
connections through a queue and a wake-up socket.
"""
from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time
from typing import Callable, Optional

from flodl_exp.protocol import wire
from flodl_exp.protocol.hello import Hello, HelloError
from flodl_exp.protocol.wire import Connection, Message

log = logging.getLogger("flodl_exp.coordinator")

MAX_HANDSHAKES = 16
"""Connections served at once before they authenticate; more are closed at once."""
SEND_STALL_TIMEOUT_S = 10.0
"""Default: a rank that accepts no byte of a frame for this long is treated as dead."""
READ_CHUNK = 256 * 1024
"""Bytes the read thread takes from one socket per turn (a snapshot larger than this takes several turns)."""
ACCEPT_BACKOFF_S = (0.05, 2.0)
"""After a failed accept: wait the first, doubling on each failure in a row up to the second, then accept again."""
class RankServer:
    def __init__(self, host: str, token: str, world_size: int, events: queue.Queue[tuple], handshake_timeout: float = 10.0,
                 *, max_handshakes: int = MAX_HANDSHAKES, send_stall_timeout: Optional[float] = SEND_STALL_TIMEOUT_S) -> None:
        self.host = host
        self.token = token
        self.world_size = world_size
        self.events = events
        self.handshake_timeout = handshake_timeout
        self.max_handshakes = max_handshakes
        self.send_stall_timeout = send_stall_timeout
        self.listener = wire.listen(host, 0)
        self.port = self.listener.getsockname()[1]
        self.conns: dict[int, Connection] = {}
        self.rejected = 0
        self.before_welcome: Optional[Callable[[int], None]] = None
        """Test hook: called with the rank after it is reserved, before the welcome is sent."""
        self._lock = threading.Lock()
        self._reserved: set[int] = set()  # ranks claimed by a handshake in progress or joined
        self._reported: set[int] = set()  # ranks whose "closed" event is out
        self._handshaking = 0
        self._closed = False
        self._stop = threading.Event()  # set by close(): wakes the accept thread's back-off
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._incoming: queue.SimpleQueue[tuple[int, Connection]] = queue.SimpleQueue()
        """Authenticated connections for the read thread to register (it alone changes the selector)."""
        self._reader = threading.Thread(target=self._read_loop, name="coord-read", daemon=True)
        self._reader.start()
        self._acceptor = threading.Thread(target=self._accept_loop, name="coord-accept", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        """Accept until the server closes. A failed accept (EMFILE, ENFILE, ENOBUFS, ECONNABORTED...) is logged
        once per run of failures and retried after a back-off, never the end of accepting: a rank that comes
        after a brief descriptor shortage must still be able to join."""
        failures, backoff = 0, 0.0
        while not self._closed:
            try:
                conn = wire.accept(self.listener, timeout=0.5)
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed:
                    return
                failures += 1
                backoff = min(ACCEPT_BACKOFF_S[1], max(ACCEPT_BACKOFF_S[0], backoff * 2))
                if failures == 1:
                    log.warning("accepting rank connections failed (%s): retrying, backing off up to %.1fs",
                                e, ACCEPT_BACKOFF_S[1])
                self._stop.wait(backoff)
                continue
            if failures:
                log.warning("accepting rank connections again after %d failed accepts", failures)
                failures, backoff = 0, 0.0
            with self._lock:
                full = self._handshaking >= self.max_handshakes
                if not full:
                    self._handshaking += 1
            if full:
                self.rejected += 1
                log.warning("closed connection from %s: %d unauthenticated connections already in progress",
                            conn.peer, self.max_handshakes)
                conn.close()
                continue
            conn.send_stall_timeout = self.send_stall_timeout
            try:
                threading.Thread(target=self._serve, args=(conn,), name="coord-conn", daemon=True).start()
            except RuntimeError as e:  # can't start a thread (out of memory or thread limits): as a failed accept
                with self._lock:
                    self._handshaking -= 1
                self.rejected += 1
                log.warning("closed connection from %s: %s", conn.peer, e)
                conn.close()
                self._stop.wait(ACCEPT_BACKOFF_S[0])

    def _handshake(self, conn: Connection) -> tuple[int, Hello]:
        """Authenticate, read the hello, reserve the rank, welcome; raises on any failure (the reservation is
        released)."""
        fields = wire.server_handshake(conn, self.token, timeout=self.handshake_timeout)
        try:
            hello = Hello.from_dict(fields, self.world_size)
        except HelloError as e:
            wire.server_reject(conn, str(e))
            raise wire.WireError(str(e)) from None
        rank = hello.rank
        with self._lock:
            taken = rank in self._reserved
            if not taken:
                self._reserved.add(rank)
        if taken:
            problem = f"rank {rank} already claimed or connected"
            wire.server_reject(conn, problem)
            raise wire.WireError(problem)
        try:
            if self.before_welcome is not None:
                self.before_welcome(rank)
            wire.server_accept(conn, {"world_size": self.world_size})
            conn.max_frame_bytes = wire.frame_ceiling(hello.model_bytes)
        except BaseException:
            with self._lock:
                self._reserved.discard(rank)
            raise
        with self._lock:
            self.conns[rank] = conn
        return rank, hello

    def _serve(self, conn: Connection) -> None:
        """A handshake thread: authenticate, report the join, hand the connection to the read thread."""
        try:
            rank, hello = self._handshake(conn)
        except Exception as e:
            self.rejected += 1
            log.warning("rejected connection from %s: %s", getattr(conn, "peer", "?"), e)
            conn.close()
            return
        finally:
            with self._lock:
                self._handshaking -= 1
        self.events.put(("join", rank, hello))  # before any of its messages: the read thread has not seen it yet
        self._incoming.put((rank, conn))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (the reader is already due to wake) or closed (shutting down)
            pass

    def _read_loop(self) -> None:
        """The read thread: every authenticated connection, one non-blocking recv per ready socket per turn."""
        scratch = memoryview(bytearray(READ_CHUNK))
        put = self.events.put
        next_check = time.monotonic() + 0.5
        while not self._closed:
            try:
                ready = self._sel.select(timeout=0.5)
            except (OSError, ValueError):  # the selector was closed under us: shutting down
                return
            for key, _ in ready:
                if key.data is None:
                    self._take_incoming()
                    continue
                rank, conn = key.data
                try:
                    msgs = conn.read_ready(scratch)
                    error: Optional[BaseException] = conn.read_error
                except Exception as e:
                    msgs, error = [], e
                for m in msgs:  # the good frames before a bad one first: a rank's last error report among them
                    put(("msg", rank, m))
                if error is not None:
                    self._forget(key.fileobj)
                    reason = "closed" if isinstance(error, wire.ConnectionClosed) else f"{type(error).__name__}: {error}"
                    self._drop(rank, conn, reason)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                self._sweep(now)

    def _take_incoming(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:  # drained (EAGAIN) or closed
            pass
        while True:
            try:
                rank, conn = self._incoming.get_nowait()
            except queue.Empty:
                return
            if conn.closed:
                self._drop(rank, conn, "closed")
                continue
            stale = self._sel.get_map().get(conn.sock.fileno())
            if stale is not None:  # a closed connection's descriptor, reused by this one
                self._forget(stale.fileobj)
            try:
                self._sel.register(conn.sock, selectors.EVENT_READ, (rank, conn))
            except (KeyError, ValueError, OSError) as e:  # closed meanwhile by another thread
                self._drop(rank, conn, "closed" if conn.closed else f"{type(e).__name__}: {e}")

    def _forget(self, fileobj: object) -> None:
        try:
            self._sel.unregister(fileobj)  # type: ignore[arg-type]
        except (KeyError, ValueError, OSError):
            pass

    def _sweep(self, now: float) -> None:
        """Connections closed by another thread (a send stall) leave the selector; a rank silent mid-frame
        for its stall timeout is dropped as the blocking read would have dropped it."""
        for key in list(self._sel.get_map().values()):
            if key.data is None:
                continue
            rank, conn = key.data
            if conn.closed:
                self._forget(key.fileobj)
            elif conn.stalled(now):
                self._forget(key.fileobj)
                self._drop(rank, conn, f"WireError: {conn.peer} stalled mid-frame; stream abandoned")

    def _drop(self, rank: int, conn: Connection, reason: str) -> None:
        """Report ``rank``'s connection closed once (``closed`` event, one log line unless a plain close), then
        close it. The report comes first: closing wakes the read thread, whose own drop (a plain ``closed``)
        must find the cause (a send stall, say) already reported. The connection leaves ``conns`` here (sends
        to the rank are refused from now on) and its partial frame is freed with it."""
        with self._lock:
            first = rank not in self._reported
            self._reported.add(rank)
            if self.conns.get(rank) is conn:
                del self.conns[rank]
        if first:
            if reason != "closed":
                log.warning("rank %d connection broken: %s", rank, reason)
            self.events.put(("closed", rank, reason))
        conn.close()

    def send(self, rank: int, msg: Message) -> bool:
        conn = self.conns.get(rank)
        if conn is None:
            return False
        try:
            conn.send(msg)
            return True
        except wire.SendStalled as e:
            self._drop(rank, conn, f"send stalled: rank {rank} stopped reading ({e})")
            return False
        except Exception as e:
            log.warning("send %s to rank %d failed: %s", msg.kind, rank, e)
            return False

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        try:
            self.listener.close()
        except OSError:
            pass
        for c in list(self.conns.values()):
            c.close()
        self._wake()
        self._reader.join(timeout=2.0)
        for sock in (self._wake_r, self._wake_w):
            sock.close()
        try:
            self._sel.close()
        except (OSError, ValueError):
            pass

