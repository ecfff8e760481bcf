# Two commands on a fresh machine:  make up   (the product, embedded default)
#                                   make test (the suite, on PostgreSQL + Redis, then SQLite)
PYTHON ?= $(shell scripts/find-python)
VENV   := .venv
BIN    := $(VENV)/bin
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install up test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The suite covers the LangGraph checkpointer too: its extra comes with the test tools.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,langgraph]'
	touch $@

install: $(VENV)/.installed

# Migrate, static files, the admin, the demo runs, then every process (scripts/up): the
# sign-in details come after the processes' start-up logs; Ctrl-C stops them and exits 0.
up: install
	$(BIN)/python scripts/up

test: install
	scripts/test

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-logo --no-cache
	$(BIN)/mypy

$(VENV)/.installed-bench: pyproject.toml | $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

bench: install $(VENV)/.installed-bench
	$(BIN)/python -m bench.checkpoint

clean:
	rm -rf var test-artifacts
