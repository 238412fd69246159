"""A tiny llama model that llama.cpp really loads and runs (one layer, 320 tokens, random F32 weights), written with
the `gguf` package; its hyperparameters and tensor types can be changed to make the files llama.cpp aborts on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

HPARAMS: dict[str, Any] = {
    "context_length": 512,
    "embedding_length": 64,
    "feed_forward_length": 128,
    "block_count": 1,
    "head_count": 4,
    "head_count_kv": 2,
    "layer_norm_rms_eps": 1e-5,
    "rope_freq_base": 10000.0,
    "rope_dimension_count": 16,
}


def write_tiny_llama(
    path: Path,
    *,
    hparams: dict[str, Any] | None = None,
    raw: dict[str, Any] | None = None,
    half: tuple[str, ...] = (),
    byte_tokens: bool = True,
    seed: int = 0,
    added: tuple[str, ...] = (),
    writes_bytes: bool = True,
) -> Path:
    """`hparams` override HPARAMS (by GGUFWriter.add_<name>); `raw` adds keys as they are (e.g. a string where a
    number belongs); tensors named in `half` are stored as F16. Without `byte_tokens` the vocabulary lacks the
    <0xNN> tokens a SentencePiece vocabulary falls back to, and llama.cpp aborts tokenizing any unknown text.
    `added` are tokens matched whole before the rest is tokenized (a vision model's image markers, as SmolVLM's).
    Without `writes_bytes` the byte tokens' logits are 0, below the words', so greedy text is whole words."""
    rng = np.random.default_rng(seed)
    n_embd = 64
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in {**HPARAMS, **(hparams or {})}.items():
        getattr(writer, f"add_{name}")(value)
    for key, value in (raw or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tokenizer_model("llama")
    pieces = [f"<0x{byte:02X}>" for byte in range(256)] if byte_tokens else []
    words = [f"\u2581w{i}" for i in range(320 - 3 - len(pieces) - len(added))]
    n_vocab = 3 + len(pieces) + len(words) + len(added)
    writer.add_token_list(["<unk>", "<s>", "</s>"] + pieces + words + list(added))
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_token_types([2, 3, 3] + [6] * len(pieces) + [1] * len(words) + [4] * len(added))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, data: np.ndarray) -> None:
        writer.add_tensor(name, data.astype(np.float16 if name in half else np.float32))

    def tensor(name: str, *shape: int, scale: float = 0.2) -> None:
        add(name, rng.standard_normal(shape) * scale)

    tensor("token_embd.weight", n_vocab, n_embd, scale=1.0)
    output = rng.standard_normal((n_vocab, n_embd)) * 0.5
    if not writes_bytes:
        output[3 : 3 + len(pieces)] = 0.0
    add("output.weight", output)
    add("output_norm.weight", np.ones(n_embd))
    add("blk.0.attn_norm.weight", np.ones(n_embd))
    add("blk.0.ffn_norm.weight", np.ones(n_embd))
    for part, shape in (
        ("attn_q", (64, n_embd)),
        ("attn_k", (32, n_embd)),
        ("attn_v", (32, n_embd)),
        ("attn_output", (n_embd, 64)),
        ("ffn_gate", (128, n_embd)),
        ("ffn_up", (128, n_embd)),
        ("ffn_down", (n_embd, 128)),
    ):
        tensor(f"blk.0.{part}.weight", *shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
