"""What time each thing takes in the simulated rig (pure arithmetic, milliseconds).

* **A step** on rank r: its declared ``step_ms`` (times ``1 + jitter x N(0,1)``, floored at 5 % of it),
  after ``data_ms`` of data wait (plus ``chunk_start_ms`` on the first batch of a chunk: the pipeline
  refills), then ``batch_message_ms`` to send its timing report.
* **nccl reduce** (a ring all-reduce once every member entered it): two ring passes over the parameters,
  ``2 (W-1)/W x bytes / bandwidth``, plus ``2 (W-1)`` hops of latency for the parameters and as many for
  the scalar mass all-reduce before them, plus ``collective_fixed_ms``.
* **cpu reduce** (gather, average, scatter through the coordinator): each snapshot crosses the rank's link
  and then the coordinator's NIC, one at a time (a FIFO at ``coordinator_gbps``); the average takes
  ``movers x bytes / average_gbps``; the W updates leave through the NIC one after another; plus
  ``collective_fixed_ms`` (the coordinator's own work on a reduce).
* **Control messages** (chunks, SyncNow, RequestParams, updates, acks, batch reports) take ``latency_ms``
  one way; their size is ignored except for snapshots and updates.
"""
from __future__ import annotations

from dataclasses import dataclass

from flodl_exp.simulate.topology import LinkConfig


@dataclass(frozen=True)
class Costs:
    link: LinkConfig
    model_bytes: float
    """Bytes a snapshot or an update carries (half the parameters under bf16_wire)."""

    @property
    def latency_s(self) -> float:
        return self.link.latency_ms / 1e3

    def _bits_per_s(self, gbps: float) -> float:
        return max(gbps, 1e-9) * 1e9

    def allreduce_s(self, members: int) -> float:
        """Ring all-reduce of the parameters (and the scalar masses first) among ``members`` ranks."""
        if members < 2:
            return self.link.collective_fixed_ms / 1e3
        w = members
        hops = 2 * (w - 1)
        wire = 2 * (w - 1) / w * self.model_bytes * 8 / self._bits_per_s(self.link.bandwidth_gbps)
        return 2 * hops * self.latency_s + wire + self.link.collective_fixed_ms / 1e3

    def nic_s(self) -> float:
        """One snapshot or update through the coordinator's NIC (or the rank's link, when slower)."""
        coord = self.link.coordinator_gbps if self.link.coordinator_gbps is not None else self.link.bandwidth_gbps
        return self.model_bytes * 8 / self._bits_per_s(min(coord, self.link.bandwidth_gbps))

    def average_s(self, movers: int) -> float:
        """The coordinator's weighted average of ``movers`` snapshots."""
        return movers * self.model_bytes * 8 / self._bits_per_s(self.link.average_gbps)

    def fixed_s(self) -> float:
        """The fixed part of one reduce, either backend (``collective_fixed_ms``)."""
        return self.link.collective_fixed_ms / 1e3

    def scatter_s(self, members: int) -> float:
        """The W updates leaving the coordinator's NIC one after another."""
        return members * self.nic_s()
