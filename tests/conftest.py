"""Shared fixtures.

Every test gets its own empty LOCALLLM_HOME (autouse), so nothing touches the user's models. Tests that need the
real catalog models use `models_home`: a home with `smollm2:135m` and `gemma3:270m` pulled once through the real pull
path into a cache that later runs reuse (LOCALLLM_TEST_CACHE, default ~/.cache/localllm-tests)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

CATALOG_TEST_MODELS = ("smollm2:135m", "gemma3:270m")
CODER_TEST_MODEL = "qwen2.5-coder:0.5b"  # tool calls and fill in the middle: pulled only by the tests that use it


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALLLM_HOME", str(home))
    monkeypatch.delenv("LOCALLLM_HOST", raising=False)
    monkeypatch.delenv("LOCALLLM_API_KEY", raising=False)
    # A name found in no catalog is asked of the registry: a closed loopback port answers at once, offline.
    monkeypatch.setenv("LOCALLLM_REGISTRY", "http://127.0.0.1:9")
    return home


def _test_cache() -> Path:
    return Path(os.environ.get("LOCALLLM_TEST_CACHE", Path.home() / ".cache" / "localllm-tests")).expanduser()


@pytest.fixture(scope="session")
def models_home() -> Path:
    """A LOCALLLM_HOME holding both catalog models, pulled once (a no-op when the cache has them)."""
    from localllm.models.store import Store

    home = _test_cache() / "home"
    store = Store(home / "models")
    for name in CATALOG_TEST_MODELS:
        _pulled(store, name)
    return home


def _pulled(store, name: str) -> None:
    """Pull `name` into `store` (a no-op when there) with its load check remembered, flash attention trial and all.
    A first load runs the trial in the background and applies it from the next load: remembered here, every load
    in the suite runs the model alike, whenever a trial would have landed."""
    from localllm import api
    from localllm.backends import load_check_memory
    from localllm.backends.llama_cpp import probe
    from localllm.models.pull import pull_model

    for _ in pull_model(name, store):
        pass
    memory, weights = load_check_memory(store.root), store.resolve(name).weights
    if probe.LoadProbe(memory).check(weights, api.LoadOptions()).trial_due:
        probe.start_trial(memory, weights, api.LoadOptions())
        probe.wait_for_trials()


@pytest.fixture(scope="session")
def pull_catalog(models_home) -> Callable[[str], None]:
    """Pull a catalog model into models_home on demand (a no-op when the cache has it), for a test whose models
    depend on its parameters (the Modelfiles' FROM and DRAFT)."""
    from localllm.models.store import Store

    store = Store(models_home / "models")
    return lambda name: _pulled(store, name)


@pytest.fixture(scope="session")
def coder_home(models_home, pull_catalog) -> Path:
    """models_home with qwen2.5-coder:0.5b pulled too (a real tool-calling, fill-in-the-middle model)."""
    pull_catalog(CODER_TEST_MODEL)
    return models_home


PAIR_TARGET_MODEL = "qwen2.5-coder:1.5b"  # drafted by CODER_TEST_MODEL: the real pair (1.1 GB, slow tests only)


@pytest.fixture(scope="session")
def pair_home(coder_home, pull_catalog) -> Path:
    """`coder_home` with qwen2.5-coder:1.5b pulled too: the target of the real draft pair, for the slow tests."""
    pull_catalog(PAIR_TARGET_MODEL)
    return coder_home


EMBED_TEST_MODEL = "nomic-embed-text:v1.5"


@pytest.fixture(scope="session")
def embed_home(models_home, pull_catalog) -> Path:
    """`models_home` with nomic-embed-text pulled too, on demand, so tests that do not embed do not pay for it."""
    pull_catalog(EMBED_TEST_MODEL)
    return models_home


PINNED_CODER = "coder-pinned"


@pytest.fixture(scope="module")
def coder_url(coder_home, tmp_path_factory):
    """The real server on qwen2.5-coder:0.5b as `coder-pinned`: greedy, one thread, no speculation, one slot, so
    that answers to the same request are the same tokens (numerics change with batch shapes and thread counts)."""
    from server_harness import local_client, private_home, served

    from localllm import api

    home = private_home(coder_home, tmp_path_factory.mktemp("coder"))
    client = local_client(home)
    pinned = {"temperature": 0, "num_thread": 1, "spec_type": "none"}
    create = {"model": PINNED_CODER, "from": CODER_TEST_MODEL, "parameters": pinned}
    for _ in client.create(api.CreateRequest.model_validate(create)):
        pass
    client.close()
    with served(home, LOCALLLM_CONTEXT_LENGTH="2048", LOCALLLM_NUM_PARALLEL="1") as url:
        yield url


@pytest.fixture(scope="module")
def base_url(models_home):
    """The real server on the catalog models (1024-token contexts, 2 slots), one per test module; a module that needs
    other settings defines its own `base_url`."""
    from server_harness import served

    with served(models_home, LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_NUM_PARALLEL="2") as url:
        yield url


@pytest.fixture(scope="session")
def smollm2_path(models_home) -> Path:
    from localllm.models.store import Store

    return Store(models_home / "models").resolve("smollm2:135m").weights


@pytest.fixture(scope="session")
def gemma3_path(models_home) -> Path:
    from localllm.models.store import Store

    return Store(models_home / "models").resolve("gemma3:270m").weights


@pytest.fixture(scope="session")
def smollm2_mlx(smollm2_path, tmp_path_factory) -> Path:
    """smollm2 converted to an MLX folder, once per session (skips where the mlx extra is missing)."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from localllm.quant.mlx_convert import convert_gguf_to_mlx

    return convert_gguf_to_mlx(smollm2_path, tmp_path_factory.mktemp("smollm2-mlx") / "mlx")


@pytest.fixture(scope="session")
def reasoner_path(smollm2_path, tmp_path_factory) -> Path:
    """smollm2 written again under a reasoning chat template (tests/reasoning_model.py), once per session."""
    from reasoning_model import write_reasoning_gguf

    return write_reasoning_gguf(smollm2_path, tmp_path_factory.mktemp("reasoner") / "reasoner.gguf")
