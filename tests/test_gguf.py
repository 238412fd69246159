"""GGUF inspection: tiny files written with gguf.GGUFWriter, corrupted copies of them, and the real catalog models."""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest

from localllm import api
from localllm.errors import ModelFormatError
from localllm.quant.gguf import GGUFInfo, format_parameter_size, inspect_gguf

Q = gguf.GGMLQuantizationType
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENS = [f"tok{i}" for i in range(100)]


@dataclass
class Spec:
    """A tiny model to write: tensors are (name, numpy-order shape, type)."""

    arch: str = "llama"
    file_type: int | None = 3
    tensors: list[tuple[str, tuple[int, ...], Q]] = field(
        default_factory=lambda: [
            ("token_embd.weight", (100, 64), Q.Q4_1),
            ("blk.0.attn_q.weight", (64, 64), Q.Q4_1),
            ("blk.0.attn_k.weight", (64, 64), Q.Q4_1),
            ("blk.0.attn_norm.weight", (64,), Q.F32),
            ("output.weight", (100, 64), Q.Q8_0),
        ]
    )
    context_length: int = 8192
    template: str | None = CHATML
    tokens: list[str] | None = field(default_factory=lambda: list(TOKENS))
    tokenizer: str = "gpt2"
    nextn_layers: int | None = None
    alignment: int | None = None


