"""Tests for flodl_exp/rank/telemetry.py: /proc probes, the sampling thread, NVML fallbacks, e2e metrics."""
from __future__ import annotations

import logging
import sys
import time
import types

import pytest
import torch

from flodl_exp.protocol.wire import Message
from flodl_exp.rank import telemetry as T

from conftest import base_overrides, run_cli, run_id_of, wait_for

CUDA = torch.cuda.is_available()


def test_proc_probes():
    cpu = T.read_cpu_seconds()
    rss = T.read_rss_bytes()
    assert cpu is not None and cpu > 0
    assert rss is not None and rss > 10 * 2**20


class _Clock:
    """A fake monotonic clock and a process CPU-seconds counter the test moves by hand."""

    def __init__(self) -> None:
        self.t = 100.0
        self.cpu = 5.0

    def monotonic(self) -> float:
        return self.t


def test_cpu_pct_is_cpu_time_over_wall_time(monkeypatch):
    clk = _Clock()
    monkeypatch.setattr(T, "time", types.SimpleNamespace(monotonic=clk.monotonic))
    monkeypatch.setattr(T, "read_cpu_seconds", lambda: clk.cpu)
    tel = T.Telemetry(lambda m: None, torch.device("cpu"), probe_gpu=False)
    clk.t += 0.5
    clk.cpu += 0.5  # one core busy for the whole interval
    busy = tel.sample()
    clk.t += 0.5
    clk.cpu += 0.0  # idle
    idle = tel.sample()
    clk.t += 0.25
    clk.cpu += 0.5  # two cores busy
    both = tel.sample()
    assert busy["cpu_pct"] == pytest.approx(100.0)
    assert idle["cpu_pct"] == pytest.approx(0.0)
    assert both["cpu_pct"] == pytest.approx(200.0)
    assert 0 < busy["rss_gb"] < 64 and "gpu_util" not in busy
    no_time = tel.sample()  # no wall time passed: no cpu_pct rather than a division by zero
    assert "cpu_pct" not in no_time and "rss_gb" in no_time


def test_cpu_pct_is_positive_after_real_cpu_work():
    """The real /proc probe: spin until the process has used CPU time (bounded), whatever the machine's speed."""
    tel = T.Telemetry(lambda m: None, torch.device("cpu"), probe_gpu=False)
    tel.sample()
    start = T.read_cpu_seconds()
    assert start is not None
    deadline = time.monotonic() + 60
    x = 0
    while (T.read_cpu_seconds() or 0.0) - start < 0.05 and time.monotonic() < deadline:
        x += 1
    busy = tel.sample()
    assert busy["cpu_pct"] > 0, busy
    assert 0 < busy["rss_gb"] < 64


def test_thread_reports_once_per_report_interval(monkeypatch):
    """_run on a fake clock: sampled every 0.25 s, reported every 1 s -> exactly one mean of 4 samples a second."""
    clk = _Clock()
    monkeypatch.setattr(T, "time", types.SimpleNamespace(monotonic=clk.monotonic))
    monkeypatch.setattr(T, "read_cpu_seconds", lambda: clk.cpu)

    class Stop:  # stands in for the thread's Event: each wait moves the clock; stops after 16 waits
        left = 16

        def wait(self, dt):
            if self.left == 0:
                return True
            self.left -= 1
            clk.t += dt
            clk.cpu += dt / 2  # half a core
            return False

    sent: list[Message] = []
    tel = T.Telemetry(sent.append, torch.device("cpu"), sample_s=0.25, report_s=1.0, probe_gpu=False)
    tel._stop = Stop()  # type: ignore[assignment]
    tel._run()
    assert len(sent) == 4 and tel.sent == 4
    for m in sent:
        assert m.kind == "telemetry"
        assert set(m.fields) == {"cpu_pct", "rss_gb"}
        assert m.fields["cpu_pct"] == pytest.approx(50.0)


