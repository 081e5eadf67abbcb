"""``mode.auto``: the mode for the rig a run finds, chosen by the simulator (which runs the coordinator's own core).

Before the first chunk every rank times a few real training steps (``Probe``; nothing is kept: see
RankTrainer.probe). :func:`probe_rig` turns those times into a simulated rig (each rank's step and data time, the
model's size, the run's data, epochs and mode knobs; the link's costs are the simulator's calibrated defaults,
conf/simulate/config.yaml), :func:`choose` simulates every candidate mode on it and keeps the one with the best
predicted throughput among those whose windows stay within ``mode.max_anchor`` batches on every rank (the guard
watches drift per window: a mode whose windows outgrow the ceiling the fixed modes respect is not offered).

What does not depend on the measurements (each mode's run config: OmegaConf merges and the run's validation, about
half of a two-epoch simulation's cost; the simulator's imports) is built beforehand by :func:`prepare`, which the
coordinator calls as it starts, while the ranks start up: after the probe's last answer only the simulations run.

Why before the first chunk and not at a later window boundary: the averaging cycle, ElChe, the dispatcher and
the bundle rules are built for one policy and backend; switching them under chunks in flight would need every
invariant (every pick once, resumable bundles, exact coverage) proved for each pair of modes. Chosen before the
first chunk, the run is exactly a fixed-mode run of the chosen mode. Pure: no I/O (the coordinator probes, logs
and rebuilds its core).
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from flodl_exp import events as ev
from flodl_exp.core.auto_choice import KEEP_MARGIN, PROBE_STEPS, Candidate, pick_mode  # noqa: F401 (re-exported: the probe and the rule are the core's)
from flodl_exp.policy.mode import Mode, known_modes, variant_of, with_overlap
from flodl_exp.simulate.topology import MODES, SimulateConfig, measured_rig_config, run_config

SIM_EPOCHS = 2
"""Epochs simulated per candidate at most: throughput settles within them, and a long run's choice stays cheap."""


@dataclass
class AutoChoice:
    mode: str
    reason: str
    candidates: list[Candidate] = field(default_factory=list)
    timing: dict[str, Any] = field(default_factory=dict)
    """The coordinator's: ``probe_s`` (the probe sent to its last answer), ``simulate_s`` (that answer to the choice),
    ``prepare_s`` (:func:`prepare`, as the coordinator started: before the probe, not in either), ``step_ms`` (each
    rank's probed step times)."""

    def as_event(self) -> ev.AutoMode:
        return ev.AutoMode(mode=self.mode, reason=self.reason,
                           candidates=[dataclasses.asdict(c) for c in self.candidates], timing=self.timing)

    def tags(self) -> dict[str, str]:
        out = {"auto.choice": self.mode, "auto.reason": self.reason[:4000]}
        for c in self.candidates:
            # an MLflow key takes no "+": auto.predicted.cpu_cadence.overlap for the candidate cpu_cadence+overlap
            out[f"auto.predicted.{c.mode.replace('+', '.')}"] = (f"{c.samples_per_s:.0f} samples/s, {c.syncs:.0f} syncs, windows up to "
                                               f"{c.window_batches:.0f} batches" + ("" if c.eligible else f" ({c.why})"))
        return out


def probe_ms(times: Sequence[float]) -> float:
    """A rank's step time from its probe: the median after the warm-up step."""
    kept = [t for t in times[1:] if t == t and t >= 0] or [t for t in times if t == t and t >= 0]
    if not kept:
        raise ValueError("the probe reported no step time")
    return float(statistics.median(kept))


def probe_rig(step_ms: Mapping[int, Sequence[float]], data_ms: Mapping[int, Sequence[float]], *, model_bytes: int,
              samples: int, batch_size: int, epochs: int, knobs: Mapping[str, Any], base: SimulateConfig,
              guard: Optional[Any] = None, outer: Optional[Any] = None, seed: int = 42) -> SimulateConfig:
    """The rig the probe measured, for the simulator (``base`` supplies what a probe does not measure: the link)."""
    ranks = sorted(step_ms)
    cfg = measured_rig_config(
        base, "probed", [probe_ms(step_ms[r]) for r in ranks],
        [statistics.median(list(data_ms.get(r) or [0.0])[1:] or [0.0]) for r in ranks],
        samples=samples, batch_size=batch_size, epochs=max(1, min(int(epochs), SIM_EPOCHS)),
        model_mb=model_bytes / 1e6 if model_bytes > 0 else None, knobs=knobs, guard=guard, outer=outer, seed=seed)
    cfg.plot = False
    return cfg


@dataclass
class Prepared:
    """What the choice needs that neither the probe nor the hellos tell (:func:`prepare`): the rig's other values
    and each mode's run config (topology.run_config: OmegaConf merges and the run's validation, most of a short
    simulation's cost). The coordinator builds it as it starts, while the ranks start up."""

    rig: dict[str, Any]
    """:func:`probe_rig`'s keyword arguments but the measured ones (step and data ms, model bytes, samples)."""
    runs: dict[str, Any] = field(default_factory=dict)
    """mode -> its run config, or the exception building it raised (raised again where :func:`choose` simulates it)."""

    def probed(self, step_ms: Mapping[int, Sequence[float]], data_ms: Mapping[int, Sequence[float]], *,
               model_bytes: int, samples: int) -> SimulateConfig:
        """The rig with the probe's measurements and the data's size (the hellos') in."""
        return probe_rig(step_ms, data_ms, model_bytes=model_bytes, samples=samples, **self.rig)


