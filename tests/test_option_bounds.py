"""Option bounds from the model and the machine (models/options.py): explicit values out of bounds are refused with
the value, the bound and a remedy; defaults are clamped, so a short-context model still loads with the defaults."""

from __future__ import annotations

import math
import os

import pytest
from pydantic import ValidationError

from localllm import api
from localllm.errors import InvalidInput
from localllm.models.options import (
    ModelFacts,
    bound_load,
    bound_sampling,
    context_size,
    effective_load,
    resolve_options,
)
from localllm.models.store import ResolvedModel

SHORT = ModelFacts(context_length=2048, vocab_size=32000)


def bounded(options: dict, facts: ModelFacts = SHORT) -> api.LoadOptions:
    model = ResolvedModel(name="m", digest="sha256-" + "0" * 64, weights=os.devnull, format="gguf")  # type: ignore
    load, _ = resolve_options(model, options)
    return bound_load(effective_load(load), load.model_fields_set, facts)


def test_default_context_is_clamped_to_the_trained_one(monkeypatch):
    monkeypatch.setenv("LOCALLLM_CONTEXT_LENGTH", "8192")
    assert bounded({}).num_ctx == 2048
    assert bounded({"num_ctx": 1024}).num_ctx == 1024


def test_explicit_context_over_the_trained_one_is_refused():
    with pytest.raises(InvalidInput, match=r"num_ctx 4096 is over 2048.*use num_ctx 2048 or less"):
        bounded({"num_ctx": 4096})


def test_threads_are_bounded_by_the_cores(monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.setenv("LOCALLLM_NUM_THREAD", str(cores * 4))
    assert bounded({}).num_thread == cores
    with pytest.raises(InvalidInput, match=f"num_thread {cores + 1} is over {cores}"):
        bounded({"num_thread": cores + 1})


def test_threads_left_unset_stay_unset_for_the_engine_to_tune(monkeypatch):
    monkeypatch.delenv("LOCALLLM_NUM_THREAD", raising=False)
    assert bounded({}).num_thread is None
    monkeypatch.setenv("LOCALLLM_NUM_THREAD", "auto")
    assert bounded({}).num_thread is None
    assert bounded({"num_thread": 1}).num_thread == 1


def test_context_cells_past_32_bits_are_refused_without_model_facts():
    with pytest.raises(InvalidInput, match="num_parallel"):
        bounded({"num_ctx": 2**26, "num_parallel": 128}, ModelFacts())


def test_batch_is_clamped_to_the_context():
    assert bounded({"num_batch": 10**6, "num_ctx": 512, "num_parallel": 2}).num_batch == 1024


def test_sampling_window_and_top_k_are_bounded_by_the_loaded_model():
    explicit = api.SamplingOptions(repeat_last_n=5000)
    with pytest.raises(InvalidInput, match="repeat_last_n 5000 is over 1024"):
        bound_sampling(explicit, n_ctx=1024, n_vocab=32000)
    with pytest.raises(InvalidInput, match="top_k 40000 is over 32000"):
        bound_sampling(api.SamplingOptions(top_k=40000), n_ctx=1024, n_vocab=32000)
    assert bound_sampling(api.SamplingOptions(), n_ctx=32, n_vocab=32000).repeat_last_n == 32  # a default: clamped


def test_defaults_are_filled_once_and_size_the_backend_s_context(monkeypatch):
    monkeypatch.setenv("LOCALLLM_CONTEXT_LENGTH", "1536")
    monkeypatch.setenv("LOCALLLM_NUM_PARALLEL", "3")
    assert context_size(effective_load(api.LoadOptions())) == (3, 1536)
    assert context_size(effective_load(api.LoadOptions(num_ctx=512, num_parallel=1))) == (1, 512)
    with pytest.raises(ValueError, match="effective_load"):  # a backend never guesses a default of its own
        context_size(api.LoadOptions(num_ctx=512))


@pytest.mark.parametrize(
    ("wire", "seconds"),
    [
        (0, 0.0),
        (300, 300.0),
        ("300", 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("500ms", 0.5),
        (".5s", 0.5),
        (-1, math.inf),
        ("-1s", math.inf),
        ("999999999h", math.inf),
        (10**400, math.inf),
    ],
)
def test_keep_alive_is_one_duration_read_as_ollama_reads_it(wire, seconds):
    request = api.ChatRequest(model="m", keep_alive=wire)
    assert request.keep_alive == seconds
    # Forever goes over the wire as Ollama's -1 (JSON has no infinity) and reads back the same.
    sent = request.model_dump(mode="json")["keep_alive"]
    assert api.ChatRequest.model_validate({"model": "m", "keep_alive": sent}).keep_alive == seconds


@pytest.mark.parametrize("wire", ["soon", "1h 30m", "5x", "", float("nan"), True])
def test_a_bad_keep_alive_is_refused_naming_the_field(wire):
    with pytest.raises(ValidationError, match="keep_alive"):
        api.GenerateRequest(model="m", keep_alive=wire)
    with pytest.raises(InvalidInput, match="--keepalive .* is not valid: expected"):
        api.parse_keep_alive(wire, what="--keepalive")  # type: ignore[arg-type]
