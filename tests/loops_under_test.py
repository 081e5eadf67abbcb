"""Cooperative loops with deliberate faults, for test_e2e_cooperative (the ranks import this file through
PYTHONPATH, which the test points at tests/)."""
from __future__ import annotations

import os
import time
from typing import Any

import torch.nn.functional as F

import flodl_exp

GATE_ENV = "FLODL_TEST_LOOP_GATE"
GATE_MAX_WAIT_S = 120.0


def hold_then_raise(cfg: Any) -> None:
    """Rank 1 takes its first batch and holds it without ``w.step()`` until the test creates the gate file,
    then raises (a bug in the user's loop); every other rank trains normally."""
    with flodl_exp.worker() as w:
        for _epoch in w.epochs():
            for x, y in w.batches():
                if w.rank == 1:
                    gate = os.environ[GATE_ENV]
                    deadline = time.monotonic() + GATE_MAX_WAIT_S
                    while not os.path.exists(gate) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    raise ValueError("deliberate bug in the user's loop")
                loss = F.cross_entropy(w.model(x), y)
                loss.backward()
                w.step(w.optimizer, loss=loss)
