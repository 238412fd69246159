"""`localllm plan MODEL`: the memory a load will take, read before anything loads."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional

import typer
from rich.table import Table

from ..errors import LocalLLMError
from .app import app, console

if TYPE_CHECKING:
    from ..models.plan import MemoryPlan


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@app.command()
def plan(
    model: str = typer.Argument(..., help="a pulled model name or a .gguf path"),
    num_ctx: Optional[int] = typer.Option(None, "--num-ctx", min=16, help="context per slot"),
    num_parallel: Optional[int] = typer.Option(None, "--num-parallel", min=1, help="slots"),
    kv_type: Optional[str] = typer.Option(None, "--kv-type", help="f16, q8_0 or q4_0"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
) -> None:
    """Show the memory a load will take, before loading.

    Weights, KV cache per slot and compute buffer for these options; exit 1 when it does not fit."""
    from .. import config
    from ..engine.pool import effective_load, resolve_options
    from ..engine.prefix_cache import ram_limit
    from ..errors import InvalidInput
    from ..models.plan import plan_memory
    from ..formats.gguf import inspect_gguf
    from ..models.store import Store

    resolved = Store().resolve(model)
    if resolved.format != "gguf":
        raise InvalidInput(f"{model} is an {resolved.format} model; the memory plan reads GGUF metadata")
    overrides = {k: v for k, v in {"num_ctx": num_ctx, "num_parallel": num_parallel, "kv_type": kv_type}.items()
                 if v is not None}
    load, _ = resolve_options(resolved, overrides)
    mem = plan_memory(inspect_gguf(resolved.weights), effective_load(load))
    cache_ram, cache_disk = ram_limit(), config.CACHE_DISK.get()
    if as_json:
        console.print_json(json.dumps({**mem.__dict__, "total": mem.total, "fits": mem.fits,
                                       "cache_ram_limit": cache_ram, "cache_disk_limit": cache_disk}))
    else:
        console.print(_table(resolved.name, mem, cache_ram=cache_ram, cache_disk=cache_disk))
    if mem.fits is False:  # a script can test the exit code; None (memory unknown) is not a failure
        raise LocalLLMError(f"{resolved.name} does not fit: it needs {_mib(mem.total)} and "
                            f"{_mib(mem.available or 0)} is available",
                            hint="lower --num-ctx or --num-parallel, or use --kv-type q8_0")


def _table(name: str, mem: MemoryPlan, *, cache_ram: int, cache_disk: int) -> Table:
    table = Table(title=f"{name}: {mem.num_parallel} slots x {mem.num_ctx} tokens, KV {mem.kv_type}")
    table.add_column("part")
    table.add_column("memory", justify="right")
    table.add_row("weights", _mib(mem.weights))
    table.add_row(f"KV cache per slot ({mem.kv_per_token:,} bytes/token)", _mib(mem.kv_per_slot))
    table.add_row(f"KV cache, {mem.num_parallel} slots", _mib(mem.kv_total))
    table.add_row("compute buffer (estimate)", _mib(mem.compute))
    table.add_row("[bold]total[/]", f"[bold]{_mib(mem.total)}[/]")
    # The prefix cache grows into its limit only as conversations outnumber the slots, so it is not in the total.
    table.add_row("prefix cache in RAM, at most (LOCALLLM_CACHE_RAM)", _mib(cache_ram) if cache_ram else "off")
    if cache_disk:
        table.add_row("prefix cache on disk, at most (LOCALLLM_CACHE_DISK)", _mib(cache_disk))
    if mem.available is not None:
        verdict = "fits" if mem.fits else "[red]does not fit[/]"
        table.add_row("available now", f"{_mib(mem.available)} ({verdict})")
    return table
