"""Every config default that differs from flodl 0.7.0's has a row in docs/reference/differences.md.

The comparison is with the *composed* default config (``compose([])``, as ``python -m flodl_exp`` with nothing on
the command line: conf/config.yaml with its default groups mode=nccl_cadence, guard=trend, outer=avg,
data_plane=default, cluster=local), not with the bare dataclass defaults: the reference's defaults are what a
user of ``Trainer::builder(...)`` gets when they set nothing, and flodl_exp's are what a user of the CLI gets
when they set nothing, presets included. The ``experiment`` group is left out (but for its two required keys,
in ``NOT_COMPARABLE``): it is the workload, the reference user's own factories and callbacks, not a framework default.

``REFERENCE_DEFAULTS`` maps a flodl_exp key (dotted, as in flodl_exp/config.py) to the reference's default and
where it comes from in the seeds (``002`` = 002_*.txt, ``DdpRunConfig::new()`` near line 680; ``004`` =
002's builder, 004_*.txt; ``003`` = the coordinator loop). A reference ``None`` that stands for a computed default
is recorded as the value it resolves to, where the seeds (or algorithms.md's reading of the reference) show it;
an "off" ``None`` is recorded as flodl_exp's "off" value (0 or None). Where flodl_exp's own ``None`` resolves to
something else than "off", ``ours_none_means`` says what, so a like-looking ``None`` is not taken for agreement.
``NOT_COMPARABLE`` lists the keys with a counterpart but no comparable reference value, with the reason;
``NO_COUNTERPART`` the reference settings flodl_exp has no key for, which need a row of their own.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from omegaconf import OmegaConf

from conftest import ROOT, compose

DIFFERENCES = ROOT / "docs" / "reference" / "differences.md"

_UNSET: Any = object()


@dataclass(frozen=True)
class Ref:
    value: Any
    """The reference's default, resolved as flodl_exp would spell it."""
    where: str
    """Where in the seeds (or algorithms.md, when the seeds only name it) the value comes from."""
    ours_none_means: Any = _UNSET
    """What flodl_exp's own ``None`` for this key resolves to, when that is not "off"/"auto" as the reference's."""


