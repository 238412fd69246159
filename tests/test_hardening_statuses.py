"""Wrong statuses and small leaks from issue 34's second hardening round, each against the real parts: a model
whose head_count is 0, an offline pull of an absent name, a blob collected while its request waited for the load,
and a flipped array count that made `show --verbose` build hundreds of megabytes before its clean error."""

from __future__ import annotations

import struct
from pathlib import Path

import httpx
import pytest
from server_harness import SMALL, private_home, served
from tiny_models import write_tiny_llama

from localllm import api
from localllm.engine.pool import ModelPool
from localllm.errors import ModelFormatError, ModelNotFound
from localllm.models.create import create_model
from localllm.models.store import Store
from localllm.quant.gguf import MAX_WHOLE_ITEMS, read_arrays


def peak_rss_reset() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM, the peak resident size, restarts from the current one
    return peak_rss()


def peak_rss() -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_a_flipped_array_count_is_refused_before_it_is_decoded(tmp_path):
    """A 100 MB file whose token_type count has bit 24 set: its bytes allow 16 million int32s, which decoded
    whole (show --verbose) built about 700 MB of Python ints before the clean error."""
    path = write_tiny_llama(tmp_path / "flipped.gguf")
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.token_type"
    at = data.index(key) + len(key) + 8  # past the value type and the item type: the count
    (count,) = struct.unpack_from("<Q", data, at)
    struct.pack_into("<Q", data, at, count | 1 << 24)
    path.write_bytes(data)
    with path.open("r+b") as handle:
        handle.truncate(100 * 2**20)  # a hole: the bytes the count claims, without writing them
    before = peak_rss_reset()
    with pytest.raises(ModelFormatError, match=f"holds {count | 1 << 24} items; localllm decodes at most"):
        read_arrays(path, frozenset({key.decode()}))
    assert peak_rss() - before < 64 * 2**20
    assert MAX_WHOLE_ITEMS >= 4 * 262_144  # the largest real vocabularies still decode whole


# ---------------------------------------------------------------------------------------------------------- pool


@pytest.fixture
def tiny_store(tmp_path) -> Store:
    store = Store(tmp_path / "models")
    for name, seed in (("race", 0), ("other", 1)):  # two blobs: other weights, another digest
        path = write_tiny_llama(tmp_path / f"{name}.gguf", seed=seed)
        for _ in create_model(api.CreateRequest(model=name, **{"from": str(path)}), store):
            pass
    return store


def test_a_blob_collected_while_its_request_waited_is_a_clean_404(tiny_store):
    """`cp other race` while a request for race has resolved it but not yet loaded it: race's old blob is
    collected, and that request used to get a 400 naming the internal blob path."""
    resolved = tiny_store.resolve("race")
    tiny_store.copy("other", "race")
    assert not resolved.weights.exists()
    pool = ModelPool(tiny_store)
    try:
        with pytest.raises(ModelNotFound) as gone:
            with pool.acquire(resolved, api.LoadOptions(num_ctx=64)):
                pass
        assert "race:latest was replaced or removed while this request waited" in str(gone.value)
        assert "sha256" not in str(gone.value) and str(tiny_store.root) not in str(gone.value)
        with pool.acquire(tiny_store.resolve("race"), api.LoadOptions(num_ctx=64)) as loaded:  # the retry works
            assert loaded.model.digest == tiny_store.resolve("other").digest
    finally:
        pool.close()


# ---------------------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(models_home, tmp_path_factory):
    home = private_home(models_home, tmp_path_factory.mktemp("statuses"))
    with served(home, LOCALLLM_HOME=str(home), LOCALLLM_OFFLINE="1") as url:
        yield url


def answers_a_plain_request(url: str) -> None:
    reply = httpx.post(
        f"{url}/api/generate",
        json={"model": "smollm2:135m", "prompt": "Hi", "stream": False, "options": SMALL},
        timeout=120,
    )
    assert reply.status_code == 200 and reply.json()["done"], reply.text


@pytest.mark.models
def test_a_model_without_attention_heads_is_a_clean_400(server, tmp_path):
    path = write_tiny_llama(tmp_path / "headless.gguf", hparams={"head_count": 0})
    made = httpx.post(f"{server}/api/create", json={"model": "headless", "from": str(path), "stream": False})
    assert made.status_code == 200, made.text
    reply = httpx.post(
        f"{server}/api/generate", json={"model": "headless", "prompt": "Hi", "stream": False}, timeout=120
    )
    assert reply.status_code == 400, reply.text  # was a 500: ZeroDivisionError in the memory plan
    answers_a_plain_request(server)


@pytest.mark.models
@pytest.mark.parametrize("name", ["gemma3:270m", "hf.co/someone/absent-GGUF:Q4_K_M"])
def test_an_offline_pull_of_a_name_not_stored_is_404(server, name):
    httpx.request("DELETE", f"{server}/api/delete", json={"model": name})  # a catalog name this home lacks now
    reply = httpx.post(f"{server}/api/pull", json={"model": name, "stream": False}, timeout=60)
    assert reply.status_code == 404, reply.text
    assert "LOCALLLM_OFFLINE" in reply.json()["error"]
    answers_a_plain_request(server)
