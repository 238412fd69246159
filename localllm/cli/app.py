"""The typer app and the one place where errors become exit codes: 0 ok, 1 user error (one line, no traceback),
2 usage (typer's own)."""

from __future__ import annotations

import typer
import typer.core
from rich.console import Console

from ..errors import LocalLLMError

console = Console()
err_console = Console(stderr=True)


def print_error(exc: LocalLLMError) -> None:
    err_console.print(f"[bold red]Error:[/] {exc}", highlight=False, soft_wrap=True)


class _Group(typer.core.TyperGroup):
    def invoke(self, ctx):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except LocalLLMError as exc:
            print_error(exc)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None


app = typer.Typer(
    cls=_Group,
    name="localllm",
    help="Run quantized language models locally.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
