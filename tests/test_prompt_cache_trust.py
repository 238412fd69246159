"""What the server trusts of the cache states it is handed back: prompt-cache uploads and the disk tier's files.

Only a state this server signed (its key under LOCALLLM_HOME) is opened; an upload is kept to the conversation that
loaded it until a request has continued from it; a state that claims more tokens than it holds costs its entry,
never a request; a disk file whose header claims more than the file holds is dropped at the scan; a write a killed
process left is swept at start-up."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import httpx
import pytest

from localllm import config
from localllm.api import LoadOptions, SamplingOptions
from localllm.backends.llama_cpp.backend import LlamaCppBackend
from localllm.engine.prefix_cache import MAGIC, as_tokens, decode_state, encode_state, make_prefix_cache
from localllm.engine.runner import GenerationParams, ModelEngine
from tests.server_harness import served

pytestmark = pytest.mark.models

N_CTX = 1024
MODEL = "smollm2:135m"
OPTIONS = {"temperature": 0, "num_predict": 6, "spec_type": "none", "num_thread": 2}
SYSTEM = "You keep a lighthouse on a rocky coast. " + "You log every ship, every storm and every lamp. " * 12


def _chat(url: str, messages: list[dict]) -> dict:
    reply = httpx.post(
        f"{url}/api/chat",
        json={"model": MODEL, "messages": messages, "stream": False, "options": OPTIONS},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def _upload(url: str, messages: list[dict], blob: bytes) -> httpx.Response:
    request = json.dumps({"model": MODEL, "messages": messages, "options": OPTIONS})
    return httpx.post(f"{url}/api/prompt-cache/load", params={"request": request}, content=blob, timeout=120)


def _parts(blob: bytes) -> tuple[dict, bytes, bytes]:
    (length,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    header = json.loads(blob[start : start + length])
    body = blob[start + length :]
    return header, body[: 4 * header["n_tokens"]], body[4 * header["n_tokens"] :]


def _old_format(header: dict, tokens: bytes, data: bytes) -> bytes:
    """The file as the unkeyed format had it: anyone could recompute its checksum after editing it."""
    digest = hashlib.blake2b(tokens, digest_size=16)
    digest.update(data)
    fields = {k: v for k, v in header.items() if k != "mac"}
    raw = json.dumps({**fields, "size": len(data), "checksum": digest.hexdigest()}).encode()
    return b"LLMKV01\n" + struct.pack("<I", len(raw)) + raw + tokens + data


def test_an_edited_or_foreign_state_is_refused_and_a_genuine_one_kept_to_its_conversation(models_home):
    with served(
        models_home, LOCALLLM_CONTEXT_LENGTH=str(N_CTX), LOCALLLM_NUM_PARALLEL="1", LOCALLLM_CACHE_DISK="0"
    ) as url:
        x = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the lamp?"}]
        x_history = x + [_chat(url, x)["message"]]
        save = {"model": MODEL, "messages": x_history, "options": OPTIONS}
        genuine = httpx.post(f"{url}/api/prompt-cache/save", json=save, timeout=120).content
        y = [{"role": "user", "content": "Bake bread in Lyon and explain each step."}]
        y_history = y + [_chat(url, y)["message"]]
        y_state = httpx.post(f"{url}/api/prompt-cache/save", json={**save, "messages": y_history}, timeout=120)

    with served(
        models_home, LOCALLLM_CONTEXT_LENGTH=str(N_CTX), LOCALLLM_NUM_PARALLEL="1", LOCALLLM_CACHE_DISK="0"
    ) as url:
        # A new server on the same home (the same key): nothing of either conversation in its slots or RAM.
        header, tokens, data = _parts(genuine)
        flipped = bytearray(data)
        for i in range(20):  # 20 flipped bits, the checksum recomputed: accepted before states were signed
            flipped[(i * 7919) % len(flipped)] ^= 1 << (i % 8)
        forgeries = {
            "edited": _old_format(header, tokens, bytes(flipped)),
            "another conversation's state": _old_format(header, tokens, _parts(y_state.content)[2]),
            "edited, new format": genuine[: -len(data)] + bytes(flipped),
        }
        for what, blob in forgeries.items():
            refused = _upload(url, x_history, blob)
            assert refused.status_code == 400, (what, refused.text)
            assert "MAC" in refused.json()["error"] or "version" in refused.json()["error"], what

        assert _upload(url, x_history, genuine).json() == {"tokens": header["n_tokens"]}
        # A fresh conversation sharing only the system prompt is not served from the upload...
        fresh = _chat(url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Any ships?"}])
        assert fresh["prompt_cache_count"] == 0
        # ...its own conversation is.
        back = _chat(url, x_history + [{"role": "user", "content": "And the ships?"}])
        assert back["prompt_cache_count"] >= header["n_tokens"] - 1


def test_a_write_a_killed_process_left_is_swept_at_start_up(models_home):
    folder = config.prefix_cache_dir() / "sha256-left" / "0123456789abcdef"
    folder.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = folder / f"{'ab' * 16}.{gone.pid}.tmp"
    left.write_bytes(b"half of a state")
    with served(models_home) as url:
        assert not left.exists()
        assert httpx.get(f"{url}/api/version").status_code == 200


# ------------------------------------------------------------------------------------------------ engine, real model


def _engine(path, digest: str = "sha256-trust") -> ModelEngine:
    opts = LoadOptions(num_thread=1, num_ctx=N_CTX, num_parallel=1)
    model = LlamaCppBackend().load(path, opts)
    return ModelEngine(model, max_queue=4, prefix_cache=make_prefix_cache(model, digest))


def _ask(engine: ModelEngine, prompt: list[int]):
    tokens, last = [], None
    for chunk in engine.submit(GenerationParams(prompt, SamplingOptions(**OPTIONS))):
        tokens.extend(chunk.tokens)
        last = chunk
    return tokens, last.timings


def _overclaiming_state(engine: ModelEngine) -> tuple[int, list[int], bytes]:
    """A state signed with this machine's key whose token list claims 40 tokens more than its cells hold (what a
    bug in saving would make): the tokens it claims, the prompt that continues it and the file's bytes."""
    history = engine.tokenize(f"{SYSTEM}\nUser: Where is the lamp?\nAssistant:")
    answer, _ = _ask(engine, history)
    shape = engine.model.cache_shape()
    state = decode_state(engine.export_prefix(history + answer), "sha256-trust", shape.fingerprint)
    claimed = state.tokens.tolist() + engine.tokenize(" The lamp is lit." * 8, add_special=False)[:40]
    blob = b"".join(encode_state("sha256-trust", shape.fingerprint, as_tokens(claimed), 0, state.data))
    prompt = claimed + engine.tokenize("\nUser: And the ships?\nAssistant:", add_special=False)
    return len(claimed), prompt, blob


