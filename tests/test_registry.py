"""Pull by Ollama library name from a loopback registry that speaks Ollama's protocol (tests/ollama_registry.py):
manifest media types mapped onto our layers, blobs redirected to a second loopback "CDN", a 404 for an unknown tag,
bytes that do not match their digest refused, resume after a dropped connection, offline and plain-http rules."""

from __future__ import annotations

import json

import pytest
from hfserver import Hub, HubServer, sha256_of, write_tiny_gguf
from ollama_registry import CHATML_GO, MANIFEST_MEDIA, Registry, RegistryServer

from localllm import api
from localllm.errors import ConfigError, IntegrityError, InvalidInput, ModelFormatError, ModelNotFound
from localllm.models.names import parse_ref
from localllm.models.pull import pull_model
from localllm.models.registry import registry_base
from localllm.models.store import MEDIA_PROJECTOR, Store

PARAMS = {"stop": ["<|im_end|>"], "temperature": 0.2, "num_ctx": 512, "mirostat": 0}
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", pad_floats=8192 * 4).read_bytes()


def _layers(weights: bytes) -> list[tuple[str, bytes]]:
    return [
        ("model", weights),
        ("template", CHATML_GO.encode()),
        ("system", b"You are terse."),
        ("params", json.dumps(PARAMS).encode()),
        ("license", b"MIT License"),
        ("messages", json.dumps(MESSAGES).encode()),
    ]


@pytest.fixture
def registry(tiny, monkeypatch):
    cdn = Hub()
    with HubServer(cdn) as cdn_url:
        registry = Registry(cdn=cdn, cdn_url=cdn_url)
        registry.publish("library/tiny", "latest", _layers(tiny))
        with RegistryServer(registry) as url:
            monkeypatch.setenv("LOCALLLM_REGISTRY", url)
            monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
            monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
            registry.url = url  # type: ignore[attr-defined]
            yield registry


@pytest.fixture
def store(isolated_home) -> Store:
    return Store(isolated_home / "models")


def test_a_library_name_pulls_every_layer_into_its_place(registry, store, tiny):
    progress = list(pull_model("tiny", store))
    model = store.resolve("tiny")
    assert model.name == "tiny:latest" and model.weights.read_bytes() == tiny
    assert model.template == CHATML_GO and model.system == "You are terse."
    assert model.parameters == {"stop": ["<|im_end|>"], "temperature": 0.2, "num_ctx": 512}  # mirostat: ignored
    assert [m.content for m in model.messages] == ["Hi", "Hello!"] and model.license == "MIT License"
    assert store.source_of("tiny") == {"registry": registry.url, "name": "library/tiny:latest"}
    # the protocol: the manifest asked for with Docker's media type, each layer by digest, redirected to the CDN
    assert registry.requests[0] == ("/v2/library/tiny/manifests/latest", MANIFEST_MEDIA)
    digest = sha256_of(tiny)
    assert f"/v2/library/tiny/blobs/sha256:{digest}" in registry.blob_requests()
    assert registry.cdn.downloads_of(f"/files/{digest}") == 1
    # progress per layer, as Ollama's pull stream: digest, total and completed
    weights = [p for p in progress if p.digest == f"sha256-{digest}" and p.total is not None]
    assert weights[-1].completed == weights[-1].total == len(tiny)
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    assert store.verify() == []


def test_a_second_pull_transfers_no_layer(registry, store):
    list(pull_model("tiny:latest", store))
    before = len(registry.cdn.requests)
    progress = list(pull_model("library/tiny", store))
    assert len(registry.cdn.requests) == before and registry.requests[-1][0].endswith("/manifests/latest")
    assert all(p.completed == p.total for p in progress if p.total is not None)


def test_an_unknown_tag_is_a_404_that_says_where_it_looked(registry, store):
    with pytest.raises(ModelNotFound) as caught:
        list(pull_model("tiny:70b", store))
    message = str(caught.value)
    assert "not in the catalog or the store" in message
    assert f"the registry {registry.url} has no library/tiny:70b" in message
    assert store.list() == []


def test_a_layer_whose_bytes_do_not_match_its_digest_is_refused(registry, store, tiny):
    other = bytes(reversed(tiny))  # same length, other bytes
    registry.publish("library/bad", "latest", _layers(tiny)[:1], served={"model": other})
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        list(pull_model("bad", store))
    assert store.list() == [] and not store.blobs.has(f"sha256-{sha256_of(tiny)}")
    assert store.blobs.partials() == []


def test_a_dropped_connection_resumes_where_it_stopped(registry, store, tiny):
    registry.cdn.drop_after, registry.cdn.drops_left = 40_000, 2
    list(pull_model("tiny", store))
    assert store.resolve("tiny").weights.read_bytes() == tiny
    assert [r for r in registry.cdn.ranges() if r] == ["bytes=40000-", "bytes=80000-"]


