"""``mode.auto`` on the coordinator's side: the probe before the first chunk, and the choice it leads to.

:class:`AutoProbe` asks every rank to time a few training steps (``Probe``), collects the ``ProbeResult``s (or
gives up waiting after :data:`PROBE_TIMEOUT_S`), and asks the simulator (flodl_exp/simulate/auto.py) which mode
the measured rig trains fastest in. What the simulations need beyond what the hellos and the probe measure (the
rig's other values, each mode's run config, the simulator's imports) is built as the coordinator starts, while the
ranks start up (:meth:`AutoProbe.prepare`), so only the simulations themselves follow the last answer. The coordinator then builds its core for that mode: nothing has happened in
the core yet, so the run is exactly a fixed-mode run of the chosen mode. Any failure (a rank that cannot probe, a
simulation error, the timeout) keeps the configured mode and says why.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from flodl_exp.core.outbox import Outbox
from flodl_exp.devices import CollectiveRefused, RankDevice, choose_collective
from flodl_exp.protocol.messages import Probe, ProbeResult

if TYPE_CHECKING:
    from flodl_exp.simulate.auto import AutoChoice, Prepared

log = logging.getLogger("flodl_exp.coordinator")

PROBE_TIMEOUT_S = 120.0
"""How long the probe may take before the run starts in the configured mode (a first step may compile)."""


class AutoProbe:
    def __init__(self, cfg: Any, world_size: int, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.W = world_size
        self.clock = clock
        self.results: dict[int, ProbeResult] = {}
        self.deadline: Optional[float] = None
        self.choice: Optional[AutoChoice] = None
        self.prepared: Optional[Prepared] = None
        self.prepare_error: Optional[Exception] = None
        self.prepare_s = 0.0
        self.prepare()

    @property
    def configured(self) -> str:
        return f"{self.cfg.mode.backend}_{self.cfg.mode.policy}"

    def begin(self, outbox: Outbox) -> None:
        """Every rank joined: ask each to time :data:`~flodl_exp.simulate.auto.PROBE_STEPS` steps."""
        from flodl_exp.simulate.auto import PROBE_STEPS

        self.deadline = self.clock() + PROBE_TIMEOUT_S
        log.info("mode=auto: every rank times %d training steps before the first chunk (nothing is kept)", PROBE_STEPS)
        outbox.broadcast(Probe(steps=PROBE_STEPS))

    def prepare(self) -> None:
        """simulate/auto.prepare for this run (every mode: which are candidates is known once the ranks said hello);
        a failure is kept for :meth:`decide` (the configured mode, with the reason)."""
        from flodl_exp.simulate.auto import prepare
        from flodl_exp.simulate.from_run import base_config
        from flodl_exp.simulate.topology import MODES

        t0 = self.clock()
        cfg = self.cfg
        try:
            knobs = {k: getattr(cfg.mode, k) for k in ("anchor", "min_anchor", "max_anchor", "overhead_target",
                                                      "max_batch_diff", "max_overshoot", "relax_up", "gamma",
                                                      "meta_controller")}
            self.prepared = prepare(MODES, world_size=self.W, batch_size=int(cfg.experiment.batch_size),
                                    epochs=int(cfg.experiment.epochs), knobs=knobs, base=base_config(),
                                    seed=int(cfg.seed), guard=cfg.guard, outer=cfg.outer)
        except Exception as e:
            self.prepare_error = e
        self.prepare_s = self.clock() - t0

    @property
    def sent(self) -> bool:
        return self.deadline is not None

    def on_result(self, r: int, res: ProbeResult) -> None:
        self.results[r] = res

    def ready(self) -> bool:
        """Every rank answered, or the probe timed out."""
        return self.sent and (len(self.results) >= self.W or self.clock() > (self.deadline or 0.0))

    def decide(self, devices: dict[int, RankDevice], total_picks: int) -> AutoChoice:
        """The mode to train in (the configured one, with the reason, when the probe cannot tell)."""
        from flodl_exp.simulate.auto import AutoChoice

        answered = self.clock()
        try:
            self.choice = self._decide(devices, total_picks)
        except Exception as e:  # the run goes on in the configured mode
            self.choice = AutoChoice(self.configured, f"the configured mode: the prediction failed ({type(e).__name__}: {e})")
        started = (self.deadline or answered) - PROBE_TIMEOUT_S
        self.choice.timing = {"probe_s": round(answered - started, 3), "simulate_s": round(self.clock() - answered, 3),
                              "prepare_s": round(self.prepare_s, 3),
                              "step_ms": {str(r): [round(x, 2) for x in res.step_ms] for r, res in sorted(self.results.items())}}
        return self.choice

    def _decide(self, devices: dict[int, RankDevice], total_picks: int) -> AutoChoice:
        from flodl_exp.simulate.auto import AutoChoice, candidate_modes, choose

        missing = [r for r in range(self.W) if r not in self.results]
        failed = {r: res.error for r, res in self.results.items() if res.error or not res.step_ms}
        if missing or failed:
            why = (f"ranks {missing} did not answer the probe within its time" if missing else
                   "; ".join(f"rank {r}: {e or 'no step timed'}" for r, e in sorted(failed.items())))
            return AutoChoice(self.configured, f"the configured mode: {why}")
        if self.prepare_error is not None:
            raise self.prepare_error
        assert self.prepared is not None
        cfg = self.cfg
        try:
            choose_collective([devices[r] for r in sorted(devices)], cfg.cluster.collective)
            can_group = True
        except CollectiveRefused:
            can_group = False
        modes = candidate_modes(can_group)
        if cfg.outer.kind != "avg":  # a stateful outer optimizer lives where the configured backend keeps it
            modes = [m for m in modes if m.startswith(str(cfg.mode.backend))]
        rig = self.prepared.probed({r: list(self.results[r].step_ms) for r in range(self.W)},
                                   {r: list(self.results[r].data_ms) for r in range(self.W)},
                                   model_bytes=max(res.model_bytes for res in self.results.values()), samples=total_picks)
        return choose(rig, modes, configured=self.configured, max_window=float(cfg.mode.max_anchor),
                      runs=self.prepared.runs)
