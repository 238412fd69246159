"""The engine on the real llama.cpp backend and the real catalog models, checked against the raw llama.cpp loop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from localllm.api import LoadOptions, SamplingOptions
from localllm.backends.llama_cpp.backend import LlamaCppBackend
from localllm.bench.raw import RawLoop
from localllm.engine.runner import GenerationParams, ModelEngine
from localllm.errors import ContextOverflow, InvalidInput, QueueFull
from localllm.models.plan import kv_cells

pytestmark = pytest.mark.models

N_CTX = 1024
N_TOKENS = 24
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
GREEDY = SamplingOptions(temperature=0, num_predict=N_TOKENS, spec_type="none")
# Batched runs never end early, so every step has the same make-up in our engine and in the raw loop.
GREEDY_NO_EOS = GREEDY.model_copy(update={"ignore_eos": True})


def _load(path, slots: int) -> ModelEngine:
    opts = LoadOptions(num_thread=1, num_ctx=N_CTX, num_parallel=slots)
    return ModelEngine(LlamaCppBackend().load(path, opts), max_queue=8)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model_path(request):
    return request.getfixturevalue(f"{request.param}_path")


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy tokens of the raw llama.cpp loop for every prompt."""
    loop = RawLoop(model_path, n_ctx=N_CTX, threads=1)
    try:
        return {p: loop.generate(loop.tokenize(p), N_TOKENS) for p in PROMPTS}
    finally:
        loop.close()


@pytest.fixture(scope="module")
def batched_reference(model_path):
    """The raw loop decoding four prompts in one batch, as the scheduler does when they arrive together: llama.cpp's
    numerics depend on the batch's make-up for some models (gemma3's greedy tokens differ batched vs alone, in
    llama.cpp itself), so the multi-slot reference must be batched the same way."""
    loop = RawLoop(model_path, n_ctx=N_CTX, n_seq=4, threads=1, ignore_eos=True, kv_cells=kv_cells(N_CTX, 4))
    try:
        out = {}
        for group in (PROMPTS[:4], PROMPTS[4:]):
            tokens = loop.generate_batched([loop.tokenize(p) for p in group], N_TOKENS, together=True)
            out.update(zip(group, tokens))
        return out
    finally:
        loop.close()


@pytest.fixture(scope="module")
def engine4(model_path):
    engine = _load(model_path, 4)
    yield engine
    engine.close()


def _tokens(stream) -> tuple[list[int], object]:
    tokens, last = [], None
    for chunk in stream:
        tokens.extend(chunk.tokens)
        last = chunk
    return tokens, last


def _run_all(engine: ModelEngine, prompts: list[str], options=GREEDY) -> dict[str, list[int]]:
    # Submitted together, so they start in the same step as the raw loop's batch (the make-up matters for gemma3).
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


def test_single_stream_equals_raw_loop(engine4, reference):
    prompt = PROMPTS[0]
    tokens, last = _tokens(engine4.submit(GenerationParams(engine4.tokenize(prompt), GREEDY)))
    assert tokens == reference[prompt]
    assert last.done and last.done_reason in ("length", "stop")
    assert last.timings.eval_count == len(tokens)


@pytest.fixture
def fresh_engine4(model_path):
    """Empty caches: a reused prefix changes the batch's make-up, which changes gemma3's numerics (see above)."""
    engine = _load(model_path, 4)
    yield engine
    engine.close()


def test_four_busy_slots_equal_raw_loop(fresh_engine4, batched_reference):
    results = _run_all(fresh_engine4, PROMPTS[:4], GREEDY_NO_EOS)
    for prompt in PROMPTS[:4]:
        assert results[prompt] == batched_reference[prompt], prompt


def test_eight_requests_on_four_slots_all_complete(fresh_engine4, batched_reference, reference, model_path):
    results = _run_all(fresh_engine4, PROMPTS, GREEDY_NO_EOS)
    assert sorted(results) == sorted(PROMPTS)
    assert all(len(tokens) == N_TOKENS for tokens in results.values())
    # The first four share every step, exactly as in the batched reference.
    for prompt in PROMPTS[:4]:
        assert results[prompt] == batched_reference[prompt], prompt
    # The last four start in slots whose caches share the BOS token with them, a batch make-up the raw loop does not
    # reproduce; a model that adds no BOS (smollm2) shares nothing, so it must still equal the single-stream loop.
    if not fresh_engine4.model.meta.add_bos:
        for prompt in PROMPTS[4:]:
            assert results[prompt][: len(reference[prompt])] == reference[prompt], prompt
    assert fresh_engine4.snapshot().slots_busy == 0


@dataclass
class Backend:
    """One backend's way to load smollm2 in an engine, and the answer a prompt gets alone (the reference)."""

    load: Callable[[int], ModelEngine]
    alone: Callable[[list[int]], list[int]]


