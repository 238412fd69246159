"""Model files that would take the process down: hyperparameters llama.cpp GGML_ASSERTs on are refused at inspection
(create, show), files that still abort llama.cpp fail in the load probe's child with a clean error, inspection of a
crafted header is bounded by the file size, and a few hundred mutated headers go through inspection and create with
nothing but clean errors. The server answers a plain request after each bad file."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import gguf
import httpx
import pytest
from server_harness import SMALL, private_home, served
from tiny_models import write_tiny_llama
from typer.testing import CliRunner

from localllm import api
from localllm.backends.llama_cpp.probe import LoadProbe, weights_key
from localllm.cli import app
from localllm.errors import LocalLLMError, ModelFormatError
from localllm.models import catalog
from localllm.models.create import create_model
from localllm.models.store import Store
from localllm.quant.gguf import MAX_STRING_ITEMS, inspect_gguf

# Each of these aborted llama.cpp (SIGABRT from a GGML_ASSERT) at load or first decode before inspection refused it.
ABORTS = {
    "no layers": (dict(hparams={"block_count": 0}), "llama.block_count is 0, outside 1..512"),
    "2**32-1 layers": (dict(hparams={"block_count": 2**32 - 1}), "llama.block_count is 4294967295"),
    "513 layers": (dict(hparams={"block_count": 513}), "llama.block_count is 513"),
    "negative rms epsilon": (
        dict(hparams={"layer_norm_rms_eps": -1.0}),
        "llama.attention.layer_norm_rms_epsilon is -1.0",
    ),
    "NaN rms epsilon": (
        dict(hparams={"layer_norm_rms_eps": math.nan}),
        "llama.attention.layer_norm_rms_epsilon is nan",
    ),
    "more MTP layers than layers": (
        dict(hparams={"nextn_predict_layers": 2}),
        "llama.nextn_predict_layers is 2, more than the 1 layers",
    ),
    "experts but none used": (dict(hparams={"expert_count": 1}), "llama.expert_used_count is 0, outside 1..1"),
    "experts used but none": (dict(hparams={"expert_used_count": 2}), "the model has no experts"),
    "unknown rope scaling": (dict(raw={"llama.rope.scaling.type": "bogus"}), "llama.rope.scaling.type is 'bogus'"),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def bad_norm(tiny_dir) -> Path:
    """Passes every header check, then aborts llama.cpp at the first decode: ggml's CPU kernels cannot multiply by an
    F16 norm weight ("binary_op: unsupported types")."""
    return write_tiny_llama(tiny_dir / "bad-norm.gguf", half=("blk.0.attn_norm.weight",))


# ---------------------------------------------------------------------------------------------------------- inspection


def test_the_tiny_model_itself_passes(tmp_path):
    info = inspect_gguf(write_tiny_llama(tmp_path / "ok.gguf"))
    assert (info.architecture, info.block_count) == ("llama", 1)


@pytest.mark.parametrize("change,message", ABORTS.values(), ids=ABORTS.keys())
def test_inspection_refuses_what_llama_cpp_asserts_on(tmp_path, change, message):
    path = write_tiny_llama(tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelFormatError) as caught:
        inspect_gguf(path)
    assert message in str(caught.value) and "llama.cpp would abort" in str(caught.value)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("name", ["no layers", "2**32-1 layers", "negative rms epsilon"])
def test_those_files_really_abort_llama_cpp_and_the_probe_survives_it(tmp_path, name):
    """The refusals above are not guesses: loading such a file kills the process (here, the probe's child)."""
    path = write_tiny_llama(tmp_path / "bad.gguf", **ABORTS[name][0])
    with pytest.raises(ModelFormatError, match="crashed llama.cpp while loading: .*GGML_ASSERT"):
        LoadProbe(tmp_path / "probes").check(path, api.LoadOptions())
    assert not (tmp_path / "probes" / weights_key(path)).exists()


def test_create_refuses_such_a_file_with_exit_1_and_stores_nothing(tmp_path, isolated_home):
    path = write_tiny_llama(tmp_path / "bad.gguf", hparams={"block_count": 0})
    (tmp_path / "Modelfile").write_text(f"FROM {path}\n")
    result = CliRunner().invoke(app, ["create", "bad", "-f", str(tmp_path / "Modelfile")], catch_exceptions=False)
    assert result.exit_code == 1 and "llama.block_count is 0, outside 1..512" in result.output
    assert "Traceback" not in result.output
    assert not Store().exists("bad")


# ---------------------------------------------------------------------------------------------------------- probe


def test_a_good_file_is_probed_once_and_remembered(tmp_path, monkeypatch):
    import localllm.backends.llama_cpp.probe as probe

    path = write_tiny_llama(tmp_path / "ok.gguf")
    memory = LoadProbe(tmp_path / "probes")
    memory.check(path, api.LoadOptions())
    entry = tmp_path / "probes" / weights_key(path)
    assert json.loads(entry.read_text())["llama_cpp"]

    def no_child(*args, **kwargs):
        raise AssertionError("a remembered file was probed again")

    monkeypatch.setattr(probe, "_run_child", no_child)
    memory.check(path, api.LoadOptions())
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "llama_cpp": "0.0.1"}))  # another llama.cpp
    with pytest.raises(AssertionError, match="probed again"):
        memory.check(path, api.LoadOptions())


