"""The declared rig the simulator runs: typed configs, registered in Hydra's ConfigStore under their own
group (``flodl_simulate``), apart from flodl_exp/config.py's run schema.

A rig is a list of rank groups (how many ranks, and each one's step time: given in ms, as a speed factor
of ``base_step_ms`` like ``cluster.rank_speeds``, or as a device type from :data:`DEVICE_SPEED`), a link
(bandwidth, latency, fixed per-collective cost), the model's parameter bytes, the data (samples, batch,
epochs, per-chunk first-batch fill) and which modes to run. The mode, guard and outer optimizer are the
run schema's own dataclasses (``ModeConfig``, ``GuardConfig``, ``OuterConfig``): the same presets
(``conf/mode/*.yaml``) and the same validation as a real run.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from flodl_exp.config import CheckpointConfig, ClusterConfig, Config, EvalConfig, ExperimentConfig, GuardConfig, ModeConfig, OuterConfig
from flodl_exp.config_rules import validate
from flodl_exp.policy.mode import Mode, known_modes, variant_of

SCHEMA_GROUP = "flodl_simulate"
MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
"""The built-in modes, simulated by default (``modes``) and by ``mode=auto``; any of :func:`known_modes` may be named."""

DEVICE_SPEED: dict[str, float] = {
    "h100": 2.0, "a100": 1.0, "l40s": 0.9, "a10": 0.45, "v100": 0.5, "rtx4090": 0.85, "rtx3090": 0.55,
    "t4": 0.18, "cpu": 0.02,
}
"""Rough relative training throughput per device type (A100 = 1.0): a rank of device d steps in
``base_step_ms / DEVICE_SPEED[d]``. Declare ``step_ms`` instead when you have a measurement."""


@dataclass
class RankGroupConfig:
    """``count`` ranks with the same step time. The first of ``step_ms``, ``speed``, ``device`` set wins."""

    count: int = 1
    """Ranks in this group, an integer >= 1."""
    step_ms: Optional[float] = None
    """Compute per batch (forward, backward, optimizer step), ms."""
    speed: Optional[float] = None
    """Speed factor in (0, 1] of ``base_step_ms``, as ``cluster.rank_speeds`` (0.33 = three times slower)."""
    device: Optional[str] = None
    """A key of DEVICE_SPEED."""
    data_ms: float = 0.0
    """Data wait per batch (prefetch that does not keep up), ms."""
    jitter: float = 0.0
    """Relative standard deviation of each step's time (seeded; 0 = every step the same)."""


@dataclass
class LinkConfig:
    """The network between ranks, and between ranks and the coordinator."""

    bandwidth_gbps: float = 100.0
    """Per-rank link, gigabits per second (a local loopback: tens of Gbit/s)."""
    latency_ms: float = 0.01
    """One-way latency of one message (control messages, each collective hop)."""
    coordinator_gbps: Optional[float] = None
    """The coordinator's NIC (cpu backend: every snapshot and update crosses it); unset = bandwidth_gbps."""
    collective_fixed_ms: float = 0.0
    """Fixed cost of one reduce (a collective's launch and Python/Gloo overhead; on the cpu backend the
    coordinator's own handling of the round), ms."""
    average_gbps: float = 16.0
    """cpu backend: the coordinator averages this many gigabits of snapshots per second."""
    batch_message_ms: float = 0.0
    """Rank-side cost of the per-batch timing message, ms (added to each step's wall)."""


@dataclass
class DivergenceConfig:
    """What the guard sees (nothing is trained): rank r's relative drift at a reduce is
    ``per_step x n_r x lr_factor x (1 + noise x N(0,1))``, n_r its steps in the window."""

    per_step: float = 0.002
    """Relative drift a rank's replica gains per local step (a fraction of the consensus norm); D grows linearly with
    its steps in the window and with the LR factor."""
    noise: float = 0.1
    """Relative standard deviation of each drift reading (seeded Gaussian; 0 = deterministic); a negative reading
    counts as 0."""


@dataclass
class SimTracking:
    """Where ``from_run`` reads its run (the main app's store unless set)."""

    uri: Optional[str] = None
    """MLflow tracking URI; unset = sqlite:///<cwd>/outputs/mlflow.db (the main app's store)."""


