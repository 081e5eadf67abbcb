"""Wire protocol between the coordinator and the rank processes.

Frame layout::

    struct ">4sII": b"FDL1" | header_len (u32) | payload_len (u32)     12 bytes
    header:  header_len bytes of UTF-8 JSON
             {"kind": str, "fields": {JSON values},
              "tensors": [{"name": str, "dtype": str, "shape": [int, ...], "nbytes": int}, ...]}
    payload: payload_len bytes, the tensors' raw bytes (C order, native = little
             endian) concatenated in header order; sum(nbytes) == payload_len.

Why it looks like this:

* No pickle, ever. Unpickling runs code chosen by the sender; a frame here is
  data only (JSON plus raw bytes), and every header field is validated before
  it is used. Tensors are rebuilt with ``torch.frombuffer`` from an allow-listed
  dtype, so a hostile frame can at worst raise :class:`WireError`.
* Torch loads with the first tensor (:func:`dtypes`): a header is validated with the
  stdlib alone, so a process that only passes control messages (the coordinator of
  the nccl backend, the launcher) never pays torch's import (seconds of CPU at start-up).
* The ceiling is checked from the 12-byte prefix before the body is read or
  allocated, so a bogus or hostile length can never make us allocate much.
  Within the ceiling, a frame's buffers grow as its bytes arrive, never to what the
  prefix claims: until its MAC is checked a frame costs at most what arrived (plus
  the 1/8 a growing buffer over-allocates) plus one :data:`RECV_STEP` (1 MiB), see
  :func:`recv_allocation_bound`. A 53-byte forged prefix and header cannot make us
  reserve the ceiling and hold it for the stall timeout.
  A connection starts at :data:`HANDSHAKE_MAX_FRAME` (64 KiB); raise
  ``Connection.max_frame_bytes`` (see :func:`frame_ceiling`) once the peer is
  authenticated and the model size is known.
* Authentication is an HMAC-SHA256 challenge-response over the job token, so
  the token never crosses the wire. Both sides send a fresh nonce, so neither
  a ``hello`` nor a ``welcome`` can be replayed, and the client checks the
  server's ``welcome`` too (a rank never takes orders from an impostor).
* Every frame after the handshake is authenticated: its magic is ``FDLA`` and
  it carries a 32-byte trailer, HMAC-SHA256 under a per-direction session key
  (derived from the token and both handshake nonces) over a 64-bit per-direction
  sequence number, the prefix, the header and the payload. A frame that is
  forged, tampered with, replayed, reordered, or not authenticated at all
  raises :class:`FrameAuthError` and the connection is unusable.
* The JSON header is capped at :data:`MAX_HEADER_BYTES` (1 MiB) from the prefix.
* Sends may carry a stall deadline (``Connection.send_stall_timeout``): a peer
  that accepts no byte for that long raises :class:`SendStalled`.
* Two ways to read: :meth:`Connection.recv` (blocking, one frame) for a peer with a
  thread of its own, and :meth:`Connection.read_ready` (non-blocking: one ``recv`` of
  whatever the socket holds, every complete frame in it) for one thread serving many
  connections from a selector (the coordinator's rank server). Both check the same
  prefix, MAC, sequence and header; a connection uses one or the other after its handshake.
  A small frame's MAC is one call (``hmac.digest``) over its bytes; a large one is MACed
  buffer by buffer, never copied. ``read_ready`` returns the good frames that came before
  a bad one in the same read (a rank's last ``error`` report is not lost with its
  connection) and raises the error on the next call (``Connection.read_error`` says so at once).
* A header is text any sender could have encoded: JSON that decodes to a lone UTF-16
  surrogate (``"\\ud800"``) is refused, so every decoded message re-encodes.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import math
import re
import secrets
import select
import socket
import string
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, TypeAlias

from flodl_exp.protocol.errors import WireError  # defined apart: the protocol's payloads raise it without the wire

if TYPE_CHECKING:
    import torch

MAGIC = b"FDL1"
MAGIC_AUTH = b"FDLA"  # a session frame: MAC trailer after the payload
PREFIX = struct.Struct(">4sII")
HANDSHAKE_MAX_FRAME = 64 * 1024
MAX_HEADER_BYTES = 2**20  # the JSON header of any frame
MAC_BYTES = 32
_SEQ = struct.Struct(">Q")
DEFAULT_STALL_TIMEOUT = 60.0  # max silence inside a frame once it has started
_U32_MAX = 2**32 - 1
_MAX_NDIM, _MAX_DIM = 32, 2**40
_COALESCE = 64 * 1024  # buffers smaller than this are joined before sendall
_ONE_SHOT_MAC = 64 * 1024  # frames up to this size are MACed in one call over a joined copy
RECV_STEP = 2**20
"""recv reads a frame part larger than this in steps of this size, so its buffer grows with the bytes that
arrived, not with the length the prefix claims (see :func:`recv_allocation_bound`)."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

