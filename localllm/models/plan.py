"""The memory plan: what loading a model with given options will take, read from GGUF metadata before anything loads.

Weights are the file's tensor bytes. The KV cache is per token: K and V for every layer, each n_head_kv x head_dim
elements of the cache type (llama.cpp keeps sliding-window layers at full size too), for the cells of the pool the
slots share (kv_cells: LOCALLLM_KV_POOL, by default one slot's num_ctx, as llama-server's unified cache). The compute
buffer is dominated by the logits of a full micro-batch (n_batch x n_vocab floats), which is what llama.cpp reserves
on CPU; it is an estimate and labelled so.

A split GGUF's weights are all its parts (gguf.inspect_gguf reads them as one model); LoRA adapters add their own
tensors. Several models planned together count weights they share (the same files, the same weight options) once:
the backend loads them once and gives each model its own context.

An MLX folder (plan_mlx_memory) is planned from its config.json and safetensors headers instead: no layer placement
(MLX runs the model on its one device) and a KV cache per sequence, as the MLX backend keeps them."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from .. import config
from ..api import LoadOptions
from ..errors import ModelFormatError
from ..quant.gguf import GGUFInfo

# Bytes per cached element: f16 is 2; q8_0 and q4_0 store 32 values in 34 and 18 bytes.
KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    adapters: int  # LoRA adapter tensors, per load
    kv_per_token: int  # one slot, one token
    kv_per_slot: int  # the most one slot can hold: num_ctx tokens
    kv_total: int  # the pool the slots share: kv_cells tokens
    compute: int
    num_ctx: int
    num_parallel: int
    kv_type: str
    available: int | None  # memory the OS reports as available now, when it can tell
    # By layer, for placement: weights of each repeating block, KV of each block over all slots; the input
    # embedding (always on the CPU) and the output head (placed like one more layer, after the blocks).
    layer_weights: tuple[int, ...] = ()
    layer_kv: tuple[int, ...] = ()
    input_weights: int = 0
    output_weights: int = 0
    output_tied: bool = False  # the head is token_embd: a copy only where it leaves the CPU
    kv_cells: int = 0  # tokens of KV the slots share (num_ctx x num_parallel where each has its own)
    projector: int = 0  # the vision projector's tensors (loaded beside the model, on the host)
    kv_pooled: bool = True  # the slots share one KV pool (llama.cpp); False: each slot has a cache of its own (MLX)

    @property
    def total(self) -> int:
        return self.weights + self.adapters + self.projector + self.kv_total + self.compute

    @property
    def fits(self) -> bool | None:
        return None if self.available is None else self.total <= self.available


def plan_memory(info: GGUFInfo, load: LoadOptions, *, adapters: int = 0, projector: int = 0) -> MemoryPlan:
    """`load` must carry effective values (models/options.effective_load fills them from the environment); `adapters`
    is the bytes of the LoRA adapters' tensors (gguf.inspect_lora), `projector` of the vision projector's."""
    n_ctx, slots, kv_type = load.num_ctx or 0, load.num_parallel or 1, load.kv_type or "f16"
    per_layer = kv_elements_by_layer(info)
    per_token = int(sum(per_layer) * KV_BYTES[kv_type])
    per_slot = per_token * n_ctx
    cells = kv_cells(n_ctx, slots)
    n_vocab = info.vocab_size or 0
    compute = load.num_batch * n_vocab * 4 + load.num_batch * (info.embedding_length or 0) * 4 * 4
    blocks, input_weights, output_weights = _weights_by_layer(info)
    tied = "output.weight" not in info.tensor_sizes
    return MemoryPlan(
        weights=info.tensor_bytes,
        adapters=adapters,
        kv_per_token=per_token,
        kv_per_slot=per_slot,
        kv_total=per_token * cells,
        compute=compute,
        num_ctx=n_ctx,
        num_parallel=slots,
        kv_type=kv_type,
        available=available_memory(),
        layer_weights=blocks,
        layer_kv=tuple(int(n * KV_BYTES[kv_type]) * cells for n in per_layer),
        input_weights=input_weights,
        output_weights=output_weights,
        output_tied=tied,
        kv_cells=cells,
        projector=projector,
    )


def kv_cells(n_ctx: int, n_seq: int) -> int:
    """The KV cells `n_seq` slots of `n_ctx` tokens share: LOCALLLM_KV_POOL, by default one slot's context (what
    llama-server's unified cache holds for the same context), never less than that nor more than all of theirs."""
    pool = config.KV_POOL.get() or n_ctx
    return max(n_ctx, min(pool, n_ctx * max(1, n_seq)))


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _weights_by_layer(info: GGUFInfo) -> tuple[tuple[int, ...], int, int]:
    """(bytes of each repeating block, input bytes, output-head bytes). Tied embeddings: llama.cpp gives the output
    layer its own copy of token_embd, so the head costs that much wherever it goes."""
    layers = info.block_count or 0
    blocks = [0] * layers
    other = 0
    for name, size in info.tensor_sizes.items():
        match = _BLOCK.match(name)
        if match and int(match.group(1)) < layers:
            blocks[int(match.group(1))] += size
        else:
            other += size
    sizes = info.tensor_sizes
    output = sum(size for name, size in sizes.items() if name.startswith("output"))
    if "output.weight" not in sizes:
        output += sizes.get("token_embd.weight", 0)
    return tuple(blocks), other - sum(size for name, size in sizes.items() if name.startswith("output")), output


def weights_identity(path: Path, load: LoadOptions) -> tuple:
    """Loads with equal identities share one copy of the weights (as backends/llama_cpp.weights_key decides)."""
    return str(Path(path).absolute()), load.num_gpu, load.use_mmap


def total_with_shared_weights(plans: list[tuple[Any, MemoryPlan]]) -> int:
    """The memory of several loads at once: (weights identity, plan) pairs, each identity's weights counted once."""
    seen: set[Any] = set()
    total = 0
    for identity, plan in plans:
        total += plan.total - (plan.weights if identity in seen else 0)
        seen.add(identity)
    return total


def kv_elements_per_token(info: GGUFInfo) -> int:
    """K and V elements one token adds to one slot's cache, summed over layers."""
    return sum(kv_elements_by_layer(info))


def kv_elements_by_layer(info: GGUFInfo) -> list[int]:
    """K and V elements one token adds to one slot's cache, layer by layer."""
    arch, meta = info.architecture, info.metadata
    layers = info.block_count
    heads = _per_layer(meta.get(f"{arch}.attention.head_count"), layers)
    kv_heads = _per_layer(meta.get(f"{arch}.attention.head_count_kv", meta.get(f"{arch}.attention.head_count")), layers)
    if not layers or not heads or not kv_heads or not info.embedding_length:
        raise ModelFormatError(
            f"{info.path} lacks the attention metadata a memory plan needs ({arch}.block_count / attention.head_count)"
        )
    if max(heads) <= 0 or min(kv_heads) < 0:  # hybrid models may have layers without attention, not all of them
        raise ModelFormatError(
            f"{info.path.name} has {arch}.attention.head_count {max(heads)} (head_count_kv {min(kv_heads)}): "
            "a model needs attention heads",
            hint="the file is damaged or was written wrong; convert the model again",
        )
    key_len = meta.get(f"{arch}.attention.key_length") or info.embedding_length // max(heads)
    value_len = meta.get(f"{arch}.attention.value_length") or key_len
    return [kv * (key_len + value_len) for kv in kv_heads]


def _per_layer(value: Any, layers: int | None) -> list[int]:
    if value is None or not layers:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


# ---------------------------------------------------------------------------------------------------------- placement

DeviceKind = Literal["cpu", "gpu", "igpu", "rpc", "accel", "meta"]
MARGIN_MIN = 256 * 2**20  # kept free on every device: drivers, fragmentation, the estimate's error
MARGIN_SHARE = 0.05


@dataclass(frozen=True)
class DeviceReport:
    """What a device says of itself: ggml's name (CPU, CUDA0, RPC0), description, and memory in bytes."""

    name: str
    description: str
    kind: DeviceKind
    free: int
    total: int

    @property
    def margin(self) -> int:
        return max(MARGIN_MIN, int(self.total * MARGIN_SHARE))

    @property
    def usable(self) -> int:
        return max(0, self.free - self.margin)


