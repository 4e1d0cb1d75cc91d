# Developer entry points. Setup is idempotent: the venv is created once, and the project is
# (re)installed only when pyproject.toml is newer than the install stamp.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
STAMP := $(VENV)/.claw-installed

.PHONY: setup test demo lint

setup: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 (dev extra) is a CPU wheel that pip finds on local disk.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -e '.[dev]'
	touch $@

test: $(STAMP)
	$(VENV)/bin/pytest -q

demo: $(STAMP)
	$(VENV)/bin/claw demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
