"""The lifecycle's transition table: every allowed move works, every other one raises."""
from __future__ import annotations

import itertools

import pytest

from flodl_exp.core.lifecycle import ALLOWED, IllegalTransition, Lifecycle, Phase, Status


def _at(phase: Phase) -> Lifecycle:
    """A lifecycle walked to ``phase`` along allowed transitions (breadth-first over the table)."""
    paths = {Phase.CONNECTING: [Phase.CONNECTING]}
    frontier = [Phase.CONNECTING]
    while frontier:
        nxt = []
        for p in frontier:
            for q in ALLOWED[p]:
                if q not in paths:
                    paths[q] = [*paths[p], q]
                    nxt.append(q)
        frontier = nxt
    life = Lifecycle()
    for p in paths[phase][1:]:
        life.move(p)
    return life


def test_every_phase_is_reachable_and_done_is_terminal():
    for p in Phase:
        assert _at(p).phase is p
    assert ALLOWED[Phase.DONE] == frozenset()


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(Phase, Phase)))
def test_transition_table(src: Phase, dst: Phase):
    life = _at(src)
    if dst is src or dst in ALLOWED[src]:
        life.move(dst)
        assert life.phase is dst
    else:
        with pytest.raises(IllegalTransition):
            life.move(dst)
        assert life.phase is src


def test_the_first_failure_text_wins_unless_overwritten():
    life = Lifecycle()
    assert life.status is Status.RUNNING
    life.end(Status.FAILED, "first")
    life.end(Status.FAILED, "second")
    assert life.failure == "first"
    life.end(Status.KILLED, "cancelled", end_reason="cancelled", overwrite=True)
    assert (life.status, life.failure, life.end_reason) == (Status.KILLED, "cancelled", "cancelled")
