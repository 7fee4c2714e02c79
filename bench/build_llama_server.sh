#!/usr/bin/env bash
# Build llama.cpp's own server (llama-server, which batches sessions) for
# bench/concurrency.py's baseline, into .venv/bin/llama-server.
#
# The source is the llama.cpp that the `bench` extra's llama-cpp-python sdist carries
# (vendor/llama.cpp, tools/server included): the package index is the only place this
# project fetches from. Flags as the Makefile's LLAMA_CMAKE (GGML_NATIVE=OFF: some VMs
# advertise AMX and trap on it, ../shared/notes/engine.md). About 5 minutes on 2 cores.
#
# Usage: bench/build_llama_server.sh [VENV]   (from the repository root; VENV: .venv)
set -euo pipefail
venv="${1:-.venv}"
version="$("$venv/bin/python" -c 'import re, pathlib; print(re.search(r"llama-cpp-python\[server\]==([0-9.]+)", pathlib.Path("pyproject.toml").read_text()).group(1))')"
work="build/llama-server-src"
rm -rf "$work" && mkdir -p "$work"
"$venv/bin/python" -m pip download --quiet --no-binary :all: --no-deps \
    "llama-cpp-python==$version" -d "$work"
tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
cmake_bin="$(command -v cmake || true)"
if [ -z "$cmake_bin" ]; then
    "$venv/bin/python" -m pip install --quiet cmake
    cmake_bin="$venv/bin/cmake"
fi
flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
cpu="$(cat /proc/cpuinfo 2>/dev/null || true)"
if grep -qw avx512f <<<"$cpu"; then
    flags+=(-DGGML_AVX512=ON)
    grep -qw avx512_vnni <<<"$cpu" && flags+=(-DGGML_AVX512_VNNI=ON)
    grep -qw avx512_bf16 <<<"$cpu" && flags+=(-DGGML_AVX512_BF16=ON)
fi
"$cmake_bin" -S "$src" -B "$work/build" "${flags[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    > "$work/cmake.log" 2>&1 || { tail -40 "$work/cmake.log"; exit 1; }
"$cmake_bin" --build "$work/build" --target llama-server -j "$(nproc)" \
    > "$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
cp "$work/build/bin/llama-server" "$venv/bin/llama-server"
rm -rf "$work"
echo "llama-server: $venv/bin/llama-server ($("$venv/bin/llama-server" --version 2>&1 | head -1))"
