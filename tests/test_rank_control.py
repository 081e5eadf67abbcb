"""The rank's control handlers, without a coordinator: what adopting an update does to the window; and the
inbox they read from: deferred work first, unreadable frames dropped, a silent or lost coordinator fatal."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rank_fakes import Sent, rank_control

from flodl_exp.protocol.codec import encode
from flodl_exp.protocol.messages import CoordHeartbeat, Save, SaveResult, Shutdown, StartEpoch, Update
from flodl_exp.protocol.wire import Message
from flodl_exp.rank.control import RankControl
from flodl_exp.rank.inbox import ControlInbox, CoordinatorLost


def _control(steps_since_avg: int) -> tuple[RankControl, Sent]:
    """A rank waiting on an update while throttled: the handlers only, no connection or data plane."""
    trainer = SimpleNamespace(steps_since_avg=steps_since_avg, model=torch.nn.Linear(2, 1))
    ctl, sent = rank_control(trainer)
    ctl.awaiting_update = True
    ctl.throttled = True
    return ctl, sent


def test_adopting_an_update_resets_the_window():
    """Batches trained after the snapshot (13 - 10 here) are overwritten by the update: none carries over."""
    ctl, _ = _control(13)
    ctl.handle(Update(n=10, skip=True))
    assert ctl.trainer.steps_since_avg == 0 and not ctl.awaiting_update and not ctl.throttled


def test_a_blended_update_moves_the_replica_halfway():
    ctl, _ = _control(4)
    model = ctl.trainer.model
    assert isinstance(model, torch.nn.Linear)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    ctl.handle(Update(n=4, alpha=0.5, tensors={"p0": torch.full((1, 2), 3.0), "p1": torch.full((1,), 3.0)}))
    assert torch.allclose(model.weight, torch.full((1, 2), 2.0)) and ctl.trainer.steps_since_avg == 0


def test_a_consensus_save_writes_the_consensus_not_the_blended_replica(tmp_path):
    from flodl_exp.checkpoint import load_model_state

    ctl, sent = _control(0)
    model = ctl.trainer.model
    assert isinstance(model, torch.nn.Linear)
    ctl.trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.weight.fill_(1.0)
    consensus = {"p0": torch.full((1, 2), 3.0), "p1": torch.full((1,), 3.0)}
    ctl.handle(Update(n=1, alpha=0.5, tensors=consensus))  # the replica is now halfway: 2.0
    stem = str(tmp_path / "b")
    ctl.handle(Save(stem=stem, primary=True, model=True, consensus=True))
    state = load_model_state(stem, map_location="cpu")
    assert torch.equal(state["weight"], consensus["p0"]) and torch.equal(state["bias"], consensus["p1"])
    assert torch.allclose(model.weight, torch.full((1, 2), 2.0)), "the replica itself is untouched"
    ctl.handle(Save(stem=stem, primary=True, model=True, consensus=False))
    assert torch.allclose(load_model_state(stem, map_location="cpu")["weight"], torch.full((1, 2), 2.0))
    assert sent == [SaveResult(stem=stem), SaveResult(stem=stem)], "each save is answered, without an error"


# ---------------------------------------------------------------- the inbox the main thread reads
def test_the_inbox_hands_out_deferred_work_first_and_drops_what_it_cannot_read():
    inbox = ControlInbox(coord_timeout=30.0)
    inbox.put(Message(kind="start_epoch", fields={"epoch": -1}))  # malformed: dropped, not fatal
    inbox.put(Message(kind="from_a_newer_version"))  # unknown: ignored
    inbox.put(encode(Shutdown(reason="done")))
    inbox.defer(StartEpoch(epoch=0, offset=0, size=8, chunk=1))
    assert inbox.has_waiting()
    got = [inbox.next(block=False, stopping=False) for _ in range(4)]
    assert got == [StartEpoch(epoch=0, offset=0, size=8, chunk=1), None, None, Shutdown(reason="done")]
    assert not inbox.has_waiting() and inbox.next(block=False, stopping=False) is None


def test_a_bundle_frame_hands_out_its_messages_in_order_before_the_next_frame():
    """The cpu reduce's flush sends a rank's update and what follows it in one frame (codec.bundle)."""
    from flodl_exp.protocol.codec import bundle
    from flodl_exp.protocol.messages import SetGlobalStep, StageAdvisory, Update

    inbox = ControlInbox(coord_timeout=30.0)
    consensus = {"p0": torch.arange(3.0)}
    frame = bundle([Update(n=2, tensors=consensus, next_plan=[1, 0, 8, 4]), SetGlobalStep(global_step=9),
                    StageAdvisory(segments=[[1, 8, 8]], counts=[])])
    frame.fields["parts"].insert(2, {"kind": "start_epoch", "fields": {"epoch": -1}})  # a malformed part: dropped
    inbox.put(frame)
    inbox.put(encode(Shutdown(reason="done")))
    assert inbox.has_waiting()
    got = [inbox.next(block=False, stopping=False) for _ in range(4)]
    upd = got[0]
    assert isinstance(upd, Update) and upd.n == 2 and torch.equal(upd.tensors["p0"], consensus["p0"])
    assert got[1:] == [SetGlobalStep(global_step=9), StageAdvisory(segments=[[1, 8, 8]], counts=[]),
                       Shutdown(reason="done")]
    inbox.put(Message(kind="bundle", fields={"parts": [{"kind": "bundle", "fields": {}}]}))  # nested: dropped whole
    assert inbox.next(block=False, stopping=False) is None and not inbox.has_waiting()


def test_a_silent_or_lost_coordinator_ends_the_rank_unless_it_is_stopping():
    now = [0.0]
    inbox = ControlInbox(coord_timeout=10.0, clock=lambda: now[0])
    now[0] = 9.0
    assert inbox.read(block=False, stopping=False) is None, "within the deadline: nothing yet"
    inbox.put(encode(CoordHeartbeat()))
    assert inbox.read(block=False, stopping=False) == CoordHeartbeat()  # a frame moves the deadline
    now[0] = 19.5
    with pytest.raises(CoordinatorLost, match="no word from the coordinator for 10s"):
        inbox.read(block=False, stopping=False)
    inbox.put(ConnectionResetError("peer closed"))
    assert inbox.read(block=False, stopping=True) is None, "the run is over: a closed connection is expected"
    inbox.put(ConnectionResetError("peer closed"))
    with pytest.raises(CoordinatorLost, match="connection lost: peer closed"):
        inbox.read(block=False, stopping=False)
