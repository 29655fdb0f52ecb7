# kiln — the two commands a newcomer needs are `make demo` and `make test`.
# Everything is idempotent: a second `make` with nothing changed takes seconds.

PYTHON ?= python3
# Python writes the bytecode of what it imports (__pycache__, ignored by git), for every command make
# runs. Where PYTHONDONTWRITEBYTECODE is set, as on this kind of machine, it never does: each
# process (every Airflow task, torchrun worker and CLI call of the tests) compiled every module it
# imported from source again, about two thirds of importing airflow, mlflow or torch (measured:
# airflow.sdk 9 s of CPU, 3 s from bytecode; docs/testing.md).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed
# The CPU build of torch 2.13.0 lies on this kind of machine's disk; pip finds it there instead of
# downloading a multi-GB CUDA build.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PYTEST_ARGS ?=

.PHONY: venv system-deps up down status demo test test-fast lint bench gpu-check chaos lock clean-state help

help:
	@echo "make demo   set everything up and run the production DAG end to end on the embedded stack"
	@echo "make demo CORPUS=prose   the sandbox DAG on another corpus (prose: text found on this machine, imported)"
	@echo "make demo MIX=code-and-prose   the sandbox DAG on a data mixture (training/mixtures/NAME.toml)"
	@echo "make test   set everything up, run make lint, then the whole test suite (prints the 25 slowest tests)"
	@echo "make test-fast   unit, DAG and fast integration tests only (under 5 min): the inner loop"
	@echo "make lint   ruff (rules in pyproject.toml [tool.ruff]) and mypy ([tool.mypy]); both must pass"
	@echo "make up     start Airflow + MLflow in the background (prints URLs and logins); make down stops them"
	@echo "make bench  run benchmarks/ and write docs/benchmarks.md"

# uv installs the pinned set into the venv (the same constraints, the same torch wheel from
# /opt/wheels): about 25 s where pip took 2.5-3.7 min on 2 cores (docs/testing.md). uv itself comes
# from pip, at the version constraints.txt pins. Both of kiln's distributions install editable: the
# trainer side, kiln-trainer (training/), and kiln (the root), which depends on it. So does the worked
# example of a trainer of your own (examples/trainers/hf_causal_lm, a Hugging Face model), as a team
# installs its trainer where the ranks and Airflow's workers run: the sandbox form's tiny-llama recipe
# trains it.
EXAMPLE_TRAINER := examples/trainers/hf_causal_lm
$(STAMP): pyproject.toml training/pyproject.toml $(EXAMPLE_TRAINER)/pyproject.toml requirements.in constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -qq -c constraints.txt uv
	$(BIN)/uv pip install -q --python $(BIN)/python $(FIND_LINKS) -c constraints.txt -r requirements.in
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps --no-build-isolation -e training -e . -e $(EXAMPLE_TRAINER)
	@touch $@

venv: $(STAMP)

# Debian packages that some tests run for real (Slurm daemons, Prometheus); idempotent.
system-deps:
	@for script in scripts/system/*.sh; do [ -e "$$script" ] || continue; bash "$$script" || exit 1; done

up: venv
	$(BIN)/kiln stack up

down:
	@if [ -x $(BIN)/kiln ]; then $(BIN)/kiln stack down; else echo "nothing to stop (no venv)"; fi

status: venv
	$(BIN)/kiln stack status

demo: venv
	$(BIN)/kiln demo $(if $(CORPUS),--corpus $(CORPUS)) $(if $(MIX),--mixture $(MIX))

# Two pytest processes (pytest-xdist): the end-to-end tests, which mostly wait on Airflow, run in
# one of them, one stack at a time; the CPU-bound rest runs in the other meanwhile (groups:
# tests/conftest.py; figures: docs/testing.md). PYTEST_WORKERS=0 runs everything in one process.
# (Four workers with three stacks at once were tried: each idle stack costs about a third of a core,
# and the run went no faster.)
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)

# The 25 slowest tests are listed before pytest's summary line (which stays last).
test: venv system-deps lint
	$(BIN)/python -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

# The inner loop (under 5 min on 2 cores): unit, DAG and the fast integration tests; no stack, no
# torchrun group, no Slurm. `make test` before a push.
test-fast: venv
	$(BIN)/python -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# The habits the code's markers promise, checked: ruff's rule sets and mypy (a few seconds with
# mypy's cache, about 40 s without it).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: venv
	$(BIN)/python benchmarks/run.py $(BENCH)

# On a CUDA machine: NCCL + bf16 + fsdp on the gpt2-small recipe; prints MFU, tokens/s and checkpoint
# blocking and writes benchmarks/results/gpu_check.json (exits 2 where no GPU is visible).
gpu-check: venv
	$(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Seeded fault injection against the real components; writes docs/reliability.md (~45 min on 2 cores).
# Replay one trial of a report: make chaos SEED=<seed> TRIAL=<family>:<index> (no report written then).
chaos: venv system-deps
	PYTHONPATH=devtools $(BIN)/python -m kiln_devtools.chaos $(if $(SEED),--seed $(SEED)) $(if $(TRIAL),--trial $(TRIAL),--report docs/reliability.md) $(CHAOS_ARGS)

# Re-resolve constraints.txt from requirements.in (needs network to the package index).
lock:
	$(PYTHON) -m pip install -q uv
	$(PYTHON) -m uv pip compile requirements.in --python-version 3.11 $(FIND_LINKS) \
		--index-strategy unsafe-best-match --no-header -o constraints.txt
	sed -i '1i # Generated by `make lock` from requirements.in (uv pip compile). Do not edit by hand.' constraints.txt

clean-state: down
	rm -rf .kiln
