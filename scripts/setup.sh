#!/usr/bin/env bash
# All set-up on a fresh machine: a virtual environment in .venv holding localllm (editable) and llama-cpp-python built
# from source for this machine. README's commands and scripts/test.sh run this first; a second run is quick.
#
#   bash scripts/setup.sh            # the app
#   bash scripts/setup.sh dev,mlx    # with extras (the test suite's)
#
# Our build flags for llama.cpp, added to any CMAKE_ARGS of yours (e.g. -DGGML_CUDA=on):
#   -DGGML_RPC=ON   the RPC backend, for `localllm worker` and LOCALLLM_RPC
#   -mno-amx-*      on x86-64: llama.cpp's AMX matmul crashes on some Xeons (ggml-org/llama.cpp#20824: its tile
#                   config can be optimised away), and -march=native turns it on wherever the CPU has AMX
# pip caches the wheel by the sdist, not by CMAKE_ARGS: a build that lacks these flags, or was made with other
# CMAKE_ARGS than the ones you give, is built again.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
pip() { "$py" -m pip --disable-pip-version-check "$@"; }

user_args="${CMAKE_ARGS:-}"
args="-DGGML_RPC=ON"
case "$(uname -m)" in
  x86_64 | amd64)
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    args="$args -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'" ;;
esac
export CMAKE_ARGS="${user_args:+$user_args }$args"
stamp=.venv/llama-cpp-cmake-args  # the CMAKE_ARGS of the llama-cpp-python this venv holds

built_as_we_need() {
  "$py" - <<'PY'
import sys

import llama_cpp

info = llama_cpp.llama_print_system_info().decode()
sys.exit(0 if llama_cpp.llama_supports_rpc() and "AMX_INT8 = 1" not in info else 1)
PY
}

asked_for_another_build() {
  [ -n "$user_args" ] && [ "$(cat "$stamp" 2>/dev/null)" != "$CMAKE_ARGS" ]
}

pip install --quiet -e ".${extras:+[$extras]}"
if ! built_as_we_need || asked_for_another_build; then
  echo "building llama-cpp-python for this machine (a few minutes): CMAKE_ARGS=$CMAKE_ARGS" >&2
  version=$("$py" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
  pip cache remove 'llama_cpp_python*' >/dev/null 2>&1 || true
  pip install --quiet --force-reinstall --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version"
  built_as_we_need || { echo "llama-cpp-python still lacks RPC or builds AMX; see scripts/setup.sh" >&2; exit 1; }
fi
printf '%s\n' "$CMAKE_ARGS" > "$stamp"
