"""What a loaded MLX model is (ModelMeta from config.json and the tokenizer), and how its vocabulary spells bytes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from ..base import ModelMeta

# ------------------------------------------------------------------------------------------------------- metadata


def read_meta(path: Path, model, tokenizer, config: dict) -> ModelMeta:
    from mlx_lm.utils import get_total_parameters

    hf = tokenizer._tokenizer
    bos = hf.bos_token_id
    probe = hf.backend_tokenizer.encode("a", add_special_tokens=True).ids
    n_params = get_total_parameters(model)
    return ModelMeta(
        architecture=str(config.get("model_type", "unknown")),
        n_vocab=int(model.args.vocab_size) if hasattr(model, "args") else hf.backend_tokenizer.get_vocab_size(),
        n_ctx_train=int(config.get("max_position_embeddings") or 0),
        n_embd=int(config.get("hidden_size") or 0),
        bos_token=bos,
        eos_token=_first_eos(config, hf),
        add_bos=bool(bos is not None and probe[:1] == [bos]),
        chat_template=_chat_template(hf),
        n_params=n_params,
        size_bytes=sum(f.stat().st_size for f in path.glob("*.safetensors")),
        description=f"{config.get('model_type', 'unknown')} {n_params / 1e6:.0f}M (MLX)",
    )


def _first_eos(config: dict, hf) -> int | None:
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        return int(eos[0]) if eos else hf.eos_token_id
    return int(eos) if eos is not None else hf.eos_token_id


def _chat_template(hf) -> str | None:
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one is what a chat uses
        template = template.get("default") or next(iter(template.values()), None)
    return template or None


# ------------------------------------------------------------------------------------------------------- token bytes


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable stand-in character of each byte → the byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def make_piece_decoder(backend) -> Callable[[str], bytes]:
    """How a vocabulary entry spells its bytes, from the tokenizer's decoder: byte-level BPE or sentencepiece."""
    spec = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    kinds = {d.get("type") for d in spec.get("decoders", [spec])}
    if "ByteLevel" in kinds:
        table = _byte_decoder()
        return lambda piece: bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
    if "ByteFallback" in kinds or "Metaspace" in kinds:

        def spm_piece(piece: str) -> bytes:
            byte = _BYTE_TOKEN.match(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()

        return spm_piece
    return lambda piece: backend.decode([backend.token_to_id(piece)], skip_special_tokens=False).encode()
