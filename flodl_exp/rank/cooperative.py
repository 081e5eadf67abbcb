"""The cooperative tier: the user's own training loop drives the rank (seed 000's cooperative ``Worker``).

    def main(cfg):                                   # experiment.loop = "my_module.main"
        with flodl_exp.worker() as w:                # joins the coordinator
            for epoch in w.epochs():                 # the epochs the coordinator hands this rank
                for batch in w.batches():            # this rank's picks of the epoch, on its device
                    loss = F.cross_entropy(w.model(batch[0]), batch[1]); loss.backward()
                    w.step(w.optimizer, loss=loss)   # steps the optimizer, books the step
                w.request_eval()                     # folded into the next boundary

Nothing changes for the coordinator: it hands out chunks, reduces, throttles and shuts down as in the
managed tier. The rank's lifecycle is the managed loop's, turned inside out: ``w.batches()`` is
``RankControl.chunk_batches`` (control, collectives and averaging run while the next item is fetched,
never inside the user's code) and ``w.step`` is the managed step's bookkeeping (timing, the window count,
the Batch report, the fault hook). The rules (README, "Your own training loop"): one ``w.step`` per item of
``w.batches()``; every ``w.batches()`` iterated to its end; ``w.epochs()`` iterated until it ends (it ends
when the run does). Breaking a rule raises :class:`LoopMisuse` naming the call (a missing ``w.step`` when the
next item is asked for); an exception of the loop's own is reported with its traceback and, by default, loses the
rank (``cluster.loop_error=lose_rank``; ``fail`` ends the run FAILED), while one raised by flodl's side (a
collective that cannot recover, a data read) is always a lost rank, as in the managed tier.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from flodl_exp.protocol.messages import Intent, LoopNotice
from flodl_exp.rank.trainer import Batch, OptimizerSet
from flodl_exp.scalars import record_scalar as _record_scalar

if TYPE_CHECKING:
    from flodl_exp.job_spec import JobSpec
    from flodl_exp.rank.control import RankControl


class LoopMisuse(RuntimeError):
    """The user's loop broke a rule of the cooperative tier (the message names the call and the fix)."""


@dataclass
class RankContext:
    """What the job hands the cooperative tier: how to build this rank's worker, and its result."""

    spec: JobSpec
    rank: int
    local_rank: int
    rendezvous: dict[str, Any] | Callable[[], dict[str, Any]]
    """The coordinator's address, or the wait for it (see RankWorker)."""
    owns_process: bool
    opened: bool = False
    result: Optional[dict[str, Any]] = None
    error: Optional[BaseException] = None
    """What ended the worker block, when the loop caught it (named if the loop then returns normally)."""


_context: Optional[RankContext] = None
"""The rank this process runs (one per process; set by :func:`run_loop` around the user's loop)."""


def run_loop(loop: Callable[[Any], Any], ctx: RankContext) -> dict[str, Any]:
    """Run the experiment's ``loop(cfg)`` as this rank; its ``flodl_exp.worker`` joins the coordinator.
    Returns the rank's Exiting record, as the managed tier's ``RankWorker.run``."""
    global _context
    from flodl_exp.config import load_config

    _context = ctx
    try:
        loop(load_config(ctx.spec.config))
    finally:
        _context = None
    name = getattr(loop, "__qualname__", repr(loop))
    if not ctx.opened:
        raise LoopMisuse(f"experiment.loop {name} returned without `with flodl_exp.worker() as w:`: the rank never "
                         "joined the coordinator")
    if ctx.result is None:
        why = f": {type(ctx.error).__name__}: {ctx.error}" if ctx.error is not None else ""
        raise LoopMisuse(f"experiment.loop {name} swallowed the error that ended its `flodl_exp.worker` block{why}")
    return ctx.result


_FROM_FLODL = "_flodl_rank_side"
"""Set on an exception raised by flodl's side of ``w.epochs()``/``w.batches()``/``w.step()``."""


def is_loop_error(e: BaseException) -> bool:
    """An exception of the user's loop (its bug, or a rule it broke): the run fails. One raised by flodl's
    side (control, collectives, data, the fault hook) is this rank's loss, recovered as in the managed tier."""
    return isinstance(e, Exception) and not getattr(e, _FROM_FLODL, False)


