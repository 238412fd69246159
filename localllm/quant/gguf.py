"""Read what a GGUF file says about itself (architecture, quantization, context, template) without loading weights.

The header is walked once with bounds checks against the file size, so a truncated or hostile file is a
`ModelFormatError` naming the file and the problem, never a crash, a hang or a huge allocation. The walk reads only
the header (metadata and tensor infos) through a memory map; the weights are never touched. Format constants (value
types, tensor types and their block sizes, llama.cpp's file types) come from the `gguf` package.

We do not hand the file to `gguf.GGUFReader`: it builds two numpy arrays per vocabulary string (seconds for a
262k-token vocabulary) and trusts the counts it reads. tests/test_gguf.py checks that this walk and GGUFReader agree
on files written by `gguf.GGUFWriter`.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import gguf

from .. import api
from ..errors import ModelFormatError

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# Arrays longer than this (token tables, merges, scores) are summarised by type and length, never decoded.
MAX_ARRAY_ITEMS = 64
# Every item of a string array, key and tensor info costs a Python step, so counts are bounded far above any real
# model (vocabularies reach 262,144 tokens, headers a few hundred keys and some thousands of tensors): a crafted
# header cannot make inspection run for minutes or fill memory.
MAX_STRING_ITEMS = 1 << 22
# An array decoded whole (`show --verbose`) becomes Python objects of 30 to 60 bytes per item: a count the file's
# bytes allow (a flipped bit in a 100 MB file allows 25 million) would build gigabytes. Four times the largest
# vocabulary or merge table.
MAX_WHOLE_ITEMS = 1 << 20
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 18
# The smallest encodings: a tensor info is name length (8) + n_dims (4) + type (4) + offset (8); a key/value pair is
# key length (8) + value type (4) + a one-byte value. Counts are checked against them before anything is read.
MIN_TENSOR_INFO_BYTES = 24
MIN_KV_BYTES = 13
HEADER_BYTES = 24  # magic, version, tensor count, kv count
# llama.cpp's own limits (src/llama-hparams.h): a file beyond them trips a GGML_ASSERT, which aborts the process.
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
LLAMA_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
NORM_EPSILONS = ("attention.layer_norm_epsilon", "attention.layer_norm_rms_epsilon", "attention.group_norm_epsilon")

_V = gguf.GGUFValueType
_U64 = struct.Struct("<Q")
_SCALAR_FORMATS = {
    _V.UINT8: "<B",
    _V.INT8: "<b",
    _V.UINT16: "<H",
    _V.INT16: "<h",
    _V.UINT32: "<I",
    _V.INT32: "<i",
    _V.FLOAT32: "<f",
    _V.BOOL: "<?",
    _V.UINT64: "<Q",
    _V.INT64: "<q",
    _V.FLOAT64: "<d",
}


# ---------------------------------------------------------------------------------------------------------- result


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file's header says. Sizes are in bytes; counts are of elements (weights)."""

    path: Path
    architecture: str
    name: str
    parameter_count: int
    parameter_size: str  # Ollama style: "135M", "1.2B"
    file_type: str  # llama.cpp's LLAMA_FTYPE name, e.g. "Q4_K_M"
    tensor_types: dict[str, int]  # tensor type name -> number of tensors
    bits_per_weight: float
    tensor_bytes: int
    file_size: int
    context_length: int | None
    embedding_length: int | None
    block_count: int | None
    chat_template: str | None
    tokenizer_model: str | None
    vocab_size: int | None  # length of tokenizer.ggml.tokens
    has_mtp: bool  # multi-token-prediction (NextN) layers that can draft for speculative decoding
    license: str | None
    metadata: dict[str, Any] = field(repr=False)  # scalars and short arrays; long arrays are in `arrays`
    arrays: dict[str, tuple[str, int]] = field(repr=False)  # every array key -> (item type, length)
    tensor_sizes: dict[str, int] = field(default_factory=dict, repr=False)  # tensor name -> bytes (layer placement)
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)  # ggml order: ne[0] first

    @property
    def quantization_level(self) -> str:
        return self.file_type

    def details(self) -> api.ModelDetails:
        return api.ModelDetails(
            format="gguf",
            family=self.architecture,
            families=[self.architecture],
            parameter_size=self.parameter_size,
            quantization_level=self.quantization_level,
        )

    def model_info(self) -> dict[str, Any]:
        """Ollama's /api/show `model_info`: every key, long arrays as null, plus general.parameter_count."""
        info: dict[str, Any] = {key: None for key in self.arrays}
        info.update(self.metadata)
        info["general.parameter_count"] = self.parameter_count
        return dict(sorted(info.items()))


