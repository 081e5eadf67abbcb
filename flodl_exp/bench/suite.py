"""What the benchmark suite runs: its typed config and the run plan (pure: no process, no store).

``python -m flodl_exp.bench`` composes ``conf/bench/config.yaml`` onto :class:`BenchConfig` (registered in
Hydra's ConfigStore under its own group, ``flodl_bench``, so the main app's frozen schema is untouched).
:func:`plan` turns it into one :class:`RunSpec` per (model, run) pair, in order: the models x
``runs`` (plus ``extra_runs`` for some models). A run name is one of

* ``solo_fast`` / ``solo_slow``: one rank at the fastest / slowest of ``rank_speeds``;
* ``ddp``: PyTorch DistributedDataParallel, one process per entry of ``rank_speeds`` (``bench/ddp.py``);
* ``<mode>`` or ``<mode>+<outer>``: flodl_exp in that mode on ``cluster=local_hetero`` with ``rank_speeds``
  (``nccl_cadence+diloco`` = ``mode=nccl_cadence outer=diloco``).

Why a plan of plain specs: the runner, the report and the tests read the same list, and a bad name fails here,
in one line, before anything starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from flodl_exp.config import ConfigError

SCHEMA_GROUP = "flodl_bench"
ZOO = ("logistic", "mlp", "lenet", "resnet20", "char_rnn", "gpt_nano", "conv_ae")
"""The reference's seven models (algorithms.md 12.1), as experiment presets under conf/experiment/."""
MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
OUTERS = ("avg", "slowmo", "diloco")
BASELINES = ("solo_fast", "solo_slow", "ddp")
ALL_RUNS = (*BASELINES, *MODES, "nccl_cadence+diloco")
REFERENCE_RUN = "solo_fast"
"""The row every ratio is taken against (the reference's solo-0)."""


@dataclass
class BenchTracking:
    uri: Optional[str] = None
    """MLflow tracking URI; unset = sqlite:///<cwd>/outputs/mlflow.db (the main app's store)."""
    experiment_name: str = "flodl_bench"
    """The MLflow experiment of the bench's parent run and of every run of the suite (created when it does not
    exist); with ``report_of``, the runs of the report are read from it."""
    artifact_location: Optional[str] = None
    """Unset = <cwd>/outputs/mlartifacts for the embedded store."""


@dataclass
class BenchConfig:
    """The suite: which models, which runs, how long, on which simulated rig."""

    name: str = "full"
    """The preset's name (set by conf/bench/preset/*.yaml), in the report's title and the parent run's tags."""
    models: List[str] = field(default_factory=lambda: list(ZOO))
    """Experiment presets (conf/experiment/<name>.yaml), one report section each."""
    runs: List[str] = field(default_factory=lambda: list(ALL_RUNS))
    """Runs for every model (names: see the module docstring)."""
    extra_runs: Dict[str, List[str]] = field(default_factory=dict)
    """model -> runs added for that model only (the quick preset runs every mode on one model)."""
    epochs: Optional[int] = None
    """Epochs of every run; unset = each preset's own."""
    experiment_overrides: Dict[str, List[str]] = field(default_factory=dict)
    """model -> ``experiment.*`` overrides of its preset (batch limits: ``experiment.train_data.limit=256``)."""
    run_overrides: List[str] = field(default_factory=lambda: ["eval.every=0", "tracking.log_model=false",
                                                              "tracking.predict=false"])
    """Main-app overrides for every flodl_exp run (the DDP and torch runs read only ``experiment``)."""
    rank_speeds: List[float] = field(default_factory=lambda: [1.0, 0.33])
    """The simulated rig (cluster.rank_speeds): rank r waits (1/s - 1) x its step time after each step."""
    seed: int = 42
    """Every run's seed: passed as ``seed=`` to each flodl_exp run, and to the DDP and torch runs (model init,
    data shuffle)."""
    solo: str = "flodl"
    """How the solo runs train: flodl (one flodl_exp rank: coordinator + rank process) or torch (a plain loop in
    the bench process, no start-up cost; the same events and metrics)."""
    ddp_start_method: str = "spawn"
    """spawn (fresh processes: the honest cold start) or fork (from the bench process: no imports, seconds less)."""
    ddp_sleep_basis: str = "compute"
    """DDP's slow rank sleeps (1/s - 1) x its compute wall (compute, like flodl_exp) or its step wall (step)."""
    lr_scale_ratio: float = 1.0
    """The DDP run's linear LR scaling, as flodl_exp's mode.lr_scale_ratio (the same LR for the same world)."""
    parallel: int = 1
    """flodl_exp runs in flight at once (DDP / torch runs train meanwhile). 1 = one run on the machine at a time:
    the only setting whose timings compare; more cuts the bench's wall (start-up overlaps) at the cost of noise."""
    run_timeout_s: float = 900.0
    """One run's limit; a run past it is cancelled and reported FAILED (the suite goes on)."""
    tracking: BenchTracking = field(default_factory=BenchTracking)
    report_of: Optional[str] = None
    """A parent run id of an earlier session: run nothing, rebuild its report from the store into ``out_dir``
    (and log it on that parent again)."""
    out_dir: Optional[str] = None
    """report.md, the PNGs and each run's folder; unset = outputs/bench/<timestamp>."""


