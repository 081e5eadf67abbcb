"""Fakes that drive the coordinator without processes: a clock, a transport that records what
is sent, a sink that records what is logged, and a few helpers that play the ranks' side."""
from __future__ import annotations

import queue
from typing import Any, Mapping, Optional

import torch
from omegaconf import OmegaConf

from flodl_exp.bundle_meta import Resume
from flodl_exp.config import Config
from flodl_exp.coordinator.coordinator import Coordinator
from flodl_exp.job_spec import JobSpec
from flodl_exp.protocol.codec import decode, encode, unbundle
from flodl_exp.protocol.hello import Hello
from flodl_exp.protocol.messages import (
    Batch,
    ChunkMetrics,
    ExecuteEval,
    ExtendPartition,
    Heartbeat,
    Payload,
    RequestParams,
    RequestSession,
    Save,
    SaveResult,
    SessionReady,
    Snapshot,
    StartEpoch,
    SyncAck,
    SyncNow,
    Update,
)
from flodl_exp.protocol.wire import Message

SAMPLES = 96
BATCH = 8


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class FakeTransport:
    def __init__(self) -> None:
        self.sent: list[tuple[int, Payload]] = []
        """What was sent, with each chunk folded into an Update also listed as a StartEpoch after it."""
        self.raw: list[tuple[int, Payload]] = []
        """What was sent, as sent (cleared by take too)."""
        self.frames: list[tuple[int, str]] = []
        """(rank, kind) of every frame (a bundle is one; never cleared)."""

    def send(self, rank: int, msg: Message) -> bool:
        self.frames.append((rank, msg.kind))
        for part in unbundle(msg):  # a bundle frame: its messages, in order, as the rank's inbox reads them
            p = decode(part)
            assert p is not None, part.kind
            self.raw.append((rank, p))
            self.sent.append((rank, p))
            if isinstance(p, Update) and p.next_plan is not None:  # cpu cadence folds a chunk in: seen as one more
                self.sent.append((rank, StartEpoch(*p.next_plan)))
        return True

    def take(self, kind: Optional[type] = None, rank: Optional[int] = None) -> list[tuple[int, Any]]:
        """Every message sent since the last take (optionally of one type / to one rank); clears all."""
        out = [(r, p) for r, p in self.sent if (kind is None or isinstance(p, kind)) and (rank is None or r == rank)]
        self.sent.clear()
        self.raw.clear()
        return out


class FakeSink:
    def __init__(self) -> None:
        self.tags: dict[str, Any] = {}
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.artifacts: list[tuple[str, str]] = []
        self.inputs: list[dict[str, Any]] = []

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.tags.update(tags)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        self.artifacts.append((path, artifact_path or ""))

    def log_inputs(self, inputs: list[dict[str, Any]]) -> None:
        self.inputs = list(inputs)

    def epochs_logged(self) -> list[int]:
        return [step for step, m in self.metrics if "loss" in m]


def make_config(mode: str, world: int, epochs: int = 2, **overrides: Any) -> dict[str, Any]:
    policy, backend = {"nccl_sync": ("sync", "nccl"), "nccl_cadence": ("cadence", "nccl"), "cpu_sync": ("sync", "cpu"),
                       "cpu_cadence": ("cadence", "cpu"), "cpu_async": ("async", "cpu")}[mode]
    cfg = OmegaConf.structured(Config)
    cfg.mode.name, cfg.mode.policy, cfg.mode.backend = mode, policy, backend
    cfg.cluster.ranks_per_node = world
    cfg.experiment.name = "fake"
    cfg.experiment.model = {"_target_": "fake"}
    cfg.experiment.optimizer = {"_target_": "fake"}
    cfg.experiment.train_data = {"_target_": "fake"}
    cfg.experiment.train_step = "fake"
    cfg.experiment.batch_size = BATCH
    cfg.experiment.epochs = epochs
    cfg.eval.every = 0
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def make_spec(config: dict[str, Any], tmp_path: Any, *, attempt: int = 0, resume: Optional[Resume] = None) -> JobSpec:
    """The job spec a coordinator under test reads (no store: run id and tracking URI are placeholders)."""
    return JobSpec(config=config, run_id="run", tracking_uri="", job_dir=str(tmp_path),
                   checkpoint_stem=str(tmp_path / "ckpt" / "final"), shuffle_seed=42, attempt=attempt, resume=resume)