@pytest.fixture(params=["llama.cpp", pytest.param("mlx", marks=pytest.mark.mlx)])
def smollm2_on(request, smollm2_path) -> Backend:
    """smollm2 on each backend: llama.cpp's answers checked against the raw loop, MLX's against a one-slot engine."""
    if request.param == "llama.cpp":
        return Backend(lambda slots: _load(smollm2_path, slots), lambda prompt: _raw_alone(smollm2_path, prompt))
    folder = request.getfixturevalue("smollm2_mlx")
    from localllm.backends.mlx import MlxBackend

    def load(slots: int) -> ModelEngine:
        return ModelEngine(MlxBackend().load(folder, LoadOptions(num_ctx=N_CTX, num_parallel=slots)), max_queue=8)

    def alone(prompt: list[int]) -> list[int]:
        engine = load(1)
        try:
            return _tokens(engine.submit(GenerationParams(prompt, GREEDY)))[0]
        finally:
            engine.close()

    return Backend(load, alone)


def _raw_alone(path, prompt: list[int]) -> list[int]:
    loop = RawLoop(path, n_ctx=N_CTX, threads=1)
    try:
        return loop.generate(prompt, N_TOKENS)
    finally:
        loop.close()


def test_cancelled_request_frees_its_slot(smollm2_on):
    engine = smollm2_on.load(1)
    try:
        long = SamplingOptions(temperature=0, num_predict=500, spec_type="none")
        stream = engine.submit(GenerationParams(engine.tokenize(PROMPTS[1]), long))
        chunks = iter(stream)
        next(chunks)
        stream.cancel()
        rest = list(chunks)
        assert rest and rest[-1].done_reason == "cancelled"
        # The only slot is free again: a new request is served.
        tokens, last = _tokens(engine.submit(GenerationParams(engine.tokenize(PROMPTS[0]), GREEDY)))
        assert tokens and last.done_reason in ("length", "stop")
        assert engine.snapshot().slots_busy == 0
    finally:
        engine.close()


def test_prefix_cache_reuses_the_shared_prompt(smollm2_on):
    engine = smollm2_on.load(2)
    try:
        first = engine.tokenize("You are a terse assistant. " * 20 + "Question one?")
        _, done1 = _tokens(engine.submit(GenerationParams(first, GREEDY)))
        assert done1.timings.prompt_cache_count == 0
        second = engine.tokenize("You are a terse assistant. " * 20 + "Another question?")
        shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
        _, done2 = _tokens(engine.submit(GenerationParams(second, GREEDY)))
        assert done2.timings.prompt_cache_count == shared
        # The exact same prompt again reuses all of it but the last token (its output starts the answer).
        _, done3 = _tokens(engine.submit(GenerationParams(second, GREEDY)))
        assert done3.timings.prompt_cache_count == len(second) - 1
    finally:
        engine.close()


def test_prefix_copied_from_a_busy_slot_gives_the_same_answer(smollm2_on):
    engine = smollm2_on.load(2)
    try:
        system = "You are a terse assistant who answers in one line. " * 15
        a = engine.tokenize(system + "Name a fruit.")
        b = engine.tokenize(system + "Name a colour.")
        long = SamplingOptions(temperature=0, num_predict=200, spec_type="none")
        busy = engine.submit(GenerationParams(a, long))  # holds slot 0 with the shared system prompt
        it = iter(busy)
        next(it)
        tokens, done = _tokens(engine.submit(GenerationParams(b, GREEDY)))
        busy.cancel()
        list(it)
        shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert done.timings.prompt_cache_count == shared
    finally:
        engine.close()
    assert tokens == smollm2_on.alone(b)


def test_overflow_raises_with_the_numbers(engine4):
    too_long = [1] * (engine4.n_ctx + 5)
    with pytest.raises(ContextOverflow) as info:
        engine4.submit(GenerationParams(too_long, GREEDY))
    assert info.value.prompt_tokens == engine4.n_ctx + 5
    assert info.value.num_ctx == engine4.n_ctx
    assert str(engine4.n_ctx) in str(info.value)


def test_truncation_reports_dropped_tokens(engine4):
    prompt = engine4.tokenize("word " * (engine4.n_ctx + 40))
    tokens, done = _tokens(engine4.submit(GenerationParams(prompt, GREEDY, truncate=True)))
    assert done.timings.truncated_tokens > 0
    assert done.timings.prompt_eval_count + done.timings.truncated_tokens == len(prompt)


def test_generation_that_fills_the_slot_ends_with_length(smollm2_path):
    engine = ModelEngine(
        LlamaCppBackend().load(smollm2_path, LoadOptions(num_thread=1, num_ctx=256, num_parallel=1)), max_queue=1
    )
    try:
        prompt = engine.tokenize("Count from one to one thousand: one, two, three,")
        tokens, done = _tokens(
            engine.submit(GenerationParams(prompt, SamplingOptions(temperature=0, ignore_eos=True, spec_type="none")))
        )
        assert done.done_reason == "length"
        assert len(prompt) + len(tokens) <= engine.n_ctx
    finally:
        engine.close()


