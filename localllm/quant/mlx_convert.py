"""GGUF → MLX folder conversion: what `localllm create NAME --from MODEL --format mlx` runs.

The output is the layout mlx-community publishes (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), so the MLX backend loads converted and downloaded models the same way.

Tensors are read with the gguf package, never with `mx.load`: MLX's GGUF reader decodes Q4_K wrongly and refuses
Q5_x (see reference/mlx-on-linux.md). Q4_0/Q4_1/Q8_0 blocks map exactly onto MLX's affine 4/8-bit layout with
group size 32, so they are repacked bit for bit; every other type is dequantized exactly with `gguf.quants`.
Everything about the model (architecture, sizes, vocabulary, template) comes from the GGUF metadata."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..errors import BackendUnavailable, InvalidInput, ModelFormatError

if TYPE_CHECKING:
    from ..api import ModelDetails

QUANTIZE_CHOICES = ("f32", "f16", "bf16", "q8", "q4")
GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1/Q8_0 blocks hold 32 weights: one MLX quantization group each

# llama.cpp also ends generation on these control tokens when the GGUF does not name them (llama-vocab.cpp does
# the same lookup), so both backends stop at the same place.
_END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "<|return|>",
        "<|call|>",
    }
)
_CONTROL_TOKEN = 3  # tokenizer.ggml.token_type value for control tokens


# ------------------------------------------------------------------------------------------------------- metadata


class _Metadata:
    """Typed access to a GGUF's key/value fields."""

    def __init__(self, reader):
        self._fields = reader.fields
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        found = self._fields.get(key)
        return default if found is None else found.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch_get(key)
        if value is None:
            raise ModelFormatError(f"GGUF metadata lacks {self.arch}.{key}, needed to build the MLX config")
        return value


# ------------------------------------------------------------------------------------------------------- arch specs

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class _ArchSpec:
    """How one GGUF architecture maps onto an mlx-lm model class."""

    model_type: str
    layer_names: dict[str, str]
    make_config: Callable[[_Metadata], dict[str, Any]]
    permute_qk: bool = False  # llama.cpp's convert script permutes llama q/k rows for its rope layout
    norm_offset: float = 0.0  # gemma stores RMSNorm weights as 1 + w; mlx-lm adds the 1 itself


