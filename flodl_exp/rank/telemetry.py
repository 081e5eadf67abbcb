"""Per-rank resource telemetry: CPU%, RSS and (with an NVIDIA driver) GPU utilisation and memory.

Why: a rank that reads slow may be starved of CPU, swapping, or sharing its
GPU; the coordinator cannot see that from step times alone. A daemon thread
samples every ``sample_s`` (0.5 s) and sends the mean of its samples as
``Message("telemetry", {"cpu_pct", "rss_gb", "gpu_util", "mem_gb", "gpu_proc_mem_gb"})``
every ``report_s`` (1 s). The coordinator averages them per epoch and logs
``rank<r>/<key>``.

- ``cpu_pct``: process CPU time (user + system, all threads, /proc/self/stat)
  over wall time, in percent of one core (200 = two busy cores).
- ``rss_gb``: resident set size (VmRSS of /proc/self/status), GiB.
- ``gpu_util``: NVML utilisation of the rank's GPU, percent (absent on a MIG
  instance: NVML does not report it there).
- ``mem_gb``: NVML used memory of the rank's GPU (or MIG instance), GiB. Device-wide:
  ranks sharing one GPU each report the same total, so do not sum it over ranks.
- ``gpu_proc_mem_gb``: this process's own GPU memory, GiB: NVML's per-process
  figure (CUDA context included) when NVML lists our pid, else (containers
  with their own pid namespace, WDDM) the caching allocator's reserve
  (``torch.cuda.memory_reserved``, no context). Summing it over ranks is right.

The rank's GPU is found by :func:`resolve_nvml_handle`: torch's device UUID,
else its ``CUDA_VISIBLE_DEVICES`` entry, else the plain index (see there why).

No pynvml, no driver, or a CPU rank: one log line and CPU telemetry only.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterator
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
    from flodl_exp.rank.data.probe import proc_kib_field

    return proc_kib_field("/proc/self/status", "VmRSS")


def visible_entry(visible: Optional[str], index: int) -> Optional[str]:
    """The ``index``-th entry of a ``CUDA_VISIBLE_DEVICES`` value: what torch's ``cuda:<index>`` is
    (None when the variable is unset or has no such entry)."""
    if visible is None:
        return None
    entries = [e.strip() for e in visible.split(",")]
    return entries[index] if 0 <= index < len(entries) and entries[index] else None


def _norm(uuid: Any) -> str:
    return (uuid.decode() if isinstance(uuid, bytes) else str(uuid)).strip().lower()


def _nvml_devices(nvml: Any) -> Iterator[Any]:
    """Every NVML device handle: each GPU, then the MIG devices on it."""
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        yield h
        try:
            n = nvml.nvmlDeviceGetMaxMigDeviceCount(h)
        except Exception:  # NotSupported: no MIG on this GPU
            continue
        for j in range(n):
            try:
                yield nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except Exception:  # NotFound: an empty slot (or MIG mode off)
                continue


def _by_uuid(nvml: Any, candidates: list[str], *, prefix: bool = False) -> Any:
    """The handle whose NVML UUID is one of ``candidates`` (case-insensitive), or, with ``prefix``, the
    one device whose UUID starts with one (CUDA takes unambiguous UUID prefixes). None: no such device.

    ``nvmlDeviceGetHandleByUUID`` first; then a scan of all GPUs and MIG devices, for the MIG UUIDs
    that the direct lookup of some drivers does not take."""
    for c in candidates:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(c)
        except Exception:
            pass
    wanted = [_norm(c) for c in candidates]
    starts: list[Any] = []
    for h in _nvml_devices(nvml):
        try:
            u = _norm(nvml.nvmlDeviceGetUUID(h))
        except Exception:
            continue
        if u in wanted:
            return h
        if prefix and any(u.startswith(w) for w in wanted):
            starts.append(h)
    return starts[0] if len(starts) == 1 else None


def _legacy_mig(nvml: Any, entry: str) -> Any:
    """``MIG-GPU-<gpu uuid>/<gpu instance>/<compute instance>`` (drivers before R470): the MIG device with
    those instance ids on that GPU, or None."""
    try:
        gpu, gi, ci = entry[len("MIG-"):].split("/")
        gi_id, ci_id = int(gi), int(ci)
    except ValueError:
        return None
    parent = _by_uuid(nvml, [gpu], prefix=True)
    if parent is None:
        return None
    try:
        n = nvml.nvmlDeviceGetMaxMigDeviceCount(parent)
    except Exception:
        return None
    for j in range(n):
        try:
            h = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, j)
            if nvml.nvmlDeviceGetGpuInstanceId(h) == gi_id and nvml.nvmlDeviceGetComputeInstanceId(h) == ci_id:
                return h
        except Exception:
            continue
    return None


def resolve_nvml_handle(index: int, visible: Optional[str], torch_uuid: Optional[str], nvml: Any) -> tuple[Any, str]:
    """The NVML handle of torch's ``cuda:<index>`` and how it was found (``"uuid"``, ``"visible"``, ``"index"``).

    Pure: everything comes in as arguments (``nvml`` is the pynvml module or a fake with its functions).
    NVML numbers every GPU of the host in PCI order and ignores ``CUDA_VISIBLE_DEVICES``; torch's index
    ``i`` is the ``i``-th visible device. So, in order:

    1. ``torch_uuid`` (``str(torch.cuda.get_device_properties(i).uuid)``: 8-4-4-4-12 hex, no prefix)
       as ``GPU-<uuid>`` or ``MIG-<uuid>`` (a MIG instance), with or without a prefix already on it;
    2. the ``i``-th ``CUDA_VISIBLE_DEVICES`` entry: an integer is an NVML index (right when CUDA counts
       in PCI order, ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, hence after 1), else ``GPU-``/``MIG-`` UUIDs
       (full or an unambiguous prefix) and the old ``MIG-GPU-<uuid>/<gi>/<ci>`` form;
    3. ``index`` as an NVML index (no ``CUDA_VISIBLE_DEVICES``: the two numberings agree in PCI order).

    Raises what ``nvmlDeviceGetHandleByIndex`` raises when even 3 fails.
    """
    if torch_uuid:
        u = _norm(torch_uuid)
        bare = u[4:] if u.startswith(("gpu-", "mig-")) else u
        h = _by_uuid(nvml, [f"GPU-{bare}", f"MIG-{bare}"])
        if h is not None:
            return h, "uuid"
    entry = visible_entry(visible, index)
    if entry is not None:
        h = None
        digits = re.match(r"\d+", entry)
        if digits is not None:  # CUDA reads an entry like strtoul: "1gpu" is 1
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(int(digits.group()))
            except Exception:
                h = None
        elif entry.upper().startswith("MIG-GPU-"):
            h = _legacy_mig(nvml, entry)
        elif entry.upper().startswith(("GPU-", "MIG-")):
            h = _by_uuid(nvml, [entry], prefix=True)
        if h is not None:
            return h, "visible"
    return nvml.nvmlDeviceGetHandleByIndex(index), "index"


def torch_device_uuid(index: int) -> Optional[str]:
    """``str()`` of torch's device UUID (``_CUuuid``: 8-4-4-4-12 lower-case hex), None when unknown."""
    try:
        uuid = torch.cuda.get_device_properties(index).uuid
    except Exception:
        return None
    s = str(uuid)
    return s or None