def _tensor_bytes(shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    if qtype == Q.F16:
        return np.ones(shape, dtype=np.float16)
    return np.zeros(gguf.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)


def write_gguf(path: Path, spec: Spec) -> Path:
    writer = gguf.GGUFWriter(path, spec.arch)
    writer.add_name(f"Tiny {spec.arch}")
    writer.add_license("apache-2.0")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_tokenizer_model(spec.tokenizer)
    writer.add_array("general.tags", ["tiny", "test"])
    if spec.file_type is not None:
        writer.add_file_type(spec.file_type)
    if spec.template is not None:
        writer.add_chat_template(spec.template)
    if spec.tokens is not None:
        writer.add_token_list(spec.tokens)
        writer.add_token_scores([0.0] * len(spec.tokens))
    if spec.nextn_layers is not None:
        writer.add_nextn_predict_layers(spec.nextn_layers)
    if spec.alignment is not None:
        writer.add_custom_alignment(spec.alignment)
    for name, shape, qtype in spec.tensors:
        data = _tensor_bytes(shape, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------------------- valid files

VALID = {
    "llama Q4_1": (
        Spec(),
        {
            "architecture": "llama",
            "file_type": "Q4_1",
            "context_length": 8192,
            "tokenizer_model": "gpt2",
            "chat_template": CHATML,
            "has_mtp": False,
            "tensor_types": {"Q4_1": 3, "F32": 1, "Q8_0": 1},
            "vocab_size": 100,
        },
    ),
    "qwen2 Q4_K_M": (
        Spec(
            arch="qwen2",
            file_type=15,
            context_length=32768,
            tensors=[("token_embd.weight", (100, 256), Q.Q4_K), ("blk.0.ffn_down.weight", (64, 256), Q.Q6_K)],
        ),
        {
            "architecture": "qwen2",
            "file_type": "Q4_K_M",
            "context_length": 32768,
            "tensor_types": {"Q4_K": 1, "Q6_K": 1},
        },
    ),
    "F16": (
        Spec(arch="phi3", file_type=1, tensors=[("token_embd.weight", (100, 64), Q.F16)]),
        {"architecture": "phi3", "file_type": "F16"},
    ),
    "no file_type: dominant tensor type": (
        Spec(file_type=None, tensors=[("token_embd.weight", (100, 64), Q.Q8_0), ("norm.weight", (64,), Q.F32)]),
        {"file_type": "Q8_0"},
    ),
    "unknown file_type: dominant tensor type": (
        Spec(file_type=999, tensors=[("a.weight", (8, 64), Q.Q4_0), ("b.weight", (64, 64), Q.Q5_0)]),
        {"file_type": "Q5_0"},
    ),
    "MTP layers": (Spec(arch="glm4moe", nextn_layers=1), {"architecture": "glm4moe", "has_mtp": True}),
    "zero MTP layers": (Spec(arch="glm4moe", nextn_layers=0), {"has_mtp": False}),
    "no template, sentencepiece": (
        Spec(
            arch="gemma3",
            file_type=15,
            template=None,
            tokenizer="llama",
            tensors=[("token_embd.weight", (100, 256), Q.Q4_K)],
        ),
        {"architecture": "gemma3", "chat_template": None, "tokenizer_model": "llama", "file_type": "Q4_K_M"},
    ),
    "custom alignment": (Spec(alignment=64), {"file_type": "Q4_1"}),
    "vocab only": (
        Spec(file_type=None, tensors=[]),
        {"parameter_count": 0, "file_type": "", "bits_per_weight": 0.0, "tensor_types": {}},
    ),
}


@pytest.fixture(params=list(VALID), ids=list(VALID))
def valid_case(request, tmp_path) -> tuple[Path, Spec, dict]:
    spec, expected = VALID[request.param]
    return write_gguf(tmp_path / "model.gguf", spec), spec, expected


def test_inspect_valid(valid_case):
    path, spec, expected = valid_case
    info = inspect_gguf(path)
    assert isinstance(info, GGUFInfo)
    for name, value in expected.items():
        assert getattr(info, name) == value, name
    assert info.name == f"Tiny {spec.arch}"
    assert info.license == "apache-2.0"
    assert info.embedding_length == 64 and info.block_count == 1
    assert info.parameter_count == sum(int(np.prod(shape)) for _n, shape, _t in spec.tensors)
    assert info.quantization_level == info.file_type
    assert info.file_size == path.stat().st_size


def test_sizes_agree_with_gguf_reader(valid_case):
    """The header walk and the gguf package's own reader see the same tensors and metadata."""
    path, _spec, _expected = valid_case
    info = inspect_gguf(path)
    reader = gguf.GGUFReader(path)
    assert info.parameter_count == sum(int(t.n_elements) for t in reader.tensors)
    assert info.tensor_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    if info.parameter_count:
        assert info.bits_per_weight == pytest.approx(info.tensor_bytes * 8 / info.parameter_count)
    for key, reader_field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in info.metadata:
            assert info.metadata[key] == reader_field.contents(), key
        else:  # a long array: summarised by type and length, not decoded
            assert info.arrays[key][1] == len(reader_field.data), key


def test_details_and_model_info(tmp_path):
    info = inspect_gguf(write_gguf(tmp_path / "m.gguf", Spec()))
    assert info.details() == api.ModelDetails(
        format="gguf", family="llama", families=["llama"], parameter_size=info.parameter_size, quantization_level="Q4_1"
    )
    model_info = info.model_info()
    assert model_info["general.architecture"] == "llama"
    assert model_info["llama.context_length"] == 8192
    assert model_info["general.parameter_count"] == info.parameter_count
    assert model_info["general.tags"] == ["tiny", "test"]
    assert model_info["tokenizer.ggml.tokens"] is None  # long arrays are left out, as in Ollama's /api/show
    assert info.arrays["tokenizer.ggml.tokens"] == ("string", 100)
    assert "tokenizer.ggml.tokens" not in info.metadata


@pytest.mark.parametrize(
    "count,size",
    [
        (0, "0"),
        (999, "999"),
        (1_500, "1.5K"),
        (134_515_008, "135M"),
        (268_098_176, "268M"),
        (999_700_000, "1.0B"),
        (1_235_814_400, "1.2B"),
        (8_030_261_248, "8.0B"),
        (13_015_864_320, "13B"),
        (70_553_706_496, "71B"),
        (1_200_000_000_000, "1.2T"),
    ],
)
def test_format_parameter_size(count, size):
    assert format_parameter_size(count) == size


# ---------------------------------------------------------------------------------------------------------- bad files


@pytest.fixture(scope="module")
def good_bytes(tmp_path_factory) -> bytes:
    return write_gguf(tmp_path_factory.mktemp("good") / "good.gguf", Spec()).read_bytes()


def _after(data: bytes, marker: bytes) -> int:
    """Offset just past the GGUF string `marker` (a key or tensor name) in the header."""
    return data.index(marker) + len(marker)


def _patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt) :]


