#!/usr/bin/env bash
# All set-up on a fresh machine, then lint, types and the whole test suite. README's test command; .ci/run calls
# exactly this. The first run builds llama-cpp-python from source (a few minutes) and llama.cpp's own reference tools
# (about 7 minutes on 2 cores); pip's wheel cache and the tools' cache make later runs quick. Arguments go to pytest;
# `--quick` first skips the tests that need the models, MLX or minutes (and the reference tools' build):
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
else
  # llama.cpp's own llama-server and llama-mtmd-cli, which the vision and rerank tests compare with: built once per
  # machine into a cache outside the tree (about 7 minutes on 2 cores), found there by every later run.
  LLAMA_SERVER=$(bash scripts/build_llama_server.sh)
  export LLAMA_SERVER LLAMA_MTMD_CLI="${LLAMA_SERVER%/*}/llama-mtmd-cli"
  # Debian's chromium, which tests/test_web_ui.py drives through Playwright (Playwright's own browser downloads are
  # not reachable here): installed once per machine.
  if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
  # The npm MCP servers tests/test_mcp*.py start with node: installed once per machine into a cache outside the tree
  # (tests/mcp_servers.py finds them there; without npm those tests skip and say why).
  MCP_NPM="${LOCALLLM_TEST_MCP_NPM:-$HOME/.cache/localllm-tests/mcp-npm}"
  if command -v npm >/dev/null && [ ! -e "$MCP_NPM/node_modules/@modelcontextprotocol/server-everything" ]; then
    mkdir -p "$MCP_NPM" && npm install --no-audit --no-fund --silent --prefix "$MCP_NPM" \
      @modelcontextprotocol/server-filesystem @modelcontextprotocol/server-everything
  fi
  # The coding agents tests/test_real_agents.py runs (Claude Code, Codex, opencode, Qwen Code, aider): installed once
  # per machine into a cache outside the tree; an agent whose install failed is skipped by its test.
  LOCALLLM_AGENTS_BIN=$(bash scripts/install_agents.sh)
  export LOCALLLM_AGENTS_BIN
fi
exec .venv/bin/python -m pytest "$@"
