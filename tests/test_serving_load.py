"""Serving under load on the real llama.cpp engine: a long prompt beside decoding streams goes in chunks the step
budget sizes (costs given through the cost-model Protocol, never measured here), and the slots draw their KV cells
from one pool that the scheduler keeps them within."""

from __future__ import annotations

import math

import httpx
import pytest

from localllm.api import LoadOptions, SamplingOptions
from localllm.backends.base import Batch
from localllm.backends.llama_cpp.backend import LlamaCppBackend
from localllm.engine.runner import GenerationParams, ModelEngine
from localllm.engine.step_budget import Line, StepBudget
from tests.server_harness import private_home, served

pytestmark = pytest.mark.models

GREEDY = SamplingOptions(temperature=0, spec_type="none", ignore_eos=True)


class FixedCosts:
    """A step cost model with given figures: the budget it yields does not depend on this machine's speed."""

    def __init__(self, base: float, per_token: float):
        self.line = Line(base, per_token)

    def observe(self, tokens: int, seconds: float, *, chunk: bool) -> None:
        pass

    def fit(self) -> Line | None:
        return self.line


def _recording(model) -> list[list[int]]:
    """Wrap the model's decode to record each step's sequence ids, one per batch row."""
    steps: list[list[int]] = []
    decode = model.decode

    def recorded(batch: Batch) -> None:
        steps.append(list(batch.seqs))
        decode(batch)

    model.decode = recorded
    return steps


def _drain(stream) -> tuple[int, str | None]:
    tokens, reason = 0, None
    for chunk in stream:
        tokens += len(chunk.tokens)
        reason = chunk.done_reason if chunk.done else reason
    return tokens, reason


def test_a_long_prompt_beside_decoding_streams_goes_in_budget_sized_chunks(smollm2_path):
    n_ctx = 2048
    model = LlamaCppBackend().load(smollm2_path, LoadOptions(num_thread=1, num_parallel=4, num_ctx=n_ctx))
    steps = _recording(model)
    # By these figures a prompt that may pay a tenth more a token than alone goes 73 tokens a step beside 3 decoders.
    budget = StepBudget(FixedCosts(base=0.02, per_token=0.004), slowdown=0.1)
    expected = budget.prefill_tokens(3, model.n_batch - 3)
    engine = ModelEngine(model, max_queue=4, pacing=budget)
    try:
        decoding = [
            engine.submit(
                GenerationParams(
                    prompt=model.tokenize(f"Story {i}:"), sampling=GREEDY.model_copy(update={"num_predict": 200})
                )
            )
            for i in range(3)
        ]
        readers = [iter(stream) for stream in decoding]  # kept: a dropped reader cancels its request
        assert all(next(reader).tokens for reader in readers)  # each is past its prompt, generating
        long_prompt = model.tokenize("the cat sat on the mat and " * 200)[:1400]
        assert len(long_prompt) == 1400
        seen = len(steps)
        long = engine.submit(
            GenerationParams(prompt=long_prompt, sampling=GREEDY.model_copy(update={"num_predict": 4}))
        )
        assert _drain(long) == (4, "length")
        assert all(_drain(reader)[1] == "length" for reader in readers)
    finally:
        engine.close()
    chunks = []
    for seqs in steps[seen:]:
        by_seq = {seq: seqs.count(seq) for seq in set(seqs)}
        prefill = [n for n in by_seq.values() if n > 1]
        if prefill:
            chunks.append((prefill[0], len(by_seq) - 1))  # the chunk, and the decode rows beside it
    beside_decoders = [n for n, decoders in chunks if decoders]
    assert sum(n for n, _ in chunks) == 1400
    assert beside_decoders and max(beside_decoders) <= expected < model.n_batch
    assert len(chunks) >= math.ceil(1400 / expected) > math.ceil(1400 / model.n_batch)


def test_a_long_conversation_uses_the_cells_short_ones_leave(smollm2_path):
    # Two slots of 512 tokens draw from one pool of 512 cells (the default: one slot's context).
    model = LlamaCppBackend().load(smollm2_path, LoadOptions(num_thread=1, num_parallel=2, num_ctx=512))
    assert model.kv_cells == 512 and model.n_ctx == 512
    engine = ModelEngine(model, max_queue=4)
    try:
        short = engine.submit(
            GenerationParams(
                prompt=model.tokenize("Hello there"), sampling=GREEDY.model_copy(update={"num_predict": 40})
            )
        )
        assert _drain(short) == (40, "length")
        held = engine.snapshot().kv_used
        assert 40 < held < 512
        prompt = model.tokenize("the cat sat on the mat and " * 60)[:300]
        long = engine.submit(GenerationParams(prompt=prompt, sampling=GREEDY.model_copy(update={"num_predict": 200})))
        # 300 + 200 tokens: more than the pool leaves beside the short cache, all of what it has once that goes.
        assert _drain(long) == (200, "length")
        assert held + len(prompt) + 200 > 512  # it did not fit beside the short cache...
        assert engine.snapshot().kv_used == len(prompt) + 200 - 1  # ...which went (the last token is never decoded)
    finally:
        engine.close()


def test_a_load_beyond_the_pool_ends_cleanly_before_native_code(smollm2_path):
    """Two conversations that would each run to a full context of 512 share 512 cells: neither makes llama_decode
    fail; the one that finds the pool full ends with "length", as at the end of a context."""
    model = LlamaCppBackend().load(smollm2_path, LoadOptions(num_thread=1, num_parallel=2, num_ctx=512))
    steps = _recording(model)
    engine = ModelEngine(model, max_queue=4)
    try:
        prompt = model.tokenize("the cat sat on the mat and " * 30)[:150]
        streams = engine.submit_all(
            [GenerationParams(prompt=prompt, sampling=GREEDY), GenerationParams(prompt=prompt[::-1], sampling=GREEDY)]
        )
        results = [_drain(stream) for stream in streams]  # an error would raise here
        assert all(reason == "length" for _, reason in results)
        first, second = sorted(tokens for tokens, _ in results)
        # Together they filled the pool: one ended there; the other took its cells and went on to its context's end.
        assert first < second and 2 * (len(prompt) + first) <= 512 + 4
        assert len(prompt) + second == 512
        assert steps
    finally:
        engine.close()


def test_ps_shows_the_pool(models_home, tmp_path):
    with served(private_home(models_home, tmp_path)) as url:
        options = {"temperature": 0, "num_predict": 8, "num_ctx": 512, "num_parallel": 2}
        reply = httpx.post(
            f"{url}/api/generate",
            json={"model": "smollm2:135m", "prompt": "Hello", "stream": False, "options": options},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        (row,) = httpx.get(f"{url}/api/ps", timeout=10).json()["models"]
    assert row["kv_cells"] == 512 and 8 < row["kv_used"] < 512
    from localllm.api import ProcessModel
    from localllm.cli.render import ps_rows

    (text,) = ps_rows([ProcessModel.model_validate(row)])
    assert f"{row['kv_used']}/512" in " ".join(text)
