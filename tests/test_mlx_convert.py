"""GGUF → MLX conversion on synthetic GGUFs written in the test with gguf.GGUFWriter.

The tiny models are exported the way llama.cpp's converter does it (q/k rows permuted for llama, norms stored as
1 + w for gemma3, mixed quant types), then converted back and run on the MLX backend. Their logits must match an
mlx-lm model built directly from the same (dequantized) weights, which checks names, permutation, norms, config and
the repacking together. The real-model conversion (smollm2) is tested in test_mlx_backend.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
gguf = pytest.importorskip("gguf")

import mlx.core as mx  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from localllm.api import LoadOptions  # noqa: E402
from localllm.backends.base import Batch  # noqa: E402
from localllm.backends.mlx import MlxBackend  # noqa: E402
from localllm.errors import InvalidInput, ModelFormatError  # noqa: E402
from localllm.quant.mlx_convert import convert_gguf_to_mlx, repack_q4_0, repack_q4_1, repack_q8_0, unpermute_rows  # noqa: E402

pytestmark = pytest.mark.mlx

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# ------------------------------------------------------------------------------------------------------- repacking


@pytest.mark.parametrize(
    "qtype, repack, bits", [(Q.Q4_0, repack_q4_0, 4), (Q.Q4_1, repack_q4_1, 4), (Q.Q8_0, repack_q8_0, 8)]
)
def test_repack_matches_gguf_dequantize(qtype, repack, bits):
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((48, 128)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    raw = quantize(weight, qtype)
    packed, scales, biases = repack(raw)
    assert packed.dtype == np.uint32 and packed.shape == (48, 128 * bits // 32)
    ours = np.array(
        mx.dequantize(
            mx.array(packed),
            mx.array(scales).astype(mx.float32),
            mx.array(biases).astype(mx.float32),
            group_size=32,
            bits=bits,
        )
    )
    reference = dequantize(raw, qtype)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-6 * float(np.abs(reference).max()))


def test_repack_is_bit_identical_to_mlx_own_gguf_reader(tmp_path):
    # mx.load reads these three types correctly (not K-quants): our numpy repack must give the very same arrays.
    rng = np.random.default_rng(1)
    path = tmp_path / "three.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    tensors = {"a.weight": Q.Q4_0, "b.weight": Q.Q4_1, "c.weight": Q.Q8_0}
    raws = {name: quantize(rng.standard_normal((16, 64)).astype(np.float32), q) for name, q in tensors.items()}
    for name, raw in raws.items():
        writer.add_tensor(name, raw, raw_dtype=tensors[name])
    _finish(writer)
    loaded = mx.load(str(path))
    for (name, raw), repack in zip(raws.items(), (repack_q4_0, repack_q4_1, repack_q8_0)):
        packed, scales, biases = repack(raw)
        base = name.rsplit(".", 1)[0]
        assert np.array_equal(np.array(loaded[name]), packed)
        assert np.array_equal(np.array(loaded[f"{base}.scales"]), scales)
        assert np.array_equal(np.array(loaded[f"{base}.biases"]), biases)


def test_unpermute_inverts_llama_cpp_permutation():
    from mlx_lm.gguf import permute_weights

    weight = np.arange(12 * 8 * 3, dtype=np.float32).reshape(12 * 8, 3)
    for heads in (4, 12):
        permuted = np.array(permute_weights(mx.array(weight), heads))
        assert not np.array_equal(permuted, weight)
        assert np.array_equal(unpermute_rows(permuted, heads), weight)


# ------------------------------------------------------------------------------------------------------- tiny GGUFs


def _train_vocab():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["The capital of France is Paris.", "Hello world, hello tests."] * 10, trainer)
    return tok


def _vocab_fields(tok) -> tuple[list[str], list[int], list[str]]:
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t in SPECIALS else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, types, merges


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _random_q4_k(rows: int, cols: int, rng) -> np.ndarray:
    """Raw Q4_K blocks (gguf-py cannot quantize to K-quants): random codes with sane f16 scales."""
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(rows, cols // 256, 2)).astype(np.float16)
    blocks[..., :4] = scales.view(np.uint8).reshape(rows, cols // 256, 4)
    return blocks.reshape(rows, -1)


# How each HF-layout weight is stored in the synthetic GGUF: mixed on purpose, so every read path runs.
LAYER_TYPES = {
    "self_attn.q_proj": Q.Q4_0,
    "self_attn.k_proj": Q.Q4_1,
    "self_attn.v_proj": Q.Q8_0,
    "self_attn.o_proj": Q.F16,
    "mlp.gate_proj": Q.Q5_0,
    "mlp.up_proj": Q.BF16,
    "mlp.down_proj": Q.Q4_K,
}
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
LLAMA_LAYER_NAMES = {**GGUF_LAYER_NAMES, "post_attention_layernorm": "ffn_norm"}


def _store(weight: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF data, the exact values a reader must recover) for one weight."""
    if qtype == Q.Q4_K:
        raw = _random_q4_k(*weight.shape, rng)
    elif qtype == Q.F32:
        return weight, weight
    else:
        raw = quantize(weight, qtype)
    return raw, dequantize(raw, qtype).reshape(weight.shape)