def test_thread_sends_telemetry_messages_until_closed():
    sent: list[Message] = []
    tel = T.Telemetry(sent.append, torch.device("cpu"), sample_s=0.05, report_s=0.2, probe_gpu=False).start()
    try:
        wait_for(lambda: len(sent) >= 2, timeout=60, what="two telemetry reports")
    finally:
        tel.close()
    assert tel._thread is not None and not tel._thread.is_alive()
    n = len(sent)
    assert tel.sent == n
    for m in sent:
        assert m.kind == "telemetry"
        assert set(m.fields) == {"cpu_pct", "rss_gb"}
        assert all(isinstance(v, float) for v in m.fields.values())
    assert len(sent) == n  # closed: no more reports


def test_report_is_the_mean_of_samples():
    tel = T.Telemetry(lambda m: None, torch.device("cpu"), probe_gpu=False)
    tel.add({"cpu_pct": 10.0, "rss_gb": 1.0})
    tel.add({"cpu_pct": 30.0, "rss_gb": 2.0, "gpu_util": 50.0})
    assert tel.report() == {"cpu_pct": 20.0, "rss_gb": 1.5, "gpu_util": 50.0}
    assert tel.report() is None


def test_a_closed_connection_ends_the_thread_quietly():
    def send(_m):
        raise ConnectionError("closed")

    tel = T.Telemetry(send, torch.device("cpu"), sample_s=0.02, report_s=0.02, probe_gpu=False).start()
    assert tel._thread is not None
    tel._thread.join(timeout=60)  # the first report hits the closed connection and the thread returns
    assert not tel._thread.is_alive()
    tel.close()


def test_cpu_rank_uses_no_nvml(caplog):
    with caplog.at_level(logging.INFO, logger="flodl_exp.telemetry"):
        assert T.open_gpu_probe(torch.device("cpu")) is None
    assert len(caplog.records) == 1 and "CPU telemetry only" in caplog.text


def test_no_pynvml_means_one_line_and_cpu_only(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with caplog.at_level(logging.INFO, logger="flodl_exp.telemetry"):
        tel = T.Telemetry(lambda m: None, torch.device("cuda:0"))
    assert tel.gpu is None
    assert len(caplog.records) == 1 and "pynvml not installed" in caplog.text
    s = tel.sample()
    assert "rss_gb" in s and "gpu_util" not in s


def test_no_driver_means_one_line_and_cpu_only(monkeypatch, caplog):
    class NVMLError(Exception):
        pass

    def init():
        raise NVMLError("Driver Not Loaded")

    fake = types.SimpleNamespace(nvmlInit=init, NVMLError=NVMLError)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with caplog.at_level(logging.INFO, logger="flodl_exp.telemetry"):
        assert T.open_gpu_probe(torch.device("cuda:0")) is None
    assert len(caplog.records) == 1 and "no NVIDIA driver" in caplog.text


def test_gpu_probe_failing_mid_run_falls_back_to_cpu(caplog):
    class Flaky:
        def sample(self):
            raise RuntimeError("GPU is lost")

        def close(self):
            pass

    tel = T.Telemetry(lambda m: None, torch.device("cpu"), gpu=Flaky())  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="flodl_exp.telemetry"):
        s = tel.sample()
        s2 = tel.sample()
    assert "gpu_util" not in s and "rss_gb" in s2 and tel.gpu is None
    assert len(caplog.records) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and an NVIDIA driver")
def test_gpu_probe_reads_utilisation_and_memory():
    pytest.importorskip("pynvml")
    probe = T.GpuProbe(torch.device("cuda:0"))
    x = torch.ones(1 << 20, device="cuda:0")
    s = probe.sample()
    assert 0.0 <= s.get("gpu_util", 0.0) <= 100.0 and s["mem_gb"] > 0 and s["gpu_proc_mem_gb"] > 0
    sent: list[Message] = []
    tel = T.Telemetry(sent.append, torch.device("cuda:0"), sample_s=0.05, report_s=0.1).start()
    try:
        wait_for(lambda: len(sent) >= 1, timeout=60, what="a telemetry report")
    finally:
        tel.close()
    probe.close()
    del x
    assert sent and {"mem_gb", "gpu_proc_mem_gb", "cpu_pct", "rss_gb"} <= set(sent[-1].fields)


