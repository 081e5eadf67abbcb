"""A checkpoint bundle's meta (``<stem>.meta.json``) as a typed value, and the resume point that carries it.

The coordinator's bundle writer builds the meta as a :class:`BundleMeta` (core/checkpoints.py) and
``checkpoint.write_meta`` writes its :meth:`BundleMeta.to_dict`. Every reader takes it through
:meth:`BundleMeta.from_dict`: the launcher's resume check and task 0's requeue (``checkpoint.load_meta``), the
job spec's ``resume`` (job_spec.py), and through it the coordinator's and the ranks' restore. A meta that cannot
resume is refused there, in one line naming the key, before any process starts.

Older metas read: ``pieces``, ``total_picks``, ``guard_kind``, ``unix_time`` and ``experiment`` came later
(absent: None); the first metas named the experiment ``model`` (kept, with any other key this version does
not read, in ``extra``, so :meth:`BundleMeta.to_dict` gives back what was read). A ``schema_version`` newer than
:data:`META_SCHEMA_VERSION` is refused. Stdlib only (the launcher reads it before torch loads).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from flodl_exp.json_fields import FieldError, Fields

META_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class MetaCoverage:
    """What the bundle's trajectory covered: the permutation's seed and algorithm, and per open epoch the
    picks already trained (a coverage-granular bundle resumes only the rest)."""

    seed: Optional[int] = None
    algorithm: Optional[str] = None
    batch_size: Optional[int] = None
    per_epoch: tuple[dict[str, Any], ...] = ()
    """One record per open epoch (``epoch``, ``total_samples``, the covered ranges), read by the dispatcher."""

    @classmethod
    def from_dict(cls, d: Any) -> MetaCoverage:
        f = Fields("bundle meta coverage", d)
        return cls(seed=f.opt_int("seed"), algorithm=f.opt_str("algorithm"), batch_size=f.opt_int("batch_size"),
                   per_epoch=tuple(f.opt_list("per_epoch", dict, "an object") or ()))

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "algorithm": self.algorithm, "batch_size": self.batch_size,
                "per_epoch": [dict(p) for p in self.per_epoch]}


@dataclass(frozen=True)
class BundleMeta:
    """``<stem>.meta.json``: where the run's trajectory stood when the bundle was saved."""

    epoch: int
    """The epoch a resume starts from."""
    global_step: int
    sync_round: int
    schema_version: int = META_SCHEMA_VERSION
    world_size_at_save: Optional[int] = None
    save_reason: Optional[str] = None
    """``completed``, ``at_epoch``, ``periodic``, ``preempted``, a fault's reason..."""
    unix_time: Optional[float] = None
    experiment: Optional[str] = None
    total_picks: Optional[int] = None
    """Picks per epoch (data set size x augment); a resume on another data set size is refused."""
    elche_state: Optional[dict[str, Any]] = None
    guard_kind: Optional[str] = None
    guard_state: Optional[dict[str, Any]] = None
    coverage: Optional[MetaCoverage] = None
    pieces: Optional[tuple[str, ...]] = None
    """The files the ranks reported written (None: a meta older than the list; only the model piece is checked)."""
    mode: Optional[str] = None
    """The mode the bundle was saved in (``<backend>_<policy>``, ``+overlap`` with ``mode.overlap``): a resumed
    ``mode=auto`` run trains on in it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not read, kept as they were."""

    @property
    def coverage_seed(self) -> Optional[int]:
        return self.coverage.seed if self.coverage is not None else None

    @classmethod
    def from_dict(cls, d: Any) -> BundleMeta:
        """The meta of a parsed ``meta.json``; :class:`~flodl_exp.json_fields.FieldError` (one line) when a key
        is missing or its value does not fit, or the schema is newer than this version reads."""
        f = Fields("bundle meta", d)
        if d.get("schema_version") is None:
            raise FieldError("bundle meta schema_version is missing: not a flodl_exp bundle meta")
        version = f.int_("schema_version", lo=1)
        if version > META_SCHEMA_VERSION:
            raise FieldError(f"bundle meta schema_version {version} is newer than supported ({META_SCHEMA_VERSION})")
        cov = f.opt_obj("coverage")
        pieces = f.opt_list("pieces", str, "a str")
        known = {x.name for x in dataclasses.fields(cls)} - {"extra"}
        return cls(
            epoch=f.int_("epoch"), global_step=f.int_("global_step"), sync_round=f.int_("sync_round"),
            schema_version=version, world_size_at_save=f.opt_int("world_size_at_save", lo=1),
            save_reason=f.opt_str("save_reason"), unix_time=f.opt_float("unix_time"),
            experiment=f.opt_str("experiment"), total_picks=f.opt_int("total_picks"),
            elche_state=f.opt_obj("elche_state"), guard_kind=f.opt_str("guard_kind"),
            guard_state=f.opt_obj("guard_state"),
            coverage=MetaCoverage.from_dict(cov) if cov is not None else None,
            pieces=tuple(pieces) if pieces is not None else None, mode=f.opt_str("mode"),
            extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        """The JSON object :meth:`from_dict` reads back to an equal meta (fields that are None are left out)."""
        out: dict[str, Any] = dict(self.extra)
        for x in dataclasses.fields(self):
            v = getattr(self, x.name)
            if x.name == "extra" or v is None:
                continue
            out[x.name] = v.to_dict() if isinstance(v, MetaCoverage) else list(v) if isinstance(v, tuple) else v
        return out


def resolve_shuffle_seed(seed: int, meta: Optional[BundleMeta]) -> tuple[int, Optional[str]]:
    """The shuffle seed a run uses: a resumed run adopts its bundle's (the reference's ``resolve_shuffle_seed``),
    so the epochs it resumes see the permutation the bundle's coverage was recorded in. With the line to log when
    the run's own ``seed`` differs (None when nothing changed)."""
    saved = meta.coverage_seed if meta is not None else None
    if saved is None or saved == seed:
        return seed, None
    return saved, (f"resume: the bundle was saved with seed={saved}; this run's seed={seed} is kept for the model's "
                   f"init but the data order follows the bundle's (shuffle seed {saved})")


@dataclass(frozen=True)
class Resume:
    """The bundle a run resumes from: its stem and its meta (checked by the launcher, or by task 0 on a requeue)."""

    stem: str
    meta: BundleMeta

    @classmethod
    def from_dict(cls, d: Any) -> Resume:
        f = Fields("resume", d)
        stem = f.str_("stem")
        try:
            meta = BundleMeta.from_dict(f.obj("meta"))
        except FieldError as e:
            raise FieldError(f"resume {stem}: {e}") from None
        return cls(stem=stem, meta=meta)

    def to_dict(self) -> dict[str, Any]:
        return {"stem": self.stem, "meta": self.meta.to_dict()}
