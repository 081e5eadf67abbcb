"""``mode.auto``'s decisions, in the core: when the probe is done, which mode its predictions choose, and when the
configured mode is kept instead.

The shell does the work around them: it asks each rank to time a few steps (:class:`~flodl_exp.protocol.messages.Probe`,
sent by the core at :class:`AutoProbeStarts`), and turns the measured rig into one prediction per candidate mode
with the simulator (coordinator/auto_probe.py; the simulator embeds a core, so the core cannot run it). The core
books the answers, decides when the probe is over (every rank answered, or :data:`PROBE_TIMEOUT_S` passed), keeps
the configured mode when a rank could not be measured, and otherwise picks among the predictions
(:func:`pick_mode`). Its verdict leaves as a :class:`ModeChosen` command; the shell rebuilds its core for that
mode (nothing has happened in the first one, so the run is exactly a fixed-mode run of the chosen mode).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from flodl_exp.protocol.messages import ProbeResult

PROBE_STEPS = 4
"""Steps each rank times; the first is warm-up (allocations, lazy initialisation) and is left out."""
PROBE_TIMEOUT_S = 120.0
"""How long the probe may take before the run starts in the configured mode (a first step may compile)."""
KEEP_MARGIN = 0.02
"""The configured mode is kept unless another candidate is predicted at least this much faster (a prediction
within a few percent is noise, and the configured mode is what the user would otherwise have run)."""


@dataclass
class Candidate:
    """One mode's prediction on the probed rig."""

    mode: str
    samples_per_s: float = 0.0
    syncs: float = 0.0
    window_batches: float = 0.0
    """The longest predicted window on any rank: batches trained between two averagings."""
    eligible: bool = True
    why: str = ""


@dataclass(frozen=True)
class ProbeMeasured:
    """What the probe measured, for the shell's predictions (:class:`PredictModes`)."""

    step_ms: dict[int, list[float]]
    data_ms: dict[int, list[float]]
    model_bytes: int


@dataclass(frozen=True)
class PredictModes:
    """Command: the probe is over and every rank was measured; predict each candidate mode on this rig and hand the
    predictions back as :class:`ModesPredicted`."""

    measured: ProbeMeasured


@dataclass(frozen=True)
class ModeChosen:
    """Command: the mode to train in (the configured one when the probe could not tell), with the reason."""

    mode: str
    reason: str
    candidates: tuple[Candidate, ...] = ()
    probe_s: float = 0.0
    """The probe, from the moment it was sent to its last answer (or its timeout)."""


@dataclass(frozen=True)
class AutoProbeStarts:
    """Event: every rank joined a ``mode.auto`` run; the core asks each to time :data:`PROBE_STEPS` steps."""

    now: float


@dataclass(frozen=True)
class ModesPredicted:
    """Event: the shell's predictions for :class:`PredictModes` (``error``: why it could not make them)."""

    candidates: tuple[Candidate, ...]
    now: float
    error: Optional[str] = None
    note: str = ""
    """What the reason says of the rig (the probed step times)."""


def pick_mode(candidates: Sequence[Candidate], configured: str, note: str = "") -> tuple[str, str]:
    """The best predicted samples/s among the eligible candidates, the configured mode kept unless beaten by
    :data:`KEEP_MARGIN`; the configured mode when none is eligible. Returns (mode, reason)."""
    ok = [c for c in candidates if c.eligible and c.samples_per_s > 0]
    if not ok:
        return configured, "no candidate could be simulated within the limits: the configured mode"
    best = max(ok, key=lambda c: c.samples_per_s)
    kept = next((c for c in ok if c.mode == configured), None)
    if kept is not None and best.mode != configured and best.samples_per_s < kept.samples_per_s * (1 + KEEP_MARGIN):
        best = kept
    others = ", ".join(f"{c.mode} {c.samples_per_s:.0f}" for c in sorted(ok, key=lambda c: -c.samples_per_s)
                       if c is not best)
    return best.mode, (f"{best.mode}: predicted {best.samples_per_s:.0f} samples/s on the probed rig"
                       f"{f' ({note})' if note else ''}; others: {others or 'none'}")


@dataclass
class AutoDecision:
    """The probe's books and the choice (see the module docstring). One per ``mode.auto`` run that probes."""

    world_size: int
    configured: str
    results: dict[int, ProbeResult] = field(default_factory=dict)
    started: Optional[float] = None
    predicting: bool = False
    answered: float = 0.0
    """When the probe ended (its last answer, or its timeout)."""
    chosen: Optional[ModeChosen] = None

    @property
    def open(self) -> bool:
        """The probe was sent and no verdict left yet."""
        return self.started is not None and self.chosen is None and not self.predicting

    def on_result(self, r: int, res: ProbeResult) -> None:
        if self.open:
            self.results[r] = res

    def over(self, now: float) -> bool:
        """Every rank answered, or the probe timed out."""
        return self.open and (len(self.results) >= self.world_size
                              or now > (self.started or 0.0) + PROBE_TIMEOUT_S)

    def conclude(self, now: float) -> Optional[PredictModes | ModeChosen]:
        """The probe is over: the configured mode when a rank was not measured, else a request for predictions."""
        if not self.over(now):
            return None
        missing = [r for r in range(self.world_size) if r not in self.results]
        failed = {r: res.error for r, res in self.results.items() if res.error or not res.step_ms}
        if missing or failed:
            why = (f"ranks {missing} did not answer the probe within its time" if missing else
                   "; ".join(f"rank {r}: {e or 'no step timed'}" for r, e in sorted(failed.items())))
            self.answered = now
            return self._choose(self.configured, f"the configured mode: {why}", ())
        self.predicting = True
        self.answered = now
        res = self.results
        return PredictModes(ProbeMeasured(step_ms={r: list(res[r].step_ms) for r in sorted(res)},
                                          data_ms={r: list(res[r].data_ms) for r in sorted(res)},
                                          model_bytes=max(x.model_bytes for x in res.values())))

    def on_predicted(self, e: ModesPredicted) -> Optional[ModeChosen]:
        if not self.predicting or self.chosen is not None:
            return None
        self.predicting = False
        if e.error is not None:
            return self._choose(self.configured, f"the configured mode: the prediction failed ({e.error})",
                                e.candidates)
        mode, reason = pick_mode(e.candidates, self.configured, e.note)
        return self._choose(mode, reason, e.candidates)

    def _choose(self, mode: str, reason: str, candidates: Sequence[Candidate]) -> ModeChosen:
        started = self.started if self.started is not None else self.answered
        self.chosen = ModeChosen(mode, reason, tuple(candidates), probe_s=self.answered - started)
        return self.chosen
