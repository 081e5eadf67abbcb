"""State the core's components share, built once from the config: the run's epoch count (core/epoch_plan.py: a
stop lowers it once and every component reads it) and srun's --kill-on-bad-exit (read by the core, not set on it)."""
from __future__ import annotations

from typing import Any

import pytest

from flodl_exp.core.epoch_plan import EpochPlan


def test_a_stop_only_lowers_the_plan():
    p = EpochPlan(10)
    p.end_after(3)
    assert p.epochs == 4
    p.end_after(7)  # a later stop asking for more epochs asks for nothing
    assert p.epochs == 4


def test_a_plan_needs_an_epoch():
    with pytest.raises(ValueError, match="at least one epoch"):
        EpochPlan(0)


def test_every_component_of_the_core_reads_the_one_plan():
    from test_control_core import Bare, FakeClock, cfg_of

    core = Bare(cfg_of("cpu_cadence", 2, epochs=6, **{"checkpoint.every": 2}), FakeClock()).core
    def epochs() -> list[int]:
        return [core.dispatch.epochs, core.slack.epochs, core.checkpoints.epochs, core.run_end.epochs]

    assert epochs() == [6] * 4
    core.plan.end_after(2)
    assert core.epochs == 3 and epochs() == [3] * 4
    assert core.writer._plan is core.plan  # the bundle meta's default epoch is the plan's too


def test_the_core_reads_srun_kill_on_bad_exit_from_the_config():
    """It used to be set on the built core from coordinator/main.py, so a core rebuilt by mode=auto lost it."""
    from test_control_core import Bare, FakeClock, cfg_of

    from flodl_exp.core.preemption import kills_on_bad_exit

    plain = cfg_of("cpu_cadence", 2)
    srun: dict[str, Any] = {"cluster.executor": "slurm", "cluster.slurm.srun_args": ["-K1"]}
    killing = cfg_of("cpu_cadence", 2, **srun)
    assert not kills_on_bad_exit(plain.cluster) and kills_on_bad_exit(killing.cluster)
    assert Bare(killing, FakeClock()).core.preemption.kill_on_bad_exit
    assert not Bare(plain, FakeClock()).core.preemption.kill_on_bad_exit