def register() -> None:
    """The schema in Hydra's ConfigStore, group ``flodl_bench`` (conf/bench/config.yaml extends it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group=SCHEMA_GROUP, name="schema", node=BenchConfig, package="_global_")


@dataclass(frozen=True)
class RunSpec:
    """One run of the suite."""

    model: str
    name: str
    kind: str
    """flodl (flodl_exp.jobs.launcher.launch) | torch (bench/ddp.py: the DDP baseline, or a torch solo)."""
    speeds: tuple[float, ...]
    overrides: tuple[str, ...] = ()
    """flodl: the main app's overrides for this run (beyond experiment, tracking and job folder)."""

    @property
    def label(self) -> str:
        return f"{self.model}/{self.name}"


def _parse(name: str) -> tuple[str, str]:
    mode, _, outer = name.partition("+")
    return mode, outer or "avg"


def check_run_name(name: str) -> None:
    if name in BASELINES:
        return
    mode, outer = _parse(name)
    if mode not in MODES or outer not in OUTERS:
        raise ConfigError(f"config error: runs entry {name!r} is not allowed: one of {', '.join(BASELINES)}, "
                          f"a mode ({', '.join(MODES)}) or <mode>+<outer> (outer: {', '.join(OUTERS[1:])})")


def validate(cfg: BenchConfig) -> None:
    """The bench's one validation pass (the main app's runs to the launcher's own)."""
    if not cfg.models:
        raise ConfigError("config error: models=[] is not allowed: at least one experiment preset")
    for n in [*cfg.runs, *(r for rs in cfg.extra_runs.values() for r in rs)]:
        check_run_name(n)
    # extra_runs / experiment_overrides of a model not in ``models`` are unused, not an error: a preset names
    # every model and the command line may narrow ``models``.
    bad = [o for rs in cfg.experiment_overrides.values() for o in rs if not str(o).startswith("experiment.")]
    if bad:
        raise ConfigError(f"config error: experiment_overrides entry {bad[0]!r} is not allowed: experiment.<key>=<value>")
    if len(cfg.rank_speeds) < 2 or any(not (0 < s <= 1) for s in cfg.rank_speeds):
        raise ConfigError(f"config error: rank_speeds={list(cfg.rank_speeds)} is not allowed: two or more factors in (0, 1]")
    if cfg.solo not in ("flodl", "torch"):
        raise ConfigError(f"config error: solo={cfg.solo!r} is not allowed: flodl or torch")
    if cfg.ddp_start_method not in ("spawn", "fork"):
        raise ConfigError(f"config error: ddp_start_method={cfg.ddp_start_method!r} is not allowed: spawn or fork")
    if cfg.ddp_sleep_basis not in ("compute", "step"):
        raise ConfigError(f"config error: ddp_sleep_basis={cfg.ddp_sleep_basis!r} is not allowed: compute or step")
    if cfg.epochs is not None and cfg.epochs < 1:
        raise ConfigError(f"config error: epochs={cfg.epochs} is not allowed: an integer >= 1 or null")
    if cfg.parallel < 1:
        raise ConfigError(f"config error: parallel={cfg.parallel} is not allowed: an integer >= 1")
    if not cfg.run_timeout_s > 0:
        raise ConfigError(f"config error: run_timeout_s={cfg.run_timeout_s} is not allowed: seconds > 0")


def _fmt(speeds: tuple[float, ...]) -> str:
    return "[" + ",".join(f"{s:g}" for s in speeds) + "]"


def spec_for(cfg: BenchConfig, model: str, name: str) -> RunSpec:
    speeds = tuple(float(s) for s in cfg.rank_speeds)
    if name in ("solo_fast", "solo_slow"):
        one = (max(speeds),) if name == "solo_fast" else (min(speeds),)
        if cfg.solo == "torch":
            return RunSpec(model, name, "torch", one)
        return RunSpec(model, name, "flodl", one, ("mode=nccl_sync", "cluster=local", "cluster.ranks_per_node=1",
                                                   f"cluster.rank_speeds={_fmt(one)}"))
    if name == "ddp":
        return RunSpec(model, name, "torch", speeds)
    mode, outer = _parse(name)
    return RunSpec(model, name, "flodl", speeds, (f"mode={mode}", f"outer={outer}", "cluster=local_hetero",
                                                  f"cluster.ranks_per_node={len(speeds)}", f"cluster.rank_speeds={_fmt(speeds)}"))


def plan(cfg: BenchConfig) -> list[RunSpec]:
    """Every run, model by model (the solo runs first: the report's reference row), duplicates dropped."""
    validate(cfg)
    out: list[RunSpec] = []
    for m in cfg.models:
        names = list(dict.fromkeys([*cfg.runs, *cfg.extra_runs.get(m, [])]))
        names.sort(key=lambda n: (n not in BASELINES, BASELINES.index(n) if n in BASELINES else 0))
        out += [spec_for(cfg, m, n) for n in names]
    return out


def experiment_overrides(cfg: BenchConfig, model: str) -> list[str]:
    """``experiment=<model>`` and what the preset changes for it (epochs, batch limits)."""
    ovr = [f"experiment={model}", *cfg.experiment_overrides.get("all", []), *cfg.experiment_overrides.get(model, [])]
    if cfg.epochs is not None:
        ovr.append(f"experiment.epochs={int(cfg.epochs)}")
    return ovr