# ---------------------------------------------------------------------------------------------------------- reading


class _Cursor:
    """Reads little-endian GGUF values from a buffer, refusing to read past its end."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.offset = 0

    def fail(self, problem: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path} is not a usable GGUF file: {problem}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.offset:
            raise self.fail(
                f"{what} at byte {self.offset} needs {n} bytes but only {self.size - self.offset} "
                "remain (truncated or corrupt)"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        width = struct.calcsize(fmt)
        self.need(width, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += width
        return value

    def string_length(self, what: str) -> int:
        length = self.scalar("<Q", f"length of {what}")
        self.need(length, f"{what} ({length} bytes)")
        return length

    def string(self, what: str) -> str:
        length = self.string_length(what)
        raw = self.buf[self.offset : self.offset + length]
        self.offset += length
        return raw.decode("utf-8", errors="replace")

    def skip_string(self, what: str) -> None:
        length = self.string_length(what)  # moves past the length field first
        self.offset += length


def _value_type(raw: int, cursor: _Cursor, key: str) -> gguf.GGUFValueType:
    try:
        return _V(raw)
    except ValueError:
        raise cursor.fail(f"key {key!r} has unknown value type {raw}") from None


def _read_scalar(cursor: _Cursor, vtype: gguf.GGUFValueType, key: str) -> Any:
    if vtype == _V.STRING:
        return cursor.string(f"value of {key!r}")
    return cursor.scalar(_SCALAR_FORMATS[vtype], f"value of {key!r}")


def _skip_strings(cursor: _Cursor, count: int, key: str) -> None:
    """Step over `count` strings: one length read per item in a tight loop, nothing built per string."""
    cursor.need(count * 8, f"{count} string lengths of {key!r}")
    if count > MAX_STRING_ITEMS:
        raise cursor.fail(f"{key!r} holds {count} strings; localllm reads at most {MAX_STRING_ITEMS}")
    buf, offset, length_at = cursor.buf, cursor.offset, _U64.unpack_from
    last = cursor.size - 8  # where the last length field can start
    for _ in range(count):
        if offset > last:
            cursor.offset = offset
            cursor.need(8, f"length of an item of {key!r}")
        length = length_at(buf, offset)[0]
        offset += 8 + length
        if offset > cursor.size:
            raise cursor.fail(
                f"item of {key!r} ({length} bytes) at byte {offset - length} needs more than the "
                f"{cursor.size - offset + length} bytes that remain (truncated or corrupt)"
            )
    cursor.offset = offset


def _skip_array(cursor: _Cursor, item_type: gguf.GGUFValueType, count: int, key: str) -> None:
    if item_type == _V.STRING:
        _skip_strings(cursor, count, key)
        return
    width = struct.calcsize(_SCALAR_FORMATS[item_type])
    cursor.need(count * width, f"{count} items of {key!r}")
    cursor.offset += count * width


def _read_numbers(cursor: _Cursor, item_type: gguf.GGUFValueType, count: int, key: str) -> list[Any]:
    """A numeric array in one unpack (per-layer hyperparameters: up to LLAMA_MAX_LAYERS items)."""
    fmt = "<" + _SCALAR_FORMATS[item_type][1] * count
    cursor.need(struct.calcsize(fmt), f"{count} items of {key!r}")
    values = list(struct.unpack_from(fmt, cursor.buf, cursor.offset))
    cursor.offset += struct.calcsize(fmt)
    return values


def _read_array(cursor: _Cursor, key: str, *, whole: bool = False) -> tuple[list[Any] | None, tuple[str, int]]:
    """Read an array value: (its items, or None when too long to decode, (item type name, length)). Numeric arrays
    of up to LLAMA_MAX_LAYERS items are decoded: per-layer hyperparameters are checked against llama.cpp's limits.
    `whole` decodes it whatever its length (its length was checked against the file's bytes first)."""
    item_type = _value_type(cursor.scalar("<I", f"array type of {key!r}"), cursor, key)
    if item_type == _V.ARRAY:
        raise cursor.fail(f"key {key!r} is an array of arrays, which GGUF readers do not support")
    count = cursor.scalar("<Q", f"array length of {key!r}")
    summary = (item_type.name.lower(), count)
    if whole:
        cursor.need(
            count * (8 if item_type == _V.STRING else struct.calcsize(_SCALAR_FORMATS[item_type])),
            f"{count} items of {key!r}",
        )
        if count > MAX_WHOLE_ITEMS:
            raise cursor.fail(f"{key!r} holds {count} items; localllm decodes at most {MAX_WHOLE_ITEMS}")
    if item_type != _V.STRING and count <= LLAMA_MAX_LAYERS:
        return _read_numbers(cursor, item_type, count, key), summary
    if count > MAX_ARRAY_ITEMS and not whole:
        _skip_array(cursor, item_type, count, key)
        return None, summary
    return [_read_scalar(cursor, item_type, key) for _ in range(count)], summary


class _Tensor(NamedTuple):
    name: str
    type: gguf.GGMLQuantizationType
    elements: int
    nbytes: int
    offset: int  # from the start of the data section
    shape: tuple[int, ...] = ()  # ggml order: ne[0] (the row length) first


@dataclass
class _Header:
    metadata: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, tuple[str, int]] = field(default_factory=dict)
    tensors: list[_Tensor] = field(default_factory=list)
    layer_arrays: dict[str, list[Any]] = field(default_factory=dict)  # numeric arrays too long for `metadata`


