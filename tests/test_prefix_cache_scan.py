"""A disk-cache file is checked whole when its tier is scanned: one changed since it was written (its state, its
tokens, or its MAC) is deleted there, not left in the folder until a request reads it."""

from __future__ import annotations

import os

import pytest

from localllm.backends.base import CacheShape
from localllm.engine import prefix_cache
from localllm.engine.prefix_cache import DiskTier, PrefixCache

SHAPE = CacheShape(fingerprint="test build; slots 2; ctx 4096")


def _tier(tmp_path) -> DiskTier:
    return DiskTier.under(tmp_path / "prefix", limit=10**7, digest="sha256-aaa", fingerprint=SHAPE.fingerprint)


def _written(tmp_path, n: int = 2) -> list:
    cache = PrefixCache(SHAPE, ram_limit=0, disk=_tier(tmp_path))  # no RAM: straight to disk
    for seed in range(n):
        cache.put([seed * 1000 + i for i in range(100)], os.urandom(100 * 100))
    return sorted((tmp_path / "prefix").rglob("*.kv"))


def _tampered(raw: bytes, where: str) -> bytes:
    data = bytearray(raw)
    if where == "state":
        data[-10] ^= 0xFF
    elif where == "tokens":  # the first token, right after the header
        start = (
            len(prefix_cache.MAGIC)
            + 4
            + int.from_bytes(raw[len(prefix_cache.MAGIC) : len(prefix_cache.MAGIC) + 4], "little")
        )
        data[start] ^= 0x01
    else:  # the MAC in the header, one hex digit changed
        at = raw.index(b'"mac": "') + len(b'"mac": "')
        data[at] = ord("0") if data[at] != ord("0") else ord("1")
    return bytes(data)


@pytest.mark.parametrize("where", ["state", "tokens", "mac"])
def test_a_tampered_file_is_deleted_at_scan_and_the_others_kept(tmp_path, where):
    first, second = _written(tmp_path)
    first.write_bytes(_tampered(first.read_bytes(), where))
    entries = PrefixCache(SHAPE, ram_limit=0, disk=_tier(tmp_path)).entries
    assert not first.exists()
    assert [e.path for e in entries] == [second]


def test_untouched_files_pass_the_scan_and_load(tmp_path):
    paths = _written(tmp_path, n=3)
    cache = PrefixCache(SHAPE, ram_limit=0, disk=_tier(tmp_path))
    assert sorted(e.path for e in cache.entries) == paths
    assert all(len(cache.load(e)) == 100 * 100 for e in cache.entries)
