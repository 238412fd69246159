#!/usr/bin/env bash
# All set-up on a fresh machine, then the whole test suite. README's test command; .ci/run calls exactly this.
# The first run builds llama-cpp-python from source (a few minutes); pip's wheel cache makes later runs quick.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev,mlx]'
exec .venv/bin/python -m pytest "$@"
