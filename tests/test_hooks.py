"""The run hooks (issue 53, item 1): called again after one raises, each distinct error logged once and its count at
the end; ``hooks.*`` dotted paths checked before anything starts; the coordinator's observer calls them with the
epoch's full metrics (per-rank fields included) and each eval's."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flodl_exp.config import ConfigError
from flodl_exp.hooks import HookCaller, RunHooks, load_hook
from flodl_exp.preflight import preflight
from flodl_exp.protocol.messages import EvalResult


def test_a_hook_that_raises_is_called_again_and_each_error_is_logged_once_with_its_count() -> None:
    seen: list[int] = []
    lines: list[str] = []

    def hook(epoch: int, metrics: dict[str, float]) -> None:
        seen.append(epoch)
        if epoch % 2 == 0:
            raise ValueError("even epoch")

    h = HookCaller("metrics_fn", hook, lines.append)
    results = [h(e, {"loss": 1.0}) for e in range(5)]
    assert seen == [0, 1, 2, 3, 4], "called for every epoch, the ones after an error included"
    assert results == [False, True, False, True, False]
    assert len(lines) == 1 and "metrics_fn raised ValueError: even epoch (epoch 0" in lines[0]
    h.close()
    assert lines[-1] == "metrics_fn raised ValueError: even epoch 3 times in 5 calls this run"


def test_an_unset_hook_is_never_called_and_logs_nothing() -> None:
    lines: list[str] = []
    h = HookCaller("eval_result_fn", None, lines.append)
    assert h(0, {}) and h.calls == 0
    h.close()
    assert lines == []


def test_the_eval_hook_is_told_the_final_eval() -> None:
    got: list[tuple[int, dict[str, float]]] = []
    hooks = RunHooks(eval_result_fn=lambda e, m: got.append((e, m)))
    hooks.on_eval(0, {"eval/accuracy": 0.5}, final=False)
    hooks.on_eval(1, {"eval/accuracy": 0.9}, final=True)
    assert got == [(0, {"eval/accuracy": 0.5}), (1, {"eval/accuracy": 0.9, "final": 1.0})]


def test_a_hook_path_resolves_to_its_function() -> None:
    fn = load_hook("flodl_exp.zoo.hooks.print_metrics")
    assert callable(fn) and load_hook(None) is None and load_hook("") is None


def test_a_hook_the_coordinators_node_cannot_import_is_logged_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """The pre-flight resolved the path where the user launched; another node's environment may not have it."""
    from types import SimpleNamespace

    caplog.set_level("WARNING", logger="flodl_exp.hooks")
    hooks = RunHooks.of(SimpleNamespace(metrics_fn="no_such_module_here.on_epoch",
                                        eval_result_fn="flodl_exp.zoo.hooks.print_eval"))
    assert hooks.metrics.fn is None and hooks.evals.fn is not None
    first = [r.getMessage() for r in caplog.records if r.name == "flodl_exp.hooks"]
    assert first == ["hooks.metrics_fn='no_such_module_here.on_epoch' cannot be loaded in the coordinator's job: "
                     "ModuleNotFoundError: No module named 'no_such_module_here'; the run goes on without it"]
    hooks.on_epoch(0, {"loss": 1.0})  # nothing to call, nothing raised
    hooks.close()
    assert caplog.records[-1].getMessage().startswith("metrics_fn was never called this run: hooks.metrics_fn=")


def test_a_misspelt_hook_path_is_one_config_error_line_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        preflight({}, [str(tmp_path)], str(tmp_path), hooks={"metrics_fn": "flodl_exp.zoo.hooks.print_metrix"})
    line = str(e.value)
    assert line.startswith("config error: hooks.metrics_fn='flodl_exp.zoo.hooks.print_metrix'") and "\n" not in line
    preflight({}, [str(tmp_path)], str(tmp_path), hooks={"metrics_fn": "flodl_exp.zoo.hooks.print_metrics",
                                                         "eval_result_fn": None})


def test_the_coordinators_observer_calls_the_hooks_with_per_rank_fields(tmp_path: Path) -> None:
    from control_fakes import Harness

    got: dict[str, list[Any]] = {"epoch": [], "eval": []}
    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=2)
    h.co.observer.hooks = RunHooks(lambda e, m: got["epoch"].append((e, m)), lambda e, m: got["eval"].append((e, m)))
    plans = h.start()
    h.play([0, 1], until=lambda: h.co.core.dispatch.all_aggregated(),
           pending=[(r, p) for r, ps in plans.items() for p in ps])
    assert [e for e, _ in got["epoch"]] == [0, 1]
    for _, m in got["epoch"]:
        assert {"loss", "rank0/batch_share", "rank1/batch_share", "rank0/batches", "rank1/samples_per_s"} <= set(m)
    h.msg(0, EvalResult(epoch=0, error="RuntimeError: eval data missing"))  # a failed eval: no hook call
    h.msg(0, EvalResult(epoch=1, metrics={"accuracy": 0.9}, final=True))
    assert got["eval"] == [(1, {"eval/accuracy": 0.9, "final": 1.0})]
