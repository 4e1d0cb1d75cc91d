# Developer entry points. Setup is idempotent: the venv is created once, and the project is
# (re)installed only when pyproject.toml is newer than the install stamp.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
STAMP := $(VENV)/.claw-installed
DEMO_STAMP := $(VENV)/.claw-demo-installed

.PHONY: setup test test-fast test-slow soak demo lint docs bench browser promtool

setup: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 (demo and dev extras) is a CPU wheel that pip finds on local disk.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -e '.[dev]'
	touch $@ $(DEMO_STAMP)

# The demo's weight only: the runtime, torch (CPU) and matplotlib; no test tools.
$(DEMO_STAMP): pyproject.toml | $(VENV)/bin/python
	@echo "== Installing Claw into $(VENV) with what the demo needs: the runtime (Celery,"
	@echo "== Redis client, numpy, ...), torch (CPU) and matplotlib. The first time this takes"
	@echo "== a few minutes; later runs skip it."
	$(VENV)/bin/python -m pip install -e '.[demo]'
	touch $@

# The web inspector's browser tests drive Debian's chromium: installed here when missing
# (as root, as in CI; otherwise the tests say which command installs it).
browser:
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	    && command -v apt-get >/dev/null 2>&1; then \
	    echo "== installing chromium for the web inspector's browser tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

# The alerts' tests run Prometheus' promtool (ops/alerts.yml): Debian's prometheus package
# ships it; installed here when missing, as chromium is.
promtool:
	@if ! command -v promtool >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	    && command -v apt-get >/dev/null 2>&1; then \
	    echo "== installing promtool (Debian's prometheus package) for the alerts' tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	fi

# Two test processes (one per core of the 2-core CI machine): most tests wait on the
# redis-servers and workers they start, so the suite's wall time nearly halves. A test file
# stays in one process (--dist loadfile): its module-scoped workers and servers are shared.
test: $(STAMP) browser promtool
	$(VENV)/bin/pytest -q -n 2 --dist loadfile

# The fast loop: tests/unit/ only (the code alone: no redis-server, worker, browser or
# network; tests/unit/conftest.py refuses them), well under a minute.
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q tests/unit

# The opt-in long variants (`slow`: soak, fuzz and learning runs at full size).
test-slow: $(STAMP) browser promtool
	$(VENV)/bin/pytest -q -n 2 --dist loadfile -m slow

# The chaos soak over simulated hosts (tests/soak/soak.py; needs root): SOAK_MINUTES of
# seeded faults, a one-page report, exit 1 on any violation.
SOAK_MINUTES ?= 30
SOAK_SEED ?= 1
soak: $(STAMP)
	$(VENV)/bin/python -m tests.soak.soak --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED)

demo: $(DEMO_STAMP)
	@echo "== Running 'claw demo' (a minute or two). To use 'claw' yourself afterwards:"
	@echo "==   source $(VENV)/bin/activate   (or run $(VENV)/bin/claw)"
	$(VENV)/bin/claw demo

# The documentation site in site/: its reference pages (settings, commands, metrics, recipe
# keys, schedule) are generated from the code at build time (tools/docsgen.py, a MkDocs
# hook); --strict fails on a broken link or anchor, a missing reference or a page left out
# of the nav.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The benches behind docs/benchmarks.md's goals table, one after the other (each starts its
# own redis-server and workers); outputs and a summary with the load under tmp/bench-<time>/.
# Run on a quiet machine. BENCH="sb3_dqn adds" runs those alone.
bench: $(STAMP)
	$(VENV)/bin/python bench/run.py $(if $(BENCH),--only $(BENCH))

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
