"""Structured configs (one typed dataclass per component) and the run's shape derived from them.

YAML files under ``conf/`` are presets merged onto these schemas, so every key
is typed and an unknown key is refused by Hydra/OmegaConf. Cross-field rules
of the reference builder (algorithms.md 11.3) live in :mod:`flodl_exp.config_rules`
(``validate``), which runs once before any process starts and raises :class:`ConfigError`
with one line naming the key, the bad value and what is allowed. This module reads no
environment and no file: the control core imports it.
"""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, cast

from omegaconf import MISSING

from flodl_exp.policy.mode import Mode

GUARDS = ("none", "trend", "msf")
EXECUTORS = ("local", "slurm")
REDUCTIONS = ("mean", "sum", "max", "min")
CORE_KEYS = ("loss", "throughput", "batch_share", "data_starve", "compute_only_ms")
DEVICES = ("auto", "cpu", "cuda")
COLLECTIVES = ("auto", "nccl", "gloo")
LOOP_ERRORS = ("lose_rank", "fail")
OUTERS = ("avg", "slowmo", "diloco")
DIRECTIONS = ("maximize", "minimize")
OUTER_DEFAULTS = {"avg": (1.0, 0.0), "slowmo": (1.0, 0.9), "diloco": (0.7, 0.9)}
"""outer.kind -> (lr, mu) when the config leaves them unset."""


@dataclass
class ModeConfig:
    """When replicas are averaged (policy) and how (backend), plus ElChe tuning."""

    name: str = "nccl_cadence"
    """The preset's name (conf/mode/<name>.yaml). Informational: what runs is ``backend`` and ``policy``, and the
    run's ``mode`` tag and default run name read ``<backend>_<policy>`` whatever this says."""
    policy: str = "cadence"
    """sync | cadence | async. Sync averages as soon as every rank stepped once;
    cadence after each rank ran its ElChe batch count; async adds lookahead."""
    backend: str = "nccl"
    """nccl: weighted all_reduce over torch.distributed (NCCL on GPUs, Gloo on CPU);
    cpu: snapshots averaged by the coordinator."""
    anchor: int = 10
    """Slow rank's batches per averaging window (ElChe's starting point)."""
    min_anchor: Optional[int] = None
    """Floor for anchor growth (default: the initial anchor)."""
    max_anchor: int = 1000
    """Ceiling on the anchor (ElChe's growth and the async relax stop there), batches; an integer >= 1.
    A min_anchor above it is lowered to it."""
    overhead_target: float = 0.05
    """Fraction of a window that per-window fixed cost (sync) may take; clamped to [0.01, 0.5]."""
    max_batch_diff: Optional[int] = None
    """Cap on per-update count change; on the cpu backend also throttles fast ranks."""
    max_overshoot: Optional[int] = None
    """Async lookahead in batches past a window; unset = auto (3, growing to 15)."""
    relax_up: bool = False
    """Async only: let a Stable verdict relax the anchor up by one."""
    speed_hint_rank: Optional[int] = None
    """Known slow rank (cold-start anchor) ..."""
    speed_hint_ratio: Optional[float] = None
    """... and how many times slower it is than the others."""
    easgd_alpha: Optional[float] = None
    """EASGD blend (1-a) W_local + a W_avg; cpu_async only (default 0.5 there)."""
    gamma: float = 1.0
    """Work weighting exponent: rank weight = steps^gamma (idle ranks weigh 0)."""
    bf16_wire: bool = False
    """Ship cpu-backend snapshots as bfloat16 (half the bytes); cpu backend only."""
    progressive_dispatch: Optional[bool] = None
    """Stream epochs in chunks; unset = on for cadence/async, off for sync."""
    lockstep_ahead: int = 0
    """nccl_sync: how many reduces the ranks may run ahead of the coordinator (0: off, a ``sync_now`` per reduce as
    in the reference). With 8, say, each rank all-reduces after every step on its own, with no round trip to the
    coordinator, and reports as it goes; the coordinator books each reduce's answers, extends the license while
    nothing needs the cohort held, and lets it run out (at most this many steps) before a bundle, a preemption or
    an epoch's end. Every step is averaged (the paced sync averages every ~2 steps: a rank trains on while the
    sync_now travels), so on the 2-core CPU rig it is the slower of the two (docs/reference/measurements.md, "nccl_sync
    in lockstep"); it is for a fast all_reduce next to a slow round trip (NCCL on GPUs). Ignored by other modes."""
    overlap: bool = False
    """Overlapped averaging (nccl_cadence, cpu_cadence, cpu_async): at a reduce a rank sends its snapshot (cpu) or
    launches its all-reduce (nccl) and trains on at once (its next window's chunk comes with the request), and when
    the consensus lands it applies the correction ``W <- W + (W_avg - W_sent)`` (EASGD's alpha scales it): no rank
    waits for a reduce, and nothing it trained meanwhile is overwritten. At most one reduce in flight; consensus
    reduces (a bundle's, the end of training) still wait. docs/concepts/modes.md, "Overlapped averaging"."""
    lr_scale_ratio: float = 1.0
    """Linear LR scaling: lr x (1 + (W - 1) x ratio); 0 turns it off."""
    max_grad_norm: Optional[float] = None
    """Global-L2 gradient clip before each optimizer step."""
    partition_ratios: Optional[List[float]] = None
    """Fixed per-rank data shares (non-progressive runs only); must sum to ~1."""
    meta_controller: bool = True
    """LR-aware meta-controller that nudges the anchor down on LR cliffs."""
    auto: bool = False
    """``mode=auto``: before the first chunk every rank times a few training steps (nothing is kept), the
    simulator predicts every mode the cohort can run on that measured rig, and the run trains in the best
    (``policy``/``backend`` are the fallback and are kept unless another mode is predicted 2% faster). The
    choice, every prediction and the reason are tagged (``auto.*``), an event and a summary line. Managed tier
    only (a cooperative loop has no step the framework can time); a resumed run trains on in the mode its bundle
    was saved in."""