def test_an_uploaded_state_that_claims_more_tokens_than_it_holds_costs_its_entry_not_the_request(
    smollm2_path, monkeypatch
):
    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "256MiB")
    engine = _engine(smollm2_path)
    try:
        claimed, prompt, blob = _overclaiming_state(engine)
        _ask(engine, engine.tokenize("Bake bread in Lyon."))  # the slot forgets the conversation
        engine.import_prefix(blob)
        answer, timings = _ask(engine, prompt)  # before: llama_decode failed with status -1, every time
        assert answer and timings.prompt_cache_count < 20
        assert all(e.n_tokens != claimed for e in engine.prefix_cache.entries)  # dropped
        again, _ = _ask(engine, prompt)
        assert again
    finally:
        engine.close()


def test_bad_disk_files_are_dropped_and_the_model_stays_usable(smollm2_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_CACHE_RAM", "0")
    monkeypatch.setenv("LOCALLLM_CACHE_DISK", "1GiB")
    engine = _engine(smollm2_path)
    try:
        _, prompt, blob = _overclaiming_state(engine)
        folder = engine.prefix_cache.disk.folder
    finally:
        engine.close()
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.kv"):
        old.unlink()
    overclaiming = folder / ("a" * 32 + ".kv")
    overclaiming.write_bytes(blob)
    header, tokens, data = _parts(blob)
    raw = json.dumps({**header, "n_tokens": 1 << 40}).encode()  # 2^40 tokens in a file of a few MB
    huge = folder / ("b" * 32 + ".kv")
    huge.write_bytes(MAGIC + struct.pack("<I", len(raw)) + raw + tokens + data)

    for restart in range(2):  # the second start finds neither file, and the state the first one left
        engine = _engine(smollm2_path)  # before: MemoryError while scanning the tier
        try:
            assert not huge.exists()
            answer, timings = _ask(engine, prompt)  # before: a 500 at every request, after every restart
            assert answer and not overclaiming.exists()
            if restart == 0:
                assert timings.prompt_cache_count < 20 and engine.prefix_cache.entries == []
            else:
                assert timings.prompt_cache_count >= len(prompt) - 1  # the genuine state the first one wrote
        finally:
            engine.close()