class Harness:
    """A coordinator plus the ranks' side of the conversation, in one process."""

    def __init__(self, tmp_path: Any, mode: str, world: int, epochs: int = 2, attempt: int = 0, **overrides: Any) -> None:
        self.clock = FakeClock()
        self.transport = FakeTransport()
        self.sink = FakeSink()
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.job_dir = str(tmp_path)
        spec = make_spec(make_config(mode, world, epochs, **overrides), tmp_path, attempt=attempt)
        self.co = Coordinator(spec, self.transport, self.events, self.sink, self.job_dir, clock=self.clock)
        self.world = world

    def start(self, samples: int = SAMPLES) -> dict[int, list[StartEpoch]]:
        for r in range(self.world):
            self.co.on_event(("join", r, Hello(rank=r, samples=samples, host="h", pid=100 + r)))
        self.co.start()
        return self.plans()

    def final_saves(self) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]]]:
        """Start, finish every rank's first chunk untrained and tick into the end of the run: the final eval
        and save messages sent then (``(rank, ExecuteEval)``s, ``(rank, Save)``s)."""
        plans = self.start()
        for r in range(self.world):
            self.finish_chunk(r, plans[r][0], trained=0)
        self.transport.take()
        self.tick(2)
        sent = self.transport.take()
        return ([(r, p) for r, p in sent if isinstance(p, ExecuteEval)], [(r, p) for r, p in sent if isinstance(p, Save)])

    def plans(self) -> dict[int, list[StartEpoch]]:
        """The chunks handed out since the last take (those folded into updates included)."""
        out: dict[int, list[StartEpoch]] = {}
        for r, p in self.transport.take(StartEpoch):
            out.setdefault(r, []).append(p)
        return out

    def msg(self, r: int, p: Payload) -> None:
        self.co.on_event(("msg", r, encode(p)))

    def batches(self, r: int, chunk: int, n: int) -> None:
        for _ in range(n):
            self.msg(r, Batch(ms=5.0, data_ms=0.1, chunk=chunk, loss=1.0, lr=0.1))

    def finish_chunk(self, r: int, plan: StartEpoch, trained: Optional[int] = None, sent: int = 0) -> None:
        """Rank r trains ``plan`` (or ``trained`` batches of it) and reports it; ``sent``: batches already reported."""
        n = plan.size // BATCH if trained is None else trained
        self.batches(r, plan.chunk, n - sent)
        self.msg(r, ChunkMetrics(epoch=plan.epoch, chunk=plan.chunk, avg_loss=1.0, batches=n, samples=n * BATCH,
                                 epoch_ms=5.0 * n, share_complete_ms=5.0 * n, compute_only_ms=5.0 * n, data_starve_ms=0.0,
                                 ranges=[[plan.offset, n * BATCH]]))

    def ack_all(self, ranks: list[int], n: int = 1) -> None:
        for r in ranks:
            self.msg(r, SyncAck(n=n, d=0.01, pre=1.0, post=1.0))

    def snapshot(self, r: int, n: int, value: float) -> None:
        self.msg(r, Snapshot(n=n, tensors={"p0": torch.full((4,), value)}))

    def pass_time(self, seconds: float, alive: list[int]) -> None:
        """Let ``seconds`` pass while ``alive`` keep heartbeating (no tick in between)."""
        left = seconds
        while left > 0:
            step = min(10.0, left)
            self.clock.advance(step)
            left -= step
            for r in alive:
                self.msg(r, Heartbeat())

    def answer(self, r: int, p: Any) -> None:
        """What a well-behaved rank answers to ``p``: train a chunk whole, snapshot or ack a reduce,
        make a session id, write its bundle pieces."""
        if isinstance(p, (StartEpoch, ExtendPartition)):
            self.finish_chunk(r, StartEpoch(epoch=p.epoch, offset=p.offset, size=p.size, chunk=p.chunk))
        elif isinstance(p, RequestParams):
            self.snapshot(r, self.co.core.cycle.steps(r), float(r))
        elif isinstance(p, SyncNow):
            self.msg(r, SyncAck(n=self.co.core.cycle.steps(r), d=0.01, pre=1.0, post=1.0))
        elif isinstance(p, RequestSession):
            self.msg(r, SessionReady(generation=p.generation, session=f"s{p.generation}"))
        elif isinstance(p, Save):
            self.msg(r, SaveResult(stem=p.stem))

    def play(self, alive: list[int], until: Any, pending: Optional[list[tuple[int, Any]]] = None,
             rounds: int = 500) -> None:
        """Answer like well-behaved ranks (train every chunk, snapshot/ack every reduce) until ``until()``."""
        todo = list(pending or [])
        for _ in range(rounds):
            if until():
                return
            todo += self.transport.take()
            for r, p in todo:
                if r in alive and self.co.core.cohort.alive(r):
                    self.answer(r, p)
            todo = []
            self.tick()
        raise AssertionError("play: the condition never held")

    def tick(self, times: int = 1) -> None:
        for _ in range(times):
            self.co.tick()