@dataclass
class GuardConfig:
    """Convergence guard watching replica drift after each reduce."""

    kind: str = "trend"
    """none | trend | msf."""
    _target_: Optional[str] = None
    """A guard of your own instead of ``kind``: the dotted path of a class implementing the Guard protocol
    (flodl_exp.policy.guards.Guard: ``report(report, k_used, k_max) -> ConvergenceAction``), built with ``args``;
    e.g. ``guard._target_=flodl_exp.zoo.guards.PatienceGuard``. Records name the guard by this path."""
    args: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``_target_``'s class (``+guard.args.patience=4``)."""
    threshold: Optional[float] = None
    """TrendGuard threshold; unset = 0.05, or 0.3 when easgd_alpha is set."""
    msf_alpha: float = 0.9
    """guard.kind=msf only: EMA factor of the growth-rate estimate, ``ema = a x ema + (1 - a) x lam`` with
    ``lam = ln(D_t / D_t-1) / k_max`` (bias-corrected); closer to 1 = smoother and slower. A number in (0, 1)."""
    suppress_threshold: float = 1e-3
    """guard.kind=msf only: the smoothed growth rate of the drift D (per step: ln of D over the previous reduce's D,
    divided by the most steps a rank took in the window) above which a reduce counts toward SuppressGrowth (hold
    the anchor)."""
    suppress_sustain: int = 3
    """guard.kind=msf only: consecutive reduces above suppress_threshold before SuppressGrowth fires (its streak then
    restarts); an integer >= 1."""
    nudge_threshold: float = 1e-2
    """guard.kind=msf only: the smoothed rate (as suppress_threshold) above which a reduce counts toward NudgeDown."""
    nudge_sustain: int = 3
    """guard.kind=msf only: consecutive reduces above nudge_threshold before NudgeDown fires (it wins over a
    SuppressGrowth due at the same reduce; its streak then restarts); an integer >= 1."""
    nudge_factor: float = 0.5
    """guard.kind=msf only: NudgeDown's factor on the anchor, ``anchor = ceil(anchor x f)`` (0.5 halves it; at least
    1, below min_anchor if need be). A number in (0, 1)."""
    nudge: bool = True
    """MsfGuard: false = suppress only, never nudge the anchor down."""


