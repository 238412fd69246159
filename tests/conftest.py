"""Shared fixtures.

Every test gets its own empty LOCALLLM_HOME (autouse), so nothing touches the user's models. Tests that need the
real catalog models use `models_home`: a home with `smollm2:135m` and `gemma3:270m` pulled once through the real pull
path into a cache that later runs reuse (LOCALLLM_TEST_CACHE, default ~/.cache/localllm-tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CATALOG_TEST_MODELS = ("smollm2:135m", "gemma3:270m")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALLLM_HOME", str(home))
    monkeypatch.delenv("LOCALLLM_HOST", raising=False)
    monkeypatch.delenv("LOCALLLM_API_KEY", raising=False)
    return home


def _test_cache() -> Path:
    return Path(os.environ.get("LOCALLLM_TEST_CACHE", Path.home() / ".cache" / "localllm-tests")).expanduser()


@pytest.fixture(scope="session")
def models_home() -> Path:
    """A LOCALLLM_HOME holding both catalog models, pulled once (a no-op when the cache has them)."""
    from localllm.models.pull import pull_model
    from localllm.models.store import Store

    home = _test_cache() / "home"
    store = Store(home / "models")
    for name in CATALOG_TEST_MODELS:
        for _ in pull_model(name, store):
            pass
    return home


EMBED_TEST_MODEL = "nomic-embed-text:v1.5"


@pytest.fixture(scope="session")
def embed_home(models_home) -> Path:
    """`models_home` with nomic-embed-text pulled too, on demand, so tests that do not embed do not pay for it."""
    from localllm.models.pull import pull_model
    from localllm.models.store import Store

    for _ in pull_model(EMBED_TEST_MODEL, Store(models_home / "models")):
        pass
    return models_home


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
def reasoner_path(smollm2_path, tmp_path_factory) -> Path:
    """smollm2 written again under a reasoning chat template (tests/reasoning_model.py), once per session."""
    from reasoning_model import write_reasoning_gguf

    return write_reasoning_gguf(smollm2_path, tmp_path_factory.mktemp("reasoner") / "reasoner.gguf")