def _read_preamble(cursor: _Cursor) -> tuple[int, int]:
    """Check magic and version, and that the counts could fit in the file; return (tensor count, kv count)."""
    magic = bytes(cursor.buf[0:4])
    if magic != struct.pack("<I", gguf.GGUF_MAGIC):
        raise cursor.fail(f"wrong magic {magic!r} (a GGUF file starts with b'GGUF')")
    cursor.need(HEADER_BYTES, "the header")
    cursor.offset = 4
    version = cursor.scalar("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise cursor.fail(
            f"unsupported GGUF version {version}{endian}; localllm reads versions "
            f"{' and '.join(map(str, SUPPORTED_VERSIONS))}"
        )
    n_tensors = cursor.scalar("<Q", "tensor count")
    n_kv = cursor.scalar("<Q", "metadata count")
    if n_tensors * MIN_TENSOR_INFO_BYTES + n_kv * MIN_KV_BYTES > cursor.size - HEADER_BYTES:
        raise cursor.fail(
            f"header claims {n_tensors} tensors and {n_kv} metadata keys, impossible in a file of {cursor.size} bytes"
        )
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise cursor.fail(
            f"header claims {n_tensors} tensors and {n_kv} metadata keys; localllm reads at most "
            f"{MAX_TENSORS} tensors and {MAX_KV} keys"
        )
    return n_tensors, n_kv


def _read_metadata(cursor: _Cursor, count: int, header: _Header, whole: frozenset[str] = frozenset()) -> None:
    for index in range(count):
        key = cursor.string(f"key #{index}")
        if key in header.metadata or key in header.arrays:
            raise cursor.fail(f"metadata key {key!r} appears twice")
        vtype = _value_type(cursor.scalar("<I", f"value type of {key!r}"), cursor, key)
        if vtype != _V.ARRAY:
            header.metadata[key] = _read_scalar(cursor, vtype, key)
            continue
        items, header.arrays[key] = _read_array(cursor, key, whole=key in whole)
        if items is not None and len(items) > MAX_ARRAY_ITEMS and key not in whole:
            header.layer_arrays[key] = items
        elif items is not None:
            header.metadata[key] = items


def _tensor_type(raw: int, cursor: _Cursor, name: str) -> gguf.GGMLQuantizationType:
    try:
        ttype = gguf.GGMLQuantizationType(raw)
    except ValueError:
        raise cursor.fail(f"tensor {name!r} has unknown type {raw}") from None
    if ttype not in gguf.GGML_QUANT_SIZES:
        raise cursor.fail(f"tensor {name!r} has type {ttype.name}, which has no known size")
    return ttype


