"""Model commands: pull, list, show, rm, cp, create, verify, prune. Each parses its arguments, asks the in-process
Client (as `run` and the TUI do) or, where the command needs what only the store offers, the store, and renders the
result; errors are raised as errors.* and mapped to exit codes in cli/app.py."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from .. import api
from ..errors import IntegrityError, InvalidInput, ModelNotFound
from ..models.names import parse_ref
from .app import app, console, err_console
from .render import human_age, human_size, print_show, render_pull  # noqa: F401  (also imported from here)


def _store():
    from ..models.store import Store

    return Store()


def _client():
    from .chat import open_client

    return open_client(in_process=True)


# ---------------------------------------------------------------------------------------------------------- pull


@app.command()
def pull(
    model: str = typer.Argument(
        ..., help="catalog name, hf.co/<org>/<repo>[:<quant>], URL, .gguf path, or an Ollama library name"
    ),
    insecure: bool = typer.Option(False, "--insecure", help="allow a registry over plain http (not loopback)"),
):
    """Download a model into the store (an interrupted pull resumes).

    A name is, in this order: an http(s) URL to a GGUF; a catalog name (smollm2:135m); hf.co/<org>/<repo>[:<quant>];
    a path to a .gguf file; else host/namespace/name:tag in an Ollama-style registry, as `ollama pull` resolves it
    (host, namespace and tag may be left out: a name without a host asks LOCALLLM_REGISTRY, default
    https://registry.ollama.ai; the namespace is library, the tag latest)."""
    from ..models.pull import pull_model

    # The store's own pull: the Client's pull carries no --insecure (the server would not honour it).
    render_pull(pull_model(model, _store(), insecure=insecure))


# ---------------------------------------------------------------------------------------------------------- list


@app.command("list")
def list_models(
    as_json: bool = typer.Option(False, "--json", help="print the list as JSON (as /api/tags does)"),
    others: bool = typer.Option(False, "--others", help="list the models of Ollama, LM Studio and the HF cache"),
    catalog: bool = typer.Option(False, "--catalog", help="list the catalog: what `pull` fetches by short name"),
):
    """List the models in the store (also: ls).

    --others lists the models Ollama, LM Studio and the Hugging Face cache keep, for `localllm import`; --catalog
    lists what `pull` fetches offline by short name."""
    if catalog:
        _list_catalog(as_json)
        return
    if others:
        from .others import print_others

        print_others(as_json)
        return
    with _client() as client:
        rows = client.list_models().models
    if as_json:
        typer.echo(api.ListResponse(models=rows).model_dump_json(indent=2))
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "ID", "SIZE", "FORMAT", "MODIFIED"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.name, row.digest[:12], human_size(row.size), row.details.format, human_age(row.modified_at))
    console.print(table)


app.command("ls", hidden=True)(list_models)  # Ollama's alias


def _list_catalog(as_json: bool) -> None:
    """The catalog's entries: pinned weights pulled from the package index (or Hugging Face), whether each is in
    the store already."""
    import json

    from ..models.catalog import CATALOG

    store = _store()  # whether each catalog name is in the store: a lookup by name the Client has no call for
    rows = [
        {
            "name": entry.name,
            "size": entry.size,
            "capabilities": entry.capabilities,
            "license": entry.license,
            "pulled": store.exists(entry.name),
            "description": entry.description,
        }
        for entry in CATALOG
    ]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "SIZE", "CAN", "LICENSE", "PULLED", "DESCRIPTION"):
        table.add_column(column, no_wrap=column in ("NAME", "SIZE", "PULLED"))
    for row in rows:
        pulled = "yes" if row["pulled"] else "-"
        table.add_row(
            row["name"], human_size(row["size"]), row["capabilities"], row["license"], pulled, row["description"]
        )
    console.print(table)


# ---------------------------------------------------------------------------------------------------------- show


@app.command()
def show(
    model: str = typer.Argument(..., help="stored model name or .gguf path"),
    as_json: bool = typer.Option(False, "--json", help="print the description as JSON (as /api/show does)"),
    modelfile: bool = typer.Option(False, "--modelfile", help="print a Modelfile that rebuilds the model"),
    parameters: bool = typer.Option(False, "--parameters", help="print the parameters only"),
    template: bool = typer.Option(False, "--template", help="print the chat template only"),
    system: bool = typer.Option(False, "--system", help="print the system message only"),
    license: bool = typer.Option(False, "--license", help="print the license only"),
):
    """Describe a model: facts, template, system, parameters.

    Architecture, size, quantization, context and format; --modelfile prints a Modelfile that `create -f` accepts."""
    with _client() as client:
        info = client.show(model)
    if as_json:
        typer.echo(info.model_dump_json(indent=2))
        return
    single = {
        "modelfile": modelfile,
        "parameters": parameters,
        "template": template,
        "system": system,
        "license": license,
    }
    chosen = [name for name, wanted in single.items() if wanted]
    if chosen:
        for name in chosen:
            typer.echo(getattr(info, name))
        return
    print_show(info)