@contextlib.contextmanager
def _rank_side() -> Generator[None, None, None]:
    """Mark what the rank's own machinery raises (LoopMisuse excepted: that is the loop's rule broken)."""
    try:
        yield
    except LoopMisuse:
        raise
    except Exception as e:
        try:
            setattr(e, _FROM_FLODL, True)
        except Exception:  # an exception type without attributes: counted as the loop's
            pass
        raise


@contextlib.contextmanager
def worker() -> Iterator[CooperativeWorker]:
    """Join the coordinator as this rank and hand the loop its :class:`CooperativeWorker`.

    Only inside a rank flodl_exp started for an experiment with ``loop:``; the rank reads its own copy of
    the config (``w.cfg``), so it takes no argument. On a clean exit the rank reports its replica and leaves;
    an exception is reported with its traceback (a lost rank, or with ``cluster.loop_error=fail`` the run ends
    FAILED) and re-raised."""
    ctx = _context
    if ctx is None:
        raise LoopMisuse("flodl_exp.worker() runs inside a rank that flodl_exp started: name the loop in the "
                         "experiment (experiment.loop=my_module.main) and run `python -m flodl_exp experiment=...`")
    if ctx.opened:
        raise LoopMisuse("flodl_exp.worker() was already opened on this rank: one `with flodl_exp.worker() as w:` "
                         "per rank and run")
    ctx.opened = True
    from flodl_exp.rank.worker import RankWorker

    try:
        rw = RankWorker(ctx.spec, ctx.rank, ctx.local_rank, ctx.rendezvous, owns_process=ctx.owns_process)
    except BaseException as e:  # no coordinator to tell (it never said hello): kept for run_loop's message
        ctx.error = e
        raise
    w = CooperativeWorker(rw.control, rw.cfg)
    rw.loop_watch = w._watch  # the heartbeat thread asks it (the user's handle keeps it private)
    try:
        yield w
        w.check_finished()
        ctx.result = rw.exit_cleanly()
    except BaseException as e:
        ctx.error = e
        rw.report_failure(e, loop=is_loop_error(e))
        raise
    finally:
        rw.loop_watch = None
        rw.close()


@dataclass
class _Held:
    """A batch handed to the loop and not stepped yet."""

    batch: Batch
    chunk: int
    started: tuple[float, Any]
    handed_at: float
    host_extra_ms: float = 0.0
    """CUDA: the loop's host time since its previous ``w.step`` (on CPU ``started`` was moved back by it)."""
    noticed: bool = False


