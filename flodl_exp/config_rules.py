"""The one validation pass over a run config: one rule function per config group (the reference builder's
cross-field rules, algorithms.md 11.3). The launcher runs it once before any process starts; each rule raises
:class:`~flodl_exp.config.ConfigError` naming the key, the bad value and what is allowed, or returns warnings.

Apart from :mod:`flodl_exp.config` because a rule reads the environment (``FLODL_SHARED_OUTPUTS``), and the
control core, which imports the schemas, reads none.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, List, Optional

from flodl_exp.config import (
    COLLECTIVES,
    CORE_KEYS,
    DEVICES,
    DIRECTIONS,
    EXECUTORS,
    GPU_TASK_CPUS,
    GUARDS,
    LOOP_ERRORS,
    OUTERS,
    REDUCTIONS,
    Config,
    ConfigError,
    _err,
    did_you_mean,
    is_progressive,
    parse_callback_rank,
    world_size,
)
from flodl_exp.policy.mode import Backend, Mode
from flodl_exp.policy.registry import policy_names

_SCHEMA: Any = None


def _unknown_key(node: Any, schema: Any, path: str = "") -> Optional[str]:
    """First key of ``node`` the schema does not know (Hydra's ``+key=`` bypasses the struct check)."""
    from omegaconf import DictConfig, OmegaConf

    for key in node.keys():
        full = f"{path}{key}"
        if key not in schema.keys():
            return full
        if OmegaConf.is_missing(node, key) or OmegaConf.is_missing(schema, key):
            continue
        child, sch = node._get_node(key), schema._get_node(key)  # unresolved: a default may interpolate (tracking)
        if isinstance(child, DictConfig) and isinstance(sch, DictConfig):
            import dataclasses

            t = OmegaConf.get_type(schema, key)
            if t is not None and dataclasses.is_dataclass(t):
                found = _unknown_key(child, sch, full + ".")
                if found:
                    return found
    return None


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0



# -- the validation pass: one rule function per config group ---------------------------------------------
# Each rule takes the whole config, raises ConfigError on the first user error of its group and returns its
# warnings; :func:`validate` runs them in the order of ``_RULES``, which is also the order in which a config
# with several errors reports them (the schema first, then the mode's kind, the cluster's shape...).
def _schema_rules(cfg: Any) -> List[str]:
    """Keys the schema does not know (Hydra's ``+key=`` bypasses the struct check) and required fields left ``???``."""
    global _SCHEMA
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        return []  # a typed Config (load_config) has neither
    if _SCHEMA is None:
        _SCHEMA = OmegaConf.structured(Config)
    unknown = _unknown_key(cfg, _SCHEMA)
    if unknown:
        parent, _, name = unknown.rpartition(".")
        siblings = _SCHEMA if not parent else OmegaConf.select(_SCHEMA, parent, throw_on_missing=False)
        close = did_you_mean(name, [str(k) for k in siblings.keys()] if isinstance(siblings, DictConfig) else [])
        hint = f"; did you mean {parent + '.' if parent else ''}{close}?" if close else ""
        raise _err(unknown, OmegaConf.select(cfg, unknown),
                   f"not a key of the config schema (see conf/ and flodl_exp/config.py){hint}")
    for k in ("name", "model", "optimizer", "train_data"):
        if OmegaConf.is_missing(cfg.experiment, k):
            raise _err(f"experiment.{k}", "???", "a value (required field)")
    return []


def _loop_rules(cfg: Any) -> List[str]:
    """The managed tier (train_step) or the cooperative one (loop): exactly one, each a dotted path."""
    from omegaconf import DictConfig, OmegaConf

    exp = cfg.experiment
    for k in ("train_step", "loop"):
        if isinstance(exp, DictConfig) and OmegaConf.is_missing(exp, k):
            raise _err(f"experiment.{k}", "???", "a value (required field; null for the tier you do not use)")
    step, loop = exp.train_step, exp.loop
    if (step is None) == (loop is None):
        key, value = ("experiment.train_step", step) if step is not None else ("experiment.loop", loop)
        raise _err(key, value, "exactly one of experiment.train_step (fn(model, batch) -> loss) and experiment.loop "
                   "(fn(cfg), your own loop) set; the other null")
    for key, value in (("experiment.train_step", step), ("experiment.loop", loop)):
        if value is not None and (not isinstance(value, str) or "." not in value):
            raise _err(key, value, "a dotted path module.function")
    amp = getattr(exp, "amp", None)
    if amp is not None and amp not in AMP_MODES:
        raise _err("experiment.amp", amp, f"one of {', '.join(AMP_MODES)}, or null (float32)")
    if amp is not None and loop is not None:
        raise _err("experiment.amp", amp, "null with experiment.loop (a cooperative loop runs its own autocast)")
    return []


AMP_MODES = ("fp16", "bf16")
"""``experiment.amp``'s values (flodl_exp/experiment.AMP_DTYPES maps them to torch dtypes)."""


def _mode_kind_rules(cfg: Any) -> List[str]:
    """mode.policy and mode.backend, and the pair that does not exist (nccl_async)."""
    m = cfg.mode
    if m.policy not in policy_names():
        raise _err("mode.policy", m.policy, f"one of {', '.join(policy_names())}")
    if m.backend not in {b.value for b in Backend}:
        raise _err("mode.backend", m.backend, f"one of {', '.join(b.value for b in Backend)}")
    if m.auto and cfg.experiment.loop is not None:
        raise _err("mode.auto", m.auto, "false with experiment.loop (a cooperative loop has no step the framework "
                                        "can time before the first chunk: choose the mode)")
    mode = Mode.parse(m.policy, m.backend)
    why = mode.unavailable
    if why is not None:
        via = "" if m.name == mode.name else f", reached from mode={m.name} and overrides"
        raise ConfigError(f"config error: mode={mode.name} (policy={m.policy} with backend={m.backend}{via}) "
                          f"does not exist: {why}")
    return []


def _user_class_rules(group: str, node: Any, protocol: str) -> Optional[str]:
    """``<group>._target_`` (a class of the user's implementing ``protocol``) and ``<group>.args``: the path is a
    dotted one, and args come only with it. Returns the target (None: the built-in)."""
    target = getattr(node, "_target_", None)
    if target is not None and (not isinstance(target, str) or "." not in target.strip(".")):
        raise _err(f"{group}._target_", target, f"the dotted path of a class (module.Class) implementing {protocol}, or null")
    if getattr(node, "args", None) and not target:
        raise _err(f"{group}.args", dict(node.args), f"keyword arguments for {group}._target_'s class: set {group}._target_ too")
    return target


def _outer_rules(cfg: Any) -> List[str]:
    o = cfg.outer
    target = _user_class_rules("outer", o, "flodl_exp.outer.UserOuterProtocol")
    if target and (o.kind != "avg" or o.lr is not None or o.mu is not None):
        raise _err("outer._target_", target, "alone: outer.kind, outer.lr and outer.mu belong to the built-in outer "
                                              "optimizers (leave them unset; give your class its knobs in outer.args)")
    if o.kind not in OUTERS:
        raise _err("outer.kind", o.kind, f"one of {', '.join(OUTERS)}")
    if o.lr is not None and not (math.isfinite(o.lr) and o.lr > 0):
        raise _err("outer.lr", o.lr, "a finite number > 0")
    if o.mu is not None and not (math.isfinite(o.mu) and 0 <= o.mu < 1):
        raise _err("outer.mu", o.mu, "a number in [0, 1)")
    if o.kind == "avg" and (o.lr is not None or o.mu is not None):
        raise _err("outer.kind", o.kind, "slowmo or diloco when outer.lr / outer.mu are set (avg has no knobs)")
    return []


def _cluster_rules(cfg: Any) -> List[str]:
    """The cluster's kind and shape (what the world size is computed from) and its collective."""
    c = cfg.cluster
    if c.executor not in EXECUTORS:
        raise _err("cluster.executor", c.executor, f"one of {', '.join(EXECUTORS)}")
    if c.device not in DEVICES:
        raise _err("cluster.device", c.device, f"one of {', '.join(DEVICES)}")
    if c.collective not in COLLECTIVES:
        raise _err("cluster.collective", c.collective, f"one of {', '.join(COLLECTIVES)}")
    if c.loop_error not in LOOP_ERRORS:
        raise _err("cluster.loop_error", c.loop_error, f"one of {', '.join(LOOP_ERRORS)}")
    if not (math.isfinite(c.collective_timeout_s) and c.collective_timeout_s >= 1):
        raise _err("cluster.collective_timeout_s", c.collective_timeout_s, "a number of seconds >= 1")
    if not (math.isfinite(c.progress_timeout_s) and c.progress_timeout_s >= 0):
        raise _err("cluster.progress_timeout_s", c.progress_timeout_s, "a number of seconds >= 0 (0 = off)")
    if c.executor == "local" and c.nodes != 1:
        raise _err("cluster.nodes", c.nodes, "1 with executor=local (use cluster=slurm for several nodes)")
    if c.nodes < 1:
        raise _err("cluster.nodes", c.nodes, "an integer >= 1")
    if c.ranks_per_node < 1:
        raise _err("cluster.ranks_per_node", c.ranks_per_node, "an integer >= 1")
    cpus = c.slurm.cpus_per_task
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1):
        raise _err("cluster.slurm.cpus_per_task", cpus, f"an integer >= 1, or null ({GPU_TASK_CPUS} with GPUs, else 1)")
    if c.executor == "slurm" and c.device != "cpu":
        gpus = int(c.slurm.gpus_per_node)
        if cfg.mode.backend == "nccl" and c.collective != "gloo" and 0 < gpus < c.ranks_per_node:
            raise _err("cluster.slurm.gpus_per_node", gpus,
                       f">= cluster.ranks_per_node ({c.ranks_per_node}) with mode.backend=nccl (NCCL needs one GPU "
                       "per rank; or share GPUs through cluster.collective=gloo)")
    return []


