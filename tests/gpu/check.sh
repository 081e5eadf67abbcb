#!/usr/bin/env bash
# The GPU check (issues 13 and 28): the CUDA paths of flodl_exp in one prepared call, on one GPU (and on 2+ GPUs
# where present: the NCCL cases need two, the diloco kill uses up to three).
#
#   bash tests/gpu/check.sh                       # from the repo root, on a machine with an NVIDIA GPU
#   PYTHON=/path/to/python bash tests/gpu/check.sh -k collective     # extra args go to pytest
#   GPU_CHECK_LIMIT_S=600 bash tests/gpu/check.sh # no test starts after 600 s (default 900: a 15-minute GPU lease)
#
# What runs (pytest marker `gpu`, everything under tests/gpu):
#   test_gpu_collective.py  two ranks each: Gloo with two processes on one GPU, NCCL on two GPUs (skipped with
#                           one): the weighted average equals the one computed on the CPU, within the sync's VRAM
#                           reserve, and so does an overlapped one plus what the replica trained meanwhile
#                           (mode.overlap, issue 51); a silent or dead peer raises in Python (TORCH_NCCL_ASYNC_ERROR_HANDLING=1
#                           inherited), the group is aborted and the survivor regroups in the same process
#                           (items 1 and 5: the elastic regroup, the NCCL environment); snapshot staging (bf16 wire)
#                           against values written behind a delayed stream; the reported device UUID (MIG- for a
#                           slice, item 3) against nvidia-smi -L / NVML, and the build's kernels for it (item 8)
#   test_gpu_e2e.py         CLI runs: two ranks sharing a GPU average through Gloo; a forced NCCL refused in one
#                           line; two CUDA ranks resume from their bundle; a rank SIGKILLed mid-reduce with
#                           outer=diloco and the run recovering (items 1, 6); cpu_cadence with bf16 on the wire;
#                           the user's CUDA_VISIBLE_DEVICES kept; local ranks on MIG slices (item 3; needs 2 slices)
#   test_gpu_data_plane.py  the VRAM budget with the pool installed, for 1 and 2 ranks on the device (item 7's
#                           split), CUDA data sets through the RAM tier, an injected OOM, stream ordering
#   test_gpu_telemetry.py   NVML handle = torch device, per-process memory, CUDA event timing, a UUID in
#                           CUDA_VISIBLE_DEVICES
#   test_gpu_rank.py        the rank's hot step (sync debug mode "error"), Adam's step on the CPU after a resume,
#                           per-rank seeds, AMP/GradScaler, the NCCL environment (items 2, 5, 6, 9, 10, 11)
#
# Time, by design: each test's timeout mark is its budget; every test prints the seconds it took against it, the
# whole run stops starting tests once GPU_CHECK_LIMIT_S (default 900 s) is spent (the rest are skipped, saying so),
# GPU_CHECK_HARD_S (default: the limit + 180 s) ends pytest for good, and the last line says what passed, failed and was skipped, in how long, on what.
#
# Self-contained: pytest, pytest-timeout and the project's dependencies (omegaconf, hydra, submitit, mlflow) come
# from the Python given, else from the wheels in .whl/ (tests/gpu/wheels.sh, run where PyPI is reachable, carry
# .whl/ with the tree), else from a package index; they go to a scratch folder ($GPU_CHECK_SITE), never into the
# environment. Without pytest the check stops with one line; without the project's dependencies the end-to-end
# cases skip. Without CUDA it prints one line and exits 0 (nothing was checked); GPU_CHECK_DRY=1 runs the rest
# anyway (every test skips), to check the script itself.
set -uo pipefail
cd "$(dirname "$0")/../.."

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then PY=.venv/bin/python; else PY=python3; fi
fi
DRY=""
if ! has_cuda "$PY"; then
  if [ -z "${GPU_CHECK_DRY:-}" ]; then
    echo "GPU check: skipped, nothing checked: no CUDA device visible to the torch of ${PYTHON:-.venv/bin/python or python3} (run it on a machine with an NVIDIA GPU)"
    exit 0
  fi
  DRY=1  # GPU_CHECK_DRY=1: the script's whole path without CUDA (every test skips): a check of the check
fi

# Python modules missing for $PY (with $PYTHONPATH as it is now).
missing() { "$PY" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "$@"; }

SITE="${GPU_CHECK_SITE:-/tmp/flodl-gpu-site}"
RUNNER="pytest pytest_timeout"
PROJECT="omegaconf hydra submitit mlflow"
# shellcheck disable=SC2086
miss="$(missing $RUNNER $PROJECT)"
if [ -n "$miss" ]; then
  echo "GPU check: $PY lacks: $miss"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo "GPU check: installing the wheels in .whl/ into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || echo "GPU check: installing .whl/ failed"
  fi
  # shellcheck disable=SC2086
  if [ -n "$(missing $RUNNER)" ]; then
    echo "GPU check: no pytest from .whl/: trying a package index for pytest and pytest-timeout"
    timeout 180 "$PY" -m pip install -q --no-cache-dir --retries 1 --timeout 15 --target "$SITE" "pytest>=7" "pytest-timeout>=2.2" >/dev/null 2>&1 \
      || echo "GPU check: no package index reachable"
  fi
  # shellcheck disable=SC2086
  still="$(missing $RUNNER)"
  if [ -n "$still" ]; then
    echo "GPU check: cannot run: $still not importable by $PY (run 'bash tests/gpu/wheels.sh' where PyPI is reachable and carry .whl/)"
    exit 2
  fi
  # shellcheck disable=SC2086
  still="$(missing $PROJECT)"
  [ -n "$still" ] && echo "GPU check: note: $still still missing: the end-to-end cases will be skipped"
fi
export PYTHONPATH="$PWD:$PWD/tests/gpu${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

[ -z "$DRY" ] && "$PY" - <<'EOF'
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
      f"cuda:0 = {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB, uuid {p.uuid}; "
      f"kernels for {' '.join(torch.cuda.get_arch_list())}; {nv}")
EOF

export GPU_CHECK_LIMIT_S="${GPU_CHECK_LIMIT_S:-900}"
HARD="${GPU_CHECK_HARD_S:-$(( ${GPU_CHECK_LIMIT_S%.*} + 180 ))}"
SUMMARY="$(mktemp)"
start=$(date +%s)
GPU_CHECK_SUMMARY="$SUMMARY" timeout -s INT -k 60 "$HARD" \
  "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -p gpu_check -rfEs "$@"
rc=$?
elapsed=$(( $(date +%s) - start ))
if [ -s "$SUMMARY" ]; then
  echo "$(cat "$SUMMARY"); pytest exit $rc"
else
  echo "GPU check: pytest ended without its summary after ${elapsed} s (exit $rc: the hard limit of ${HARD} s, GPU_CHECK_HARD_S, or a crash)"
fi
rm -f "$SUMMARY"
exit $rc
