"""The MLX backend behind the backend Protocol.

Plumbing runs on a tiny random llama (2 layers, hidden 64) with a byte-level BPE tokenizer trained in the test, so
it needs no download. The cross-checks against llama.cpp run on the real smollm2 (converted once per module): on an
F32 copy of the weights the two backends must agree greedily for 30 tokens; on the Q4_1 model their logits must
correlate above 0.99 (llama.cpp quantizes activations in its Q4 dot products, so exact agreement is not expected)."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402

from localllm.api import LoadOptions, SamplingOptions  # noqa: E402
from localllm.backends import choose_backend, get_backend  # noqa: E402
from localllm.backends.base import Batch  # noqa: E402
from localllm.backends.mlx import GRAMMAR_UNSUPPORTED, MlxBackend, MlxModel  # noqa: E402
from localllm.errors import InvalidInput, LocalLLMError, ModelFormatError  # noqa: E402

pytestmark = pytest.mark.mlx

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris.",
    "Hello world, hello tests.",
    "def add(a, b): return a + b",
    "Quantized models run locally on a laptop.",
]


# ------------------------------------------------------------------------------------------------------- fixtures


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok


def _write_tiny_llama(folder: Path, **shape) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    tok = _train_tokenizer()
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **shape,
    }
    mx.random.seed(7)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Larger embeddings than the default init make the logits peaked, so greedy choices are not near-ties.
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * 0.5
    folder.mkdir(parents=True)
    # Stored in float16, as mlx-community checkpoints are: the backend casts them to float32 on CPU at load.
    weights = {name: value.astype(mx.float16) for name, value in tree_flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "chat_template": CHATML,
            }
        )
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mlx") / "tiny-llama"
    _write_tiny_llama(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder) -> MlxModel:
    model = MlxBackend().load(tiny_folder, LoadOptions(num_ctx=64, num_parallel=3))
    yield model
    model.close()


@pytest.fixture(autouse=True)
def _clear_sequences(request):
    yield
    if "tiny" in request.fixturenames:
        model = request.getfixturevalue("tiny")
        for seq in range(model.n_seq):
            model.remove(seq, 0)


def _prefill(model, seq: int, tokens: list[int], start: int = 0) -> int:
    """Decode `tokens` into `seq` from position `start`; returns the batch row holding the last logits."""
    batch = Batch()
    for i, tok in enumerate(tokens):
        batch.add(tok, start + i, seq, i == len(tokens) - 1)
    model.decode(batch)
    return len(tokens) - 1


def _greedy(model, tokens: list[int], n: int, *, seq: int = 0) -> list[int]:
    row = _prefill(model, seq, tokens)
    sampler = model.make_sampler(SamplingOptions(temperature=0))
    out: list[int] = []
    for pos in range(len(tokens), len(tokens) + n):
        out.append(sampler.sample(row))
        if len(out) == n:
            break
        batch = Batch()
        row = batch.add(out[-1], pos, seq, True)
        model.decode(batch)
    sampler.close()
    return out


# ------------------------------------------------------------------------------------------------------- loading


def test_registry_picks_mlx_for_folders(tiny_folder, tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert choose_backend("auto", tiny_folder) == "mlx"
    assert choose_backend("auto", gguf_file) == "llama.cpp"
    assert isinstance(get_backend("mlx"), MlxBackend)


def test_meta_comes_from_config_and_tokenizer(tiny, tiny_folder):
    meta = tiny.meta
    vocab = json.loads((tiny_folder / "config.json").read_text())["vocab_size"]
    assert (meta.architecture, meta.n_vocab, meta.n_ctx_train, meta.n_embd) == ("llama", vocab, 512, 64)
    assert meta.bos_token == 1 and meta.eos_token == 2 and meta.add_bos is False
    assert meta.chat_template == CHATML
    assert meta.n_params > 0 and meta.size_bytes > 0
    assert tiny.is_eog(2) and not tiny.is_eog(5)


def test_missing_or_incomplete_folder_is_a_format_error(tmp_path):
    with pytest.raises(ModelFormatError, match="does not exist"):
        MlxBackend().load(tmp_path / "nope", LoadOptions(num_ctx=16, num_parallel=1))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(ModelFormatError, match=r"\*\.safetensors"):
        MlxBackend().load(tmp_path / "half", LoadOptions(num_ctx=16, num_parallel=1))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelFormatError, match="--format mlx"):
        MlxBackend().load(tmp_path / "m.gguf", LoadOptions(num_ctx=16, num_parallel=1))


def test_mlx_repo_pulled_from_the_hub_loads_and_decodes(tiny_folder, tiny, monkeypatch):
    from hfserver import Hub, HubServer

    from localllm.models.pull import pull_model
    from localllm.models.store import Store

    repo = {p.name: p.read_bytes() for p in tiny_folder.iterdir()}
    with HubServer(Hub(repos={"mlx-community/tiny-llama-mlx": repo})) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
        statuses = [p.status for p in pull_model("hf.co/mlx-community/tiny-llama-mlx", Store())]
    assert statuses[-1] == "success"
    stored = Store().resolve("hf.co/mlx-community/tiny-llama-mlx")
    assert stored.format == "mlx" and choose_backend("auto", stored.weights) == "mlx"
    pulled = get_backend("mlx").load(stored.weights, LoadOptions(num_ctx=64, num_parallel=1))
    try:
        tokens = tiny.tokenize("The capital of France")
        assert _greedy(pulled, tokens, 5) == _greedy(tiny, tokens, 5)
    finally:
        pulled.close()


# ------------------------------------------------------------------------------------------------------- text


def test_token_bytes_rebuild_the_text_exactly(tiny):
    text = "Hello héllo wörld 🙂 — Paris!\n\ttabs"
    tokens = tiny.tokenize(text, add_special=False)
    assert b"".join(tiny.token_bytes(t) for t in tokens) == text.encode()
    # Multi-byte characters split across byte-level tokens come back as partial UTF-8, not replacement chars.
    assert any(not _is_utf8(tiny.token_bytes(t)) for t in tokens)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_special_tokens_parse_only_when_asked(tiny):
    assert tiny.tokenize("<|im_end|>", parse_special=True) == [2]
    plain = tiny.tokenize("<|im_end|>", parse_special=False)
    assert 2 not in plain and b"".join(tiny.token_bytes(t) for t in plain) == b"<|im_end|>"
    assert tiny.token_bytes(2) == b""  # control tokens render as nothing, like llama.cpp


# ------------------------------------------------------------------------------------------------------- decode


def test_mixed_batch_matches_each_sequence_alone(tiny):
    a = tiny.tokenize("The capital of France")
    b = tiny.tokenize("def add(a, b):")
    alone_a = tiny.logits(_prefill(tiny, 0, a))
    alone_b = tiny.logits(_prefill(tiny, 1, b))
    tiny.remove(0, 0)
    tiny.remove(1, 0)
    batch = Batch()
    for i, tok in enumerate(b):
        row_b = batch.add(tok, i, 2, i == len(b) - 1)
    for i, tok in enumerate(a):
        row_a = batch.add(tok, i, 0, i == len(a) - 1)
    tiny.decode(batch)
    np.testing.assert_allclose(tiny.logits(row_a), alone_a, atol=1e-4)
    np.testing.assert_allclose(tiny.logits(row_b), alone_b, atol=1e-4)


def test_chunked_prefill_matches_one_pass(tiny):
    tokens = tiny.tokenize("Quantized models run locally on a laptop.")
    whole = tiny.logits(_prefill(tiny, 0, tokens))
    _prefill(tiny, 1, tokens[:4])
    chunked = tiny.logits(_prefill(tiny, 1, tokens[4:], start=4))
    np.testing.assert_allclose(chunked, whole, atol=1e-4)


def test_the_step_clock_counts_the_callers_wait(tiny):
    """MLX evaluates on its own stream threads while the caller waits: steps and drafts are priced on a clock that
    counts that wait (the caller's CPU time priced four rows like one, so drafts that never paid looked free)."""
    start = tiny.step_clock()
    time.sleep(0.05)  # the caller waiting, as it does while MLX evaluates
    assert tiny.step_clock() - start >= 0.05


def _greedy_together(model, prompts: dict[int, list[int]], n: int) -> dict[int, list[tuple[int, np.ndarray]]]:
    """Greedy decoding of every prompt at once, one batch per step holding one row of each sequence: each
    sequence's tokens, each with the logits it was picked from."""
    batch, rows = Batch(), {}
    for seq, tokens in prompts.items():
        for i, tok in enumerate(tokens):
            rows[seq] = batch.add(tok, i, seq, i == len(tokens) - 1)
    model.decode(batch)
    samplers = {seq: model.make_sampler(SamplingOptions(temperature=0)) for seq in prompts}
    out: dict[int, list[tuple[int, np.ndarray]]] = {seq: [] for seq in prompts}
    for step in range(n):
        for seq in prompts:
            out[seq].append((samplers[seq].sample(rows[seq]), model.logits(rows[seq])))
        if step == n - 1:
            break
        batch = Batch()
        for seq, tokens in prompts.items():
            rows[seq] = batch.add(out[seq][-1][0], len(tokens) + step, seq, True)
        model.decode(batch)
    return out


def _assert_same_decoding(together, alone) -> None:
    for seq, picks in alone.items():
        assert [t for t, _ in together[seq]] == [t for t, _ in picks], f"sequence {seq}"
        for (_, got), (_, expected) in zip(together[seq], picks):
            np.testing.assert_allclose(got, expected, atol=1e-4)


def test_batched_greedy_decoding_gives_each_sequence_its_own_tokens(tiny):
    # Different prompt lengths: the rows sit at different positions of the shared cache in every step.
    prompts = {
        0: tiny.tokenize("The capital of France is"),
        1: tiny.tokenize("def add(a, b):"),
        2: tiny.tokenize("Hello"),
    }
    alone = {}
    for seq, tokens in prompts.items():
        alone.update(_greedy_together(tiny, {seq: tokens}, 12))
        tiny.remove(seq, 0)
    assert len({tuple(t for t, _ in picks) for picks in alone.values()}) == 3  # the sequences really differ
    _assert_same_decoding(_greedy_together(tiny, prompts, 12), alone)


def test_sequences_with_gaps_between_them_decode_together(tiny):
    # Sequences 0 and 2 without 1: the pass gathers rows that are not side by side in the cache.
    prompts = {0: tiny.tokenize("Quantized models run"), 2: tiny.tokenize("Hello world, hello")}
    alone = {}
    for seq, tokens in prompts.items():
        alone.update(_greedy_together(tiny, {seq: tokens}, 8))
        tiny.remove(seq, 0)
    held_tokens = tiny.tokenize("def add(a, b):")
    _prefill(tiny, 1, held_tokens)  # a held sequence the pass must leave alone
    held = tiny.logits(_prefill(tiny, 1, tiny.tokenize(" return"), start=len(held_tokens)))
    tiny.remove(1, len(held_tokens))
    _assert_same_decoding(_greedy_together(tiny, prompts, 8), alone)
    again = tiny.logits(_prefill(tiny, 1, tiny.tokenize(" return"), start=len(held_tokens)))
    np.testing.assert_allclose(again, held, atol=1e-4)


def test_rows_of_unequal_counts_share_a_pass_exactly(tiny):
    # One sequence decodes one token while another verifies a four-token draft: the shorter is padded, and the
    # padding must change neither its logits nor what its cache holds afterwards.
    a, b = tiny.tokenize("The capital of France is"), tiny.tokenize("def add(a, b):")
    draft = tiny.tokenize(" return a + b")[:4]
    _prefill(tiny, 0, a)
    alone_a = tiny.logits(_prefill(tiny, 0, [a[-1]], start=len(a)))
    _prefill(tiny, 1, b)
    batch = Batch()
    for i, tok in enumerate(draft):
        batch.add(tok, len(b) + i, 1, True)
    tiny.decode(batch)
    alone_b = [tiny.logits(i) for i in range(len(draft))]
    for seq in (0, 1):
        tiny.remove(seq, 0)
    _prefill(tiny, 0, a)
    _prefill(tiny, 1, b)
    batch = Batch()
    row_a = batch.add(a[-1], len(a), 0, True)
    rows_b = [batch.add(tok, len(b) + i, 1, True) for i, tok in enumerate(draft)]
    tiny.decode(batch)
    np.testing.assert_allclose(tiny.logits(row_a), alone_a, atol=1e-4)
    for row, expected in zip(rows_b, alone_b):
        np.testing.assert_allclose(tiny.logits(row), expected, atol=1e-4)
    assert (tiny.cached_tokens(0), tiny.cached_tokens(1)) == (len(a) + 1, len(b) + len(draft))
    after = tiny.logits(_prefill(tiny, 0, [a[0]], start=len(a) + 1))
    tiny.remove(0, 0)
    _prefill(tiny, 0, a + [a[-1]])
    np.testing.assert_allclose(after, tiny.logits(_prefill(tiny, 0, [a[0]], start=len(a) + 1)), atol=1e-4)


def test_a_pass_masks_each_row_to_its_own_window():
    # Sliding-window layers: each row sees the window behind its own positions, and nothing past its own end.
    from mlx_lm.models.base import create_causal_mask

    from localllm.backends.mlx.kv import Step

    step = Step([0, 2], [3, 7], 2)
    mask = np.array(step.mask(4, return_array=True))  # [B, 1, L, S]
    assert mask.shape == (2, 1, 2, 9)
    for b, start in enumerate(step.starts):
        alone = np.array(create_causal_mask(2, start, window_size=4))  # [L, start + L]
        np.testing.assert_array_equal(mask[b, 0, :, : start + 2], alone)
        assert not mask[b, 0, :, start + 2 :].any()


def test_a_prefill_chunk_beside_decode_rows_matches_each_alone(tiny):
    long_prompt = tiny.tokenize("Quantized models run locally on a laptop. " * 2)
    short = tiny.tokenize("Hello")
    whole = tiny.logits(_prefill(tiny, 0, long_prompt))
    alone_short = tiny.logits(_prefill(tiny, 1, short))
    for seq in (0, 1):
        tiny.remove(seq, 0)
    _prefill(tiny, 1, short[:-1])
    batch = Batch()
    for i, tok in enumerate(long_prompt):
        row_long = batch.add(tok, i, 0, i == len(long_prompt) - 1)
    row_short = batch.add(short[-1], len(short) - 1, 1, True)
    tiny.decode(batch)
    np.testing.assert_allclose(tiny.logits(row_long), whole, atol=1e-4)
    np.testing.assert_allclose(tiny.logits(row_short), alone_short, atol=1e-4)


def test_rows_without_logits_have_none(tiny):
    tokens = tiny.tokenize("Hello world")
    last = _prefill(tiny, 0, tokens)
    assert tiny.logits(last).shape == (tiny.meta.n_vocab,)
    with pytest.raises(LocalLLMError, match="row 0"):
        tiny.logits(0)


def test_rows_must_continue_the_cache(tiny):
    _prefill(tiny, 0, tiny.tokenize("Hello"))
    batch = Batch()
    batch.add(5, 0, 0, True)  # position 0 again: the cache already holds it
    with pytest.raises(LocalLLMError, match="rows must continue the cache"):
        tiny.decode(batch)


def test_a_full_context_is_an_error_not_a_wraparound(tiny):
    tokens = (tiny.tokenize("Hello world, hello tests. ") * 40)[: tiny.n_ctx + 1]
    with pytest.raises(LocalLLMError, match="context is 64"):
        _prefill(tiny, 0, tokens)


def test_decode_runs_on_another_thread_than_load(tiny_folder, tiny):
    # The engine thread decodes what the pool loaded on another thread: nothing lazy may stay tied to the loader.
    fresh = MlxBackend().load(tiny_folder, LoadOptions(num_ctx=64, num_parallel=1))
    tokens = tiny.tokenize("The capital of France")
    result: dict = {}

    def decode_there():
        try:
            result["out"] = _greedy(fresh, tokens, 4)
        except Exception as exc:  # noqa: BLE001  (reported below)
            result["out"] = exc

    worker = threading.Thread(target=decode_there)
    worker.start()
    worker.join(60)
    fresh.close()
    assert result.get("out") == _greedy(tiny, tokens, 4)


# ------------------------------------------------------------------------------------------------------- cache


def test_trim_then_redecode_gives_the_same_logits(tiny):
    tokens = tiny.tokenize("The capital of France is Paris.")
    full = tiny.logits(_prefill(tiny, 0, tokens))
    tiny.remove(0, 3)
    assert tiny.cached_tokens(0) == 3
    again = tiny.logits(_prefill(tiny, 0, tokens[3:], start=3))
    np.testing.assert_allclose(again, full, atol=1e-4)


def test_only_a_suffix_can_be_removed(tiny):
    _prefill(tiny, 0, tiny.tokenize("The capital of France is Paris."))
    with pytest.raises(InvalidInput, match="only drop the end"):
        tiny.remove(0, 1, 3)
    tiny.remove(0, 2, 10_000)  # an end past the cache is a suffix too
    assert tiny.cached_tokens(0) == 2


def test_copy_prefix_shares_the_prefix_and_nothing_after(tiny):
    tokens = tiny.tokenize("The capital of France is Paris.")
    full = tiny.logits(_prefill(tiny, 0, tokens))
    tiny.copy_prefix(0, 1, 4)
    assert tiny.cached_tokens(1) == 4
    # The source keeps growing; the copy must not see those writes.
    _prefill(tiny, 0, tiny.tokenize(" Hello"), start=len(tokens))
    copied = tiny.logits(_prefill(tiny, 1, tokens[4:], start=4))
    np.testing.assert_allclose(copied, full, atol=1e-4)


def test_a_saved_state_restores_into_another_slot_exactly(tiny):
    tokens = tiny.tokenize("The capital of France is Paris.")
    _prefill(tiny, 0, tokens[:-1])
    data = tiny.states.save_seq(0)
    expected = tiny.logits(_prefill(tiny, 0, tokens[-1:], start=len(tokens) - 1))
    _prefill(tiny, 2, tiny.tokenize("Hello world"))  # the slot held something else before
    tiny.states.restore_seq(2, data, len(tokens) - 1)
    assert tiny.cached_tokens(2) == len(tokens) - 1
    np.testing.assert_allclose(tiny.logits(_prefill(tiny, 2, tokens[-1:], start=len(tokens) - 1)), expected, atol=1e-5)


def test_a_state_that_does_not_fit_is_refused_and_leaves_the_slot_empty(tiny):
    _prefill(tiny, 0, tiny.tokenize("The capital of France is Paris."))
    data = tiny.states.save_seq(0)
    held = tiny.cached_tokens(0)
    assert tiny.states.save_seq(1) is None  # an empty slot has nothing to save
    for bad, n_tokens in ((data, held + 1), (data[:-7], held), (data + b"xx", held), (b"\x00\x01", held)):
        _prefill(tiny, 1, tiny.tokenize("Hello"))
        with pytest.raises(LocalLLMError, match="does not fit slot 1"):
            tiny.states.restore_seq(1, bad, n_tokens)
        assert tiny.cached_tokens(1) == 0


# ------------------------------------------------------------------------------------------------------- kv_type


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory) -> Path:
    """Heads of 64 elements, so that mlx-lm's KV quantization (groups of 64) applies."""
    folder = tmp_path_factory.mktemp("mlx") / "wide-llama"
    _write_tiny_llama(folder, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    return folder


def _load_wide(folder: Path, kv_type: str) -> MlxModel:
    return MlxBackend().load(folder, LoadOptions(num_ctx=64, num_parallel=3, kv_type=kv_type))


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_a_quantized_kv_cache_decodes_close_to_a_full_one_and_batched_exactly(wide_folder, kv_type):
    full, quantized = _load_wide(wide_folder, "f16"), _load_wide(wide_folder, kv_type)
    try:
        assert "bits" not in full.cache_shape().fingerprint and "bits" in quantized.cache_shape().fingerprint
        prompts = {0: full.tokenize("The capital of France is"), 1: full.tokenize("def add(a, b):")}
        reference = _greedy_together(full, prompts, 6)
        alone = {}
        for seq, tokens in prompts.items():
            alone.update(_greedy_together(quantized, {seq: tokens}, 6))
            quantized.remove(seq, 0)
        together = _greedy_together(quantized, prompts, 6)
        _assert_same_decoding(together, alone)  # batching stays exact on quantized caches too
        for seq, picks in reference.items():  # and they stay close to the full cache's logits
            for (_, got), (_, expected) in zip(together[seq], picks):
                assert np.corrcoef(got, expected)[0, 1] > 0.99
        assert quantized.states is not None and quantized.states.save_seq(0) is not None
    finally:
        full.close()
        quantized.close()


def test_a_state_saved_with_another_kv_type_is_refused(wide_folder):
    full, quantized = _load_wide(wide_folder, "f16"), _load_wide(wide_folder, "q8_0")
    try:
        tokens = full.tokenize("The capital of France is Paris.")
        for model in (full, quantized):
            _prefill(model, 0, tokens)
        saved = {"full": full.states.save_seq(0), "q8": quantized.states.save_seq(0)}
        with pytest.raises(LocalLLMError, match="arrays per cache"):
            quantized.states.restore_seq(1, saved["full"], len(tokens))
        with pytest.raises(LocalLLMError, match="arrays per cache"):
            full.states.restore_seq(1, saved["q8"], len(tokens))
        quantized.states.restore_seq(2, saved["q8"], len(tokens))
        expected = quantized.logits(_prefill(quantized, 0, [tokens[0]], start=len(tokens)))
        restored = quantized.logits(_prefill(quantized, 2, [tokens[0]], start=len(tokens)))
        np.testing.assert_allclose(restored, expected, atol=1e-5)
    finally:
        full.close()
        quantized.close()


def test_heads_no_group_divides_keep_a_full_cache(tiny_folder, caplog):
    model = MlxBackend().load(tiny_folder, LoadOptions(num_ctx=64, num_parallel=1, kv_type="q8_0"))
    try:
        assert "kv full" in model.cache_shape().fingerprint
        assert "kept unquantized" in caplog.text
    finally:
        model.close()


# ------------------------------------------------------------------------------------------------------- sampling


def test_greedy_is_argmax(tiny):
    row = _prefill(tiny, 0, tiny.tokenize("Hello world"))
    sampler = tiny.make_sampler(SamplingOptions(temperature=0))
    assert sampler.sample(row) == int(np.argmax(tiny.logits(row)))


def test_seeded_sampling_repeats_and_seeds_differ(tiny):
    row = _prefill(tiny, 0, tiny.tokenize("Hello world"))

    def draws(seed: int) -> list[int]:
        sampler = tiny.make_sampler(SamplingOptions(temperature=10.0, top_k=0, top_p=1.0, seed=seed))
        return [sampler.sample(row) for _ in range(24)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_truncation_filters_limit_the_choice(tiny):
    row = _prefill(tiny, 0, tiny.tokenize("Hello world"))
    top = int(np.argmax(tiny.logits(row)))
    for opts in (
        dict(top_k=1),
        dict(top_p=1e-6, top_k=0),
        dict(min_p=1.0, top_k=0),
        dict(typical_p=1e-6, top_k=0, top_p=1.0),
    ):
        sampler = tiny.make_sampler(SamplingOptions(temperature=1.0, seed=3, **opts))
        picks = {sampler.sample(row) for _ in range(8)}
        if "typical_p" in opts:  # typical keeps the one token closest to the entropy, not always the argmax
            assert len(picks) == 1, opts
        else:
            assert picks == {top}, opts


def test_logit_bias_and_ignore_eos(tiny):
    row = _prefill(tiny, 0, tiny.tokenize("Hello world"))
    forced = tiny.make_sampler(SamplingOptions(temperature=0, logit_bias={2: 1e4}))
    assert forced.sample(row) == 2
    blocked = tiny.make_sampler(SamplingOptions(temperature=0, logit_bias={2: 1e4}, ignore_eos=True))
    assert blocked.sample(row) != 2


def test_penalties_see_accepted_prompt_tokens(tiny):
    row = _prefill(tiny, 0, tiny.tokenize("Hello world"))
    top = int(np.argmax(tiny.logits(row)))
    sampler = tiny.make_sampler(SamplingOptions(temperature=0, presence_penalty=1e4))
    sampler.accept(top)
    assert sampler.sample(row) != top


def test_a_grammar_holds_the_answer_to_its_words_and_ends_it(tiny):
    pytest.importorskip("llguidance")
    words = ("Hello world", "Paris", "def add")
    grammar = "root ::= " + " | ".join(f'"{w}"' for w in words)
    sampler = tiny.make_sampler(SamplingOptions(temperature=0), grammar=grammar)
    row = _prefill(tiny, 0, tiny.tokenize("The capital of France is"))
    out: list[int] = []
    while not out or not tiny.is_eog(out[-1]):
        assert len(out) < 10
        out.append(sampler.sample(row))
        batch = Batch()
        row = batch.add(out[-1], tiny.cached_tokens(0), 0, True)
        tiny.decode(batch)
    assert b"".join(tiny.token_bytes(t) for t in out[:-1]).decode() in words


def test_without_llguidance_a_grammar_is_refused_with_the_install_hint_and_a_lazy_one_dropped(tiny, monkeypatch):
    from localllm.api import GrammarTriggers

    monkeypatch.setattr(tiny, "_grammars", None)
    with pytest.raises(InvalidInput, match="needs llguidance") as err:
        tiny.make_sampler(SamplingOptions(), grammar='root ::= "a"')
    assert err.value.status_code == 400 and GRAMMAR_UNSUPPORTED in str(err.value)
    assert "localllm[mlx]" in (err.value.hint or "")
    lazy = tiny.make_sampler(SamplingOptions(), grammar='root ::= "a"', triggers=GrammarTriggers(words=("<x>",)))
    lazy.close()  # the answer is parsed as before, without the grammar


# ------------------------------------------------------------------------------------------------------- embeddings


def test_a_loaded_model_offers_states_an_embedder_and_grammars_and_no_other_part(tiny):
    assert (tiny.vision, tiny.reranker, tiny.mtp, tiny.threads) == (None,) * 4
    assert tiny.embedder is not None and tiny.states is not None
    assert (tiny.grammars is not None) == (importlib.util.find_spec("llguidance") is not None)
    assert tiny.cache_shape().fingerprint  # the disk tier keeps states only for loads that describe them


def test_embeddings_are_normalised_and_deterministic(tiny):
    one, other = tiny.embedder.embed([tiny.tokenize("The capital of France"), tiny.tokenize("def add(a, b):")])
    assert len(one) == tiny.meta.n_embd
    assert abs(float(np.linalg.norm(one)) - 1.0) < 1e-5
    assert one == tiny.embedder.embed([tiny.tokenize("The capital of France")])[0]
    assert one != other
    with pytest.raises(InvalidInput):
        tiny.embedder.embed([[]])


# ------------------------------------------------------------------------------------------------------- real model


def _write_f32_gguf(src: Path, dst: Path) -> None:
    """An F32 copy of a GGUF: same metadata, every tensor dequantized exactly (file_type 0)."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(0)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        writer.add_tensor(t.name, dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def smol_mlx(smollm2_path, tmp_path_factory) -> Path:
    from localllm.quant.mlx_convert import convert_gguf_to_mlx

    return convert_gguf_to_mlx(smollm2_path, tmp_path_factory.mktemp("smol") / "mlx")


def _load_pair(gguf_path: Path, mlx_folder: Path):
    from localllm.backends.llama_cpp.backend import LlamaCppBackend

    # One thread: llama.cpp collapses when its threads outnumber free cores on a shared machine.
    opts = LoadOptions(num_thread=1, num_batch=128, num_ctx=128, num_parallel=1)
    return (
        LlamaCppBackend().load(gguf_path, opts),
        MlxBackend().load(mlx_folder, opts),
    )


PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.models
def test_smollm2_converted_answers_paris_with_llama_cpp_tokens(smollm2_path, smol_mlx):
    llama, mlx = _load_pair(smollm2_path, smol_mlx)
    try:
        for text in (PROMPT, "In 2024, 12345 apples cost $3.50!", "héllo  wörld\n\n\t🙂", "<|im_end|> raw"):
            for special in (True, False):
                assert mlx.tokenize(text, parse_special=special) == llama.tokenize(text, parse_special=special)
        answer = _greedy(mlx, mlx.tokenize(PROMPT), 10)
        text = b"".join(mlx.token_bytes(t) for t in answer).decode("utf-8", "replace")
        assert "Paris" in text
    finally:
        llama.close()
        mlx.close()


@pytest.mark.models
@pytest.mark.slow
def test_f32_weights_agree_greedily_with_llama_cpp(smollm2_path, tmp_path):
    from localllm.quant.mlx_convert import convert_gguf_to_mlx

    f32 = tmp_path / "smollm2-f32.gguf"
    _write_f32_gguf(smollm2_path, f32)
    folder = convert_gguf_to_mlx(f32, tmp_path / "f32-mlx")
    assert "quantization" not in json.loads((folder / "config.json").read_text())
    llama, mlx = _load_pair(f32, folder)
    try:
        prompt = llama.tokenize(
            "<|im_start|>user\nTell me about the history of Rome.<|im_end|>\n<|im_start|>assistant\n"
        )
        assert _greedy(mlx, prompt, 30) == _greedy(llama, prompt, 30)
    finally:
        llama.close()
        mlx.close()


@pytest.mark.models
def test_quantized_logits_correlate_with_llama_cpp(smollm2_path, smol_mlx):
    llama, mlx = _load_pair(smollm2_path, smol_mlx)
    try:
        _assert_next_token_agrees(llama, mlx, llama.tokenize(PROMPT), correlation=0.99)
    finally:
        llama.close()
        mlx.close()


def _assert_next_token_agrees(llama, mlx, tokens: list[int], *, correlation: float) -> None:
    """After the same prompt, both backends' logits correlate and pick the same next token."""
    a = llama.logits(_prefill(llama, 0, tokens))
    b = mlx.logits(_prefill(mlx, 0, tokens))
    assert float(np.corrcoef(a, b)[0, 1]) > correlation
    assert int(np.argmax(a)) == int(np.argmax(b))


@pytest.mark.models
@pytest.mark.slow
def test_qwen2_converts_with_llama_cpp_tokens_and_logits(coder_home, tmp_path):
    """qwen2.5-coder:0.5b (q/k/v biases, its own pre-tokenizer, K-quants requantized to MLX's 4 bits): the same
    tokens as llama.cpp on the same GGUF, and logits that agree on the next token of a code prompt."""
    from localllm.models.store import Store
    from localllm.quant.mlx_convert import convert_gguf_to_mlx

    gguf_path = Store(coder_home / "models").resolve("qwen2.5-coder:0.5b").weights
    folder = convert_gguf_to_mlx(gguf_path, tmp_path / "qwen-mlx", quantize="q4")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    llama, mlx = _load_pair(gguf_path, folder)
    try:
        texts = ("def f(x):\n    return x**2  # 1234567\n", "I'm héllo  wörld\n\n\t🙂 ÜBER", "<|im_end|> raw")
        for text in texts:
            for special in (True, False):
                assert mlx.tokenize(text, parse_special=special) == llama.tokenize(text, parse_special=special)
        tokens = llama.tokenize(
            "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n"
        )
        _assert_next_token_agrees(llama, mlx, tokens, correlation=0.98)
    finally:
        llama.close()
        mlx.close()


@pytest.mark.models
def test_create_format_mlx_then_chat_answers_paris(smollm2_path, tmp_path, isolated_home):
    """The acceptance path: `localllm create smollm2-mlx --from <smollm2> --format mlx`, then a chat through the
    same client, engine and scheduler as llama.cpp models."""
    from typer.testing import CliRunner

    from localllm import api
    from localllm.cli import app
    from localllm.client.local import LocalClient

    link = tmp_path / "smollm2.gguf"
    link.symlink_to(smollm2_path)
    created = CliRunner().invoke(
        app, ["create", "smollm2-mlx", "--from", str(link), "--format", "mlx"], catch_exceptions=False
    )
    assert created.exit_code == 0, created.output
    client = LocalClient()
    try:
        request = api.ChatRequest(
            model="smollm2-mlx",
            stream=True,
            options={"temperature": 0, "num_predict": 12},
            messages=[api.Message(role="user", content="What is the capital of France?")],
        )
        chunks = list(client.chat(request))
        assert "Paris" in "".join(c.message.content for c in chunks)
        assert chunks[-1].done and chunks[-1].prompt_eval_count > 0
        assert [m.backend for m in client.ps().models] == ["mlx"]
    finally:
        client.close()
