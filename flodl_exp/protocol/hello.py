"""The rank's hello: what a rank tells the coordinator as it connects, as a typed value.

The rank builds a :class:`Hello` (rank/worker.py) and sends :meth:`Hello.to_dict` as the fields of the wire's
``hello`` frame (``wire.client_handshake``: the handshake MACs them with the job's token). The rank server reads
them back with :meth:`Hello.from_dict` before it reserves the rank or welcomes it (coordinator/server.py), so a
value that does not fit is refused with its reason, which the rank logs, and the coordinator's event loop only
ever sees a checked ``Hello`` (``("join", rank, hello)``: the cohort, the devices, the data set size).

The rules: ``rank`` an int in ``[0, world_size)`` (required); ``model_bytes`` an int in
``[0, MAX_MODEL_BYTES]`` (default 0); ``pid``, ``samples`` non-negative ints; ``device_score`` a finite number;
``host``, ``device``, ``device_uuid`` str; ``inputs`` a list of objects. Every field but ``rank`` may be absent
or None (an older or partial peer); fields this version does not read are ignored. Stdlib only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from flodl_exp.json_fields import FieldError, Fields

MAX_MODEL_BYTES = 2**40
"""The largest ``model_bytes`` a hello may state (a terabyte of float32 state; past it the number is garbage).
It sizes the connection's frame ceiling (``wire.frame_ceiling``)."""


class HelloError(FieldError):
    """A hello field that is missing or does not fit (the message is one line, naming it)."""


@dataclass(frozen=True)
class Hello:
    rank: int
    host: Optional[str] = None
    """The rank's node name."""
    pid: Optional[int] = None
    device: Optional[str] = None
    """``cpu`` or ``cuda:<i>`` (the index inside the rank's own CUDA_VISIBLE_DEVICES)."""
    device_uuid: Optional[str] = None
    """The physical GPU's (or MIG slice's) UUID: ranks sharing one device say the same."""
    device_score: Optional[float] = None
    """The spec prior's device score (devices.device_score); None on CPU or a failed query."""
    model_bytes: int = 0
    """The replica's snapshot size: both ends size the connection's frame ceiling from it."""
    samples: int = 0
    """The training set's length (the coordinator's picks per epoch: samples x augment)."""
    inputs: tuple[dict[str, Any], ...] = ()
    """Rank 0: its data sets as MLflow inputs (name, digest, source), logged once by the coordinator."""

    @classmethod
    def from_dict(cls, d: Any, world_size: Optional[int] = None) -> Hello:
        """The hello in the handshake's fields; :class:`HelloError` when a value does not fit (``rank`` must be
        an int in ``[0, world_size)`` when the world size is given)."""
        try:
            f = Fields("hello", d)
            rank_what = f"an int in [0, {world_size})" if world_size is not None else "a non-negative int"
            rank = f.int_("rank", hi=world_size - 1 if world_size is not None else 2**63 - 1, what=rank_what)
            model_bytes = f.int_("model_bytes", hi=MAX_MODEL_BYTES, what="an int in [0, 2**40]", default=0)
            return cls(rank=rank, host=f.opt_str("host"), pid=f.opt_int("pid"), device=f.opt_str("device"),
                       device_uuid=f.opt_str("device_uuid"), device_score=f.opt_float("device_score"),
                       model_bytes=model_bytes, samples=f.int_("samples", default=0),
                       inputs=tuple(f.opt_list("inputs", dict, "an object") or ()))
        except FieldError as e:
            raise HelloError(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        """The handshake's fields (what :meth:`from_dict` reads back)."""
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "device": self.device,
                "device_uuid": self.device_uuid, "device_score": self.device_score, "model_bytes": self.model_bytes,
                "samples": self.samples, "inputs": [dict(i) for i in self.inputs]}
