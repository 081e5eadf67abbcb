"""What-if simulator: a declared rig (step times, link, model size, data, modes, guard, outer optimizer) run
through the coordinator's real components (ElChe, chunk pools, dispatch, the reduce gate, guards) against a
discrete-event clock. ``python -m flodl_exp.simulate`` (conf/simulate/); README section "What-if simulator".

* topology.py: the rig's typed configs (ConfigStore group ``flodl_simulate``) and derived values
* clock.py: the simulated clock and the event heap
* costs.py: step, collective, gather/scatter and message times
* engine.py: the coordinator's components paced by simulated ranks
* report.py: the table, the plot, events.jsonl
"""
from __future__ import annotations

from typing import Any


def no_step(*args: Any) -> None:
    """The train step a simulated run names (the run schema requires one; nothing is trained)."""
    raise RuntimeError("flodl_exp.simulate trains nothing")