def test_a_catalog_file_needs_no_child_under_the_llama_cpp_it_was_checked_with(tmp_path, monkeypatch):
    """The pinned bytes of a catalog model were loaded and decoded with this llama-cpp-python (the suite does it):
    that verdict ships, so a first load starts no child. Any other llama.cpp, or any other file, runs the child."""
    import localllm.backends.llama_cpp.probe as probe

    def no_child(*args, **kwargs):
        raise AssertionError("probed in a child")

    monkeypatch.setattr(probe, "_run_child", no_child)
    no_trial = api.LoadOptions(flash_attn=False)
    blob = write_tiny_llama(tmp_path / catalog.CATALOG[0].digest)  # a store blob is named by its digest
    LoadProbe(tmp_path / "probes").check(blob, no_trial)
    assert json.loads((tmp_path / "probes" / blob.name).read_text())["llama_cpp"] == catalog.CHECKED_WITH_LLAMA_CPP
    with pytest.raises(AssertionError, match="probed in a child"):
        LoadProbe(tmp_path / "other-probes").check(write_tiny_llama(tmp_path / f"sha256-{'0' * 64}"), no_trial)
    monkeypatch.setattr(probe, "_llama_cpp_version", lambda: "0.3.99")
    with pytest.raises(AssertionError, match="probed in a child"):
        LoadProbe(tmp_path / "probes").check(blob, no_trial)


def test_the_catalog_was_checked_with_the_pinned_llama_cpp():
    """Raising the pin makes every catalog file pass the probe's child again until the suite has run on the new one
    and this constant says so."""
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert f'"llama-cpp-python=={catalog.CHECKED_WITH_LLAMA_CPP}"' in pyproject


def test_a_file_that_aborts_llama_cpp_fails_in_the_probe_every_time(tmp_path, bad_norm):
    memory = LoadProbe(tmp_path / "probes")
    for _ in range(2):  # a failure is not remembered as a success
        with pytest.raises(ModelFormatError, match="binary_op: unsupported types"):
            memory.check(bad_norm, api.LoadOptions())


def test_a_vocabulary_llama_cpp_cannot_tokenize_with_fails_in_the_probe(tmp_path):
    """A SentencePiece vocabulary without its <0xNN> byte tokens loads and decodes, then the first unknown character
    a user types throws out of llama.cpp's C API, which ends the process."""
    path = write_tiny_llama(tmp_path / "no-bytes.gguf", byte_tokens=False)
    with pytest.raises(ModelFormatError, match=r"llama.cpp threw std::out_of_range \(unordered_map::at\)"):
        LoadProbe(tmp_path / "probes").check(path, api.LoadOptions())


def test_a_clean_load_failure_is_left_to_the_real_load(tmp_path):
    """A file llama.cpp refuses without dying (a tensor missing) is not the probe's to report."""
    path = write_tiny_llama(tmp_path / "two-layers.gguf", hparams={"block_count": 2})  # blk.1.* are missing
    LoadProbe(tmp_path / "probes").check(path, api.LoadOptions())
    assert not (tmp_path / "probes" / weights_key(path)).exists()


# ---------------------------------------------------------------------------------------------------------- bounds


def _string_array_header(key: str, count: int) -> bytes:
    """A GGUF header with no tensors and one key: an array of `count` strings (the items follow, not written)."""
    name = key.encode()
    return (
        struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, 1)
        + struct.pack("<Q", len(name))
        + name
        + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, count)
    )


def test_a_huge_string_array_in_a_sparse_file_is_refused_at_once(tmp_path):
    """400 MB of zeros read as 50 million empty strings: this walk took 113 s; the count alone now refuses it."""
    path = tmp_path / "sparse.gguf"
    size = 400 * 1024 * 1024
    count = (size - len(_string_array_header("tokenizer.ggml.tokens", 0))) // 8  # every byte left: empty strings
    with path.open("wb") as handle:
        handle.write(_string_array_header("tokenizer.ggml.tokens", count))
        handle.truncate(size)  # a hole: nothing is written to disk
    with pytest.raises(ModelFormatError, match=f"holds {count} strings; localllm reads at most"):
        inspect_gguf(path)


def test_a_string_array_within_the_bound_is_still_read(tmp_path):
    path = tmp_path / "many.gguf"
    count = MAX_STRING_ITEMS // 64
    header = _string_array_header("tokenizer.ggml.tokens", count)
    with path.open("wb") as handle:
        handle.write(header)
        handle.truncate(len(header) + count * 8)  # that many empty strings
    assert inspect_gguf(path).vocab_size == count


