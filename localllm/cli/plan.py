"""`localllm plan MODEL [MODEL...]`: the memory loads will take, and where their layers go, read before anything
loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import typer
from rich.table import Table

from ..errors import LocalLLMError
from ..models.plan import Placement
from .app import app, console

if TYPE_CHECKING:
    from ..api import LoadOptions
    from ..models.plan import MemoryPlan
    from ..models.store import ResolvedModel


class ModelPlan(NamedTuple):
    """One model's row of `localllm plan`: its name, the weights it shares with others, its memory and placement."""

    name: str
    identity: tuple  # models with equal weights_identity share one copy of the weights
    memory: MemoryPlan
    placement: Placement | None


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
    from ..engine.prefix_cache import disk_limit, ram_limit
    from ..models.plan import total_with_shared_weights

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
    plans = [plan for model in models for plan in _plan_with_draft(model, overrides)]
    total = total_with_shared_weights([(p.identity, p.memory) for p in plans])
    available = plans[0].memory.available
    cache_ram, cache_disk = ram_limit(), disk_limit()
    if as_json:
        rows = [
            {
                "model": p.name,
                **{k: v for k, v in p.memory.__dict__.items() if not isinstance(v, tuple)},
                "total": p.memory.total,
                "fits": p.memory.fits,
                "cache_ram_limit": cache_ram,
                "cache_disk_limit": cache_disk,
                "placement": _placement_json(p.placement),
            }
            for p in plans
        ]
        console.print_json(json.dumps(rows[0] if len(rows) == 1 else {"models": rows, "total": total}))
    else:
        seen: set = set()
        for p in plans:
            console.print(
                _table(p.name, p.memory, shared=p.identity in seen, cache_ram=cache_ram, cache_disk=cache_disk)
            )
            if p.placement is not None:
                console.print(_placement_table(p.placement))
            seen.add(p.identity)
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


def _plan_with_draft(model: str, overrides: dict) -> list[ModelPlan]:
    """The model's plan, and its draft model's where it speculates with one: loaded beside it with a KV cache for
    each of its slots, at the same context and threads."""
    from ..models.options import resolve_options
    from ..models.store import Store

    store = Store()  # the plan reads the weights' metadata and the resolved options before anything loads
    resolved = store.resolve(model)
    load, _ = resolve_options(resolved, overrides)
    plans = [_plan_one(model, resolved, load)]
    if load.draft:
        shape = {"num_ctx": plans[0].memory.num_ctx, "num_parallel": plans[0].memory.num_parallel}
        draft = store.resolve(load.draft)
        drafted = _plan_one(load.draft, draft, resolve_options(draft, {**overrides, **shape})[0])
        plans.append(drafted._replace(name=f"{drafted.name} (draft model of {plans[0].name})", placement=None))
    return plans


def _plan_one(model: str, resolved: ResolvedModel, load: LoadOptions) -> ModelPlan:
    """The plan of `model` (as the user named it), resolved to `resolved` with the load options `load`."""
    from ..errors import InvalidInput
    from ..models.options import effective_load
    from ..models.plan import plan_memory, weights_identity
    from ..quant.gguf import inspect_gguf, inspect_lora

    if resolved.format != "gguf":
        raise InvalidInput(f"{model} is an {resolved.format} model; the memory plan reads GGUF metadata")
    adapters: int = sum([inspect_lora(Path(adapter.path)).tensor_bytes for adapter in resolved.adapters], 0)
    projector = inspect_gguf(resolved.projector).tensor_bytes if resolved.projector is not None else 0
    mem = plan_memory(inspect_gguf(resolved.weights), effective_load(load), adapters=adapters, projector=projector)
    identity = weights_identity(resolved.weights, effective_load(load))
    return ModelPlan(resolved.name, identity, mem, _placement(resolved, load))


def _placement(model: ResolvedModel, load: LoadOptions) -> Placement | None:
    """What the loader would do now with these options: the backend's own function, the devices' free memory now."""
    from ..backends import choose_backend, get_backend
    from ..models.options import effective_load

    load = effective_load(load)
    return get_backend(choose_backend(load.backend, model.weights)).placement(model.weights, load)


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
    table.add_row(
        f"KV pool the {mem.num_parallel} slots share ({mem.kv_cells:,} tokens, LOCALLLM_KV_POOL)", _mib(mem.kv_total)
    )
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


def _placement_json(placement: Placement | None) -> dict | None:
    if placement is None:
        return None
    return {
        "n_gpu_layers": placement.n_gpu_layers,
        "fits": placement.fits,
        "devices": [
            {
                "device": s.device.name,
                "description": s.device.description,
                "kind": s.device.kind,
                "layers": s.layers,
                "weights": s.weights,
                "kv": s.kv,
                "compute": s.compute,
                "total": s.total,
                "free": s.device.free,
                "usable": s.device.usable,
                "fits": s.fits,
            }
            for s in placement.shares
        ],
    }


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
