"""What a run trained on and what it produced, the way MLflow's users look for them.

* :func:`dataset_input` describes a data set (name, digest, source, rows) for ``MlflowClient.log_inputs``, so
  the UI's Dataset column says what a run trained and evaluated on. Rank 0 computes it from the data set it
  built (no second load) and sends it in its hello; the coordinator's sink logs it.
* :func:`log_consensus_model` logs the run's consensus model (the final bundle's ``<stem>.pt``) with
  ``mlflow.pytorch.log_model``, with a signature and an input example, so ``mlflow.pytorch.load_model`` loads
  it and the model registry takes it. The bundle stays the resumable record; this is the deployable one.

The digest is content-based where it can be: sha256 over the data set's length, its config and the bytes of
its first :data:`DIGEST_SAMPLES` samples (read through the trainer's own batch accessor), so two runs on the
same data agree and a changed file shows up, without reading a large data set whole.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Optional

log = logging.getLogger("flodl_exp.coordinator")

DIGEST_SAMPLES = 256
EXAMPLE_ROWS = 2
MODEL_NAME = "model"
"""The logged model's name (``runs:/<run_id>/model``)."""


def _tensors(batch: Any) -> list[Any]:
    import torch

    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [t for b in batch for t in _tensors(b)]
    if isinstance(batch, dict):
        return [t for k in sorted(batch) for t in _tensors(batch[k])]
    return []


def dataset_input(role: str, dataset: Any, node: Any) -> dict[str, Any]:
    """A JSON-safe description of ``dataset`` (built from config ``node``) in the role ``training`` or ``eval``."""
    import numpy as np

    from flodl_exp.experiment import fetch_batch

    target = str((node or {}).get("_target_", type(dataset).__name__))
    args = {k: v for k, v in (node or {}).items() if k != "_target_"}
    n = len(dataset)
    h = hashlib.sha256(json.dumps({"target": target, "args": args, "rows": n}, sort_keys=True, default=str).encode())
    try:
        for t in _tensors(fetch_batch(dataset, np.arange(min(n, DIGEST_SAMPLES), dtype=np.int64))):
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    except Exception as e:  # a data set the accessor cannot slice: the config and length still identify it
        log.debug("dataset digest from config only (%s)", e)
    short = target.rsplit(".", 1)[-1]
    split = args.get("split")
    source = next((str(args[k]) for k in ("data_path", "data_dir", "path", "root") if args.get(k)), target)
    return {"name": f"{short}/{split}" if split else short, "digest": h.hexdigest()[:16], "role": role,
            "source": source, "rows": n}


def log_inputs(client: Any, run_id: str, inputs: list[dict[str, Any]]) -> None:
    from mlflow.entities import Dataset, DatasetInput, InputTag

    datasets = [DatasetInput(
        dataset=Dataset(name=d["name"], digest=d["digest"], source_type="local",
                        source=json.dumps({"uri": d["source"]}), profile=json.dumps({"num_rows": d["rows"]})),
        tags=[InputTag("mlflow.data.context", d["role"])]) for d in inputs]
    client.log_inputs(run_id, datasets=datasets)


def _example(experiment: dict[str, Any]) -> Optional[Any]:
    """``EXAMPLE_ROWS`` model inputs from the eval (else train) data set: the first tensor of a batch."""
    import numpy as np
    from hydra.utils import instantiate

    from flodl_exp.experiment import fetch_batch

    node = experiment.get("eval_data") or experiment.get("train_data")
    if not node:
        return None
    ds = instantiate(node)
    batch = fetch_batch(ds, np.arange(min(len(ds), EXAMPLE_ROWS), dtype=np.int64))
    tensors = _tensors(batch)
    return tensors[0] if tensors else None


