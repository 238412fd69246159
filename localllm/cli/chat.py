"""The commands that talk to loaded models: `run` (one-shot answer or the interactive chat), `ps`, `stop` and `tui`.

They go through a Client: the running server's, started in the background when none answers on LOCALLLM_HOST (as
Ollama does), so a second `run`, the TUI or an IDE plugin reuse the loaded model. `run --in-process` keeps the model
in the command's own process instead."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from .. import api, config
from ..client.protocol import Client
from ..conversation import Conversation, is_model
from ..errors import InvalidInput, LocalLLMError, ModelNotFound, ServerConflict
from .app import app, console, err_console
from .line_input import make_line_reader
from .render import print_timings, ps_table, ps_text
from .repl import Repl, prepare_model, stream_reply

IN_PROCESS_HELP = "run the model inside this command instead of through the server (nothing else can share it)"


# ---------------------------------------------------------------------------------------------------------- clients


@contextmanager
def open_client(*, in_process: bool = False) -> Iterator[Client]:
    """The client `run` and `tui` use: the server's (started in the background if needed), or an in-process one."""
    client = _local_client() if in_process else _server_client(start=True)
    try:
        yield client
    finally:
        client.close()


def _local_client():
    from ..client.local import LocalClient

    return LocalClient()


def _server_client(*, start: bool):
    from ..client.http import HttpClient
    from .background import check_same_home, server_health

    url = config.base_url()
    health = server_health(url) if start else None
    if health is not None:
        check_same_home(health)
    elif start:
        start_server()
    return HttpClient(url)


def start_server() -> None:
    from .background import ensure_server, started_notice

    url = config.base_url()
    started: list[str] = []
    with err_console.status(f"starting the localllm server on {url}…", spinner="dots"):
        ensure_server(on_start=started.append)
    for url in started:  # said once, by the command that started it
        err_console.print(started_notice(url), style="dim", highlight=False)


# ---------------------------------------------------------------------------------------------------------- run


@app.command()
def run(
    model: str = typer.Argument(..., help="model name (pulled first if missing) or a .gguf path"),
    prompt: list[str] | None = typer.Argument(
        None, help="ask once and print the answer; piped stdin is read as (the start of) the prompt"
    ),
    verbose: bool = typer.Option(False, "--verbose", help="print timings after each answer"),
    keepalive: str | None = typer.Option(
        None, "--keepalive", help="how long the model stays loaded after the last request (5m, 1h, -1 forever)"
    ),
    format: str | None = typer.Option(None, "--format", help="json: answer in JSON"),
    think: str | None = typer.Option(
        None, "--think", help="a reasoning model thinks first: --think, --think=false, --think=low|medium|high"
    ),
    hidethinking: bool = typer.Option(False, "--hidethinking", help="do not show the thinking"),
    in_process: bool = typer.Option(False, "--in-process", help=IN_PROCESS_HELP),
    mcp_config: Path | None = typer.Option(
        None, "--mcp-config", help="the mcp.json whose servers' tools the chat offers (default: LOCALLLM_MCP_CONFIG)"
    ),
    trust_tools: bool = typer.Option(False, "--trust-tools", help="run MCP tool calls without asking"),
    tools: bool = typer.Option(True, "--tools/--no-tools", help="offer the MCP servers' tools to the model"),
):
    """Chat with a model, or ask it once (prompt argument or stdin).

    A one-shot run prints the answer alone on stdout; progress and timings go to stderr."""
    keep_alive = None if keepalive is None else api.parse_keep_alive(keepalive, what="--keepalive")
    conversation = Conversation(model, keep_alive=keep_alive, format=_format(format))
    _set_think(conversation, think)
    text = _one_shot_prompt(prompt)
    if text is not None and not text.strip():
        raise InvalidInput(
            "there was no prompt: " + ("stdin was empty" if not prompt else "the prompt is empty"),
            hint=f'pass one: `localllm run {model} "..."`, or pipe text in; without either, `run` opens the chat',
        )
    with open_client(in_process=in_process) as client:
        prepare_model(client, conversation.load_request(), to=err_console)
        if text is None:
            from .mcp_chat import open_chat_tools

            reader = make_line_reader(config.HOME.get() / "history")
            with open_chat_tools(client, mcp_config, trust=trust_tools, enabled=tools) as chat_tools:
                Repl(
                    client, conversation, reader=reader, verbose=verbose, hide_thinking=hidethinking, tools=chat_tools
                ).run()
        else:
            _answer_once(client, conversation, text, verbose=verbose, hide_thinking=hidethinking)


