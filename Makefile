PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: run test bench lint install install-test

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(VENV)/bin/activate
	$(PIP) install -q -e .

install-test: $(VENV)/bin/activate
	$(PIP) install -q -e '.[test]'

run: install
	$(VENV)/bin/kimi-linear-jax generate --prompt "The quick brown fox" --max-tokens 32 --num-scheduler-steps 8

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q

bench: install-test
	$(PY) benchmarks/run_all.py
