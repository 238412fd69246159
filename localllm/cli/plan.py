"""`localllm plan MODEL`: the memory a load will take, read before anything loads."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from ..models.plan import Placement
from .app import app, console


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@app.command()
def plan(
    model: str = typer.Argument(..., help="a pulled model name or a .gguf path"),
    num_ctx: Optional[int] = typer.Option(None, "--num-ctx", min=16, help="context per slot"),
    num_parallel: Optional[int] = typer.Option(None, "--num-parallel", min=1, help="slots"),
    kv_type: Optional[str] = typer.Option(None, "--kv-type", help="f16, q8_0 or q4_0"),
    num_gpu: Optional[int] = typer.Option(None, "--num-gpu", min=-1, max=100_000,
                                          help="layers to offload (default: all that fit)"),
    rpc: Optional[str] = typer.Option(None, "--rpc", help="RPC workers host:port,... (default LOCALLLM_RPC)"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
) -> None:
    """Show the memory a model will take with these options (weights, KV cache per slot, compute), before loading."""
    from ..engine.pool import effective_load, resolve_options
    from ..engine.scaleout import placement as place
    from ..errors import InvalidInput
    from ..models.plan import plan_memory
    from ..formats.gguf import inspect_gguf
    from ..models.store import Store

    resolved = Store().resolve(model)
    if resolved.format != "gguf":
        raise InvalidInput(f"{model} is an {resolved.format} model; the memory plan reads GGUF metadata")
    overrides = {k: v for k, v in {"num_ctx": num_ctx, "num_parallel": num_parallel, "kv_type": kv_type,
                                    "num_gpu": num_gpu, "rpc": rpc}.items() if v is not None}
    load, _ = resolve_options(resolved, overrides)
    mem = plan_memory(inspect_gguf(resolved.weights), effective_load(load))
    placement = place(resolved, load)
    if as_json:
        summary = {k: v for k, v in mem.__dict__.items() if not isinstance(v, tuple)}
        console.print_json(json.dumps({**summary, "total": mem.total, "fits": mem.fits,
                                       "placement": _placement_json(placement)}))
        return
    table = Table(title=f"{resolved.name}: {mem.num_parallel} slots x {mem.num_ctx} tokens, KV {mem.kv_type}")
    table.add_column("part")
    table.add_column("memory", justify="right")
    table.add_row("weights", _mib(mem.weights))
    table.add_row(f"KV cache per slot ({mem.kv_per_token:,} bytes/token)", _mib(mem.kv_per_slot))
    table.add_row(f"KV cache, {mem.num_parallel} slots", _mib(mem.kv_total))
    table.add_row("compute buffer (estimate)", _mib(mem.compute))
    table.add_row("[bold]total[/]", f"[bold]{_mib(mem.total)}[/]")
    if mem.available is not None:
        verdict = "fits" if mem.fits else "[red]does not fit[/]"
        table.add_row("available now", f"{_mib(mem.available)} ({verdict})")
    console.print(table)
    if placement is not None:
        console.print(_placement_table(placement))


def _placement_json(placement: Optional[Placement]) -> Optional[dict]:
    if placement is None:
        return None
    return {"n_gpu_layers": placement.n_gpu_layers, "fits": placement.fits, "devices": [
        {"device": s.device.name, "description": s.device.description, "kind": s.device.kind, "layers": s.layers,
         "weights": s.weights, "kv": s.kv, "compute": s.compute, "total": s.total, "free": s.device.free,
         "usable": s.device.usable, "fits": s.fits} for s in placement.shares]}


def _placement_table(placement: Placement) -> Table:
    """Per device, the numbers the loader uses: what it holds, against its free memory less the margin."""
    units = sum(s.layers for s in placement.shares)
    verdict = "fits" if placement.fits else "[red]does not fit: lower num_ctx or num_parallel, or add a device[/]"
    table = Table(title=f"placement: {placement.n_gpu_layers} of {units} layers offloaded ({verdict})",
                  caption="usable: free memory less a margin (5%, at least 256 MiB)")
    for column in ("device", "layers", "weights", "KV cache", "compute", "total", "usable"):
        table.add_column(column, justify="left" if column == "device" else "right")
    for s in placement.shares:
        name = f"{s.device.name} ({s.device.description})" if s.device.description else s.device.name
        usable = _mib(s.device.usable) + ("" if s.fits else " [red]too small[/]")
        table.add_row(name, str(s.layers), _mib(s.weights), _mib(s.kv), _mib(s.compute), _mib(s.total), usable)
    return table
