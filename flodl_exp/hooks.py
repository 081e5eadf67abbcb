"""The user's run hooks (``metrics_fn``, ``eval_result_fn``): called with each aggregated epoch's and each eval's
metrics, and kept being called when one raises, as the reference's coordinator does (it logs the error and goes on).

A hook that raises every epoch would fill the log with one traceback per epoch; each distinct error (its type and
message) is logged the first time with its traceback's last frame, and the count of every error is logged when
the run ends (:meth:`HookCaller.close`). The hooks come from ``hooks.*`` in the config (called in the coordinator's
job) or from ``launch(metrics_fn=..., eval_result_fn=...)`` (called in the launching process).
"""
from __future__ import annotations

import collections
import logging
import traceback
from collections.abc import Callable, Mapping
from typing import Optional

log = logging.getLogger("flodl_exp.hooks")

Hook = Callable[[int, dict[str, float]], object]
"""``fn(epoch, metrics)``; what it returns is ignored."""


class HookCaller:
    """One hook, called until the run ends whatever it raises; see the module docstring."""

    def __init__(self, name: str, fn: Optional[Hook], warn: Callable[[str], None] = log.warning) -> None:
        self.name = name
        self.fn = fn
        self.calls = 0
        self.errors: collections.Counter[str] = collections.Counter()
        """``"<Type>: <message>"`` -> how many calls raised it."""
        self._warn = warn
        self.unavailable: Optional[str] = None
        """Why the hook could not be loaded in this process (it is then never called), or None."""

    def __call__(self, epoch: int, metrics: Mapping[str, float]) -> bool:
        """Call the hook; False when it raised (the run goes on, and the next call is made as usual)."""
        if self.fn is None:
            return True
        self.calls += 1
        try:
            self.fn(epoch, dict(metrics))
            return True
        except Exception as e:  # the user's hook: the run goes on, and so do the calls
            key = f"{type(e).__name__}: {e}"
            self.errors[key] += 1
            if self.errors[key] == 1:
                where = traceback.extract_tb(e.__traceback__)[-1]
                self._warn(f"{self.name} raised {key} (epoch {epoch}, at {where.filename}:{where.lineno}); it is called "
                           f"again for the next one, and the same error is not logged again until the run ends")
            return False

    def close(self) -> None:
        """The run ended: each error's count, once."""
        if self.unavailable is not None:
            self._warn(f"{self.name} was never called this run: {self.unavailable}")
        for key, n in self.errors.items():
            self._warn(f"{self.name} raised {key} {n} time{'s' if n != 1 else ''} in {self.calls} calls this run")


def load_hook(path: Optional[str]) -> Optional[Hook]:
    """The function a ``hooks.*`` dotted path names (None: unset). The launcher's pre-flight checked it resolves."""
    if not path:
        return None
    from hydra.utils import get_method

    return get_method(path)


class RunHooks:
    """A run's two hooks (either may be unset)."""

    def __init__(self, metrics_fn: Optional[Hook] = None, eval_result_fn: Optional[Hook] = None) -> None:
        self.metrics = HookCaller("metrics_fn", metrics_fn)
        self.evals = HookCaller("eval_result_fn", eval_result_fn)

    @classmethod
    def of(cls, hooks: object) -> RunHooks:
        """From the config's ``hooks`` group (``HooksConfig``), in the coordinator's job.

        The launcher's pre-flight resolved each path where it launched; on a cluster the coordinator's node (its
        own environment) may still fail to import it. A reporting hook is not worth the run: the error is logged
        once, naming the key and the path, the run goes on without that hook, and the run's end says so again."""
        run = cls()
        for caller, key in ((run.metrics, "metrics_fn"), (run.evals, "eval_result_fn")):
            path = getattr(hooks, key, None)
            try:
                caller.fn = load_hook(path)
            except Exception as e:  # ImportError, AttributeError, a module that raises at import
                cause = e.__cause__ or e  # Hydra wraps the import's own error in a multi-line one
                why = " ".join(f"{type(cause).__name__}: {cause}".split())
                caller.unavailable = f"hooks.{key}={path!r} cannot be loaded in the coordinator's job: {why}"
                caller._warn(f"{caller.unavailable}; the run goes on without it")
        return run

    def on_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        self.metrics(epoch, metrics)

    def on_eval(self, epoch: int, metrics: Mapping[str, float], final: bool) -> None:
        self.evals(epoch, {**metrics, **({"final": 1.0} if final else {})})

    def close(self) -> None:
        self.metrics.close()
        self.evals.close()
