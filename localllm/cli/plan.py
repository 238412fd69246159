"""`localllm plan MODEL [MODEL...]`: the memory loads will take, and where their layers go, read before anything
loads."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from ..errors import LocalLLMError
from .app import app, console

if TYPE_CHECKING:
    from ..models.plan import MemoryPlan, Placement


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@app.command()
def plan(
    models: list[str] = typer.Argument(..., help="pulled model names or .gguf paths (several: loaded together)"),
    num_ctx: int | None = typer.Option(None, "--num-ctx", min=16, help="context per slot"),
    num_parallel: int | None = typer.Option(None, "--num-parallel", min=1, help="slots"),
    kv_type: str | None = typer.Option(None, "--kv-type", help="f16, q8_0 or q4_0"),
    num_gpu: int | None = typer.Option(
        None, "--num-gpu", min=-1, max=100_000, help="layers to offload (default: all that fit)"
    ),
    rpc: str | None = typer.Option(None, "--rpc", help="RPC workers host:port,... (default LOCALLLM_RPC)"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
) -> None:
    """Show the memory a load will take, before loading.

    Weights, adapters, KV cache per slot and compute buffer for these options, and the layers each device takes;
    models over the same weights count them once. Exits 1 when it does not fit."""
    from ..engine.planning import plan_response, plan_with_draft
    from ..models.store import Store

    overrides = {
        k: v
        for k, v in {
            "num_ctx": num_ctx,
            "num_parallel": num_parallel,
            "kv_type": kv_type,
            "num_gpu": num_gpu,
            "rpc": rpc,
        }.items()
        if v is not None
    }
    store = Store()  # the plan reads the weights' metadata and the resolved options before anything loads
    plans = [plan for model in models for plan in plan_with_draft(store, model, overrides)]
    response = plan_response(plans)
    total, available = response.total, response.available
    if as_json:
        rows = [row.model_dump() for row in response.models]
        console.print_json(json.dumps(rows[0] if len(rows) == 1 else {"models": rows, "total": total}))
    else:
        for p, row in zip(plans, response.models, strict=True):
            cache_ram, cache_disk = row.cache_ram_limit, row.cache_disk_limit
            console.print(
                _table(p.name, p.memory, shared=row.shares_weights, cache_ram=cache_ram, cache_disk=cache_disk)
            )
            if p.placement is not None:
                console.print(_placement_table(p.placement))
        if len(plans) > 1:
            verdict = (
                ""
                if available is None
                else f" ({'fits' if total <= available else 'does not fit'} in {_mib(available)} available)"
            )
            console.print(f"[bold]all {len(plans)} models: {_mib(total)}[/] (shared weights counted once){verdict}")
    if available is not None and total > available:  # a script can test the exit code; unknown memory is no failure
        names = ", ".join(p.name for p in plans)
        raise LocalLLMError(
            f"{names} does not fit: it needs {_mib(total)} and {_mib(available)} is available",
            hint="lower --num-ctx or --num-parallel, or use --kv-type q8_0",
        )


def _table(name: str, mem: MemoryPlan, *, shared: bool, cache_ram: int, cache_disk: int) -> Table:
    table = Table(title=f"{name}: {mem.num_parallel} slots x {mem.num_ctx} tokens, KV {mem.kv_type}")
    table.add_column("part")
    table.add_column("memory", justify="right")
    table.add_row("weights" + (" (shared with a model above: counted once)" if shared else ""), _mib(mem.weights))
    if mem.adapters:
        table.add_row("LoRA adapters", _mib(mem.adapters))
    if mem.projector:
        table.add_row("vision projector", _mib(mem.projector))
    table.add_row(f"KV cache per token ({mem.kv_per_token:,} bytes), one slot's {mem.num_ctx:,}", _mib(mem.kv_per_slot))
    table.add_row(_kv_total_label(mem), _mib(mem.kv_total))
    table.add_row("compute buffer (estimate)", _mib(mem.compute))
    table.add_row("[bold]total[/]", f"[bold]{_mib(mem.total - (mem.weights if shared else 0))}[/]")
    # The prefix cache grows into its limit only as conversations outnumber the slots, so it is not in the total.
    table.add_row("prefix cache in RAM, at most (LOCALLLM_CACHE_RAM)", _mib(cache_ram) if cache_ram else "off")
    if cache_disk:
        table.add_row("prefix cache on disk, at most (LOCALLLM_CACHE_DISK)", _mib(cache_disk))
    if mem.available is not None:
        verdict = "fits" if mem.fits else "[red]does not fit[/]"
        table.add_row("available now", f"{_mib(mem.available)} ({verdict})")
    return table


def _kv_total_label(mem: MemoryPlan) -> str:
    if mem.kv_pooled:
        return f"KV pool the {mem.num_parallel} slots share ({mem.kv_cells:,} tokens, LOCALLLM_KV_POOL)"
    return f"KV caches, one per slot ({mem.num_parallel} x {mem.num_ctx:,} tokens)"


def _placement_table(placement: Placement) -> Table:
    """Per device, the numbers the loader uses: what it holds, against its free memory less the margin."""
    units = sum(s.layers for s in placement.shares)
    verdict = "fits" if placement.fits else "[red]does not fit: lower num_ctx or num_parallel, or add a device[/]"
    table = Table(
        title=f"placement: {placement.n_gpu_layers} of {units} layers offloaded ({verdict})",
        caption="usable: free memory less a margin (5%, at least 256 MiB)",
    )
    for column in ("device", "layers", "weights", "KV cache", "compute", "total", "usable"):
        table.add_column(column, justify="left" if column == "device" else "right")
    for s in placement.shares:
        name = f"{s.device.name} ({s.device.description})" if s.device.description else s.device.name
        usable = _mib(s.device.usable) + ("" if s.fits else " [red]too small[/]")
        table.add_row(name, str(s.layers), _mib(s.weights), _mib(s.kv), _mib(s.compute), _mib(s.total), usable)
    return table
