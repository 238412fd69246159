"""`localllm launch AGENT [--model M] [--context N] [--config | --restore] [-- ARGS...]`, as `ollama launch` does:
find the server for this home (or start it in the background, as `run` does), make sure the model is there (pulled if
missing), load it with a context window that fits the agent, point the agent at it and exec it with ARGS.

The context is the model's trained context, at most LAUNCH_CONTEXT, halved until the memory plan (`localllm plan`)
fits the memory available; it is shown before launch with the plan. The model is loaded with it and kept loaded
(requests that ask a smaller context, as the agents' do by default, are served by it: engine/pool.py), and each
agent is told that window, so it compacts its history before the server would refuse it as overflowing.

What each agent is told, and where, is in agents.py; the files written, and how `--restore` puts them back, in
agent_files.py. The key is LOCALLLM_API_KEY when the server requires one, else a placeholder (agents insist on one)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .. import api, config
from ..errors import InvalidInput, LocalLLMError, ModelNotFound
from .agent_files import restore, write
from .agents import AGENTS, BY_HAND, Agent, Setup
from .app import app, err_console

if TYPE_CHECKING:
    from ..models.options import ModelFacts
    from ..models.plan import MemoryPlan

PLACEHOLDER_KEY = "localllm"  # the agents refuse to start without a key; our server ignores it unless one is set
# Ollama recommends at least 64K tokens for coding agents; more costs memory that few sessions fill.
LAUNCH_CONTEXT = 65_536
SMALLEST_CONTEXT = 2_048  # halving for memory stops here: the server's own check then says what does not fit
GIB = 2**30


class ToolNotInstalled(LocalLLMError):
    """The agent's command is not on PATH (exit 1, with how to install it)."""


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    tool: str = typer.Argument(..., help="the coding agent: " + ", ".join(AGENTS)),
    model: str | None = typer.Option(None, "--model", "-m", help="the model it uses (asked for when not given)"),
    context: int | None = typer.Option(
        None, "--context", min=16, help="context window in tokens (default: the most the model and memory allow)"
    ),
    config_only: bool = typer.Option(False, "--config", help="write the agent's config files without launching it"),
    undo: bool = typer.Option(False, "--restore", help="put back the config files launch wrote for this agent"),
):
    """Start a coding agent (claude, codex, opencode, aider...) locally.

    Arguments after `--` go to the agent, e.g. `localllm launch claude --model qwen2.5-coder:1.5b -- -p "hi"`."""
    agent = _agent(tool)
    if undo:
        _restore(agent)
        return
    executable = None if config_only else _executable(agent, tool)
    url = _server_url()
    chosen, shown = _choose_model(url, model)
    window = choose_context(chosen, shown, context)
    key = config.API_KEY.get()
    setup = Setup(url=url, key=key or PLACEHOLDER_KEY, keyed=bool(key), model=chosen, context=window.context)
    _show_window(agent, chosen, window)
    if config_only:
        _write_config(agent, setup)
        return
    assert executable is not None
    _load(url, chosen, window.context)
    write(agent.files(setup))
    env = {**os.environ, **agent.env(setup)}
    argv = [executable, *agent.args(setup), *ctx.args]
    err_console.print(f"launching {agent.title} on {chosen} at {url}", style="dim", highlight=False, soft_wrap=True)
    _exec(argv, env)


def _agent(tool: str) -> Agent:
    if tool in BY_HAND:
        raise InvalidInput(f"launch cannot set up {tool}", hint=BY_HAND[tool].format(url=config.base_url()))
    agent = AGENTS.get(tool)
    if agent is None:
        raise InvalidInput(f"unknown agent {tool!r}", hint=f"use one of {', '.join(AGENTS)}")
    return agent


def _executable(agent: Agent, tool: str) -> str:
    executable = shutil.which(agent.command)
    if executable is None:
        raise ToolNotInstalled(
            f"{agent.title} is not installed: `{agent.command}` is not on PATH",
            hint=f"install it ({agent.install}) and run `localllm launch {tool}` again",
        )
    return executable


def _restore(agent: Agent) -> None:
    done = restore(agent.paths())
    for line in done or [f"nothing to restore: launch wrote no config for {agent.title}"]:
        err_console.print(line, highlight=False, soft_wrap=True)


def _write_config(agent: Agent, setup: Setup) -> None:
    for path in write(agent.files(setup) + agent.saved(setup)):
        err_console.print(f"wrote {path}", highlight=False, soft_wrap=True)
    start = [f"{name}={value}" for name, value in agent.start_env(setup).items()]
    err_console.print(
        f"start it with: {shlex.join([*start, agent.command, *agent.args(setup)])}",
        highlight=False,
        soft_wrap=True,
    )
    err_console.print(
        f"the server loads {setup.model} with LOCALLLM_CONTEXT_LENGTH tokens unless it is already loaded with more: "
        f"`localllm launch {_name_of(agent)}` loads it with {setup.context:,}, or start the server with "
        f"LOCALLLM_CONTEXT_LENGTH={setup.context}",
        style="dim",
        highlight=False,
        soft_wrap=True,
    )


def _name_of(agent: Agent) -> str:
    return next(name for name, known in AGENTS.items() if known is agent)


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


def _choose_model(url: str, model: str | None) -> tuple[str, api.ShowResponse]:
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
    return model, shown


