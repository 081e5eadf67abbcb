"""Side work yields the CPU to training (flodl_exp/background.py): lowered per thread, never the caller's others."""
from __future__ import annotations

import os
import sys
import threading

import pytest

from flodl_exp.background import BACKGROUND_NICE, yield_to_training

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def _in_thread(fn):  # type: ignore[no-untyped-def]
    box = {}

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
        return ok, before, os.getpriority(os.PRIO_PROCESS, tid)

    ok, before, after = _in_thread(work)
    assert ok
    assert after == min(19, before + BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before


@linux_only
def test_threads_started_by_a_yielding_thread_inherit_its_niceness() -> None:
    def work() -> tuple[int, int]:
        yield_to_training()
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = _in_thread(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return mine, child

    mine, child = _in_thread(work)
    assert child == mine


def test_no_increment_changes_nothing() -> None:
    assert _in_thread(lambda: yield_to_training(0)) is False