@dataclass
class OuterConfig:
    """Outer optimizer applied to each window's consensus before it is adopted (algorithms.md 11.1)."""

    kind: str = "avg"
    """avg (identity: adopt the consensus) | slowmo (heavy-ball momentum) | diloco (Nesterov momentum,
    inner optimizer state reset after each adoption)."""
    lr: Optional[float] = None
    """Outer learning rate; unset = 1.0 for slowmo, 0.7 for diloco."""
    mu: Optional[float] = None
    """Outer momentum in [0, 1); unset = 0.9."""
    _target_: Optional[str] = None
    """An outer optimizer of your own instead of ``kind``: the dotted path of a class implementing the OuterOptimizer
    protocol (flodl_exp.outer.UserOuterProtocol: ``step(consensus) -> new global``), built with ``args``; e.g.
    ``outer._target_=flodl_exp.zoo.outers.HeavyBall``. It runs where the backend keeps the outer optimizer (the
    coordinator for cpu, every rank for nccl)."""
    args: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``_target_``'s class (``+outer.args.mu=0.5``)."""


@dataclass
class DataPlaneConfig:
    """Per-rank data pipeline budgets (algorithms.md 10)."""

    vram_max_usage: float = 0.90
    """Fraction of total VRAM for prefetch + device pool; clamped to [0.5, 0.99]."""
    ram_max_usage: float = 0.50
    """Fraction of available RAM for staging + sample cache; [0, 0.9]; 0 = no retention."""
    sample_cache: bool = True
    """Retain samples in host RAM across epochs (pinned on CUDA): 3/4 of the rank's RAM share (ram_max_usage) holds
    samples, the rest the ready-batch ring. false: the ring keeps the whole share and the disk stage is off."""
    disk_stage_gb: float = 0.0
    """Local-disk overflow under the sample cache; 0 = off."""
    disk_stage_dir: Optional[str] = None
    """Where the disk stage lives (default: system temp dir)."""
    vram_pool: bool = True
    """Keep samples on the device from leftover VRAM (CUDA; env FLODL_VRAM_POOL=off kills it)."""
    augment: int = 1
    """Each sample appears k times per epoch (pick space = samples x k)."""
    stage_advisories: bool = True
    """Progressive modes: the coordinator tells each rank which picks it is likely to get next (its span, then
    its peers' tails, this epoch and the predicted next one), and the rank retains those samples in its host
    cache while its readers are idle."""


@dataclass
class SlurmConfig:
    partition: Optional[str] = None
    """sbatch ``--partition``; unset = the cluster's default partition."""
    account: Optional[str] = None
    """sbatch ``--account`` charged for the job; unset = your default account."""
    qos: Optional[str] = None
    """sbatch ``--qos``; unset = the default quality of service."""
    time_min: int = 60
    """sbatch ``--time``, minutes. USR2 comes min(90, max(15, time_min x 60 // 4)) s before it runs out: the ranks
    save a bundle, the job requeues and resumes from it (at most 3 time-limit requeues, then FAILED)."""
    mem_gb: Optional[float] = None
    """sbatch ``--mem`` (memory per node), GB; a fraction is passed in MB. Unset = the partition's default."""
    cpus_per_task: Optional[int] = None
    """sbatch ``--cpus-per-task``: CPU cores allotted to each rank's task, an integer >= 1. Unset = 6 when the job
    asks for GPUs (gpus_per_node > 0: a GPU rank runs its main thread, 4 data-reader threads and NCCL's proxy
    thread, and task 0 the coordinator beside them; one core would starve the GPU), else 1 (a CPU rank trains on
    one torch thread; the tasks pack onto small nodes). Raise it with more readers (FLODL_DATA_READERS)."""
    gpus_per_node: int = 0
    """sbatch ``--gpus-per-node``; 0 = the flag is left out (some sites refuse it without GRES). With
    mode.backend=nccl on GPUs, a value from 1 to ranks_per_node - 1 is refused: NCCL needs one GPU per rank
    (or share GPUs through cluster.collective=gloo)."""
    constraint: Optional[str] = None
    """sbatch ``--constraint``: node features the job needs (``a100``, ``a100|h100``); unset = any node."""
    exclude: Optional[str] = None
    """sbatch ``--exclude``: nodes not to run on, a SLURM node list (``node[01-03]``); unset = none."""
    no_kill: bool = True
    """Keep the job and its step running when one of its nodes fails (``--no-kill`` to sbatch and to srun): the
    survivors' fault rules decide (cluster.max_failure, recovery), as the reference's elastic design intends.
    false = SLURM cancels the whole job at the first node failure (and requeues it where the site allows)."""
    srun_args: List[str] = field(default_factory=list)
    """Extra srun options. Empty by default: a dead rank is the fault rules' (cluster.max_failure, recovery), as
    locally; ``[--kill-on-bad-exit=1]`` ends the job at the first failed task (ShutdownWithSave, task_failed)."""
    setup: List[str] = field(default_factory=list)
    """Shell lines the batch script runs before ``srun`` (``module load cuda/12.4``, ``export NCCL_SOCKET_IFNAME=ib0``)."""
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    """Any other sbatch option, name -> value (``_`` becomes ``-``; true = a bare flag), over the ones above:
    ``+cluster.slurm.additional_parameters.signal=USR2@300`` gives ``--signal=USR2@300``."""


