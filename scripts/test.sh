#!/usr/bin/env bash
# All set-up on a fresh machine, then lint, types and the whole test suite. README's test command; .ci/run calls
# exactly this. The first run builds llama-cpp-python from source (a few minutes); pip's wheel cache makes later runs
# quick. Arguments go to pytest; `--quick` first skips the tests that need the models, MLX or minutes:
#   bash scripts/test.sh --quick            bash scripts/test.sh tests/test_scheduler.py -k chunk
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,mlx
.venv/bin/python -m ruff check localllm tests scripts
.venv/bin/python -m ruff format --check localllm tests scripts
.venv/bin/python -m mypy
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- -m "not models and not mlx and not slow" "$@"
fi
exec .venv/bin/python -m pytest "$@"