def _anchor_rules(cfg: Any) -> List[str]:
    """ElChe's knobs: the anchor and its bounds, the batch-difference and overshoot caps, the overhead target."""
    m, warnings = cfg.mode, []
    if m.anchor < 1:
        raise _err("mode.anchor", m.anchor, "an integer >= 1")
    if m.max_anchor < 1:
        raise _err("mode.max_anchor", m.max_anchor, "an integer >= 1")
    if m.min_anchor is not None and m.min_anchor < 1:
        raise _err("mode.min_anchor", m.min_anchor, "an integer >= 1 or null")
    if m.max_batch_diff is not None and m.max_batch_diff < 0:
        raise _err("mode.max_batch_diff", m.max_batch_diff, "an integer >= 0 or null")
    if m.max_overshoot is not None:
        if m.max_overshoot < 0:
            raise _err("mode.max_overshoot", m.max_overshoot, "an integer >= 0 or null")
        if not Mode.of(cfg).streams:
            warnings.append(f"mode.max_overshoot={m.max_overshoot} has no effect with policy={m.policy} "
                            "(a streaming policy only: async)")
    if not math.isfinite(m.overhead_target):
        raise _err("mode.overhead_target", m.overhead_target, "a finite number (clamped to [0.01, 0.5])")
    if not (0.01 <= m.overhead_target <= 0.5):
        warnings.append(f"mode.overhead_target={m.overhead_target} is clamped to [0.01, 0.5]")
    return warnings


