"""Machine probes for the budget laws: MemAvailable and the CUDA memory counters.

Kept apart from ``budget.py`` so the laws stay pure; every probe degrades to
``None`` (unknown) instead of raising, and the laws have an answer for
unknown.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

RAM_BUDGET_ENV = "FLODL_RAM_BUDGET_BYTES"
"""Force this rank's RAM share in bytes (tests, memory-capped containers); overrides ram_max_usage x MemAvailable."""
READERS_ENV = "FLODL_DATA_READERS"
"""Reader threads per rank (default 4; 1 for data sets whose get_batch is not thread-safe)."""
VRAM_POOL_ENV = "FLODL_VRAM_POOL"


def proc_kib_field(path: str, key: str) -> Optional[int]:
    """A ``Key:  <n> kB`` line of a /proc file, in bytes (None off Linux or when absent)."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def mem_available() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes (None off Linux)."""
    return proc_kib_field("/proc/meminfo", "MemAvailable")


def forced_ram_budget() -> Optional[int]:
    v = os.environ.get(RAM_BUDGET_ENV)
    if v is None or not v.strip():
        return None
    return max(0, int(float(v)))


def cuda_memory(device: torch.device) -> tuple[int, int]:
    """(total, live) bytes on ``device``: live = used by anyone minus our allocator's cached free blocks.

    Cached-but-free blocks are ours to reuse, so counting them as used would
    charge the last step's activations twice (they are in the reserve).
    """
    free, total = torch.cuda.mem_get_info(device)
    cached_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(total), max(0, int(total - free - cached_free))
