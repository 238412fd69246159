#!/usr/bin/env bash
# Build llama.cpp's own llama-server (and llama-mtmd-cli, its multimodal tool) from the sources vendored in the
# llama-cpp-python sdist we pin, for the benchmark's reference (what a user gets from llama-server at its defaults)
# and the tests that compare with llama.cpp's own tools. Cached outside the tree; prints llama-server's path
# (llama-mtmd-cli lies beside it). Same build flags as scripts/setup.sh (no AMX matmul on x86-64), so both sides
# run the same kernels.
#   LLAMA_SERVER=$(bash scripts/build_llama_server.sh) python scripts/bench.py ...
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -1 | cut -d= -f3)
cache="${LOCALLLM_BENCH_CACHE:-$HOME/.cache/localllm-bench}/llama.cpp-$version"
binary="$cache/build/bin/llama-server"
if [ ! -x "$binary" ] || [ ! -x "$cache/build/bin/llama-mtmd-cli" ]; then
  mkdir -p "$cache"
  if [ ! -d "$cache/src" ]; then
    python3 -m pip download --quiet --no-deps --no-binary :all: -d "$cache" "llama-cpp-python==$version" >&2
    tar -xzf "$cache/llama_cpp_python-$version.tar.gz" -C "$cache"
    mv "$cache/llama_cpp_python-$version/vendor/llama.cpp" "$cache/src"
    rm -rf "$cache/llama_cpp_python-$version"
  fi
  flags=()
  case "$(uname -m)" in
    x86_64 | amd64) flags=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                           -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16") ;;
  esac
  cmake -S "$cache/src" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF "${flags[@]}" >&2
  cmake --build "$cache/build" --target llama-server llama-mtmd-cli -j "$(nproc)" >&2
fi
echo "$binary"