class TinyExport:
    """A random mlx-lm model written as a GGUF, plus the weights a correct reader gets back."""

    def __init__(self, arch: str, config: dict, path: Path, *, extra_tensor: str | None = None):
        from mlx.utils import tree_flatten
        from mlx_lm.utils import _get_classes

        rng = np.random.default_rng(5)
        model_class, args_class = _get_classes(config)
        self.config = config
        self.model = model_class(args_class.from_dict(config))
        self.model.sanitize({})  # gemma3 unties its output head here when no lm_head weight is given
        self.expected: dict[str, np.ndarray] = {}
        writer = gguf.GGUFWriter(str(path), arch)
        _write_metadata(writer, arch, config)
        for name, value in tree_flatten(self.model.parameters()):
            weight = rng.standard_normal(value.shape).astype(np.float32) * (0.02 if value.ndim == 2 else 0.1)
            if name.endswith("norm.weight"):
                weight += 0.0 if arch == "gemma3" else 1.0  # norm gains around 1 (gemma adds its 1 at run time)
            self._write_tensor(writer, arch, name, weight, rng)
        if extra_tensor:
            writer.add_tensor(extra_tensor, np.zeros(64, dtype=np.float32))
        _finish(writer)
        self.model.load_weights([(k, mx.array(v)) for k, v in self.expected.items()])

    def _write_tensor(self, writer, arch: str, name: str, weight: np.ndarray, rng) -> None:
        parts = name.split(".")
        if parts[1] == "layers":
            layer, kind = parts[2], ".".join(parts[3:-1])
            names = GGUF_LAYER_NAMES if arch == "gemma3" else LLAMA_LAYER_NAMES
            suffix = parts[-1]  # qwen2's q/k/v carry biases, stored as F32 as llama.cpp's converter does
            qtype = LAYER_TYPES.get(kind, Q.F32) if suffix == "weight" else Q.F32
            gguf_name = f"blk.{layer}.{names[kind]}.{suffix}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[
                name
            ]
            qtype = Q.Q8_0 if "embed" in name else Q.F32
        raw, exact = _store(weight, qtype, rng)
        self.expected[name] = exact
        stored = raw
        if arch == "llama" and kind_is(name, ("q_proj", "k_proj")):
            heads = self.config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            stored = _permute(raw, heads)
        if arch == "gemma3" and weight.ndim == 1:
            stored = raw + 1.0  # llama.cpp's gemma converter stores norm gains as 1 + w
        writer.add_tensor(gguf_name, stored, raw_dtype=qtype if qtype not in (Q.F32,) else None)


def kind_is(name: str, kinds: tuple[str, ...]) -> bool:
    return any(f".{k}." in name for k in kinds)


def _permute(raw: np.ndarray, heads: int) -> np.ndarray:
    from mlx_lm.gguf import permute_weights

    return np.array(permute_weights(mx.array(raw), heads))  # row permutation: valid on raw quantized rows too