def _ask_model(names: list[str]) -> str:
    if not names:
        raise InvalidInput("no model is installed", hint="name one with --model (it is pulled first)")
    if not sys.stdin.isatty():
        raise InvalidInput("no model was named", hint=f"pass --model, e.g. --model {names[0]}")
    for number, name in enumerate(names, 1):
        err_console.print(f"  {number}. {name}", highlight=False, soft_wrap=True)
    choice = typer.prompt("model", default="1", err=True)
    if choice.isdigit() and 1 <= int(choice) <= len(names):
        return names[int(choice) - 1]
    if choice in names:
        return choice
    raise InvalidInput(f"{choice!r} is not one of the models listed", hint="pass --model")


# ---------------------------------------------------------------------------------------------------------- context


@dataclass(frozen=True)
class Window:
    """The context launch loads the model with, what bounded it, and the memory plan for it (None: no GGUF here)."""

    context: int
    trained: int | None
    bound: str
    plan: MemoryPlan | None


def choose_context(model: str, shown: api.ShowResponse, asked: int | None) -> Window:
    """`asked` when given (checked against the trained context and memory); else the trained context, at most
    LAUNCH_CONTEXT, halved until the memory plan fits what is available."""
    facts = _facts(shown)
    trained = facts.context_length or _trained_context(shown.model_info)
    if asked is not None:
        return _asked_window(model, asked, trained, facts)
    size = min(trained or LAUNCH_CONTEXT, LAUNCH_CONTEXT)
    bound = "its trained context" if trained and trained <= LAUNCH_CONTEXT else "launch's default"
    plan = _plan(facts, size)
    while plan is not None and plan.fits is False and size > SMALLEST_CONTEXT:
        size, bound = max(SMALLEST_CONTEXT, size // 2), "the memory available"
        plan = _plan(facts, size)
    return Window(size, trained, bound, plan)


def _asked_window(model: str, asked: int, trained: int | None, facts: ModelFacts) -> Window:
    if trained and asked > trained:
        raise InvalidInput(
            f"--context {asked} is over {trained}, the context {model} was trained on",
            hint=f"use --context {trained} or less",
        )
    plan = _plan(facts, asked)
    if plan is not None and plan.fits is False and plan.available is not None:
        raise InvalidInput(
            f"{model} with --context {asked} needs {plan.total / GIB:.1f} GiB but "
            f"{plan.available / GIB:.1f} GiB of memory is available",
            hint=f"lower --context, or leave it out to take what fits; `localllm plan {model} --num-ctx {asked}`",
        )
    return Window(asked, trained, "--context", plan)


def _facts(shown: api.ShowResponse) -> ModelFacts:
    """The weights' header, when the server's file is a GGUF this machine can read (the same home: _server_url)."""
    from ..models.options import ModelFacts, model_facts

    if not shown.path or not Path(shown.path).is_file():
        return ModelFacts()
    try:
        return model_facts(Path(shown.path), "gguf")
    except (LocalLLMError, OSError, ValueError):
        return ModelFacts()


def _trained_context(model_info: dict) -> int | None:
    value = model_info.get(f"{model_info.get('general.architecture')}.context_length")
    return value if isinstance(value, int) and value > 0 else None


def _plan(facts: ModelFacts, size: int) -> MemoryPlan | None:
    from ..errors import ModelFormatError
    from ..models.options import effective_load
    from ..models.plan import plan_memory

    if facts.info is None:
        return None
    try:
        return plan_memory(facts.info, effective_load(api.LoadOptions(num_ctx=size)))
    except ModelFormatError:
        return None


def _show_window(agent: Agent, model: str, window: Window) -> None:
    trained = f"trained for {window.trained:,}" if window.trained else "trained context unknown"
    err_console.print(
        f"{model}: context {window.context:,} tokens (bounded by {window.bound}; {trained})", highlight=False
    )
    plan = window.plan
    if plan is None:
        err_console.print(
            "memory: no plan (the weights' GGUF metadata cannot be read here)", highlight=False, soft_wrap=True
        )
    else:
        available = "unknown" if plan.available is None else f"{plan.available / GIB:.1f} GiB"
        err_console.print(
            f"memory: {plan.total / GIB:.1f} GiB (weights {plan.weights / GIB:.1f}, "
            f"KV cache {plan.kv_total / GIB:.1f}, compute {plan.compute / GIB:.1f}) of {available} available; "
            f"`localllm plan {model} --num-ctx {window.context}` shows it",
            highlight=False,
            soft_wrap=True,
        )
    if window.context < agent.least:
        err_console.print(
            f"warning: {agent.title}'s first request takes about {agent.least:,} tokens and {model} holds "
            f"{window.context:,}: the server will refuse it as overflowing; pick a model trained for more "
            "(e.g. qwen2.5-coder:1.5b)",
            style="yellow",
            highlight=False,
            soft_wrap=True,
        )


def _load(url: str, model: str, size: int) -> None:
    """Load the model with `size` tokens of context and keep it loaded: the agents' requests, which ask no context
    (or a smaller one), are served by it."""
    from ..client.http import HttpClient

    err_console.print(
        f"loading {model} with {size:,} tokens of context (kept loaded until `localllm stop {model}`)",
        style="dim",
        highlight=False,
        soft_wrap=True,
    )
    request = api.GenerateRequest(model=model, options={"num_ctx": size}, keep_alive=-1)
    with HttpClient(url) as client:
        for _ in client.generate(request):
            pass


def _exec(argv: list[str], env: dict[str, str]) -> None:
    """Become the agent (its exit code is ours); where exec is not the way (Windows), run it and pass its code on."""
    sys.stdout.flush()
    sys.stderr.flush()
    if sys.platform != "win32":
        os.execve(argv[0], argv, env)
    raise typer.Exit(subprocess.run(argv, env=env, check=False).returncode)
