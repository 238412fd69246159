"""Keyed MACs over what the server hands out and must trust again on its return (prompt-cache state files, Codex
compaction items). A checksum proves nothing to an attacker who can recompute it; an HMAC needs the key, a random
secret kept under LOCALLLM_HOME (mode 0600) that never leaves the machine.

Each use names its purpose, so a MAC made for one kind of data never verifies another."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from . import config

KEY_BYTES = 32
MAC_BYTES = 32  # sha256


def _key_path() -> Path:
    return config.HOME.get() / "secret.key"


def _key() -> bytes:
    path = _key_path()
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = _create_key(path)
    if len(key) != KEY_BYTES:  # a truncated or foreign file: a new key makes every earlier MAC invalid, loudly
        key = _create_key(path, replace=True)
    return key


def _create_key(path: Path, *, replace: bool = False) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(KEY_BYTES)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    if replace:
        os.replace(tmp, path)
        return key
    try:
        os.link(tmp, path)  # first writer wins: two processes starting together agree on one key
    except FileExistsError:
        key = path.read_bytes()
    finally:
        tmp.unlink(missing_ok=True)
    return key


def sign(purpose: str, data: bytes) -> bytes:
    """The MAC of `data` for `purpose` (MAC_BYTES long)."""
    return hmac.new(_key(), purpose.encode("utf-8") + b"\0" + data, hashlib.sha256).digest()


def verify(purpose: str, data: bytes, mac: bytes) -> bool:
    """Whether `mac` is the MAC this machine's key gives `data` for `purpose` (constant-time)."""
    return hmac.compare_digest(sign(purpose, data), mac)
