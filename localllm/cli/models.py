"""Model commands: pull, list, show, rm, cp, create, verify. Each parses its arguments, calls the store / pull /
create functions and renders the result; errors are raised as errors.* and mapped to exit codes in cli/app.py."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from .. import api
from ..errors import IntegrityError, InvalidInput, ModelNotFound
from ..models.names import parse_ref
from .app import app, console
from .render import human_age, human_size, print_show, render_pull  # noqa: F401  (also imported from here)


def _store():
    from ..models.store import Store

    return Store()


# ---------------------------------------------------------------------------------------------------------- pull

@app.command()
def pull(model: str = typer.Argument(..., help="catalog name, hf.co/<org>/<repo>[:<quant>], URL or .gguf path")):
    """Download a model into the store (resumes an interrupted pull)."""
    from ..models.pull import pull_model

    render_pull(pull_model(model, _store()))


# ---------------------------------------------------------------------------------------------------------- list

@app.command("list")
def list_models(as_json: bool = typer.Option(False, "--json", help="print api.ListResponse as JSON")):
    """List the models in the store."""
    rows = _store().list()
    if as_json:
        typer.echo(api.ListResponse(models=rows).model_dump_json(indent=2))
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "ID", "SIZE", "FORMAT", "MODIFIED"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.name, row.digest[:12], human_size(row.size), row.details.format, human_age(row.modified_at))
    console.print(table)


# ---------------------------------------------------------------------------------------------------------- show

@app.command()
def show(model: str = typer.Argument(..., help="stored model name or .gguf path"),
         as_json: bool = typer.Option(False, "--json", help="print api.ShowResponse as JSON"),
         modelfile: bool = typer.Option(False, "--modelfile", help="print a Modelfile that rebuilds the model"),
         parameters: bool = typer.Option(False, "--parameters", help="print the parameters only"),
         template: bool = typer.Option(False, "--template", help="print the chat template only"),
         system: bool = typer.Option(False, "--system", help="print the system message only"),
         license: bool = typer.Option(False, "--license", help="print the license only")):
    """Describe a model: architecture, size, quantization, context, template, parameters."""
    from ..models.info import show_model

    info = show_model(_store(), model)
    if as_json:
        typer.echo(info.model_dump_json(indent=2))
        return
    single = {"modelfile": modelfile, "parameters": parameters, "template": template, "system": system,
              "license": license}
    chosen = [name for name, wanted in single.items() if wanted]
    if chosen:
        for name in chosen:
            typer.echo(getattr(info, name))
        return
    print_show(info)


# ---------------------------------------------------------------------------------------------------------- rm, cp

@app.command()
def rm(models: List[str] = typer.Argument(..., help="stored model names")):
    """Remove models (blobs no other model uses are deleted)."""
    store = _store()
    for name in models:  # every name is checked before anything is removed
        _check_stored(store, name)
    for name in models:
        store.delete(name)
        console.print(f"deleted '{parse_ref(name).display}'", highlight=False)


def _check_stored(store, name: str) -> None:
    ref = parse_ref(name)
    ref.manifest_parts  # noqa: B018  (a file path is not a stored model: InvalidName)
    if not store.exists(name):
        raise ModelNotFound(f"model {ref.display!r} not found", hint="see `localllm list`")


@app.command()
def cp(source: str = typer.Argument(..., help="stored model"),
       destination: str = typer.Argument(..., help="new name")):
    """Copy a model under a new name (no bytes are copied)."""
    _store().copy(source, destination)
    console.print(f"copied '{parse_ref(source).display}' to '{parse_ref(destination).display}'", highlight=False)


# ---------------------------------------------------------------------------------------------------------- create

@app.command()
def create(name: str = typer.Argument(..., help="name of the new model, e.g. me/assistant:v1"),
           file: Optional[Path] = typer.Option(None, "--file", "-f", help="the Modelfile (default ./Modelfile)"),
           from_: Optional[str] = typer.Option(None, "--from", help="the model to build on (FROM, without a "
                                                                   "Modelfile)"),
           fmt: Optional[str] = typer.Option(None, "--format", help="weights format: gguf, or mlx to convert"),
           quantize: Optional[str] = typer.Option(None, "--quantize", "-q", help="quantize to TYPE: q4_K_M, q5_K_M, "
                                                  "q6_K, q8_0, q4_0, iq4_xs, f16, ... (with --format mlx: f32, f16, "
                                                  "bf16, q8, q4)"),
           allow_requantize: bool = typer.Option(False, "--allow-requantize", help="quantize weights that are "
                                                 "already quantized (loses more quality than quantizing F16)"),
           imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="importance matrix (GGUF from "
                                                  "llama-imatrix) for --quantize")):
    """Create a model from a Modelfile, or from another model with --from. --quantize prints a quality report."""
    from ..models.create import create_model
    from ..models.modelfile import parse_modelfile

    if fmt not in (None, "gguf", "mlx"):
        raise InvalidInput(f"format {fmt!r} is not known", hint="use gguf or mlx")
    if from_ is not None and file is None:
        request, base = api.CreateRequest(model=name, **{"from": from_}), Path.cwd()
    else:
        file = file or Path("Modelfile")
        if not file.is_file():
            raise InvalidInput(f"no Modelfile at {file}", hint="pass one with -f PATH, or name a model with --from")
        request, base = parse_modelfile(file.read_text(encoding="utf-8")), file.resolve().parent
    update = {"model": name, "quantize": quantize, "format": fmt or request.format,
              "allow_requantize": allow_requantize, "imatrix": str(imatrix.resolve()) if imatrix else None}
    request = request.model_copy(update={**update, **({"from_": from_} if from_ else {})})
    render_pull(create_model(request, _store(), base_dir=base))


# ---------------------------------------------------------------------------------------------------------- verify

@app.command()
def verify(model: Optional[str] = typer.Argument(None, help="one stored model (default: all)")):
    """Re-hash the blobs of one model or of all models; exit 1 naming any corrupt or missing blob."""
    problems = _store().verify(model)
    for problem in problems:
        console.print(problem, highlight=False, markup=False)
    if problems:
        raise IntegrityError(f"{len(problems)} problem(s) found",
                             hint="remove the affected models with `localllm rm` and pull them again")
    console.print("all blobs intact")
