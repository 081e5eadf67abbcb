#!/usr/bin/env bash
# The GPU check (issue 13): every CUDA path of flodl_exp in one prepared run, under 5 minutes on one GPU.
#
#   bash tests/gpu/check.sh            # from the repo root, on a machine with an NVIDIA GPU
#   PYTHON=/path/to/python bash tests/gpu/check.sh -k telemetry   # extra args go to pytest
#
# It runs tests/gpu (pytest marker `gpu`): the collective (NCCL with device_id, a collective that outlives
# its deadline raises instead of aborting the process, the abort path, the sync's peak memory), the data
# plane on CUDA (budget with the pool installed, CUDA-returning datasets through the RAM tier, an injected
# OOM, stream ordering), telemetry (NVML handle = torch device, per-process memory, a rank launched with
# CUDA_VISIBLE_DEVICES=<uuid>), and end-to-end runs on the first GPU (two ranks sharing it through Gloo, a
# forced NCCL refused, one CUDA rank with GPU telemetry that resumes from its bundle, cpu_cadence with
# bf16 on the wire). Without CUDA it prints one line and exits 0.
#
# Python: $PYTHON, else .venv/bin/python when its torch sees CUDA, else python3. The project's own
# dependencies must be importable; where the machine has no package index, wheels in .whl/ (see
# tests/gpu/wheels.sh) are installed into a scratch folder first.
set -uo pipefail
cd "$(dirname "$0")/../.."

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! has_cuda "$PY"; then
  echo "tests/gpu/check.sh: skipped: no CUDA device visible to $PY's torch"
  exit 0
fi

if ! "$PY" -c 'import omegaconf, hydra, submitit, mlflow' >/dev/null 2>&1; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo "installing the project's dependencies from .whl/ into /tmp/flodl-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/flodl-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/flodl-site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "note: omegaconf/hydra/submitit/mlflow missing and no .whl/: the end-to-end cases will be skipped"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$PY" - <<'EOF'
import torch
p = torch.cuda.get_device_properties(0)
nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
try:
    import pynvml
    pynvml.nvmlInit()
    nv = f"driver {pynvml.nvmlSystemGetDriverVersion()}"
except Exception as e:  # noqa: BLE001
    nv = f"no NVML ({type(e).__name__})"
print(f"GPU check: torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {torch.cuda.device_count()} device(s); "
      f"cuda:0 = {p.name}, {p.total_memory / 2**30:.0f} GiB, uuid {p.uuid}; {nv}")
EOF

start=$(date +%s)
timeout 290 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rA --durations=15 "$@"
rc=$?
echo "GPU check: pytest exit $rc after $(( $(date +%s) - start )) s"
exit $rc
