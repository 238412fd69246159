"""Nothing escapes the store, nothing corrupt is served, no registry read lasts forever (issue 48).

An import reads another tool's files only from inside that tool's folder (a link out of it is refused, and a failed
import leaves nothing behind); a blob `verify` marked corrupt, or another tool's file changed in place since its
import, is never loaded or served; an adapter that `create` refuses is refused by a pull and an import too; a
registry blob that runs past its declared size is cut off there, and a manifest or a download dripped byte by byte
ends with an error. The servers are the loopback fakes of tests/ollama_registry.py and tests/hfserver.py."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from hfserver import Hub, HubServer, sha256_of, write_tiny_gguf
from ollama_registry import CHATML_GO, Registry, RegistryServer, write_ollama_store
from typer.testing import CliRunner

from localllm import api
from localllm.cli import app
from localllm.errors import IntegrityError, InvalidInput, ModelFormatError, NetworkError
from localllm.models.create import create_model
from localllm.models.others import find_other, find_others, import_model
from localllm.models.pull import pull_model
from localllm.models.store import Store

SECRET = b"root:x:0:0:root:/root:/bin/bash\nsecret-of-the-machine\n"
runner = CliRunner()


@pytest.fixture(autouse=True)
def user_home(tmp_path, monkeypatch) -> Path:
    """A home of the user's own, so the other tools' default folders are the ones written here."""
    home = tmp_path / "user"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("OLLAMA_MODELS", str(home / ".ollama" / "models"))
    for name in ("HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture
def store(isolated_home) -> Store:
    return Store(isolated_home / "models")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", pad_floats=8192).read_bytes()


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder outside every tool's folder, holding what a hostile link points at."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "passwd").write_bytes(SECRET)
    return folder


def blob_name(data: bytes) -> str:
    return f"sha256-{sha256_of(data)}"


def assert_store_holds_nothing_of(store: Store, *files: Path) -> None:
    """No manifest, no blob, no reference record; and no file of the store is, links to or contains `files`."""
    assert store.list() == []
    assert list(store.blobs.dir.glob("sha256-*")) == [] and list(store.blobs.refs_dir.glob("*")) == []
    inodes = {(f.stat().st_dev, f.stat().st_ino) for f in files}
    for path in store.root.rglob("*"):
        if path.is_symlink():
            assert path.resolve() not in {f.resolve() for f in files}, path
        elif path.is_file():
            assert (path.stat().st_dev, path.stat().st_ino) not in inodes, path
            assert SECRET not in path.read_bytes(), path
    assert all(f.stat().st_nlink == 1 for f in files)  # no hard link to them anywhere


# ------------------------------------------------------------------------------------------------ links out of a store


def test_a_license_linked_out_of_ollamas_blobs_is_refused_and_the_failed_import_leaves_nothing(
    user_home, store, tiny, outside
):
    ollama = write_ollama_store(
        user_home / ".ollama" / "models", {"library/leak:latest": [("model", tiny), ("license", SECRET)]}
    )
    license_blob = ollama / "blobs" / blob_name(SECRET)
    license_blob.unlink()
    license_blob.symlink_to(outside / "passwd")  # named by the digest of the file it leads to

    done = runner.invoke(app, ["import", "leak"], catch_exceptions=False)
    assert done.exit_code == 1, done.output
    assert f"{license_blob} leads to {outside / 'passwd'}, outside {ollama / 'blobs'}" in done.output
    # the weights were linked before the license was read: the failed import took that link back
    assert_store_holds_nothing_of(store, outside / "passwd", ollama / "blobs" / blob_name(tiny))


def test_weights_linked_out_of_ollamas_blobs_are_never_hard_linked(user_home, store, tiny, outside):
    theirs = outside / "weights.gguf"
    theirs.write_bytes(tiny)
    ollama = write_ollama_store(user_home / ".ollama" / "models", {"library/out:latest": [("model", tiny)]})
    blob = ollama / "blobs" / blob_name(tiny)
    blob.unlink()
    blob.symlink_to(theirs)
    for link in (True, False):
        with pytest.raises(InvalidInput, match="only files inside that folder are imported") as refused:
            list(import_model(find_other("out"), store, link=link))
        assert refused.value.status_code == 400 and str(theirs) in str(refused.value)
        assert_store_holds_nothing_of(store, theirs)


def test_an_lm_studio_file_linked_out_of_its_folder_is_refused(user_home, store, tiny, outside):
    theirs = outside / "weights.gguf"
    theirs.write_bytes(tiny)
    link = user_home / ".lmstudio" / "models" / "org" / "Repo-GGUF" / "tiny-Q8_0.gguf"
    link.parent.mkdir(parents=True)
    link.symlink_to(theirs)
    with pytest.raises(InvalidInput, match=f"leads to {theirs}, outside"):
        list(import_model(find_others(["lmstudio"])[0], store))
    assert_store_holds_nothing_of(store, theirs)


def test_a_referenced_file_swapped_for_a_link_with_the_same_bytes_is_refused(user_home, store, tiny, outside):
    theirs = user_home / ".lmstudio" / "models" / "org" / "Repo-GGUF" / "tiny-Q8_0.gguf"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(tiny)
    model = find_others(["lmstudio"])[0]
    list(import_model(model, store, link=False))
    assert store.resolve(model.name).weights.is_symlink()
    (outside / "same.gguf").write_bytes(tiny)  # the very bytes, so a re-hash alone would take it
    theirs.unlink()
    theirs.symlink_to(outside / "same.gguf")
    with pytest.raises(IntegrityError, match=f"{theirs}, which is now a link to {outside / 'same.gguf'}"):
        store.resolve(model.name)


# ------------------------------------------------------------------------------------------------ corrupt blobs


def _stored_tiny(store: Store, tiny: bytes, tmp_path: Path) -> Path:
    source = tmp_path / "tiny.gguf"
    source.write_bytes(tiny)
    store.write_model("tiny", weights=store.blobs.add_file(source), license="MIT")
    return store.blobs.path(blob_name(tiny))


def _change_in_place(path: Path, *, keep_mtime: bool = False) -> None:
    """Other bytes at the end of the file, written into the same inode (the file's size stays)."""
    before = path.stat()
    with path.open("r+b") as handle:
        handle.seek(-4096, os.SEEK_END)
        handle.write(b"\xff" * 4096)
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_blob_verify_marked_corrupt_is_never_loaded_or_shown(store, tiny, tmp_path):
    _change_in_place(_stored_tiny(store, tiny, tmp_path))
    assert any("is corrupt" in problem for problem in store.verify())
    with pytest.raises(IntegrityError) as refused:
        store.resolve("tiny")
    assert "found corrupt by `localllm verify`" in str(refused.value)
    assert "localllm verify --repair" in str(refused.value.hint)
    for command in (["run", "--in-process", "tiny", "Hello"], ["show", "tiny"]):
        done = runner.invoke(app, command, catch_exceptions=False)
        assert done.exit_code == 1 and "localllm verify --repair" in done.output, done.output


def test_a_hard_linked_import_changed_in_place_is_caught_at_load_before_verify(user_home, store, tiny):
    theirs = user_home / ".lmstudio" / "models" / "org" / "Repo-GGUF" / "tiny-Q8_0.gguf"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(tiny)
    model = find_others(["lmstudio"])[0]
    list(import_model(model, store))
    assert store.resolve(model.name).weights.stat().st_ino == theirs.stat().st_ino  # a hard link
    os.utime(theirs, ns=(theirs.stat().st_atime_ns, theirs.stat().st_mtime_ns + 10**9))  # touched: re-hashed, fine
    store.resolve(model.name)

    _change_in_place(theirs)
    with pytest.raises(IntegrityError, match="which changed since it was imported"):
        store.resolve(model.name)
    assert store.blobs.marked_corrupt(blob_name(tiny))  # as `verify` would have marked it


def test_a_hard_linked_import_changed_with_its_mtime_kept_is_refused_once_verify_sees_it(user_home, store, tiny):
    theirs = user_home / ".lmstudio" / "models" / "org" / "Repo-GGUF" / "tiny-Q8_0.gguf"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(tiny)
    model = find_others(["lmstudio"])[0]
    list(import_model(model, store))
    _change_in_place(theirs, keep_mtime=True)  # size and mtime as recorded: only a re-hash can tell
    assert store.verify()  # the re-hash tells
    with pytest.raises(IntegrityError, match="found corrupt by `localllm verify`"):
        store.resolve(model.name)


# ------------------------------------------------------------------------------------------------ adapters


def write_lora(path: Path, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> Path:
    """A GGUF LoRA on tiny's token_embd.weight, as convert_lora_to_gguf.py writes one."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 4.0)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight.lora_a", rng.normal(0, 0.02, a_shape).astype(np.float32))
    writer.add_tensor("token_embd.weight.lora_b", rng.normal(0, 0.02, b_shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def lora_3d(tmp_path) -> bytes:
    return write_lora(tmp_path / "3d.gguf", (2, 4, 8), (8, 4)).read_bytes()


def _problem(refusal: ModelFormatError) -> str:
    """What is wrong with the adapter, without the names of the adapter and model (which differ by route)."""
    assert "does not fit" in refusal.message, refusal.message
    return refusal.message.split(": ", 1)[1]


@pytest.fixture
def create_refusal(store, tiny, tmp_path, lora_3d) -> ModelFormatError:
    (tmp_path / "base.gguf").write_bytes(tiny)
    (tmp_path / "bad.gguf").write_bytes(lora_3d)
    request = api.CreateRequest(model="made", modelfile=f"FROM {tmp_path / 'base.gguf'}\nADAPTER bad.gguf\n")
    with pytest.raises(ModelFormatError) as refused:
        list(create_model(request, store, base_dir=tmp_path))
    assert "dimensions past the second" in str(refused.value)
    return refused.value


def test_an_ollama_import_refuses_the_adapter_create_refuses(user_home, store, tiny, lora_3d, create_refusal):
    write_ollama_store(
        user_home / ".ollama" / "models", {"library/lora:latest": [("model", tiny), ("adapter", lora_3d)]}
    )
    with pytest.raises(ModelFormatError) as refused:
        list(import_model(find_other("lora"), store))
    assert refused.value.status_code == 400 and "does not fit lora:latest" in refused.value.message
    assert _problem(refused.value) == _problem(create_refusal)
    assert_store_holds_nothing_of(store)


@pytest.fixture
def registry(tiny, monkeypatch):
    cdn = Hub()
    with HubServer(cdn) as cdn_url:
        registry = Registry(cdn=cdn, cdn_url=cdn_url)
        registry.publish("library/tiny", "latest", [("model", tiny), ("template", CHATML_GO.encode())])
        with RegistryServer(registry) as url:
            monkeypatch.setenv("LOCALLLM_REGISTRY", url)
            monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
            monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
            yield registry
            registry.stop_drip.set()


def test_a_registry_pull_refuses_the_adapter_create_refuses(registry, store, tiny, lora_3d, create_refusal):
    registry.publish("library/lora", "latest", [("model", tiny), ("adapter", lora_3d)])
    with pytest.raises(ModelFormatError) as refused:
        list(pull_model("lora", store))
    assert refused.value.status_code == 400 and "does not fit lora:latest" in refused.value.message
    assert _problem(refused.value) == _problem(create_refusal)
    assert_store_holds_nothing_of(store) and store.blobs.partials() == []


# ------------------------------------------------------------------------------------------------ registry reads


def test_a_blob_running_past_its_declared_size_is_cut_off_there(registry, store, tiny):
    registry.cdn.overrun = 256 << 20  # far more than it declared, sent until we hang up
    with pytest.raises(IntegrityError, match=f"the source sent more than the {len(tiny)} bytes declared") as caught:
        list(pull_model("tiny", store))
    assert "localllm pull" not in str(caught.value) and caught.value.hint
    assert registry.cdn.sent < 64 << 20  # the client stopped reading, not the server sending
    assert_store_holds_nothing_of(store)
    assert store.blobs.partials() == [] and not list(store.blobs.dir.glob("*partial*"))


def _ends(call: Callable[[], object]) -> BaseException | None:
    """Run `call` in a thread; the error it ended with. A bound so that a pull that never ends fails the test."""
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(90)
    assert not thread.is_alive(), "the pull never ended"
    return box.get("error")


def test_a_dripping_manifest_ends_at_the_deadline(registry, store, monkeypatch):
    monkeypatch.setenv("LOCALLLM_PULL_TIMEOUT", "1")
    registry.drip = 0.2  # one byte every 0.2 s: each read arrives well within any read timeout
    error = _ends(lambda: list(pull_model("tiny", store)))
    assert isinstance(error, NetworkError), error
    assert "the manifest of library/tiny:latest did not arrive within 1 s" in error.message
    assert "LOCALLLM_PULL_TIMEOUT" in str(error.hint) and store.list() == []


def test_a_dripping_blob_download_stops_and_can_resume(registry, store, tiny, monkeypatch):
    monkeypatch.setenv("LOCALLLM_PULL_TIMEOUT", "1")
    registry.cdn.chunk, registry.cdn.delay = 64, 0.2
    error = _ends(lambda: list(pull_model("tiny", store)))
    assert isinstance(error, NetworkError) and "the download stopped" in error.message, error
    assert "pull again to resume" in str(error.hint) and store.list() == []
    registry.cdn.chunk, registry.cdn.delay = 64 * 1024, 0.0
    list(pull_model("tiny", store))
    assert store.resolve("tiny").weights.read_bytes() == tiny


def test_a_bad_pull_timeout_names_the_variable(registry, store, monkeypatch):
    monkeypatch.setenv("LOCALLLM_PULL_TIMEOUT", "0")
    done = runner.invoke(app, ["pull", "tiny"], catch_exceptions=False)
    assert done.exit_code == 1 and "LOCALLLM_PULL_TIMEOUT='0' is not valid" in done.output, done.output