REFERENCE_DEFAULTS: dict[str, Ref] = {
    # -- the mode (policy x backend) and ElChe's tuning ---------------------------------------------------------
    "mode.policy": Ref("cadence", "004 DdpHandle::new_builder: policy ApplyPolicy::Cadence"),
    "mode.backend": Ref("nccl", "004 DdpHandle::new_builder: backend AverageBackend::Nccl"),
    "mode.name": Ref("nccl_cadence", "004 new_builder (Cadence, Nccl); ElCheMode::from_parts in finalize_and_extract"),
    "mode.anchor": Ref(10, "ElCheConfig::default() (not in the seeds; algorithms.md 1.1, 2.1: preset anchor 10)"),
    "mode.min_anchor": Ref(None, "ElCheConfig min_anchor None = the initial anchor (002 with_min_anchor; "
                                 "algorithms.md 2.1)"),
    "mode.max_anchor": Ref(1000, "ElCheConfig max_anchor None -> 1000 (algorithms.md 2.1)"),
    "mode.overhead_target": Ref(0.05, "ElCheConfig overhead_target None -> 0.05 (algorithms.md 2.1)"),
    "mode.max_batch_diff": Ref(None, "ElCheConfig max_batch_diff None = no throttle (002 with_max_batch_diff)"),
    "mode.max_overshoot": Ref(None, "ElCheConfig max_overshoot None = auto (002 with_max_overshoot 'Default: "
                                    "auto-tuned'; algorithms.md 1.1: 3 up to 15)"),
    "mode.relax_up": Ref(False, "002 with_elche_relax_up 'Default: false (off)'"),
    "mode.easgd_alpha": Ref(None, "002 with_easgd_alpha '`None` (default) is full overwrite'; cpu_async's 0.5 is "
                                  "filled by ElCheConfig::default_for (004 finalize_and_extract), as flodl_exp's "
                                  "RunShape does"),
    "mode.gamma": Ref(1.0, "002 WorkerConfig.gamma '1.0 (default)'; 004 DdpBuilder::gamma"),
    "mode.bf16_wire": Ref(False, "004 DdpBuilder::bf16_wire: opt-in (WorkerConfig.bf16_wire, 002)"),
    "mode.progressive_dispatch": Ref(None, "002 DdpRunConfig::new: None (auto: on for Cadence/Async, off for Sync)"),
    "mode.lr_scale_ratio": Ref(1.0, "002 DdpRunConfig::new: lr_scale_ratio 1.0"),
    "mode.max_grad_norm": Ref(None, "002 DdpRunConfig::new: max_grad_norm None"),
    "mode.partition_ratios": Ref(None, "ElCheConfig partition_ratios None (002 with_partition_ratios)"),
    "mode.meta_controller": Ref(True, "002 with_meta_controller 'On by default' (004's setter doc says off; "
                                      "002's field doc and algorithms.md 6.6 say on)"),
    "mode.speed_hint_rank": Ref(None, "no speed hint unless set (004 partition_ratios doc: 'see speed_hint')"),
    "mode.lockstep_ahead": Ref(0, "the reference sends a SyncNow per reduce (003 should_average); 0 = that"),
    "mode.auto": Ref(False, "the reference has no measured mode choice: the mode is what the builder says"),
    # -- the convergence guard ------------------------------------------------------------------------------------
    "guard.kind": Ref("trend", "004 convergence_guard: 'TrendGuard (production default)'"),
    "guard.threshold": Ref(None, "ElCheConfig divergence_threshold None -> 0.05, or 0.3 with easgd_alpha "
                                 "(algorithms.md 6.4); flodl_exp's None resolves by the same rule"),
    "guard.msf_alpha": Ref(0.9, "MsfGuard::default() (algorithms.md 6.3)"),
    "guard.suppress_threshold": Ref(1e-3, "MsfGuard::default(); 004 convergence_guard example with_suppress(1e-3, 3)"),
    "guard.suppress_sustain": Ref(3, "MsfGuard::default(); 004 convergence_guard example"),
    "guard.nudge_threshold": Ref(1e-2, "MsfGuard::default(); 004 convergence_guard example with_nudge(1e-2, 3, 0.5)"),
    "guard.nudge_sustain": Ref(3, "MsfGuard::default(); 004 convergence_guard example"),
    "guard.nudge_factor": Ref(0.5, "MsfGuard::default(); 004 convergence_guard example"),
    "guard.nudge": Ref(True, "MsfGuard nudges unless told not to (algorithms.md 6.3)"),
    "outer.kind": Ref("avg", "004 outer_optimizer: absent = OuterAvg, today's averaging"),
    # -- the data plane ---------------------------------------------------------------------------------------------
    "data_plane.vram_max_usage": Ref(0.90, "002 DdpRunConfig::new: vram_max_usage 0.90"),
    "data_plane.ram_max_usage": Ref(0.50, "002 DdpRunConfig::new: ram_max_usage 0.50"),
    "data_plane.sample_cache": Ref(True, "002 DdpRunConfig::new: sample_cache true"),
    "data_plane.disk_stage_gb": Ref(0, "002 DdpRunConfig::new: disk_stage_gb 0 (off)"),
    "data_plane.disk_stage_dir": Ref(None, "002 DdpRunConfig::new: disk_stage_dir None (system temp dir)"),
    "data_plane.vram_pool": Ref(True, "002 DdpRunConfig::new: VRAM_POOL_DEFAULT, field doc 'Default: `true`'"),
    "data_plane.augment": Ref(1, "002 DdpRunConfig::new: augment 1"),
    "data_plane.stage_advisories": Ref(True, "the coordinator always sends StageAdvisory (algorithms.md 5.10)"),
    # -- the cluster, liveness and faults -------------------------------------------------------------------------
    "cluster.heartbeat_timeout_s": Ref(30.0, "002 heartbeat_timeout_secs None -> the controller's built-in 30 s; "
                                             "DEFAULT_COORD_LIVENESS_TIMEOUT_SECS = 30 (002 ~line 1590)"),
    "cluster.progress_timeout_s": Ref(0.0, "no progress eviction in the reference (liveness is the heartbeat, 003 "
                                           "process_timing_msg); 0 = flodl_exp's watch off"),
    "cluster.stall_dump_s": Ref(120.0, "003 maybe_dump_stall: STALL_DUMP_PROD_SECS (120 s, algorithms.md 3.1)"),
    "cluster.report_coalesce_ms": Ref(0.0, "every timing message goes when the batch ends (003 process_timing_msg "
                                           "reads one per batch); 0 = every report at once"),
    "cluster.max_failure": Ref(None, "002 DdpRunConfig::new: max_failure None (backend floors only)"),
    "cluster.max_failure_pct": Ref(None, "002 max_failure None (MaxFailureThreshold unset)"),
    "cluster.loop_error": Ref("lose_rank", "the cooperative loop's error is a lost rank (config.py loop_error)"),
    # -- callbacks, eval, checkpoints, resume ---------------------------------------------------------------------
    "eval.every": Ref(0, "002 DdpRunConfig::new: eval_every_epochs None = never"),
    "eval.callback_rank": Ref("fastest", "002 DdpRunConfig::new: EpochCallbackPolicy::default() = Fastest"),
    "checkpoint.every": Ref(0, "002 DdpRunConfig::new: checkpoint_every None = no periodic checkpoint"),
    "checkpoint.at_epoch": Ref(None, "002 DdpRunConfig::new: checkpoint_at_epoch None"),
    "checkpoint.save_path": Ref(None, "002 DdpRunConfig::new: save_path None = no bundle written",
                                ours_none_means="<job dir>/checkpoints/final"),
    "checkpoint.resume_from": Ref(None, "002 DdpRunConfig::new: resume_from None = a fresh run"),
    "hooks.metrics_fn": Ref(None, "004 new_builder: metrics_fn None"),
    "hooks.eval_result_fn": Ref(None, "004 new_builder: eval_result_fn None"),
    # -- records and reporting ------------------------------------------------------------------------------------
    "seed": Ref(42, "002 SHUFFLE_BASE_SEED = 42 (~line 1460)"),
    "reports_per_epoch": Ref(0, "002 DdpRunConfig::new: reports_per_epoch None = off"),
    "scalar_reductions": Ref({}, "002 DdpRunConfig::new: Reductions::new() (every user scalar Mean)"),
    "record_log.dir": Ref(None, "002 DdpRunConfig::new: record_log_dir None = live-only"),
    "dashboard.html": Ref(None, "002 DdpRunConfig::new: dashboard_html None = live-only"),
    "dashboard.theme": Ref("auto", "002 dashboard_theme None = the reader's prefers-color-scheme, which is auto"),
}

