"""``python -m flodl_exp.bench [--quick] [overrides]``: the benchmark suite (conf/bench/config.yaml).

``--quick`` is ``preset=quick`` (every model, a few batches each: the smoke run in the test suite); the
default preset is ``full``. Any key of :class:`~flodl_exp.bench.suite.BenchConfig` is an override, e.g.
``python -m flodl_exp.bench --quick models=[mlp] runs=[solo_fast,cpu_async]``.
"""
from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict
from typing import Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from flodl_exp.bench.suite import BenchConfig, plan, register
from flodl_exp.config import ConfigError
from flodl_exp.fsio import atomic_text

PRESET_FLAGS = {"--quick": "preset=quick", "--full": "preset=full"}


def translate_argv(argv: list[str]) -> list[str]:
    """``--quick`` / ``--full`` -> ``preset=quick`` / ``preset=full`` (before Hydra parses the command line)."""
    return [PRESET_FLAGS.get(a, a) for a in argv]


def run_suite(cfg: BenchConfig) -> int:
    """Every run of the plan as a child of one parent run, then the report; 0 when every run finished."""
    from flodl_exp.bench.runner import RunRecord, run_all
    from flodl_exp.tracking import client, create_run, resolve_tracking

    specs = plan(cfg)
    out = os.path.abspath(cfg.out_dir or os.path.join("outputs", "bench", time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(out, exist_ok=True)
    # The ranks (submitit) and the DDP workers (spawn) import the presets' modules: flodl_exp.zoo from the package,
    # a user's own from the launch directory.
    root = os.getcwd()
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *[p for p in paths if p]])
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri, art = resolve_tracking(cfg.tracking, root)
    if cfg.report_of:
        run = client(uri).get_run(cfg.report_of)
        wall = float(run.data.metrics.get("bench_wall_s", float("nan")))
        print(f"report: {write_report(cfg, client(uri), cfg.report_of, out, wall, uri)}", flush=True)
        return 0
    params = {k: v for k, v in asdict(cfg).items() if k != "tracking"}
    parent = create_run(uri, cfg.tracking.experiment_name, art, f"bench {cfg.name}", params,
                        {"flodl.bench": "parent", "bench.preset": cfg.name, "out_dir": out})
    print(f"bench {cfg.name}: {len(specs)} runs ({len(cfg.models)} models); MLflow parent run {parent} "
          f"({uri}, experiment {cfg.tracking.experiment_name}); out {out}", flush=True)
    t0 = time.monotonic()

    def said(i: int, rec: RunRecord) -> None:
        print(f"  [{i + 1}/{len(specs)}] {rec.spec.label:<28} {rec.status:<8} {rec.process_s:6.1f} s"
              + (f"  {rec.error.strip().splitlines()[-1][:200]}" if rec.error.strip() else ""), flush=True)

    records = run_all(cfg, specs, parent, out, said)
    wall = time.monotonic() - t0
    c = client(uri)
    code = 0 if all(r.status == "FINISHED" for r in records) else 1
    try:
        md_path = write_report(cfg, c, parent, out, wall, uri)
        print(f"report: {md_path}", flush=True)
    except Exception as e:  # the runs are in the store; a report problem is said, and fails the command
        print(f"error: report not written: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    c.log_metric(parent, "bench_wall_s", wall)
    c.set_tag(parent, "children", str(len(records)))
    c.set_terminated(parent, status="FINISHED" if code == 0 else "FAILED")
    print(f"bench wall {wall:.1f} s; {sum(r.status == 'FINISHED' for r in records)}/{len(records)} runs finished",
          flush=True)
    return code


def write_report(cfg: BenchConfig, c: object, parent: str, out: str, wall: float, uri: str) -> str:
    from flodl_exp.bench.collect import load_rows
    from flodl_exp.bench.plots import write_plots
    from flodl_exp.bench.report import PLOTS, build_markdown

    rows = load_rows(c, cfg.tracking.experiment_name, parent)
    write_plots(rows, out, cfg.models)
    from importlib.metadata import version

    torch_v = version("torch")
    header = [f"Parent run: `{parent}` ({uri}, experiment `{cfg.tracking.experiment_name}`)",
              f"Hardware: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), torch {torch_v}, "
              f"ranks on CPU; simulated rig rank_speeds {list(cfg.rank_speeds)} (cluster=local_hetero)",
              f"Preset `{cfg.name}`: epochs {cfg.epochs or 'of each preset'}; solo runs via {cfg.solo}; "
              f"DDP workers by {cfg.ddp_start_method}; bench wall {wall:.1f} s (every run, start-up included)"]
    md = build_markdown(rows, title=cfg.name, header=header, models=cfg.models, plots=PLOTS)
    md_path = os.path.join(out, "report.md")
    atomic_text(md, md_path, mode=None)
    for name in ("report.md", *PLOTS):
        c.log_artifact(parent, os.path.join(out, name), "report")  # type: ignore[attr-defined]
    return md_path


register()


@hydra.main(version_base="1.3", config_path="../conf/bench", config_name="config")
def main(dcfg: DictConfig) -> None:
    obj = OmegaConf.to_object(dcfg)
    assert isinstance(obj, BenchConfig)
    try:
        code = run_suite(obj)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the main app: skip the interpreter's teardown of torch and mlflow


def cli(argv: Optional[list[str]] = None) -> None:
    sys.argv = [sys.argv[0], *translate_argv(list(sys.argv[1:] if argv is None else argv))]
    from flodl_exp.config_errors import one_line_config_errors

    with one_line_config_errors():  # a misspelt key or preset: one config error line, exit 2, as the main app
        main()


if __name__ == "__main__":
    cli()
