"""The engine on the real MLX backend, on smollm2 converted to an MLX folder: the checks of batched decoding, the
prefix cache's tiers and speculation on MLX (tests/test_engine.py runs its cancel and prefix-reuse checks on both
backends). The reference is MLX itself: each prompt decoded alone in a one-slot engine, so four busy slots (one
batched forward pass per step) must give every request the tokens it gets alone."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from localllm.api import LoadOptions, SamplingOptions  # noqa: E402
from localllm.backends.mlx import MlxBackend  # noqa: E402
from localllm.engine.runner import GenerationParams, ModelEngine  # noqa: E402

pytestmark = [pytest.mark.mlx, pytest.mark.models]

N_CTX = 512
N_TOKENS = 16
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at a temperature of",
    "My favourite book is",
    "The quick brown fox",
    "In the year 2050, cities will",
]
# Never ending early keeps every request in every step, so the batches hold all four slots throughout.
GREEDY = SamplingOptions(temperature=0, num_predict=N_TOKENS, spec_type="none", ignore_eos=True)


def _load(folder: Path, slots: int) -> ModelEngine:
    return ModelEngine(MlxBackend().load(folder, LoadOptions(num_ctx=N_CTX, num_parallel=slots)), max_queue=8)


def _tokens(stream) -> tuple[list[int], object]:
    tokens, last = [], None
    for chunk in stream:
        tokens.extend(chunk.tokens)
        last = chunk
    return tokens, last


def _run_all(engine: ModelEngine, prompts: list[str], options=GREEDY) -> dict[str, list[int]]:
    streams = dict(zip(prompts, engine.submit_all([GenerationParams(engine.tokenize(p), options) for p in prompts])))
    results: dict[str, list[int]] = {}

    def drain(p):
        results[p] = _tokens(streams[p])[0]

    threads = [threading.Thread(target=drain, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


@pytest.fixture(scope="module")
def alone(smollm2_mlx) -> dict[str, list[int]]:
    """Each prompt's greedy tokens decoded by itself, in a one-slot engine."""
    engine = _load(smollm2_mlx, 1)
    try:
        return {p: _tokens(engine.submit(GenerationParams(engine.tokenize(p), GREEDY)))[0] for p in PROMPTS}
    finally:
        engine.close()


@pytest.fixture
def engine4(smollm2_mlx):
    engine = _load(smollm2_mlx, 4)
    yield engine
    engine.close()


def test_four_busy_slots_give_each_request_its_tokens_alone(engine4, alone):
    assert len({tuple(t) for t in alone.values()}) == len(PROMPTS)  # the answers really differ
    results = _run_all(engine4, PROMPTS[:4])
    for prompt in PROMPTS[:4]:
        assert results[prompt] == alone[prompt], prompt


@pytest.mark.slow
def test_eight_requests_on_four_slots_all_complete(engine4, alone):
    results = _run_all(engine4, PROMPTS)
    assert sorted(results) == sorted(PROMPTS)
    for prompt in PROMPTS:
        assert results[prompt] == alone[prompt], prompt
    assert engine4.snapshot().slots_busy == 0


# ------------------------------------------------------------------------------------------------------- prefix cache

NAVIGATOR = "You are a ship's navigator in the year 1790. You log winds, currents and stars in careful detail. "
SHORT = SamplingOptions(temperature=0, num_predict=8, spec_type="none")


def _cached_engine(folder: Path) -> ModelEngine:
    from localllm.engine.prefix_cache import make_prefix_cache

    model = MlxBackend().load(folder, LoadOptions(num_ctx=N_CTX, num_parallel=1))
    return ModelEngine(model, max_queue=8, prefix_cache=make_prefix_cache(model, "sha256-test"))


def _ask(engine: ModelEngine, prompt: list[int]) -> tuple[list[int], object]:
    tokens, last = [], None
    for chunk in engine.submit(GenerationParams(prompt, SHORT)):
        tokens.extend(chunk.tokens)
        last = chunk
    return tokens, last.timings


def _conversation(engine: ModelEngine) -> tuple[list[int], list[int], object]:
    """X's first turn, Y's first turn (which takes X's only slot), X's second turn: (X's first prompt and answer,
    X's second answer, its timings)."""
    x1 = engine.tokenize(f"{NAVIGATOR}\nUser: Say something about your work.\nAssistant:")
    x_answer, _ = _ask(engine, x1)
    _ask(engine, engine.tokenize("Bake bread in Lyon and explain each step.\nUser: Hi.\nAssistant:"))
    more = engine.tokenize("\nUser: And what else?\nAssistant:", add_special=False)
    answer, timings = _ask(engine, x1 + x_answer + more)
    return x1 + x_answer, answer, timings