ITEMSIZES: dict[str, int] = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1,
}
"""The dtypes allowed on the wire (torch's names) and their element sizes: what a header is checked against
before torch is needed."""


@functools.cache
def dtypes() -> dict[str, torch.dtype]:
    """The allowed dtypes by name (imports torch on the first call)."""
    import torch

    return {name: getattr(torch, name) for name in ITEMSIZES}


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {v: k for k, v in dtypes().items()}


_HEADER_KEYS = {"kind", "fields", "tensors"}
_DESC_KEYS = {"name", "dtype", "shape", "nbytes"}




class FrameTooLarge(WireError):
    """The prefix announces more than the connection's ceiling."""


class ConnectionClosed(WireError):
    """The peer closed the connection (or it was closed locally)."""


class AuthError(WireError):
    """The handshake failed: wrong token, wrong message, or a timeout."""


class FrameAuthError(AuthError):
    """A frame after the handshake failed its MAC (forged, tampered, replayed, reordered, unauthenticated)."""


class SendStalled(WireError):
    """The peer accepted no byte of a frame for ``send_stall_timeout`` seconds (it stopped reading)."""


@dataclass(frozen=True, eq=False)  # identity: the raw views are not hashable
class TensorPart:
    """The encoded tensor half of a frame: the header's ``tensors`` descriptors (JSON) and the raw views.

    One part serves every frame that carries the same tensors: the cpu backend sends one consensus to a
    thousand ranks, and building the views and descriptors per rank was a fifth of that fan-out's encoding
    (:meth:`Message.sharing`). The views alias the tensors' memory, as :func:`encode_buffers`'s do."""

    descs_json: str
    raws: tuple[memoryview, ...]
    payload_len: int

    @staticmethod
    def of(tensors: dict[str, torch.Tensor]) -> TensorPart:
        import torch

        descs: list[dict[str, Any]] = []
        raws: list[memoryview] = []
        names = _dtype_names()
        for name, t in tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                raise WireError(f"tensor {name!r}: need a str name and a dense torch.Tensor")
            dname = names.get(t.dtype)
            if dname is None:
                raise WireError(f"tensor {name!r}: dtype {t.dtype} is not supported on the wire")
            flat = t.detach().cpu().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().data  # bf16/bool ride as bytes
            descs.append({"name": name, "dtype": dname, "shape": list(t.shape), "nbytes": raw.nbytes})
            raws.append(raw)
        descs_json = json.dumps(descs, separators=(",", ":"), ensure_ascii=False)
        return TensorPart(descs_json, tuple(raws), sum(d["nbytes"] for d in descs))


_NO_TENSORS = TensorPart("[]", (), 0)
SharedParts: TypeAlias = "dict[int, tuple[dict[str, torch.Tensor], TensorPart]]"
"""id(tensors dict) -> (the dict, its encoding): what :meth:`Message.sharing` reads and fills."""


@dataclass
class Message:
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    tensor_part: TensorPart | None = field(default=None, repr=False, compare=False)
    """``tensors`` encoded already (:meth:`sharing`); None: :func:`encode_buffers` encodes them."""

    def sharing(self, parts: SharedParts) -> Message:
        """This message with its tensors' encoding taken from ``parts`` (by the tensors dict's identity), made
        and kept there on first use. ``parts`` holds each dict too, so no other dict can take its id while
        ``parts`` lives; it must live no longer than the tensors stay unchanged: a batch of sends of one
        consensus, not a cache across reduces."""
        if self.tensors and self.tensor_part is None:
            known = parts.get(id(self.tensors))
            if known is None:
                known = parts[id(self.tensors)] = (self.tensors, TensorPart.of(self.tensors))
            self.tensor_part = known[1]
        return self