def test_full_queue_is_rejected_at_once(smollm2_path):
    engine = ModelEngine(
        LlamaCppBackend().load(smollm2_path, LoadOptions(num_thread=1, num_ctx=256, num_parallel=1)), max_queue=1
    )
    try:
        prompt = engine.tokenize(PROMPTS[0])
        slow = SamplingOptions(temperature=0, num_predict=100, spec_type="none")
        with pytest.raises(InvalidInput, match="more than this model can ever hold"):  # never: a 400, not a 503
            engine.submit_all([GenerationParams(prompt, slow)] * 3)
        held = [engine.submit(GenerationParams(prompt, slow))]  # one running
        with pytest.raises(QueueFull):  # a batch that does not fit now is refused whole: nothing of it is queued
            engine.submit_all([GenerationParams(prompt, slow)] * 2)
        held.append(engine.submit(GenerationParams(prompt, slow)))  # one queued
        with pytest.raises(QueueFull):
            engine.submit(GenerationParams(prompt, slow))
        for s in held:
            s.cancel()
            list(s)
    finally:
        engine.close()


def test_stop_string_ends_generation_without_showing_it(engine4, reference):
    prompt = PROMPTS[2]
    full = "".join(c.text for c in engine4.submit(GenerationParams(engine4.tokenize(prompt), GREEDY)))
    stop = full.strip().split()[2] if len(full.split()) > 3 else full[-3:]
    cut = full.index(stop)
    opts = GREEDY.model_copy(update={"stop": [stop]})
    chunks = list(engine4.submit(GenerationParams(engine4.tokenize(prompt), opts)))
    assert "".join(c.text for c in chunks) == full[:cut]
    assert chunks[-1].done_reason == "stop"


def test_embeddings_are_normalised_and_distinct(engine4):
    a, b = engine4.embed([engine4.tokenize("cats and dogs"), engine4.tokenize("quantum chromodynamics")])
    assert len(a) == engine4.model.meta.n_embd
    assert abs(sum(x * x for x in a) - 1.0) < 1e-6
    assert a != b


def test_sampler_chain_options_take_effect(engine4):
    prompt = engine4.tokenize("one two three one two three one two three one two")
    greedy = _tokens(engine4.submit(GenerationParams(prompt, GREEDY)))[0]
    penalised = _tokens(
        engine4.submit(
            GenerationParams(
                prompt,
                GREEDY.model_copy(update={"repeat_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.5}),
            )
        )
    )[0]
    assert penalised != greedy
    banned = greedy[0]
    biased = _tokens(
        engine4.submit(GenerationParams(prompt, GREEDY.model_copy(update={"logit_bias": {banned: float("-inf")}})))
    )[0]
    assert biased[0] != banned
    seeded = GREEDY.model_copy(update={"temperature": 1.0, "top_k": 50, "top_p": 0.95, "min_p": 0.05, "seed": 7})
    first, again = (_tokens(engine4.submit(GenerationParams(prompt, seeded)))[0] for _ in range(2))
    assert first == again  # the same seed draws the same tokens


def test_greedy_shortcut_picks_what_llama_cpps_chain_picks(model_path):
    from localllm.backends.base import Batch
    from localllm.backends.llama_cpp.backend import GreedySampler, LlamaCppSampler

    model = LlamaCppBackend().load(model_path, LoadOptions(num_thread=1, num_ctx=256, num_parallel=1))
    try:
        tokens = model.tokenize("The capital of France is")
        batch = Batch()
        for i, tok in enumerate(tokens):
            batch.add(tok, i, 0, True)
        model.decode(batch)
        eog = model.eog_tokens()
        top = [int(t) for t in model.logits(len(tokens) - 1).argsort()[::-1][:3]]
        cases = [
            {},
            {"ignore_eos": True},
            {"logit_bias": {top[0]: float("-inf")}},  # the favourite banned: the runner-up wins
            {"logit_bias": {top[2]: 100.0}},  # a biased token overtakes
            {"logit_bias": {eog[0]: 1000.0}, "ignore_eos": True},  # a ban beats any bias
            {"logit_bias": {top[0]: -1.0, 10**9: 5.0}},  # an id past the vocabulary is ignored, as llama.cpp does
        ]
        for extra in cases:
            opts = SamplingOptions(temperature=0, **extra)
            fast = model.make_sampler(opts)
            assert isinstance(fast, GreedySampler)
            chain = LlamaCppSampler(model, opts, None)
            for row in range(len(tokens)):
                assert fast.sample(row) == chain.sample(row), (extra, row)
            chain.close()
        assert isinstance(model.make_sampler(SamplingOptions(temperature=0, repeat_penalty=1.3)), LlamaCppSampler)
        assert isinstance(model.make_sampler(SamplingOptions(temperature=0.7)), LlamaCppSampler)
    finally:
        model.close()
