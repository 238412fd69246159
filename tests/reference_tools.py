"""llama.cpp's own tools, built from the vendored sources by scripts/build_llama_server.sh, for the tests that
compare our answers with theirs on the same files. scripts/test.sh builds them once per machine (its cache) and
names them in LLAMA_SERVER and LLAMA_MTMD_CLI; elsewhere a test that needs one skips, saying how to build it."""

from __future__ import annotations

import os
from pathlib import Path

import llama_cpp
import pytest

VARIABLES = {"llama-server": "LLAMA_SERVER", "llama-mtmd-cli": "LLAMA_MTMD_CLI"}


def reference_tool(name: str) -> str:
    """The path of llama.cpp's tool `name`: its variable's, or where the build script leaves it."""
    variable = VARIABLES[name]
    binary = Path(os.environ.get(variable) or built_path(name))
    if binary.is_file():
        return str(binary)
    why = f"{name} is not built at {binary} (bash scripts/build_llama_server.sh, or {variable}=PATH)"
    if os.environ.get("CI") == "true":  # scripts/test.sh builds them there: a missing one is a broken set-up
        pytest.fail(why)
    pytest.skip(why)


def built_path(name: str) -> Path:
    """Where scripts/build_llama_server.sh builds `name` for the llama-cpp-python installed here."""
    cache = Path(os.environ.get("LOCALLLM_BENCH_CACHE") or Path.home() / ".cache" / "localllm-bench")
    return cache / f"llama.cpp-{llama_cpp.__version__}" / "build" / "bin" / name
