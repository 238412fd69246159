"""The store on tiny GGUFs written in the test: manifests, dedup, copy/delete, verify, MLX folders, partial blobs,
and names or digests that must be refused before any path is touched."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hfserver import sha256_of, write_tiny_gguf

from localllm import api
from localllm.errors import IntegrityError, InvalidInput, InvalidName, ModelFormatError, ModelNotFound
from localllm.models.store import Store


@pytest.fixture
def store(isolated_home) -> Store:
    return Store(isolated_home / "models")


@pytest.fixture
def gguf(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "src" / "tiny.gguf")


@pytest.fixture
def stored(store, gguf) -> str:
    """The digest of the tiny GGUF, stored as `tiny:1`."""
    digest = store.blobs.add_file(gguf)
    store.write_model("tiny:1", weights=digest)
    return digest


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def test_default_root_is_models_under_localllm_home(isolated_home):
    assert Store().root == isolated_home / "models"


def test_same_bytes_are_stored_once(store, gguf, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf.read_bytes())
    first, second = store.blobs.add_file(gguf), store.blobs.add_file(copy)
    assert first == second == "sha256-" + sha256_of(gguf.read_bytes())
    assert [p.name for p in store.blobs.dir.iterdir()] == [first]


def test_write_model_round_trips_every_layer(store, stored, tmp_path):
    adapter = store.blobs.add_bytes(b"adapter weights")
    model = store.write_model(
        "Me/Assistant:V1",
        weights=stored,
        template="{{ messages }}",
        system="Be brief.",
        parameters={"temperature": 0.2, "stop": ["<|im_end|>"]},
        messages=[api.Message(role="user", content="hi"), {"role": "assistant", "content": "hello"}],
        license=["MIT", "extra terms"],
        draft="smollm2:135m",
        adapters=[adapter],
    )
    assert model.name == "me/assistant:v1"
    assert model.weights == store.blobs.path(stored) and model.format == "gguf"
    assert (model.template, model.system) == ("{{ messages }}", "Be brief.")
    assert model.parameters == {"temperature": 0.2, "stop": ["<|im_end|>"]}
    assert [(m.role, m.content) for m in model.messages] == [("user", "hi"), ("assistant", "hello")]
    assert model.license == "MIT\n\nextra terms"
    assert model.draft == "smollm2:135m"
    assert model.adapters == [api.LoraAdapter(path=str(store.blobs.path(adapter)), scale=1.0)]
    assert model.details.family == "llama" and model.digest.startswith("sha256-")


def test_details_are_cached_in_the_manifest_so_list_opens_no_weights(store, stored):
    manifest = json.loads((store.manifests_dir / "localllm/library/tiny/1").read_text())
    assert manifest["config"]["details"]["family"] == "llama"
    store.blobs.path(stored).write_bytes(b"not a gguf any more")  # list must not notice: it reads the manifest only
    (row,) = store.list()
    assert (row.name, row.details.family, row.details.format) == ("tiny:1", "llama", "gguf")
    assert row.digest == store.resolve("tiny:1").digest.removeprefix("sha256-")


def test_resolve_of_a_missing_model_says_how_to_pull_it(store):
    with pytest.raises(ModelNotFound, match="localllm pull smollm2:135m"):
        store.resolve("smollm2:135m")
    assert not store.exists("smollm2:135m")


def test_a_gguf_path_resolves_without_a_manifest(store, gguf):
    model = store.resolve(str(gguf))
    assert model.weights == gguf.resolve() and model.details.family == "llama" and store.exists(str(gguf))
    assert store.list() == []


def test_a_path_that_is_not_a_gguf_is_a_format_error(store, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but truncated")
    with pytest.raises(ModelFormatError):
        store.resolve(str(bad))


def test_copy_shares_the_manifest_and_delete_keeps_blobs_in_use(store, stored):
    store.copy("tiny:1", "other/tiny")
    assert store.resolve("other/tiny").digest == store.resolve("tiny:1").digest
    store.delete("tiny:1")
    assert store.blobs.has(stored) and [row.name for row in store.list()] == ["other/tiny:latest"]
    store.delete("other/tiny")
    assert not store.blobs.has(stored) and store.list() == []
    assert not any(store.manifests_dir.iterdir())


def test_delete_keeps_text_layers_other_models_share(store, stored):
    store.write_model("a", weights=stored, system="shared")
    store.write_model("b", weights=stored, system="shared")
    store.delete("a")
    assert store.resolve("b").system == "shared"


def test_delete_of_an_unknown_model_is_model_not_found(store):
    with pytest.raises(ModelNotFound):
        store.delete("nothing:here")


def test_write_model_refuses_blobs_not_in_the_store(store):
    with pytest.raises(InvalidInput, match="not in the store"):
        store.write_model("x", weights="sha256-" + "0" * 64)
    assert store.list() == []


def test_verify_names_corrupt_and_missing_blobs(store, stored):
    assert store.verify() == [] and store.verify("tiny:1") == []
    path = store.blobs.path(stored)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    (problem,) = store.verify()
    assert problem.startswith(f"tiny:1: blob {stored} is corrupt")
    path.unlink()
    assert store.verify("tiny:1") == [f"tiny:1: blob {stored} is missing"]


def test_resolving_a_model_whose_blob_vanished_says_so(store, stored):
    store.blobs.path(stored).unlink()
    with pytest.raises(IntegrityError, match="missing"):
        store.resolve("tiny:1")


def test_a_manifest_that_is_not_json_is_a_clear_error(store, stored):
    (store.manifests_dir / "localllm/library/tiny/1").write_text("{broken")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        store.resolve("tiny:1")
    assert store.list() == []


def test_leftover_temp_files_are_not_models(store, stored):
    (store.manifests_dir / "localllm/library/tiny/.1.tmp-abc").write_text("{}")
    (store.blobs.dir / ".tmp-abc").write_bytes(b"half")
    assert [row.name for row in store.list()] == ["tiny:1"] and store.verify() == []


# ------------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "name",
    [
        "../evil",
        "../../etc/passwd",
        "a/../../b",
        "/abs/name",
        "me/..",
        "x:../y",
        "bad name",
        "x" * 300,
        "nul\x00",
        "hf.co/../x",
    ],
)
def test_invalid_names_touch_nothing(store, stored, name):
    before = _tree(store.root)
    for action in (
        lambda: store.write_model(name, weights=stored),
        lambda: store.resolve(name),
        lambda: store.delete(name),
        lambda: store.copy("tiny:1", name),
        lambda: store.copy(name, "y"),
    ):
        with pytest.raises(InvalidName):
            action()
    assert _tree(store.root) == before


def test_a_file_path_cannot_be_a_store_name(store, stored):
    with pytest.raises(InvalidName, match="file path"):
        store.write_model("./x.gguf", weights=stored)


@pytest.mark.parametrize("digest", ["sha256-../../etc/passwd", "sha256-" + "A" * 64, "md5-" + "0" * 32, "", "x"])
def test_invalid_digests_touch_nothing(store, stored, digest):
    before = _tree(store.root)
    with pytest.raises(InvalidName, match="digest"):
        store.blobs.path(digest)
    with pytest.raises(InvalidName):
        store.write_model("y", weights=digest)
    with pytest.raises(InvalidName):
        with store.blobs.open_partial(digest):
            pass
    assert _tree(store.root) == before


# ------------------------------------------------------------------------------------------------------- MLX


def test_mlx_weights_materialise_as_a_folder_of_links(store):
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model.safetensors": b"\0" * 32,
        "tokenizer/tokenizer.json": b"{}",
    }
    digests = {name: store.blobs.add_bytes(data) for name, data in files.items()}
    model = store.write_model("mlx-tiny", weights=digests, fmt="mlx")
    assert model.format == "mlx" and model.weights.is_dir()
    assert {str(p.relative_to(model.weights)): p.read_bytes() for p in model.weights.rglob("*") if p.is_file()} == files
    assert store.weights_of("mlx-tiny") == ("mlx", digests)
    store.delete("mlx-tiny")
    assert not model.weights.exists() and not any(store.blobs.dir.iterdir())


@pytest.mark.parametrize("bad", ["../escape.json", "/etc/passwd", "a/../../b", "", ".hidden/x"])
def test_mlx_file_names_cannot_escape_the_folder(store, bad):
    digest = store.blobs.add_bytes(b"x")
    with pytest.raises(InvalidName):
        store.write_model("mlx-bad", weights={bad: digest}, fmt="mlx")
    assert store.list() == []


# ------------------------------------------------------------------------------------------------------- partials


def test_a_partial_blob_resumes_and_commits(store):
    data = os.urandom(300_000)
    digest = "sha256-" + sha256_of(data)
    with store.blobs.open_partial(digest, size=len(data)) as partial:
        partial.write(data[:100_000])  # then the process "dies": the partial file stays
    with store.blobs.open_partial(digest, size=len(data)) as partial:
        assert partial.completed == 100_000 and not partial.done
        partial.write(data[100_000:])
        assert partial.commit() == digest
    assert store.blobs.path(digest).read_bytes() == data
    assert not (store.blobs.dir / f"{digest}-partial").exists()
    with store.blobs.open_partial(digest, size=len(data)) as partial:
        assert partial.done


def test_a_partial_blob_with_other_bytes_is_discarded(store):
    digest = "sha256-" + sha256_of(b"expected")
    with store.blobs.open_partial(digest, size=8) as partial:
        partial.write(b"otherbyt")
        with pytest.raises(IntegrityError, match="sha256 mismatch.*from test source"):
            partial.commit("test source")
    assert not store.blobs.has(digest) and list(store.blobs.dir.iterdir()) == []


def test_a_partial_blob_without_a_known_digest_is_named_by_its_bytes(store):
    with store.blobs.open_partial(None, key="http://example.invalid/x.gguf") as partial:
        partial.write(b"abc")
        digest = partial.commit()
    assert digest == "sha256-" + sha256_of(b"abc") and store.blobs.has(digest)


def test_a_manifest_that_is_not_json_can_still_be_removed(store, stored):
    (store.manifests_dir / "localllm/library/tiny/1").write_text("{broken")
    store.delete("tiny:1")
    assert not store.exists("tiny:1") and store.blobs.has(stored)  # its blob waits for prune
    assert store.prune().removed == [f"blobs/{stored}"] and not store.blobs.has(stored)
