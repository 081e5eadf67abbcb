"""flodl_exp/config_errors.py: Hydra's composition errors as one ``config error:`` line (in-process, no subprocess).

The exceptions are Hydra's own, raised by composing the app's config with Hydra's compose API (~0.1 s each), so a
Hydra upgrade that changes them fails here, by name. tests/test_hydra_errors_cli.py runs the same through the CLI."""
from __future__ import annotations

import types
from pathlib import Path
from typing import Iterator

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal import utils as hydra_utils
from hydra.errors import ConfigCompositionException, MissingConfigException

import flodl_exp
from flodl_exp.config import ConfigError, register_configs
from flodl_exp.config_errors import _all_groups, did_you_mean, explain, one_line_config_errors, raised_by_a_job

CONF = Path(flodl_exp.__file__).parent / "conf"


@pytest.fixture(scope="module")
def hydra_app() -> Iterator[None]:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def refusal(*overrides: str) -> BaseException:
    """The exception Hydra raises composing the app's config with ``overrides``."""
    with pytest.raises(Exception) as ei:
        compose("config", overrides=list(overrides))
    return ei.value


def test_did_you_mean_picks_the_closest_or_nothing() -> None:
    assert did_you_mean("nccl_cadense", ["nccl_sync", "nccl_cadence", "cpu_cadence"]) == "nccl_cadence"
    assert did_you_mean("zzz", ["nccl_sync", "nccl_cadence"]) is None


def test_a_misspelt_option_is_named_with_the_options_but_not_nccl_async(hydra_app: None) -> None:
    ex = refusal("mode=nccl_cadense")
    assert isinstance(ex, MissingConfigException)
    assert explain(ex) == ("config error: mode=nccl_cadense: no such option (available: auto, cpu_async, cpu_cadence, "
                           "cpu_sync, nccl_cadence, nccl_sync); did you mean nccl_cadence?")


def test_an_option_in_the_local_conf_says_to_pass_config_dir(hydra_app: None, tmp_path: Path) -> None:
    ex = refusal("experiment=my_task")
    line = explain(ex, cwd=tmp_path)
    assert line is not None and line.startswith("config error: experiment=my_task: no such option (available: char_rnn, ")
    assert "--config-dir" not in line  # nothing under ./conf
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "my_task.yaml").write_text("# @package experiment\n")
    line = explain(ex, cwd=tmp_path)
    assert line is not None and line.endswith(", resnet20); ./conf/experiment/my_task.yaml exists: add --config-dir ./conf")


def test_a_misspelt_group_gets_a_did_you_mean_and_no_plus_advice(hydra_app: None) -> None:
    ex = refusal("experment=cancer")
    assert "+experment" in str(ex)  # what Hydra says
    assert explain(ex, groups=_all_groups()) == "config error: experment=cancer: no such key or config group; did you mean experiment?"


def test_a_misspelt_nested_group_is_found_among_the_groups(hydra_app: None) -> None:
    ex = refusal("hydra/sweper=optuna")
    assert explain(ex, groups=_all_groups()) == "config error: hydra/sweper=optuna: no such config group; did you mean hydra/sweeper?"


@pytest.mark.parametrize(("override", "line"), [
    ("mode.max_overshot=3", "config error: mode.max_overshot=3: no such key in mode; did you mean mode.max_overshoot?"),
    ("cluster.slurm.gpus_per_nod=1",
     "config error: cluster.slurm.gpus_per_nod=1: no such key in cluster.slurm; did you mean cluster.slurm.gpus_per_node?"),
])
def test_a_misspelt_key_gets_a_did_you_mean(hydra_app: None, override: str, line: str) -> None:
    assert explain(refusal(override)) == line