GPU_TASK_CPUS = 6
"""``cluster.slurm.cpus_per_task`` when unset on a GPU job: the rank's main thread, the data plane's 4 reader
threads (rank/data/pipeline.DEFAULT_READERS), one for NCCL's proxy and the coordinator in task 0."""


def slurm_cpus_per_task(slurm: Any) -> int:
    """``--cpus-per-task`` for ``cluster.slurm``: its ``cpus_per_task``, or the default (see the field)."""
    if slurm.cpus_per_task is not None:
        return int(slurm.cpus_per_task)
    return GPU_TASK_CPUS if int(slurm.gpus_per_node) > 0 else 1


@dataclass
class ClusterConfig:
    """Where the ranks run and how failures are tolerated."""

    name: str = "local"
    """The preset's name (conf/cluster/<name>.yaml), recorded as the run's ``cluster`` tag; what runs is ``executor``."""
    executor: str = "local"
    """local (submitit LocalExecutor: processes on this machine) | slurm."""
    nodes: int = 1
    """Nodes the job spans (sbatch ``--nodes``); world size = nodes x ranks_per_node. An integer >= 1; 1 with
    executor=local."""
    ranks_per_node: int = 2
    """Rank processes per node (SLURM tasks per node; locally, processes on this machine); an integer >= 1. Co-hosted
    ranks split the node's RAM budget; the NCCL collective needs a GPU per rank."""
    device: str = "auto"
    """auto (cuda:<local_rank> when GPUs exist, else cpu) | cpu | cuda."""
    rank_speeds: Optional[List[float]] = None
    """Simulated heterogeneity: rank r waits (1/s - 1) x step time after each step."""
    heartbeat_timeout_s: float = 30.0
    """Seconds without a heartbeat (sent every 1 s each way) after which the coordinator declares a rank dead and a
    rank gives its coordinator up as lost; > 0. A reduce that waits max(10 x this, 300) s with the cohort alive
    ends the run (ShutdownWithSave, reduce_stall)."""
    collective: str = "auto"
    """The nccl modes' collective: auto (NCCL when every rank has a GPU of its own, else Gloo,
    said once in the log) | nccl (refuse the run otherwise) | gloo."""
    collective_timeout_s: float = 300.0
    """How long one collective may wait for its peers (a slow eval, the first NCCL connection)
    before it raises and the rank waits for a regroup; separate from the heartbeat timeout."""
    progress_timeout_s: float = 600.0
    """A rank whose heartbeat keeps arriving while its main thread takes no training step for this
    long, with a chunk in progress, is declared dead and recovered from like a crash (a hung data
    read, a stuck kernel). 0 turns the watch off. Evals, saves and collectives are not counted."""
    loop_error: str = "lose_rank"
    """The cooperative tier: an exception out of the user's loop is a lost rank (lose_rank: the survivors recover as
    from a crash, as in the reference and the managed tier; a bug every rank hits ends in max_failure's bundle) or
    ends the run at once (fail: ShutdownWithSave, save_reason loop_error, FAILED with the traceback)."""
    stall_dump_s: float = 120.0
    """The stall watchdog's interval: when the global step has not moved this long with ranks alive, the
    coordinator dumps its state to ``stall-<k>.json`` (again each interval, at most 5 a run). 120 is the
    reference's production interval (healthy long windows and evals stay quiet); 15 its debugging one."""
    max_failure: Optional[int] = None
    """Dead ranks that end the run with ShutdownWithSave (unset = down to the backend floor)."""
    max_failure_pct: Optional[float] = None
    """The same as a share of the world in (0, 1]: ceil(pct x world size) dead ranks end the run
    (algorithms.md 7.3; 0.2 of 32 ranks = 7). With both set, the lower limit wins."""
    rendezvous_timeout_s: float = 120.0
    """How long ranks wait for rendezvous.json and the coordinator waits for ranks."""
    report_coalesce_ms: float = 50.0
    """In the cadence and async modes a rank's per-batch reports may wait this long to travel several to a frame,
    except the one that completes its count for the window (and every one after it), which goes at once: the
    coordinator's cost is per frame, and the reduce fires as early as without it (rank/report_pacer.py). Sync modes,
    ``mode.max_batch_diff`` and the cold-start probe send every report at once. 0 = every report at once; at most
    1000."""
    host: Optional[str] = None
    """Address the coordinator binds; unset = 127.0.0.1 locally, the node's name on SLURM."""
    node_reduce: bool = False
    """cpu backend: hierarchical averaging. The ranks of a node (same host name) send their snapshots to the
    node's lowest rank, which sums them (float64, each weighted by its ElChe mass) into one partial; the
    coordinator combines one partial per node and sends one consensus per node, which the leader hands on. A
    reduce's cost at the coordinator grows with the nodes, not the ranks; the consensus is the flat one's
    (docs/how-to/large-clusters.md). Ignored by the nccl backend and on nodes with one rank."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)


@dataclass
class ExperimentConfig:
    """What is trained: factories found through ``_target_`` dotted paths."""

    name: str = MISSING
    """The experiment's name (required; the preset sets it): the run's ``experiment`` tag, the first part of the
    default run name, the dashboard's title."""
    model: Any = MISSING
    """Required: a ``_target_`` factory of the ``torch.nn.Module`` to train, built on every rank under
    ``torch.manual_seed(seed)`` (the replicas start equal) and moved to the rank's device."""
    optimizer: Any = MISSING
    """Required: a ``_target_`` factory with ``_partial_: true`` (``torch.optim.Adam``, ``lr``), called with the
    model's parameters on every rank."""
    scheduler: Any = None
    """Optional factory returning ``lr_factor(step) -> float``; gets total_steps, world_size."""
    train_data: Any = MISSING
    """Required: a ``_target_`` factory of the training data set (``len()``, and ``get_batch(ids)`` or
    ``__getitem__``); every rank builds it and trains the sample indices the coordinator deals it."""
    eval_data: Any = None
    """A ``_target_`` factory of the evaluation data set, passed to eval_fn on the callback rank; unset = no
    evaluation."""
    train_step: Optional[str] = None
    """Dotted path of ``fn(model, batch) -> loss`` (the managed tier: the rank's own loop calls it)."""
    loop: Optional[str] = None
    """Dotted path of ``fn(cfg)``, the user's own training loop run on every rank (the cooperative tier:
    ``with flodl_exp.worker(cfg) as w:``, README "Your own training loop"). Exactly one of train_step and loop."""
    eval_fn: Optional[str] = None
    """Dotted path of ``fn(model, dataset, device) -> {metric: value}``."""
    epoch_fn: Optional[str] = None
    """Dotted path of ``fn(epoch, model, last_epoch_metrics) -> {name: value} | None``: run on the epoch-role
    rank (the callback rank) before it trains each epoch; what it returns is logged as ``epoch_fn/<name>``."""
    checkpoint_fn: Optional[str] = None
    """Dotted path of ``fn(version, model) -> None``, run with each periodic (``checkpoint.every``) or requested
    (``w.request_checkpoint()``) bundle on the rank that writes its model piece, right after it does (the model
    is the bundle's state, at the start of epoch ``version``; the cpu backend hands it a copy holding the
    consensus): an export of your own. An error is logged and the next live rank tries; never fatal."""
    amp: Optional[str] = None
    """Mixed precision of the managed step: ``fp16`` (autocast to float16 with a GradScaler: the loss is scaled,
    gradients are unscaled before ``mode.max_grad_norm`` clipping, a step with inf/NaN gradients is skipped),
    ``bf16`` (autocast to bfloat16, no scaler needed) or null (float32, as the model is). A cooperative loop
    (``experiment.loop``) does its own."""
    batch_size: int = 32
    """Samples per batch on each rank (one optimizer step per batch); an epoch trains floor(picks / batch_size)
    batches in all (picks = samples x data_plane.augment). An integer >= 1."""
    epochs: int = 1
    """Passes over the training data before the final consensus, eval and bundle; an integer >= 1."""
    data_dir: Optional[str] = None
    """A local data folder the preset's data factories read (MNIST IDX files, CIFAR-10 binary batches); unset =
    the preset's offline default. Only presets that interpolate ``${experiment.data_dir}`` use it."""
    data_path: Optional[str] = None
    """A local data file (a plain-text corpus for the language models), as ``data_dir``."""


