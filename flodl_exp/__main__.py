"""``python -m flodl_exp [overrides]``: the Hydra app (``-m`` for sweeps)."""
from __future__ import annotations

import sys
import time

import hydra
from omegaconf import DictConfig

from .config import ConfigError, register_configs, validate

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        for w in validate(cfg):
            print(f"warning: {w}", file=sys.stderr)
        from .progress import follow, summary
        from .runner import RunFailed, launch

        t0 = time.monotonic()
        handle = launch(cfg)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        sys.exit(2)
    print(f"MLflow run {handle.run_id}  job {handle.job_id}  folder {handle.job_dir}", flush=True)
    try:
        follow(handle, cfg.run.progress)
        result = handle.wait()
    except KeyboardInterrupt:
        print("\ninterrupted: cancelling the job ...", file=sys.stderr, flush=True)
        handle.shutdown()
        sys.exit(130)
    except RunFailed as e:
        print(summary(handle, handle.result, time.monotonic() - t0, str(e)))
        print(f"\nrun failed:\n{e}", file=sys.stderr)
        sys.exit(1)
    print(summary(handle, result, time.monotonic() - t0))


if __name__ == "__main__":
    main()