def _read_tensor_info(cursor: _Cursor, index: int) -> _Tensor:
    name = cursor.string(f"name of tensor #{index}")
    n_dims = cursor.scalar("<I", f"dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cursor.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    dims = [cursor.scalar("<Q", f"shape of tensor {name!r}") for _ in range(n_dims)]
    ttype = _tensor_type(cursor.scalar("<I", f"type of tensor {name!r}"), cursor, name)
    offset = cursor.scalar("<Q", f"data offset of tensor {name!r}")
    elements = 1
    for dim in dims:
        elements *= dim
    block, type_size = gguf.GGML_QUANT_SIZES[ttype]
    if elements >= 2**63 or dims[0] % block:
        raise cursor.fail(f"tensor {name!r} has impossible shape {dims} for type {ttype.name}")
    return _Tensor(name, ttype, elements, elements // block * type_size, offset, tuple(dims))


def _alignment(cursor: _Cursor, metadata: dict[str, Any]) -> int:
    alignment = metadata.get(gguf.Keys.General.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment {alignment!r} is not a power of two")
    return alignment


def _read_tensors(cursor: _Cursor, count: int, header: _Header) -> None:
    infos = [_read_tensor_info(cursor, index) for index in range(count)]
    alignment = _alignment(cursor, header.metadata)
    data_start = -(-cursor.offset // alignment) * alignment
    seen: set[str] = set()
    for tensor in infos:
        if tensor.name in seen:
            raise cursor.fail(f"tensor {tensor.name!r} appears twice")
        seen.add(tensor.name)
        if tensor.offset % alignment:
            raise cursor.fail(
                f"tensor {tensor.name!r} starts at offset {tensor.offset}, not a multiple of the alignment {alignment}"
            )
        end = data_start + tensor.offset + tensor.nbytes
        if end > cursor.size:
            raise cursor.fail(
                f"tensor {tensor.name!r} ends at byte {end} but the file has only {cursor.size} bytes (truncated)"
            )
        header.tensors.append(tensor)


def _open_map(path: Path) -> mmap.mmap:
    if not path.exists():
        raise ModelFormatError(f"{path} does not exist")
    if not path.is_file():
        raise ModelFormatError(f"{path} is not a file")
    if path.stat().st_size == 0:
        raise ModelFormatError(f"{path} is not a usable GGUF file: it is empty")
    try:
        with path.open("rb") as handle:
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ModelFormatError(f"{path} cannot be read: {exc.strerror or exc}") from None


def _read_header(path: Path) -> _Header:
    """Walk the header of `path` with every count and length checked against the file size."""
    buf = _open_map(path)
    try:
        cursor = _Cursor(buf, path)
        header = _Header()
        n_tensors, n_kv = _read_preamble(cursor)
        _read_metadata(cursor, n_kv, header)
        _read_tensors(cursor, n_tensors, header)
        _check_hparams(cursor, header)
        return header
    finally:
        buf.close()


def read_arrays(path: Path, keys: frozenset[str]) -> dict[str, list[Any]]:
    """The whole of the array values named by `keys` (for `show --verbose`: tokenizer.ggml.tokens, merges, ...);
    keys the file does not have are left out."""
    buf = _open_map(Path(path))
    try:
        cursor = _Cursor(buf, Path(path))
        header = _Header()
        _, n_kv = _read_preamble(cursor)
        _read_metadata(cursor, n_kv, header, whole=keys)
        return {key: header.metadata[key] for key in keys if key in header.metadata}
    finally:
        buf.close()


# ---------------------------------------------------------------------------------------------------------- limits
#
# llama.cpp checks some hyperparameters with GGML_ASSERT while it loads a model (llama-model.cpp, load_hparams) or
# runs it (ggml's norms assert eps >= 0): a file that breaks one aborts the whole process, the server included. These
# are refused here, at inspection (pull, create, show), with the value and the rule. Anything else llama.cpp would
# abort on is caught by the load probe (backends/llama_cpp/probe.py).


class _Hparams:
    """Typed reads of `<arch>.*` numbers: scalars, or per-layer arrays (their items)."""

    def __init__(self, header: _Header, arch: str):
        self.header, self.arch = header, arch

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def number(self, name: str) -> float | None:
        value = self.header.metadata.get(self.key(name))
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def per_layer(self, name: str) -> list[float]:
        value = self.header.layer_arrays.get(self.key(name), self.header.metadata.get(self.key(name)))
        values = value if isinstance(value, list) else [value]
        return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _layer_problems(hp: _Hparams) -> Iterator[str]:
    layers = hp.number("block_count")
    if layers is not None and not 1 <= layers <= LLAMA_MAX_LAYERS:
        yield f"{hp.key('block_count')} is {layers}, outside 1..{LLAMA_MAX_LAYERS}"
    nextn = hp.number("nextn_predict_layers")
    if layers is not None and nextn is not None and nextn > layers:
        yield f"{hp.key('nextn_predict_layers')} is {nextn}, more than the {layers} layers"


def _expert_problems(hp: _Hparams) -> Iterator[str]:
    experts = hp.number("expert_count") or 0
    if hp.arch in ("hunyuan-dense", "hunyuan_vl") and experts <= 1:
        return  # llama.cpp treats these as dense models and ignores the expert keys
    used = max(hp.per_layer("expert_used_count"), default=0)
    groups, groups_used = hp.number("expert_group_count") or 0, hp.number("expert_group_used_count") or 0
    if experts > LLAMA_MAX_EXPERTS:
        yield f"{hp.key('expert_count')} is {experts}, more than llama.cpp's {LLAMA_MAX_EXPERTS}"
    elif experts == 0 and (used or groups):
        yield f"{hp.key('expert_used_count')} or expert_group_count is set but the model has no experts"
    elif experts and not 0 < used <= experts:
        yield f"{hp.key('expert_used_count')} is {used}, outside 1..{experts} (expert_count)"
    elif experts and groups >= experts:
        yield f"{hp.key('expert_group_count')} is {groups}, not fewer than the {experts} experts"
    elif groups > 1 and (experts % groups or not 0 < groups_used < groups):
        yield (
            f"{hp.key('expert_group_count')} {groups} with expert_group_used_count {groups_used} does not fit "
            f"{experts} experts (groups must divide them, and 0 < used < groups)"
        )


def _number_problems(hp: _Hparams) -> Iterator[str]:
    for name in NORM_EPSILONS:
        eps = hp.number(name)
        if eps is not None and not eps >= 0:  # ggml's norms assert eps >= 0, which a NaN fails too
            yield f"{hp.key(name)} is {eps}; a norm epsilon must be at least 0"
    scaling = hp.header.metadata.get(hp.key("rope.scaling.type"))
    if isinstance(scaling, str) and scaling not in LLAMA_ROPE_SCALING_TYPES:
        yield f"{hp.key('rope.scaling.type')} is {scaling!r}, not one of {', '.join(LLAMA_ROPE_SCALING_TYPES)}"


def _check_hparams(cursor: _Cursor, header: _Header) -> None:
    arch = _text(header.metadata, gguf.Keys.General.ARCHITECTURE)
    if not arch:
        return
    hp = _Hparams(header, arch)
    for problems in (_layer_problems, _expert_problems, _number_problems):
        for problem in problems(hp):
            raise cursor.fail(f"{problem}; llama.cpp would abort on it (a broken conversion or a damaged file)")


# ---------------------------------------------------------------------------------------------------------- facts


def format_parameter_size(count: int) -> str:
    """Ollama-style size: one decimal below 10, none above ("1.2B", "8.0B", "135M", "70B")."""
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        # 999.7M is written 1.0B, not 1000M.
        if count >= scale * 0.9995:
            value = count / scale
            return f"{value:.1f}{suffix}" if value < 9.95 else f"{value:.0f}{suffix}"
    return str(count)


def _dominant_tensor_type(tensors: list[_Tensor]) -> str:
    """The type that holds the most weights (1-D norms stay F32 in every quantization, so they never win)."""
    weights: Counter[str] = Counter()
    for tensor in tensors:
        weights[tensor.type.name] += tensor.elements
    return weights.most_common(1)[0][0] if weights else ""


def _file_type_name(raw: Any, tensors: list[_Tensor]) -> str:
    """llama.cpp's name for general.file_type (3 -> "Q4_1"); the dominant tensor type when absent or unknown."""
    try:
        ftype = gguf.LlamaFileType(raw)
    except ValueError:
        ftype = gguf.LlamaFileType.GUESSED
    if ftype == gguf.LlamaFileType.GUESSED:
        return _dominant_tensor_type(tensors)
    return ftype.name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _arch_int(metadata: dict[str, Any], arch: str, key: str) -> int | None:
    value = metadata.get(key.format(arch=arch))
    return int(value) if isinstance(value, int) else None


def _text(metadata: dict[str, Any], key: str) -> str | None:
    value = metadata.get(key)
    return value if isinstance(value, str) else None


def inspect_gguf(path: Path) -> GGUFInfo:
    """Describe a GGUF file from its header alone; for a split GGUF, the whole model (every part's tensors).

    Args:
        path: the .gguf file (a store blob or any path); of a split set, any part named as gguf-split names them.
    Returns:
        GGUFInfo with architecture, sizes, quantization, context length, chat template and metadata.
    Raises:
        ModelFormatError: when the file is missing, not a file, truncated or malformed; the message names both.
    """
    path = Path(path)
    header = _read_header(path)
    parts = split_parts(path, header.metadata)
    if len(parts) > 1:
        header = _merge_split(parts)
    meta = header.metadata
    arch = _text(meta, gguf.Keys.General.ARCHITECTURE) or ""
    params = sum(tensor.elements for tensor in header.tensors)
    tensor_bytes = sum(tensor.nbytes for tensor in header.tensors)
    return GGUFInfo(
        path=path,
        architecture=arch,
        name=_text(meta, gguf.Keys.General.NAME) or "",
        parameter_count=params,
        parameter_size=format_parameter_size(params),
        file_type=_file_type_name(meta.get(gguf.Keys.General.FILE_TYPE), header.tensors),
        tensor_types=dict(Counter(tensor.type.name for tensor in header.tensors)),
        bits_per_weight=tensor_bytes * 8 / params if params else 0.0,
        tensor_bytes=tensor_bytes,
        file_size=sum(part.stat().st_size for part in parts),
        context_length=_arch_int(meta, arch, gguf.Keys.LLM.CONTEXT_LENGTH),
        embedding_length=_arch_int(meta, arch, gguf.Keys.LLM.EMBEDDING_LENGTH),
        block_count=_arch_int(meta, arch, gguf.Keys.LLM.BLOCK_COUNT),
        chat_template=_text(meta, gguf.Keys.Tokenizer.CHAT_TEMPLATE),
        tokenizer_model=_text(meta, gguf.Keys.Tokenizer.MODEL),
        vocab_size=header.arrays.get(gguf.Keys.Tokenizer.LIST, (None, None))[1],
        has_mtp=(_arch_int(meta, arch, gguf.Keys.LLM.NEXTN_PREDICT_LAYERS) or 0) > 0,
        license=_text(meta, gguf.Keys.General.LICENSE),
        metadata=meta,
        arrays=header.arrays,
        tensor_sizes={tensor.name: tensor.nbytes for tensor in header.tensors},
        tensor_shapes={tensor.name: tensor.shape for tensor in header.tensors},
    )


# ---------------------------------------------------------------------------------------------------------- splits

# gguf-split names part i of n `<prefix>-0000i-of-0000n.gguf` (llama.cpp's llama_split_path); its loader finds the
# other parts by that name, so the names are part of the format.
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_SPLIT_PARTS = 9999


def parse_split_name(name: str) -> tuple[str, int, int] | None:
    """(prefix, part number from 1, part count) of a file named as gguf-split names parts, else None."""
    match = SPLIT_NAME.match(name)
    if not match:
        return None
    number, count = int(match["no"]), int(match["count"])
    return (match["prefix"], number, count) if 1 <= number <= count <= MAX_SPLIT_PARTS else None


def split_part_name(prefix: str, number: int, count: int) -> str:
    """The file name of part `number` (1-based) of `count`, as gguf-split writes it."""
    return f"{prefix}-{number:05d}-of-{count:05d}.gguf"


def split_position(metadata: dict[str, Any], path: Path) -> tuple[int, int]:
    """(part number from 1, part count) of a GGUF: (1, 1) for a whole file.

    Raises:
        ModelFormatError: split.no / split.count are out of range.
    """
    count = metadata.get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, 1)
    number = metadata.get(gguf.Keys.Split.LLM_KV_SPLIT_NO, 0)
    if (
        not isinstance(count, int)
        or not isinstance(number, int)
        or not 1 <= count <= MAX_SPLIT_PARTS
        or not 0 <= number < count
    ):
        raise ModelFormatError(f"{path} has impossible split metadata: split.no {number!r} of split.count {count!r}")
    return number + 1, count


def split_parts(path: Path, metadata: dict[str, Any] | None = None) -> list[Path]:
    """Every part of the split GGUF that `path` belongs to, in order (just [path] for a whole file).

    Raises:
        ModelFormatError: a part of a split is not named as gguf-split names it, or a part is missing.
    """
    path = Path(path)
    number, count = split_position(metadata if metadata is not None else _read_header(path).metadata, path)
    if count == 1:
        return [path]
    parsed = parse_split_name(path.name)
    if not parsed or parsed[1:] != (number, count):
        raise ModelFormatError(
            f"{path} is part {number} of a {count}-part split GGUF, but its name does not say so",
            hint=f"keep the names gguf-split gave the parts, e.g. {split_part_name('model', number, count)}",
        )
    parts = [path.with_name(split_part_name(parsed[0], i, count)) for i in range(1, count + 1)]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise ModelFormatError(
            f"split GGUF {path.name}: part(s) {', '.join(missing)} missing beside it",
            hint="download every part into the same folder",
        )
    return parts


def _merge_split(parts: list[Path]) -> _Header:
    """One header for a whole split model: the first part's metadata, every part's tensors (checked as llama.cpp's
    loader checks them: each part knows its place, and the tensor count adds up)."""
    merged = _Header()
    for index, part in enumerate(parts):
        header = _read_header(part)
        number, count = split_position(header.metadata, part)
        if (number, count) != (index + 1, len(parts)):
            raise ModelFormatError(f"{part} says it is part {number} of {count}, expected {index + 1} of {len(parts)}")
        if index == 0:
            merged.metadata, merged.arrays = header.metadata, header.arrays
        merged.tensors += header.tensors
    expected = merged.metadata.get(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    if expected is not None and expected != len(merged.tensors):
        raise ModelFormatError(
            f"split GGUF {parts[0].name}: split.tensors.count is {expected} but the parts hold "
            f"{len(merged.tensors)} tensors"
        )
    return merged


# ---------------------------------------------------------------------------------------------------------- LoRA


@dataclass(frozen=True)
class LoraInfo:
    """What a GGUF LoRA adapter's header says."""

    path: Path
    architecture: str
    alpha: float
    pairs: int  # adapted tensors (each a lora_a / lora_b pair)
    tensor_bytes: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)  # tensor name -> ggml shape


def inspect_lora(path: Path) -> LoraInfo:
    """Check that `path` is a GGUF LoRA adapter as llama.cpp loads them (llama-adapter.cpp), from its header alone.

    Raises:
        ModelFormatError (HTTP 400): not a GGUF file, not an adapter, not a LoRA, or lora_a / lora_b unpaired.
    """
    path = Path(path)
    try:
        header = _read_header(path)
    except ModelFormatError as exc:
        raise ModelFormatError(
            f"adapter {exc.message}", hint="ADAPTER takes a GGUF LoRA file (convert_lora_to_gguf.py makes one)"
        ) from None
    meta = header.metadata
    if meta.get(gguf.Keys.General.TYPE) != "adapter" or meta.get(gguf.Keys.Adapter.TYPE) != "lora":
        raise ModelFormatError(
            f"{path} is a GGUF file but not a LoRA adapter (general.type "
            f"{meta.get(gguf.Keys.General.TYPE)!r}, adapter.type "
            f"{meta.get(gguf.Keys.Adapter.TYPE)!r}; expected 'adapter' and 'lora')",
            hint="ADAPTER takes a GGUF LoRA file (convert_lora_to_gguf.py makes one)",
        )
    halves: dict[str, set[str]] = {}
    for tensor in header.tensors:
        base, _, half = tensor.name.rpartition(".")
        if half in ("lora_a", "lora_b"):
            halves.setdefault(base, set()).add(half)
        elif not tensor.name.endswith("_norm.weight"):  # llama.cpp skips norms and refuses anything else
            raise ModelFormatError(f"LoRA adapter {path}: tensor {tensor.name!r} is neither a lora_a nor a lora_b")
    unpaired = sorted(base for base, found in halves.items() if len(found) != 2)
    if unpaired or not halves:
        raise ModelFormatError(
            f"LoRA adapter {path}: "
            + (
                f"tensor {unpaired[0]!r} lacks its lora_a or lora_b"
                if unpaired
                else "it holds no lora_a / lora_b tensors"
            )
        )
    alpha = meta.get(gguf.Keys.Adapter.LORA_ALPHA, 0.0)
    return LoraInfo(
        path=path,
        architecture=_text(meta, gguf.Keys.General.ARCHITECTURE) or "",
        alpha=float(alpha) if isinstance(alpha, (int, float)) else 0.0,
        pairs=len(halves),
        tensor_bytes=sum(tensor.nbytes for tensor in header.tensors),
        shapes={tensor.name: _squeezed(tensor.shape) for tensor in header.tensors},
    )


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape without its trailing 1s (ggml treats [n, m, 1] as [n, m]), at least 2-D."""
    dims = list(shape)
    while len(dims) > 2 and dims[-1] == 1:
        dims.pop()
    return tuple(dims + [1] * (2 - len(dims)))


def check_lora_fits(lora: LoraInfo, base: GGUFInfo, label: str) -> None:
    """Every lora_a / lora_b pair against the base tensor it adapts, as llama.cpp's adapter loader checks them
    (llama-adapter.cpp) and beyond: a pair whose extra dimensions do not match the base's (a 3-D lora_a on a 2-D
    weight) passes llama.cpp's checks and then aborts the server at the first multiplication (ggml_can_mul_mat).

    Raises:
        ModelFormatError (HTTP 400): the tensor, the shapes, and what they should be.
    """
    pairs = {tensor.rpartition(".")[0] for tensor in lora.shapes if tensor.endswith((".lora_a", ".lora_b"))}
    for name in sorted(pairs):
        problem = _lora_pair_problem(name, lora.shapes[f"{name}.lora_a"], lora.shapes[f"{name}.lora_b"], base)
        if problem:
            raise ModelFormatError(
                f"LoRA adapter {lora.path.name} does not fit {label}: {problem}",
                hint="use an adapter trained on this base model (convert_lora_to_gguf.py with its --base)",
            )


def _lora_pair_problem(name: str, a: tuple[int, ...], b: tuple[int, ...], base: GGUFInfo) -> str | None:
    target = base.tensor_shapes.get(name)
    if target is None:
        return f"tensor {name!r} is not in the base model"
    target = _squeezed(target)
    if a[2:] != target[2:] or b[2:] != target[2:]:
        return (
            f"{name} has lora_a {list(a)} and lora_b {list(b)}, whose dimensions past the second must be the base "
            f"tensor's {list(target[2:])} (base {list(target)})"
        )
    if name.endswith("token_embd.weight"):  # A and B are flipped for the embedding (llm_build_inp_embd)
        fits, rank_a, rank_b = target[0] == b[1] and target[1] == a[1], a[0], b[0]
    else:
        fits, rank_a, rank_b = target[0] == a[0] and target[1] == b[1], a[1], b[0]
    if not fits:
        return f"{name} has lora_a {list(a)} and lora_b {list(b)}, which do not fit the base tensor {list(target)}"
    if rank_a != rank_b or rank_a < 1:
        return f"{name} has lora_a {list(a)} and lora_b {list(b)}: their ranks ({rank_a}, {rank_b}) differ"
    return None


# ---------------------------------------------------------------------------------------------------------- projectors

PROJECTOR_HINT = "the second FROM takes a vision projector: a `clip` GGUF (an mmproj-*.gguf file beside the model)"


@dataclass(frozen=True)
class ProjectorInfo:
    """A vision projector (a `clip` GGUF): what turns an image into embeddings the text model reads."""

    path: Path
    projector_type: str  # clip.projector_type, e.g. "idefics3", "gemma3"
    output_width: int | None  # clip.vision.projection_dim: the text model's embedding width it feeds
    file_size: int


def inspect_projector(path: Path) -> ProjectorInfo:
    """Check that `path` is a vision projector as llama.cpp's mtmd loads them (tools/mtmd/clip.cpp), from its header.

    Raises:
        ModelFormatError (HTTP 400): not a GGUF file, not a `clip` architecture, or no vision encoder in it.
    """
    path = Path(path)
    try:
        header = _read_header(path)
    except ModelFormatError as exc:
        raise ModelFormatError(f"vision projector {exc.message}", hint=PROJECTOR_HINT) from None
    meta = header.metadata
    arch = _text(meta, gguf.Keys.General.ARCHITECTURE) or ""
    if arch != "clip":
        raise ModelFormatError(
            f"{path} is not a vision projector: its architecture is {arch or 'unnamed'!r}, not 'clip'",
            hint=PROJECTOR_HINT,
        )
    if meta.get("clip.has_vision_encoder") is not True:
        raise ModelFormatError(
            f"vision projector {path} has no vision encoder (clip.has_vision_encoder is not true)",
            hint="localllm reads images only; audio projectors are not supported",
        )
    width = meta.get("clip.vision.projection_dim")
    return ProjectorInfo(
        path=path,
        projector_type=str(meta.get("clip.vision.projector_type") or meta.get("clip.projector_type") or ""),
        output_width=int(width) if isinstance(width, int) else None,
        file_size=path.stat().st_size,
    )
