# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned here (dev/CI) to the CPU wheel; the package itself asks for a range.
TORCH_PIN ?= torch==2.13.0
FAST := not e2e and not slurm and not gpu and not conformance and not fuzz and not package

.PHONY: run test test-fast test-package docs docs-serve conformance lint typecheck ui venv clean clean-all

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[dev]" "$(TORCH_PIN)"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m flodl_exp $(ARGS)

# SLURM=0 leaves the slurm-marked tests out of make test: as root they apt-get install slurm-wlm, munge and
# mariadb-server when missing and start a single-node SLURM (munged, mariadbd, slurmdbd, slurmctld, slurmd;
# tests/slurm/up.sh), stopped again at their end. .ci/run runs them (SLURM=1, the default).
SLURM ?= 1
NOT_SLURM := $(if $(filter 0,$(SLURM)), and not slurm)

# The full suite: unit tests, end-to-end runs on real processes, a real SLURM, a real browser (~16-22 min on 2 cores).
# The unit tests on two pytest workers (as make test-fast), then the end-to-end runs, SLURM, GPU and fuzz cases
# serially (resource-sensitive): the same tests as one serial run, ~45 s sooner. `make test SLURM=0`: no SLURM.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "$(FAST)" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -m "not conformance and not package and not ($(FAST))$(NOT_SLURM)" $(PYTEST_ARGS)

# What a user outside this repository gets: the wheel installed into a fresh venv and run from a temporary project,
# the strict docs build, the quickstart's commands, an Optuna study (.ci/run runs it after make test).
test-package: $(STAMP)
	$(BIN)/python -m pytest -q -m package $(PYTEST_ARGS)

# The documentation site (docs/, mkdocs-material) into site/; --strict: a broken link or a missing page fails.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

# The whole conformance matrix on the 3:1 rig (five modes x (managed loop, two cooperative loops)) and the fault
# cases make test covers another way (an nccl kill, max_failure on one node), ~9 minutes.
conformance: $(STAMP)
	$(BIN)/python -m pytest -q -m conformance $(PYTEST_ARGS)

# Unit tests only (no process, no cluster): for iteration, under 2 minutes (two pytest workers: ~1,200 small
# tests, ~1.5 min on 2 cores; serial ~2.1 min).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "$(FAST)" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check flodl_exp experiments tests

typecheck: $(STAMP)
	$(BIN)/mypy

ui: $(STAMP)
	$(BIN)/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///$(CURDIR)/outputs/mlflow.db --default-artifact-root $(CURDIR)/outputs/mlartifacts

# Keeps the MLflow store (outputs/mlflow.db, outputs/mlartifacts) and every bundle; `make clean-all` removes them too.
clean:
	rm -rf outputs/jobs outputs/reports outputs/bench multirun site .pytest_cache .mypy_cache .ruff_cache
	@echo "kept outputs/mlflow.db, outputs/mlartifacts and checkpoint bundles (make clean-all removes them)"

clean-all:
	rm -rf outputs multirun .pytest_cache .mypy_cache .ruff_cache
