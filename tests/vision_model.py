"""Tiny vision projectors that llama.cpp's mtmd really loads, over smollm2:135m's 576-wide embeddings, written with
the `gguf` package with random F32 weights from a seeded generator. No real vision model ships offline; these have the
tensor names and `clip.vision.*` keys tools/mtmd/clip.cpp reads, so llama-mtmd-cli can run the same files:

    mlp        LLaVA-1.5's layout (a CLIP encoder, a two-layer MLP): a fixed-size image, no wrapper tokens
    idefics3   SmolVLM's (a SigLIP encoder, a pixel shuffle, one linear projection): mtmd wraps its images in
               special tokens (<global-img>, ...) that SmolVLM's vocabulary has and smollm2's lacks"""

from __future__ import annotations

import io
from pathlib import Path

import gguf
import numpy as np
from random_weights import weight_writers

TEXT_EMBD = 576  # smollm2:135m's n_embd: the projector's output width must match the text model's
IMAGE_SIZE = 32
PATCH_SIZE = 16
N_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2
SCALE_FACTOR = 2  # idefics3's pixel shuffle merges 2x2 patches into one image token
N_IMAGE_TOKENS = N_PATCHES // SCALE_FACTOR**2
N_EMBD = 32
N_FF = 64
N_LAYER = 2
N_HEAD = 4


MLP_HIDDEN = 64


def write_projector(path: Path, *, seed: int = 0, text_embd: int = TEXT_EMBD, kind: str = "mlp") -> Path:
    """The projector at `path`; `text_embd` is the width of the embeddings it hands the text model."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name(f"tiny-{kind}-projector")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", kind)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    if kind == "idefics3":
        writer.add_uint32("clip.vision.preproc_image_size", IMAGE_SIZE)
        writer.add_uint32("clip.vision.projector.scale_factor", SCALE_FACTOR)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", N_EMBD)
    writer.add_uint32("clip.vision.feed_forward_length", N_FF)
    writer.add_uint32("clip.vision.block_count", N_LAYER)
    writer.add_uint32("clip.vision.attention.head_count", N_HEAD)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_uint32("clip.vision.projection_dim", text_embd)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    tensor, norm = weight_writers(writer, rng, N_EMBD)

    # numpy shapes are ggml's ne reversed: the patch convolution is ne [16, 16, 3, n_embd].
    tensor("v.patch_embd.weight", N_EMBD, 3, PATCH_SIZE, PATCH_SIZE, scale=1 / np.sqrt(3 * PATCH_SIZE**2))
    tensor("v.patch_embd.bias", N_EMBD, scale=0.02)
    tensor("v.position_embd.weight", N_PATCHES, N_EMBD, scale=0.1)
    for i in range(N_LAYER):
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensor(f"v.blk.{i}.{part}.weight", N_EMBD, N_EMBD)
            tensor(f"v.blk.{i}.{part}.bias", N_EMBD, scale=0.02)
        norm(f"v.blk.{i}.ln1")
        norm(f"v.blk.{i}.ln2")
        tensor(f"v.blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        tensor(f"v.blk.{i}.ffn_up.bias", N_FF, scale=0.02)
        tensor(f"v.blk.{i}.ffn_down.weight", N_EMBD, N_FF)
        tensor(f"v.blk.{i}.ffn_down.bias", N_EMBD, scale=0.02)
    if kind == "idefics3":
        norm("v.post_ln")
        tensor("mm.model.fc.weight", text_embd, N_EMBD * SCALE_FACTOR**2)
    else:
        norm("v.pre_ln")
        tensor("mm.0.weight", MLP_HIDDEN, N_EMBD)
        tensor("mm.0.bias", MLP_HIDDEN, scale=0.02)
        tensor("mm.2.weight", text_embd, MLP_HIDDEN)
        tensor("mm.2.bias", text_embd, scale=0.02)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def png(seed: int = 0, size: int = IMAGE_SIZE) -> bytes:
    """A PNG of random pixels (random weights see noise anyway); another seed, another image."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3)).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()
