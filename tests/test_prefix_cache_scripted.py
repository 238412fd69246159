"""The engine's prefix-cache path against a scripted backend behind the real LoadedModel Protocol: a toy model whose
next token depends on every token its sequence's cache holds, and whose decode refuses positions that do not follow
the cache, as llama.cpp does. So any disagreement between the scheduler's bookkeeping and the backend's cache (a
save of the wrong slot, a restore cut in the wrong place, a failed restore that leaves old cells) shows up as a wrong
answer or an error."""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence

import numpy as np

from localllm.api import SamplingOptions
from localllm.backends.base import Batch, CacheShape, ModelMeta
from localllm.engine.prefix_cache import PrefixCache, as_tokens, encode_state
from localllm.engine.runner import GenerationParams, ModelEngine
from localllm.errors import LocalLLMError

N_VOCAB = 64
GREEDY = SamplingOptions(temperature=0, num_predict=6, spec_type="none")


def next_token(history: Sequence[int]) -> int:
    """The toy model: a function of the whole history (never 0, its end-of-generation token)."""
    return 1 + sum((i + 1) * t for i, t in enumerate(history)) % (N_VOCAB - 1)


def reference(prompt: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(next_token(prompt + out))
    return out


class ToyModel:
    meta = ModelMeta(
        architecture="toy",
        n_vocab=N_VOCAB,
        n_ctx_train=4096,
        n_embd=4,
        bos_token=None,
        eos_token=0,
        add_bos=False,
        chat_template=None,
    )
    n_batch = 512
    kv_pad = 1
    weights = "toy"
    placement = None
    vision = embedder = reranker = mtp = grammars = threads = None  # the toy's one optional part is its states

    def __init__(self, n_seq: int, *, shape: CacheShape | None = None):
        self.n_seq, self.n_ctx = n_seq, 1024
        self.kv_cells = n_seq * self.n_ctx
        self.cells: list[list[int]] = [[] for _ in range(n_seq)]  # each sequence's cached tokens, position order
        self.rows: list[np.ndarray] = []
        self.shape = shape or CacheShape(fingerprint="toy")
        self.states = ToyStates(self.cells)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [1 + ord(c) % (N_VOCAB - 1) for c in text]

    def token_bytes(self, token: int) -> bytes:
        return bytes([97 + token % 26])

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode()

    def is_eog(self, token: int) -> bool:
        return token == 0

    def decode(self, batch: Batch) -> None:
        self.rows = []
        for tok, pos, seq, _want in zip(batch.tokens, batch.positions, batch.seqs, batch.logits):
            if pos != len(self.cells[seq]):
                raise LocalLLMError(f"position {pos} does not follow sequence {seq}'s {len(self.cells[seq])} cells")
            self.cells[seq].append(tok)
            logits = np.zeros(N_VOCAB, dtype=np.float32)
            logits[next_token(self.cells[seq])] = 1.0
            self.rows.append(logits)

    def logits(self, row: int) -> np.ndarray:
        return self.rows[row]

    def step_clock(self) -> float:
        return time.thread_time()

    def make_sampler(self, options: SamplingOptions, *, grammar: str | None = None, triggers: object = None):
        model = self

        class Greedy:
            def sample(self, row: int) -> int:
                return int(np.argmax(model.rows[row]))

            def accept(self, token: int) -> None:
                pass

            def close(self) -> None:
                pass

        return Greedy()

    def remove(self, seq: int, start: int, end: int = -1) -> None:
        assert end == -1
        del self.cells[seq][max(0, start) :]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.cells[dst] = self.cells[src][:n]

    def cache_shape(self) -> CacheShape:
        return self.shape

    def close(self) -> None:
        pass


class ToyStates:
    """The toy's SequenceStates part: a sequence's cells, pickled."""

    def __init__(self, cells: list[list[int]]):
        self.cells = cells
        self.fail_restore = False

    def save_seq(self, seq: int) -> bytes | None:
        return pickle.dumps(self.cells[seq]) + bytes(1000)  # padded: a state has a size to budget

    def restore_seq(self, seq: int, data: bytes, n_tokens: int) -> None:
        if self.fail_restore:
            self.cells[seq] = []
            raise LocalLLMError("the toy refuses this state")
        self.cells[seq] = pickle.loads(data)


def _engine(model: ToyModel, *, ram: int = 10**7) -> ModelEngine:
    return ModelEngine(model, max_queue=8, prefix_cache=PrefixCache(model.cache_shape(), ram_limit=ram))


def _ask(engine: ModelEngine, prompt: list[int]):
    tokens, last = [], None
    for chunk in engine.submit(GenerationParams(prompt, GREEDY)):
        tokens.extend(chunk.tokens)
        last = chunk
    return tokens, last.timings


def _prompt(seed: int, n: int = 120) -> list[int]:
    return [1 + (seed * 7 + i * 3) % (N_VOCAB - 1) for i in range(n)]


def test_conversations_outnumbering_the_slots_come_back_from_ram_exactly():
    model = ToyModel(n_seq=2)
    engine = _engine(model)
    try:
        histories = {seed: _prompt(seed) for seed in range(5)}
        for turn in range(3):
            for seed in range(5):
                prompt = histories[seed] + [5, 6, 7]
                answer, timings = _ask(engine, prompt)
                assert answer == reference(prompt, 6)
                if turn:  # everything but the last answer token (never decoded) came back
                    assert timings.prompt_cache_count == len(histories[seed]) - 1
                histories[seed] = prompt + answer
        stats = engine.snapshot()
    finally:
        engine.close()
    assert stats.prefix_hits["ram"] == 10 and stats.cache_ram_bytes <= stats.cache_ram_limit


def test_a_failed_restore_answers_from_a_full_prefill():
    model = ToyModel(n_seq=1)
    engine = _engine(model)
    try:
        x = _prompt(1)
        x_answer, _ = _ask(engine, x)
        _ask(engine, _prompt(2))
        model.states.fail_restore = True
        again = x + x_answer + [9, 9]
        answer, timings = _ask(engine, again)
    finally:
        engine.close()
    assert answer == reference(again, 6) and timings.prompt_cache_count == 0


def test_a_ram_budget_too_small_for_two_states_still_answers_exactly():
    model = ToyModel(n_seq=1)
    size = len(model.states.save_seq(0)) + 4 * 130  # about one saved conversation
    engine = _engine(model, ram=size + 600)
    try:
        prompts = [_prompt(seed) for seed in range(4)]
        answers = [_ask(engine, p)[0] for p in prompts]
        for p, a in zip(prompts, answers):
            follow = p + a + [3]
            assert _ask(engine, follow)[0] == reference(follow, 6)
        stats = engine.snapshot()
    finally:
        engine.close()
    assert stats.cache_ram_bytes <= stats.cache_ram_limit


def test_a_restored_window_state_is_never_cut_below_its_floor():
    # A sliding-window model: a restored state of more than `window` tokens continues only from its end.
    model = ToyModel(n_seq=1, shape=CacheShape(window=32, fingerprint="toy"))
    engine = _engine(model)
    try:
        x = _prompt(1)
        x_answer, _ = _ask(engine, x)
        _ask(engine, _prompt(2))
        _, back = _ask(engine, x + x_answer + [4])
        assert back.prompt_cache_count == len(x) + len(x_answer) - 1
        early = x[:80] + [11, 12]  # shares 80 tokens with the restored slot: below its floor
        answer, timings = _ask(engine, early)
    finally:
        engine.close()
    assert timings.prompt_cache_count == 0 and answer == reference(early, 6)


def _signed_state(tokens: list[int], cells: list[int]) -> bytes:
    """A prompt-cache file this machine signed, for `tokens`, whose state holds `cells` (the toy's format)."""
    data = pickle.dumps(cells) + bytes(1000)
    return b"".join(encode_state("", "toy", as_tokens(tokens), 0, data))


def test_a_state_that_claims_more_tokens_than_it_holds_is_dropped_and_the_prompt_prefilled():
    # The toy's restore trusts the token count (llama.cpp's is checked in the backend): the first decode after it
    # fails, which must cost the entry, never the request.
    model = ToyModel(n_seq=1)
    engine = _engine(model)
    try:
        x = _prompt(1)
        assert engine.import_prefix(_signed_state(x, x[:60])) == len(x)
        first = x + [5, 6, 7]
        answer, timings = _ask(engine, first)
        assert answer == reference(first, 6) and timings.prompt_cache_count == 0
        assert engine.prefix_cache.entries == []
        _ask(engine, _prompt(2))  # takes the slot: the conversation can come back only from the cache
        again = first + answer + [8]
        assert _ask(engine, again)[0] == reference(again, 6)
    finally:
        engine.close()


def test_an_imported_state_serves_its_own_conversation_only():
    model = ToyModel(n_seq=1)
    engine = _engine(model)
    try:
        x = _prompt(1)
        engine.import_prefix(_signed_state(x, x))
        fresh = x[:80] + [11, 12]  # another conversation sharing a prefix with it
        answer, timings = _ask(engine, fresh)
        assert timings.prompt_cache_count == 0 and answer == reference(fresh, 6)
        own = x + [5, 6]
        answer, timings = _ask(engine, own)
        assert timings.prompt_cache_count == len(x) and answer == reference(own, 6)
    finally:
        engine.close()