@dataclass
class TrackingConfig:
    uri: Optional[str] = None
    """MLflow tracking URI; unset = sqlite:///<cwd>/outputs/mlflow.db."""
    experiment_name: str = "${experiment.name}"
    """The MLflow experiment the run is logged in; created (at artifact_location) when it does not exist. Default:
    the experiment's name (``experiment.name``); a sweep over ``experiment`` logs its parent and children in
    ``flodl_exp`` unless this is set."""
    artifact_location: Optional[str] = None
    """Unset = <cwd>/outputs/mlartifacts for the embedded store."""
    run_name: Optional[str] = None
    """The MLflow run's name; unset = ``<experiment.name>/<backend>_<policy>/<guard.kind>``, plus
    ``/<outer.kind>`` unless outer.kind is avg."""
    log_model: bool = True
    """Log the final consensus model as an MLflow model (``runs:/<run_id>/model``) besides the bundle."""
    predict: bool = True
    """After a FINISHED run of 2+ ranks, log the simulator's prediction for its mode on its measured rig
    (``predicted/samples_per_s``, ``predicted/syncs``, ``predicted/share.rank<r>``, ``predicted/error_pct``) and
    print it in the run summary; the simulator is imported in the background while the run starts."""
    relay: bool = True
    """With ``run.wait``: the job writes its MLflow records to ``<job>/records.jsonl`` and the launcher, which imports
    MLflow anyway, delivers them (the job imports no MLflow; its end waits for no store). Off: the job's own sink
    process delivers them, as with ``run.wait=false``."""
    relay_stale_s: float = 30.0
    """A launcher whose relay has not beaten for this long is taken for gone: the job delivers its records itself
    from where the relay stopped."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Write a consensus bundle every N epochs (0 = only at the end)."""
    at_epoch: Optional[int] = None
    """Coverage-granular bundle at the first reduce that reaches this epoch."""
    save_path: Optional[str] = None
    """Bundle stem; unset = <job dir>/checkpoints/final."""
    resume_from: Optional[str] = None
    """A bundle's stem to continue from (its path without ``.pt`` / ``.meta.json``: ``<job dir>/checkpoints/final``);
    from a coverage-granular bundle only the uncovered picks of its epoch are trained. Refused before any rank
    starts: missing or corrupt pieces, another world size, model or data set size. Unset = a fresh start."""


