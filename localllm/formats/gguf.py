"""Read what a GGUF file says about itself (architecture, quantization, context, template) without loading weights.

The header is walked once with bounds checks against the file size, so a truncated or hostile file is a
`ModelFormatError` naming the file and the problem, never a crash, a hang or a huge allocation. The walk reads only
the header (metadata and tensor infos) through a memory map; the weights are never touched. Format constants (value
types, tensor types and their block sizes, llama.cpp's file types) come from the `gguf` package.

We do not hand the file to `gguf.GGUFReader`: it builds two numpy arrays per vocabulary string (17 s for
gemma3:270m's 262k tokens on our machines) and trusts the counts it reads. tests/test_gguf.py checks that this walk
and GGUFReader agree on files written by `gguf.GGUFWriter`.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

import gguf

from .. import api
from ..errors import ModelFormatError

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# Arrays longer than this (token tables, merges, scores) are summarised by type and length, never decoded.
MAX_ARRAY_ITEMS = 64
# The smallest encodings: a tensor info is name length (8) + n_dims (4) + type (4) + offset (8); a key/value pair is
# key length (8) + value type (4) + a one-byte value. Counts are checked against them before anything is read.
MIN_TENSOR_INFO_BYTES = 24
MIN_KV_BYTES = 13
HEADER_BYTES = 24  # magic, version, tensor count, kv count

_V = gguf.GGUFValueType
_SCALAR_FORMATS = {
    _V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I", _V.INT32: "<i",
    _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q", _V.FLOAT64: "<d",
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
    context_length: Optional[int]
    embedding_length: Optional[int]
    block_count: Optional[int]
    chat_template: Optional[str]
    tokenizer_model: Optional[str]
    vocab_size: Optional[int]  # length of tokenizer.ggml.tokens
    has_mtp: bool  # multi-token-prediction (NextN) layers that can draft for speculative decoding
    license: Optional[str]
    metadata: dict[str, Any] = field(repr=False)  # scalars and short arrays; long arrays are in `arrays`
    arrays: dict[str, tuple[str, int]] = field(repr=False)  # every array key -> (item type, length)
    tensor_sizes: dict[str, int] = field(default_factory=dict, repr=False)  # tensor name -> bytes (layer placement)

    @property
    def quantization_level(self) -> str:
        return self.file_type

    def details(self) -> api.ModelDetails:
        return api.ModelDetails(format="gguf", family=self.architecture, families=[self.architecture],
                                parameter_size=self.parameter_size, quantization_level=self.quantization_level)

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
            raise self.fail(f"{what} at byte {self.offset} needs {n} bytes but only {self.size - self.offset} "
                            "remain (truncated or corrupt)")

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
        raw = self.buf[self.offset:self.offset + length]
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


def _skip_array(cursor: _Cursor, item_type: gguf.GGUFValueType, count: int, key: str) -> None:
    if item_type == _V.STRING:
        cursor.need(count * 8, f"{count} string lengths of {key!r}")
        for _ in range(count):
            cursor.skip_string(f"item of {key!r}")
        return
    width = struct.calcsize(_SCALAR_FORMATS[item_type])
    cursor.need(count * width, f"{count} items of {key!r}")
    cursor.offset += count * width


def _read_array(cursor: _Cursor, key: str) -> tuple[Optional[list[Any]], tuple[str, int]]:
    """Read an array value: (its items, or None when too long to decode, (item type name, length))."""
    item_type = _value_type(cursor.scalar("<I", f"array type of {key!r}"), cursor, key)
    if item_type == _V.ARRAY:
        raise cursor.fail(f"key {key!r} is an array of arrays, which GGUF readers do not support")
    count = cursor.scalar("<Q", f"array length of {key!r}")
    summary = (item_type.name.lower(), count)
    if count > MAX_ARRAY_ITEMS:
        _skip_array(cursor, item_type, count, key)
        return None, summary
    return [_read_scalar(cursor, item_type, key) for _ in range(count)], summary


class _Tensor(NamedTuple):
    name: str
    type: gguf.GGMLQuantizationType
    elements: int
    nbytes: int
    offset: int  # from the start of the data section


@dataclass
class _Header:
    metadata: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, tuple[str, int]] = field(default_factory=dict)
    tensors: list[_Tensor] = field(default_factory=list)


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
        raise cursor.fail(f"unsupported GGUF version {version}{endian}; localllm reads versions "
                          f"{' and '.join(map(str, SUPPORTED_VERSIONS))}")
    n_tensors = cursor.scalar("<Q", "tensor count")
    n_kv = cursor.scalar("<Q", "metadata count")
    if n_tensors * MIN_TENSOR_INFO_BYTES + n_kv * MIN_KV_BYTES > cursor.size - HEADER_BYTES:
        raise cursor.fail(f"header claims {n_tensors} tensors and {n_kv} metadata keys, "
                          f"impossible in a file of {cursor.size} bytes")
    return n_tensors, n_kv


def _read_metadata(cursor: _Cursor, count: int, header: _Header) -> None:
    for index in range(count):
        key = cursor.string(f"key #{index}")
        if key in header.metadata or key in header.arrays:
            raise cursor.fail(f"metadata key {key!r} appears twice")
        vtype = _value_type(cursor.scalar("<I", f"value type of {key!r}"), cursor, key)
        if vtype != _V.ARRAY:
            header.metadata[key] = _read_scalar(cursor, vtype, key)
            continue
        items, header.arrays[key] = _read_array(cursor, key)
        if items is not None:
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
    return _Tensor(name, ttype, elements, elements // block * type_size, offset)


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
            raise cursor.fail(f"tensor {tensor.name!r} starts at offset {tensor.offset}, "
                              f"not a multiple of the alignment {alignment}")
        end = data_start + tensor.offset + tensor.nbytes
        if end > cursor.size:
            raise cursor.fail(f"tensor {tensor.name!r} ends at byte {end} but the file has only {cursor.size} "
                              "bytes (truncated)")
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
        return header
    finally:
        buf.close()


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


def _arch_int(metadata: dict[str, Any], arch: str, key: str) -> Optional[int]:
    value = metadata.get(key.format(arch=arch))
    return int(value) if isinstance(value, int) else None


def _text(metadata: dict[str, Any], key: str) -> Optional[str]:
    value = metadata.get(key)
    return value if isinstance(value, str) else None


def inspect_gguf(path: Path) -> GGUFInfo:
    """Describe a GGUF file from its header alone.

    Args:
        path: the .gguf file (a store blob or any path).
    Returns:
        GGUFInfo with architecture, sizes, quantization, context length, chat template and metadata.
    Raises:
        ModelFormatError: when the file is missing, not a file, truncated or malformed; the message names both.
    """
    path = Path(path)
    header = _read_header(path)
    meta = header.metadata
    arch = _text(meta, gguf.Keys.General.ARCHITECTURE) or ""
    params = sum(tensor.elements for tensor in header.tensors)
    tensor_bytes = sum(tensor.nbytes for tensor in header.tensors)
    return GGUFInfo(
        path=path, architecture=arch, name=_text(meta, gguf.Keys.General.NAME) or "",
        parameter_count=params, parameter_size=format_parameter_size(params),
        file_type=_file_type_name(meta.get(gguf.Keys.General.FILE_TYPE), header.tensors),
        tensor_types=dict(Counter(tensor.type.name for tensor in header.tensors)),
        bits_per_weight=tensor_bytes * 8 / params if params else 0.0,
        tensor_bytes=tensor_bytes, file_size=path.stat().st_size,
        context_length=_arch_int(meta, arch, gguf.Keys.LLM.CONTEXT_LENGTH),
        embedding_length=_arch_int(meta, arch, gguf.Keys.LLM.EMBEDDING_LENGTH),
        block_count=_arch_int(meta, arch, gguf.Keys.LLM.BLOCK_COUNT),
        chat_template=_text(meta, gguf.Keys.Tokenizer.CHAT_TEMPLATE),
        tokenizer_model=_text(meta, gguf.Keys.Tokenizer.MODEL),
        vocab_size=header.arrays.get(gguf.Keys.Tokenizer.LIST, (None, None))[1],
        has_mtp=(_arch_int(meta, arch, gguf.Keys.LLM.NEXTN_PREDICT_LAYERS) or 0) > 0,
        license=_text(meta, gguf.Keys.General.LICENSE),
        metadata=meta, arrays=header.arrays,
        tensor_sizes={tensor.name: tensor.nbytes for tensor in header.tensors},
    )
