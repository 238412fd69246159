"""The typer app and the one place where errors become exit codes: 0 ok, 1 user error (one line, no traceback),
2 usage (typer's own), 130 Ctrl-C. Also Ollama's habits at the top level: a bare `localllm` prints the help and
exits 0, `-h` is `--help`, `-v` is `--version`, and `localllm help [COMMAND]`."""

from __future__ import annotations

import typer
import typer.core
from rich.console import Console

from .. import __version__
from ..errors import InvalidInput, LocalLLMError
from .interrupts import interrupt_handled

console = Console()
err_console = Console(stderr=True)


def print_error(exc: LocalLLMError) -> None:
    err_console.print(f"[bold red]Error:[/] {exc}", highlight=False, soft_wrap=True)


class _Group(typer.core.TyperGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LocalLLMError as exc:
            print_error(exc)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            interrupt_handled()
            # The shell's prompt must start on a line of its own, whatever was being written when Ctrl-C came.
            err_console.print()
            raise typer.Exit(130) from None


app = typer.Typer(
    cls=_Group,
    name="localllm",
    help="Run quantized language models locally.",
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"localllm version {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", "-v", is_eager=True, callback=_print_version, help="print the version and exit"
    ),
) -> None:
    if ctx.invoked_subcommand is None:  # a bare `localllm`: the help, and success (Ollama does the same)
        typer.echo(ctx.get_help())
        raise typer.Exit()


@app.command("help")
def help_command(
    ctx: typer.Context, command: list[str] | None = typer.Argument(None, help="a command, e.g. run")
) -> None:
    """Show the help of localllm or of one command."""
    group = ctx.parent.command if ctx.parent is not None else ctx.command
    parent = ctx.parent or ctx
    if not command:
        typer.echo(group.get_help(parent))
        return
    name = command[0]
    target = group.get_command(parent, name) if isinstance(group, _Group) else None
    if target is None:
        raise InvalidInput(f"unknown command {name!r}", hint="see `localllm help` for the list")
    with type(ctx)(target, info_name=name, parent=parent) as sub:
        typer.echo(target.get_help(sub))