def _write_metadata(writer, arch: str, config: dict) -> None:
    tokens, types, merges = _vocab_fields(_train_vocab())
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    if arch == "gemma3":
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_sliding_window(config["sliding_window"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def llama_config(vocab: int) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }


def qwen2_config(vocab: int) -> dict:
    return {**llama_config(vocab), "model_type": "qwen2", "rope_theta": 1e6}


def gemma3_config(vocab: int) -> dict:
    # Six layers so the pattern holds five sliding-window layers and one global one; a window of 4 tokens is
    # crossed by the prompts below.
    return {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 4,
        "sliding_window_pattern": 6,
    }


@pytest.fixture(scope="module")
def vocab_size() -> int:
    return _train_vocab().get_vocab_size()


def _incremental_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    """Logits of the last token, decoded one token per step through the backend (cache, masks, positions)."""
    model = MlxBackend().load(folder, LoadOptions(num_ctx=64, num_parallel=1))
    try:
        batch = Batch()
        for pos, tok in enumerate(tokens[:-1]):
            batch.add(tok, pos, 0, False)
        model.decode(batch)
        last = Batch()
        row = last.add(tokens[-1], len(tokens) - 1, 0, True)
        model.decode(last)
        return model.logits(row)
    finally:
        model.close()


def _reference_logits(export: TinyExport, tokens: list[int]) -> np.ndarray:
    return np.array(export.model(mx.array([tokens]))[0, -1].astype(mx.float32))


@pytest.mark.parametrize(
    "arch, make_config", [("llama", llama_config), ("qwen2", qwen2_config), ("gemma3", gemma3_config)]
)
def test_tiny_model_converts_exactly(arch, make_config, vocab_size, tmp_path):
    export = TinyExport(arch, make_config(vocab_size), tmp_path / f"{arch}.gguf")
    folder = convert_gguf_to_mlx(tmp_path / f"{arch}.gguf", tmp_path / f"{arch}-mlx")
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32 and config["tie_word_embeddings"] is True
    tokens = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8]
    np.testing.assert_allclose(
        _incremental_logits(folder, tokens), _reference_logits(export, tokens), atol=2e-4, rtol=1e-4
    )


def test_tokenizer_and_template_come_from_metadata(vocab_size, tmp_path):
    TinyExport("llama", llama_config(vocab_size), tmp_path / "m.gguf")
    folder = convert_gguf_to_mlx(tmp_path / "m.gguf", tmp_path / "out")
    model = MlxBackend().load(folder, LoadOptions(num_ctx=32, num_parallel=1))
    try:
        source = _train_vocab()
        for text in ("The capital of France is Paris.", "héllo wörld 🙂", "<|im_start|>user\nhi<|im_end|>"):
            assert model.tokenize(text) == source.encode(text).ids
        assert model.meta.chat_template == CHATML
        assert model.meta.eos_token == 0 and model.meta.bos_token == 1
        assert model.is_eog(2)  # <|im_end|>: a control token llama.cpp also ends a turn on
    finally:
        model.close()


@pytest.mark.parametrize("mode, bits", [("f32", None), ("q8", 8), ("q4", 4)])
def test_quantize_modes(mode, bits, vocab_size, tmp_path):
    export = TinyExport("llama", llama_config(vocab_size), tmp_path / "m.gguf")
    folder = convert_gguf_to_mlx(tmp_path / "m.gguf", tmp_path / "out", quantize=mode)
    config = json.loads((folder / "config.json").read_text())
    weights = mx.load(str(folder / "model.safetensors"))
    if bits is None:
        assert "quantization" not in config
        assert not any(name.endswith(".scales") for name in weights)
    else:
        # Dense GGUF matrices (F16 o_proj) are quantized to the asked bits; packed ones keep theirs.
        assert weights["model.layers.0.self_attn.o_proj.weight"].shape[-1] == 64 * bits // 32
        assert weights["model.layers.0.self_attn.q_proj.weight"].shape[-1] == 64 * 4 // 32
    tokens = [5, 17, 42, 99, 7, 3]
    ours, reference = _incremental_logits(folder, tokens), _reference_logits(export, tokens)
    if mode == "f32":
        np.testing.assert_allclose(ours, reference, atol=2e-4, rtol=1e-4)
    else:
        # Requantizing random Gaussian matrices is lossy, 4-bit much more than 8-bit.
        assert float(np.corrcoef(ours, reference)[0, 1]) > (0.99 if bits == 8 else 0.9)


