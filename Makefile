# Two commands do everything on a fresh clone: `make sweep` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.foldsweep-installed
SPEC ?= sweeps/quickstart.yaml
PYTEST_ARGS ?=

.PHONY: sweep test ui install clean

sweep: $(STAMP)
	$(BIN)/foldsweep run $(SPEC)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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