def sent_payloads(commands: list[Any]) -> list[tuple[int, Payload]]:
    """A core's Send and Broadcast commands as (rank, payload), in order (a broadcast once per rank it went to)."""
    from flodl_exp.core.commands import Broadcast, Send

    out: list[tuple[int, Payload]] = []
    for c in commands:
        if isinstance(c, Send):
            out.append((c.rank, c.payload))
        elif isinstance(c, Broadcast):
            out += [(r, c.payload) for r in c.to]
    return out


class ScriptedRun:
    """A recording core (``recording_core``) driven by scripted ranks, one message at a time: ``ranks`` hears what the
    core sent (``hear(out) -> answers``, queued in :attr:`pending`), trains (``next() -> (rank, payload)`` or None)
    and answers final evals (``final_evals``, ``shutdown``). The clock moves 10 ms a message, 50 ms an idle tick."""

    def __init__(self, core: Any, commands: list[Any], clock: FakeClock, ranks: Any) -> None:
        self.core, self.commands, self.clock, self.ranks = core, commands, clock, ranks
        self.pending: list[tuple[int, Payload]] = []

    def take(self) -> list[tuple[int, Payload]]:
        out = sent_payloads(self.commands)
        self.commands.clear()
        return out

    def handle(self, event: Any) -> None:
        self.commands.extend(self.core.handle(event))
        self.pending += self.ranks.hear(self.take())

    def play(self, until: Any = lambda: False, max_steps: int = 20000) -> None:
        """Deliver answers first, then the ranks' next messages, ticking the core after each, until ``until()``, the
        run's shutdown, or nothing moves (an AssertionError naming the phase)."""
        from flodl_exp.core.commands import RankMessage, Tick
        from flodl_exp.protocol.messages import EvalResult

        for _ in range(max_steps):
            if self.ranks.shutdown or until():
                return
            msg = self.pending.pop(0) if self.pending else self.ranks.next()
            if msg is None:
                if self.ranks.final_evals:
                    r = self.ranks.final_evals.pop()
                    msg = (r, EvalResult(epoch=self.core.epochs - 1, metrics={"acc": 0.9}, final=True, elapsed_ms=5.0))
                else:
                    self.clock.advance(0.05)
                    n = len(self.pending)
                    self.handle(Tick(self.clock()))
                    if len(self.pending) == n and self.ranks.next() is None and not self.ranks.final_evals:
                        raise AssertionError(f"nothing moves in phase {self.core.life.phase}")
                    continue
            self.clock.advance(0.01)
            self.handle(RankMessage(msg[0], msg[1], self.clock()))
            self.handle(Tick(self.clock()))
        raise AssertionError("the script did not end")