def test_a_misspelt_key_or_option_in_a_users_preset_names_the_preset(hydra_app: None, tmp_path: Path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "bad_key.yaml").write_text("# @package experiment\nmodl: {_target_: my_model.Net}\n")
    (tmp_path / "experiment" / "bad_mode.yaml").write_text("# @package experiment\ndefaults:\n  - /mode: nccl_cadense\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path}]"  # what --config-dir adds
    assert explain(refusal(searchpath, "experiment=bad_key")) == (
        "config error: experiment.modl (set in experiment/bad_key.yaml): no such key in experiment; did you mean experiment.model?")
    line = explain(refusal(searchpath, "experiment=bad_mode"))
    assert line is not None and line.startswith("config error: mode=nccl_cadense (named in experiment/bad_mode.yaml): no such option")


def test_an_unknown_key_without_a_close_one_lists_the_keys(hydra_app: None) -> None:
    line = explain(refusal("guard.zzzzzz=1"))
    assert line is not None and line.startswith("config error: guard.zzzzzz=1: no such key in guard (keys: kind, _target_, args, threshold, ")
    line = explain(refusal("mode.nope=1"))  # matched against the key names, not the paths ("mode.nope" ~ "mode.name")
    assert line is not None and line.startswith("config error: mode.nope=1: no such key in mode (keys: name, policy, ")


@pytest.mark.parametrize(("override", "line"), [
    ("seed=abc", "config error: seed='abc' is not allowed: an integer"),
    ("mode.max_overshoot=abc", "config error: mode.max_overshoot='abc' is not allowed: an integer or null"),
    ("mode.relax_up=maybe", "config error: mode.relax_up='maybe' is not allowed: true or false"),
    ("mode.gamma=fast", "config error: mode.gamma='fast' is not allowed: a number"),
    ("mode.partition_ratios=3", "config error: mode.partition_ratios=3 is not allowed: a list ([a,b,...]) or null"),
])
def test_a_value_of_the_wrong_type_says_what_the_key_takes(hydra_app: None, override: str, line: str) -> None:
    assert explain(refusal(override)) == line


def test_an_unparsable_override_is_one_line(hydra_app: None) -> None:
    assert explain(refusal("mode=[")) == ("config error: mode=[: not a valid override: no viable alternative at input '[' "
                                          "(see https://hydra.cc/docs/1.2/advanced/override_grammar/basic)")


def test_other_composition_errors_are_flattened_to_one_line(hydra_app: None) -> None:
    line = explain(refusal("mode.anchor=1,2"))  # a sweep without -m
    assert line is not None and line.startswith("config error: Ambiguous value for argument 'mode.anchor=1,2'; 1. To use it as a list")
    assert "\n" not in line and "\\" not in line


def test_a_missing_primary_config_may_be_in_the_local_conf(tmp_path: Path) -> None:
    ex = MissingConfigException("Cannot find primary config 'mine'. Check that it's in your config search path.\n\n"
                                "Config search path:\n\tprovider=main", missing_cfg_file="mine")
    assert explain(ex, cwd=tmp_path) == "config error: --config-name=mine: no such primary config"
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text("{}\n")
    assert explain(ex, cwd=tmp_path) == "config error: --config-name=mine: no such primary config; ./conf/mine.yaml exists: add --config-dir ./conf"


def test_errors_that_are_not_composition_errors_are_left_to_hydra() -> None:
    assert explain(ValueError("x")) is None
    assert explain(ConfigError("config error: a=1 is not allowed: b")) is None


def run_job() -> None:
    """Stands in for Hydra's run_job (the task function runs under it); its globals are given hydra.core.utils's name."""
    raise ConfigCompositionException("composed by the app itself")


def test_a_composition_error_raised_inside_a_job_is_the_apps_own() -> None:
    in_hydra = types.FunctionType(run_job.__code__, {"__name__": "hydra.core.utils",
                                                     "ConfigCompositionException": ConfigCompositionException})
    with pytest.raises(ConfigCompositionException) as ei:
        in_hydra()
    assert raised_by_a_job(ei.value) and explain(ei.value) is None
    with pytest.raises(ConfigCompositionException) as ei:
        run_job()  # the same name in another module is not Hydra's
    assert not raised_by_a_job(ei.value)


def test_the_groups_come_from_hydras_config_loader(hydra_app: None) -> None:
    groups = _all_groups()
    assert {"mode", "experiment", "hydra", "hydra/sweeper"} <= set(groups)


# -- on the CLI's path -----------------------------------------------------------------------------------------

def test_hydra_still_reports_through_run_and_report() -> None:
    """The seam this module wraps: if Hydra moves it, this fails (the CLI would fall back to Hydra's own report)."""
    assert callable(hydra_utils.run_and_report)


def missing_option() -> None:
    raise MissingConfigException("Could not find 'mode/x'", missing_cfg_file="mode/x", options=["nccl_sync"])


def test_a_composition_error_ends_in_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    original = hydra_utils.run_and_report
    with pytest.raises(SystemExit) as ei, one_line_config_errors():
        hydra_utils.run_and_report(missing_option)
    assert ei.value.code == 2
    assert capsys.readouterr().err == "config error: mode=x: no such option (available: nccl_sync)\n"
    assert hydra_utils.run_and_report is original


def test_anything_else_is_hydras_report_as_before(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def fails() -> None:
        raise RuntimeError("the app's own")

    with pytest.raises(SystemExit) as ei, one_line_config_errors():
        hydra_utils.run_and_report(fails)
    assert ei.value.code == 1  # Hydra's exit code and report
    assert "RuntimeError: the app's own" in capsys.readouterr().err


def test_hydra_full_error_keeps_hydras_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(MissingConfigException), one_line_config_errors():
        hydra_utils.run_and_report(missing_option)


def test_a_composition_error_outside_run_and_report_is_one_line_too(capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--help`` composes the config outside run_and_report: its error reaches the context manager as raised."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as ei, one_line_config_errors():
        missing_option()
    assert ei.value.code == 2 and capsys.readouterr().err.startswith("config error: mode=x: no such option")
