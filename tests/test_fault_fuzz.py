"""A fault fuzz of the control core (no processes): four paced fake ranks with jittered speeds train a run while
two of them die at random moments (between batches, on a reduce's request before answering, or right after
answering it), in every mode. Each seed must end FINISHED with every pick of every epoch in the coverage once
and the global step at the run's batch count (every pick trained once, none dropped while counted).

It found a run that never ended (cpu_cadence, seed 385 below): the final window's plan, pinned while the counts
held, kept the dead rank's slot after a death gave its picks back to the pool, and allotted the survivors
nothing (chunk_pool.refresh_final_window_plan now re-plans when the live ranks change)."""
from __future__ import annotations

import random
from collections import deque
from pathlib import Path
from typing import Any, Optional

import pytest
from control_fakes import BATCH, Harness

from flodl_exp.core.lifecycle import Status
from flodl_exp.protocol import messages as protocol

MODES = ["nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"]
SEEDS = 25
"""Seeds per mode in make test (about 0.15 s each); the campaigns behind it ran 300-1,500 a mode."""
WORLD, EPOCHS, SAMPLES, TICKS = 4, 5, 960, 4000
DEATH_KINDS = ("between_batches", "between_batches", "at_request", "after_answer")
"""How a victim dies; "at_save" (on a bundle's Save, before writing) is for runs with periodic bundles."""


def play(seed: int, mode: str, tmp: Path, **overrides: Any) -> Optional[str]:
    """One seeded run (``overrides``: config keys, e.g. periodic bundles); None when it ended as it must, else what
    went wrong."""
    return _FuzzRun(seed, mode, tmp, **overrides).run()