# ---------------------------------------------------------------- encode / decode
def encode_buffers(msg: Message) -> list[bytes | memoryview]:
    """Frame ``msg`` as [prefix+header, raw tensor views...] without copying CPU tensors.

    The views alias the tensors' memory: send them before mutating the tensors.
    """
    if not isinstance(msg.kind, str) or not msg.kind:
        raise WireError(f"kind must be a non-empty str, got {msg.kind!r}")
    if not isinstance(msg.fields, dict):
        raise WireError("fields must be a dict")
    part = msg.tensor_part if msg.tensor_part is not None else TensorPart.of(msg.tensors) if msg.tensors else _NO_TENSORS
    try:  # {"kind":..,"fields":..} with the descriptors spliced in: the same bytes as one dumps of all three
        head = json.dumps({"kind": msg.kind, "fields": msg.fields}, separators=(",", ":"), ensure_ascii=False)
        header = f'{head[:-1]},"tensors":{part.descs_json}}}'.encode()  # a lone surrogate fails here
    except (TypeError, ValueError, RecursionError) as e:  # UnicodeEncodeError is a ValueError
        raise WireError(f"fields are not JSON-serialisable: {e}") from None
    if len(header) > MAX_HEADER_BYTES or part.payload_len > _U32_MAX:
        raise FrameTooLarge(f"{msg.kind!r}: header over {MAX_HEADER_BYTES} bytes or payload over the u32 length field")
    return [PREFIX.pack(MAGIC, len(header), part.payload_len) + header, *part.raws]


def encode(msg: Message) -> bytes:
    """One contiguous frame (copies; :meth:`Connection.send` avoids that)."""
    return b"".join(encode_buffers(msg))


def _parse_prefix(prefix: bytes | bytearray, max_frame_bytes: int, magic_expected: bytes = MAGIC) -> tuple[int, int]:
    magic, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != magic_expected:
        if magic_expected == MAGIC_AUTH and magic == MAGIC:
            raise FrameAuthError("unauthenticated frame after the handshake")
        raise WireError(f"bad magic {bytes(magic)!r} (not a flodl frame)")
    if header_len > MAX_HEADER_BYTES:
        raise FrameTooLarge(f"header of {header_len} bytes exceeds the cap of {MAX_HEADER_BYTES} bytes")
    if header_len + payload_len > max_frame_bytes:
        raise FrameTooLarge(f"frame of {header_len}+{payload_len} bytes exceeds the "
                            f"ceiling of {max_frame_bytes} bytes")
    if header_len < 2:
        raise WireError(f"header_len {header_len} is too short")
    return header_len, payload_len


_Spec = tuple[str, str, list[int], int]
"""A checked tensor descriptor: name, dtype name, shape, bytes."""


def _is_int(v: Any) -> bool:
    return type(v) is int  # bool is not an int here


def _parse_header(raw: bytes | bytearray, payload_len: int) -> tuple[str, dict[str, Any], list[_Spec]]:
    try:
        h = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"header is not UTF-8 JSON: {type(e).__name__}") from None
    if b"\\u" in raw and _SURROGATE_ESCAPE.search(raw):  # rare: only then look for a lone surrogate
        try:
            json.dumps(h, ensure_ascii=False).encode("utf-8")
        except (ValueError, RecursionError):
            raise WireError("header holds a lone UTF-16 surrogate: no sender could have encoded it") from None
    if not isinstance(h, dict) or set(h) != _HEADER_KEYS:
        raise WireError("header must be an object with exactly kind, fields, tensors")
    kind, fields, descs = h["kind"], h["fields"], h["tensors"]
    if not isinstance(kind, str) or not kind:
        raise WireError("header kind must be a non-empty str")
    if not isinstance(fields, dict) or not isinstance(descs, list):
        raise WireError("header fields must be an object and tensors a list")
    specs: list[_Spec] = []
    names: set[str] = set()
    total = 0
    for d in descs:
        if not isinstance(d, dict) or set(d) != _DESC_KEYS:
            raise WireError(f"bad tensor descriptor {d!r:.200}")
        name, dname, shape, nbytes = d["name"], d["dtype"], d["shape"], d["nbytes"]
        if not isinstance(name, str) or name in names:
            raise WireError(f"bad or duplicate tensor name {name!r:.100}")
        itemsize = ITEMSIZES.get(dname) if isinstance(dname, str) else None
        if itemsize is None:
            raise WireError(f"tensor {name!r}: dtype {dname!r:.50} is not allowed")
        if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
                or not all(_is_int(s) and 0 <= s <= _MAX_DIM for s in shape)):
            raise WireError(f"tensor {name!r}: bad shape {shape!r:.200}")
        if not _is_int(nbytes) or nbytes != math.prod(shape) * itemsize:
            raise WireError(f"tensor {name!r}: nbytes {nbytes!r:.50} does not match {dname}{shape}")
        names.add(name)
        total += nbytes
        specs.append((name, dname, shape, nbytes))
    if total != payload_len:
        raise WireError(f"tensors declare {total} bytes but payload_len is {payload_len}")
    return kind, fields, specs