def _split_rules(cfg: Any) -> List[str]:
    """How work is split before measurement: the speed hint and fixed partition ratios."""
    m, w = cfg.mode, world_size(cfg)
    if m.speed_hint_ratio is not None and m.speed_hint_rank is None:
        raise _err("mode.speed_hint_ratio", m.speed_hint_ratio, "only together with mode.speed_hint_rank")
    if m.speed_hint_rank is not None:
        if not (0 <= m.speed_hint_rank < w):
            raise _err("mode.speed_hint_rank", m.speed_hint_rank, f"a rank in [0, {w})")
        if m.speed_hint_ratio is None or not math.isfinite(m.speed_hint_ratio) or m.speed_hint_ratio < 1:
            raise _err("mode.speed_hint_ratio", m.speed_hint_ratio, "a finite number >= 1 when speed_hint_rank is set")
    if m.partition_ratios is None:
        return []
    ratios = list(m.partition_ratios)
    if not ratios:
        raise _err("mode.partition_ratios", ratios, "a non-empty list")
    if any((not math.isfinite(x)) or x <= 0 for x in ratios):
        raise _err("mode.partition_ratios", ratios, "finite entries > 0")
    if abs(sum(ratios) - 1.0) > 0.05:
        raise _err("mode.partition_ratios", ratios, f"entries summing to 1 +/- 0.05 (sum is {sum(ratios):.3f})")
    if len(ratios) != w:
        raise _err("mode.partition_ratios", ratios, f"one entry per rank (world size {w})")
    if is_progressive(cfg):
        raise _err("mode.partition_ratios", ratios, "only without progressive dispatch (policy=sync or mode.progressive_dispatch=false)")
    return []


