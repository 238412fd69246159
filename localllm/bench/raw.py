"""The reference: llama.cpp's decode loop through llama-cpp-python's low-level API, with no scheduler and greedy
sampling, timed on the same clock as our runs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from contextlib import contextmanager
from pathlib import Path

import llama_cpp

from ..backends.llama_cpp.backend import init_backend
from ..models.plan import kv_cells


class RawLoop:
    """The reference: one llama_context, a greedy C sampler, llama_decode in a plain loop. Nothing of ours."""

    def __init__(
        self,
        path: Path,
        *,
        n_ctx: int,
        n_seq: int = 1,
        threads: int = 1,
        n_batch: int = 512,
        ignore_eos: bool = False,
        kv_cells: int | None = None,
    ):
        """`kv_cells`: the sequences share a unified pool of that many cells, as the backend does below every slot's
        whole context (None, or n_ctx per sequence: a stream of n_ctx each)."""
        init_backend()
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_seq_max = kv_cells or n_ctx * n_seq, n_seq
        cparams.kv_unified = kv_cells is not None and kv_cells < n_ctx * n_seq
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.batch = llama_cpp.llama_batch_init(max(n_batch, n_seq), 0, 1)
        self.n_batch = n_batch
        chain = llama_cpp.llama_sampler_chain_default_params()
        self.sampler = llama_cpp.llama_sampler_chain_init(chain)
        if ignore_eos:
            self._ban_eog()
        llama_cpp.llama_sampler_chain_add(self.sampler, llama_cpp.llama_sampler_init_greedy())

    def _ban_eog(self) -> None:
        n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        eog = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)]
        biases = (llama_cpp.llama_logit_bias * len(eog))()
        for i, tok in enumerate(eog):
            biases[i].token, biases[i].bias = llama_cpp.llama_token(tok), float("-inf")
        bias = llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(eog), biases)
        llama_cpp.llama_sampler_chain_add(self.sampler, bias)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 16))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, True)
        return list(buf[:n])

    def _decode(self, rows: Sequence[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        b.n_tokens = len(rows)
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        if llama_cpp.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("raw llama_decode failed")

    def prefill(self, prompt: Sequence[int], seq: int = 0) -> None:
        for start in range(0, len(prompt), self.n_batch):
            chunk = prompt[start : start + self.n_batch]
            self._decode([(t, start + i, seq, start + i == len(prompt) - 1) for i, t in enumerate(chunk)])

    def _sample(self, row: int) -> int | None:
        tok = llama_cpp.llama_sampler_sample(self.sampler, self.ctx, row)
        return None if llama_cpp.llama_vocab_is_eog(self.vocab, tok) else tok

    def generate(self, prompt: Sequence[int], n: int, *, on_token: Callable[[], None] | None = None) -> list[int]:
        """Greedy tokens for one sequence (stops at end-of-generation)."""
        return self.generate_batched([prompt], n, on_token=on_token)[0]

    def generate_batched(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        *,
        together: bool = False,
        on_token: Callable[[], None] | None = None,
    ) -> list[list[int]]:
        """Greedy tokens for several sequences decoded together: one token per live sequence per llama_decode.
        `together` prefills all prompts in one batch (as our scheduler does when they arrive at once) instead of one
        after another; llama.cpp's numerics depend on the batch's make-up for some models (gemma3).
        `on_token` is called after each sampling round (the benchmark's clock starts at the first)."""
        self.clear()
        outs: list[list[int]] = [[] for _ in prompts]
        nxt: dict[int, int] = {}
        for seq, tok in self._prefill_all(prompts, together):
            if tok is not None:
                outs[seq].append(tok)
                nxt[seq] = tok
        if on_token:
            on_token()
        positions = [len(p) for p in prompts]
        while True:
            live = [seq for seq in sorted(nxt) if len(outs[seq]) < n]
            if not live:
                return outs
            self._decode([(nxt[seq], positions[seq], seq, True) for seq in live])
            for row, seq in enumerate(live):
                positions[seq] += 1
                tok = self._sample(row)
                if tok is None:
                    del nxt[seq]
                else:
                    outs[seq].append(tok)
                    nxt[seq] = tok
            if on_token:
                on_token()

    def _prefill_all(self, prompts: Sequence[Sequence[int]], together: bool) -> Iterator[tuple[int, int | None]]:
        """Prefill every prompt and yield (seq, first token), sampled before the next decode overwrites logits."""
        if not together:
            for seq, prompt in enumerate(prompts):
                self.prefill(prompt, seq)
                yield seq, self._sample(-1)
            return
        rows = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
        if len(rows) > self.n_batch:
            raise ValueError(f"{len(rows)} prompt tokens do not fit one batch of {self.n_batch}")
        self._decode(rows)
        last_rows = [i for i, row in enumerate(rows) if row[3]]
        for seq, row in enumerate(last_rows):
            yield seq, self._sample(row)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        llama_cpp.llama_sampler_free(self.sampler)
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


class _Clock:
    def __init__(self) -> None:
        self.marks: list[float] = []

    def tick(self) -> None:
        self.marks.append(time.perf_counter())

    def rate(self, tokens: int) -> float:
        """Tokens per second after the first mark (so prefill is excluded)."""
        span = self.marks[-1] - self.marks[0] if len(self.marks) > 1 else 0.0
        return tokens / span if span > 0 else 0.0


def raw_decode_rate(path: Path, prompt: list[int], n: int, *, threads: int, n_ctx: int) -> tuple[float, list[int]]:
    loop = RawLoop(path, n_ctx=n_ctx, threads=threads, ignore_eos=True)
    try:
        clock = _Clock()
        out = loop.generate(prompt, n, on_token=clock.tick)
        return clock.rate(len(out) - 1), out
    finally:
        loop.close()


def raw_batched_rate(path: Path, prompts: list[list[int]], n: int, *, threads: int, n_ctx: int) -> float:
    # The same KV pool as our engine's slots draw from (the attention spans a shared pool's used cells).
    pool = kv_cells(n_ctx, len(prompts))
    loop = RawLoop(path, n_ctx=n_ctx, n_seq=len(prompts), threads=threads, ignore_eos=True, kv_cells=pool)
    try:
        clock = _Clock()
        outs = loop.generate_batched(prompts, n, on_token=clock.tick)
        return clock.rate(sum(len(o) - 1 for o in outs))
    finally:
        loop.close()


def raw_prefill_rate(path: Path, prompt: list[int], *, threads: int, n_ctx: int) -> float:
    loop = RawLoop(path, n_ctx=n_ctx, threads=threads)
    try:
        loop.prefill(prompt[:8])  # warm up the graph allocation
        loop.clear()
        t0 = time.perf_counter()
        loop.prefill(prompt)
        return len(prompt) / (time.perf_counter() - t0)
    finally:
        loop.close()


@contextmanager
def raw_process() -> Iterator[Executor]:
    """A process of its own for raw loops that are compared with an engine in this one. GNU OpenMP gives every
    thread that runs llama.cpp a team of its own, and once a process's teams hold more threads than it has CPUs, it
    cuts the spin at every barrier to a thousand turns for good: a raw loop run here would leave our engine's
    two-thread steps sleeping at barriers (docs/benchmark-notes.md, "Raw loops in a process of their own"). The
    server's process runs one team per loaded model, as this child does."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool
