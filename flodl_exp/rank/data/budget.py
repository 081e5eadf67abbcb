"""Data-plane budget laws (algorithms.md section 10). Pure: numbers in, numbers out.

Every sizing decision of the rank's data plane lives here so it can be unit
tested without a device, a dataset or a thread: the prefetch depth (VRAM law
on CUDA, reader-ring law on CPU), the per-rank RAM share and how it splits
between the reader ring and the sample cache, the disk-stage capacity, the
device-pool budget and the activation-peak calibration. The pipeline only
probes the machine (MemAvailable, cudaMemGetInfo) and calls these.

The VRAM budget of a CUDA rank (``vram_headroom``) is its part of
``vram_max_usage x total`` (split among the ranks sharing the GPU), less what
it holds live, the larger of the step's activation peak and a parameter
sync's working memory, and the device pool's whole capacity (allocated or
not). The prefetch window (ready batches plus the readers' copy temporaries)
and the pool are sized from what is left.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
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


def transient_reserve(activation_peak: int, sync_reserve: int) -> int:
    """VRAM held back for the training thread's transients: ``max(activation peak, sync working memory)``.

    A step's activations and a parameter sync's working memory (scratch clone
    of the parameters plus flat copies, ``SYNC_WORKSPACE_FACTOR`` x parameter
    bytes, see ``sync_reserve_bytes``) are both transients of the training
    thread, which runs one or the other, never both at once; neither is live
    when the budget is probed between chunks. Reserving the larger one covers
    both without counting twice a sync that the measured peak already saw.
    """
    return max(0, int(activation_peak), int(sync_reserve))


def vram_headroom(*, total: int, used: int, max_usage: float, reserve: int, own: Optional[int] = None,
                  ranks_on_device: int = 1, sync_reserve: int = 0, pool_pending: int = 0) -> int:
    """Bytes of this rank's VRAM budget not yet committed (may be negative).

    ``cap = total * clamp(max_usage)`` is the device's budget. ``ranks_on_device``
    ranks share the device, so this rank's part is ``cap // ranks_on_device``,
    charged with ``own`` (what this process's allocator holds live: parameters,
    optimizer state, the pool's allocated slabs, batches). It is also never more
    than what the device has left under the cap (``cap - used``, ``used`` being
    everyone's live memory): ranks that probe at the same moment each take at
    most their part, and a foreign process's memory still counts. With one rank
    per device (``own`` defaults to ``used``) it is ``cap - used``.

    Then the commitments that are not live at probe time come off:
    ``transient_reserve(reserve, sync_reserve)`` (the step's activation peak or
    a sync's working memory) and ``pool_pending``, the part of the device pool's
    capacity whose slabs are not allocated yet (the pool grows lazily but its
    whole capacity is spoken for).
    """
    cap = int(total * clamp_vram_usage(max_usage))
    k = max(1, int(ranks_on_device))
    own_b = int(used) if own is None else int(own)
    room = min(cap // k - own_b, cap - int(used))
    return room - transient_reserve(reserve, sync_reserve) - max(0, int(pool_pending))


def window_batches(depth: int, readers: int = 0) -> int:
    """Batches of device memory a prefetch window of ``depth`` may hold: the ready batches plus one batch of
    temporaries (staging copy, pool gather) per reader that is copying one, ``depth + min(depth, readers)``."""
    d = max(0, int(depth))
    return d + min(d, max(0, int(readers)))


def depth_for_room(batches: int, readers: int = 0) -> int:
    """The deepest window whose ``window_batches`` fit in ``batches`` batches of room."""
    q, r = max(0, int(batches)), max(0, int(readers))
    return q - r if q >= 2 * r else q // 2


def prefetch_depth_from_vram(per_sample_bytes: int, batch: int, *, is_cuda: bool, total: int, used: int,
                             max_usage: float, reserve: int, own: Optional[int] = None, ranks_on_device: int = 1,
                             sync_reserve: int = 0, pool_pending: int = 0, readers: int = 0) -> int:
    """Ready batches the VRAM budget affords: ``depth_for_room(vram_headroom(...) // batch_bytes, readers)``.

    CPU device or unknown batch size -> 2. ``used`` is what is live on the
    device now (other processes, parameters, optimizer state, the pool's
    allocated slabs), ``own`` this process's part of it, ``reserve`` the
    measured activation peak, ``sync_reserve`` a sync's working memory and
    ``pool_pending`` the pool's not yet allocated capacity (see
    ``vram_headroom``); ``readers`` copying at once each hold one more batch
    of temporaries (``window_batches``). No double-buffer floor: depth 0 means the synchronous
    fallback, which the pipeline logs.
    """
    batch_bytes = int(per_sample_bytes) * int(batch)
    if not is_cuda or batch_bytes <= 0:
        return CPU_PREFETCH_DEPTH
    budget = vram_headroom(total=total, used=used, max_usage=max_usage, reserve=reserve, own=own,
                           ranks_on_device=ranks_on_device, sync_reserve=sync_reserve, pool_pending=pool_pending)
    return depth_for_room(max(0, budget // batch_bytes), readers)


def chunk_depth(depth: int, chunk_batches: int, install_pool: bool = False) -> int:
    """Never deeper than the chunk; collapsed to the flow reserve on the pool-install chunk."""
    d = min(max(0, int(depth)), max(0, int(chunk_batches)))
    if install_pool:
        d = min(d, FLOW_RESERVE_BATCHES)
    return d


def flow_reserve_bytes(depth: int, batch_bytes: int, readers: int = 0) -> int:
    """VRAM left to the batch channel when the device pool takes its budget (``window_batches`` of the depth)."""
    return max(window_batches(depth, readers), 1) * max(int(batch_bytes), 0)


def vram_pool_budget(*, total: int, used: int, max_usage: float, activation_peak: int, flow_reserve: int,
                     own: Optional[int] = None, ranks_on_device: int = 1, sync_reserve: int = 0) -> int:
    """Device-pool bytes: this rank's headroom (``vram_headroom``: its part of the device budget after live memory,
    the step peak or a sync's working memory) less the flow reserve and a margin.

    The whole result is the pool's capacity and stays charged to the budget
    (``pool_pending``) until its slabs are allocated.
    """
    room = vram_headroom(total=total, used=used, max_usage=max_usage, reserve=activation_peak, own=own,
                         ranks_on_device=ranks_on_device, sync_reserve=sync_reserve)
    return max(0, room - int(flow_reserve) - VRAM_POOL_MARGIN)


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


def update_activation_peak(prev: int, peak_allocated: int, baseline: int, batch_bytes: int, depth: int = 0,
                           readers: int = 0) -> int:
    """Later chunk boundaries: the worst step seen, net of the data plane's own budgeted bytes.

    ``peak_allocated - baseline`` is the window's high-water mark above what
    is live at its end. While the window ran, the data plane itself held up
    to ``window_batches(depth, readers)`` batches (ready ones and the readers'
    temporaries) plus the one being trained on; the depth law already charges
    those (and the batch in use was live when the first peak was calibrated),
    so ``(window_batches + 1) * batch_bytes`` comes off before the mark is
    compared with the step peak. Folding them in
    instead made the peak absorb the prefetch window: a deeper window raised
    the reserve, the reserve never shrinks, so depth could only decay over a
    run. The pool's slabs cancel out (allocated during the window, they are
    in ``baseline`` too). The rule stays conservative: the result never
    shrinks below ``prev`` (the clean depth-0 calibration or a worse window),
    so a genuinely larger step, or data-plane temporaries the depth law does
    not charge, still raise it, once.
    """
    dp = (window_batches(depth, readers) + 1) * max(0, int(batch_bytes))
    return max(int(prev), int(peak_allocated) - int(baseline) - dp)


SYNC_WORKSPACE_FACTOR = 5
"""A parameter sync's working memory in parameter bytes: the scratch clone kept for a retry, the flat
all-reduce buffer, its averaged slice, and the pre/post flat copies for the divergence."""


def sync_reserve_bytes(param_bytes: int, factor: int = SYNC_WORKSPACE_FACTOR) -> int:
    """VRAM a sync allocates on top of what is live: ``factor x`` the parameter (and float buffer) bytes."""
    return max(0, int(factor) * int(param_bytes))


def _listed(value: Optional[str]) -> int:
    """Entries of a comma-separated list such as ``SLURM_STEP_GPUS`` (0 when unset or empty)."""
    return len([e for e in (value or "").split(",") if e.strip()])


def node_devices(env: Mapping[str, str]) -> int:
    """GPUs (or MIG slices) the node's tasks are spread over when each task sees one of them; 0 = not known.

    ``FLODL_NODE_DEVICES`` (the local launcher gave each task one MIG slice), else SLURM's per-task binding:
    ``--gpus-per-task`` (every task its own GPUs: as many as tasks, ``sys.maxsize``) or the step's GPUs
    (``SLURM_STEP_GPUS``, ``SLURM_JOB_GPUS``) when ``--gpu-bind`` gave each task a part of them."""
    from flodl_exp.constants import NODE_DEVICES_ENV

    if (env.get(NODE_DEVICES_ENV) or "").strip().isdigit():
        return int(env[NODE_DEVICES_ENV])
    per_task = (env.get("SLURM_GPUS_PER_TASK") or "").strip()
    if per_task and per_task.split(":")[-1].isdigit() and int(per_task.split(":")[-1]) > 0:
        return sys.maxsize
    return max(_listed(env.get("SLURM_STEP_GPUS")), _listed(env.get("SLURM_JOB_GPUS")))


def ranks_sharing_device(ranks_per_node: int, device_count: int, local_rank: int,
                         env: Optional[Mapping[str, str]] = None) -> int:
    """Ranks of a node on ``local_rank``'s GPU when rank ``r`` takes ``cuda:(r % device_count)`` (at least 1).

    A task that sees a single GPU under per-task binding (SLURM ``--gpus-per-task``, ``--gpu-bind``, or one MIG
    slice per local task: :func:`node_devices` of ``env``, default the process's) shares it only with the ranks
    bound to the same one, ``r % n == local_rank % n`` over the node's ``n`` devices, not with every rank of
    the node: counting them all split the VRAM budget for nothing."""
    n = max(1, int(ranks_per_node))
    g = int(device_count)
    if g <= 0:
        return 1
    if g == 1 and n > 1:
        spread = node_devices(os.environ if env is None else env)
        if spread > 1:
            g = min(spread, n)
    mine = int(local_rank) % g
    return max(1, sum(1 for r in range(n) if r % g == mine))


def vram_pool_enabled(config_flag: bool, env_value: Optional[str]) -> bool:
    """vram_pool config flag AND NOT the runtime kill switch FLODL_VRAM_POOL=off|0|false|no."""
    if not config_flag:
        return False
    if env_value is None:
        return True
    return env_value.strip().lower() not in ("off", "0", "false", "no")