# -- which NVML device is the rank's: resolve_nvml_handle against a fake NVML ------------------------------

class FakeNvml:
    """The pynvml functions telemetry uses, over a made-up host: GPUs in NVML (PCI) order, each with
    optional MIG devices (uuid, gpu instance, compute instance). Handles are the Dev objects."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class Dev:
        def __init__(self, uuid, mem=0, gi=None, ci=None, migs=None):
            self.uuid, self.mem, self.gi, self.ci = uuid, mem, gi, ci
            self.migs = migs  # None: no MIG on this GPU

        def __repr__(self):
            return f"Dev({self.uuid})"

    def __init__(self, gpus, *, mig_by_uuid=True, procs=None, util=True):
        self.gpus = gpus
        self.mig_by_uuid = mig_by_uuid
        self.procs = procs if procs is not None else {}
        self.util = util
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.gpus):
            raise self.NVMLError("Invalid Argument")
        return self.gpus[i]

    def nvmlDeviceGetHandleByUUID(self, uuid):  # exact, like the driver; MIG UUIDs only when mig_by_uuid
        for g in self.gpus:
            if g.uuid == uuid:
                return g
            for m in (g.migs or []) if self.mig_by_uuid else []:
                if m.uuid == uuid:
                    return m
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetUUID(self, h):
        return h.uuid

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        if h.migs is None:
            raise self.NVMLError_NotSupported("Not Supported")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, j):
        if h.migs is None or j >= len(h.migs):
            raise self.NVMLError("Not Found")
        return h.migs[j]

    def nvmlDeviceGetGpuInstanceId(self, h):
        return h.gi

    def nvmlDeviceGetComputeInstanceId(self, h):
        return h.ci

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=h.mem, total=80 << 30, free=(80 << 30) - h.mem)

    def nvmlDeviceGetUtilizationRates(self, h):
        if not self.util or h.gi is not None:
            raise self.NVMLError_NotSupported("Not Supported")  # no utilisation on a MIG device
        return types.SimpleNamespace(gpu=42, memory=7)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        got = self.procs.get(h.uuid, [])
        if isinstance(got, Exception):
            raise got
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in got]


U0 = "11111111-aaaa-bbbb-cccc-000000000000"
U1 = "22222222-aaaa-bbbb-cccc-111111111111"
U2 = "33333333-aaaa-bbbb-cccc-222222222222"
M0 = "44444444-aaaa-bbbb-cccc-333333333333"
M1 = "55555555-aaaa-bbbb-cccc-444444444444"


def _host(**kw) -> FakeNvml:
    """Three GPUs; the third is in MIG mode with two instances (gi 1 / ci 0, gi 2 / ci 0)."""
    D = FakeNvml.Dev
    migs = [D(f"MIG-{M0}", gi=1, ci=0), D(f"MIG-{M1}", gi=2, ci=0)]
    return FakeNvml([D(f"GPU-{U0}"), D(f"GPU-{U1}"), D(f"GPU-{U2}", migs=migs)], **kw)


def _uuid(nv: FakeNvml, got: tuple) -> tuple[str, str]:
    return got[0].uuid, got[1]


def test_visible_entry_is_the_index_th_entry():
    assert T.visible_entry(None, 0) is None
    assert T.visible_entry("", 0) is None
    assert T.visible_entry("2, 0", 1) == "0"
    assert T.visible_entry("GPU-abc,MIG-def", 1) == "MIG-def"
    assert T.visible_entry("3", 1) is None


@pytest.mark.parametrize("torch_uuid", [U1, U1.upper(), f"GPU-{U1}"])
def test_the_torch_uuid_wins_over_a_misleading_index(torch_uuid):
    """torch's cuda:0 is NVML's GPU 1 (CUDA_VISIBLE_DEVICES=1): found by UUID, whatever the index says."""
    nv = _host()
    assert _uuid(nv, T.resolve_nvml_handle(0, None, torch_uuid, nv)) == (f"GPU-{U1}", "uuid")
    assert _uuid(nv, T.resolve_nvml_handle(0, "1", torch_uuid, nv)) == (f"GPU-{U1}", "uuid")


@pytest.mark.parametrize("mig_by_uuid", [True, False])
def test_a_mig_instance_is_found_by_its_torch_uuid(mig_by_uuid):
    """torch reports the MIG instance's UUID: matched as MIG-<uuid>, by lookup or (old drivers) by scanning."""
    nv = _host(mig_by_uuid=mig_by_uuid)
    assert _uuid(nv, T.resolve_nvml_handle(0, f"MIG-{M1}", M1, nv)) == (f"MIG-{M1}", "uuid")


