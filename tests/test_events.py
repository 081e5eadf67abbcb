"""The event log's records (flodl_exp/events.py): one dataclass per kind, written as the JSON the readers expect."""
from __future__ import annotations

import dataclasses

import pytest

from flodl_exp import events as ev


def test_every_kind_has_one_unique_name():
    names = [c.EVENT for c in ev.EventRecord.__subclasses__()]
    assert all(names) and len(names) == len(set(names)) == len(ev.KINDS)


def test_a_record_is_its_fields_under_its_kind():
    assert ev.Stop(rank=1, asked_epoch=1, last_epoch=2).record() == {
        "event": "stop", "rank": 1, "asked_epoch": 1, "last_epoch": 2}


def test_flat_fields_become_top_level_keys():
    rec = ev.Epoch(epoch=3, metrics={"loss": 0.5, "rank0/batch_share": 0.75}).record()
    assert rec == {"event": "epoch", "epoch": 3, "loss": 0.5, "rank0/batch_share": 0.75}


def test_optional_fields_are_left_out_while_none():
    assert ev.Retrain(rank=2, picks=7).record() == {"event": "retrain", "rank": 2, "picks": 7}
    assert ev.Retrain(rank=2, picks=7, why="answer_not_in_consensus").record()["why"] == "answer_not_in_consensus"
    assert ev.Checkpoint(stem="s", epoch=None).record() == {"event": "checkpoint", "stem": "s", "epoch": None}


def test_records_are_frozen_and_need_every_field():
    r = ev.FirstBatch(rank=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.rank = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        ev.RankDead(rank=1)  # type: ignore[call-arg]