@dataclass
class EvalConfig:
    every: int = 1
    """Evaluate every N epochs on the callback rank (0 = only at the end)."""
    callback_rank: str = "fastest"
    """fastest (sticky, re-elected on death) or a rank index."""
    callback_slack: bool = True
    """Before the window in which a periodic eval runs, lower the callback rank's batch count by the eval's
    expected time (an EWMA of its measured evals), so its peers do not wait for it at the next reduce."""


@dataclass
class RunConfig:
    wait: bool = True
    """true: follow the run here (progress, summary) and exit with its outcome; false: submit, print the job id,
    log paths and MLflow run, and return (the job ends its own run). true in an Optuna study."""
    progress: str = "auto"
    """auto (a live bar on a TTY, plain lines otherwise) | bar | plain | off."""
    timeout_min: int = 60
    """cluster.executor=local: the job's time limit, minutes (submitit's LocalExecutor); 30 s before it the job is
    signalled as at a SLURM time limit (a bundle, a requeue that resumes). SLURM jobs use
    cluster.slurm.time_min. An integer >= 1."""
    job_root: Optional[str] = None
    """Where job folders go; unset = <cwd>/outputs/jobs."""
    verbose: bool = False
    """A failed run: false prints one line (the rank, the user's exception and its own innermost frame, the path of
    the full traceback file); true prints the full failure text too (framework frames, the task's traceback)."""


