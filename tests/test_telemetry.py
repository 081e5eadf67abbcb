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

from conftest import base_overrides, run_cli, run_id_of

CUDA = torch.cuda.is_available()


def test_proc_probes():
    cpu = T.read_cpu_seconds()
    rss = T.read_rss_bytes()
    assert cpu is not None and cpu > 0
    assert rss is not None and rss > 10 * 2**20


def test_cpu_pct_follows_a_busy_thread():
    tel = T.Telemetry(lambda m: None, torch.device("cpu"), probe_gpu=False)
    tel.sample()
    end = time.monotonic() + 0.3
    x = 0
    while time.monotonic() < end:
        x += 1
    busy = tel.sample()
    time.sleep(0.3)
    idle = tel.sample()
    assert busy["cpu_pct"] > 50, busy
    assert idle["cpu_pct"] < 30, idle
    assert 0 < busy["rss_gb"] < 64 and "gpu_util" not in busy


def test_thread_sends_means_about_once_per_report():
    sent: list[Message] = []
    tel = T.Telemetry(sent.append, torch.device("cpu"), sample_s=0.05, report_s=0.2, probe_gpu=False).start()
    time.sleep(0.75)
    tel.close()
    assert 2 <= len(sent) <= 5, len(sent)
    for m in sent:
        assert m.kind == "telemetry"
        assert set(m.fields) == {"cpu_pct", "rss_gb"}
        assert all(isinstance(v, float) for v in m.fields.values())


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
    time.sleep(0.2)
    assert tel._thread is not None and not tel._thread.is_alive()
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
    time.sleep(0.4)
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
