"""A dead rank's picks handed to the survivors (Dispatcher._extend_over): a survivor the send fails to (dying itself,
not declared dead yet: two deaths close together) is skipped and its piece goes to another, so no pick is dropped
unseen (the fault suite's kill2 lost two batches of a retrain that way)."""
from __future__ import annotations

from typing import Any

from control_fakes import FakeClock, make_config

from flodl_exp.config import RunShape, load_config
from flodl_exp.core.commands import RankJoined, Send, TrainingStarts
from flodl_exp.core.control_core import recording_core
from flodl_exp.protocol.messages import ExtendPartition, StartEpoch
from flodl_exp.torch_averager import TorchAverager

BATCH = 8


def _core(world: int) -> tuple[Any, list[Any]]:
    cfg = load_config(make_config("cpu_cadence", world, 2))
    clock = FakeClock()
    core, commands = recording_core(cfg, clock, averager=TorchAverager(RunShape.of(cfg).outer))
    for r in range(world):
        core.handle(RankJoined(r, 0.0))
    core.handle(TrainingStarts(192, None, clock()))
    commands.clear()
    return core, commands


def _failing_for(core: Any, dying: set[int]) -> None:
    out = core.dispatch._out
    real = out.send
    out.send = lambda r, p: False if r in dying else real(r, p)


def test_a_piece_whose_send_fails_goes_to_another_survivor() -> None:
    core, commands = _core(3)
    _failing_for(core, {1})
    assert core.dispatch._extend_over([0, 1], 0, 64, 64) == 0
    ext = [(c.rank, c.payload.offset, c.payload.size) for c in commands
           if isinstance(c, Send) and isinstance(c.payload, ExtendPartition)]
    assert ext == [(0, 64, 32), (0, 96, 32)], "rank 1's half went to rank 0"


def test_picks_no_survivor_took_are_returned() -> None:
    core, commands = _core(3)
    _failing_for(core, {0, 1})
    assert core.dispatch._extend_over([0, 1], 0, 64, 64) == 64
    assert core.dispatch._extend_over([], 0, 64, 64) == 64


def test_an_epoch_share_that_cannot_be_sent_goes_to_the_other_ranks() -> None:
    """Epoch plans go out to a rank whose connection just closed (the death not declared yet): its share is handed
    to the others at once; before, it was dropped unseen and the epoch ran one share short (fault suite,
    nccl_sync+overlap kill2)."""
    cfg = load_config(make_config("cpu_sync", 3, 2))  # a sync mode: whole-epoch plans, not a chunk pool
    clock = FakeClock()
    core, _ = recording_core(cfg, clock, averager=TorchAverager(RunShape.of(cfg).outer))
    for r in range(3):
        core.handle(RankJoined(r, 0.0))
    _failing_for(core, {1})
    out = core.handle(TrainingStarts(192, None, clock()))  # returns what it sent
    starts = {c.rank: (c.payload.offset, c.payload.size) for c in out
              if isinstance(c, Send) and isinstance(c.payload, StartEpoch)}
    ext = [(c.rank, c.payload.offset, c.payload.size) for c in out
           if isinstance(c, Send) and isinstance(c.payload, ExtendPartition)]
    assert 1 not in starts and sorted(starts) == [0, 2]
    assert sum(size for _, _, size in ext) == 64 and {r for r, _, _ in ext} == {0, 2}, ext
    covered = sorted([*starts.values(), *((o, n) for _, o, n in ext)])
    assert sum(n for _, n in covered) == 192 and all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))
