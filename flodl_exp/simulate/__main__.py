"""``python -m flodl_exp.simulate [overrides]``: predict a rig's syncs, shares, idle, sync time, wall and
samples/s per mode (conf/simulate/config.yaml; a preset with ``--config-name rig_4to2to1``)."""
from __future__ import annotations

import sys
import time

import hydra
from omegaconf import DictConfig, OmegaConf

from ..config import ConfigError
from .topology import SimulateConfig, register

register()


def run(cfg: SimulateConfig) -> tuple[str, list[str]]:
    """Simulate every mode of ``cfg``; the markdown report and the files written."""
    from .engine import simulate
    from .report import fastest_rank, render, summarize, write

    t0 = time.perf_counter()
    stats = [simulate(cfg, m) for m in cfg.modes]
    seconds = time.perf_counter() - t0
    fast = fastest_rank(cfg)
    rows = [summarize(st, fast) for st in stats]
    md = render(cfg, rows, seconds)
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


if __name__ == "__main__":
    main()
