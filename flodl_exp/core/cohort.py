"""The cohort: who is alive, who left cleanly, who died and why, and who holds the callback role.

Liveness (algorithms.md 7.1): a rank is alive from its hello until its
connection closes or its messages stop for the heartbeat timeout; a clean
``exiting`` latches it as finished (never counted dead). The callback rank
(eval, primary optimizer piece) is the fastest calibrated live rank, sticky:
re-elected only on death, or pinned by ``eval.callback_rank``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


@dataclass
class Death:
    rank: int
    reason: str
    epoch: int
    global_step: int
    last_step: int = 0
    """Batches the rank had reported trained."""
    unix_time: float = 0.0
    traceback: str = ""
    unreduced_steps: int = 0
    """Batches it trained that no finished reduce holds: survivors retrain those picks."""
    acked_steps: int = 0
    """Batches in its answer to the nccl reduce in flight: in the consensus if that reduce keeps its share."""

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "reason": self.reason, "epoch": self.epoch, "global_step": self.global_step}

    def record(self) -> dict[str, Any]:
        """The ``.death.json`` entry: who, when, last step, error."""
        return {**self.as_dict(), "last_step": self.last_step, "unreduced_steps": self.unreduced_steps,
                "unix_time": self.unix_time, "traceback": self.traceback}


class Cohort:
    def __init__(self, world_size: int, fixed_callback: Optional[int], now: float,
                 wall_clock: Callable[[], float] = lambda: 0.0) -> None:
        self.world_size = world_size
        self._wall_clock = wall_clock
        """Unix time, for a death's ``unix_time`` (the shell's clock; 0.0 where none is given: the tests')."""
        self._fixed_callback = fixed_callback
        self._callback_rank = fixed_callback if fixed_callback is not None else 0
        self.roles_elected = False
        """Fastest-rank election happened (sticky until a death)."""
        self._alive = [False] * world_size
        self._n_alive = 0
        self._alive_list: Optional[list[int]] = None
        self._exited = [False] * world_size
        self._last_seen = [now] * world_size
        self._hosts: dict[int, str] = {}
        """Each joined rank's node, as its hello named it (node groups: core/node_groups.py)."""
        self._finals: dict[int, dict[str, Any]] = {}
        """rank -> its clean-exit report (hash, steps, global_step)."""
        self._errors: dict[int, dict[str, Any]] = {}
        """rank -> the error it reported before failing."""
        self._deaths: list[Death] = []
        self.batches = [0] * world_size
        """Batches each rank reported trained (its last step, for death records and stall dumps)."""
        self._generation = 0
        """Process-group generation (nccl): bumped at each regroup, the store prefix of the new group."""

    @property
    def deaths(self) -> list[Death]:
        return self._deaths

    @property
    def errors(self) -> dict[int, dict[str, Any]]:
        return self._errors

    @property
    def callback_rank(self) -> int:
        return self._callback_rank

    @property
    def fixed_callback(self) -> Optional[int]:
        return self._fixed_callback

    @property
    def generation(self) -> int:
        return self._generation

    def error_of(self, r: int) -> Optional[str]:
        """The error the rank reported before failing, if any."""
        err = (self._errors.get(r) or {}).get("error")
        return str(err) if err else None

    def failure_summary(self) -> str:
        """What went wrong with the ranks, in one line: the deaths, else the errors they reported."""
        if self._deaths:
            return "; ".join(f"rank {d.rank} {d.reason}" for d in self._deaths)
        return "; ".join(f"rank {r}: {e.get('error')}" for r, e in sorted(self._errors.items()))

    def outcome(self) -> dict[str, Any]:
        """The cohort's part of the run's outcome (result.json): final reports, roles, deaths, errors, regroups."""
        return {
            "finals": {str(r): v for r, v in self._finals.items()},
            "callback_rank": self._callback_rank,
            "deaths": [d.as_dict() for d in self._deaths],
            "errors": {str(r): v for r, v in self._errors.items()},
            "regroups": self._generation,
        }

    # -- queries ----------------------------------------------------------
    def alive(self, r: int) -> bool:
        return self._alive[r]

    def exited(self, r: int) -> bool:
        return self._exited[r]

    @property
    def alive_mask(self) -> Sequence[bool]:
        """Rank -> alive, without a copy (per-chunk reads at a thousand ranks); read it, never keep or change it."""
        return self._alive

    def alive_ranks(self) -> list[int]:
        """The live ranks, ascending (a fresh list; the one it copies is rebuilt only on a join or a death,
        so the coordinator's per-tick reads cost a copy, not a scan of the world)."""
        return list(self._live())

    def _live(self) -> list[int]:
        """The live ranks, rebuilt only after a join or a death (callers copy what they keep)."""
        if self._alive_list is None:
            self._alive_list = [r for r in range(self.world_size) if self._alive[r]]
        return self._alive_list

    def alive_count(self) -> int:
        return self._n_alive

    def all_joined(self) -> bool:
        return all(self._alive)

    def missing(self) -> list[int]:
        return [r for r in range(self.world_size) if not self._alive[r]]

    def working(self) -> list[int]:
        """Alive and not yet exited."""
        return [r for r in range(self.world_size) if self._alive[r] and not self._exited[r]]

    def dead_count(self) -> int:
        return self.world_size - len(self.alive_ranks()) - sum(self._exited)

    def silent_for(self, r: int, now: float) -> float:
        return now - self._last_seen[r]

    def stale(self, now: float, timeout: float) -> list[int]:
        return [r for r in self.working() if now - self._last_seen[r] > timeout]

    def lowest_alive(self) -> Optional[int]:
        """Asked on every batch (who speaks for the LR): the cached live list's head, not a scan."""
        live = self._live()
        return live[0] if live else None

    def primary(self) -> int:
        """The rank that writes the model and the primary optimizer piece: the callback rank, else the lowest live one."""
        if self._alive[self._callback_rank]:
            return self._callback_rank
        low = self.lowest_alive()
        return self._callback_rank if low is None else low

    # -- events -----------------------------------------------------------
    def join(self, r: int, now: float, host: Optional[str] = None) -> None:
        if host is not None:
            self._hosts[r] = host
        if not self._alive[r]:
            self._n_alive += 1
        self._alive[r] = True
        self._alive_list = None
        self._last_seen[r] = now

    def hosts(self) -> dict[int, str]:
        """Each joined rank's node, as its hello named it."""
        return dict(self._hosts)

    def seen(self, r: int, now: float) -> None:
        self._last_seen[r] = now

    def record_error(self, r: int, report: dict[str, Any]) -> None:
        self._errors[r] = report

    def mark_exited(self, r: int, final: dict[str, Any]) -> None:
        self._exited[r] = True
        self._finals[r] = final

    def mark_dead(self, r: int, reason: str, *, epoch: int, global_step: int, unreduced_steps: int = 0,
                  acked_steps: int = 0) -> Optional[Death]:
        """Take ``r`` out of the cohort. Returns the Death, or None when it was already gone or had exited cleanly."""
        if not self._alive[r]:
            return None
        self._alive[r] = False
        self._n_alive -= 1
        self._alive_list = None
        if self._exited[r]:
            return None
        report = self._errors.get(r) or {}
        err = report.get("error")
        death = Death(r, f"{reason}: {err}" if err else reason, epoch, global_step, last_step=self.batches[r],
                      unix_time=self._wall_clock(), traceback=str(report.get("traceback") or ""), unreduced_steps=unreduced_steps,
                      acked_steps=acked_steps)
        self._deaths.append(death)
        return death

    def next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def on_batch(self, r: int) -> None:
        self.batches[r] += 1

    def elect_fastest_once(self, smoothed_ms: Callable[[int], Optional[float]]) -> None:
        """ElChe calibrated: the fastest rank takes the callback roles, once (sticky: re-elected only on a
        death), unless ``eval.callback_rank`` pinned them."""
        if self._fixed_callback is None and not self.roles_elected:
            self.roles_elected = True
            self.elect_callback(smoothed_ms)

    def elect_callback(self, smoothed_ms: Optional[Callable[[int], Optional[float]]], *, force: bool = False) -> None:
        """Fastest calibrated live rank (``smoothed_ms`` given), else the lowest live one when forced or
        when the holder died. A pinned rank (``eval.callback_rank=<n>``) keeps the eval and epoch roles even
        dead (periodic evals and the epoch hook are then skipped, algorithms.md 3.15); only the checkpoint
        role fails over (:meth:`primary`)."""
        alive = self.alive_ranks()
        if not alive:
            return
        if self._fixed_callback is not None:
            self._callback_rank = self._fixed_callback
            return
        if smoothed_ms is not None:
            self._callback_rank = min(alive, key=lambda q: (smoothed_ms(q) or math.inf, q))
        elif force or not self._alive[self._callback_rank]:
            self._callback_rank = alive[0]


