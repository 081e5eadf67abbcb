"""Data-plane budget laws (algorithms.md section 10). Pure: numbers in, numbers out.

Every sizing decision of the rank's data plane lives here so it can be unit
tested without a device, a dataset or a thread: the prefetch depth (VRAM law
on CUDA, reader-ring law on CPU), the per-rank RAM share and how it splits
between the reader ring and the sample cache, the disk-stage capacity, the
device-pool budget and the activation-peak calibration. The pipeline only
probes the machine (MemAvailable, cudaMemGetInfo) and calls these.
"""
from __future__ import annotations

from typing import Optional

MIB = 1 << 20
GIB = 1 << 30

RING_SLOTS_WITH_CACHE = 8
"""Cap on the reader ring of a CUDA rank (a retained tier sits beside it: the ring only absorbs jitter)."""
RING_SLOTS_UNKNOWN = 4
"""Ring slots while the batch size in bytes (or MemAvailable) is still unknown."""
FLOW_RESERVE_BATCHES = 16
"""Prefetch depth cap on the chunk where the device pool takes its one-shot budget."""
VRAM_POOL_MARGIN = 512 * MIB
"""Free VRAM the device pool never claims (allocator fragmentation, cuDNN workspaces)."""
VRAM_POOL_SLAB = 64 * MIB
"""Device-pool allocation granularity."""
CPU_PREFETCH_DEPTH = 2
"""prefetch_depth_from_vram on a CPU device (the ring law decides the real depth there)."""


def clamp_vram_usage(x: float) -> float:
    """vram_max_usage is clamped to [0.5, 0.99]: 0.0 means 0.5, never "off"."""
    return min(max(float(x), 0.50), 0.99)


def clamp_ram_usage(x: float) -> float:
    """ram_max_usage is clamped to [0, 0.9]; 0 disables retention and the ring."""
    return min(max(float(x), 0.0), 0.90)


def anchored_ram_budget(available: int, held: int, r: float) -> int:
    """``min(r, 0.9) * (available + held)``: bytes the data plane may hold.

    ``held`` is what the data plane already holds, so re-probing MemAvailable
    after filling the cache does not shrink the budget by our own bytes.
    """
    return int(clamp_ram_usage(r) * (max(0, int(available)) + max(0, int(held))))


def rank_ram_share(available: Optional[int], held: int, r: float, ranks_per_node: int) -> int:
    """This rank's part of the node's budget: co-hosted ranks split it evenly.

    Unknown MemAvailable (no /proc/meminfo) yields 0: no retention rather than a guess.
    """
    if available is None or r <= 0:
        return 0
    return anchored_ram_budget(available, held, r) // max(1, int(ranks_per_node))


def split_share(share: int, sample_cache: bool) -> tuple[int, int]:
    """(cache bytes, ring bytes): 3:1 between retained samples and the ready-batch ring.

    With the cache off the ring keeps the whole share (it is then the only
    thing the share pays for).
    """
    share = max(0, int(share))
    if not sample_cache:
        return 0, share
    cache = share * 3 // 4
    return cache, share - cache


def ring_slots(batch_bytes: int, ring_bytes: int, chunk_batches: int, cuda_prefetch: bool = False) -> int:
    """Reader-ring depth (ring_slots_from_ram): ready batches the ring's bytes hold, never more than the chunk.

    ``ring_bytes`` is this rank's ring share (ram_max_usage x MemAvailable,
    split among co-hosted ranks and with the cache); 0 -> 0, the single-stage
    synchronous fetch. Batch bytes still unknown (before the first batch) ->
    ``min(4, chunk)``. A CUDA prefetch path is capped at 8: a retained tier
    sits beside the ring, which only absorbs jitter.
    """
    if ring_bytes <= 0 or chunk_batches <= 0:
        return 0
    if batch_bytes <= 0:
        slots = min(RING_SLOTS_UNKNOWN, chunk_batches)
    else:
        slots = min(int(ring_bytes) // int(batch_bytes), chunk_batches)
    if cuda_prefetch:
        slots = min(slots, RING_SLOTS_WITH_CACHE)
    return max(0, int(slots))


def prefetch_depth_from_vram(per_sample_bytes: int, batch: int, *, is_cuda: bool, total: int, used: int,
                             max_usage: float, reserve: int) -> int:
    """Ready batches the VRAM budget affords: ``(total * clamp(max_usage) - used - reserve) // batch_bytes``.

    CPU device or unknown batch size -> 2. ``used`` is what is live on the
    device now (other processes, parameters, optimizer state, the pool) and
    ``reserve`` the measured activation peak, which is not live between
    steps but will be during the next one. No double-buffer floor: depth 0
    means the synchronous fallback, which the pipeline logs.
    """
    batch_bytes = int(per_sample_bytes) * int(batch)
    if not is_cuda or batch_bytes <= 0:
        return CPU_PREFETCH_DEPTH
    cap = int(total * clamp_vram_usage(max_usage))
    budget = cap - int(used) - int(reserve)
    return max(0, budget // batch_bytes)


def chunk_depth(depth: int, chunk_batches: int, install_pool: bool = False) -> int:
    """Never deeper than the chunk; collapsed to the flow reserve on the pool-install chunk."""
    d = min(max(0, int(depth)), max(0, int(chunk_batches)))
    if install_pool:
        d = min(d, FLOW_RESERVE_BATCHES)
    return d


def flow_reserve_bytes(depth: int, batch_bytes: int) -> int:
    """VRAM left to the batch channel when the device pool takes its budget."""
    return max(int(depth), 1) * max(int(batch_bytes), 0)


def vram_pool_budget(*, total: int, used: int, max_usage: float, activation_peak: int, flow_reserve: int) -> int:
    """Device-pool bytes: what the VRAM budget leaves after live memory, the step peak, the flow reserve and a margin."""
    cap = int(total * clamp_vram_usage(max_usage))
    return max(0, cap - int(used) - int(activation_peak) - int(flow_reserve) - VRAM_POOL_MARGIN)


def rows_for(budget_bytes: int, row_bytes: int, samples: int) -> int:
    """How many whole samples fit a byte budget (never more than the data set holds)."""
    if row_bytes <= 0 or budget_bytes <= 0:
        return 0
    return int(min(budget_bytes // row_bytes, samples))


def disk_stage_bytes(disk_stage_gb: float) -> int:
    """disk_stage_gb in bytes (GiB); <= 0 is off."""
    return max(0, int(float(disk_stage_gb) * GIB))


def first_activation_peak(peak_allocated: int, current_allocated: int) -> int:
    """Peak after the first (synchronous) step: ``max(peak - current, 1)`` so 1 means calibrated."""
    return max(int(peak_allocated) - int(current_allocated), 1)


def update_activation_peak(prev: int, peak_allocated: int, baseline: int, batch_bytes: int) -> int:
    """Later chunk boundaries: the worst step seen, never shrinking (the batch itself is not activation)."""
    return max(int(prev), int(peak_allocated) - int(baseline) - int(batch_bytes))


def vram_pool_enabled(config_flag: bool, env_value: Optional[str]) -> bool:
    """vram_pool config flag AND NOT the runtime kill switch FLODL_VRAM_POOL=off|0|false|no."""
    if not config_flag:
        return False
    if env_value is None:
        return True
    return env_value.strip().lower() not in ("off", "0", "false", "no")