class CooperativeWorker:
    """The handle the user's loop drives (``w``): the replica, its batches, and the step that books them.

    ``ctl``: the rank's control (rank/control.py), which trains the chunks and handles control between
    batches; ``cfg``: the rank's config (``w.cfg``). No socket here: :func:`worker` wires the I/O shell."""

    def __init__(self, ctl: RankControl, cfg: Any) -> None:
        self._ctl = ctl
        self._cfg = cfg
        self._registered = {id(ctl.trainer.optimizer)}
        """``id()`` of each optimizer the loop may pass to ``w.step`` (``w.setup``'s, else ``w.optimizer``)."""
        self._started = False
        self._epoch: Optional[int] = None
        self._epoch_done = False
        self._held: Optional[_Held] = None
        self._stepped_at: Optional[float] = None
        self._resumed_at = 0.0
        """When the last ``w.step`` ended: the loop's code from then to its next item is part of the next step."""
        self._evals_read = 0
        """How many of the broadcast evals ``poll_eval`` has handed out."""
        self.hold_notice_s = float(cfg.cluster.heartbeat_timeout_s) / 2
        """A batch held this long without ``w.step()`` is reported (well inside the heartbeat timeout)."""

    # -- what the loop reads ------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The rank's replica (the experiment's model, identical on every rank at the start)."""
        return self._ctl.trainer.model

    @property
    def optimizer(self) -> Any:
        """The experiment's optimizer (or what ``w.setup`` registered)."""
        return self._ctl.trainer.optimizer

    @property
    def cfg(self) -> Any:
        return self._cfg

    @property
    def rank(self) -> int:
        return self._ctl.rank

    @property
    def world_size(self) -> int:
        return self._ctl.world_size

    @property
    def device(self) -> torch.device:
        return self._ctl.device

    @property
    def epoch(self) -> Optional[int]:
        """The epoch ``w.epochs()`` last yielded (None outside it)."""
        return self._epoch

    @property
    def global_step(self) -> int:
        """Batches the whole cohort trained up to the last reduce."""
        return self._ctl.trainer.global_step

    # -- setup ----------------------------------------------------------------
    def setup(self, *optimizers: torch.optim.Optimizer) -> None:
        """Register the optimizers the loop steps (default: ``w.optimizer`` alone), before ``w.epochs()``.
        They get the run's linear LR scaling and schedule, bundles save their state (a resume restores it
        here), DiLoCo resets them at each adopted global."""
        if self._started:
            raise LoopMisuse("w.setup() after w.epochs() started: register the optimizers before the first epoch")
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise LoopMisuse(f"w.setup() takes one or more torch.optim.Optimizer, got {[type(o).__name__ for o in optimizers]}")
        ours = {id(p) for p in self.model.parameters()}
        for o in optimizers:
            foreign = [p for g in o.param_groups for p in g["params"] if id(p) not in ours]
            if foreign:
                raise LoopMisuse(f"w.setup(): an optimizer ({type(o).__name__}) holds {len(foreign)} tensor(s) that are "
                                 "not parameters of w.model: only the replica's parameters are averaged")
        self._registered = {id(o) for o in optimizers}
        self._ctl.trainer.use_optimizer(optimizers[0] if len(optimizers) == 1 else OptimizerSet(list(optimizers)))

    # -- the loop -----------------------------------------------------------
    def epochs(self) -> Iterator[int]:
        """The epochs the coordinator hands this rank, in its order (under async an epoch a dead rank left
        open may come back after a newer one). Ends when the run ends."""
        if self._started:
            raise LoopMisuse("w.epochs() was already iterated: iterate it once per run")
        self._started = True
        ctl = self._ctl
        with _rank_side():
            ctl.load_resumed_optimizer()
        while True:
            with _rank_side():
                if not ctl.plans:
                    ctl.wait_for_plans()
            if ctl.stopping:
                break
            self._epoch, self._epoch_done = ctl.plans[0].epoch, False
            yield self._epoch
            if not self._epoch_done and not ctl.stopping:
                raise LoopMisuse(f"the loop moved past epoch {self._epoch} without iterating w.batches() to its end: "
                                 "every pick of an epoch is trained (the coordinator counts them)")
        self._epoch = None

    def batches(self) -> Iterator[Any]:
        """This rank's batches of the current epoch (its chunks, and any a dead rank left it), on its device.
        Control messages, reduces and collectives run while the next item is fetched."""
        if self._epoch is None:
            raise LoopMisuse("w.batches() outside w.epochs(): iterate it inside `for epoch in w.epochs():`")
        if self._epoch_done:
            raise LoopMisuse(f"w.batches() of epoch {self._epoch} was already iterated to its end")
        ctl, e = self._ctl, self._epoch
        with ctl.doing("train"):
            while True:
                with _rank_side():
                    if not ctl.plans:
                        ctl.wait_for_plans()
                if ctl.stopping or ctl.plans[0].epoch != e:
                    break
                plan = ctl.plans.popleft()
                batches = ctl.chunk_batches(plan)
                while True:
                    with _rank_side():
                        batch = next(batches, None)
                    if batch is None:
                        break
                    yield self._hand_out(batch, plan.chunk)
                    self._resumed_at = time.perf_counter()
                    ctl.state = "train"
                    if self._held is not None:
                        raise LoopMisuse(f"w.step() was not called for a batch of epoch {e}: call it once per item of "
                                         "w.batches(), after the backward (it steps the optimizers and books the step)")
        self._epoch_done = True

    def _hand_out(self, batch: Batch, chunk: int) -> Any:
        """Open the batch's step: its timing (with the loop's code since its last ``w.step``), the LR, no grads."""
        tr = self._ctl.trainer
        t0, event = tr.begin_step()
        gap_s = 0.0 if self._stepped_at is None else max(0.0, self._resumed_at - self._stepped_at)
        self._stepped_at = None
        on_device = event is not None
        self._held = _Held(batch, chunk, (t0, event) if on_device else (t0 - gap_s, event), time.monotonic(),
                           host_extra_ms=gap_s * 1e3 if on_device else 0.0)
        self.model.zero_grad(set_to_none=True)
        self._ctl.state = "loop"
        return batch.data

    def step(self, *optimizers: torch.optim.Optimizer, loss: Any = None) -> None:
        """Close the current batch's step: clip (``mode.max_grad_norm``), step and zero each optimizer given
        (none: the loop stepped them itself, e.g. through a GradScaler), then book it as the managed step
        does. ``loss`` (a tensor or a number) feeds the epoch's loss; it stays on the device."""
        held, self._held = self._held, None
        if held is None:
            raise LoopMisuse("w.step() without a batch to book: it was already called for this batch, or it is "
                             "outside `for batch in w.batches():` (one w.step() per item)")
        self._ctl.state = "train"  # the loop is back in flodl's hands: a hang from here is not a missing w.step
        for o in optimizers:
            if id(o) not in self._registered:
                raise LoopMisuse(f"w.step() got an optimizer ({type(o).__name__}) that w.setup() did not register: "
                                 "register every optimizer the loop steps with w.setup(...) first (bundles save them)")
        tr = self._ctl.trainer
        if optimizers:
            tr.clip_grads()
            for o in optimizers:
                o.step()
                o.zero_grad(set_to_none=True)
        value = None
        if loss is not None:
            value = (loss.detach().reshape(()) if isinstance(loss, torch.Tensor)
                     else torch.tensor(float(loss), device=self.device))
        with _rank_side():
            self._ctl.book_step(held.batch, tr.end_step(held.started, value, held.host_extra_ms), held.chunk)
        self._stepped_at = time.perf_counter()

    # -- intents and metrics --------------------------------------------------
    def request_eval(self) -> None:
        """Ask for an eval at the next epoch boundary (besides ``eval.every``)."""
        self._intent("eval")

    def request_checkpoint(self) -> None:
        """Ask for a bundle at the next boundary (the next epoch boundary; the next reduce in progressive modes)."""
        self._intent("checkpoint")

    def request_stop(self) -> None:
        """End the run early (the loop's own early stopping): the furthest epoch the cohort has started is the
        last, trained whole; then the final reduce, eval and bundle, and ``w.epochs()`` ends on every rank. Any
        rank may ask, once or more; the run's tag ``stopped_early`` says where it stopped and who asked."""
        self._intent("stop")

    def poll_eval(self) -> Optional[tuple[int, dict[str, float]]]:
        """The next eval result this loop has not read yet, oldest first: ``(epoch, {"eval/<name>": value})``, or
        None. Every rank hears each periodic and final eval (the reference's ``EvalBroadcast``), between batches:
        a loop can stop improving a schedule, or log, on the cohort's eval."""
        evals = self._ctl.evals
        if self._evals_read >= len(evals):
            return None
        m = evals[self._evals_read]
        self._evals_read += 1
        return m.epoch, {f"eval/{k}": float(v) for k, v in m.metrics.items() if isinstance(v, (int, float))}

    def latest_metrics(self) -> Optional[tuple[int, dict[str, float]]]:
        """The latest aggregated epoch's cohort metrics (loss, samples, global step...; the reference's
        ``EpochAggregated``): ``(epoch, metrics)``, or None before the first epoch aggregates."""
        e = self._ctl.last_metrics_epoch
        return None if e is None else (e, dict(self._ctl.last_epoch_metrics))

    def _intent(self, kind: str) -> None:
        self._ctl.send(Intent(kind=kind, epoch=self._epoch if self._epoch is not None else -1))

    @staticmethod
    def record_scalar(name: str, value: float) -> None:
        """A user metric, rolled up per epoch as in the managed tier (``flodl_exp.record_scalar``)."""
        _record_scalar(name, value)

    # -- checks -----------------------------------------------------------------
    def check_finished(self) -> None:
        """At the end of the ``with`` block: the loop ran until the run ended."""
        if self._held is not None:
            raise LoopMisuse("the loop ended with a batch it never stepped: call w.step() once per item of w.batches()")
        if not self._ctl.stopping:
            where = f" at epoch {self._epoch}" if self._epoch is not None else ""
            raise LoopMisuse(f"the loop left w.epochs(){where} before the coordinator ended the run: iterate "
                             "w.epochs() until it ends (it ends when the run does)")

    def _watch(self) -> Optional[LoopNotice]:
        """Every heartbeat (its thread): a batch held past ``hold_notice_s`` without ``w.step()``, once per batch."""
        held = self._held
        if held is None or held.noticed or self.hold_notice_s <= 0:
            return None
        held_s = time.monotonic() - held.handed_at
        if held_s < self.hold_notice_s:
            return None
        held.noticed = True
        return LoopNotice(message=f"rank {self.rank}: the training loop has held a batch of epoch {self._epoch} for "
                                  f"{held_s:.0f}s and has not called w.step() yet: call w.step() once per item of "
                                  "w.batches() (without it no step is booked and the run cannot progress)", held_s=held_s)