class ProgressWatch:
    """Ranks whose main thread is stuck while their heartbeat thread beats on (issue: a hung data read).

    Each heartbeat says what the rank's main thread does (``state``) and its step count. A rank in
    ``train`` (a chunk in progress) or ``loop`` (a cooperative loop holding a batch) whose step count has not moved for ``timeout_s`` is stuck. Any
    other state (a collective waiting on peers, an eval, a save, a wait for the coordinator) restarts
    the clock: those waits are not the rank's own lack of progress, and have their own deadlines.
    Pure: the coordinator feeds heartbeats and asks :meth:`stuck` each tick.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self._since: dict[int, float] = {}
        self._steps: dict[int, Optional[int]] = {}
        self.states: dict[int, Optional[str]] = {}
        """Each rank's last reported state (``loop``: a cooperative loop holds a batch it has not stepped)."""

    def on_heartbeat(self, r: int, state: Optional[str], steps: Optional[int], now: float) -> None:
        self.states[r] = state
        if state not in ("train", "loop") or steps is None:
            self._since.pop(r, None)
            self._steps[r] = steps
            return
        if r not in self._since or self._steps.get(r) != steps:
            self._since[r] = now
        self._steps[r] = steps

    def forget(self, r: int) -> None:
        self._since.pop(r, None)
        self._steps.pop(r, None)
        self.states.pop(r, None)

    def stuck(self, now: float) -> list[tuple[int, float]]:
        """(rank, seconds without a step) for each stuck rank; none when the watch is off."""
        if self.timeout_s <= 0:
            return []
        return [(r, now - t) for r, t in sorted(self._since.items()) if now - t > self.timeout_s]
