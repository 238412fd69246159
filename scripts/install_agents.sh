#!/usr/bin/env bash
# Install the coding agents that tests/test_real_agents.py runs against localllm, once per machine, into a cache
# outside the tree: Claude Code, Codex, opencode and Qwen Code from npm (one prefix), aider from pip into its own venv
# (it pins many packages). Prints the folder to put first on PATH (the agents' commands lie there). An agent whose
# install fails is left out (said on stderr); the tests of an agent that is not there skip.
#   PATH="$(bash scripts/install_agents.sh):$PATH" .venv/bin/python -m pytest tests/test_real_agents.py
set -uo pipefail
cd "$(dirname "$0")/.."
cache="${LOCALLLM_AGENTS_CACHE:-$HOME/.cache/localllm-agents}"
bin="$cache/bin"
mkdir -p "$bin"

npm_agent() { # package, command
  local package=$1 command=$2
  if [ ! -x "$cache/npm/node_modules/.bin/$command" ]; then
    command -v npm >/dev/null || { echo "install_agents: npm is missing, $package left out" >&2; return; }
    npm install --prefix "$cache/npm" --no-audit --no-fund --loglevel=error "$package" >&2 ||
      echo "install_agents: npm install $package failed, left out" >&2
  fi
  [ -x "$cache/npm/node_modules/.bin/$command" ] && ln -sf "$cache/npm/node_modules/.bin/$command" "$bin/$command"
}

npm_agent @anthropic-ai/claude-code claude
npm_agent @openai/codex codex
npm_agent opencode-ai opencode
npm_agent @qwen-code/qwen-code qwen

if [ ! -x "$cache/aider/bin/aider" ]; then
  python3 -m venv "$cache/aider" >&2 &&
    "$cache/aider/bin/python" -m pip install --quiet aider-chat >&2 ||
    echo "install_agents: pip install aider-chat failed, left out" >&2
fi
[ -x "$cache/aider/bin/aider" ] && ln -sf "$cache/aider/bin/aider" "$bin/aider"
echo "$bin"
