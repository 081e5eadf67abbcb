"""Per-rank resource telemetry: CPU%, RSS and (with an NVIDIA driver) GPU utilisation and memory.

Why: a rank that reads slow may be starved of CPU, swapping, or sharing its
GPU; the coordinator cannot see that from step times alone. A daemon thread
samples every ``sample_s`` (0.5 s) and sends the mean of its samples as
``Message("telemetry", {"cpu_pct", "rss_gb", "gpu_util", "mem_gb"})`` every
``report_s`` (1 s). The coordinator averages them per epoch and logs
``rank<r>/<key>``.

- ``cpu_pct``: process CPU time (user + system, all threads, /proc/self/stat)
  over wall time, in percent of one core (200 = two busy cores).
- ``rss_gb``: resident set size (VmRSS of /proc/self/status), GiB.
- ``gpu_util``: NVML utilisation of the rank's GPU, percent.
- ``mem_gb``: NVML used memory of the rank's GPU (device-wide), GiB.

No pynvml, no driver, or a CPU rank: one log line and CPU telemetry only.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("flodl_exp.telemetry")

GIB = float(1 << 30)
SAMPLE_S = 0.5
REPORT_S = 1.0


def read_cpu_seconds() -> Optional[float]:
    """utime + stime of this process (all threads) in seconds, from /proc/self/stat."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5), counted after "(comm)"
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def read_rss_bytes() -> Optional[int]:
    """VmRSS of this process in bytes, from /proc/self/status."""
    from .data.probe import proc_kib_field

    return proc_kib_field("/proc/self/status", "VmRSS")


class GpuProbe:
    """NVML handle for the rank's CUDA device; ``sample()`` -> (util %, used GiB)."""

    def __init__(self, device: torch.device) -> None:
        import pynvml  # ImportError when nvidia-ml-py is missing

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = self._handle(device)

    def _handle(self, device: torch.device) -> Any:
        """Match by UUID (CUDA_VISIBLE_DEVICES renumbers devices; NVML does not), else by index."""
        nv = self.nvml
        idx = device.index if device.index is not None else torch.cuda.current_device()
        try:
            uuid = str(torch.cuda.get_device_properties(idx).uuid)
            return nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception:
            return nv.nvmlDeviceGetHandleByIndex(idx)

    def sample(self) -> tuple[float, float]:
        util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
        mem = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used
        return float(util), float(mem) / GIB

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass


def open_gpu_probe(device: torch.device, rank: int = 0) -> Optional[GpuProbe]:
    """A GpuProbe for a CUDA rank, or None (logged once) when NVML is not usable."""
    if device.type != "cuda":
        log.info("rank %d: telemetry: CPU device, CPU telemetry only", rank)
        return None
    try:
        return GpuProbe(device)
    except ImportError:
        log.info("rank %d: telemetry: pynvml not installed (nvidia-ml-py), CPU telemetry only", rank)
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.info("rank %d: telemetry: no NVIDIA driver (%s), CPU telemetry only", rank, type(e).__name__)
    return None


class Telemetry:
    """The sampling thread; ``send`` must be thread-safe (the worker's ``conn.send`` is)."""

    def __init__(self, send: Callable[[Any], None], device: torch.device, *, rank: int = 0,
                 sample_s: float = SAMPLE_S, report_s: float = REPORT_S,
                 gpu: Optional[GpuProbe] = None, probe_gpu: bool = True) -> None:
        self.send = send
        self.rank = rank
        self.sample_s = float(sample_s)
        self.report_s = float(report_s)
        self.gpu = gpu if gpu is not None or not probe_gpu else open_gpu_probe(device, rank)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last_cpu = read_cpu_seconds()
        self._last_t = time.monotonic()
        self._sums: dict[str, list[float]] = {}
        self.sent = 0

    def sample(self) -> dict[str, float]:
        """One sample now (CPU% over the time since the previous sample)."""
        out: dict[str, float] = {}
        now, cpu = time.monotonic(), read_cpu_seconds()
        if cpu is not None and self._last_cpu is not None and now > self._last_t:
            out["cpu_pct"] = 100.0 * (cpu - self._last_cpu) / (now - self._last_t)
        self._last_cpu, self._last_t = cpu, now
        rss = read_rss_bytes()
        if rss is not None:
            out["rss_gb"] = rss / GIB
        if self.gpu is not None:
            try:
                out["gpu_util"], out["mem_gb"] = self.gpu.sample()
            except Exception as e:  # the driver went away mid-run: keep CPU telemetry
                log.info("rank %d: telemetry: GPU probe failed (%s), CPU telemetry only from now", self.rank, e)
                self.gpu.close()
                self.gpu = None
        return out

    def add(self, s: dict[str, float]) -> None:
        for k, v in s.items():
            acc = self._sums.setdefault(k, [0.0, 0])
            acc[0] += v
            acc[1] += 1

    def report(self) -> Optional[dict[str, float]]:
        """Means of the samples since the last report (None when there were none)."""
        if not self._sums:
            return None
        out = {k: s / n for k, (s, n) in self._sums.items() if n}
        self._sums = {}
        return out

    def _run(self) -> None:
        from ..wire import Message

        next_report = time.monotonic() + self.report_s
        while not self._stop.wait(self.sample_s):
            self.add(self.sample())
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + self.report_s
                fields = self.report()
                if fields:
                    try:
                        self.send(Message("telemetry", fields))
                        self.sent += 1
                    except Exception:  # connection closed: the rank is going down
                        return

    def start(self) -> Telemetry:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rank-telemetry", daemon=True)
            self._thread.start()
        return self

    def close(self, flush: bool = False) -> None:
        """Stop sampling; with ``flush``, first send one last report (a sample now plus what the
        last period collected), so a run shorter than a report interval still logs its telemetry."""
        already = self._stop.is_set()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        if flush and not already:
            from ..wire import Message

            self.add(self.sample())
            fields = self.report()
            if fields:
                try:
                    self.send(Message("telemetry", fields))
                    self.sent += 1
                except Exception:  # connection closed: nothing to flush to
                    pass
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