class _FuzzRun:
    """The ranks' side: each takes its chunks in order, trains up to its speed a tick (jittered), obeys a
    Throttle or a barrier request until the next Update, and answers every reduce; a victim dies when armed."""

    def __init__(self, seed: int, mode: str, tmp: Path, **overrides: Any) -> None:
        self.rng = rng = random.Random(seed)
        tmp.mkdir(parents=True, exist_ok=True)
        self.h = Harness(tmp, mode, world=WORLD, epochs=EPOCHS, **overrides)
        self.speeds = [rng.choice([1, 1, 2, 3, 4]) for _ in range(WORLD)]  # batches a tick, at most
        self.death_ticks = sorted(rng.sample(range(2, 70), 2))  # a run lasts ~75 ticks
        self.kinds = [rng.choice(DEATH_KINDS) for _ in range(2)]
        self.victims = rng.sample(range(1, WORLD), 2)
        self.chunks: dict[int, deque[list[int]]] = {r: deque() for r in range(WORLD)}  # [epoch, offset, batches, id, done]
        self.held = [False] * WORLD
        self.armed: dict[int, str] = {}
        self.dead: set[int] = set()

    def run(self) -> Optional[str]:
        h = self.h
        todo: list[tuple[int, Any]] = [(r, p) for r, ps in h.start(samples=SAMPLES).items() for p in ps]
        for t in range(TICKS):
            h.clock.advance(0.01)
            todo += self._deaths_due(t)
            for r, p in todo:
                if r not in self.dead:
                    self._deliver(r, p)
            if h.co.core.life.status is not Status.RUNNING:
                return _check_end(h)
            for r in range(WORLD):
                if r not in self.dead:
                    h.msg(r, protocol.Heartbeat())
                    self._train(r, self.rng.randint(0, self.speeds[r]))
            h.tick()
            todo = h.transport.take()
        return f"no end after {TICKS} ticks (deaths {sorted(self.dead)}): {h.co.stall_state()}"

    def _die(self, r: int) -> None:
        self.dead.add(r)
        self.h.co.on_event(("closed", r, "closed"))

    def _deaths_due(self, t: int) -> list[tuple[int, Any]]:
        sent: list[tuple[int, Any]] = []
        while self.death_ticks and t >= self.death_ticks[0]:
            self.death_ticks.pop(0)
            victim, kind = self.victims.pop(0), self.kinds.pop(0)
            if kind == "between_batches":
                self._die(victim)
                sent += self.h.transport.take()
            else:
                self.armed[victim] = kind
        return sent

    def _deliver(self, r: int, p: Any) -> None:
        h = self.h
        if isinstance(p, (protocol.StartEpoch, protocol.ExtendPartition)):
            self.chunks[r].append([p.epoch, p.offset, p.size // BATCH, p.chunk, 0])
        elif isinstance(p, protocol.Throttle):
            self.held[r] = True
        elif isinstance(p, (protocol.RequestParams, protocol.SyncNow)):
            self._answer_reduce(r, p)
        elif isinstance(p, protocol.RequestSession):
            h.msg(r, protocol.SessionReady(generation=p.generation, session=f"s{p.generation}"))
        elif isinstance(p, protocol.Update):
            self.held[r] = False
        elif isinstance(p, protocol.ExecuteEval):
            h.msg(r, protocol.EvalResult(epoch=p.epoch, metrics={"accuracy": 0.5}, final=p.final))
        elif isinstance(p, protocol.Save):
            if self.armed.get(r) == "at_save":
                self._die(r)
                return
            h.msg(r, protocol.SaveResult(stem=p.stem))
        elif isinstance(p, protocol.Shutdown):
            h.msg(r, protocol.Exiting(rank=r, pid=100 + r, hash="x", steps=1, global_step=h.co.core.cycle.global_step))

    def _answer_reduce(self, r: int, p: Any) -> None:
        h = self.h
        if self.armed.get(r) == "at_request":
            self._die(r)
            return
        if isinstance(p, protocol.RequestParams):
            h.snapshot(r, h.co.core.cycle.steps(r), float(r))
            self.held[r] = self.held[r] or p.barrier
        else:
            h.msg(r, protocol.SyncAck(n=h.co.core.cycle.steps(r), d=0.01, pre=1.0, post=1.0))
        if self.armed.get(r) == "after_answer":
            self._die(r)

    def _train(self, r: int, n: int) -> None:
        h, q = self.h, self.chunks[r]
        while n > 0 and q and not self.held[r]:
            c = q[0]
            h.msg(r, protocol.Batch(ms=10.0 / self.speeds[r], data_ms=0.1, chunk=c[3], loss=1.0, lr=0.1))
            c[4] += 1
            n -= 1
            if c[4] == c[2]:
                q.popleft()
                h.msg(r, protocol.ChunkMetrics(epoch=c[0], chunk=c[3], avg_loss=1.0, batches=c[2], samples=c[2] * BATCH,
                                      epoch_ms=1.0, share_complete_ms=1.0, compute_only_ms=1.0, data_starve_ms=0.0,
                                      ranges=[[c[1], c[2] * BATCH]]))


def _check_end(h: Harness) -> Optional[str]:
    if h.co.core.life.status is not Status.FINISHED:
        return f"ended {h.co.core.life.status.value}: {h.co.core.life.failure}"
    d = h.co.core.dispatch
    for e in range(EPOCHS):
        marks = [0] * SAMPLES
        for off, n in d.coverage.get(e, []):
            for i in range(off, off + n):
                marks[i] += 1
        if any(m != 1 for m in marks):
            return (f"epoch {e}: {sum(m == 0 for m in marks)} picks uncovered, "
                    f"{sum(m > 1 for m in marks)} covered twice")
    if h.co.core.cycle.global_step != EPOCHS * SAMPLES // BATCH:
        return f"global step {h.co.core.cycle.global_step}, the run has {EPOCHS * SAMPLES // BATCH} batches"
    return None


def test_the_seed_that_found_the_stale_final_window_plan(tmp_path):
    assert play(385, "cpu_cadence", tmp_path) is None


def test_a_throttle_never_wedges_cpu_sync(tmp_path):
    # mode.max_batch_diff with 3+ ranks: the held ranks waited for a reduce that a rank done with its epoch share
    # (nothing in flight, no step this window) kept from firing; it wedged nearly every run of the fuzz, no death
    # needed (cycle.should_average now counts such a rank as arrived while a throttle holds others).
    assert play(194, "cpu_sync", tmp_path, **{"mode.max_batch_diff": 2}) is None


@pytest.mark.fuzz
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["cpu_sync", "cpu_cadence", "cpu_async"])
def test_deaths_with_a_throttle_never_wedge_or_drop_a_pick(tmp_path, mode):
    failures = [(seed, why) for seed in range(SEEDS)
                if (why := play(seed, mode, tmp_path / str(seed), **{"mode.max_batch_diff": 2})) is not None]
    assert not failures, f"{len(failures)} of {SEEDS} seeds: {failures[:3]}"


@pytest.mark.fuzz
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
def test_two_deaths_at_random_moments_never_wedge_or_drop_a_pick(tmp_path, mode):
    failures = [(seed, why) for seed in range(SEEDS) if (why := play(seed, mode, tmp_path / str(seed))) is not None]
    assert not failures, f"{len(failures)} of {SEEDS} seeds: {failures[:3]}"
