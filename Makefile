# Two commands do everything on a fresh clone: `make sweep` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.foldsweep-installed
SPEC ?= sweeps/quickstart.yaml
PYTEST_ARGS ?=

.PHONY: sweep test ui install clean chromium

sweep: $(STAMP)
	$(BIN)/foldsweep run $(SPEC)

test: $(STAMP) chromium
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The UI test drives the MLflow UI in headless Chromium, from Debian's package.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	@command -v chromium >/dev/null || { \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

ui: $(STAMP)
	$(BIN)/foldsweep ui

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstalls whenever the project's metadata changes; the package itself is installed editable.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) ray_results .pytest_cache
