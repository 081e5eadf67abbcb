"""``mode.auto`` on the coordinator's side: the predictions the core's choice is made from.

The core decides (core/auto_choice.py): it sends the probe once the coordinator says every rank joined
(``AutoProbeStarts``), books the answers, keeps the configured mode when a rank could not be measured, and otherwise
asks for predictions (``PredictModes``). :class:`AutoProbe` makes them: the simulator (flodl_exp/simulate/auto.py) runs
each candidate mode on the measured rig; the simulator embeds a core, so it runs here, not in the core. What the
simulations need beyond what the hellos and the probe measure (the rig's other values, each mode's run config, the
simulator's imports) is built as the coordinator starts, while the ranks start up (:meth:`AutoProbe.prepare`), so only
the simulations themselves follow the last answer. The core picks from the predictions (``ModeChosen``) and the
coordinator builds its core for that mode: nothing has happened in the first one, so the run is exactly a fixed-mode
run of the chosen mode.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from flodl_exp.config import outer_spec
from flodl_exp.core.auto_choice import Candidate, ModeChosen, ModesPredicted, ProbeMeasured
from flodl_exp.devices import CollectiveRefused, RankDevice, choose_collective

if TYPE_CHECKING:
    from flodl_exp.simulate.auto import AutoChoice, Prepared

log = logging.getLogger("flodl_exp.coordinator")


class AutoProbe:
    def __init__(self, cfg: Any, world_size: int, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.W = world_size
        self.clock = clock
        self.sent = False
        """The core was told every rank joined (it sent the probe)."""
        self.choice: Optional[AutoChoice] = None
        self.prepared: Optional[Prepared] = None
        self.prepare_error: Optional[Exception] = None
        self.prepare_s = 0.0
        self.simulate_s = 0.0
        self.step_ms: dict[int, list[float]] = {}
        self.prepare()

    def prepare(self) -> None:
        """simulate/auto.prepare for this run (every mode: which are candidates is known once the ranks said hello);
        a failure is kept for :meth:`predict` (the core keeps the configured mode, with the reason)."""
        from flodl_exp.policy.mode import with_overlap
        from flodl_exp.simulate.auto import prepare
        from flodl_exp.simulate.from_run import base_config
        from flodl_exp.simulate.topology import MODES

        t0 = self.clock()
        cfg = self.cfg
        try:
            knobs = {k: getattr(cfg.mode, k) for k in ("anchor", "min_anchor", "max_anchor", "overhead_target",
                                                      "max_batch_diff", "max_overshoot", "relax_up", "gamma",
                                                      "meta_controller")}
            self.prepared = prepare(with_overlap(MODES), world_size=self.W, batch_size=int(cfg.experiment.batch_size),
                                    epochs=int(cfg.experiment.epochs), knobs=knobs, base=base_config(),
                                    seed=int(cfg.seed), guard=cfg.guard, outer=cfg.outer)
        except Exception as e:
            self.prepare_error = e
        self.prepare_s = self.clock() - t0

    def predict(self, measured: ProbeMeasured, devices: dict[int, RankDevice], total_picks: int) -> ModesPredicted:
        """Each candidate mode simulated on the measured rig (``error``: why it could not be)."""
        from flodl_exp.simulate.auto import rig_note

        t0 = self.clock()
        self.step_ms = dict(measured.step_ms)
        try:
            rig, candidates = self._predict(measured, devices, total_picks)
            out = ModesPredicted(tuple(candidates), self.clock(), note=rig_note(rig))
        except Exception as e:  # the run goes on in the configured mode (the core says why)
            out = ModesPredicted((), self.clock(), error=f"{type(e).__name__}: {e}")
        self.simulate_s = self.clock() - t0
        return out

    def _predict(self, measured: ProbeMeasured, devices: dict[int, RankDevice], total_picks: int) -> tuple[Any, list[Candidate]]:
        from flodl_exp.simulate.auto import candidate_modes, predict

        if self.prepare_error is not None:
            raise self.prepare_error
        assert self.prepared is not None
        cfg = self.cfg
        try:
            choose_collective([devices[r] for r in sorted(devices)], cfg.cluster.collective)
            can_group = True
        except CollectiveRefused:
            can_group = False
        modes = candidate_modes(can_group, lockstep=bool(cfg.mode.lockstep_ahead))
        if outer_spec(cfg).stateful:  # a stateful outer optimizer lives where the configured backend keeps it
            modes = [m for m in modes if m.startswith(str(cfg.mode.backend))]
        rig = self.prepared.probed(measured.step_ms, measured.data_ms, model_bytes=measured.model_bytes,
                                   samples=total_picks)
        return rig, predict(rig, modes, configured=self.configured, max_window=float(cfg.mode.max_anchor),
                            runs=self.prepared.runs)

    @property
    def configured(self) -> str:
        from flodl_exp.policy.mode import configured_variant

        return configured_variant(self.cfg.mode)

    def chosen(self, c: ModeChosen) -> AutoChoice:
        """The core's verdict, as the coordinator records it (its event, its tags, result.json)."""
        from flodl_exp.simulate.auto import AutoChoice

        self.choice = AutoChoice(c.mode, c.reason, list(c.candidates))
        self.choice.timing = {"probe_s": round(c.probe_s, 3), "simulate_s": round(self.simulate_s, 3),
                              "prepare_s": round(self.prepare_s, 3),
                              "step_ms": {str(r): [round(x, 2) for x in ms] for r, ms in sorted(self.step_ms.items())}}
        return self.choice
