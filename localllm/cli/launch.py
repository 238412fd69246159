"""`localllm launch claude|codex|opencode [--model M] [-- ARGS...]`, as `ollama launch` does: find the server for
this home (or start it in the background, as `run` does), make sure the model is there (pulled if missing), point the
coding agent at it through the variables and flags each documents, and exec it with ARGS.

- Claude Code speaks Anthropic's Messages API: ANTHROPIC_BASE_URL (no /v1), the key as ANTHROPIC_AUTH_TOKEN (sent as
  a bearer token; ANTHROPIC_API_KEY emptied so a real key is not sent instead), the model as ANTHROPIC_MODEL, every
  model alias (opus, sonnet, haiku, subagents) set to the same model, and `--model`.
- Codex speaks the Responses API: a `localllm` provider given with `-c` (base_url, wire_api "responses", its key read
  from OPENAI_API_KEY), OPENAI_BASE_URL for the tools that read it, and `-m`.
- opencode takes a provider in its inline config (OPENCODE_CONFIG_CONTENT): an OpenAI-compatible one on /v1 whose
  only model is the one chosen, made the default.

The key is LOCALLLM_API_KEY when the server requires one, else a placeholder (the agents insist on one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import typer

from .. import config
from ..errors import InvalidInput, LocalLLMError, ModelNotFound
from .app import app, err_console

PLACEHOLDER_KEY = "localllm"  # the agents refuse to start without a key; our server ignores it unless one is set


class ToolNotInstalled(LocalLLMError):
    """The agent's command is not on PATH (exit 1, with how to install it)."""


@dataclass(frozen=True)
class Launch:
    """What one agent needs: its command, and its environment and arguments for a server URL, key and model."""

    command: str
    title: str
    install: str
    env: Callable[[str, str, str], dict[str, str]]
    args: Callable[[str, str], list[str]] = field(default=lambda url, model: [])


def _claude_env(url: str, key: str, model: str) -> dict[str, str]:
    aliases = ("ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL")
    return {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_AUTH_TOKEN": key,
        "ANTHROPIC_API_KEY": "",
        "ANTHROPIC_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        **dict.fromkeys(aliases, model),
    }


def _codex_env(url: str, key: str, model: str) -> dict[str, str]:
    return {"OPENAI_BASE_URL": url + "/v1", "OPENAI_API_KEY": key}


def _codex_args(url: str, model: str) -> list[str]:
    provider = f'{{name = "localllm", base_url = {json.dumps(url + "/v1")}, env_key = "OPENAI_API_KEY", '
    provider += 'wire_api = "responses"}'
    return ["-c", 'model_provider="localllm"', "-c", f"model_providers.localllm={provider}", "-m", model]


def _opencode_env(url: str, key: str, model: str) -> dict[str, str]:
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "localllm",
        "options": {"baseURL": url + "/v1", "apiKey": key},
        "models": {model: {"name": model, "tool_call": True}},
    }
    return {"OPENCODE_CONFIG_CONTENT": json.dumps({"provider": {"localllm": provider}, "model": f"localllm/{model}"})}


TOOLS: dict[str, Launch] = {
    "claude": Launch(
        "claude", "Claude Code", "npm install -g @anthropic-ai/claude-code", _claude_env, lambda u, m: ["--model", m]
    ),
    "codex": Launch("codex", "Codex", "npm install -g @openai/codex", _codex_env, _codex_args),
    "opencode": Launch("opencode", "opencode", "npm install -g opencode-ai", _opencode_env),
}


# ---------------------------------------------------------------------------------------------------------- command


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    tool: str = typer.Argument(..., help="the coding agent: " + ", ".join(TOOLS)),
    model: str | None = typer.Option(None, "--model", "-m", help="the model it uses (asked for when not given)"),
):
    """Start a coding agent (claude, codex, opencode) on a local model.

    Arguments after `--` go to the agent, e.g. `localllm launch claude --model qwen2.5-coder:1.5b -- -p "hi"`."""
    target = TOOLS.get(tool)
    if target is None:
        raise InvalidInput(f"unknown agent {tool!r}", hint=f"use one of {', '.join(TOOLS)}")
    executable = shutil.which(target.command)
    if executable is None:
        raise ToolNotInstalled(
            f"{target.title} is not installed: `{target.command}` is not on PATH",
            hint=f"install it ({target.install}) and run `localllm launch {tool}` again",
        )
    url = _server_url()
    chosen = _choose_model(url, model)
    key = config.API_KEY.get() or PLACEHOLDER_KEY
    env = {**os.environ, **target.env(url, key, chosen)}
    argv = [executable, *target.args(url, chosen), *ctx.args]
    err_console.print(f"launching {target.title} on {chosen} at {url}", style="dim", highlight=False)
    _exec(argv, env)


def _server_url() -> str:
    from .background import check_same_home, server_health
    from .chat import start_server

    url = config.base_url()
    health = server_health(url)
    if health is None:
        start_server()
    else:
        check_same_home(health)
    return url


def _choose_model(url: str, model: str | None) -> str:
    """The model named, pulled when missing; without a name, one picked from the local models (asked for)."""
    from ..client.http import HttpClient
    from .render import render_pull

    with HttpClient(url) as client:
        if model is None:
            model = _ask_model([m.name for m in client.list_models().models])
        try:
            shown = client.show(model)
        except ModelNotFound:
            render_pull(client.pull(model), to=err_console)
            shown = client.show(model)
    if "tools" not in shown.capabilities:
        err_console.print(
            f"warning: {model} cannot call tools (its template shows none); the agent will only chat", style="yellow"
        )
    return model


def _ask_model(names: list[str]) -> str:
    if not names:
        raise InvalidInput("no model is installed", hint="name one with --model (it is pulled first)")
    if not sys.stdin.isatty():
        raise InvalidInput("no model was named", hint=f"pass --model, e.g. --model {names[0]}")
    for number, name in enumerate(names, 1):
        err_console.print(f"  {number}. {name}", highlight=False)
    choice = typer.prompt("model", default="1", err=True)
    if choice.isdigit() and 1 <= int(choice) <= len(names):
        return names[int(choice) - 1]
    if choice in names:
        return choice
    raise InvalidInput(f"{choice!r} is not one of the models listed", hint="pass --model")


def _exec(argv: list[str], env: dict[str, str]) -> None:
    """Become the agent (its exit code is ours); where exec is not the way (Windows), run it and pass its code on."""
    sys.stdout.flush()
    sys.stderr.flush()
    if sys.platform != "win32":
        os.execve(argv[0], argv, env)
    raise typer.Exit(subprocess.run(argv, env=env, check=False).returncode)