NOT_COMPARABLE: dict[str, str] = {
    "record_log.max_bytes": "002 max_log_size None -> DEFAULT_MAX_LOG_BYTES, whose value the seeds do not show "
                            "(algorithms.md 13: open point, flodl_exp chose 4 MiB)",
    "experiment.batch_size": "required in the reference (004 finalize_and_extract panics without it)",
    "experiment.epochs": "required in the reference (004: num_epochs is required)",
    "cluster.collective_timeout_s": "the reference's NCCL abort handles have no such setting in the seeds",
}

NO_COUNTERPART: dict[str, str] = {
    "snapshot_timeout_secs": "002 DdpRunConfig::new: 5 (cpu averaging snapshot collection timeout)",
}


def config_value(cfg: Any, key: str) -> Any:
    """The composed config's value at ``key`` (containers as plain Python)."""
    v = OmegaConf.select(cfg, key, throw_on_missing=True)
    return OmegaConf.to_container(v) if OmegaConf.is_config(v) else v


def same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)))
    return bool(a == b)


def differing(ours: Mapping[str, Any], refs: Mapping[str, Ref]) -> dict[str, tuple[Any, Any]]:
    """key -> (reference, flodl_exp) for every key whose defaults differ."""
    out: dict[str, tuple[Any, Any]] = {}
    for key, ref in refs.items():
        mine = ours[key]
        if mine is None and ref.ours_none_means is not _UNSET:
            mine = ref.ours_none_means
        if not same(ref.value, mine):
            out[key] = (ref.value, mine)
    return out


def documented_keys(markdown: str) -> set[str]:
    """Every backticked name in the first column of the table's rows."""
    keys: set[str] = set()
    for line in markdown.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        first = line.split("|")[1]
        keys.update(re.findall(r"`([^`]+)`", first))
    return keys


def undocumented(ours: Mapping[str, Any], refs: Mapping[str, Ref], markdown: str) -> list[str]:
    """The differing keys without a row naming them (in backticks, in the first column)."""
    rows = documented_keys(markdown)
    return sorted(k for k in differing(ours, refs) if k not in rows)


def composed_defaults() -> dict[str, Any]:
    cfg = compose([])
    keys = [*REFERENCE_DEFAULTS, *NOT_COMPARABLE]
    return {k: config_value(cfg, k) for k in keys}


def test_every_differing_default_has_a_row_in_differences_md() -> None:
    ours = composed_defaults()
    markdown = DIFFERENCES.read_text()
    missing = undocumented(ours, REFERENCE_DEFAULTS, markdown)
    assert not missing, "defaults that differ from flodl 0.7.0 without a row in differences.md: " + ", ".join(
        f"{k} (reference {REFERENCE_DEFAULTS[k].value!r}, flodl_exp {differing(ours, REFERENCE_DEFAULTS)[k][1]!r})"
        for k in missing)
    rows = documented_keys(markdown)
    assert not [k for k in NO_COUNTERPART if k not in rows], "reference settings without a key or a row"


def test_the_table_covers_keys_the_config_has() -> None:
    cfg = compose([])
    for key in [*REFERENCE_DEFAULTS, *NOT_COMPARABLE]:
        assert OmegaConf.select(cfg, key, default=_UNSET) is not _UNSET, key
    assert len(REFERENCE_DEFAULTS) >= 25


def test_a_differing_default_without_a_row_is_reported() -> None:
    refs = {"eval.every": Ref(0, "fake"), "fake.knob": Ref(5, "fake"), "fake.same": Ref(1.0, "fake"),
            "fake.path": Ref(None, "fake", ours_none_means="somewhere")}
    ours = {"eval.every": 1, "fake.knob": 7, "fake.same": 1, "fake.path": None}
    markdown = "| what | a | b | c |\n|---|---|---|---|\n| `eval.every` default | 0 | 1 | why |\n| x | `fake.knob` | | |\n"
    assert differing(ours, refs) == {"eval.every": (0, 1), "fake.knob": (5, 7), "fake.path": (None, "somewhere")}
    # eval.every has its row; fake.knob is only mentioned outside the first column; fake.path has none
    assert undocumented(ours, refs, markdown) == ["fake.knob", "fake.path"]


def test_the_real_differences_md_parses() -> None:
    rows = documented_keys(Path(DIFFERENCES).read_text())
    assert "mode.max_batch_diff" in rows  # an existing row's key, read from the first column
