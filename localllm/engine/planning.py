"""The memory plan of a load before it happens (`localllm plan`, POST /api/plan): what the weights, adapters, KV
pool and compute buffer take for the resolved options, and where the backend would put the layers now. The same
functions the loader uses, so the plan and the load agree; the engine reaches the backend through its registry."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from .. import api
from ..backends import choose_backend, get_backend, mlx_load_facts
from ..errors import InvalidInput
from ..models.options import effective_load, model_facts, resolve_options, with_context
from ..models.plan import (
    MemoryPlan,
    Placement,
    mlx_config,
    plan_memory,
    plan_mlx_memory,
    total_with_shared_weights,
    weights_identity,
)
from ..models.store import ResolvedModel, Store
from ..quant.gguf import inspect_gguf, inspect_lora
from .prefix_cache import disk_limit, ram_limit


class ModelPlan(NamedTuple):
    """One model's plan: its name, the weights it shares with others, its memory and placement."""

    name: str
    identity: tuple  # models with equal weights_identity share one copy of the weights
    memory: MemoryPlan
    placement: Placement | None


def plan_with_draft(store: Store, model: str, options: dict[str, Any] | None) -> list[ModelPlan]:
    """The model's plan, and its draft model's where it speculates with one: loaded beside it with a KV cache for
    each of its slots, at the same context and threads."""
    resolved = store.resolve(model)
    load, _ = resolve_options(resolved, options)
    plans = [plan_one(model, resolved, load)]
    if load.draft:
        shape = {"num_ctx": plans[0].memory.num_ctx, "num_parallel": plans[0].memory.num_parallel}
        draft = store.resolve(load.draft)
        drafted = plan_one(load.draft, draft, resolve_options(draft, {**(options or {}), **shape})[0])
        plans.append(drafted._replace(name=f"{drafted.name} (draft model of {plans[0].name})", placement=None))
    return plans


def plan_one(model: str, resolved: ResolvedModel, load: api.LoadOptions) -> ModelPlan:
    """The plan of `model` (as the user named it), resolved to `resolved` with the load options `load`."""
    if resolved.format == "mlx":
        return _plan_mlx(resolved, load)
    if resolved.format != "gguf":
        raise InvalidInput(f"{model} is an {resolved.format} model; the memory plan reads GGUF or MLX weights")
    adapters: int = sum([inspect_lora(Path(adapter.path)).tensor_bytes for adapter in resolved.adapters], 0)
    projector = inspect_gguf(resolved.projector).tensor_bytes if resolved.projector is not None else 0
    effective = with_context(effective_load(load), model_facts(resolved.weights, resolved.format))
    mem = plan_memory(inspect_gguf(resolved.weights), effective, adapters=adapters, projector=projector)
    placement = get_backend(choose_backend(effective.backend, resolved.weights)).placement(resolved.weights, effective)
    return ModelPlan(resolved.name, weights_identity(resolved.weights, effective), mem, placement)


def _plan_mlx(resolved: ResolvedModel, load: api.LoadOptions) -> ModelPlan:
    """An MLX folder's plan, with the float type and KV quantization the MLX backend's load picks."""
    folder = Path(resolved.weights)
    config = mlx_config(folder)
    effective = with_context(effective_load(load), model_facts(folder, resolved.format))
    float_bytes, quant = mlx_load_facts(effective.kv_type, config)
    mem = plan_mlx_memory(folder, config, effective, float_bytes=float_bytes, kv_quant=quant)
    # Every MLX load holds its own copy of the weights (MlxModel.weights): an identity no other plan shares.
    return ModelPlan(resolved.name, ("mlx", str(folder.absolute()), object()), mem, None)


def plan_response(plans: list[ModelPlan]) -> api.PlanResponse:
    """The plans as the API answers them: a row per model, and the total with shared weights counted once."""
    total = total_with_shared_weights([(p.identity, p.memory) for p in plans])
    available = plans[0].memory.available if plans else None
    cache_ram, cache_disk = ram_limit(), disk_limit()
    seen: set[tuple] = set()
    rows = []
    for p in plans:
        rows.append(_plan_row(p, shared=p.identity in seen, cache_ram=cache_ram, cache_disk=cache_disk))
        seen.add(p.identity)
    fits = None if available is None else total <= available
    return api.PlanResponse(models=rows, total=total, available=available, fits=fits)


def _plan_row(p: ModelPlan, *, shared: bool, cache_ram: int, cache_disk: int) -> api.PlanModel:
    memory = {k: v for k, v in p.memory.__dict__.items() if not isinstance(v, tuple)}
    return api.PlanModel(
        model=p.name,
        **memory,
        total=p.memory.total,
        fits=p.memory.fits,
        shares_weights=shared,
        cache_ram_limit=cache_ram,
        cache_disk_limit=cache_disk,
        placement=_placement_row(p.placement),
    )


def _placement_row(placement: Placement | None) -> api.PlanPlacement | None:
    if placement is None:
        return None
    return api.PlanPlacement(
        n_gpu_layers=placement.n_gpu_layers,
        fits=placement.fits,
        devices=[
            api.PlanDevice(
                device=s.device.name,
                description=s.device.description,
                kind=s.device.kind,
                layers=s.layers,
                weights=s.weights,
                kv=s.kv,
                compute=s.compute,
                total=s.total,
                free=s.device.free,
                usable=s.device.usable,
                fits=s.fits,
            )
            for s in placement.shares
        ],
    )
