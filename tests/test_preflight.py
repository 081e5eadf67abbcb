"""The launcher's pre-flight (flodl_exp/preflight.py): every dotted path of the experiment resolves in the tasks'
import context before anything is made; what cannot be resolved is one ``config error:`` line. No process here but
one interpreter that proves the static look imports no torch."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, cast

import pytest
from omegaconf import OmegaConf

from flodl_exp.config import ConfigError
from flodl_exp.preflight import DottedPath, bound_names, check_path, dotted_paths, preflight, static_verdict

REPO = Path(__file__).resolve().parents[1]


def test_dotted_paths_are_every_target_at_any_depth_and_the_function_keys() -> None:
    exp = {"name": "x", "model": {"_target_": "m.Net", "block": {"_target_": "m.Block", "k": [{"_target_": "m.Act"}]}},
           "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True}, "train_step": "m.step", "loop": None,
           "eval_fn": "m.evaluate", "batch_size": 32}
    assert dotted_paths(exp) == [
        DottedPath("experiment.model._target_", "m.Net"), DottedPath("experiment.model.block._target_", "m.Block"),
        DottedPath("experiment.model.block.k[0]._target_", "m.Act"),
        DottedPath("experiment.optimizer._target_", "torch.optim.Adam"), DottedPath("experiment.train_step", "m.step"),
        DottedPath("experiment.eval_fn", "m.evaluate")]


def test_bound_names_reads_the_top_level_and_says_when_it_cannot_tell() -> None:
    src = textwrap.dedent("""
        import os, numpy as np
        from a.b import c, d as e
        X = 1
        Y: int = 2
        p, (q, r) = 1, (2, 3)
        def f(): g = 1
        class K: h = 1
        if os: i = 1
        else: j = 1
        try: import k
        except ImportError as err: k = None
        for n in range(2): pass
        with open(os.devnull) as fh: w = 1
        """)
    names = bound_names(src)
    assert names is not None
    assert {"os", "np", "c", "e", "X", "Y", "p", "q", "r", "f", "K", "i", "j", "k", "err", "n", "fh", "w"} <= names
    assert not {"g", "h", "numpy", "d"} & names
    assert bound_names("def __getattr__(name): ...") is None  # a module __getattr__: anything may exist
    assert bound_names("globals()['Z'] = 1") is None
    assert bound_names("from x import *") is None  # a star nobody can list
    assert bound_names("from x import *", star=lambda m, lvl: {"Z"} if m == "x" else None) == {"Z"}
    assert bound_names("def broken(:") is None


def _module(tmp_path: Path, name: str, body: str) -> Path:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return tmp_path


def test_a_missing_attribute_is_named_with_the_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _module(tmp_path, "pf_user_model", "class TinyNet: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert static_verdict("pf_user_model.TinyNet") is True
    assert static_verdict("pf_user_model.Nett") is False
    line = check_path(DottedPath("experiment.model._target_", "pf_user_model.Nett"), str(tmp_path))
    assert line == ("config error: experiment.model._target_='pf_user_model.Nett' cannot be resolved: "
                    "module 'pf_user_model' has no attribute 'Nett'")


def test_a_name_the_source_does_not_show_is_confirmed_by_importing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _module(tmp_path, "pf_dynamic", "for _n in ('Made',):\n    globals()[_n] = type(_n, (), {})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert static_verdict("pf_dynamic.Made") is None  # the source cannot tell...
    assert check_path(DottedPath("experiment.model._target_", "pf_dynamic.Made"), str(tmp_path)) is None  # ...it imports


def test_a_module_that_raises_at_import_reports_its_own_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _module(tmp_path, "pf_raises", "import pf_no_such_dependency\nclass Net: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check_path(DottedPath("experiment.model._target_", "pf_raises.Net"), str(tmp_path)) is None  # static: found
    _module(tmp_path, "pf_raises2", "import pf_no_such_dependency\n")
    line = check_path(DottedPath("experiment.model._target_", "pf_raises2.Net"), str(tmp_path))
    assert line == ("config error: experiment.model._target_='pf_raises2.Net' cannot be resolved: "
                    "ModuleNotFoundError: No module named 'pf_no_such_dependency'")


def test_a_module_not_importable_from_the_launch_folder_says_where_it_is(tmp_path: Path) -> None:
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    (proj / "conf").mkdir(parents=True)
    elsewhere.mkdir()
    (proj / "pf_far_model.py").write_text("class TinyNet: pass\n")
    key = DottedPath("experiment.model._target_", "pf_far_model.TinyNet")
    assert check_path(key, str(elsewhere), [str(proj / "conf")]) == (
        f"config error: experiment.model._target_='pf_far_model.TinyNet': pf_far_model is not importable from "
        f"{elsewhere}: it is in {proj}: launch from there, or set PYTHONPATH={proj}")
    assert check_path(key, str(elsewhere)) == (
        f"config error: experiment.model._target_='pf_far_model.TinyNet': pf_far_model is not importable from "
        f"{elsewhere}: launch from the folder that holds it, or set PYTHONPATH")


def test_preflight_raises_the_first_unresolvable_path_and_restores_sys_path(tmp_path: Path) -> None:
    _module(tmp_path, "pf_first", "class Net: pass\ndef step(m, b): pass\n")
    exp = {"model": {"_target_": "pf_first.Net"}, "train_step": "pf_first.stepp"}
    before = list(sys.path)
    with pytest.raises(ConfigError, match=r"^config error: experiment\.train_step='pf_first\.stepp' cannot be resolved: "
                                          r"module 'pf_first' has no attribute 'stepp'$"):
        preflight(exp, [str(tmp_path)], str(tmp_path))
    assert sys.path == before
    preflight({**exp, "train_step": "pf_first.step"}, [str(tmp_path)], str(tmp_path))


def test_every_shipped_preset_passes() -> None:
    for path in sorted(glob.glob(str(REPO / "flodl_exp" / "conf" / "experiment" / "*.yaml"))):
        exp = cast(dict[str, Any], OmegaConf.to_container(OmegaConf.load(path)))
        preflight(exp, [str(REPO)], str(REPO))  # raises with the preset's broken path


def test_the_static_look_imports_no_torch() -> None:
    """The launcher must not pay torch's import (~1.5 s) to check torch.optim.Adam or a zoo model."""
    code = ("import sys; from flodl_exp.preflight import static_verdict as v; "
            "r = [v(t) for t in ('torch.optim.Adam', 'torch.nn.Linear', 'torch.nn.Nope', 'flodl_exp.zoo.digits.MLP', "
            "'torch.optim.lr_scheduler.StepLR')]; print(r, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(REPO),
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[True, True, False, True, True] False"