@pytest.mark.parametrize("visible, index, want", [
    ("2,1", 1, f"GPU-{U1}"),  # an integer entry is an NVML index
    ("2,0", 0, f"GPU-{U2}"),
    (f"GPU-{U1},GPU-{U0}", 1, f"GPU-{U0}"),  # a full GPU UUID
    ("GPU-2222", 0, f"GPU-{U1}"),  # an unambiguous UUID prefix (CUDA takes those)
    (f"MIG-{M0}", 0, f"MIG-{M0}"),  # a MIG UUID
    (f"MIG-GPU-{U2}/2/0", 0, f"MIG-{M1}"),  # the pre-R470 MIG form: the instance with gi 2, ci 0 on that GPU
])
def test_without_a_torch_uuid_the_visible_entry_decides(visible, index, want):
    nv = _host(mig_by_uuid=False)
    assert _uuid(nv, T.resolve_nvml_handle(index, visible, None, nv)) == (want, "visible")


def test_an_unknown_torch_uuid_falls_back_to_the_visible_entry_then_the_index():
    nv = _host()
    stale = "99999999-0000-0000-0000-000000000000"
    assert _uuid(nv, T.resolve_nvml_handle(0, "2", stale, nv)) == (f"GPU-{U2}", "visible")
    assert _uuid(nv, T.resolve_nvml_handle(1, None, stale, nv)) == (f"GPU-{U1}", "index")
    assert _uuid(nv, T.resolve_nvml_handle(1, "", None, nv)) == (f"GPU-{U1}", "index")
    # entries that match nothing (an NVML index out of range, an ambiguous UUID prefix): the plain index
    assert _uuid(nv, T.resolve_nvml_handle(0, "7", None, nv)) == (f"GPU-{U0}", "index")
    assert _uuid(nv, T.resolve_nvml_handle(0, "GPU-", None, nv)) == (f"GPU-{U0}", "index")
    with pytest.raises(FakeNvml.NVMLError):
        T.resolve_nvml_handle(5, None, None, nv)


def _probe(monkeypatch, nv: FakeNvml, *, index: int, visible=None, torch_uuid=None, pid=4242, reserved=3 << 30):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(T, "torch_device_uuid", lambda i: torch_uuid)
    return T.GpuProbe(torch.device("cuda", index), nvml=nv, pid=pid, reserved=lambda: float(reserved))


def test_probe_reports_device_wide_and_per_process_memory(monkeypatch):
    """Two ranks on GPU 1: mem_gb is the device's total (the same for both), gpu_proc_mem_gb each one's own."""
    nv = _host(procs={f"GPU-{U1}": [(4242, 2 << 30), (4343, 5 << 30), (4242, 1 << 30), (9, None)]})
    nv.gpus[1].mem = 9 << 30
    a = _probe(monkeypatch, nv, index=0, visible="1", pid=4242)
    b = _probe(monkeypatch, nv, index=0, visible="1", pid=4343)
    sa, sb = a.sample(), b.sample()
    assert sa == {"mem_gb": 9.0, "gpu_util": 42.0, "gpu_proc_mem_gb": 3.0}
    assert sb == {"mem_gb": 9.0, "gpu_util": 42.0, "gpu_proc_mem_gb": 5.0}
    a.close()
    b.close()
    assert nv.inits == 0