def _update_rules(cfg: Any) -> List[str]:
    """How the average is applied and trained on: EASGD's alpha, gamma, the bf16 wire, lr scaling, clipping, dispatch."""
    m = cfg.mode
    if m.easgd_alpha is not None:
        if not (0.0 < m.easgd_alpha <= 1.0) or not math.isfinite(m.easgd_alpha):
            raise _err("mode.easgd_alpha", m.easgd_alpha, "a number in (0, 1]")
        if Mode.of(cfg).default_easgd_alpha is None:
            raise _err("mode.easgd_alpha", m.easgd_alpha, "only with mode=cpu_async (sync/cadence fully overwrite)")
    if not math.isfinite(m.gamma):
        raise _err("mode.gamma", m.gamma, "a finite number")
    if m.bf16_wire and m.backend != "cpu":
        raise _err("mode.bf16_wire", m.bf16_wire, "true only with backend=cpu (the nccl collective averages in place)")
    if m.lr_scale_ratio < 0 or not math.isfinite(m.lr_scale_ratio):
        raise _err("mode.lr_scale_ratio", m.lr_scale_ratio, "a finite number >= 0")
    if m.max_grad_norm is not None and not (m.max_grad_norm > 0):
        raise _err("mode.max_grad_norm", m.max_grad_norm, "a number > 0 or null")
    if isinstance(m.lockstep_ahead, bool) or not isinstance(m.lockstep_ahead, int) or not (0 <= m.lockstep_ahead <= 1024):
        raise _err("mode.lockstep_ahead", m.lockstep_ahead, "an integer in [0, 1024] (0: a sync_now per reduce)")
    if not isinstance(m.overlap, bool):
        raise _err("mode.overlap", m.overlap, "true or false")
    if m.overlap and not Mode.of(cfg).overlap_capable:
        raise _err("mode.overlap", m.overlap, "true only with mode=nccl_sync, mode=nccl_cadence, mode=cpu_cadence or "
                   f"mode=cpu_async (false for {Mode.of(cfg).name})")
    if m.overlap and m.lockstep_ahead:
        raise _err("mode.overlap", m.overlap, "false with mode.lockstep_ahead > 0 (a lockstep reduce after every step "
                   "waits for it; overlap paces them instead)")
    if m.progressive_dispatch is False and Mode.of(cfg).policy.requires_progressive:
        raise _err("mode.progressive_dispatch", False, f"true or null with policy={m.policy} (it streams chunks)")
    return []


def _guard_rules(cfg: Any) -> List[str]:
    g = cfg.guard
    _user_class_rules("guard", g, "flodl_exp.policy.guards.Guard")
    if g.kind not in GUARDS:
        raise _err("guard.kind", g.kind, f"one of {', '.join(GUARDS)}")
    if g.threshold is not None and not (g.threshold > 0 and math.isfinite(g.threshold)):
        raise _err("guard.threshold", g.threshold, "a finite number > 0 or null")
    if not (0 < g.msf_alpha < 1):
        raise _err("guard.msf_alpha", g.msf_alpha, "a number in (0, 1)")
    if not (0 < g.nudge_factor < 1):
        raise _err("guard.nudge_factor", g.nudge_factor, "a number in (0, 1)")
    return []


