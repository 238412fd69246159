"""Models of Ollama, LM Studio and the Hugging Face cache, used in place: fake stores of those tools written here
(real GGUF files), imported by reference (a hard link, or a checked path), answering like the original file; a
changed or vanished file is refused with a message, and `rm` / `prune` never touch the other tool's files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hfserver import write_tiny_gguf
from ollama_registry import CHATML_GO, write_ollama_store
from typer.testing import CliRunner

from localllm import api
from localllm.cli import app
from localllm.errors import IntegrityError, InvalidInput
from localllm.models.others import find_other, find_others, import_model
from localllm.models.store import Store

PARAMS = {"stop": ["<|im_end|>"], "temperature": 0.3}
GREEDY = {"temperature": 0, "num_predict": 10, "num_ctx": 256, "num_parallel": 1, "spec_type": "none"}
runner = CliRunner()


def _ollama_layers(weights: bytes) -> list[tuple[str, bytes]]:
    return [
        ("model", weights),
        ("template", CHATML_GO.encode()),
        ("system", b"Answer in one word."),
        ("params", json.dumps(PARAMS).encode()),
        ("license", b"Apache 2.0"),
    ]


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


@pytest.fixture(scope="module")
def tiny2(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny2.gguf", name="tiny two").read_bytes()


def _snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under `root` (links followed): size, mtime and sha256, to show nothing of it changed."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            stat = path.stat()
            files[str(path.relative_to(root))] = (
                stat.st_size,
                stat.st_mtime_ns,
                hashlib.sha256(path.read_bytes()).hexdigest(),
            )
    return files


def _lmstudio_file(home: Path, data: bytes, name: str = "Tiny-Q8_0.gguf") -> Path:
    path = home / ".lmstudio" / "models" / "tiny-org" / "Tiny-GGUF" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _hf_cache_file(home: Path, data: bytes, name: str = "tiny.Q4_K_M.gguf") -> Path:
    """A file in the Hugging Face cache as huggingface_hub lays it out: a blob, and a snapshot symlink to it."""
    repo = home / ".cache" / "huggingface" / "hub" / "models--tiny-org--Tiny-GGUF"
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    link = repo / "snapshots" / "abc123" / name
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return link


# ------------------------------------------------------------------------------------------------------- Ollama


def test_an_ollama_model_is_a_hard_link_that_keeps_its_name_and_settings(user_home, store, tiny):
    ollama = write_ollama_store(user_home / ".ollama" / "models", {"library/tiny:1b": _ollama_layers(tiny)})
    before = _snapshot(ollama)
    list(import_model(find_other("tiny:1b"), store))
    model = store.resolve("tiny:1b")
    theirs = ollama / "blobs" / f"sha256-{hashlib.sha256(tiny).hexdigest()}"
    assert model.weights.stat().st_ino == theirs.stat().st_ino  # the same file: no second copy
    assert model.template == CHATML_GO and model.system == "Answer in one word."
    assert model.parameters == PARAMS and model.license == "Apache 2.0"
    assert store.verify() == []
    store.delete("tiny:1b")
    store.prune()
    assert _snapshot(ollama) == before and theirs.stat().st_nlink == 1


def test_an_ollama_blob_that_does_not_match_its_digest_is_refused(user_home, store, tiny):
    ollama = write_ollama_store(user_home / ".ollama" / "models", {"library/tiny:1b": _ollama_layers(tiny)})
    blob = ollama / "blobs" / f"sha256-{hashlib.sha256(tiny).hexdigest()}"
    blob.write_bytes(bytes(reversed(tiny)))
    with pytest.raises(IntegrityError, match="is named sha256-.* but its bytes hash to"):
        list(import_model(find_other("tiny:1b"), store))
    assert store.list() == [] and not any(p.name.startswith("sha256-") for p in store.blobs.dir.iterdir())


@pytest.mark.models
def test_an_imported_ollama_model_answers_like_the_original_file(user_home, store, smollm2_path):
    from localllm.client.local import LocalClient

    ollama = write_ollama_store(
        user_home / ".ollama" / "models", {"library/smol:135m": [("model", smollm2_path.read_bytes())]}
    )
    blob = ollama / "blobs" / smollm2_path.name  # the test cache names its blob by digest, as Ollama does
    list(import_model(find_other("smol:135m", ["ollama"]), store))
    assert store.resolve("smol:135m").weights.stat().st_ino == blob.stat().st_ino
    original = user_home / "original.gguf"
    original.symlink_to(smollm2_path)
    client = LocalClient(store)
    try:
        answers = [
            "".join(
                chunk.response
                for chunk in client.generate(
                    api.GenerateRequest(model=name, prompt="The capital of France is", raw=True, options=GREEDY)
                )
            )
            for name in ("smol:135m", str(original))
        ]
    finally:
        client.close()
    assert answers[0].strip() and answers[0] == answers[1]


# ------------------------------------------------------------------------------------------------------- LM Studio, HF


def test_lm_studio_and_hugging_face_files_are_found_named_and_imported(user_home, store, tiny, tiny2):
    lmstudio = _lmstudio_file(user_home, tiny)
    hf = _hf_cache_file(user_home, tiny2)
    projector = write_tiny_gguf(lmstudio.parent / "mmproj-tiny-f16.gguf", arch="clip")
    names = {m.name: m for m in find_others()}
    assert set(names) == {"tiny-org/tiny-gguf:tiny-q8_0", "hf.co/tiny-org/Tiny-GGUF:tiny.q4_k_m"}
    assert str(projector) not in {m.origin for m in names.values()}  # a vision projector is no model
    for model in names.values():
        list(import_model(model, store))
    assert store.resolve("tiny-org/tiny-gguf:tiny-q8_0").weights.stat().st_ino == lmstudio.stat().st_ino
    assert store.resolve("hf.co/tiny-org/Tiny-GGUF:tiny.q4_k_m").weights.stat().st_ino == hf.resolve().stat().st_ino
    assert store.verify() == []


def test_a_recorded_path_is_rechecked_when_the_file_changes_and_refused_when_gone(user_home, store, tiny):
    theirs = _lmstudio_file(user_home, tiny)
    (theirs.parent / "README.md").write_text("the publisher's notes")
    model = find_others(["lmstudio"])[0]
    list(import_model(model, store, link=False))
    blob = store.resolve(model.name).weights
    assert blob.is_symlink() and blob.resolve() == theirs.resolve()
    assert not any(p.stat().st_size == len(tiny) for p in store.blobs.dir.iterdir() if not p.is_symlink())

    os.utime(theirs, ns=(theirs.stat().st_atime_ns, theirs.stat().st_mtime_ns + 10**9))  # touched: re-hashed, fine
    assert store.resolve(model.name).weights == blob

    theirs.write_bytes(tiny[:-8] + b"\x00" * 8)  # other bytes
    with pytest.raises(IntegrityError, match=f"{theirs}, which changed since it was imported"):
        store.resolve(model.name)
    theirs.unlink()
    with pytest.raises(IntegrityError, match=f"the file {theirs}, which is gone"):
        store.resolve(model.name)
    assert [row.name for row in store.list()] == [model.name]  # still listed, and verify says why it is broken
    assert any("which is gone" in problem for problem in store.verify())
    before = _snapshot(user_home / ".lmstudio")
    store.delete(model.name)  # only our link and its record go
    store.prune()
    assert list(store.blobs.dir.iterdir()) == [] and list(store.blobs.refs_dir.iterdir()) == []
    assert _snapshot(user_home / ".lmstudio") == before and "README.md" in str(before)


def test_a_file_on_another_file_system_is_referenced_by_path(store, tiny, monkeypatch):
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == store.root.parent.parent.stat().st_dev:
        pytest.skip("no second file system to import across")
    folder = Path(tempfile.mkdtemp(dir=shm, prefix="localllm-test-"))
    try:
        theirs = folder / ".lmstudio" / "models" / "p" / "r" / "tiny.gguf"
        theirs.parent.mkdir(parents=True)
        theirs.write_bytes(tiny)
        monkeypatch.setenv("HOME", str(folder))
        list(import_model(find_others(["lmstudio"])[0], store))
        blob = store.resolve("p/r:tiny").weights
        assert blob.is_symlink() and blob.resolve() == theirs
        store.delete("p/r:tiny")
        assert theirs.read_bytes() == tiny
    finally:
        shutil.rmtree(folder)


def test_a_name_taken_by_another_model_is_not_replaced(user_home, store, tiny, tmp_path):
    _lmstudio_file(user_home, tiny)
    other = write_tiny_gguf(tmp_path / "other.gguf", name="other")
    store.write_model("tiny-org/tiny-gguf:tiny-q8_0", weights=store.blobs.add_file(other))
    with pytest.raises(InvalidInput, match="already stored, not imported from"):
        list(import_model(find_others(["lmstudio"])[0], store))


# ------------------------------------------------------------------------------------------------------- CLI


def test_ls_others_and_import_from_the_command_line(user_home, isolated_home, tiny):
    write_ollama_store(user_home / ".ollama" / "models", {"library/tiny:1b": _ollama_layers(tiny)})
    _lmstudio_file(user_home, tiny)
    listed = runner.invoke(app, ["ls", "--others", "--json"], catch_exceptions=False)
    rows = {row["name"]: row for row in json.loads(listed.output)["models"]}
    assert rows["tiny:1b"]["from"] == "ollama" and rows["tiny:1b"]["imported"] is False
    assert set(rows) == {"tiny:1b", "tiny-org/tiny-gguf:tiny-q8_0"}

    imported = runner.invoke(app, ["import", "--from", "ollama"], catch_exceptions=False)
    assert imported.exit_code == 0 and "success" in imported.output
    assert [row.name for row in Store(isolated_home / "models").list()] == ["tiny:1b"]
    again = runner.invoke(app, ["import", "--from", "ollama"], catch_exceptions=False)
    assert "tiny:1b: already imported" in again.output
    missing = runner.invoke(app, ["import", "nosuch:7b"], catch_exceptions=False)
    assert missing.exit_code == 1 and "no model 'nosuch:7b' found in Ollama:" in missing.output
    bad = runner.invoke(app, ["import", "--from", "gpt4all"], catch_exceptions=False)
    assert bad.exit_code == 1 and "use ollama, lmstudio or hf" in bad.output