def _header_end(data: bytes) -> int:
    """Where the tensor infos end (the last tensor's name, then n_dims, dims, type and offset)."""
    offset = _after(data, b"output.weight")
    return offset + 4 + 2 * 8 + 4 + 8


CORRUPTIONS = {
    "wrong magic": (lambda d: b"GGML" + d[4:], "wrong magic b'GGML'"),
    "zero magic": (lambda d: b"\0" * 4 + d[4:], "wrong magic"),
    "version 1": (lambda d: _patch(d, 4, "<I", 1), "unsupported GGUF version 1"),
    "version 4": (lambda d: _patch(d, 4, "<I", 4), "unsupported GGUF version 4"),
    "big-endian": (lambda d: _patch(d, 4, "<I", 3 << 24), "big-endian"),
    "header cut short": (lambda d: d[:20], "the header at byte 0 needs 24 bytes"),
    "magic only": (lambda d: d[:4], "truncated or corrupt"),
    "tensor count 2**60": (lambda d: _patch(d, 8, "<Q", 2**60), "claims 1152921504606846976 tensors"),
    "tensor count 2**64-1": (lambda d: _patch(d, 8, "<Q", 2**64 - 1), "impossible in a file of"),
    "metadata count 2**60": (lambda d: _patch(d, 16, "<Q", 2**60), "metadata keys, impossible"),
    "more metadata than written": (
        lambda d: _patch(d, 16, "<Q", struct.unpack_from("<Q", d, 16)[0] + 1),
        "truncated or corrupt",
    ),
    "key length 2**62": (lambda d: _patch(d, 24, "<Q", 2**62), "key #0 (4611686018427387904 bytes) at byte 32"),
    "string value length 2**62": (
        lambda d: _patch(d, _after(d, b"general.name") + 4, "<Q", 2**62),
        "value of 'general.name'",
    ),
    "array length 2**62": (
        lambda d: _patch(d, _after(d, b"tokenizer.ggml.tokens") + 8, "<Q", 2**62),
        "4611686018427387904 string lengths of 'tokenizer.ggml.tokens'",
    ),
    "array item string length 2**40": (
        lambda d: _patch(d, _after(d, b"tokenizer.ggml.tokens") + 16, "<Q", 2**40),
        "item of 'tokenizer.ggml.tokens' (1099511627776 bytes)",
    ),
    "score array length 2**61": (
        lambda d: _patch(d, _after(d, b"tokenizer.ggml.scores") + 8, "<Q", 2**61),
        "items of 'tokenizer.ggml.scores'",
    ),
    "unknown value type": (lambda d: _patch(d, _after(d, b"general.name"), "<I", 99), "unknown value type 99"),
    "array of arrays": (lambda d: _patch(d, _after(d, b"general.tags") + 4, "<I", 9), "array of arrays"),
    "unknown array item type": (lambda d: _patch(d, _after(d, b"general.tags") + 4, "<I", 77), "unknown value type 77"),
    "five dimensions": (lambda d: _patch(d, _after(d, b"output.weight"), "<I", 5), "has 5 dimensions"),
    "zero dimensions": (lambda d: _patch(d, _after(d, b"output.weight"), "<I", 0), "has 0 dimensions"),
    "absurd shape": (lambda d: _patch(d, _after(d, b"output.weight") + 4, "<Q", 2**62), "impossible shape"),
    "unknown tensor type": (lambda d: _patch(d, _after(d, b"output.weight") + 20, "<I", 200), "unknown type 200"),
    "removed tensor type Q4_2": (lambda d: _patch(d, _after(d, b"output.weight") + 20, "<I", 4), "unknown type 4"),
    "tensor offset past the end": (lambda d: _patch(d, _after(d, b"output.weight") + 24, "<Q", 2**40), "ends at byte"),
    "misaligned tensor offset": (
        lambda d: _patch(
            d,
            _after(d, b"output.weight") + 24,
            "<Q",
            struct.unpack_from("<Q", d, _after(d, b"output.weight") + 24)[0] + 1,
        ),
        "not a multiple of the alignment 32",
    ),
    "duplicate tensor name": (
        lambda d: d.replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight", 1),
        "tensor 'blk.0.attn_q.weight' appears twice",
    ),
    "duplicate metadata key": (
        lambda d: d.replace(b"general.name", b"general.tags", 1),
        "metadata key 'general.tags' appears twice",
    ),
    # The last tensor (Q8_0, 6800 bytes) is followed by alignment padding; cut into the tensor itself.
    "weights cut off": (lambda d: d[:-1000], "tensor 'output.weight' ends at byte"),
    "header only": (lambda d: d[: _header_end(d)], "(truncated)"),
}


