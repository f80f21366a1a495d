# The project's commands. `make setup` once, then `make demo`, `make test`, `make bench`.
PY      ?= .venv/bin/python
DATA    ?= synthetic
RUNS    ?= runs
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: setup test test-fast demo bench clean

setup: .venv/.installed

.venv/.installed: requirements.txt requirements-nodeps.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip==24.3.1
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	touch $@

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q tests -m "not server"

clean:
	rm -rf $(RUNS) .pytest_cache