class GpuProbe:
    """NVML handle for the rank's CUDA device; ``sample()`` -> ``{"mem_gb", "gpu_util", "gpu_proc_mem_gb"}``.

    ``nvml`` (default: pynvml), ``pid`` and ``reserved`` (the per-process fallback, default
    ``torch.cuda.memory_reserved``) are injectable for tests. A metric that NVML refuses here
    (utilisation on a MIG instance; the process list without permission) is dropped with one log
    line; ``nvmlDeviceGetMemoryInfo`` failing (the driver went away) raises.
    """

    def __init__(self, device: torch.device, *, nvml: Any = None, pid: Optional[int] = None,
                 reserved: Optional[Callable[[], float]] = None, rank: int = 0) -> None:
        if nvml is None:
            import pynvml  # ImportError when nvidia-ml-py is missing

            nvml = pynvml
        self.nvml = nvml
        self.rank = rank
        nvml.nvmlInit()
        try:
            idx = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", idx)
            self.handle, self.found_by = resolve_nvml_handle(
                idx, os.environ.get("CUDA_VISIBLE_DEVICES"), torch_device_uuid(idx), nvml)
        except BaseException:
            self.close()
            raise
        self.pid = os.getpid() if pid is None else pid
        self.reserved = reserved if reserved is not None else (lambda: float(torch.cuda.memory_reserved(self.device)))
        self.util_ok = True
        self.procs_ok = True

    def proc_mem_bytes(self) -> Optional[float]:
        """This process's GPU memory: NVML's per-process figure for our pid, else the allocator's reserve."""
        if self.procs_ok:
            try:
                used = [p.usedGpuMemory for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
                        if p.pid == self.pid and p.usedGpuMemory is not None]
                if used:
                    return float(sum(used))
            except Exception as e:  # NoPermission, NotSupported: the allocator's figure from now on
                log.info("rank %d: telemetry: NVML process list unavailable (%s), gpu_proc_mem_gb from "
                         "torch.cuda.memory_reserved", self.rank, type(e).__name__)
                self.procs_ok = False
        try:
            return float(self.reserved())
        except Exception:
            return None

    def sample(self) -> dict[str, float]:
        nv, h = self.nvml, self.handle
        out = {"mem_gb": float(nv.nvmlDeviceGetMemoryInfo(h).used) / GIB}
        if self.util_ok:
            try:
                out["gpu_util"] = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception as e:  # NotSupported on a MIG instance
                log.info("rank %d: telemetry: no GPU utilisation here (%s)", self.rank, type(e).__name__)
                self.util_ok = False
        proc = self.proc_mem_bytes()
        if proc is not None:
            out["gpu_proc_mem_gb"] = proc / GIB
        return out

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
        return GpuProbe(device, rank=rank)
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
                out.update(self.gpu.sample())
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
        from flodl_exp.protocol.wire import Message

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
            from flodl_exp.protocol.wire import Message

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