def test_a_layer_of_an_unknown_media_type_is_refused_by_name(registry, store, tiny):
    registry.publish("library/odd", "latest", [("model", tiny), ("application/vnd.ollama.image.tensor", b"x")])
    with pytest.raises(ModelFormatError, match="application/vnd.ollama.image.tensor"):
        list(pull_model("odd", store))
    assert store.list() == []


def test_a_vision_projector_is_stored_with_the_model(registry, store, tiny):
    registry.publish("library/eyes", "v1", [("model", tiny), ("projector", b"projector bytes")])
    list(pull_model("eyes:v1", store))
    assert store.resolve("eyes:v1").projector is not None  # the model reads images through it
    manifest = json.loads((store.manifests_dir / "localllm" / "library" / "eyes" / "v1").read_text())
    assert [layer["mediaType"] for layer in manifest["layers"]].count(MEDIA_PROJECTOR) == 1
    assert store.verify() == []


def test_a_name_with_a_loopback_host_is_pulled_from_that_host(registry, store, tiny):
    host = registry.url.removeprefix("http://")
    list(pull_model(f"{host}/library/tiny:latest", store))
    assert store.resolve(f"{host}/library/tiny:latest").weights.read_bytes() == tiny
    assert not store.exists("tiny")


def test_offline_never_asks_the_registry(registry, store, monkeypatch):
    monkeypatch.setenv("LOCALLLM_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="LOCALLLM_OFFLINE is set, so the registry .* was not asked"):
        list(pull_model("tiny", store))
    assert registry.requests == []
    monkeypatch.delenv("LOCALLLM_OFFLINE")
    list(pull_model("tiny", store))
    monkeypatch.setenv("LOCALLLM_OFFLINE", "1")
    asked = len(registry.requests)
    assert [p.status for p in pull_model("tiny", store)] == ["pulling manifest", "success"]
    assert len(registry.requests) == asked


def test_plain_http_needs_a_loopback_host_or_insecure(monkeypatch):
    monkeypatch.setenv("LOCALLLM_REGISTRY", "http://registry.example")
    with pytest.raises(InvalidInput, match="--insecure"):
        registry_base(parse_ref("tiny"))
    assert registry_base(parse_ref("tiny"), insecure=True) == "http://registry.example"
    assert registry_base(parse_ref("registry.example/me/tiny")) == "https://registry.example"
    assert registry_base(parse_ref("registry.example/me/tiny"), insecure=True) == "http://registry.example"
    assert registry_base(parse_ref("localhost:5000/me/tiny")) == "http://localhost:5000"
    monkeypatch.setenv("LOCALLLM_REGISTRY", "ftp://registry.example/v2")
    with pytest.raises(ConfigError, match="LOCALLLM_REGISTRY"):
        registry_base(parse_ref("tiny"))


@pytest.mark.models
def test_a_pulled_library_model_answers_a_chat(registry, store, smollm2_path):
    from localllm.client.local import LocalClient

    registry.publish("library/smol", "135m", _layers(smollm2_path.read_bytes()))
    list(pull_model("smol:135m", store))
    client = LocalClient(store)
    try:
        request = api.ChatRequest(
            model="smol:135m",
            messages=[api.Message(role="user", content="What is the capital of France?")],
            stream=False,
            options={"temperature": 0, "num_predict": 8, "num_parallel": 1, "spec_type": "none"},
        )
        chunks = list(client.chat(request))
    finally:
        client.close()
    assert "".join(chunk.message.content for chunk in chunks).strip()
    assert chunks[-1].prompt_eval_count > 0


def test_pull_help_states_the_order_names_resolve_in():
    from typer.testing import CliRunner

    from localllm.cli import app

    text = " ".join(CliRunner().invoke(app, ["pull", "--help"], env={"COLUMNS": "200"}).output.split())
    order = ["URL", "catalog name", "hf.co/", ".gguf file", "Ollama-style registry", "LOCALLLM_REGISTRY"]
    assert [text.index(word) for word in order] == sorted(text.index(word) for word in order)


def test_verify_repair_fetches_a_corrupt_layer_again_from_the_registry(registry, store, tiny):
    from localllm.models.repair import repair_blobs

    list(pull_model("tiny", store))
    blob = store.resolve("tiny").weights
    blob.write_bytes(bytes(reversed(tiny)))
    assert len(store.verify()) == 1
    statuses = [p.status for p in repair_blobs(store)]
    assert any(s.startswith("repairing") and "from the registry (tiny:latest)" in s for s in statuses)
    assert store.verify() == [] and blob.read_bytes() == tiny