@dataclass
class SimulateConfig:
    """The simulator app's config (``conf/simulate/config.yaml`` and the rig presets)."""

    rig: str = "custom"
    """A name for the report."""
    ranks: List[RankGroupConfig] = field(default_factory=lambda: [RankGroupConfig(count=2)])
    """The rig's ranks as groups, in rank order (the first group's ranks are 0 .. count - 1); world size = the sum
    of the counts."""
    base_step_ms: float = 10.0
    """Step time of a speed-1.0 (A100-class) rank, ms."""
    link: LinkConfig = field(default_factory=LinkConfig)
    model_mb: float = 1.0
    """Parameter (and float buffer) bytes, MB (1e6 bytes)."""
    samples: int = 1437
    """Training samples per epoch (the data set's size)."""
    batch_size: int = 16
    """Samples per batch on each rank (one step per batch), as ``experiment.batch_size``: an epoch is
    floor(samples / batch_size) batches. An integer >= 1."""
    epochs: int = 10
    """Epochs simulated for each mode, as ``experiment.epochs``; an integer >= 1."""
    chunk_start_ms: float = 0.0
    """Extra data wait on the first batch of every chunk (the pipeline refills): ElChe's window fill."""
    lr_schedule: str = "none"
    """none | cosine (linear warm-up over warmup_frac of the steps, then cosine to 1% of the LR)."""
    warmup_frac: float = 0.1
    """lr_schedule=cosine: the share of all steps (floor(samples / batch_size) x epochs) the LR warms up over
    (at least one step)."""
    modes: List[str] = field(default_factory=lambda: list(MODES))
    """The modes to simulate, one report row each: nccl_sync | nccl_cadence | cpu_sync | cpu_cadence | cpu_async
    (nccl_async is refused, as by a real run)."""
    mode: Dict[str, Any] = field(default_factory=dict)
    """Overrides applied to every mode's preset, e.g. ``+mode.anchor=20``."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    seed: int = 42
    """Seeds each mode's random draws (step jitter, drift noise; every mode starts from the same seed) and is the
    run config's ``seed``."""
    max_events: int = 20_000_000
    """Hard bound on the event loop (a rig that never ends is reported, not looped on)."""
    out: Optional[str] = None
    """Write report.md, report.png and <mode>/events.jsonl here; unset = print only."""
    plot: bool = True
    """With ``out`` set, also draw report.png (samples trained over simulated time, and each rank's batch share)."""
    from_run: Optional[str] = None
    """An MLflow run id (``--from-run RUN_ID``): replay that finished run's measured rig (per-rank step and data
    times, the link's fixed cost fitted to its mean sync ms, its data, mode knobs, guard and outer optimizer) instead
    of the declared one; the link's other values, ``divergence``, ``modes``, ``out`` and ``plot`` still apply."""
    tracking: SimTracking = field(default_factory=SimTracking)