def _cluster_health_rules(cfg: Any) -> List[str]:
    """The simulated rig's speeds, and the timeouts and failure budget that decide when a rank is lost."""
    c, w = cfg.cluster, world_size(cfg)
    if c.rank_speeds is not None:
        speeds = list(c.rank_speeds)
        if len(speeds) != w:
            raise _err("cluster.rank_speeds", speeds, f"one factor per rank (world size {w})")
        if any((not math.isfinite(s)) or not (0 < s <= 1) for s in speeds):
            raise _err("cluster.rank_speeds", speeds, "factors in (0, 1]")
    if not _finite_positive(c.heartbeat_timeout_s):
        raise _err("cluster.heartbeat_timeout_s", c.heartbeat_timeout_s, "a number > 0")
    if not _finite_positive(c.stall_dump_s):
        raise _err("cluster.stall_dump_s", c.stall_dump_s, "a number of seconds > 0 (15 = the reference's debug interval)")
    if not _finite_positive(c.rendezvous_timeout_s):
        raise _err("cluster.rendezvous_timeout_s", c.rendezvous_timeout_s, "a number > 0")
    if not (math.isfinite(c.report_coalesce_ms) and 0 <= c.report_coalesce_ms <= 1000):
        raise _err("cluster.report_coalesce_ms", c.report_coalesce_ms, "milliseconds in [0, 1000] (0: every report at once)")
    if c.max_failure is not None and c.max_failure < 1:
        raise _err("cluster.max_failure", c.max_failure, "an integer >= 1 or null")
    if c.max_failure_pct is not None and not (math.isfinite(c.max_failure_pct) and 0 < c.max_failure_pct <= 1):
        raise _err("cluster.max_failure_pct", c.max_failure_pct, "a share of the world in (0, 1] or null")
    return []


def _experiment_rules(cfg: Any) -> List[str]:
    e = cfg.experiment
    if e.batch_size < 1:
        raise _err("experiment.batch_size", e.batch_size, "an integer >= 1")
    if e.epochs < 1:
        raise _err("experiment.epochs", e.epochs, "an integer >= 1")
    return []


def _eval_rules(cfg: Any) -> List[str]:
    w = world_size(cfg)
    try:
        cb = parse_callback_rank(cfg.eval.callback_rank)
    except ValueError:
        raise _err("eval.callback_rank", cfg.eval.callback_rank, "'fastest' or a rank index") from None
    if cb is not None and not (0 <= cb < w):
        raise _err("eval.callback_rank", cb, f"'fastest' or a rank in [0, {w})")
    if cfg.eval.every < 0:
        raise _err("eval.every", cfg.eval.every, "an integer >= 0 (0 = only at the end)")
    return []


def _checkpoint_rules(cfg: Any) -> List[str]:
    ck, epochs = cfg.checkpoint, cfg.experiment.epochs
    if ck.every < 0:
        raise _err("checkpoint.every", ck.every, "an integer >= 0")
    if ck.at_epoch is not None:
        if not (0 <= ck.at_epoch < epochs):
            raise _err("checkpoint.at_epoch", ck.at_epoch, f"an epoch in [0, {epochs})")
        if not is_progressive(cfg):
            raise _err("checkpoint.at_epoch", ck.at_epoch, "only with progressive dispatch (cadence/async modes)")
    return []


