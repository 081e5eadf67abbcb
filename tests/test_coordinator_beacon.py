"""The coordinator's heartbeat to the ranks goes out one slice at a time (coordinator.BEACON_SLICES): every rank
still hears it once a second, and no turn of the loop writes to every rank (at 1,024 ranks that turn took ~30 ms,
a reduce trigger waiting behind it). The start of training tunes only the coordinator's own process (heap, GIL)."""
from __future__ import annotations

import collections
import gc
import subprocess
import sys

from control_fakes import Harness

from flodl_exp.coordinator.coordinator import BEACON_SLICES, COORD_HEARTBEAT_S
from flodl_exp.protocol.messages import CoordHeartbeat

WORLD = 23


def test_each_rank_hears_the_coordinator_once_a_second_and_no_turn_beacons_everyone(tmp_path) -> None:
    h = Harness(tmp_path, "cpu_cadence", WORLD, epochs=1)
    h.start()
    h.transport.take()
    step = COORD_HEARTBEAT_S / BEACON_SLICES
    per_rank: collections.Counter[int] = collections.Counter()
    widest = 0
    seconds = 3
    for _ in range(seconds * BEACON_SLICES):
        h.clock.advance(step)
        h.tick()
        beats = [r for r, _ in h.transport.take(CoordHeartbeat)]
        assert len(beats) == len(set(beats))
        widest = max(widest, len(beats))
        per_rank.update(beats)
    assert sorted(per_rank) == list(range(WORLD)), "every rank hears the coordinator"
    assert set(per_rank.values()) == {seconds}, per_rank  # once a second each
    assert widest == -(-WORLD // BEACON_SLICES)  # one slice per turn, never the whole cohort


def test_a_coordinator_inside_another_process_leaves_its_heap_alone(tmp_path) -> None:
    frozen, interval = gc.get_freeze_count(), sys.getswitchinterval()
    h = Harness(tmp_path, "cpu_cadence", 2, epochs=1)
    h.start()
    assert gc.get_freeze_count() == frozen  # owns_process=False (the default): a test or launcher hosting it
    assert sys.getswitchinterval() == interval


def test_the_coordinators_own_process_is_tuned_as_training_starts() -> None:
    """main.py's coordinator (owns_process): the start-up heap frozen and a short GIL switch interval, in that
    process only (run in a child here: the test process keeps its own)."""
    code = ("import gc, sys; from flodl_exp.coordinator.coordinator import SWITCH_INTERVAL_S, tune_process; "
            "tune_process(); print(gc.get_freeze_count() > 0, sys.getswitchinterval() == SWITCH_INTERVAL_S)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
