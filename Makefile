# kiln — the two commands a newcomer needs are `make demo` and `make test`.
# Everything is idempotent: a second `make` with nothing changed takes seconds.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed
# The CPU build of torch 2.13.0 lies on this kind of machine's disk; pip finds it there instead of
# downloading a multi-GB CUDA build.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PYTEST_ARGS ?=

.PHONY: venv system-deps up down status demo test test-fast bench lock clean-state help

help:
	@echo "make demo   set everything up and run the production DAG end to end on the embedded stack"
	@echo "make test   set everything up and run the whole test suite"
	@echo "make up     start Airflow + MLflow in the background (prints URLs and logins); make down stops them"
	@echo "make bench  run benchmarks/ and write docs/benchmarks.md"

$(STAMP): pyproject.toml requirements.in constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q $(FIND_LINKS) -c constraints.txt -r requirements.in
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
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
	$(BIN)/kiln demo

test: venv system-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: venv
	$(BIN)/python benchmarks/run.py $(BENCH)

# Re-resolve constraints.txt from requirements.in (needs network to the package index).
lock:
	$(PYTHON) -m pip install -q uv
	$(PYTHON) -m uv pip compile requirements.in --python-version 3.11 $(FIND_LINKS) \
		--index-strategy unsafe-best-match --no-header -o constraints.txt

clean-state: down
	rm -rf .kiln
