"""Which runs task 0 hosts the collective's TCPStore for (jobs/collective_store.py)."""
from __future__ import annotations

import pytest

from flodl_exp.config import ClusterConfig
from flodl_exp.jobs.collective_store import needs_store


@pytest.mark.parametrize(("mode", "ranks", "expected"), [
    ({"policy": "cadence", "backend": "nccl"}, 2, True),
    ({"policy": "sync", "backend": "nccl"}, 1, False),  # one rank forms no group
    ({"policy": "cadence", "backend": "cpu"}, 2, False),
    # mode=auto may choose an nccl mode whatever its fallback (and a resumed choice may be one)
    ({"policy": "cadence", "backend": "cpu", "auto": True}, 2, True),
])
def test_a_store_for_every_run_that_may_form_a_group(mode, ranks, expected):
    assert needs_store({"mode": mode}, ClusterConfig(ranks_per_node=ranks)) is expected