@pytest.mark.parametrize("corrupt,message", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corrupt_file_is_a_clear_error(tmp_path, good_bytes, corrupt, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(corrupt(good_bytes))
    with pytest.raises(ModelFormatError) as caught:
        inspect_gguf(path)
    text = str(caught.value)
    assert text.startswith(f"{path} is not a usable GGUF file: ")
    assert message in text
    assert "\n" not in text


def test_truncated_anywhere_is_a_clear_error(tmp_path, good_bytes):
    """Cut the file at every offset of its header (and some inside the weights): always a ModelFormatError."""
    cuts = list(range(1, _header_end(good_bytes) + 40)) + list(range(_header_end(good_bytes), len(good_bytes), 97))
    path = tmp_path / "cut.gguf"
    for cut in cuts:
        path.write_bytes(good_bytes[:cut])
        with pytest.raises(ModelFormatError, match="is not a usable GGUF file"):
            inspect_gguf(path)


def test_random_damage_never_escapes_as_another_error(tmp_path, good_bytes):
    """Flip bytes in the header: the result is either a description or a ModelFormatError, never a crash."""
    rng = random.Random(1234)
    path = tmp_path / "flipped.gguf"
    failures = 0
    for _ in range(300):
        data = bytearray(good_bytes)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(_header_end(good_bytes))] = rng.randrange(256)
        path.write_bytes(bytes(data))
        try:
            inspect_gguf(path)
        except ModelFormatError:
            failures += 1
    assert failures > 0


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda p: p.write_bytes(b""), "it is empty"),
        (lambda p: p.write_bytes(bytes(range(256)) * 8), "wrong magic"),
        (lambda p: p.write_text("FROM smollm2:135m\n"), "wrong magic b'FROM'"),
        (lambda p: p.mkdir(), "is not a file"),
        (lambda p: None, "does not exist"),
    ],
)
def test_not_a_gguf_file(tmp_path, make, message):
    path = tmp_path / "thing.gguf"
    make(path)
    with pytest.raises(ModelFormatError, match=message) as caught:
        inspect_gguf(path)
    assert str(path) in str(caught.value)


# ---------------------------------------------------------------------------------------------------------- real models


@pytest.mark.models
def test_smollm2(smollm2_path):
    info = inspect_gguf(smollm2_path)
    assert (info.architecture, info.file_type, info.context_length) == ("llama", "Q4_1", 8192)
    assert "<|im_start|>" in info.chat_template
    assert info.tokenizer_model == "gpt2"
    assert info.parameter_size == "135M"
    assert info.details().quantization_level == "Q4_1"
    assert info.model_info()["llama.context_length"] == 8192


@pytest.mark.models
def test_gemma3(gemma3_path):
    info = inspect_gguf(gemma3_path)
    assert (info.architecture, info.file_type) == ("gemma3", "Q4_K_M")
    assert info.context_length == 32768
    assert info.parameter_size == "268M"
    assert info.vocab_size == 262144
    assert info.details().family == "gemma3"