@dataclass(frozen=True)
class DeviceShare:
    """The part of a model one device holds: `layers` counts repeating layers, plus one for the output head."""

    device: DeviceReport
    layers: int
    weights: int
    kv: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    @property
    def fits(self) -> bool:
        return self.total <= self.device.usable


@dataclass(frozen=True)
class Placement:
    """Where a model's layers go. shares[0] is the host (the CPU, which always holds the input embedding); the
    rest are the offload devices in the order llama.cpp is given them, each holding a contiguous run of layers."""

    n_gpu_layers: int  # llama_model_params.n_gpu_layers: the last n of the n_layer + 1 units (blocks, output)
    shares: tuple[DeviceShare, ...]
    tensor_split: tuple[float, ...]  # one per offload device: llama.cpp's split points fall between our counts
    # RPC workers the load asked for that could not be reached: the model was placed without them, since it fits.
    missing_workers: tuple[str, ...] = ()

    @property
    def host(self) -> DeviceShare:
        return self.shares[0]

    @property
    def offload(self) -> tuple[DeviceShare, ...]:
        return self.shares[1:]

    @property
    def fits(self) -> bool:
        return all(share.fits for share in self.shares)


def place_layers(
    plan: MemoryPlan, host: DeviceReport, devices: Sequence[DeviceReport], num_gpu: int | None = None
) -> Placement:
    """Place a model's layers on `devices` (offload devices, in llama.cpp's order) and the host.

    num_gpu None or -1: as many layers as fit, leaving each device its margin, and the rest on the host; llama.cpp
    offloads the last layers, the first device taking the lowest of them, so the devices are filled from the last
    one down. num_gpu n >= 0: exactly n units, shared by the devices in proportion to their usable memory."""
    costs = list(_unit_costs(plan))
    if not devices:
        counts: list[int] = []
    elif num_gpu is None or num_gpu < 0:
        counts = _fill_from_the_top(costs, [d.usable - plan.compute for d in devices])
    else:
        counts = _proportional(min(num_gpu, len(costs)), [max(0, d.usable) for d in devices])
    offloaded = sum(counts)
    start = len(costs) - offloaded
    shares = [_share(host, plan, costs, 0, start, host_part=True)]
    split: list[float] = []
    position = start
    for device, count in zip(devices, counts):
        if count == 0:
            continue
        shares.append(_share(device, plan, costs, position, position + count, host_part=False))
        position += count
        split.append(float(count))
    return Placement(n_gpu_layers=offloaded, shares=tuple(shares), tensor_split=_split_points(split))


def unplanned_placement(host: DeviceReport, devices: Sequence[DeviceReport], num_gpu: int | None = None) -> Placement:
    """For weights without the metadata a plan needs: llama.cpp splits by free memory itself (a zero tensor_split),
    and how many layers each device got is not known here."""
    n_gpu = 0 if not devices else 999 if num_gpu is None or num_gpu < 0 else num_gpu
    shares = tuple(DeviceShare(device=d, layers=0, weights=0, kv=0, compute=0) for d in [host, *devices])
    return Placement(n_gpu_layers=n_gpu, shares=shares, tensor_split=())


def _unit_costs(plan: MemoryPlan):
    """Weights + KV of each unit llama.cpp places: the repeating blocks, then the output head."""
    kv = plan.layer_kv or (0,) * len(plan.layer_weights)
    for weights, cache in zip(plan.layer_weights, kv):
        yield weights + cache
    yield plan.output_weights


def _fill_from_the_top(costs: list[int], budgets: list[int]) -> list[int]:
    counts = [0] * len(budgets)
    top = len(costs)  # units [top, len) are placed
    for i in reversed(range(len(budgets))):
        room = budgets[i]
        while top > 0 and costs[top - 1] <= room:
            room -= costs[top - 1]
            top -= 1
            counts[i] += 1
    return counts  # a device that takes nothing is left out, so the runs stay contiguous


