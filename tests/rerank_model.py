"""A tiny BERT cross-encoder that llama.cpp really loads and scores pairs with (rank pooling, a classifier head),
written with the `gguf` package: two layers, a WordPiece vocabulary of the letters and a few words, random F32
weights from a seeded generator. No real reranker ships offline; this one has the layout llama.cpp's bert loader
reads for one (src/models/bert.cpp: `cls` and `cls.output`), so the same file can be scored by llama-server too."""

from __future__ import annotations

import string
from pathlib import Path

import gguf
import numpy as np
from random_weights import weight_writers

N_EMBD = 64
N_FF = 128
N_LAYER = 2
N_HEAD = 4
N_CTX_TRAIN = 512
# BERT's special tokens at the ids llama.cpp's WordPiece vocabulary assumes ([UNK] 100, [CLS] 101, [SEP] 102).
PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103
WORDS = (
    "the a of and to in is it that for on with as was cat dog river invoice compiler violin glacier garden "
    "satellite bakery explains hides measures follows repairs describes morning light broken clock map report song "
    "what where who how why paris france capital city weather rain sun"
).split()


def vocabulary() -> list[str]:
    """[PAD], unused slots up to [UNK], the specials, then whole words, letters, digits and their continuations, in
    llama.cpp's phantom-space spelling of WordPiece (as its converter writes BERT vocabularies): a word that starts a
    word is "\u2581word", a continuation ("##s") is the bare piece."""
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(1, UNK)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    starts = list(WORDS) + [p for p in string.ascii_lowercase + string.digits + string.punctuation if p not in WORDS]
    return tokens + [f"\u2581{w}" for w in starts] + list(string.ascii_lowercase + string.digits)


def write_reranker(path: Path, *, seed: int = 0, n_ctx_train: int = N_CTX_TRAIN, template: str | None = None) -> Path:
    """The cross-encoder at `path`: [CLS] query [SEP] document [SEP] pairs, one relevance logit per pair; with
    `template`, pairs are laid out by that `rerank` template instead ({query} and {document} in it), as some
    rerankers' GGUFs carry one."""
    rng = np.random.default_rng(seed)
    tokens = vocabulary()
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name("tiny-reranker")
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_FF)
    writer.add_block_count(N_LAYER)
    writer.add_head_count(N_HEAD)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("[") else 1 for t in tokens])
    writer.add_token_type_count(2)
    writer.add_bos_token_id(CLS)
    writer.add_eos_token_id(SEP)  # the pair's separator and closer, as BERT cross-encoders end each segment
    writer.add_sep_token_id(SEP)
    writer.add_unk_token_id(UNK)
    writer.add_pad_token_id(PAD)
    writer.add_mask_token_id(MASK)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_add_sep_token(False)
    if template is not None:
        writer.add_string(gguf.Keys.Tokenizer.CHAT_TEMPLATE_N.format(name="rerank"), template)

    tensor, norm = weight_writers(writer, rng, N_EMBD)

    tensor("token_embd.weight", len(tokens), N_EMBD, scale=1.0)
    tensor("token_types.weight", 2, N_EMBD, scale=0.1)
    tensor("position_embd.weight", n_ctx_train, N_EMBD, scale=0.1)
    norm("token_embd_norm")
    for i in range(N_LAYER):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{part}.weight", N_EMBD, N_EMBD)
            tensor(f"blk.{i}.{part}.bias", N_EMBD, scale=0.02)
        norm(f"blk.{i}.attn_output_norm")
        tensor(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        tensor(f"blk.{i}.ffn_up.bias", N_FF, scale=0.02)
        tensor(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
        tensor(f"blk.{i}.ffn_down.bias", N_EMBD, scale=0.02)
        norm(f"blk.{i}.layer_output_norm")
    # The classifier head: a dense layer with tanh over the [CLS] row, then one output logit (n_cls_out = 1).
    tensor("cls.weight", N_EMBD, N_EMBD)
    tensor("cls.bias", N_EMBD, scale=0.02)
    tensor("cls.output.weight", 1, N_EMBD)
    tensor("cls.output.bias", 1, scale=0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
