"""``hooks.metrics_fn`` / ``hooks.eval_result_fn`` as config keys (issue 53, item 1), end to end: the CLI from a
user's project, two ranks; the user's hooks run in the coordinator's job with each epoch's per-rank fields and each
eval (the final one marked), and a hook that raises is called again for the next epoch, its error logged once with
its count at the end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from user_project import TINY_NET, preset, write_project

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

HOOKS = '''\
import json
import os


def _write(kind, epoch, metrics):
    with open(os.environ["HOOK_OUT"], "a") as fh:
        fh.write(json.dumps({"kind": kind, "epoch": epoch, "metrics": metrics}) + "\\n")


def record(epoch, metrics):
    _write("epoch", epoch, metrics)
    if epoch == 0:
        raise ValueError("the first epoch is refused")


def record_eval(epoch, metrics):
    _write("eval", epoch, metrics)
'''


def test_config_hooks_run_in_the_coordinator_with_per_rank_fields_and_survive_an_error(tmp_path: Path) -> None:
    proj = write_project(tmp_path / "proj", TINY_NET, {"hooked": preset("hooked")})
    (proj / "my_hooks.py").write_text(HOOKS)
    out = tmp_path / "hooks.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "FLODL_")) or k == "FLODL_DATA_CACHE"}
    env.update(OMP_NUM_THREADS="1", HOOK_OUT=str(out))
    res = subprocess.run([sys.executable, "-m", "flodl_exp", "--config-dir", str(proj / "conf"), "run.progress=plain",
                          "experiment=hooked", "experiment.epochs=2", "cluster.ranks_per_node=2", "mode=cpu_cadence",
                          "hooks.metrics_fn=my_hooks.record", "hooks.eval_result_fn=my_hooks.record_eval"],
                         cwd=proj, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    calls = [json.loads(line) for line in out.read_text().splitlines()]
    epochs = [c for c in calls if c["kind"] == "epoch"]
    assert [c["epoch"] for c in epochs] == [0, 1], "called again after epoch 0's error"
    for c in epochs:
        assert {"loss", "rank0/batch_share", "rank1/batch_share", "rank0/batches", "rank1/batches"} <= set(c["metrics"])
    evals = [c for c in calls if c["kind"] == "eval"]
    assert evals and evals[-1]["metrics"].get("final") == 1.0 and "eval/accuracy" in evals[-1]["metrics"]
    logs = "\n".join(p.read_text(errors="replace") for p in (proj / "outputs").rglob("*") if p.is_file()
                     and p.suffix in (".out", ".err", ".log"))
    text = logs + res.stdout + res.stderr
    assert text.count("metrics_fn raised ValueError: the first epoch is refused (epoch 0") == 1, text[-3000:]
    assert "metrics_fn raised ValueError: the first epoch is refused 1 time in 2 calls this run" in text
