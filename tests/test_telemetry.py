"""Tests for flodl_exp/rank/telemetry.py: /proc probes, the sampling thread, NVML fallbacks, e2e metrics."""
from __future__ import annotations

import logging
import sys
import time
import types

import pytest
import torch

from flodl_exp.rank import telemetry as T
from flodl_exp.wire import Message

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
    util, mem = probe.sample()
    assert 0.0 <= util <= 100.0 and mem > 0
    sent: list[Message] = []
    tel = T.Telemetry(sent.append, torch.device("cuda:0"), sample_s=0.05, report_s=0.1).start()
    try:
        wait_for(lambda: len(sent) >= 1, timeout=60, what="a telemetry report")
    finally:
        tel.close()
    probe.close()
    del x
    assert sent and {"gpu_util", "mem_gb", "cpu_pct", "rss_gb"} <= set(sent[-1].fields)


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