def _one_shot_prompt(words: list[str] | None) -> str | None:
    """The prompt of a one-shot run (piped stdin, then the arguments), or None for the interactive chat."""
    piped = None if sys.stdin.isatty() else sys.stdin.read()
    if piped is None and not words:
        return None
    return "\n\n".join(part.strip() for part in (piped, " ".join(words or [])) if part and part.strip())


def _answer_once(
    client: Client, conversation: Conversation, text: str, *, verbose: bool, hide_thinking: bool = False
) -> None:
    """Stream the answer to stdout as plain text (a script reads it as it comes); thinking goes to stderr, dimmed."""

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    def think(piece: str) -> None:
        err_console.print(piece, style="dim", end="", highlight=False, markup=False)

    final = stream_reply(client.chat(conversation.ask(text)), write, None if hide_thinking else think)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if verbose and final is not None:
        print_timings(final, to=err_console)


def _set_think(conversation: Conversation, value: str | None) -> None:
    try:
        conversation.set_think(value)
    except InvalidInput:
        raise InvalidInput(
            f"--think={value} is not valid", hint="use --think, --think=false or --think=low|medium|high"
        ) from None


def _format(value: str | None) -> api.Format:
    if value not in (None, "json"):
        raise InvalidInput(f"--format {value!r} is not supported", hint="use --format json")
    return "json" if value else None


# ---------------------------------------------------------------------------------------------------------- ps, stop


@app.command()
def ps(as_json: bool = typer.Option(False, "--json", help="print the list as JSON (as /api/ps does)")):
    """List the loaded models: slots, context, KV, GPU, expiry.

    Context is per slot; BUSY is busy/total slots; SPEC is the speculative decoding in use."""
    from .. import api
    from ..client.http import server_running

    url = config.base_url()
    if server_running(url):
        with _server_client(start=False) as client:
            response = client.ps()
    else:
        response = api.ProcessResponse(models=[])
        err_console.print(f"no localllm server answers at {url}, so no model is loaded", highlight=False)
    if as_json:
        typer.echo(response.model_dump_json(indent=2))
    elif console.is_terminal:
        console.print(ps_table(response.models, width=console.width))
    else:
        typer.echo(ps_text(response.models))


@app.command()
def stop(model: str = typer.Argument(..., help="a loaded model (see `localllm ps`)")):
    """Unload a model from the server now."""
    with _server_client(start=False) as client:
        if not any(is_model(row, model) for row in client.ps().models):
            raise ModelNotFound(f"model {model!r} is not loaded", hint="see `localllm ps`")
        client.stop(model)
    console.print(f"stopped '{model}'", highlight=False)


# ---------------------------------------------------------------------------------------------------------- tui


@app.command()
def tui(
    model: str | None = typer.Argument(None, help="model to chat with at start (F2 picks another)"),
    in_process: bool = typer.Option(False, "--in-process", help=IN_PROCESS_HELP),
    mcp_config: Path | None = typer.Option(
        None, "--mcp-config", help="the mcp.json whose servers' tools the chat offers (default: LOCALLLM_MCP_CONFIG)"
    ),
    trust_tools: bool = typer.Option(False, "--trust-tools", help="run MCP tool calls without asking"),
    tools: bool = typer.Option(True, "--tools/--no-tools", help="offer the MCP servers' tools to the model"),
):
    """Open the terminal UI: chat, models, live engine figures."""
    from ..mcp.tool_loop import open_toolbox
    from ..tui import run_tui

    notice = None
    if not in_process:
        try:
            _server_client(start=True).close()
        except ServerConflict:
            raise  # another home's server: the TUI must not open on its models
        except LocalLLMError as exc:
            notice = exc  # the TUI opens anyway and says why it cannot reach the server
    client = _local_client() if in_process else _server_client(start=False)
    try:
        with open_toolbox(mcp_config, trust_all=trust_tools, enabled=tools) as toolbox:
            log_file = config.HOME.get() / "logs" / "tui.log"
            run_tui(client, model=model, notice=notice, log_file=log_file, tools=toolbox)
    finally:
        client.close()
