"""Prompt-cache files of `localllm run` (`/save chat.kv`, `/load chat.kv`): a chat and its cached state in one file,
as llama.cpp's --prompt-cache and mlx-lm's cache_prompt keep a prompt's KV cache, so a long conversation comes back
without evaluating its history again.

    MAGIC, u32 length, the conversation as JSON (api.PromptCacheSession), then the state the server exported (its own
    header names the model digest and load, and carries the server's MAC, checked on load: only the server that
    saved it, or one on the same LOCALLLM_HOME, takes it back)

Written to a temporary name and renamed, so a failed save never leaves half a file."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from pydantic import ValidationError

from .. import api
from ..errors import InvalidInput

SUFFIX = ".kv"
MAGIC = b"LLMCHAT1\n"
_LENGTH = struct.Struct("<I")
_MAX_SESSION = 64 * 1024 * 1024  # the conversation's JSON: far beyond any context, small enough to read whole


def is_prompt_cache_file(argument: str) -> bool:
    """`/save` and `/load` take a model name (Ollama's meaning) or, ending in .kv, a prompt-cache file."""
    return argument.endswith(SUFFIX)


def write_prompt_cache(path: Path, session: api.PromptCacheSession, state: bytes) -> None:
    header = session.model_dump_json(exclude_none=True).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(MAGIC + _LENGTH.pack(len(header)) + header)
            handle.write(state)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InvalidInput(f"cannot write {path}: {exc.strerror or exc}") from None


def read_prompt_cache(path: Path) -> tuple[api.PromptCacheSession, bytes]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc.strerror or exc}") from None
    start = len(MAGIC) + _LENGTH.size
    if not raw.startswith(MAGIC) or len(raw) < start:
        raise InvalidInput(f"{path} is not a prompt-cache file", hint="files from /save NAME.kv")
    (length,) = _LENGTH.unpack_from(raw, len(MAGIC))
    if length > _MAX_SESSION or len(raw) < start + length:
        raise InvalidInput(f"{path} is truncated")
    try:
        session = api.PromptCacheSession.model_validate_json(raw[start : start + length])
    except ValidationError as exc:
        raise InvalidInput(f"{path} holds no readable conversation: {exc.errors()[0]['msg']}") from None
    return session, raw[start + length :]