def _build_tensors(specs: list[_Spec], payload: bytearray) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if not specs:
        return out
    import torch

    by_name = dtypes()
    off = 0
    try:
        for name, dname, shape, nbytes in specs:
            dtype = by_name[dname]
            if nbytes == 0:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            # clone -> the tensor owns aligned, writable memory (not the frame buffer)
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=off).clone()
            if dtype is torch.bool and bool((raw > 1).any()):
                raise WireError(f"tensor {name!r}: bool payload holds bytes other than 0/1")
            out[name] = raw.view(dtype).reshape(shape)
            off += nbytes
    except (RuntimeError, ValueError) as e:
        raise WireError(f"cannot rebuild tensors: {e}") from None
    return out


def decode(frame: bytes | bytearray, max_frame_bytes: int) -> Message:
    """Validate and decode one complete frame; anything wrong raises :class:`WireError`."""
    n = PREFIX.size
    if len(frame) < n:
        raise WireError(f"truncated frame: {len(frame)} bytes, the prefix alone is {n}")
    header_len, payload_len = _parse_prefix(frame[:n], max_frame_bytes)
    if len(frame) != n + header_len + payload_len:
        what = "truncated" if len(frame) < n + header_len + payload_len else "trailing bytes in"
        raise WireError(f"{what} frame: {len(frame)} bytes, prefix says {n + header_len + payload_len}")
    kind, fields, specs = _parse_header(frame[n:n + header_len], payload_len)
    return Message(kind, fields, _build_tensors(specs, bytearray(memoryview(frame)[n + header_len:])))


def recv_allocation_bound(arrived: int) -> int:
    """The most :meth:`Connection.recv` holds for a frame of which ``arrived`` bytes came, whatever its prefix
    claims, until the frame is complete and its MAC checked: what arrived, 1/8 on top (a growing
    ``bytearray``'s over-allocation) and one :data:`RECV_STEP` being filled."""
    return arrived + arrived // 8 + RECV_STEP + MAC_BYTES


def frame_ceiling(model_bytes: int, headroom: float = 4.0, floor: int = 16 * 2**20) -> int:
    """Largest frame to accept: ``max(floor, ceil(model_bytes * headroom))``."""
    if model_bytes < 0 or headroom < 1.0 or floor < 0:
        raise ValueError("need model_bytes >= 0, headroom >= 1, floor >= 0")
    return max(int(floor), math.ceil(model_bytes * headroom))