def prepare(modes: Sequence[str], *, world_size: int, batch_size: int, epochs: int, knobs: Mapping[str, Any],
            base: SimulateConfig, guard: Optional[Any] = None, outer: Optional[Any] = None, seed: int = 42) -> Prepared:
    """Everything :func:`choose` needs but the measurements (:func:`probe_rig`'s other arguments; a run config for
    each of ``modes``: the run's world size, batch, epochs, knobs, guard, outer and seed are all in it, the rig's
    times and data size are not), so that only the simulations themselves follow the probe's last answer. Also
    imports the engine (a coordinator's first simulation would otherwise pay for it)."""
    from flodl_exp.simulate import engine, report  # noqa: F401

    out = Prepared(dict(batch_size=batch_size, epochs=epochs, knobs=dict(knobs), base=base, guard=guard, outer=outer,
                        seed=seed))
    template = out.probed({r: [1.0] for r in range(world_size)}, {}, model_bytes=0, samples=batch_size)
    for mode in modes:
        if variant_of(mode)[0] in known_modes():
            try:
                out.runs[mode] = run_config(template, mode, world_size)
            except Exception as e:  # choose raises it where it simulates this mode, as without preparing
                out.runs[mode] = e
    return out


def rig_note(rig: SimulateConfig) -> str:
    """The probed step times, as the choice's reason quotes them."""
    return f"step ms {', '.join(f'{g.step_ms:.1f}' for g in rig.ranks)}"


def predict(rig: SimulateConfig, candidates: Sequence[str], *, configured: str, max_window: float,
            runs: Optional[Mapping[str, Any]] = None) -> list[Candidate]:
    """Simulate the candidates on ``rig`` (in ``candidates``' order): each one's predicted samples/s, syncs and
    longest window, ineligible when its windows outgrow ``max_window`` batches (the guard watches drift per window:
    a mode whose windows outgrow the ceiling the fixed modes respect is not offered). ``runs``: the candidates' run
    configs built beforehand (:attr:`Prepared.runs`, for the same rig but its measurements)."""
    from flodl_exp.simulate.engine import simulate
    from flodl_exp.simulate.report import fastest_rank, summarize

    fast = fastest_rank(rig)
    per_epoch = rig.samples // rig.batch_size

    def simulated(mode: str) -> Candidate:
        if variant_of(mode)[0] not in known_modes():
            return Candidate(mode, eligible=False, why="not a mode the simulator runs")
        run = (runs or {}).get(mode)
        if isinstance(run, BaseException):
            raise run
        row = summarize(simulate(rig, mode, run), fast)
        syncs = float(row["syncs"])
        window = max(float(s) for s in row["shares"]) * per_epoch * rig.epochs / max(1.0, syncs)
        c = Candidate(mode, float(row["samples_per_s"]), syncs, window)
        if window > max_window:
            c.eligible, c.why = False, f"windows of {window:.0f} batches exceed mode.max_anchor={max_window:.0f}"
        return c

    # Per-step averaging is never faster than a mode with windows in the model (a window of one batch is the
    # most it does): the sync modes are simulated only when no windowed mode stays within the window limit, or
    # when one is the configured mode (its prediction decides whether it is kept). They are ~55 % of the events.
    def windowed(m: str) -> bool:
        base = variant_of(m)[0]
        return base in known_modes() and Mode.from_name(base).window_grows

    per_step = [m for m in candidates if variant_of(m)[0] in known_modes() and not windowed(m) and m != configured]
    out = [simulated(m) for m in candidates if m not in per_step]
    windowed_ok = any(c.eligible and c.samples_per_s > 0 and windowed(c.mode) for c in out)
    for m in per_step:
        out.append(Candidate(m, eligible=False, why="not simulated: a mode with windows is within the limit, and "
                                                    "per-step averaging is never faster")
                   if windowed_ok else simulated(m))
    order = {m: i for i, m in enumerate(candidates)}
    out.sort(key=lambda c: order[c.mode])
    return out


def choose(rig: SimulateConfig, candidates: Sequence[str], *, configured: str, max_window: float,
           runs: Optional[Mapping[str, Any]] = None) -> AutoChoice:
    """:func:`predict`, then the core's rule (core/auto_choice.py's :func:`pick_mode`): the best predicted samples/s
    among the eligible candidates, ``configured`` kept unless beaten by :data:`KEEP_MARGIN`."""
    out = predict(rig, candidates, configured=configured, max_window=max_window, runs=runs)
    mode, reason = pick_mode(out, configured, rig_note(rig))
    return AutoChoice(mode, reason, out)


def candidate_modes(can_form_group: bool, lockstep: bool = False) -> list[str]:
    """Every mode the cohort can run: the nccl modes only where a process group can form, the cpu modes always;
    each overlap-capable one also with ``mode.overlap`` (``cpu_cadence+overlap``: policy/mode.py's variant_of), but
    for a lockstep-capable one when ``lockstep`` (``mode.lockstep_ahead`` is set: the two are refused together)."""
    modes = with_overlap([m for m in MODES if can_form_group or not m.startswith("nccl")])
    if not lockstep:
        return modes
    return [m for m in modes if not (variant_of(m)[1] and Mode.from_name(variant_of(m)[0]).lockstep_capable)]