def _records_rules(cfg: Any) -> List[str]:
    """What a run records and shows: window reports, user scalars, the record log, the dashboard, progress."""
    if cfg.reports_per_epoch < 0:
        raise _err("reports_per_epoch", cfg.reports_per_epoch, "an integer >= 0 (0 = off)")
    for name, red in dict(cfg.scalar_reductions).items():
        if red not in REDUCTIONS:
            raise _err(f"scalar_reductions.{name}", red, f"one of {', '.join(REDUCTIONS)}")
        if name in CORE_KEYS:
            raise _err(f"scalar_reductions.{name}", red, f"a user scalar (core keys {', '.join(CORE_KEYS)} have fixed reductions)")
    if cfg.record_log.max_bytes < 1024:
        raise _err("record_log.max_bytes", cfg.record_log.max_bytes, "an integer >= 1024")
    if cfg.dashboard.theme not in ("light", "dark", "auto"):
        raise _err("dashboard.theme", cfg.dashboard.theme, "one of light, dark, auto")
    if cfg.run.progress not in ("auto", "bar", "plain", "off"):
        raise _err("run.progress", cfg.run.progress, "one of auto, bar, plain, off")
    if not _finite_positive(cfg.tracking.relay_stale_s):
        raise _err("tracking.relay_stale_s", cfg.tracking.relay_stale_s, "a number of seconds > 0")
    if cfg.run.timeout_min < 1:
        raise _err("run.timeout_min", cfg.run.timeout_min, "an integer >= 1")
    return []


def _data_plane_rules(cfg: Any) -> List[str]:
    dp, warnings = cfg.data_plane, []
    for key, v in (("ram_max_usage", dp.ram_max_usage), ("vram_max_usage", dp.vram_max_usage)):
        if not math.isfinite(v):
            raise _err(f"data_plane.{key}", v, "a finite fraction")
    if not (0.0 <= dp.ram_max_usage <= 0.9):
        warnings.append(f"data_plane.ram_max_usage={dp.ram_max_usage} is clamped to [0, 0.9]")
    if not (0.5 <= dp.vram_max_usage <= 0.99):
        warnings.append(f"data_plane.vram_max_usage={dp.vram_max_usage} is clamped to [0.5, 0.99]")
    if dp.augment < 1:
        raise _err("data_plane.augment", dp.augment, "an integer >= 1")
    if not (math.isfinite(dp.disk_stage_gb) and dp.disk_stage_gb >= 0):
        raise _err("data_plane.disk_stage_gb", dp.disk_stage_gb, "a number >= 0")
    return warnings


def _multinode_rules(cfg: Any) -> List[str]:
    """What several nodes need shared: the checkpoint paths (a warning) and the MLflow store (an error)."""
    c, warnings = cfg.cluster, []
    if c.nodes > 1 and (cfg.checkpoint.save_path or cfg.checkpoint.resume_from):
        paths = {p for p in (cfg.checkpoint.save_path, cfg.checkpoint.resume_from) if p}
        warnings.append("checkpoint paths " + " and ".join(sorted(paths)) + " must be on storage every node shares: "
                        "bundle pieces are written on their ranks' hosts and the meta is read on the coordinator's")
    if c.executor == "slurm" and c.nodes > 1 and not cfg.tracking.uri and not os.environ.get("FLODL_SHARED_OUTPUTS"):
        raise _err("tracking.uri", None, "with cluster.nodes > 1, an MLflow store every node reaches: "
                   "sqlite:////<shared path>/mlflow.db or a server URI (or export FLODL_SHARED_OUTPUTS=1 "
                   "when ./outputs is on shared storage)")
    return warnings


def _sweep_rules(cfg: Any) -> List[str]:
    """What an Optuna study optimizes (read only in a study, checked in every run: a typo waits for no sweep)."""
    s = cfg.sweep
    if s.direction not in DIRECTIONS:
        raise _err("sweep.direction", s.direction, f"one of {', '.join(DIRECTIONS)}")
    if not isinstance(s.objective, str) or not s.objective.strip():
        raise _err("sweep.objective", s.objective, "the name of a metric the run logs (eval/accuracy, eval/loss, loss, ...)")
    return []


_RULES: tuple[Callable[[Any], List[str]], ...] = (
    _schema_rules, _loop_rules, _mode_kind_rules, _outer_rules, _cluster_rules, _anchor_rules, _split_rules,
    _update_rules, _guard_rules, _cluster_health_rules, _experiment_rules, _eval_rules, _checkpoint_rules,
    _records_rules, _data_plane_rules, _multinode_rules, _sweep_rules,
)


def validate(cfg: Any) -> List[str]:
    """The one validation pass. Raises ConfigError on the first user error; returns warnings."""
    warnings: List[str] = []
    for rule in _RULES:
        warnings += rule(cfg)
    return warnings