# ---------------------------------------------------------------- connection
class Connection:
    """A framed, thread-safe (one lock per direction) view of a connected stream socket.

    The socket is kept blocking and waits use ``poll``, so a ``recv`` timeout never
    changes the socket timeout a concurrent ``send`` (e.g. a heartbeat) runs under.
    Any :class:`WireError` leaves the connection unusable: close it.

    After the handshake (:func:`server_accept` / :func:`client_handshake`) every frame
    is MACed both ways (see the module docstring). ``send_stall_timeout`` (None: wait
    forever) bounds how long a send waits for the peer to accept more bytes.
    """

    def __init__(self, sock: socket.socket, max_frame_bytes: int = HANDSHAKE_MAX_FRAME,
                 peer: str | None = None, stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
                 send_stall_timeout: float | None = None) -> None:
        sock.settimeout(None)
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self.stall_timeout = stall_timeout
        self.send_stall_timeout = send_stall_timeout
        self.peer = peer or _peer_name(sock)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._wpoll = select.poll()
        self._wpoll.register(sock, select.POLLOUT)
        self._broken: WireError | None = None
        self._closed = False
        self._auth: tuple[bytes, bytes, bytes] | None = None  # (token, server nonce, client nonce) for server_accept
        self._tx_key: bytes | None = None  # session keys: set once the handshake succeeded
        self._rx_key: bytes | None = None
        self._tx_seq = 0
        self._rx_seq = 0
        self._rbuf = bytearray()  # read_ready: bytes received, not yet a complete frame
        self._rx_last = time.monotonic()  # read_ready: when the last byte came
        self._read_error: WireError | None = None  # read_ready: why reading stopped (raised by every later call)

    @property
    def closed(self) -> bool:
        """close() was called (the socket may still be registered with a selector: unregister it)."""
        return self._closed

    @property
    def buffered(self) -> int:
        """Bytes :meth:`read_ready` holds of a frame not complete yet (0 once the connection failed or closed)."""
        return len(self._rbuf)

    @property
    def read_error(self) -> WireError | None:
        """Why :meth:`read_ready` stopped reading (a bad frame, EOF), or None. Set as soon as it is met, also
        when the call that met it returned the good frames before it: a caller that serves many connections
        checks it after each call instead of waiting for a readiness event that may never come."""
        return self._read_error

    @property
    def authenticated(self) -> bool:
        """True once frames are MACed (after a successful handshake)."""
        return self._tx_key is not None

    def _start_session(self, token: bytes | str, server_nonce: bytes, client_nonce: bytes, server: bool) -> None:
        """Derive the per-direction session keys; every later frame is MACed and sequenced."""
        with self._send_lock, self._recv_lock:
            master = hmac.new(_key(token), b"flodl-session|" + server_nonce + client_nonce, hashlib.sha256).digest()
            c2s = hmac.new(master, b"client->server", hashlib.sha256).digest()
            s2c = hmac.new(master, b"server->client", hashlib.sha256).digest()
            self._tx_key, self._rx_key = (s2c, c2s) if server else (c2s, s2c)
            self._tx_seq = self._rx_seq = 0

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed")
        if self._broken is not None:
            cls = ConnectionClosed if isinstance(self._broken, ConnectionClosed) else WireError
            raise cls(f"connection to {self.peer} is unusable after: {self._broken}")

    def send(self, msg: Message) -> None:
        bufs = encode_buffers(msg)  # encoding errors never touch the stream
        with self._send_lock:
            self._check_usable()
            if self._tx_key is not None:
                bufs[0] = MAGIC_AUTH + bytes(memoryview(bufs[0])[len(MAGIC):])
                seq = _SEQ.pack(self._tx_seq)
                if len(bufs) == 1 and len(bufs[0]) <= _ONE_SHOT_MAC:  # the common small frame: one C call
                    bufs.append(hmac.digest(self._tx_key, seq + bufs[0], "sha256"))
                else:
                    mac = hmac.new(self._tx_key, seq, hashlib.sha256)
                    for b in bufs:
                        mac.update(b)  # over the raw buffers: no copy of the tensor bytes
                    bufs.append(mac.digest())
                self._tx_seq += 1
            try:
                pending = bytearray()
                for b in bufs:
                    if len(b) < _COALESCE:
                        pending += b
                        continue
                    if pending:
                        self._sendall(pending)
                        pending = bytearray()
                    self._sendall(b)
                if pending:
                    self._sendall(pending)
            except SendStalled as e:
                self._broken = e
                raise
            except OSError as e:
                self._broken = ConnectionClosed(f"send to {self.peer} failed: {e}")
                raise self._broken from e
            except BaseException as e:  # e.g. KeyboardInterrupt: a partial frame may be out
                self._broken = WireError(f"send to {self.peer} aborted: {e!r}")
                raise

    def _sendall(self, buf: bytes | bytearray | memoryview) -> None:
        stall = self.send_stall_timeout
        if stall is None:
            self.sock.sendall(buf)
            return
        view = memoryview(buf)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        ms = max(0, math.ceil(stall * 1000))
        sent = 0
        while sent < len(view):
            try:
                sent += self.sock.send(view[sent:], socket.MSG_DONTWAIT)
                continue
            except (BlockingIOError, InterruptedError):
                pass
            if not self._wpoll.poll(ms):
                raise SendStalled(f"{self.peer} accepted no data for {stall:.3g}s (it stopped reading); "
                                  "stream abandoned")

    def recv(self, timeout: float | None = None) -> Message:
        """Next message. ``timeout`` bounds the wait for the frame to *start*
        (``TimeoutError`` = ``socket.timeout``, stream intact); once started, a
        silence longer than ``stall_timeout`` raises :class:`WireError`."""
        return self._recv(timeout, whole_frame=False)

    def _recv(self, timeout: float | None, whole_frame: bool) -> Message:
        with self._recv_lock:
            self._check_usable()
            deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
            try:
                prefix = bytearray(PREFIX.size)
                self._fill(prefix, deadline, False, whole_frame)
                key = self._rx_key
                header_len, payload_len = _parse_prefix(prefix, self.max_frame_bytes,
                                                        MAGIC if key is None else MAGIC_AUTH)
                header = self._read_part(header_len, deadline, whole_frame)
                if key is None:
                    kind, fields, specs = _parse_header(header, payload_len)
                payload = self._read_part(payload_len, deadline, whole_frame)
                if key is not None:  # verify before anything in the frame is parsed
                    tag = bytearray(MAC_BYTES)
                    self._fill(tag, deadline, True, whole_frame)
                    seq = _SEQ.pack(self._rx_seq)
                    if PREFIX.size + header_len + payload_len <= _ONE_SHOT_MAC:
                        digest = hmac.digest(key, seq + prefix + header + payload, "sha256")
                    else:
                        mac = hmac.new(key, seq, hashlib.sha256)
                        mac.update(prefix)
                        mac.update(header)
                        mac.update(payload)
                        digest = mac.digest()
                    if not hmac.compare_digest(digest, tag):
                        raise FrameAuthError(f"frame from {self.peer} failed its MAC "
                                             f"(forged, tampered, replayed or reordered; seq {self._rx_seq})")
                    self._rx_seq += 1
                    kind, fields, specs = _parse_header(header, payload_len)
                return Message(kind, fields, _build_tensors(specs, payload))
            except TimeoutError:  # only raised before any byte of the frame was consumed
                raise
            except BaseException as e:  # anything else leaves us mid-frame
                self._broken = e if isinstance(e, WireError) else WireError(f"recv aborted: {e!r}")
                raise

    def _read_part(self, size: int, deadline: float | None, whole_frame: bool) -> bytearray:
        """``size`` bytes of a frame already started. Up to :data:`RECV_STEP` they are read in place; a larger
        part is read a step at a time and appended, so the buffer holds what arrived, not what the prefix
        claimed (:func:`recv_allocation_bound`). The extra copy is one memcpy per byte, against a network."""
        if size <= RECV_STEP:
            buf = bytearray(size)
            self._fill(buf, deadline, True, whole_frame)
            return buf
        buf, step = bytearray(), memoryview(bytearray(RECV_STEP))
        while len(buf) < size:
            part = step[:min(RECV_STEP, size - len(buf))]
            self._fill(part, deadline, True, whole_frame)
            buf += part
        return buf

    def _fill(self, buf: bytearray | memoryview, deadline: float | None, started: bool, whole_frame: bool) -> None:
        view, got = memoryview(buf), 0
        while got < len(buf):
            left = None if deadline is None else deadline - time.monotonic()
            if started:
                wait = self.stall_timeout
                if whole_frame and left is not None:
                    wait = left if wait is None else min(wait, left)
            else:
                wait = left
            ms = None if wait is None else max(0, math.ceil(wait * 1000))
            if not self._poll.poll(ms):
                if not started:
                    raise TimeoutError(f"no message from {self.peer} within {wait:.3g}s")
                raise WireError(f"{self.peer} stalled mid-frame; stream abandoned")
            try:
                n = self.sock.recv_into(view[got:])
            except OSError as e:
                raise ConnectionClosed(f"recv from {self.peer} failed: {e}") from None
            if n == 0:
                raise ConnectionClosed(f"{self.peer} closed the connection"
                                       + (" mid-frame" if started else ""))
            got += n
            started = True

    def read_ready(self, scratch: memoryview) -> list[Message]:
        """Non-blocking: one ``recv`` of what the socket holds now (up to ``len(scratch)`` bytes, received into
        ``scratch``, which the caller may reuse for every connection it serves) and every frame it completes,
        in order. ``[]`` when nothing is there yet or the frame is still incomplete.

        Raises :class:`ConnectionClosed` at EOF, :class:`FrameAuthError` / :class:`WireError` on a bad
        frame (checked as in :meth:`recv`: the ceiling from the prefix before anything is kept, the MAC
        and sequence before the header is parsed); the connection is then unusable. Frames that came
        before a bad one in the same read are returned first (they passed every check, and their
        sequence numbers are spent): the error is then :attr:`read_error` at once and raised by the next
        call, and by every call after it. A failed or closed connection frees its partial frame. A peer
        silent mid-frame for ``stall_timeout`` is the caller's to find (:meth:`stalled`)."""
        with self._recv_lock:
            if self._closed or self._broken is not None:
                self._rbuf = bytearray()  # a connection that is done holds no partial frame
                if self._read_error is not None and not self._closed:
                    raise self._read_error
                self._check_usable()
            try:
                try:
                    n = self.sock.recv_into(scratch, len(scratch), socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return []
                except OSError as e:
                    raise ConnectionClosed(f"recv from {self.peer} failed: {e}") from None
                if n == 0:
                    raise ConnectionClosed(f"{self.peer} closed the connection" + (" mid-frame" if self._rbuf else ""))
                self._rx_last = time.monotonic()
                self._rbuf += scratch[:n]
                out, error = self._complete_frames()
            except WireError as e:
                out, error = [], e
            except BaseException as e:
                self._fail_read(WireError(f"read aborted: {e!r}"))
                raise
            if error is not None:
                self._fail_read(error)
                if not out:
                    raise error
            return out

    def _fail_read(self, error: WireError) -> None:
        self._broken = self._read_error = error
        self._rbuf = bytearray()

    def _complete_frames(self) -> tuple[list[Message], WireError | None]:
        """Every complete frame in the buffer, in order, and the error that stopped the walk (None: the rest
        is an incomplete frame, kept)."""
        out: list[Message] = []
        try:
            self._walk_frames(out)
        except WireError as e:
            return out, e
        return out, None

    def _walk_frames(self, out: list[Message]) -> None:
        buf, key, n = self._rbuf, self._rx_key, PREFIX.size
        magic, tail = (MAGIC, 0) if key is None else (MAGIC_AUTH, MAC_BYTES)
        pos = 0
        while len(buf) - pos >= n:
            header_len, payload_len = _parse_prefix(buf[pos:pos + n], self.max_frame_bytes, magic)
            body = pos + n + header_len
            end = body + payload_len + tail
            if len(buf) < end:
                break
            if key is not None:  # verify before anything in the frame is parsed
                seq = _SEQ.pack(self._rx_seq)
                if end - pos <= _ONE_SHOT_MAC:
                    digest = hmac.digest(key, seq + buf[pos:end - MAC_BYTES], "sha256")
                else:
                    mac = hmac.new(key, seq, hashlib.sha256)
                    with memoryview(buf) as view:
                        mac.update(view[pos:end - MAC_BYTES])
                    digest = mac.digest()
                if not hmac.compare_digest(digest, bytes(buf[end - MAC_BYTES:end])):
                    raise FrameAuthError(f"frame from {self.peer} failed its MAC "
                                         f"(forged, tampered, replayed or reordered; seq {self._rx_seq})")
                self._rx_seq += 1
            kind, fields, specs = _parse_header(buf[pos + n:body], payload_len)
            payload = buf[body:body + payload_len] if payload_len else bytearray()
            out.append(Message(kind, fields, _build_tensors(specs, payload)))
            pos = end
        if pos:
            del buf[:pos]

    def stalled(self, now: float) -> bool:
        """:meth:`read_ready` holds part of a frame and the peer sent nothing for ``stall_timeout``."""
        return bool(self._rbuf) and self.stall_timeout is not None and now - self._rx_last > self.stall_timeout

    def close(self) -> None:
        """Idempotent; wakes a ``recv`` blocked in another thread (ConnectionClosed)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self._recv_lock.acquire(blocking=False):  # else a read_ready under way frees it on its next call
            try:
                self._rbuf = bytearray()
            finally:
                self._recv_lock.release()


def _peer_name(sock: socket.socket) -> str:
    try:
        addr = sock.getpeername()
    except OSError:
        return "?"
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else (str(addr) or "local")


# ---------------------------------------------------------------- handshake
def new_token() -> str:
    """A fresh job token: 32 random bytes as hex."""
    return secrets.token_hex(32)


def _key(token: bytes | str) -> bytes:
    return token.encode("utf-8") if isinstance(token, str) else bytes(token)


def _mac(token: bytes | str, label: bytes, nonce: bytes, fields: dict[str, Any]) -> str:
    # normalise through a JSON round trip first, so both ends MAC the same text
    canon = json.dumps(json.loads(json.dumps(fields)), sort_keys=True, separators=(",", ":"))
    return hmac.new(_key(token), label + b"|" + nonce + b"|" + canon.encode("ascii"),
                    hashlib.sha256).hexdigest()


def _hex32(v: Any, what: str) -> bytes:
    if not isinstance(v, str) or len(v) != 64 or not set(v) <= set(string.hexdigits):
        raise AuthError(f"{what} is not 32 hex-encoded bytes")
    return bytes.fromhex(v)


def _verify(token: bytes | str, label: bytes, nonce: bytes, fields: dict[str, Any]) -> dict[str, Any]:
    rest = {k: v for k, v in fields.items() if k != "mac"}
    mac = fields.get("mac")
    ok = (isinstance(mac, str) and len(mac) == 64 and set(mac) <= set(string.hexdigits)
          and hmac.compare_digest(_mac(token, label, nonce, rest), mac.lower()))
    if not ok:
        raise AuthError(f"bad {label.decode()} MAC (wrong job token?)")
    return rest


@contextlib.contextmanager
def _handshake_ceiling(conn: Connection) -> Iterator[None]:
    saved = conn.max_frame_bytes
    conn.max_frame_bytes = min(saved, HANDSHAKE_MAX_FRAME)
    try:
        yield
    finally:
        conn.max_frame_bytes = saved


def _hs_recv(conn: Connection, deadline: float, expect: str) -> Message:
    try:
        msg = conn._recv(max(0.0, deadline - time.monotonic()), whole_frame=True)
    except TimeoutError:
        raise AuthError(f"handshake with {conn.peer} timed out waiting for {expect!r}") from None
    if msg.kind == "reject" and expect == "welcome":
        raise AuthError(f"{conn.peer} rejected us: {msg.fields.get('reason')!r:.200}")
    if msg.kind != expect or msg.tensors:
        raise AuthError(f"expected {expect!r} from {conn.peer}, got {msg.kind!r:.50}")
    return msg


def server_handshake(conn: Connection, token: bytes | str, timeout: float) -> dict[str, Any]:
    """Challenge the peer; returns its hello fields (without mac/nonce) or raises.

    Raises :class:`AuthError` (wrong token, wrong message, timeout) or another
    :class:`WireError` (garbage, oversized frame, peer gone). Follow with
    :func:`server_accept` or :func:`server_reject`.
    """
    deadline = time.monotonic() + timeout
    with _handshake_ceiling(conn):
        nonce = secrets.token_bytes(32)
        conn.send(Message("challenge", {"nonce": nonce.hex()}))
        hello = _hs_recv(conn, deadline, "hello")
        try:
            fields = _verify(token, b"hello", nonce, hello.fields)
        except AuthError:
            server_reject(conn, "authentication failed")
            raise
        client_nonce = _hex32(fields.pop("nonce", None), "hello nonce")
    conn._auth = (_key(token), nonce, client_nonce)
    return fields


def server_accept(conn: Connection, fields: dict[str, Any] | None = None) -> None:
    """Send ``welcome`` (with ``fields``, < 64 KiB) after a successful server_handshake."""
    if conn._auth is None:
        raise WireError("server_accept() needs a successful server_handshake() first")
    fields = dict(fields or {})
    if "mac" in fields:
        raise ValueError("'mac' is a reserved welcome field")
    token, server_nonce, client_nonce = conn._auth
    conn._auth = None
    conn.send(Message("welcome", {**fields, "mac": _mac(token, b"welcome", client_nonce, fields)}))
    conn._start_session(token, server_nonce, client_nonce, server=True)


def server_reject(conn: Connection, reason: str) -> None:
    """Best-effort ``reject`` (the client raises AuthError with ``reason``); then close."""
    conn._auth = None
    with contextlib.suppress(WireError):
        conn.send(Message("reject", {"reason": str(reason)}))


def client_handshake(conn: Connection, token: bytes | str, hello_fields: dict[str, Any],
                     timeout: float) -> dict[str, Any]:
    """Answer the challenge; returns the server's verified welcome fields (without mac).

    Raises :class:`AuthError` on reject, a bad welcome MAC, a timeout, or the
    server closing the connection; another :class:`WireError` on garbage.
    """
    if {"mac", "nonce"} & set(hello_fields):
        raise ValueError("'mac' and 'nonce' are reserved hello fields")
    deadline = time.monotonic() + timeout
    with _handshake_ceiling(conn):
        try:
            challenge = _hs_recv(conn, deadline, "challenge")
            server_nonce = _hex32(challenge.fields.get("nonce"), "challenge nonce")
            nonce = secrets.token_bytes(32)
            fields = {**hello_fields, "nonce": nonce.hex()}
            conn.send(Message("hello", {**fields, "mac": _mac(token, b"hello", server_nonce, fields)}))
            welcome = _hs_recv(conn, deadline, "welcome")
        except ConnectionClosed as e:
            raise AuthError(f"{conn.peer} closed the connection during the handshake ({e})") from None
        verified = _verify(token, b"welcome", nonce, welcome.fields)
    conn._start_session(token, server_nonce, nonce, server=False)
    return verified


# ---------------------------------------------------------------- sockets
def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket (SO_REUSEADDR, backlog 64); port 0 picks a free one."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def accept(listener: socket.socket, timeout: float | None = None) -> Connection:
    """Accept one peer (TimeoutError after ``timeout``); sets the listener's timeout."""
    listener.settimeout(timeout)
    sock, _ = listener.accept()
    try:
        return Connection(_tune(sock))
    except BaseException:  # e.g. the peer reset before setsockopt: never leak the descriptor
        sock.close()
        raise


def dial(host: str, port: int, timeout: float) -> Connection:
    """Connect (TCP_NODELAY, keepalive); ``timeout`` bounds the connect only."""
    return Connection(_tune(socket.create_connection((host, port), timeout=timeout)))
