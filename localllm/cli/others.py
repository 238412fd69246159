"""`localllm import` and `localllm ls --others`: models that Ollama, LM Studio and the Hugging Face cache already
keep, used in place (models/others.py finds them and makes references; nothing of theirs is written or removed)."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from ..errors import InvalidInput, LocalLLMError, ModelNotFound
from ..models.others import TOOL_NAMES, TOOLS, Tool, find_other, find_others, import_model, imported_from, searched
from .app import app, console, print_error
from .render import human_size, render_pull


def _store():
    """The store itself: importing writes references to other tools' files, which no Client call can carry."""
    from ..models.store import Store

    return Store()


def _tools(chosen: str | None) -> tuple[Tool, ...]:
    if chosen is None:
        return TOOLS
    for tool in TOOLS:
        if chosen.lower() == tool:
            return (tool,)
    raise InvalidInput(f"--from {chosen!r} is not known", hint="use ollama, lmstudio or hf")


@app.command("import")
def import_models(
    name: str | None = typer.Argument(None, help="one model, by its name here or in the other tool (default: all)"),
    from_: str | None = typer.Option(None, "--from", help="ollama, lmstudio or hf (default: all three)"),
    no_link: bool = typer.Option(
        False, "--no-link", help="record the file's path even on the same file system, instead of a hard link"
    ),
):
    """Use the models of Ollama, LM Studio or the HF cache in place.

    Their files are only read: on the same file system a hard link names the same bytes (nothing is copied), else
    the file's path is recorded and re-checked whenever its size or mtime changes. `rm` and `prune` remove only
    localllm's names. An Ollama model keeps its name, template, system prompt and parameters. See `ls --others`."""
    tools = _tools(from_)
    store = _store()
    models = [find_other(name, tools)] if name else find_others(tools)
    if not models:
        raise ModelNotFound(f"no models found in {searched(tools)}")
    failed = 0
    for model in models:
        if name is None and imported_from(store, model):
            console.print(f"{model.name}: already imported from {model.origin}", highlight=False)
            continue
        try:
            render_pull(import_model(model, store, link=not no_link))
        except LocalLLMError as exc:
            if name is not None:
                raise
            print_error(exc)
            failed += 1
    if failed:
        raise InvalidInput(f"{failed} of {len(models)} models could not be imported (see above)")


def print_others(as_json: bool) -> None:
    """The table (or JSON) of `ls --others`: what other tools keep, and whether it is imported here."""
    store = _store()
    models = find_others()
    if as_json:
        rows = [
            {
                "name": m.name,
                "from": m.tool,
                "origin": m.origin,
                "size": m.size,
                "imported": imported_from(store, m),
            }
            for m in models
        ]
        typer.echo(json.dumps({"models": rows}, indent=2))
        return
    if not models:
        console.print(f"no models found in {searched()}", highlight=False)
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "FROM", "SIZE", "IMPORTED", "WHERE"):
        table.add_column(column)
    for m in models:
        imported = "yes" if imported_from(store, m) else "-"
        table.add_row(m.name, TOOL_NAMES[m.tool], human_size(m.size), imported, m.origin)
    console.print(table)