def test_an_evicted_conversation_comes_back_from_ram_with_the_same_answer(smollm2_mlx, monkeypatch):
    monkeypatch.setenv("LOCALLLM_CACHE_DISK", "0")
    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "0")
    engine = _cached_engine(smollm2_mlx)
    try:
        _, reference, cold = _conversation(engine)
    finally:
        engine.close()
    assert cold.prompt_cache_count <= 1  # no cache beyond the one slot: the history is prefilled again

    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "256MiB")
    engine = _cached_engine(smollm2_mlx)
    try:
        history, answer, warm = _conversation(engine)
        stats = engine.snapshot()
    finally:
        engine.close()
    assert warm.prompt_cache_count >= len(history) - 1
    assert stats.prefix_hits["ram"] == 1 and 0 < stats.cache_ram_bytes <= stats.cache_ram_limit
    assert answer == reference


def test_a_prefix_survives_a_restart_on_disk(smollm2_mlx, monkeypatch):
    from localllm import config

    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "0")
    monkeypatch.setenv("LOCALLLM_CACHE_DISK", "1GiB")
    engine = _cached_engine(smollm2_mlx)
    try:
        prompt = engine.tokenize(f"{NAVIGATOR}\nUser: Say something about your work.\nAssistant:")
        first, _ = _ask(engine, prompt)
    finally:
        engine.close()  # the slot's prefix goes to disk with the unload
    assert len(list(config.prefix_cache_dir().rglob("*.kv"))) == 1
    engine = _cached_engine(smollm2_mlx)  # a new engine on the same home: a restarted server
    try:
        again, timings = _ask(engine, prompt)
        assert engine.snapshot().prefix_hits["disk"] == 1
    finally:
        engine.close()
    assert timings.prompt_cache_count >= len(prompt) - 1 and again == first


# ------------------------------------------------------------------------------------------------------- speculation

REPEAT_PROMPT = "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 2\n\ndef f(x):\n    return x + 1\n\ndef"
SPEC_PROMPTS = [REPEAT_PROMPT, "The alphabet: a b c d e f g h i j k l m n o p q r s t u v w x y z. Again: a b c d"]


@pytest.fixture(scope="module")
def spec_engines(smollm2_mlx):
    """Two slots each: n-gram drafting, and the model drafting for itself (a second MLX load as the draft model).
    A fixed window drafts every step it can, so the plumbing is exercised whatever the machine's load."""
    from localllm.engine.speculative.policy import FixedWindow
    from localllm.engine.speculative.speculation import Speculation, open_draft_model

    engines = {}
    for spec_type in ("ngram", "draft"):
        model = MlxBackend().load(smollm2_mlx, LoadOptions(num_ctx=N_CTX, num_parallel=2))
        draft = None
        if spec_type == "draft":
            draft = open_draft_model(smollm2_mlx, LoadOptions(num_ctx=N_CTX), model, name="itself")
        speculation = Speculation(model, draft=draft, window=FixedWindow)
        engines[spec_type] = ModelEngine(model, max_queue=8, speculation=speculation)
    yield engines
    for engine in engines.values():
        engine.close()


def _spec_run(engine: ModelEngine, spec_type: str) -> list[tuple[list[int], object]]:
    options = SamplingOptions(temperature=0, num_predict=24, spec_type=spec_type, spec_max_draft=6)
    streams = engine.submit_all([GenerationParams(engine.tokenize(p), options) for p in SPEC_PROMPTS])
    return [_tokens(stream) for stream in streams]


@pytest.mark.parametrize("spec_type", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_speculation_is_lossless_with_two_busy_slots(spec_engines, spec_type):
    engine = spec_engines[spec_type]
    _spec_run(engine, "none")  # warms each slot's prefix, so both compared runs start from the same cache state
    plain = _spec_run(engine, "none")
    fast = _spec_run(engine, spec_type)
    assert [tokens for tokens, _ in fast] == [tokens for tokens, _ in plain]
    assert sum(last.timings.draft_count for _, last in fast) > 0, "nothing was drafted: the test proves nothing"
    if spec_type == "draft":  # the model drafting for itself: every draft is what it would have picked
        assert all(last.timings.draft_accepted == last.timings.draft_count for _, last in fast)