def register() -> None:
    """The schema in Hydra's ConfigStore, group ``flodl_simulate`` (conf/simulate/config.yaml extends it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group=SCHEMA_GROUP, name="schema", node=SimulateConfig, package="_global_")


# -- derived values ------------------------------------------------------------
def rank_steps(cfg: SimulateConfig) -> list[tuple[float, float, float]]:
    """``(step_ms, data_ms, jitter)`` of every rank, in rank order."""
    out: list[tuple[float, float, float]] = []
    for i, g in enumerate(cfg.ranks):
        if g.count < 1:
            raise ValueError(f"simulate: ranks[{i}].count={g.count} is not allowed: an integer >= 1")
        if g.step_ms is not None:
            ms = float(g.step_ms)
        elif g.speed is not None:
            if not 0 < g.speed:
                raise ValueError(f"simulate: ranks[{i}].speed={g.speed} is not allowed: a factor > 0")
            ms = cfg.base_step_ms / float(g.speed)
        elif g.device is not None:
            if g.device not in DEVICE_SPEED:
                raise ValueError(f"simulate: ranks[{i}].device={g.device!r} is not allowed: one of {', '.join(DEVICE_SPEED)}")
            ms = cfg.base_step_ms / DEVICE_SPEED[g.device]
        else:
            ms = cfg.base_step_ms
        if not ms > 0:
            raise ValueError(f"simulate: ranks[{i}] step time {ms} ms is not allowed: > 0")
        out += [(ms, float(g.data_ms), float(g.jitter))] * int(g.count)
    return out


def _preset(name: str) -> dict[str, Any]:
    """conf/mode/<name>.yaml the package ships (the run's presets); the policy/backend split of the name when
    the file is not there. Read once per process (a fresh dict each call)."""
    return dict(_read_preset(name))


@functools.cache
def _read_preset(name: str) -> dict[str, Any]:
    from flodl_exp.package_conf import CONF_DIR

    path = os.path.join(CONF_DIR, "mode", f"{name}.yaml")
    if os.path.exists(path):
        from omegaconf import OmegaConf

        return dict(OmegaConf.to_container(OmegaConf.load(path)))  # type: ignore[arg-type]
    mode = Mode.from_name(name)
    return {"name": name, "policy": mode.policy.name, "backend": mode.backend.value,
            "anchor": mode.policy.default_anchor}


def measured_rig_config(base: SimulateConfig, name: str, step_ms: Sequence[float], data_ms: Sequence[float], *,
                        samples: int, batch_size: int, epochs: int, model_mb: Optional[float] = None,
                        knobs: Optional[Mapping[str, Any]] = None, guard: Optional[Any] = None,
                        outer: Optional[Any] = None, seed: Optional[int] = None) -> SimulateConfig:
    """A rig whose ranks were measured (rank r's step and data-wait ms, in rank order; the first batch's refill in
    its data wait, so ``chunk_start_ms`` is 0) on ``base`` for what was not (the link, a copy the caller may fit;
    the divergence; the LR schedule): mode=auto's probe (auto.probe_rig) and a finished run's replay
    (from_run.measured_rig). ``model_mb``, ``knobs``, ``guard``, ``outer``, ``seed``: base's where None."""
    if len(step_ms) != len(data_ms):
        raise ValueError(f"simulate: {len(step_ms)} step times for {len(data_ms)} data waits")
    cfg = dataclasses.replace(base)
    cfg.link = dataclasses.replace(base.link)
    cfg.rig = name
    cfg.ranks = [RankGroupConfig(step_ms=max(float(s), 1e-3), data_ms=max(0.0, float(d))) for s, d in zip(step_ms, data_ms)]
    cfg.chunk_start_ms = 0.0
    cfg.samples, cfg.batch_size, cfg.epochs = int(samples), int(batch_size), int(epochs)
    if model_mb is not None and model_mb > 0:
        cfg.model_mb = float(model_mb)
    if knobs is not None:
        cfg.mode = dict(knobs)
    if guard is not None:
        cfg.guard = guard
    if outer is not None:
        cfg.outer = outer
    if seed is not None:
        cfg.seed = int(seed)
    cfg.out = None
    return cfg


def run_config(cfg: SimulateConfig, mode: str, world_size: int) -> Config:
    """The run schema's Config for one simulated mode, through the real validation (``validate``): a mode
    a real run refuses (``nccl_async``, EASGD off cpu_async, ...) is refused here with the same line. A mode named
    with ``+overlap`` (mode=auto's candidates, :func:`~flodl_exp.policy.mode.variant_of`) runs with ``mode.overlap``."""
    from omegaconf import OmegaConf

    mode, overlap = variant_of(mode)
    try:
        Mode.from_name(mode)  # one that does not run on its backend (nccl_async) is the validation's to refuse
    except ValueError:
        raise ValueError(f"simulate: modes entry {mode!r} is not allowed: one of {', '.join(known_modes())}") from None
    merged = OmegaConf.merge(OmegaConf.structured(ModeConfig), _preset(mode), dict(cfg.mode),
                             {"overlap": True} if overlap else {})
    mode_cfg = OmegaConf.to_object(merged)
    assert isinstance(mode_cfg, ModeConfig)
    guard = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GuardConfig), cfg.guard))
    outer = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OuterConfig), cfg.outer))
    assert isinstance(guard, GuardConfig) and isinstance(outer, OuterConfig)
    run = Config(mode=mode_cfg, guard=guard, outer=outer,
                 # simulated ranks send every report at once (the per-batch link cost is what the model charges)
                 cluster=ClusterConfig(ranks_per_node=world_size, report_coalesce_ms=0.0),
                 experiment=ExperimentConfig(name="simulate", model=None, optimizer=None, train_data=None,
                                             train_step="flodl_exp.simulate.no_step", batch_size=cfg.batch_size,
                                             epochs=cfg.epochs),
                 eval=EvalConfig(every=0, callback_slack=False), checkpoint=CheckpointConfig(), seed=cfg.seed)
    validate(run)
    return run


def lr_factor(cfg: SimulateConfig) -> Any:
    """The rank's LR factor of the global step (what the meta-controller watches), as flodl_exp.zoo.digits'
    cosine_schedule: a pure function of the step."""
    import math

    if cfg.lr_schedule == "none":
        return lambda step: 1.0
    if cfg.lr_schedule != "cosine":
        raise ValueError(f"simulate: lr_schedule={cfg.lr_schedule!r} is not allowed: none or cosine")
    total = max(1, (cfg.samples // cfg.batch_size) * cfg.epochs)
    warm = max(1, int(total * cfg.warmup_frac))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, total - warm))
        return 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * t))

    return factor