@dataclass
class RecordLogConfig:
    dir: Optional[str] = None
    """Persist every record as JSONL per node (root.log, <host>/rank<r>.log); unset = off."""
    max_bytes: int = 4 * 2**20
    """Each file is a drop-oldest ring of at most this many bytes."""


@dataclass
class HooksConfig:
    """The reference's builder hooks as config: dotted paths to ``fn(epoch: int, metrics: dict[str, float])``, called in
    the coordinator's job (so they fire however the run was launched: the CLI, ``launch()``, SLURM)."""

    metrics_fn: Optional[str] = None
    """Called with each aggregated epoch's metrics (``loss``, ``samples_per_s``, ..., and ``rank<r>/...`` per rank)."""
    eval_result_fn: Optional[str] = None
    """Called with each periodic and final eval's metrics (``eval/<name>``; the final one has ``final`` = 1.0)."""


@dataclass
class DashboardConfig:
    html: Optional[str] = None
    """Write one self-contained HTML dashboard here at teardown; unset = off."""
    theme: str = "auto"
    """light | dark | auto (follows the browser)."""


@dataclass
class SweepConfig:
    """Hydra sweeps (``-m``). An Optuna study (``hydra/sweeper=optuna``, docs/how-to/optuna.md) optimizes the final
    value of ``objective`` in each trial's finished run; a grid sweep (Hydra's basic sweeper) reads neither key."""

    objective: str = "eval/accuracy"
    """The MLflow metric of a finished run each trial returns to the sweeper (its last value): eval/accuracy,
    eval/loss, loss, epoch_time_s, ... (any key the run logged)."""
    direction: str = "maximize"
    """maximize | minimize the objective; ``hydra.sweeper.direction`` follows it (set there too, it must agree)."""