def log_consensus_model(uri: str, run_id: str, stem: str, experiment: dict[str, Any]) -> str:
    """Log the final bundle's consensus model into run ``run_id``; returns the model's URI."""
    import mlflow
    import mlflow.pytorch
    import torch
    from hydra.utils import instantiate
    from mlflow.models import infer_signature

    from flodl_exp.checkpoint import load_model_state, model_path

    if not os.path.exists(model_path(stem)):
        raise FileNotFoundError(f"no consensus model at {model_path(stem)}")
    model = instantiate(experiment["model"])
    model.load_state_dict(load_model_state(stem))
    model.eval()
    example = _example(experiment)
    signature = None
    if example is not None:
        with torch.no_grad():
            out = model(example)
        if isinstance(out, torch.Tensor):
            signature = infer_signature(example.numpy(), out.detach().numpy())
    mlflow.set_tracking_uri(uri)
    # A logged model whose source is the run, written without reopening it: the run may already be FINISHED
    # (the launcher exports after the run's end) and must not flip back to RUNNING while the model is written.
    experiment_id = mlflow.MlflowClient(uri).get_run(run_id).info.experiment_id
    logged = mlflow.initialize_logged_model(name=MODEL_NAME, source_run_id=run_id, experiment_id=experiment_id)
    info = mlflow.pytorch.log_model(
        model, name=MODEL_NAME, model_id=logged.model_id, signature=signature,
        input_example=example.numpy() if example is not None else None,
        # the requirements named here: MLflow's inference of them loads the model in a subprocess (seconds)
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"])
    return str(info.model_uri)


EXPORT_REQUEST = "model_export.json"
"""The coordinator's request (in the job folder) to export the final bundle's model once the run has ended."""
EXPORT_LOG = "model_export.log"
URI_ENV = "FLODL_EXPORT_TRACKING_URI"
"""The store (with its credentials) the export process connects to: passed in its environment, never on disk."""


def write_export_request(job_dir: str, run_id: str, stem: str, experiment: dict[str, Any],
                         import_paths: list[str]) -> str:
    """Ask for the model export after the run's end (the launcher runs it): the run's end does not wait for it.
    ``import_paths``: where the tasks import the user's modules from (the export builds the model too)."""
    from flodl_exp.fsio import atomic_text

    path = os.path.join(job_dir, EXPORT_REQUEST)
    atomic_text(json.dumps({"run_id": run_id, "stem": stem, "experiment": experiment, "import_paths": import_paths}),
                path, mode=0o600)
    return path


def _hide_password(text: str, uri: str) -> str:
    """``text`` with the store's password (if the URI has one) replaced: MLflow's errors quote the URL it built."""
    from urllib.parse import urlsplit

    try:
        password = urlsplit(uri).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def export_from_request(path: str, uri: str) -> int:
    """Run one export request: the model logged and the run tagged ``model_export=done``, or ``log_model_error``
    on failure (the run keeps its status either way: the bundle is the run's record, the model a copy)."""
    import sys

    from mlflow import MlflowClient

    with open(path) as fh:
        req = json.load(fh)
    if not req.get("run_id"):  # the launcher names the run as it claims the request; by hand: the job folder's id
        try:
            with open(os.path.join(os.path.dirname(os.path.abspath(path)), "run_id.json")) as fh:
                req["run_id"] = str(json.load(fh)["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            log.error("%s names no MLflow run and its job folder has no run_id.json: nothing exported", path)
            return 1
    for p in reversed(req.get("import_paths") or []):
        if p not in sys.path:
            sys.path.insert(0, p)
    c = MlflowClient(uri)  # (not tracking.client: tracking imports this module to export in a detached job)
    try:
        model_uri = log_consensus_model(uri, req["run_id"], req["stem"], req["experiment"])
    except Exception as e:
        why = _hide_password(f"{type(e).__name__}: {e}", uri)
        log.warning("consensus model not logged to MLflow: %s", why)
        c.set_tag(req["run_id"], "log_model_error", why[:2000])
        c.set_tag(req["run_id"], "model_export", "failed")
        return 1
    c.set_tag(req["run_id"], "model_export", "done")
    log.info("consensus model logged: %s", model_uri)
    return 0


def request_of(path: str) -> str:
    """The request to run for ``path``: a request file itself, or a job folder's (claimed or not, so an export the
    launcher never started, or one that failed, can be run again by hand)."""
    if os.path.isdir(path):
        for name in (EXPORT_REQUEST, EXPORT_REQUEST + ".claimed"):
            if os.path.exists(os.path.join(path, name)):
                return os.path.join(path, name)
        raise FileNotFoundError(f"{path}: no {EXPORT_REQUEST} (the run did not finish, or tracking.log_model=false)")
    return path


def store_of(request: str) -> str:
    """The store to log to: the launcher's (``FLODL_EXPORT_TRACKING_URI``, with credentials), else
    ``MLFLOW_TRACKING_URI``, else the job's own ``spec.json`` (its URI without credentials: enough for SQLite)."""
    uri = os.environ.pop(URI_ENV, None) or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    with open(os.path.join(os.path.dirname(os.path.abspath(request)), "spec.json")) as fh:
        return str(json.load(fh)["tracking_uri"])


if __name__ == "__main__":
    # python -m flodl_exp.model_export <request | job folder>: the launcher's background export, or the same by hand
    # for a run whose launcher did not live to start it (its tag model_export is missing or failed)
    import sys

    from flodl_exp.background import yield_to_training

    yield_to_training()  # the export may overlap another run's training (a sweep's next child, a bench rotation)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s model_export %(levelname)s %(message)s")
    target = request_of(sys.argv[1])
    store = store_of(target)
    sys.argv[1] = target
    try:
        code = export_from_request(sys.argv[1], store)
    except Exception as exc:  # the request or the store could not be read: the log says why
        log.error("model export failed: %s", _hide_password(f"{type(exc).__name__}: {exc}", store))
        code = 2
    # Every write above is done (the store's commits, the artifact files; tags queued by MLFLOW_ENABLE_ASYNC_LOGGING
    # flushed here): leave without the interpreter's teardown of torch and MLflow, 1.7 s of CPU that the next run
    # of a sweep or a bench rotation shared its cores with.
    mlflow_module = sys.modules.get("mlflow")
    if mlflow_module is not None:
        try:
            mlflow_module.flush_async_logging()
        except Exception as exc:
            log.warning("MLflow's async logging queue not flushed: %s", exc)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