def test_per_process_memory_falls_back_to_the_allocator(monkeypatch, caplog):
    """Our pid not listed (a container's pid namespace): torch's reserve. The list refused: the same, logged once."""
    nv = _host(procs={f"GPU-{U0}": [(1, 1 << 30)], f"GPU-{U1}": FakeNvml.NVMLError("No Permission")})
    p = _probe(monkeypatch, nv, index=0, torch_uuid=U0, reserved=2 << 30)
    assert p.sample()["gpu_proc_mem_gb"] == 2.0 and p.procs_ok
    q = _probe(monkeypatch, nv, index=1, reserved=1 << 29)
    with caplog.at_level(logging.INFO, logger="flodl_exp.telemetry"):
        assert q.sample()["gpu_proc_mem_gb"] == 0.5
        assert q.sample()["gpu_proc_mem_gb"] == 0.5
    assert not q.procs_ok and len(caplog.records) == 1


def test_a_mig_instance_reports_memory_without_utilisation(monkeypatch, caplog):
    nv = _host(procs={f"MIG-{M0}": [(4242, 1 << 30)]})
    nv.gpus[2].migs[0].mem = 4 << 30
    p = _probe(monkeypatch, nv, index=0, visible=f"MIG-{M0}", torch_uuid=M0)
    with caplog.at_level(logging.INFO, logger="flodl_exp.telemetry"):
        s1, s2 = p.sample(), p.sample()
    assert s1 == s2 == {"mem_gb": 4.0, "gpu_proc_mem_gb": 1.0}
    assert len(caplog.records) == 1 and "utilisation" in caplog.text


def test_telemetry_sends_the_gpu_fields(monkeypatch):
    nv = _host(procs={f"GPU-{U0}": [(4242, 1 << 30)]})
    nv.gpus[0].mem = 6 << 30
    sent: list[Message] = []
    tel = T.Telemetry(sent.append, torch.device("cuda:0"), gpu=_probe(monkeypatch, nv, index=0, torch_uuid=U0))
    tel.close(flush=True)
    assert len(sent) == 1
    f = sent[0].fields
    assert {"cpu_pct", "rss_gb", "gpu_util", "mem_gb", "gpu_proc_mem_gb"} >= set(f) >= {"rss_gb", "gpu_util", "mem_gb"}
    assert f["mem_gb"] == 6.0 and f["gpu_proc_mem_gb"] == 1.0 and tel.gpu is None and nv.inits == 0


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_e2e_telemetry_reaches_mlflow_for_every_rank(store):
    """CPU-only run: every rank's cpu_pct and rss_gb are logged per epoch; no GPU keys."""
    from mlflow.tracking import MlflowClient

    # Synchronous slow data keeps each epoch a couple of seconds: telemetry reports once a second.
    r = run_cli([*base_overrides(store, "telemetry"), "experiment=digits_slow", "experiment.epochs=2",
                 "experiment.train_data.sleep_ms=3.0", "data_plane.ram_max_usage=0", "cluster.ranks_per_node=2",
                 "cluster.device=cpu"], timeout=280)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    m = MlflowClient(store["uri"]).get_run(run_id_of(r.stdout)).data.metrics
    for rank in range(2):
        assert f"rank{rank}/cpu_pct" in m and f"rank{rank}/rss_gb" in m, sorted(m)
        assert 0 < m[f"rank{rank}/rss_gb"] < 64 and m[f"rank{rank}/cpu_pct"] >= 0
        assert f"rank{rank}/gpu_util" not in m


def test_close_with_flush_sends_one_last_report_even_before_the_first_period():
    sent: list[Message] = []
    tel = T.Telemetry(sent.append, torch.device("cpu"), sample_s=30.0, report_s=60.0, probe_gpu=False).start()
    tel.close(flush=True)
    assert len(sent) == 1 and set(sent[0].fields) >= {"rss_gb"} and tel.sent == 1
    tel.close(flush=True)
    assert len(sent) == 1, "closed once: no second flush"