def _llama_config(meta: _Metadata) -> dict[str, Any]:
    heads = meta.require("attention.head_count")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": meta.require("embedding_length"),
        "num_hidden_layers": meta.require("block_count"),
        "intermediate_size": meta.require("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.arch_get("attention.head_count_kv", heads),
        "rms_norm_eps": meta.require("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.arch_get("rope.freq_base", 10000.0),
        "max_position_embeddings": meta.require("context_length"),
    }
    if meta.arch_get("attention.key_length") is not None:
        config["head_dim"] = meta.arch_get("attention.key_length")
    scaling = _rope_scaling(meta)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _qwen2_config(meta: _Metadata) -> dict[str, Any]:
    # The llama layout with biases on q/k/v (mlx-lm's qwen2 class has them); llama.cpp's converter leaves qwen2's
    # q/k rows as Hugging Face wrote them, so nothing is unpermuted.
    config = _llama_config(meta)
    config.update({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    head_dim = config.pop("head_dim", None)
    if head_dim is not None and head_dim != config["hidden_size"] // config["num_attention_heads"]:
        raise ModelFormatError(
            f"this qwen2 GGUF has heads of {head_dim} values, which mlx-lm's qwen2 model cannot hold",
            hint="run it on llama.cpp (the default backend)",
        )
    return config


def _gemma3_config(meta: _Metadata) -> dict[str, Any]:
    head_dim = meta.require("attention.key_length")
    hidden, heads, layers = (
        meta.require("embedding_length"),
        meta.require("attention.head_count"),
        meta.require("block_count"),
    )
    config = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": meta.require("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.arch_get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.require("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.arch_get("rope.freq_base", 1_000_000.0),
        "max_position_embeddings": meta.require("context_length"),
        "sliding_window": meta.require("attention.sliding_window"),
        # Fixed for Gemma 3 and therefore not in the GGUF; llama.cpp hard-codes the same two values.
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        # llama.cpp scales attention by the head size, except the 62-layer 27B which uses hidden / heads.
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
    }
    scaling = _rope_scaling(meta)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(meta: _Metadata) -> dict[str, Any] | None:
    kind = meta.arch_get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelFormatError(
            f"rope scaling {kind!r} in this GGUF is not supported by the MLX converter yet",
            hint="run it on llama.cpp (the default backend)",
        )
    factor = float(meta.arch_get("rope.scaling.factor", 1.0))
    return {"type": "linear", "rope_type": "linear", "factor": factor}


_ARCHS = {
    "llama": _ArchSpec(
        "llama", {**_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"}, _llama_config, permute_qk=True
    ),
    "qwen2": _ArchSpec("qwen2", {**_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"}, _qwen2_config),
    "gemma3": _ArchSpec(
        "gemma3_text",
        {
            **_LAYER_NAMES,
            "ffn_norm": "pre_feedforward_layernorm",
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        _gemma3_config,
        norm_offset=-1.0,
    ),
}


def map_tensor_name(spec: _ArchSpec, name: str) -> str:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`; an unknown tensor is a ModelFormatError."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in spec.layer_names:
        return f"model.layers.{parts[1]}.{spec.layer_names[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise ModelFormatError(
        f"tensor {name!r} has no MLX counterpart in the {spec.model_type} conversion",
        hint="this GGUF variant is not supported by the MLX converter; run it on llama.cpp",
    )


# ------------------------------------------------------------------------------------------------------- tensors


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (the inverse of mlx_lm.gguf.permute_weights).

    Rows are independent, so the same reshuffle applies to packed codes, scales and biases."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = data.shape[0]
    return data.reshape(rows, -1, block_bytes)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[rows, n] codes 0..15 → [rows, n/8] uint32, element i in bits 4i..4i+3 (MLX's little-endian packing)."""
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed.reshape(codes.shape[0], -1)).view(np.uint32)


def _q4_codes(blocks: np.ndarray, qs_start: int) -> np.ndarray:
    # A Q4 block stores element j in the low nibble of byte j and element j+16 in the high nibble.
    qs = blocks[..., qs_start : qs_start + 16]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(blocks.shape[0], -1)


def repack_q4_0(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 (w = d * (q - 8)) → MLX affine 4-bit: scale d, bias -8d. Returns (weight, scales, biases)."""
    blocks = _blocks(data, 18)
    d = _f16_field(blocks, 0)
    return _pack_nibbles(_q4_codes(blocks, 2)), d, (d.astype(np.float32) * -8).astype(np.float16)


def repack_q4_1(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 (w = d * q + m) → MLX affine 4-bit: scale d, bias m."""
    blocks = _blocks(data, 20)
    return _pack_nibbles(_q4_codes(blocks, 4)), _f16_field(blocks, 0), _f16_field(blocks, 2)


def repack_q8_0(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_0 (w = d * q, q signed) → MLX affine 8-bit: code q + 128, scale d, bias -128d."""
    blocks = _blocks(data, 34)
    d = _f16_field(blocks, 0)
    codes = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    weight = np.ascontiguousarray(codes.reshape(blocks.shape[0], -1)).view(np.uint32)
    return weight, d, (d.astype(np.float32) * -128).astype(np.float16)


def _repackers() -> dict:
    from gguf import GGMLQuantizationType as Q

    return {Q.Q4_0: repack_q4_0, Q.Q4_1: repack_q4_1, Q.Q8_0: repack_q8_0}


@dataclass
class _Tensor:
    """One converted weight: a float array, or packed codes with their scales and biases."""

    weight: np.ndarray
    scales: np.ndarray | None = None
    biases: np.ndarray | None = None
    bits: int = 0
    float_type: str = "f32"  # for dense tensors: the element type to store

    def rows_map(self, fn: Callable[[np.ndarray], np.ndarray]) -> _Tensor:
        def mapped(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else fn(a)

        return _Tensor(
            fn(self.weight), mapped(self.scales), mapped(self.biases), bits=self.bits, float_type=self.float_type
        )


def _read_tensor(tensor, *, keep_packed: bool) -> _Tensor:
    """Repack or dequantize one GGUF tensor; dense GGUF types keep their element type."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    repack = _repackers().get(qtype) if keep_packed else None
    if repack is not None:
        weight, scales, biases = repack(np.asarray(tensor.data))
        return _Tensor(weight, scales, biases, bits=8 if qtype == Q.Q8_0 else 4)
    dense = dequantize(np.asarray(tensor.data), qtype).astype(np.float32, copy=False)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dimensions innermost first
    return _Tensor(dense.reshape(shape), float_type={Q.F16: "f16", Q.BF16: "bf16"}.get(qtype, "f32"))


def _requantize(t: _Tensor, bits: int) -> _Tensor:
    import mlx.core as mx

    weight, scales, biases = mx.quantize(mx.array(t.weight), group_size=GROUP_SIZE, bits=bits)
    return _Tensor(np.array(weight), np.array(scales), np.array(biases), bits=bits)


def _apply_quantize(t: _Tensor, quantize: str | None) -> _Tensor:
    """Requantize dense matrices (q8/q4) or set the float type (f32/f16/bf16); packed tensors stay as they are."""
    if t.bits or quantize is None:
        return t
    if quantize in ("q8", "q4"):
        is_matrix = t.weight.ndim == 2 and t.weight.shape[-1] % GROUP_SIZE == 0
        return _requantize(t, int(quantize[1:])) if is_matrix else t
    return _Tensor(t.weight, float_type=quantize)


def _arch_tensor_fix(spec: _ArchSpec, meta: _Metadata, gguf_name: str, t: _Tensor) -> _Tensor:
    stem = gguf_name.rsplit(".", 1)[0]
    if spec.permute_qk and stem.endswith((".attn_q", ".attn_k")):
        heads = meta.require("attention.head_count")
        n_head = heads if stem.endswith(".attn_q") else meta.arch_get("attention.head_count_kv", heads)
        return t.rows_map(lambda a: unpermute_rows(a, n_head))
    if spec.norm_offset and stem.endswith("norm") and not t.bits:
        return _Tensor(t.weight + np.float32(spec.norm_offset), float_type=t.float_type)
    return t


def _convert_tensors(reader, spec: _ArchSpec, meta: _Metadata, quantize: str | None) -> dict[str, _Tensor]:
    keep_packed = quantize not in ("f32", "f16", "bf16")
    out: dict[str, _Tensor] = {}
    for tensor in reader.tensors:
        name = map_tensor_name(spec, tensor.name)
        converted = _arch_tensor_fix(spec, meta, tensor.name, _read_tensor(tensor, keep_packed=keep_packed))
        out[name] = _apply_quantize(converted, quantize)
    return out


def _to_mlx_arrays(tensors: dict[str, _Tensor]) -> dict[str, Any]:
    import mlx.core as mx

    float_types = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
    arrays: dict[str, Any] = {}
    for name, t in tensors.items():
        base = name.rsplit(".", 1)[0]
        if t.bits and t.scales is not None and t.biases is not None:  # packed codes always carry both
            arrays[name] = mx.array(t.weight)
            arrays[f"{base}.scales"] = mx.array(t.scales)
            arrays[f"{base}.biases"] = mx.array(t.biases)
        else:
            arrays[name] = mx.array(t.weight).astype(float_types[t.float_type])
    return arrays


# ------------------------------------------------------------------------------------------------------- config


def _token_list(meta: _Metadata) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError("GGUF has no tokenizer.ggml.tokens; the MLX folder needs a vocabulary")
    return tokens


def end_of_generation_ids(meta: _Metadata, tokens: list[str]) -> list[int]:
    """EOS first, then EOT/EOM when named and the control tokens llama.cpp treats as end of turn."""
    ids = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    types = meta.get("tokenizer.ggml.token_type") or []
    ids += [
        i for i, (text, kind) in enumerate(zip(tokens, types)) if kind == _CONTROL_TOKEN and text in _END_OF_TURN_TEXTS
    ]
    # The file's own EOS goes first: readers of a single `eos_token_id` take the first entry.
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def build_config(spec: _ArchSpec, meta: _Metadata, tensors: dict[str, _Tensor], tokens: list[str]) -> dict:
    config = spec.make_config(meta)
    embed = tensors["model.embed_tokens.weight"]
    config["vocab_size"] = int(embed.weight.shape[0])
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    config["bos_token_id"] = meta.get("tokenizer.ggml.bos_token_id")
    config["eos_token_id"] = end_of_generation_ids(meta, tokens)
    config["torch_dtype"] = "float32"
    bits = sorted({t.bits for t in tensors.values() if t.bits})
    if bits:
        # mlx-lm reads each layer's bits from its shapes, so Q8_0 embeddings and Q4 layers load together.
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": bits[0], "mode": "affine"}
    return config


# ------------------------------------------------------------------------------------------------------- tokenizer

_TOKENIZER_KEYS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}


def _gguf_tokenizer_dict(meta: _Metadata) -> dict[str, Any]:
    found = {name: meta.get(f"tokenizer.ggml.{key}") for key, name in _TOKENIZER_KEYS.items()}
    return {name: value for name, value in found.items() if value is not None}


def _smollm_pre_tokenizer():
    # llama.cpp's "smollm" pre-tokenizer splits every digit on its own before the GPT-2 byte-level split;
    # transformers' GGUF table does not know the name and would keep digit runs together.
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


_PRE_TOKENIZER_FIXES = {"smollm": _smollm_pre_tokenizer}


def build_tokenizer(meta: _Metadata):
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's view of the GGUF vocabulary.

    Uses transformers' GGUF tokenizer builders, which import without torch (its GGUF *reader* needs torch, so the
    metadata comes from gguf-py here)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as exc:
        raise BackendUnavailable(
            f"building an MLX tokenizer from GGUF needs transformers' GGUF helpers ({exc})",
            hint="pip install 'localllm[mlx]'",
        ) from None
    tok_dict = _gguf_tokenizer_dict(meta)
    try:
        backend, _ = convert_gguf_tokenizer(meta.arch, tok_dict)
    except ValueError as exc:
        raise ModelFormatError(f"cannot build a tokenizer from this GGUF: {exc}") from None
    fix = _PRE_TOKENIZER_FIXES.get(str(tok_dict.get("pre_tokenizer_type")))
    if fix is not None:
        backend.pre_tokenizer = fix()
    if meta.get("tokenizer.ggml.add_bos_token", False):
        _add_bos_post_processor(backend, tok_dict)
    return backend


def _add_bos_post_processor(backend, tok_dict: dict[str, Any]) -> None:
    from tokenizers.processors import TemplateProcessing

    bos_id = tok_dict.get("bos_token_id")
    if bos_id is None:
        return
    bos = tok_dict["tokens"][bos_id]
    backend.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
    )


def tokenizer_config(meta: _Metadata, tokens: list[str]) -> dict[str, Any]:
    def token_text(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_text("bos"),
        "eos_token": token_text("eos"),
        "unk_token": token_text("unknown"),
        "pad_token": token_text("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(meta.arch_get("context_length", 0) or 0),
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return {key: value for key, value in config.items() if value is not None}


# ------------------------------------------------------------------------------------------------------- reading back


@dataclass(frozen=True)
class MlxFolderInfo:
    """What `show` tells about an MLX folder, read from its JSON files (no mlx import, no weights read)."""

    config: dict[str, Any]
    chat_template: str | None
    license: str | None = None

    def model_info(self) -> dict[str, Any]:
        """Ollama-style model_info keys, named like the GGUF ones so `show` reads both the same way."""
        arch = str(self.config.get("model_type", "unknown"))
        keys = {
            "context_length": "max_position_embeddings",
            "embedding_length": "hidden_size",
            "block_count": "num_hidden_layers",
            "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads",
            "vocab_size": "vocab_size",
        }
        info: dict[str, Any] = {"general.architecture": arch, "general.format": "mlx"}
        info.update({f"{arch}.{key}": self.config[name] for key, name in keys.items() if name in self.config})
        if "quantization" in self.config:
            info["general.quantization"] = self.config["quantization"]
        return info


def mlx_details(config: dict[str, Any]) -> ModelDetails:
    """list/show details of an MLX model from its config.json: family, and Q<bits> when quantized."""
    from .. import api

    family = str(config.get("model_type", ""))
    bits = (config.get("quantization") or {}).get("bits")
    level = f"Q{bits}" if bits else str(config.get("torch_dtype", "")).replace("float", "F").replace("bF", "BF")
    return api.ModelDetails(
        format="mlx", family=family, families=[family] if family else None, quantization_level=level.upper()
    )


def inspect_mlx_folder(folder: Path) -> MlxFolderInfo:
    """Read config.json and the chat template of an MLX folder; ModelFormatError when config.json is unusable."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"MLX folder {folder} has no readable config.json: {exc}") from None
    template = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "tokenizer_config.json").is_file():
        template = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    return MlxFolderInfo(config=config, chat_template=template if isinstance(template, str) else None)


# ------------------------------------------------------------------------------------------------------- writing


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_folder(folder: Path, arrays: dict[str, Any], config: dict, tokenizer, tok_config: dict) -> None:
    import mlx.core as mx

    mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "mlx"})
    _write_json(folder / "config.json", config)
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", tok_config)
    if tok_config.get("chat_template"):
        (folder / "chat_template.jinja").write_text(tok_config["chat_template"], encoding="utf-8")


def _verify_folder(folder: Path, arrays: dict[str, Any]) -> None:
    """Read back what was written: every array with its shape, and parseable JSON."""
    import mlx.core as mx

    written = cast(dict[str, Any], mx.load(str(folder / "model.safetensors")))  # a .safetensors file: a dict
    expected = {name: tuple(a.shape) for name, a in arrays.items()}
    if {name: tuple(a.shape) for name, a in written.items()} != expected:
        raise ModelFormatError(f"the MLX weights written to {folder} do not read back as written")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        json.loads((folder / name).read_text(encoding="utf-8"))


def _require_mlx() -> None:
    try:
        import mlx.core  # noqa: F401  (writes the safetensors and requantizes)
    except ImportError as exc:
        raise BackendUnavailable(
            f"converting to MLX needs mlx ({exc.name} is missing)", hint="pip install 'localllm[mlx]'"
        ) from None


def _open_reader(gguf_path: Path):
    from gguf import GGUFReader

    if not Path(gguf_path).is_file():
        raise ModelFormatError(f"GGUF file {gguf_path} does not exist")
    try:
        return GGUFReader(str(gguf_path))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ModelFormatError(f"{gguf_path} is not a readable GGUF file: {exc}") from None


def check_quantize(quantize: str | None) -> None:
    """InvalidInput naming `quantize` unless it is None or one of QUANTIZE_CHOICES."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise InvalidInput(
            f"quantize {quantize!r} is not available for MLX output",
            hint=f"use one of {', '.join(QUANTIZE_CHOICES)}, or none to keep the GGUF's own",
        )


def _check_request(out_dir: Path, quantize: str | None) -> None:
    check_quantize(quantize)
    if out_dir.exists():
        raise InvalidInput(f"output folder {out_dir} already exists", hint="choose a new folder")


def convert_gguf_to_mlx(gguf_path: Path, out_dir: Path, *, quantize: str | None = None) -> Path:
    """Convert a llama, qwen2 or gemma3 GGUF into an MLX model folder at `out_dir` (created; must not exist).

    Args:
        gguf_path: the GGUF file.
        out_dir: the folder to create. It appears complete or not at all (built beside it, then renamed).
        quantize: None keeps Q4_0/Q4_1/Q8_0 packed and dequantizes other types to f32; "f32"/"f16"/"bf16" make
            every tensor dense of that type; "q8"/"q4" also quantize the dense matrices (affine, group size 32).

    Returns:
        out_dir.
    """
    out_dir = Path(out_dir)
    _check_request(out_dir, quantize)
    _require_mlx()
    reader = _open_reader(Path(gguf_path))
    meta = _Metadata(reader)
    spec = _ARCHS.get(meta.arch)
    if spec is None:
        raise ModelFormatError(
            f"architecture {meta.arch!r} cannot be converted to MLX yet",
            hint=f"supported: {', '.join(sorted(_ARCHS))}; run it on llama.cpp instead",
        )
    tokens = _token_list(meta)
    tensors = _convert_tensors(reader, spec, meta, quantize)
    config = build_config(spec, meta, tensors, tokens)
    arrays = _to_mlx_arrays(tensors)
    del tensors
    tokenizer = build_tokenizer(meta)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        _write_folder(partial, arrays, config, tokenizer, tokenizer_config(meta, tokens))
        _verify_folder(partial, arrays)
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir
