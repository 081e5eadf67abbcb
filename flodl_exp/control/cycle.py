"""The averaging cycle, coordinator side (algorithms.md 3.2-3.11): the window ledger, the
policy's firing gate, triggering a reduce on either backend, the cpu backend's weighted
average, and the finish (ElChe feed, guard verdict, global step, window records).

Both backends finish when every live member answered:
* nccl: broadcast ``sync_now``; ranks all_reduce in place and ``sync_ack``.
* cpu: broadcast ``request_params``; ranks send ``snapshot``; the coordinator
  averages (work weights ``n^gamma``) and sends ``update`` to each rank.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from ..averaging import divergence, weighted_average
from ..wire import Message
from .actions import STABLE
from .elche import WindowReport
from .guards import DivergenceReport

if TYPE_CHECKING:
    from .coordinator import Coordinator

log = logging.getLogger("flodl_exp.coordinator")


@dataclass
class Cycle:
    backend: str
    started: float
    members: set[int]
    final: bool = False
    acks: dict[int, dict] = field(default_factory=dict)
    snapshots: dict[int, Message] = field(default_factory=dict)


@dataclass
class Ledger:
    """Per-rank window ledger since the last finished reduce (algorithms.md 3.2)."""

    steps: int = 0
    wall_ms: float = 0.0
    first_ms: Optional[float] = None
    delivered_ms: float = 0.0
    delivered_batches: int = 0
    window_batches: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    throttled: bool = False
    """A Throttle was sent this window (cpu backend, max_batch_diff); cleared at every finish."""

    def add(self, batch_ms: float, data_ms: float, loss: Optional[float] = None) -> None:
        if loss is not None and math.isfinite(loss):
            self.loss_sum += loss
            self.loss_count += 1
        self.steps += 1
        self.window_batches += 1
        self.wall_ms += batch_ms
        if self.first_ms is None:
            self.first_ms = batch_ms + data_ms
        else:
            self.delivered_ms += batch_ms + data_ms
            self.delivered_batches += 1

    def fill_excess(self) -> float:
        if self.first_ms is None or self.delivered_batches == 0:
            return 0.0
        return max(self.first_ms - self.delivered_ms / self.delivered_batches, 0.0)

    def reset_timing(self) -> None:
        self.wall_ms, self.first_ms, self.delivered_ms, self.delivered_batches, self.window_batches = 0.0, None, 0.0, 0, 0
        self.loss_sum, self.loss_count = 0.0, 0



class AveragingCycle:
    """Mixin of :class:`Coordinator`."""

    def _should_average(self: "Coordinator") -> bool:
        if self.W < 2 or self.cycle is not None:
            return False
        any_mover = False
        counts = self.counts
        for r in self.alive_ranks():
            s = self.ledger[r].steps
            if s > 0:
                any_mover = True
            hit = s >= 1 if self.policy == "sync" else s >= counts[r]
            # A throttled rank is held at max_batch_diff ahead of the slowest on purpose: it waits for
            # this reduce, so it counts as arrived (else the gate and the throttle wait on each other).
            hit = hit or self.ledger[r].throttled
            if not (hit or (self.progressive and self.dispatch.quiesced(r))):
                return False
        return any_mover

    def _check_throttle(self: "Coordinator") -> None:
        mbd = self.cfg["mode"]["max_batch_diff"]
        if self.backend != "cpu" or mbd is None or len(self.alive_ranks()) < self.W or self.W < 2:
            return
        low = min(self.ledger[r].steps for r in self.alive_ranks())
        for r in self.alive_ranks():
            if self.ledger[r].steps > low + int(mbd) and not self.ledger[r].throttled:
                self.ledger[r].throttled = True
                self.send(r, Message("throttle", {}))

    def _trigger(self: "Coordinator", final: bool = False) -> None:
        members = set(self.alive_ranks())
        self.cycle = Cycle(self.backend, time.monotonic(), members, final=final)
        if self.backend == "nccl":
            self.broadcast(Message("sync_now", {"version": self.version, "divergence": True}))
        else:
            barrier = final or not self.progressive
            self.broadcast(Message("request_params", {"version": self.version, "barrier": barrier}))

    def _maybe_finish(self: "Coordinator") -> None:
        c = self.cycle
        live = {r for r in c.members if self.alive[r]}
        if c.backend == "nccl":
            if not live.issubset(c.acks):
                return
            n = {r: int(c.acks[r]["n"]) for r in live}
            div = {r: c.acks[r].get("d") for r in live}
            pre = {r: c.acks[r].get("pre") for r in live}
            post = next((c.acks[r].get("post") for r in live if c.acks[r].get("post") is not None), None)
        else:
            if not live.issubset(c.snapshots):
                return
            n, div, pre, post = self._average_cpu(c, sorted(live))
        sync_ms = (time.monotonic() - c.started) * 1e3
        self._finish(c, n, div, pre, post, sync_ms)

    def _average_cpu(self: "Coordinator", c: Cycle, ranks: list[int]):
        snaps = [c.snapshots[r] for r in ranks]
        n = {r: int(s.fields["n"]) for r, s in zip(ranks, snaps)}
        n_p = sum(1 for k in snaps[0].tensors if k.startswith("p"))
        n_b = sum(1 for k in snaps[0].tensors if k.startswith("b"))
        params = [[s.tensors[f"p{i}"].float() for i in range(n_p)] for s in snaps]
        bufs = [[s.tensors[f"b{j}"] for j in range(n_b)] for s in snaps]
        res = weighted_average([n[r] for r in ranks], params, bufs, self.gamma)
        if res is None and c.final and self.alpha is not None:
            # EASGD leaves replicas apart even when nobody stepped: the final consensus is their plain mean.
            res = weighted_average([1] * len(ranks), params, bufs, 1.0)
        div: dict[int, Optional[float]] = {}
        pre: dict[int, Optional[float]] = {}
        post = None
        alpha = None if c.final else self.alpha
        if res is None:  # nobody moved: everyone keeps its state
            for r in ranks:  # release barrier waits; each rank keeps its own state
                div[r], pre[r] = 0.0, None
                self.send(r, Message("update", {"n": n[r], "skip": True}, {}))
            return n, div, pre, post
        avg_p, avg_b = res
        flat_avg = torch.cat([t.reshape(-1).float() for t in avg_p])
        tensors = {f"p{i}": t for i, t in enumerate(avg_p)}
        tensors.update({f"b{j}": t for j, t in enumerate(avg_b)})
        for r, ps in zip(ranks, params):
            d, post, pre_n = divergence(torch.cat([t.reshape(-1) for t in ps]), flat_avg)
            div[r], pre[r] = d, pre_n
            self.send(r, Message("update", {"n": n[r], "alpha": alpha, "version": self.version}, tensors))
        return n, div, pre, post

    def _finish(self: "Coordinator", c: Cycle, n: dict[int, int], div: dict, pre: dict, post: Optional[float], sync_ms: float) -> None:
        action = STABLE
        old_anchor = self.elche.anchor if self.elche else 0
        if self.elche is not None:
            alive = self.alive_ranks()
            led = self.ledger
            movers = [r for r in alive if led[r].window_batches > 0]
            capable = (self.backend == "cpu" and self.policy in ("cadence", "async")) or (self.backend == "nccl" and self.policy == "cadence")
            self.elche.report_window(WindowReport(
                wall_ms=[led[r].wall_ms if self.alive[r] else 0.0 for r in range(self.W)],
                steps=[led[r].window_batches if self.alive[r] else 0 for r in range(self.W)],
                delivered_ms=[led[r].delivered_ms for r in range(self.W)],
                delivered_batches=[led[r].delivered_batches for r in range(self.W)],
                fill_ms=[led[r].fill_excess() for r in range(self.W)],
                sync_ms=sync_ms,
                delivered_coherent=capable and bool(movers) and all(led[r].delivered_batches >= 1 for r in movers),
            ))
            if self.fixed_callback is None and self.elche.is_calibrated and not self.roles_elected:
                self.roles_elected = True  # sticky: re-elected only on death
                self.elect_callback_rank()
            deltas = [float(div.get(r) or 0.0) for r in range(self.W)]
            pres = [pre.get(r) for r in range(self.W)]
            report = DivergenceReport(deltas, pres if all(p is not None for p in pres) else None, post)
            k_used, k_max = sum(n.values()), max(n.values(), default=0)
            action = self.guard.report(report, k_used, k_max)
            if self.meta is not None and self.lr_seen is not None:
                meta_action = self.meta.observe(self.lr_seen, self.elche.anchor, action, self.elche.phase)
                if meta_action is not None:
                    self.elche.nudge_anchor_down(meta_action.factor)
                    self.elche.discard_proposed_anchor()
            self.elche.apply_verdict(action, relax_up=self.policy == "async" and bool(self.cfg["mode"]["relax_up"]))
            if self.dispatch is not None:
                self.dispatch.on_verdict(action)
        self.version += 1
        k_used = sum(n.values())
        self.global_step += k_used
        self._window_record(n, k_used, sync_ms, div)
        for r, nr in n.items():
            self.ledger[r].steps = max(0, self.ledger[r].steps - nr)
        for led in self.ledger:
            led.reset_timing()
            led.throttled = False
        self.cycle = None
        self.window_t0 = time.monotonic()
        self.broadcast(Message("set_global_step", {"global_step": self.global_step}))
        d_max = max((float(v) for v in div.values() if v is not None), default=None)
        if self.dispatch is not None:
            self.dispatch.on_sync(sync_ms, d_max, action.code)
            if self.elche is not None and self.elche.anchor != old_anchor:
                log.info("anchor %d -> %d", old_anchor, self.elche.anchor)
            self.maybe_at_epoch_checkpoint()
            self.dispatch.after_finish()

    def _window_record(self: "Coordinator", n: dict[int, int], k_used: int, sync_ms: float, div: dict, force_epoch: Optional[int] = None) -> None:
        """A sub-epoch report at this reduce boundary when it closes a slice of the epoch's work."""
        epoch = force_epoch if force_epoch is not None else (self.current_epoch() if self.dispatch else 0)
        if force_epoch is None and (epoch >= self.epochs or not self.windows.on_window(epoch, k_used)):
            return  # the drain reduce after the last epoch belongs to no epoch's slices
        now = time.monotonic()
        led = self.ledger
        loss_n = sum(led[r].loss_count for r in range(self.W))
        rec: dict[str, float] = {
            "window/loss": sum(led[r].loss_sum for r in range(self.W)) / loss_n if loss_n else float("nan"),
            "window/samples_per_s": k_used * self.batch_size / max(now - self.window_t0, 1e-6),
            "window/sync_ms": sync_ms,
            "window/epoch": float(epoch),
        }
        if self.elche is not None:
            rec["window/anchor"] = float(self.elche.anchor)
        d = [float(v) for v in div.values() if v is not None]
        if d:
            rec["window/divergence"] = max(d)
        for r in range(self.W):
            rec[f"window/rank{r}/share"] = n.get(r, 0) / k_used if k_used else 0.0
            rec[f"window/rank{r}/steps"] = float(n.get(r, 0))
        if rec["window/loss"] != rec["window/loss"]:  # a flushed slice with no batches: carry the last loss
            rec["window/loss"] = self.last_window_loss
        self.last_window_loss = rec["window/loss"]
        rec = {k: v for k, v in rec.items() if v == v}
        self.sink.log_metrics(rec, step=self.global_step)
        self.emit({"event": "window", "step": self.global_step, **{k[len("window/"):]: v for k, v in rec.items()}})
        for r in range(self.W):
            self.records.rank(r, "window", {"step": self.global_step, "steps": n.get(r, 0)})