def _proportional(n: int, weights: list[int]) -> list[int]:
    total = sum(weights)
    if total <= 0:
        weights, total = [1] * len(weights), len(weights)
    exact = [n * w / total for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _split_points(counts: list[float]) -> tuple[float, ...]:
    """tensor_split for llama.cpp from whole counts: it gives unit j (of the offloaded ones) to the first device
    whose cumulative share exceeds j/n, so each boundary is put half a unit early, away from float rounding."""
    if len(counts) < 2:
        return tuple(counts)
    n = sum(counts)
    cumulative, running = [], 0.0
    for count in counts[:-1]:
        running += count
        cumulative.append(running - 0.5)
    cumulative.append(n)
    return tuple(b - a for a, b in zip([0.0] + cumulative[:-1], cumulative))


def layer_devices(n_units: int, n_gpu_layers: int, tensor_split: Sequence[float]) -> list[int]:
    """llama.cpp's own assignment (llama_model::load_tensors): the device index of each unit, -1 for the host."""
    start = max(n_units - n_gpu_layers, 0)
    active = min(n_gpu_layers, n_units) if tensor_split else 0
    total = sum(tensor_split)
    points, running = [], 0.0
    for value in tensor_split:
        running += value
        points.append(running / total)
    out = []
    for unit in range(n_units):
        if unit < start or unit - start >= active:
            out.append(-1)
            continue
        x = (unit - start) / active
        out.append(next((i for i, p in enumerate(points) if p > x), len(points) - 1))
    return out


def _share(
    device: DeviceReport, plan: MemoryPlan, costs: list[int], first: int, end: int, *, host_part: bool
) -> DeviceShare:
    n_blocks = len(plan.layer_weights)
    blocks = range(first, min(end, n_blocks))
    holds_output = end > n_blocks and not (host_part and plan.output_tied)
    weights = sum(plan.layer_weights[i] for i in blocks) + (plan.output_weights if holds_output else 0)
    kv = sum(plan.layer_kv[i] for i in blocks) if plan.layer_kv else 0
    if host_part:
        weights += plan.input_weights
    if not plan.layer_weights:  # a plan without per-layer figures: everything on the host
        weights, kv = (plan.weights, plan.kv_total) if host_part else (0, 0)
    return DeviceShare(device=device, layers=end - first, weights=weights, kv=kv, compute=plan.compute)


def host_report(plan: MemoryPlan, total: int | None = None) -> DeviceReport:
    """The host as placement sees it: the memory the OS calls available now."""
    free = plan.available if plan.available is not None else 0
    return DeviceReport(name="CPU", description="", kind="cpu", free=free, total=total or _total_memory() or free)


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


# ---------------------------------------------------------------------------------------------------------- MLX


class KvQuantization(Protocol):
    """mlx-lm's KV quantization as the MLX backend chose it (backends/mlx/kv.KvQuant)."""

    @property
    def bits(self) -> int: ...

    @property
    def group_size(self) -> int: ...


def plan_mlx_memory(
    folder: Path, config: dict, load: LoadOptions, *, float_bytes: int | None, kv_quant: KvQuantization | None
) -> MemoryPlan:
    """The plan of an MLX folder: its safetensors' tensors with float ones at `float_bytes` each (the type the backend
    casts them to at load; None: as stored), and a KV cache per sequence (the MLX backend's slots share no pool),
    each layer's keys and values in the model's float type or, with `kv_quant`, packed with a scale and a bias per
    group. `config` is mlx_config's; `load` carries effective values, as for plan_memory."""
    tensors = _safetensors_tensors(folder)
    weights = sum(n * float_bytes if float_bytes and d in _FLOAT_BYTES else size for d, n, size in tensors)
    n_ctx, slots, kv_type = load.num_ctx or 0, load.num_parallel or 1, load.kv_type or "f16"
    kv_float = float_bytes or _stored_float_bytes(tensors)
    per_token = int(mlx_kv_elements_per_token(config, folder) * _mlx_kv_bytes(kv_float, kv_quant))
    cells = n_ctx * slots
    n_vocab, n_embd = int(config.get("vocab_size") or 0), int(config.get("hidden_size") or 0)
    return MemoryPlan(
        weights=weights,
        adapters=0,
        kv_per_token=per_token,
        kv_per_slot=per_token * n_ctx,
        kv_total=per_token * cells,
        compute=load.num_batch * n_vocab * 4 + load.num_batch * n_embd * 4 * 4,
        num_ctx=n_ctx,
        num_parallel=slots,
        kv_type=_mlx_kv_label(kv_type, kv_quant, "f32" if float_bytes == 4 else _stored_float_type(tensors)),
        available=available_memory(),
        kv_cells=cells,
        kv_pooled=False,
    )


def _mlx_kv_label(kv_type: str, quant: KvQuantization | None, held: str) -> str:
    """The KV type an MLX load keeps: the asked quantization, else `held`, the activations' float type (f32 where
    the backend casts the weights to it, as on MLX's CPU build)."""
    if quant is not None:
        return kv_type
    return held if kv_type == "f16" else f"{held} ({kv_type} kept unquantized)"


def _stored_float_type(tensors: list[tuple[str, int, int]]) -> str:
    """The float type most of the weights' float elements are stored in, as llama.cpp names types (bf16, f16)."""
    elements: dict[str, int] = {}
    for dtype, n, _ in tensors:
        if dtype in _FLOAT_BYTES:
            elements[dtype] = elements.get(dtype, 0) + n
    return max(elements, key=elements.__getitem__, default="F16").lower()


# safetensors' float dtypes and their bytes; the rest (packed quantized weights, integer buffers) load as stored.
_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def mlx_kv_elements_per_token(config: dict, folder: Path) -> int:
    """K and V elements one token adds to one sequence's cache: layers x kv heads x head dim, twice. Sliding-window
    layers count in full: the MLX backend gives them full caches."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ModelFormatError(
            f"{folder / 'config.json'} lacks the attention shape a memory plan needs ({exc})",
            hint="num_hidden_layers, num_attention_heads and hidden_size (or head_dim) are read from it",
        ) from None
    return layers * kv_heads * head_dim * 2


def _stored_float_bytes(tensors: list[tuple[str, int, int]]) -> int:
    """The size of the float type most of the weights' float elements are stored in: what activations, and so an
    unquantized cache, take where the backend keeps the weights as stored."""
    elements: dict[int, int] = {}
    for dtype, n, _ in tensors:
        if dtype in _FLOAT_BYTES:
            elements[_FLOAT_BYTES[dtype]] = elements.get(_FLOAT_BYTES[dtype], 0) + n
    return max(elements, key=elements.__getitem__, default=2)


def _mlx_kv_bytes(float_bytes: int, quant: KvQuantization | None) -> float:
    """Bytes per cached element: the float type, or mx.quantize's packed bits plus a scale and a bias (in the float
    type) per group."""
    if quant is None:
        return float(float_bytes)
    return quant.bits / 8 + 2 * float_bytes / quant.group_size


def mlx_config(folder: Path) -> dict:
    """config.json, with its text_config where a multimodal folder keeps the language model's shape there; checked
    to carry the attention shape the plan reads."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"cannot read {path}: {exc}", hint="an MLX model is a folder with config.json") from None
    text = config.get("text_config")
    config = {**config, **text} if isinstance(text, dict) else config
    mlx_kv_elements_per_token(config, folder)
    return config


def _safetensors_tensors(folder: Path) -> list[tuple[str, int, int]]:
    """(dtype, elements, bytes) of every tensor in the folder's safetensors files, read from their headers."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"MLX model folder {folder} has no *.safetensors")
    tensors = []
    for path in files:
        for name, entry in _safetensors_header(path).items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            tensors.append((str(entry["dtype"]), math.prod(entry["shape"]), end - start))
    return tensors


def _safetensors_header(path: Path) -> dict:
    """A safetensors file's JSON header: 8 bytes of its length (little-endian), then the JSON."""
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= min(path.stat().st_size - 8, 100 * 2**20):
                raise ValueError(f"a header of {length} bytes")
            return json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(
            f"{path} is not a readable safetensors file ({exc})", hint="download or convert the model again"
        ) from None
