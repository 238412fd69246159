"""The rows of `ps` (/api/ps): one per loaded model, from the engine's snapshot and the model's placement."""

from __future__ import annotations

from .. import api
from ..engine.pool import Loaded
from ..models.plan import Placement


def process_row(entry: Loaded, sharing: list[str]) -> api.ProcessModel:
    stats = entry.engine.snapshot()
    placement = entry.engine.placement
    model = entry.model
    return api.ProcessModel(
        name=model.name,
        model=model.name,
        size=model.size,
        digest=model.digest.removeprefix("sha256-"),
        details=model.details,
        expires_at=entry.expires_at,
        context_length=entry.engine.n_ctx,
        backend=entry.backend,
        slots_busy=stats.slots_busy,
        slots_total=stats.slots_total,
        queue_depth=stats.queue_depth,
        kv_type=entry.options.kv_type or "f16",
        gpu_layers=_gpu_layers(entry),
        size_vram=sum(s.total for s in placement.offload) if placement is not None else 0,
        speculation=entry.speculation.kind if entry.speculation is not None else "none",
        threads=stats.threads,
        threads_auto=entry.engine.threads is not None,
        flash_attn=entry.options.flash_attn if entry.measured_flash_attn is None else entry.measured_flash_attn,
        flash_attn_measured=entry.measured_flash_attn is not None,
        draft_count=stats.draft_tokens,
        draft_accepted=stats.accepted_tokens,
        draft=entry.speculation.draft_row() if entry.speculation is not None else None,
        status="removed" if entry.removed else "draining" if entry.draining else None,
        load_waiting=entry.waiting,
        kv_cells=stats.kv_cells,
        kv_used=stats.kv_used,
        cache_ram_bytes=stats.cache_ram_bytes,
        cache_ram_limit=stats.cache_ram_limit,
        cache_disk_bytes=stats.cache_disk_bytes,
        cache_disk_limit=stats.cache_disk_limit,
        prefix_cache_hits=dict(stats.prefix_hits),
        prefix_cache_tokens=dict(stats.prefix_tokens),
        shares_weights_with=sharing,
        placement=_placement_rows(placement),
        missing_workers=list(placement.missing_workers) if placement else [],
    )


def _gpu_layers(entry: Loaded) -> int:
    """Layers off the CPU as placed; else the num_gpu asked for (-1: the backend's "all that fit")."""
    placement = entry.engine.placement
    if placement is None or any(s.layers == 0 for s in placement.offload):  # llama.cpp split them itself
        return entry.options.num_gpu if entry.options.num_gpu is not None else -1
    return placement.n_gpu_layers


def _placement_rows(placement: Placement | None) -> list[api.DeviceLayers]:
    if placement is None:
        return []
    return [
        api.DeviceLayers(device=s.device.name, description=s.device.description, layers=s.layers, memory=s.total)
        for s in placement.shares
        if s.layers or s.device.kind == "cpu"
    ]