def test_a_string_array_that_runs_past_the_end_is_refused(tmp_path):
    path = tmp_path / "short.gguf"
    path.write_bytes(
        _string_array_header("tokenizer.ggml.tokens", 100) + struct.pack("<Q", 0) * 99 + struct.pack("<Q", 5) + b"ab"
    )  # a long array (skipped, not decoded) whose last item is cut
    with pytest.raises(ModelFormatError, match=r"item of 'tokenizer.ggml.tokens' \(5 bytes\)"):
        inspect_gguf(path)


# ---------------------------------------------------------------------------------------------------------- fuzz

_U32 = (0, 1, 2, 7, 255, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)
_U64 = (0, 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1)
_F32 = (-1.0, 0.0, math.nan, math.inf, -math.inf, 1e38)


def _mutate(data: bytes, header_end: int, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(4, header_end - 8)  # keep the magic: without it nothing further is read
        kind = rng.randrange(4)
        if kind == 0:
            out[at] = rng.randrange(256)
        elif kind == 1:
            struct.pack_into("<I", out, at, rng.choice(_U32))
        elif kind == 2:
            struct.pack_into("<Q", out, at, rng.choice(_U64))
        else:
            struct.pack_into("<f", out, at, rng.choice(_F32))
    return bytes(out)


def test_mutated_headers_through_inspection_and_create_give_only_clean_errors(tmp_path, isolated_home):
    good = write_tiny_llama(tmp_path / "good.gguf").read_bytes()
    header_end = good.index(b"ffn_down.weight") + 60  # past the last tensor info
    rng = random.Random(13)
    store = Store()
    path = tmp_path / "fuzzed.gguf"
    outcomes = {"described": 0, "refused": 0, "created": 0}
    for case in range(300):
        path.write_bytes(_mutate(good, header_end, rng))
        try:
            inspect_gguf(path)
            outcomes["described"] += 1
        except ModelFormatError as exc:
            assert "\n" not in str(exc) and str(path) in str(exc)
            outcomes["refused"] += 1
        try:
            for _ in create_model(api.CreateRequest(model=f"fuzz-{case}", from_=str(path)), store):
                pass
            outcomes["created"] += 1
        except LocalLLMError as exc:
            assert exc.status_code < 500, exc
    assert outcomes["refused"] > 100 and outcomes["described"] > 10, outcomes
    assert outcomes["created"] == outcomes["described"]  # create refuses exactly what inspection refuses


# ---------------------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(models_home, tmp_path_factory):
    home = private_home(models_home, tmp_path_factory.mktemp("files-home"))
    with served(home) as url:
        yield url, home


def _answers_a_plain_request(url: str) -> None:
    reply = httpx.post(
        f"{url}/api/generate",
        json={"model": "smollm2:135m", "prompt": "Hi", "stream": False, "options": SMALL},
        timeout=120,
    )
    assert reply.status_code == 200 and reply.json()["done"], reply.text


@pytest.mark.models
def test_server_refuses_to_create_a_file_llama_cpp_asserts_on(server, tmp_path):
    url, _home = server
    path = write_tiny_llama(tmp_path / "eps.gguf", hparams={"layer_norm_rms_eps": -1.0})
    reply = httpx.post(f"{url}/api/create", json={"model": "eps:bad", "from": str(path), "stream": False}, timeout=60)
    assert reply.status_code == 400
    assert "layer_norm_rms_epsilon is -1.0" in reply.json()["error"]
    _answers_a_plain_request(url)


@pytest.mark.models
def test_server_survives_a_file_that_aborts_llama_cpp_at_decode(server, bad_norm):
    url, home = server
    reply = httpx.post(
        f"{url}/api/create", json={"model": "norm:bad", "from": str(bad_norm), "stream": False}, timeout=60
    )
    assert reply.status_code == 200  # nothing in its header is wrong: only running it shows the fault
    for _ in range(2):
        reply = httpx.post(
            f"{url}/api/generate", json={"model": "norm:bad", "prompt": "Hi", "stream": False}, timeout=120
        )
        assert reply.status_code == 400
        assert "crashed llama.cpp while loading: binary-ops.cpp" in reply.json()["error"]
        _answers_a_plain_request(url)
    smollm2 = Store(home / "models").resolve("smollm2:135m").weights
    assert (home / "models" / "probes" / smollm2.name).is_file()  # the good blob is remembered
    assert not (home / "models" / "probes" / Store(home / "models").resolve("norm:bad").weights.name).exists()


@pytest.mark.models
def test_server_survives_a_draft_model_that_aborts_llama_cpp(server, bad_norm):
    url, _home = server
    reply = httpx.post(
        f"{url}/api/generate",
        json={
            "model": "smollm2:135m",
            "prompt": "Hi",
            "stream": False,
            "options": {**SMALL, "draft": str(bad_norm), "num_ctx": 256},
        },
        timeout=120,
    )
    assert reply.status_code == 400
    assert "crashed llama.cpp while loading: binary-ops.cpp" in reply.json()["error"]
    _answers_a_plain_request(url)