# ---------------------------------------------------------------------------------------------------------- rm, cp


@app.command()
def rm(models: list[str] = typer.Argument(..., help="stored model names")):
    """Remove models (blobs no other model uses are deleted)."""
    store = _store()  # the store's delete removes even a broken manifest, which the Client's (resolving first) refuses
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
def cp(source: str = typer.Argument(..., help="stored model"), destination: str = typer.Argument(..., help="new name")):
    """Copy a model under a new name; no bytes are copied.

    A model already under that name is replaced, and what it held is freed when nothing else uses it."""
    replaced = _store().copy(source, destination)  # the store says what the copy replaced; the Client's copy does not
    line = f"copied '{parse_ref(source).display}' to '{parse_ref(destination).display}'"
    if replaced is not None:
        line += f" (replaced the previous '{replaced.name}' {replaced.digest.removeprefix('sha256-')[:12]}"
        line += f", freed {human_size(replaced.freed)})" if replaced.freed else ")"
    console.print(line, highlight=False)


# ---------------------------------------------------------------------------------------------------------- create


@app.command()
def create(
    name: str = typer.Argument(..., help="name of the new model, e.g. me/assistant:v1"),
    file: Path | None = typer.Option(None, "--file", "-f", help="the Modelfile (default ./Modelfile)"),
    from_: str | None = typer.Option(None, "--from", help="the model to build on (FROM, without a Modelfile)"),
    fmt: str | None = typer.Option(None, "--format", help="weights format: gguf, or mlx to convert"),
    quantize: str | None = typer.Option(
        None,
        "--quantize",
        "-q",
        help="quantize to TYPE: q4_K_M, q5_K_M, "
        "q6_K, q8_0, q4_0, iq4_xs, f16, ... (with --format mlx: f32, f16, "
        "bf16, q8, q4)",
    ),
    allow_requantize: bool = typer.Option(
        False,
        "--allow-requantize",
        help="quantize weights that are already quantized (loses more quality than quantizing F16)",
    ),
    imatrix: Path | None = typer.Option(
        None, "--imatrix", help="importance matrix (GGUF from llama-imatrix) for --quantize"
    ),
):
    """Create a model from a Modelfile (or --from another model).

    --quantize quantizes GGUF weights and prints a quality report."""
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
    update = {
        "model": name,
        "quantize": quantize,
        "format": fmt or request.format,
        "allow_requantize": allow_requantize,
        "imatrix": str(imatrix.resolve()) if imatrix else None,
    }
    request = request.model_copy(update={**update, **({"from_": from_} if from_ else {})})
    # The store's own create: the Modelfile's relative paths resolve against its folder, which the Client cannot pass.
    render_pull(create_model(request, _store(), base_dir=base))


# ---------------------------------------------------------------------------------------------------------- verify


@app.command()
def verify(
    model: str | None = typer.Argument(None, help="one stored model (default: all)"),
    repair: bool = typer.Option(
        False, "--repair", help="download corrupt or missing catalog and Hugging Face blobs again in place, then prune"
    ),
):
    """Re-hash the blobs of one model or all; exit 1 if any is bad.

    Each corrupt or missing blob is named; --repair downloads corrupt catalog and Hugging Face blobs again."""
    from ..models.repair import repair_blobs

    store = _store()  # verify, repair and prune work on this store's blobs, not through a Client
    problems = store.verify(model)
    _print_lines(problems)
    if repair:
        if problems:
            render_pull(repair_blobs(store, model))
            problems = store.verify(model)
            _print_lines(f"still: {problem}" for problem in problems)
        _print_prune(store.prune(on_wait=_say_waiting))
    if problems:
        hint = (
            "pull or create the affected models again"
            if repair
            else "run `localllm verify --repair` to download them again, or `localllm rm` the affected models"
        )
        raise IntegrityError(f"{len(problems)} problem(s) found", hint=hint)
    console.print("all blobs intact")


@app.command()
def prune(dry_run: bool = typer.Option(False, "--dry-run", help="list what would be removed, remove nothing")):
    """Remove unused blobs and partial downloads; say how much that freed.

    Leftovers of interrupted writes go too. Waits for pulls and creates in progress to finish first."""
    _print_prune(_store().prune(dry_run=dry_run, on_wait=_say_waiting))


def _say_waiting() -> None:
    err_console.print("waiting for the pulls and creates in progress to finish…", highlight=False)


def _print_lines(lines) -> None:
    for line in lines:
        console.print(line, highlight=False, markup=False)


def _print_prune(report: api.PruneReport) -> None:
    verb = "would remove" if report.dry_run else "removed"
    _print_lines(f"{verb} {path}" for path in report.removed)
    console.print(f"{'would free' if report.dry_run else 'freed'} {human_size(report.freed)}", highlight=False)
