"""The quality report of a quantization: the quantized model against its source on the same fixed text.

Both models read the built-in text (quality_text.py) in chunks of CHUNK tokens, each chunk in a fresh context, and
give next-token logits at every position. From them:

    top-1 agreement   share of positions where both models' likeliest next token is the same
    mean KL           mean over positions of KL(P_source || P_quantized), in nats (llama-perplexity's --kl-divergence)
    perplexity        exp(mean negative log-likelihood of the text's actual next token), of each model

Decode speed is tokens per second generating one sequence greedily, each model measured in this same process and run,
so the two figures compare; they are not benchmarks. This runs in the quantize worker process (quantize.py)
and drives llama.cpp directly, like the quantizer itself: the engine is not needed to read logits."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import api
from ..errors import ModelFormatError
from .quality_text import TEXT, TEXT_ID

CHUNK = 256  # tokens per context; bounds the logits buffer to CHUNK x n_vocab floats per model
ROWS = 32  # positions compared at once (ROWS x n_vocab float64s)
DECODE_PROMPT = 16
DECODE_TOKENS = 32


class _Reader:
    """One model in one context of CHUNK tokens, with every position's logits kept."""

    def __init__(self, path: Path, threads: int):
        import llama_cpp

        self.ll = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 999  # a GPU build measures on the GPU, as the model will run
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ModelFormatError(f"llama.cpp could not load {path} to measure its quality")
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = ctx_params.n_batch = ctx_params.n_ubatch = CHUNK
        ctx_params.n_seq_max = 1
        if threads > 0:
            ctx_params.n_threads = ctx_params.n_threads_batch = threads
        ctx_params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise ModelFormatError(f"llama.cpp could not create a context to measure {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.batch = llama_cpp.llama_batch_init(CHUNK, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        buf = (self.ll.llama_token * (len(data) + 16))()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, False)
        return list(buf[: max(n, 0)])

    def read(self, tokens: list[int], *, all_logits: bool = True) -> np.ndarray:
        """Decode `tokens` from position 0 of an empty context; the logits of every position (a view, valid until
        the next decode), or of the last one."""
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        self._decode(tokens, 0, all_logits)
        rows = len(tokens) if all_logits else 1
        pointer = self.ll.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(pointer, shape=(rows, self.n_vocab))

    def _decode(self, tokens: list[int], start: int, all_logits: bool) -> None:
        batch = self.batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits or i == len(tokens) - 1
        if self.ll.llama_decode(self.ctx, batch) != 0:
            raise ModelFormatError("llama_decode failed while measuring quality")

    def decode_speed(self, prompt: list[int]) -> float:
        """Tokens per second generating DECODE_TOKENS greedily after `prompt`, one token per decode."""
        logits = self.read(prompt, all_logits=False)
        token, position = int(np.argmax(logits[-1])), len(prompt)
        start = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            self._decode([token], position, False)
            position += 1
            token = int(
                np.argmax(np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(1, self.n_vocab))[0])
            )
        return DECODE_TOKENS / max(time.perf_counter() - start, 1e-9)

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


class _Tally:
    def __init__(self):
        self.positions = self.agree = 0
        self.kl = self.nll_source = self.nll_quantized = 0.0
        self.scored = 0  # positions whose next token is known (for perplexity)

    def add(self, source: np.ndarray, quantized: np.ndarray, following: np.ndarray) -> None:
        """One block of rows; `following` holds each row's actual next token, or -1 past the chunk's end."""
        ls, lq = _log_softmax(source), _log_softmax(quantized)
        self.kl += float((np.exp(ls) * (ls - lq)).sum())
        self.agree += int((source.argmax(axis=1) == quantized.argmax(axis=1)).sum())
        self.positions += len(source)
        known = following >= 0
        rows = np.nonzero(known)[0]
        self.nll_source -= float(ls[rows, following[known]].sum())
        self.nll_quantized -= float(lq[rows, following[known]].sum())
        self.scored += len(rows)


def measure_quality(
    source: Path, quantized: Path, *, qtype: str, label: str, threads: int, tokens: int, emit: Callable[[dict], None]
) -> api.QuantizationReport:
    """Compare `quantized` with `source` on the first `tokens` tokens of the built-in text (both models loaded
    here; each chunk read by one, then the other)."""
    emit({"status": "measuring quality against the source (fixed text)"})
    first, second = _Reader(source, threads), _Reader(quantized, threads)
    try:
        text_tokens = first.tokenize(TEXT)[: max(tokens, 2)]
        tally = _Tally()
        for start in range(0, len(text_tokens) - 1, CHUNK):
            chunk = text_tokens[start : start + CHUNK]
            a, b = first.read(chunk), second.read(chunk)  # two contexts, two logits buffers
            following = np.array(chunk[1:] + [-1], dtype=np.int64)
            for row in range(0, len(chunk), ROWS):
                tally.add(a[row : row + ROWS], b[row : row + ROWS], following[row : row + ROWS])
        emit({"status": "measuring decode speed of both models"})
        speeds = (first.decode_speed(text_tokens[:DECODE_PROMPT]), second.decode_speed(text_tokens[:DECODE_PROMPT]))
    finally:
        first.close()
        second.close()
    from .gguf import split_parts

    size_source = sum(part.stat().st_size for part in split_parts(source))
    size_quantized = quantized.stat().st_size
    return api.QuantizationReport(
        quantize=qtype,
        source=label,
        text=TEXT_ID,
        tokens=tally.positions,
        top1_agreement=tally.agree / max(tally.positions, 1),
        mean_kl=tally.kl / max(tally.positions, 1),
        perplexity_source=float(np.exp(tally.nll_source / max(tally.scored, 1))),
        perplexity_quantized=float(np.exp(tally.nll_quantized / max(tally.scored, 1))),
        size_source=size_source,
        size_quantized=size_quantized,
        size_ratio=size_quantized / max(size_source, 1),
        decode_tps_source=speeds[0],
        decode_tps_quantized=speeds[1],
    )


def describe_report(report: api.QuantizationReport) -> list[str]:
    """The report as lines for a terminal or a progress stream."""
    return [
        f"quality of {report.quantize} against {report.source} ({report.tokens} tokens of {report.text}):",
        f"  top-1 agreement {report.top1_agreement:.1%}, mean KL divergence {report.mean_kl:.4f} nats",
        f"  perplexity {report.perplexity_source:.3f} -> {report.perplexity_quantized:.3f}",
        f"  size {report.size_source / 1e6:.1f} MB -> {report.size_quantized / 1e6:.1f} MB ({report.size_ratio:.2f}x)",
        f"  decode {report.decode_tps_source:.1f} -> {report.decode_tps_quantized:.1f} tokens/s",
    ]
