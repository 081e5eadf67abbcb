"""Example run hooks (``hooks.metrics_fn`` / ``hooks.eval_result_fn``): ``fn(epoch, metrics)``, called in the
coordinator's job. Copy one into your project and point the config at it::

    python -m flodl_exp hooks.metrics_fn=flodl_exp.zoo.hooks.print_metrics hooks.eval_result_fn=flodl_exp.zoo.hooks.print_eval

A hook that raises is logged (each distinct error once, the counts at the run's end) and called again for the next
epoch: it can never stop or slow a run beyond its own time.
"""
from __future__ import annotations

import re

_RANK = re.compile(r"^rank(\d+)/batch_share$")


def print_metrics(epoch: int, metrics: dict[str, float]) -> None:
    """One line per epoch: the loss, the throughput and each rank's share of the batches."""
    shares = {int(m.group(1)): v for k, v in metrics.items() if (m := _RANK.match(k))}
    per_rank = " ".join(f"r{r}={v:.2f}" for r, v in sorted(shares.items()))
    print(f"[metrics_fn] epoch {epoch}: loss {metrics.get('loss', float('nan')):.4f}, "
          f"{metrics.get('samples_per_s', 0.0):.0f} samples/s, batch share {per_rank}", flush=True)


def print_eval(epoch: int, metrics: dict[str, float]) -> None:
    """One line per eval (the final one marked)."""
    label = "final eval" if metrics.get("final") else f"eval after epoch {epoch}"
    shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in sorted(metrics.items()) if k != "final")
    print(f"[eval_result_fn] {label}: {shown}", flush=True)
