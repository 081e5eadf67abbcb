"""Side work yields the CPU to training (flodl_exp/background.py): lowered per thread, never the caller's others."""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable, TypeVar

import pytest

from flodl_exp.background import BACKGROUND_NICE, yield_to_training

T = TypeVar("T")
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def _in_thread(fn: Callable[[], T]) -> T:
    box: dict[str, T] = {}

    def run() -> None:
        box["out"] = fn()

    th = threading.Thread(target=run)
    th.start()
    th.join(10)
    assert not th.is_alive()
    return box["out"]


@linux_only
def test_a_thread_that_yields_runs_nicer_and_its_creator_keeps_its_priority() -> None:
    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def work() -> tuple[bool, int, int]:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        ok = yield_to_training()
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        return ok, before, os.getpriority(os.PRIO_PROCESS, tid)

    ok, before, after = _in_thread(work)
    assert ok
    assert after == min(19, before + BACKGROUND_NICE)
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # this thread (the process's main one) keeps its class
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before


@linux_only
def test_threads_started_by_a_yielding_thread_inherit_its_niceness() -> None:
    def work() -> tuple[tuple[int, int], tuple[int, int]]:
        yield_to_training()

        def mine() -> tuple[int, int]:
            tid = threading.get_native_id()
            return os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)

        return mine(), _in_thread(mine)

    parent, child = _in_thread(work)
    assert child == parent and parent[1] == os.SCHED_IDLE


@linux_only
def test_a_thread_sharing_its_interpreter_is_only_made_nicer() -> None:
    def work() -> tuple[bool, int]:
        ok = yield_to_training(idle=False)
        return ok, os.sched_getscheduler(threading.get_native_id())

    ok, policy = _in_thread(work)
    assert ok and policy != os.SCHED_IDLE


def test_no_increment_changes_nothing() -> None:
    assert _in_thread(lambda: yield_to_training(0)) is False
