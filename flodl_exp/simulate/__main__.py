"""``python -m flodl_exp.simulate [--from-run RUN_ID] [overrides]``: predict a rig's syncs, shares, idle, sync time,
wall and samples/s per mode (conf/simulate/config.yaml; a preset with ``--config-name rig_4to2to1``).

``--from-run RUN_ID`` is ``from_run=RUN_ID``: the rig is the one that finished MLflow run measured
(flodl_exp/simulate/from_run.py), read from ``tracking.uri`` (unset: the main app's store,
sqlite:///<cwd>/outputs/mlflow.db), and every mode of ``modes`` is replayed on it, with the run's measured numbers
and its own mode's prediction error above the same report."""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from flodl_exp.config import ConfigError
from flodl_exp.simulate.topology import SimulateConfig, register

register()

FLAGS = {"--from-run": "from_run"}


def translate_argv(argv: list[str]) -> list[str]:
    """``--from-run RUN_ID`` / ``--from-run=RUN_ID`` -> ``from_run=RUN_ID`` (before Hydra parses the command line);
    a flag without its value is left for Hydra to refuse."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        flag, eq, value = a.partition("=")
        if flag in FLAGS and eq:
            out.append(f"{FLAGS[flag]}={value}")
        elif a in FLAGS and i + 1 < len(argv):
            out.append(f"{FLAGS[a]}={argv[i + 1]}")
            i += 1
        else:
            out.append(a)
        i += 1
    return out


def replay(cfg: SimulateConfig) -> tuple[SimulateConfig, str, dict[str, float], str]:
    """The measured rig of run ``cfg.from_run`` (its ``modes``: those of ``cfg.modes`` the run's knobs allow), a
    header saying what was measured, the measured numbers and the run's own mode. Raises ValueError (one line)."""
    from flodl_exp.simulate.from_run import NotReplayable, measured, measured_rig, read_run, run_mode
    from flodl_exp.simulate.topology import rank_steps, run_config

    run_id = str(cfg.from_run)
    where = "simulate --from-run"
    uri = cfg.tracking.uri
    if not uri:
        from flodl_exp.tracking import default_uri

        uri = default_uri(os.getcwd())
    if uri.startswith("sqlite:///") and not os.path.isfile(uri[len("sqlite:///"):]):
        raise NotReplayable(f"{where}: no MLflow store at {uri[len('sqlite:///'):]} (set tracking.uri=...)")
    from mlflow.exceptions import MlflowException

    from flodl_exp.tracking import client

    c = client(uri)
    try:
        run = c.get_run(run_id)
        params, history, result, model_mb = read_run(c, run_id)
        rig = measured_rig(params, history, result, base=cfg, model_mb=model_mb)
        own = run_mode(params)
        m = measured(history)
    except MlflowException as e:
        raise NotReplayable(f"{where}: no run {run_id} in {uri} ({(str(e).splitlines() or [''])[0][:200]})") from e
    except NotReplayable as e:
        raise NotReplayable(f"{where}: run {run_id}: {e}") from e
    w = len(rank_steps(rig))
    modes, skipped = [], []
    for mode in cfg.modes:
        rig.modes = [mode]
        try:
            run_config(rig, mode, w)
            modes.append(mode)
        except (ConfigError, ValueError) as e:
            skipped.append(f"{mode} ({(str(e).splitlines() or [''])[0]})")
    if not modes:
        raise NotReplayable(f"{where}: run {run_id}: no mode of modes={list(cfg.modes)} runs with its knobs: "
                            + "; ".join(skipped))
    rig.modes, rig.out, rig.plot = modes, cfg.out, cfg.plot
    rig.rig = f"run {run_id[:8]} ({run.data.tags.get('mlflow.runName', run.info.run_name)}, {run.info.status})"
    shares = ", ".join(f"{m[f'share.rank{r}']:.2f}" for r in range(w))
    steps = ", ".join(f"{m[f'step_ms.rank{r}']:.2f}+{m[f'data_ms.rank{r}']:.2f}" for r in range(w))
    lines = [f"Replay of MLflow run `{run_id}` ({uri}): mode {own}, {w} ranks, {int(m['epochs'])} epochs measured.",
             "",
             f"Measured: {m['samples_per_s']:.0f} samples/s over {m['wall_s']:.2f} s, {int(m['syncs'])} syncs, mean "
             f"sync {m['sync_ms']:.1f} ms, batch share {shares}; per-rank step + data ms per batch {steps}; the "
             f"link's fixed cost per reduce fitted to {rig.link.collective_fixed_ms:.2f} ms.",
             ""]
    if skipped:
        lines += [f"Not replayed (the run's mode knobs {rig.mode} refuse them): {'; '.join(skipped)}.", ""]
    return rig, "\n".join(lines), m, own


def run(cfg: SimulateConfig) -> tuple[str, list[str]]:
    """Simulate every mode of ``cfg`` (of the run ``cfg.from_run`` measured, when set); the markdown report and the
    files written."""
    from flodl_exp.simulate.engine import simulate
    from flodl_exp.simulate.from_run import error_pct
    from flodl_exp.simulate.report import fastest_rank, render, summarize, write

    header, footer = "", ""
    if cfg.from_run:
        cfg, header, m, own = replay(cfg)
    t0 = time.perf_counter()
    stats = [simulate(cfg, mode) for mode in cfg.modes]
    seconds = time.perf_counter() - t0
    fast = fastest_rank(cfg)
    rows = [summarize(st, fast) for st in stats]
    if header:
        row = next((r for r in rows if r["name"] == own), None)
        if row is not None:
            footer = (f"The run's own mode {own}: predicted {row['samples_per_s']:.0f} samples/s, measured "
                      f"{m['samples_per_s']:.0f} (error {error_pct(m['samples_per_s'], row['samples_per_s']):+.1f}%: "
                      "100 (measured - predicted) / predicted).\n")
    md = header + render(cfg, rows, seconds) + footer
    return md, write(cfg, stats, rows, md, cfg.out)


@hydra.main(version_base="1.3", config_path="../conf/simulate", config_name="config")
def main(dcfg: DictConfig) -> None:
    obj = OmegaConf.to_object(dcfg)
    assert isinstance(obj, SimulateConfig)
    try:
        md, paths = run(obj)
    except (ConfigError, ValueError) as e:
        print(str(e), file=sys.stderr)
        sys.exit(2)
    print(md)
    for p in paths:
        print(f"wrote {p}")


def cli(argv: Optional[list[str]] = None) -> None:
    sys.argv = [sys.argv[0], *translate_argv(list(sys.argv[1:] if argv is None else argv))]
    from flodl_exp.config_errors import one_line_config_errors

    with one_line_config_errors():  # a misspelt key or preset: one config error line, exit 2, as the main app
        main()


if __name__ == "__main__":
    cli()