# ------------------------------------------------------------------------------------------------------- refusals


def test_unknown_architecture_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    _finish(writer)
    with pytest.raises(ModelFormatError, match="'mamba'"):
        convert_gguf_to_mlx(tmp_path / "q.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_tensor_fails_and_leaves_nothing_behind(vocab_size, tmp_path):
    TinyExport("llama", llama_config(vocab_size), tmp_path / "m.gguf", extra_tensor="blk.0.mystery.weight")
    with pytest.raises(ModelFormatError, match="blk.0.mystery.weight"):
        convert_gguf_to_mlx(tmp_path / "m.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_bad_requests_name_the_value(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(InvalidInput, match="'q3'"):
        convert_gguf_to_mlx(tmp_path / "m.gguf", tmp_path / "out", quantize="q3")
    with pytest.raises(InvalidInput, match="already exists"):
        convert_gguf_to_mlx(tmp_path / "m.gguf", tmp_path / "taken")
    with pytest.raises(ModelFormatError, match="does not exist"):
        convert_gguf_to_mlx(tmp_path / "m.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelFormatError, match="not a readable GGUF"):
        convert_gguf_to_mlx(tmp_path / "junk.gguf", tmp_path / "out")


# ------------------------------------------------------------------------------------------------------- create


def _invoke(*args: str):
    from typer.testing import CliRunner

    from localllm.cli import app

    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_modelfile_backend_mlx_stores_a_converted_folder(vocab_size, tmp_path, isolated_home):
    from localllm.models.store import Store

    export = TinyExport("llama", llama_config(vocab_size), tmp_path / "m.gguf")
    (tmp_path / "Modelfile").write_text("FROM ./m.gguf\nPARAMETER backend mlx\nPARAMETER temperature 0\n")
    result = _invoke("create", "tiny-mlx", "-f", str(tmp_path / "Modelfile"))
    assert result.exit_code == 0 and "converting to MLX" in result.output
    stored = Store().resolve("tiny-mlx")
    assert stored.format == "mlx" and stored.weights.is_dir() and stored.parameters["backend"] == "mlx"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in stored.weights.iterdir()}
    tokens = [5, 17, 42, 99]
    np.testing.assert_allclose(
        _incremental_logits(stored.weights, tokens), _reference_logits(export, tokens), atol=2e-4, rtol=1e-4
    )
    shown = _invoke("show", "tiny-mlx").output
    assert "mlx" in shown and "<|im_start|>" in shown and "256" in shown  # format, template, context length


def test_create_from_with_format_mlx_and_quantize(vocab_size, tmp_path, isolated_home):
    from localllm.models.store import Store

    TinyExport("llama", llama_config(vocab_size), tmp_path / "m.gguf")
    result = _invoke("create", "tiny-q8", "--from", str(tmp_path / "m.gguf"), "--format", "mlx", "--quantize", "q8")
    assert result.exit_code == 0
    stored = Store().resolve("tiny-q8")
    assert stored.details.format == "mlx" and stored.details.quantization_level == "Q8"
    assert json.loads((stored.weights / "config.json").read_text())["quantization"]["bits"] == 4  # Q4_0 q_proj kept


def test_create_refuses_unknown_format_and_mlx_quantize(vocab_size, tmp_path, isolated_home):
    from localllm.models.store import Store

    TinyExport("llama", llama_config(vocab_size), tmp_path / "m.gguf")
    bad_format = _invoke("create", "x", "--from", str(tmp_path / "m.gguf"), "--format", "onnx")
    assert bad_format.exit_code == 1 and "format 'onnx'" in bad_format.output
    bad_quant = _invoke("create", "x", "--from", str(tmp_path / "m.gguf"), "--format", "mlx", "--quantize", "q3")
    assert bad_quant.exit_code == 1 and "'q3'" in bad_quant.output and "Traceback" not in bad_quant.output
    assert not Store().root.exists() or not any(Store().root.rglob("sha256-*"))  # nothing copied in
