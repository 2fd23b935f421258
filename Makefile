# Two commands do everything on a fresh clone: `make sweep` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.foldsweep-installed
READ_AHEAD := $(VENV)/foldsweep-read-ahead.json
SPEC ?= sweeps/quickstart.yaml
PYTEST_ARGS ?=
# `make test` runs the suite in two pytest-xdist workers, a test module at a time (tests/run_machinery.py
# says how they are sent): on two cores one worker's sweep starts processes and imports while the
# other's trains. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
# The extras of .venv; a GPU machine adds gpu: `make install EXTRAS="test gpu"`.
EXTRAS ?= test

# .venv holds exactly the versions of uv.lock, installed by uv; uv itself comes from PyPI, pinned,
# into a tools environment of its own (.venv is synced exactly and would lose it).
UV_VERSION := 0.13.9
TOOLS := .tools
UV := $(TOOLS)/bin/uv
export UV_PROJECT_ENVIRONMENT := $(abspath $(VENV))
# pylock.toml (PEP 751) for other installers: the runtime dependencies, and with the gpu extra.
EXPORT := $(UV) export --frozen --no-emit-project --no-header --quiet --format pylock.toml

.PHONY: sweep test test-fast lint docs docs-check ui install bytecode lock lock-check clean chromium

sweep: bytecode $(READ_AHEAD)
	$(BIN)/foldsweep run $(SPEC)

# The lint and the docs build run beside the suite rather than before it: on a fresh clone mypy
# takes a core for about 16 s with nothing cached. Their output follows the suite's, and either
# failing fails `make test`.
test: lock-check bytecode chromium
	@checks=$$(mktemp) && trap 'rm -f "$$checks"' EXIT && \
	{ $(MAKE) --no-print-directory lint docs-check >"$$checks" 2>&1 & } && beside=$$! && \
	{ $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS); suite=$$?; } ; \
	wait $$beside; checked=$$?; cat "$$checks"; \
	[ $$checked -eq 0 ] || echo "make lint or make docs-check failed (above)" >&2; \
	exit $$(( suite || checked ))

# The style, kept by tools: ruff's formatter and linter over the code, mypy over the package and the
# benchmarks (pyproject.toml's [tool.mypy]). `make test` runs it beside the suite, so CI keeps it.
lint: $(STAMP)
	$(BIN)/ruff format --check pipeline tests benchmarks
	$(BIN)/ruff check pipeline tests benchmarks
	$(BIN)/mypy

# The docs site (mkdocs.yml: docs/ with the Material theme) into site/. MkDocs' strict build
# refuses a link to a missing page or a missing anchor; docs-check builds it so into a scratch
# directory, and `make test` runs it before the suite, so CI fails on a broken link. It prints
# MkDocs' log only when the build fails: `--quiet` would hide the warnings from strict mode too,
# and the build would pass. NO_MKDOCS_2_WARNING: the Material theme's notice about MkDocs 2.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs
docs: $(STAMP)
	$(MKDOCS) build --strict --site-dir site

docs-check: $(STAMP)
	@scratch=$$(mktemp -d) && trap 'rm -rf "$$scratch"' EXIT && \
		log=$$($(MKDOCS) build --strict --site-dir "$$scratch" 2>&1) || { echo "$$log" >&2; exit 1; }

# The inner loop: pure logic and quick in-process checks, no sweep, no training, no browser.
test-fast: bytecode
	$(BIN)/python -m pytest -m "not e2e and not training" $(PYTEST_ARGS)

# The UI test drives the MLflow UI in headless Chromium, from Debian's package.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	@command -v chromium >/dev/null || { \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

ui: bytecode
	$(BIN)/foldsweep ui

install: bytecode $(READ_AHEAD)

# The bytecode of the repository's own modules, which uv's --compile-bytecode (below) leaves out:
# where PYTHONDONTWRITEBYTECODE is set, every process would compile them from source: the sweep's
# driver and each of its Ray workers, every command a test runs. compileall writes only what
# changed since; a file that does not compile is left to the command that imports it to report.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -qq pipeline experiments benchmarks tests || true

$(UV):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --quiet "uv==$(UV_VERSION)"

# --locked: a uv.lock that no longer matches pyproject.toml stops here instead of being re-resolved.
# --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set (as on these machines) nothing else ever
# writes the .pyc files, and every process (each Ray worker, each CLI call) would compile
# TensorFlow, Ray and MLflow from source again: 12.6 s to import them instead of 5.2 s.
# Then the empty MLflow store that every new SQLite store is copied from, made in foldsweep's cache
# once per MLflow version (pipeline.records.stores.empty_store) rather than by the first sweep.
# Last, what the install wrote (hundreds of MB, most of it bytecode) goes to disk at once (`sync`):
# left to the kernel's writeback, it is written while the suite's first processes start, slowing them.
$(STAMP): pyproject.toml uv.lock | $(UV)
	$(UV) sync --locked --compile-bytecode $(addprefix --extra ,$(EXTRAS)) --python $(PYTHON)
	$(BIN)/python -m pipeline.records.tracking
	sync -f $(VENV) 2>/dev/null || sync
	touch $(STAMP)

# The plan of the files a sweep's processes read as they start, in the environment, which each
# command that loads TensorFlow asks the kernel to read ahead (pipeline.base.read_ahead); recorded
# once the repository's bytecode is written, so that it names those files too.
$(READ_AHEAD): $(STAMP) | bytecode
	$(BIN)/python -c "from pipeline.sweep import record_start_up_read_ahead; record_start_up_read_ahead()"

# The one way to change dependencies: edit pyproject.toml, then `make lock`, and commit all three.
lock: | $(UV)
	$(UV) lock
	$(EXPORT) -o pylock.toml
	$(EXPORT) --extra gpu -o pylock.gpu.toml

lock-check: | $(UV)
	@$(UV) lock --check --quiet || { echo "uv.lock does not match pyproject.toml: run make lock" >&2; exit 1; }
	@$(EXPORT) | cmp -s - pylock.toml || { echo "pylock.toml does not match uv.lock: run make lock" >&2; exit 1; }
	@$(EXPORT) --extra gpu | cmp -s - pylock.gpu.toml || { echo "pylock.gpu.toml does not match uv.lock: run make lock" >&2; exit 1; }

clean:
	rm -rf $(VENV) $(TOOLS) ray_results .pytest_cache site