@dataclass
class Config:
    mode: ModeConfig = field(default_factory=ModeConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    data_plane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    seed: int = 42
    """Shuffle base seed: the epoch-e permutation uses seed + e."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    reports_per_epoch: int = 0
    """Sub-epoch window records per epoch (logged under window/ with step = global step); 0 = off."""
    scalar_reductions: Dict[str, str] = field(default_factory=dict)
    """Cross-rank roll-up of user scalars: name -> mean | sum | max | min (undeclared = mean)."""
    record_log: RecordLogConfig = field(default_factory=RecordLogConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (conf/config.yaml extends base_config)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)


class ConfigError(ValueError):
    """A user error in the configuration: one line, key + value + what is allowed."""


def did_you_mean(word: str, candidates: Iterable[str]) -> Optional[str]:
    """The closest candidate to a misspelt ``word`` (``difflib``'s ratio >= 0.6), or None: the one suggestion rule of
    the validation's and Hydra's config errors (flodl_exp/config_errors.py)."""
    import difflib

    close = difflib.get_close_matches(word, sorted(set(candidates)), n=1)
    return close[0] if close else None


def _err(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config error: {key}={value!r} is not allowed: {allowed}")


def cluster_size(cluster: Any) -> int:
    """Ranks in the job: ``nodes x ranks_per_node`` (the one place this product is written)."""
    return int(cluster.nodes) * int(cluster.ranks_per_node)


def world_size(cfg: Any) -> int:
    return cluster_size(cfg.cluster)


def load_config(resolved: Any) -> Config:
    """The typed config from the resolved dict a job spec carries (coordinator and ranks):
    the same dataclasses the launcher validated, so every process reads attributes, not keys."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(Config), resolved)
    return typing.cast(Config, OmegaConf.to_object(merged))


def load_cluster(resolved_cluster: Any) -> ClusterConfig:
    """Just the typed ``cluster`` section (the job's task code reads nothing else before torch loads)."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(ClusterConfig), resolved_cluster)
    return typing.cast(ClusterConfig, OmegaConf.to_object(merged))


@dataclass(frozen=True)
class RunShape:
    """Values derived from the config, computed once (every process reads them from here)."""

    mode: Mode
    """The policy and backend as one value (flodl_exp/policy/mode.py)."""
    world_size: int
    progressive: bool
    """Progressive dispatch (chunks from a pool), only meaningful with 2+ ranks."""
    easgd_alpha: Optional[float]
    """The EASGD blend as run (cpu_async's default 0.5 filled in), None = full overwrite."""
    fixed_callback_rank: Optional[int]
    """``eval.callback_rank`` as an index, None = the fastest rank."""
    max_failure: Optional[int]
    """Dead ranks that end the run: the lower of ``cluster.max_failure`` and ``ceil(max_failure_pct x W)``."""
    outer: Any = None
    """The outer optimizer as run (an ``outer.OuterSpec``, defaults filled in)."""

    @classmethod
    def of(cls, cfg: Any) -> RunShape:
        w = world_size(cfg)
        limits = [int(cfg.cluster.max_failure)] if cfg.cluster.max_failure is not None else []
        if cfg.cluster.max_failure_pct is not None:
            limits.append(max(1, math.ceil(float(cfg.cluster.max_failure_pct) * w - 1e-9)))
        return cls(mode=Mode.of(cfg), world_size=w, progressive=is_progressive(cfg) and w >= 2, easgd_alpha=effective_easgd_alpha(cfg),
                   fixed_callback_rank=parse_callback_rank(cfg.eval.callback_rank),
                   max_failure=min(limits) if limits else None, outer=outer_spec(cfg))


@dataclass(frozen=True)
class OuterSpec:
    """The outer optimizer as run (flodl_exp/outer.py runs it). Here, not there: the launcher reads it
    and must not import torch."""

    kind: str = "avg"
    lr: float = 1.0
    mu: float = 0.0
    target: Optional[str] = None
    """``outer._target_``: the user's class (then ``kind`` is not used)."""
    args: tuple[tuple[str, Any], ...] = ()
    """``outer.args``, as sorted pairs (the spec is hashable)."""

    @property
    def stateful(self) -> bool:
        """Carries state across windows (and writes a bundle sidecar); a user's class always may."""
        return self.kind != "avg" or self.target is not None

    @property
    def resets_inner(self) -> bool:
        """The inner optimizer's state is cleared after each adoption (DiLoCo; a user's class says so with a
        ``resets_inner = True`` attribute, which the ranks read: flodl_exp/outer.py)."""
        return self.kind == "diloco"

    def describe(self) -> str:
        if self.target is not None:
            args = ", ".join(f"{k}={v!r}" for k, v in self.args)
            return f"{self.target.rpartition('.')[2]}({args})"
        return self.kind if not self.stateful else f"{self.kind}(lr={self.lr:g}, mu={self.mu:g})"


def outer_spec(cfg: Any) -> OuterSpec:
    """``outer`` as run: the kind's default lr and mu fill what the config leaves unset."""
    o = cfg.outer
    target = getattr(o, "_target_", None)  # a DictConfig or the OuterConfig dataclass alike
    if target:
        args = getattr(o, "args", None)
        if args is not None and not isinstance(args, dict):  # a DictConfig: plain values, so the spec stays plain
            from omegaconf import OmegaConf

            args = cast(dict[str, Any], OmegaConf.to_container(args, resolve=True))
        return OuterSpec(kind="avg", target=str(target), args=tuple(sorted(dict(args or {}).items())))
    lr, mu = OUTER_DEFAULTS[o.kind]
    return OuterSpec(kind=str(o.kind), lr=float(o.lr) if o.lr is not None else lr,
                     mu=float(o.mu) if o.mu is not None else mu)


def is_progressive(cfg: Any) -> bool:
    """Progressive dispatch: explicit override, else on for cadence/async, off for sync."""
    if cfg.mode.progressive_dispatch is not None:
        return bool(cfg.mode.progressive_dispatch)
    return Mode.of(cfg).progressive_by_default


def effective_easgd_alpha(cfg: Any) -> Optional[float]:
    """easgd_alpha as used at run time: the mode default (0.5) fills cpu_async."""
    if cfg.mode.easgd_alpha is not None:
        return float(cfg.mode.easgd_alpha)
    return Mode.of(cfg).default_easgd_alpha


def parse_callback_rank(value: Any) -> Optional[int]:
    """None for 'fastest', else the rank index (raises ValueError when neither)."""
    s = str(value).strip().lower()
    if s == "fastest":
        return None
    return int(s)


def mode_name(cfg: Any) -> str:
    """The mode as run: reconciled from (backend, policy), whatever ``mode.name`` says."""
    return f"{cfg.mode.backend}_{cfg.mode.policy}"
