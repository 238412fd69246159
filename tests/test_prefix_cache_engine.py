"""The prefix cache on the real llama.cpp engine: a conversation whose slot was taken comes back from RAM or disk
with its prefix reused (the answer's prompt_cache_count says how much) and the same greedy answer as a full prefill;
on gemma3 too, whose sliding-window layers make a saved state usable only from its end."""

from __future__ import annotations

import shutil

import pytest

from localllm import config
from localllm.api import LoadOptions, SamplingOptions
from localllm.backends.llama_cpp.backend import LlamaCppBackend
from localllm.engine.prefix_cache import make_prefix_cache
from localllm.engine.runner import GenerationParams, ModelEngine

pytestmark = pytest.mark.models

N_CTX = 1024
GREEDY = SamplingOptions(temperature=0, num_predict=8, spec_type="none")
NAVIGATOR = "You are a ship's navigator in the year 1790. " + "You log winds, currents and stars in careful detail. "
OTHER = "Bake bread in Lyon and explain each step."  # another conversation, sharing nothing with the first


@pytest.fixture(autouse=True)
def no_disk_tier_unless_asked(monkeypatch):
    """The disk tier is on by default; these tests turn it on where they mean it."""
    monkeypatch.setenv("LOCALLLM_CACHE_DISK", "0")


@pytest.fixture(params=["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def model_path(request):
    return request.getfixturevalue(f"{request.param}_path")


def _engine(path, *, slots: int = 1, digest: str = "sha256-test") -> ModelEngine:
    opts = LoadOptions(num_thread=2, num_ctx=N_CTX, num_parallel=slots)
    model = LlamaCppBackend().load(path, opts)
    return ModelEngine(model, max_queue=8, prefix_cache=make_prefix_cache(model, digest))


def _ask(engine: ModelEngine, prompt: list[int]) -> tuple[list[int], object]:
    tokens, last = [], None
    for chunk in engine.submit(GenerationParams(prompt, GREEDY)):
        tokens.extend(chunk.tokens)
        last = chunk
    return tokens, last.timings


def _first_turn(engine: ModelEngine, who: str) -> list[int]:
    if who == "y":
        return engine.tokenize(f"{OTHER}\nUser: Hi.\nAssistant:")
    # 200 tokens, or past a sliding window (gemma3's 512) so that a saved state holds only the window's last cells.
    window = engine.model.cache_shape().window
    system = NAVIGATOR
    while len(engine.tokenize(system)) < (window + 40 if window else 200):
        system += "You log winds, currents and stars in careful detail. "
    return engine.tokenize(f"{system}\nUser: Say something about your work.\nAssistant:")


def _next_turn(engine: ModelEngine, prompt: list[int], answer: list[int]) -> list[int]:
    # The conversation goes on as Ollama's `context` does: the previous prompt and answer as tokens, then more.
    return prompt + answer + engine.tokenize("\nUser: And what else?\nAssistant:", add_special=False)


def _conversation(engine: ModelEngine) -> tuple[list[int], list[int], object]:
    """X's first turn, Y's first turn (which takes X's only slot), X's second turn: (X's first prompt and answer,
    X's second answer, its timings)."""
    x1 = _first_turn(engine, "x")
    x_answer, _ = _ask(engine, x1)
    _ask(engine, _first_turn(engine, "y"))
    answer, timings = _ask(engine, _next_turn(engine, x1, x_answer))
    return x1 + x_answer, answer, timings


def test_an_evicted_conversation_comes_back_from_ram_with_the_same_answer(model_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "0")
    engine = _engine(model_path)
    try:
        _, reference, cold = _conversation(engine)
    finally:
        engine.close()
    assert cold.prompt_cache_count <= 1  # no cache beyond the one slot: the history is prefilled again (BOS aside)

    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "256MiB")
    engine = _engine(model_path)
    try:
        history, answer, warm = _conversation(engine)
        stats = engine.snapshot()
        shape = engine.model.cache_shape()
    finally:
        engine.close()
    # Everything X's slot held (its prompt and answer but the answer's last token) came back from RAM.
    assert warm.prompt_cache_count >= len(history) - 1
    assert stats.prefix_hits["ram"] == 1 and stats.prefix_tokens["ram"] == warm.prompt_cache_count
    assert 0 < stats.cache_ram_bytes <= stats.cache_ram_limit
    assert answer == reference
    if shape.window:  # gemma3: the state was longer than the window, so it held only the window's last cells
        assert 0 < shape.window < len(history)


def test_prefixes_survive_a_restart_on_disk_and_a_damaged_file_is_refused(smollm2_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "0")
    engine = _engine(smollm2_path)
    try:
        x1 = _first_turn(engine, "x")
        x_answer, _ = _ask(engine, x1)
        x2 = _next_turn(engine, x1, x_answer)
        reference, _ = _ask(engine, x2)  # one slot, no cache tiers: the same conversation prefilled anew
    finally:
        engine.close()

    monkeypatch.setenv("LOCALLLM_CACHE_DISK", "1GiB")
    engine = _engine(smollm2_path)
    try:
        assert _ask(engine, x1)[0] == x_answer
    finally:
        engine.close()  # the slot's prefix goes to disk with the unload
    assert len(list(config.prefix_cache_dir().rglob("*.kv"))) == 1

    engine = _engine(smollm2_path)  # a new engine on the same home: a restarted server
    try:
        answer, timings = _ask(engine, x2)
        assert engine.snapshot().prefix_hits["disk"] == 1
    finally:
        engine.close()
    assert timings.prompt_cache_count >= len(x1) and answer == reference

    # What the restarted engine left on disk (X's second turn) is damaged before the next start.
    (path,) = config.prefix_cache_dir().rglob("*.kv")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    engine = _engine(smollm2_path)
    try:
        answer, timings = _ask(engine, x2)
    finally:
        engine.close()
    assert timings.prompt_cache_count == 0 and answer == reference  # refused, prefilled again, same answer
    # Dropped: the file there now is the one this engine's unload wrote afresh.
    assert not path.exists() or path.read_bytes() != bytes(raw)


def test_a_file_from_another_model_is_refused(smollm2_path, gemma3_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "0")
    monkeypatch.setenv("LOCALLLM_CACHE_DISK", "1GiB")
    engine = _engine(smollm2_path, digest="sha256-smollm2")
    try:
        _ask(engine, _first_turn(engine, "x"))
    finally:
        engine.close()
    (ours,) = config.prefix_cache_dir().rglob("*.kv")
    gemma = _engine(gemma3_path, digest="sha256-gemma3")
    try:
        folder = gemma.prefix_cache.disk.folder
        folder.mkdir(parents=True, exist_ok=True)
        planted = folder / ours.name
        shutil.copy(ours, planted)
        assert make_prefix_cache(gemma.model, "sha256-gemma3").entries == []
        assert not planted.exists()
    finally:
        gemma.close()


# ---------------------------------------------------------------------------------------------------------- for people

LONG_SYSTEM = "You are a careful assistant for a lighthouse keeper. " + "Keep the lamp lit and log every ship. " * 15


@pytest.mark.parametrize("pinned", [True, False])
def test_keep_prefix_pins_a_conversation_against_eviction(models_home, monkeypatch, pinned):
    from localllm import api
    from tests.server_harness import local_client

    # Room for two saved conversations (~23 kB of KV per token on smollm2: ~3.5 MB for X's, ~6 MB for the others').
    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "12MiB")
    monkeypatch.setenv("LOCALLLM_NUM_PARALLEL", "1")
    monkeypatch.setenv("LOCALLLM_CONTEXT_LENGTH", str(N_CTX))
    client = local_client(models_home)
    options = {"temperature": 0, "num_predict": 4, "spec_type": "none"}

    def chat(system: str, question: str, **extra) -> api.ChatChunk:
        messages = [api.Message(role="system", content=system), api.Message(role="user", content=question)]
        *_, last = client.chat(api.ChatRequest(model="smollm2:135m", messages=messages, options={**options, **extra}))
        return last

    try:
        chat(LONG_SYSTEM, "Hello?", keep_prefix=pinned)
        for i in range(3):  # three other conversations take the slot; each is saved in turn and evicts the oldest
            chat(f"You are helper number {i}. " + "Answer briefly and kindly. " * 50, "Hi")
        back = chat(LONG_SYSTEM, "Hello again?")
        (row,) = client.ps().models
    finally:
        client.close()
    assert row.cache_ram_bytes <= row.cache_ram_limit
    if pinned:
        assert back.prompt_cache_count > 100 and row.prefix_cache_hits["ram"] == 1
    else:  # evicted: only the chat template's opening is shared with the slot's last conversation
        assert back.prompt_cache_count < 20 and row.prefix_cache_hits["ram"] == 0


def test_a_chat_saved_with_its_prompt_cache_comes_back_in_a_new_server(models_home, tmp_path, monkeypatch):
    from localllm.cli.repl import Repl
    from localllm.client.http import HttpClient
    from localllm.conversation import Conversation
    from localllm.errors import InvalidInput
    from localllm.server.app import create_app
    from tests.server_harness import local_client, serve_in_thread

    monkeypatch.setenv("LOCALLLM_NUM_PARALLEL", "1")
    monkeypatch.setenv("LOCALLLM_CONTEXT_LENGTH", str(N_CTX))
    saved = tmp_path / "chat.kv"

    class NoInput:  # the Repl's LineInput: this test drives it by ask() and _command(), never by typing
        def __call__(self, prompt: str) -> str:
            return ""

        def take_interrupt(self) -> bool:
            return False

        def keep_history(self, enabled: bool) -> None:
            pass

    def repl_on(url: str, conversation: Conversation) -> Repl:
        return Repl(HttpClient(url), conversation, reader=NoInput())

    def new_conversation() -> Conversation:
        return Conversation(model="smollm2:135m", options={"temperature": 0, "num_predict": 6, "spec_type": "none"})

    client = local_client(models_home)
    try:
        with serve_in_thread(create_app(client)) as url:
            first = new_conversation()
            first.system = LONG_SYSTEM
            repl = repl_on(url, first)
            repl.ask("Where is the lamp?")
            repl._command(f"/save {saved}")
    finally:
        client.close()
    assert saved.stat().st_size > 1_000_000  # the conversation and its KV state

    client = local_client(models_home)  # a new server: nothing cached in its slots or RAM
    try:
        with serve_in_thread(create_app(client)) as url:
            later = new_conversation()
            repl = repl_on(url, later)
            repl._command(f"/load {saved}")
            assert later.system == LONG_SYSTEM and [m.role for m in later.messages] == ["user", "assistant"]
            repl.ask("And the ships?")
            assert later.figures.last.prompt_cache_count > 100  # the history was not evaluated again
            (row,) = client.ps().models
            assert row.prefix_cache_hits["ram"] == 1

            damaged = tmp_path / "damaged.kv"
            raw = bytearray(saved.read_bytes())
            raw[-100] ^= 0xFF
            damaged.write_bytes(bytes(raw))
            with pytest.raises(InvalidInput, match="corrupt"):
                repl._command(f"/load {damaged}")
    finally:
        client.close()
