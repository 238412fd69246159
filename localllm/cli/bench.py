"""`localllm bench MODEL`: the engine benchmark (scripts/bench.py's figures) for any pulled GGUF model."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from .app import app, console, err_console


@app.command()
def bench(
    model: str = typer.Argument(..., help="a pulled model name or a .gguf path"),
    tokens: int = typer.Option(128, "--tokens", "-n", min=8, help="tokens generated per stream"),
    threads: int | None = typer.Option(None, "--threads", min=1, help="our engine's threads (default: ours)"),
    rest: bool = typer.Option(False, "--rest", help="also measure through `localllm serve`"),
    as_json: bool = typer.Option(False, "--json", help="print the figures as JSON"),
) -> None:
    """Measure the engine against raw llama.cpp in one run.

    Same model, threads and tokens for both."""
    from ..bench.engine import run_benchmarks
    from ..bench.rest import run_rest_benchmarks
    from ..errors import InvalidInput
    from ..models.store import Store

    resolved = Store().resolve(model)  # the weights file itself: the raw llama.cpp loop maps it too
    if resolved.format != "gguf":
        raise InvalidInput(f"{model} is an {resolved.format} model; the benchmark compares against llama.cpp (GGUF)")

    def log(msg: str) -> None:
        err_console.print(f"[dim]{msg}[/]")

    figures = run_benchmarks(resolved.weights, n=tokens, threads=threads, log=log)
    if rest:
        figures += run_rest_benchmarks(resolved.weights, n=tokens, threads=threads, log=log)
    if as_json:
        console.print_json(json.dumps([{**f.__dict__, "ratio": f.ratio, "met": f.met} for f in figures]))
        return
    console.print(figure_table(f"{resolved.name}", figures))


def figure_table(title: str, figures) -> Table:
    table = Table(title=title)
    for column in ("figure", "ours", "reference", "ratio", "target", "met", "note"):
        table.add_column(column, justify="right" if column in ("ours", "reference", "ratio") else "left")
    for f in figures:
        met = "[red]no[/]" if f.met is False else f.met_text
        table.add_row(
            f.name,
            f"{f.ours:.1f} {f.unit}",
            f"{f.reference:.1f} {f.unit}",
            f"{f.ratio:.2f}",
            f.target_text,
            met,
            f.note,
        )
    return table
