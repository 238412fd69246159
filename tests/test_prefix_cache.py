"""The prefix cache's tiers and the scheduler's decisions about them, tested with data alone (no model): the RAM
bound, the eviction policy, the floors of sliding-window and recurrent states, the disk files' checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from localllm import config
from localllm.backends.base import CacheShape
from localllm.engine import prefix_cache
from localllm.engine.prefix_cache import (
    RESTORE_MIN_GAIN,
    SAVE_MIN_TOKENS,
    CacheFileError,
    DiskTier,
    PrefixCache,
    RestorePrice,
    as_tokens,
)
from localllm.engine.scheduler import Request, Scheduler, Step
from localllm.errors import ConfigError

FULL = CacheShape(fingerprint="test build; slots 2; ctx 4096")
SWA = CacheShape(window=64, fingerprint="test build")
RECURRENT = CacheShape(recurrent=True, fingerprint="test build")


def _prefix(seed: int, n: int) -> list[int]:
    return [seed * 10_000 + i for i in range(n)]


def _state(n_tokens: int, per_token: int = 100) -> bytes:
    return os.urandom(n_tokens * per_token)


def test_ram_bound_holds_and_evicts_the_least_valuable():
    cache = PrefixCache(FULL, ram_limit=10 * 100 * 100)  # room for ten 100-token states
    for seed in range(30):
        tokens = _prefix(seed, 100)
        cache.put(tokens, _state(100))
        if seed == 3:  # a prefix that keeps being reused (a shared system prompt)
            for _ in range(5):
                match = cache.lookup(tokens + [1])
                assert match is not None
                cache.hit(match.entry)
        assert cache.figures().ram.bytes_held <= cache.ram_limit
    kept = {int(e.tokens[0]) // 10_000 for e in cache.entries}
    assert len(kept) == 10
    assert 3 in kept  # hit often: outlives newer entries that were never used
    assert {0, 1, 2}.isdisjoint(kept) and 29 in kept  # otherwise the oldest go first


def test_a_state_larger_than_the_budget_is_not_kept():
    cache = PrefixCache(FULL, ram_limit=1000)
    assert cache.put(_prefix(1, 100), _state(100)) is None
    assert cache.figures().ram.bytes_held == 0


def test_lookup_finds_the_longest_usable_prefix_and_keeps_the_last_token():
    cache = PrefixCache(FULL, ram_limit=10**7)
    cache.put(_prefix(1, 200), _state(200))
    cache.put(_prefix(1, 120), _state(120))  # covered by the longer one: not stored twice
    assert len(cache.entries) == 1
    assert cache.lookup(_prefix(1, 150) + [7]).reuse == 150  # a full-attention state can be cut anywhere
    assert cache.lookup(_prefix(1, 200)).reuse == 199  # the last prompt token is decoded again
    assert cache.lookup(_prefix(2, 200)) is None


def test_sliding_window_and_recurrent_states_are_reused_only_from_their_end():
    # A saved sliding-window state holds only the last window of those layers: cut shorter, the window has holes.
    swa = PrefixCache(SWA, ram_limit=10**7)
    swa.put(_prefix(1, 200), _state(200))
    assert swa.lookup(_prefix(1, 150) + [7]) is None
    assert swa.lookup(_prefix(1, 200) + [7, 8]).reuse == 200
    swa.put(_prefix(2, 50), _state(50))  # within one window: every cell is kept, any cut works
    assert swa.lookup(_prefix(2, 30) + [7]).reuse == 30
    rec = PrefixCache(RECURRENT, ram_limit=10**7)
    rec.put(_prefix(1, 40), _state(40))
    assert rec.lookup(_prefix(1, 30) + [7]) is None
    assert rec.lookup(_prefix(1, 40) + [7]).reuse == 40


def test_pins_survive_eviction_but_never_fill_the_budget():
    cache = PrefixCache(FULL, ram_limit=10 * 100 * 100)
    cache.put(_prefix(100, 100), _state(100), pinned=True)
    for seed in range(20):
        cache.put(_prefix(seed, 100), _state(100))
    assert any(int(e.tokens[0]) // 10_000 == 100 for e in cache.entries)
    for seed in range(200, 220):  # more pins than half the budget: the oldest lose their pin
        cache.put(_prefix(seed, 100), _state(100), pinned=True)
    assert sum(e.size for e in cache.entries if e.pinned) <= cache.ram_limit / 2
    assert cache.figures().ram.bytes_held <= cache.ram_limit


def _disk(tmp_path, digest="sha256-aaa", fingerprint=FULL.fingerprint, limit=10**7) -> DiskTier:
    return DiskTier.under(tmp_path / "prefix", limit=limit, digest=digest, fingerprint=fingerprint)


def test_disk_tier_keeps_prefixes_for_the_next_process(tmp_path):
    cache = PrefixCache(FULL, ram_limit=0, disk=_disk(tmp_path))  # no RAM: straight to disk
    state = _state(100)
    cache.put(_prefix(1, 100), state)
    assert cache.figures().disk.bytes_held == len(state)
    again = PrefixCache(FULL, ram_limit=0, disk=_disk(tmp_path))
    match = again.lookup(_prefix(1, 100) + [5])
    assert match is not None and match.tier == "disk" and match.reuse == 100
    assert again.load(match.entry) == state
    assert not list((tmp_path / "prefix").rglob("*.tmp"))


def test_ram_entries_spill_to_disk_when_evicted_and_on_flush(tmp_path):
    cache = PrefixCache(FULL, ram_limit=2 * 100 * 100, disk=_disk(tmp_path))
    for seed in range(4):
        cache.put(_prefix(seed, 100), _state(100))
    figures = cache.figures()
    assert figures.ram.entries == 2 and figures.disk.entries == 2
    cache.flush()
    assert cache.figures().disk.entries == 4


def test_a_corrupt_disk_file_is_dropped_never_loaded(tmp_path):
    PrefixCache(FULL, ram_limit=0, disk=_disk(tmp_path)).put(_prefix(1, 100), _state(100))
    (path,) = (tmp_path / "prefix").rglob("*.kv")
    cache = PrefixCache(FULL, ram_limit=0, disk=_disk(tmp_path))  # changed after the scan (which checks it too)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    match = cache.lookup(_prefix(1, 100) + [5])
    with pytest.raises(CacheFileError, match="corrupt"):
        cache.load(match.entry)
    assert not path.exists() and cache.lookup(_prefix(1, 100) + [5]) is None


@pytest.mark.parametrize("damage", ["other model", "other load", "truncated", "not ours"])
def test_a_foreign_or_broken_file_is_dropped_when_indexed(tmp_path, damage):
    PrefixCache(FULL, ram_limit=0, disk=_disk(tmp_path)).put(_prefix(1, 100), _state(100))
    (path,) = (tmp_path / "prefix").rglob("*.kv")
    ours = _disk(tmp_path)
    if damage == "other model":  # a file written for another model, copied into this model's folder
        other = _disk(tmp_path / "other", digest="sha256-bbb")
        PrefixCache(FULL, ram_limit=0, disk=other).put(_prefix(2, 100), _state(100))
        (foreign,) = (tmp_path / "other").rglob("*.kv")
        foreign.replace(path)
    elif damage == "other load":
        other = DiskTier(path.parent, limit=10**7, digest="sha256-aaa", fingerprint="another build")
        PrefixCache(FULL, ram_limit=0, disk=other).put(_prefix(1, 100), _state(100))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-1])
    else:
        path.write_bytes(b"hello")
    assert PrefixCache(FULL, ram_limit=0, disk=ours).entries == []
    assert not path.exists()


def test_disk_bound_holds(tmp_path):
    cache = PrefixCache(FULL, ram_limit=0, disk=_disk(tmp_path, limit=3 * 100 * 100))
    for seed in range(10):
        cache.put(_prefix(seed, 100), _state(100))
    files = list((tmp_path / "prefix").rglob("*.kv"))
    assert len(files) == 3 and cache.figures().disk.bytes_held <= 3 * 100 * 100


def test_an_imported_state_serves_only_its_own_conversation_until_a_request_continues_from_it(tmp_path):
    cache = PrefixCache(FULL, ram_limit=10**7, disk=_disk(tmp_path))
    imported = cache.put(_prefix(1, 200), _state(200), pinned=True, scoped=True)
    assert cache.lookup(_prefix(1, 150) + [7]) is None  # a fresh conversation sharing a prefix: not served
    assert cache.lookup(_prefix(1, 200) + [7]).reuse == 200  # its own conversation going on
    assert not cache.holds(_prefix(1, 150))  # a slot's own save of the prefix is still made
    cache.flush()
    assert not list((tmp_path / "prefix").rglob("*.kv"))  # never written to disk while scoped
    cache.confirm(imported)
    assert cache.lookup(_prefix(1, 150) + [7]).reuse == 150
    cache.flush()
    assert len(list((tmp_path / "prefix").rglob("*.kv"))) == 1


def _forge(fields: dict, tokens: bytes, data: bytes, *, old_format: bool = False) -> bytes:
    """A state file as someone without the key makes it: the old format's checksum, or a MAC of their own key."""
    import hashlib
    import hmac
    import json
    import struct

    if old_format:
        digest = hashlib.blake2b(tokens, digest_size=16)
        digest.update(data)
        header = {**fields, "checksum": digest.hexdigest()}
        magic = b"LLMKV01\n"
    else:
        content = hashlib.blake2b(tokens, digest_size=32)
        content.update(data)
        signed = json.dumps(fields, sort_keys=True).encode() + b"\0" + content.digest()
        mac = hmac.new(os.urandom(32), b"prefix-cache state\0" + signed, hashlib.sha256).hexdigest()
        header, magic = {**fields, "mac": mac}, prefix_cache.MAGIC
    raw = json.dumps(header).encode()
    return magic + struct.pack("<I", len(raw)) + raw + tokens + data


@pytest.mark.parametrize("forgery", ["old checksum", "another key", "bits flipped", "tokens swapped"])
def test_only_states_this_machine_signed_are_opened(forgery):
    tokens, data = as_tokens(_prefix(1, 100)), _state(100)
    genuine = b"".join(prefix_cache.encode_state("sha256-aaa", "fp", tokens, 0, data))
    assert prefix_cache.decode_state(genuine, "sha256-aaa", "fp").data == data
    fields = {"digest": "sha256-aaa", "fingerprint": "fp", "floor": 0, "n_tokens": 100, "size": len(data)}
    raw_tokens = tokens.astype("<i4").tobytes()
    if forgery == "old checksum":  # the attack that worked on the unkeyed format
        blob = _forge({**fields, "pinned": False}, raw_tokens, data, old_format=True)
    elif forgery == "another key":
        blob = _forge({**fields, "pinned": False}, raw_tokens, bytes(len(data)))
    elif forgery == "bits flipped":
        flipped = bytearray(genuine)
        flipped[-50] ^= 0x10
        blob = bytes(flipped)
    else:  # another conversation's tokens under the same state and MAC
        blob = genuine.replace(raw_tokens, as_tokens(_prefix(2, 100)).astype("<i4").tobytes())
    with pytest.raises(CacheFileError, match="MAC|version"):
        prefix_cache.decode_state(blob, "sha256-aaa", "fp")


def test_a_header_claiming_more_than_its_file_holds_is_dropped_and_the_scan_goes_on(tmp_path):
    cache = PrefixCache(FULL, ram_limit=0, disk=_disk(tmp_path))
    cache.put(_prefix(1, 100), _state(100))
    cache.put(_prefix(2, 100), _state(100))
    first, second = sorted((tmp_path / "prefix").rglob("*.kv"))
    raw = first.read_bytes()
    header = raw[len(prefix_cache.MAGIC) + 4 :].split(b"}", 1)[0] + b"}"
    huge = header.replace(b'"n_tokens": 100', b'"n_tokens": %d' % (1 << 40))
    first.write_bytes(raw.replace(header, huge.ljust(len(header))))  # the same length: the file still parses
    again = PrefixCache(FULL, ram_limit=0, disk=_disk(tmp_path))  # no MemoryError: refused from its size alone
    assert [e.path for e in again.entries] == [second]
    assert not first.exists()
    assert again.load(again.entries[0])


def test_writes_a_killed_process_left_are_swept_and_live_ones_kept(tmp_path):
    folder = tmp_path / "prefix" / "sha256-aaa" / "key"
    folder.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = folder / f"abc.{dead.pid}.tmp"
    writing = folder / f"abd.{os.getpid()}.tmp"
    ancient = folder / f"abe.{os.getpid()}.tmp"
    for path in (left, writing, ancient):
        path.write_bytes(b"half a state")
    os.utime(ancient, (0, 0))
    prefix_cache.sweep_unfinished(tmp_path / "prefix")
    assert writing.exists() and not left.exists() and not ancient.exists()


def test_cache_sizes_parse_like_llama_servers(monkeypatch):
    for raw, value in [("0", 0), ("1048576", 1 << 20), ("512MiB", 512 << 20), ("2g", 2 << 30), ("1.5GB", 3 << 29)]:
        monkeypatch.setenv("LOCALLLM_CACHE_RAM", raw)
        assert config.CACHE_RAM.get() == value
    monkeypatch.setenv("LOCALLLM_CACHE_DISK", "lots")
    with pytest.raises(ConfigError, match="LOCALLLM_CACHE_DISK"):
        config.CACHE_DISK.get()


# ---------------------------------------------------------------------------------------------------------- scheduler


def _run_to_end(s: Scheduler, req: Request, answer: list[int]) -> None:
    """Prefill `req` and 'generate' `answer`, then finish it, as the engine would."""
    while True:
        step = s.schedule()
        for restore in step.restores:
            s.restored(restore.request, ok=True)
        done = [w for w in step.work if w.request is req]
        s.update(step, {req.id: [answer[0]]} if done else {})
        if done:
            break
    for tok in answer[1:]:
        step = s.schedule()
        s.update(step, {req.id: [tok]})
    s.finish(req, "stop")


def test_scheduler_saves_a_slot_before_reuse_and_restores_it_for_the_returning_conversation():
    cache = PrefixCache(FULL, ram_limit=10**7)
    s = Scheduler(n_slots=1, n_ctx=4096, n_batch=512, max_queue=4, prefix_cache=cache)
    x1 = Request(prompt=_prefix(1, 300), max_tokens=5, sink=None)
    s.admit(x1)
    _run_to_end(s, x1, [1, 2, 3])
    y = Request(prompt=_prefix(2, 300), max_tokens=5, sink=None)
    s.admit(y)
    step = s.schedule()
    # X's prompt and answer (all but the last token, never decoded) are saved before Y's prefill cuts them.
    assert [(save.seq, len(save.tokens)) for save in step.saves] == [(0, 302)]
    assert step.trims == [(0, 0)]
    cache.put(step.saves[0].tokens, _state(302))  # what the engine does with the Save
    s.update(step, {y.id: [4]})
    s.finish(y, "stop")
    x2 = Request(prompt=_prefix(1, 300) + [1, 2] + [9] * 10, max_tokens=5, sink=None)
    s.admit(x2)
    step = s.schedule()
    (restore,) = step.restores
    assert restore.keep == 302 and x2.cache_tier == "ram" and x2.n_cached == 302
    assert not step.batch.tokens  # its prefill waits for the restore
    s.restored(x2, ok=True)
    s.update(step, {})
    step = s.schedule()
    assert step.batch.positions[0] == 302 and len(step.batch) == 10


def test_a_failed_restore_prefills_the_whole_prompt():
    cache = PrefixCache(FULL, ram_limit=10**7)
    cache.put(_prefix(1, 300), _state(300))
    s = Scheduler(n_slots=1, n_ctx=4096, n_batch=512, max_queue=4, prefix_cache=cache)
    req = Request(prompt=_prefix(1, 300) + [5], max_tokens=5, sink=None)
    s.admit(req)
    step = s.schedule()
    assert step.restores and req.n_cached == 300
    s.restored(req, ok=False)
    step = s.schedule()
    assert req.n_cached == 0 and step.batch.positions[0] == 0 and req.cache_tier is None


def test_a_short_gain_is_left_to_the_slots():
    cache = PrefixCache(FULL, ram_limit=10**7)
    cache.put(_prefix(1, 300), _state(300))
    s = Scheduler(n_slots=1, n_ctx=4096, n_batch=512, max_queue=4, prefix_cache=cache)
    first = Request(prompt=_prefix(1, 300 - RESTORE_MIN_GAIN + 1) + [5], max_tokens=5, sink=None)
    s.admit(first)
    _run_to_end(s, first, [6])
    again = Request(prompt=_prefix(1, 300) + [5], max_tokens=5, sink=None)
    s.admit(again)
    step = s.schedule()
    assert not step.restores and again.cache_tier == "slot"


def _returning_after_a_short_slot(price: RestorePrice) -> Step:
    """A slot holding 250 tokens of a 300-token saved prefix, and a request for all 300: a gain of 50 tokens."""
    cache = PrefixCache(FULL, ram_limit=10**7)
    cache.put(_prefix(1, 300), _state(300))
    cache.price = price
    s = Scheduler(n_slots=1, n_ctx=4096, n_batch=512, max_queue=4, prefix_cache=cache)
    first = Request(prompt=_prefix(1, 250) + [5], max_tokens=5, sink=None)
    s.admit(first)
    _run_to_end(s, first, [6])
    s.admit(Request(prompt=_prefix(1, 300) + [5], max_tokens=5, sink=None))
    return s.schedule()


def test_a_restore_is_weighed_against_the_prefill_it_saves():
    size = len(_state(300))
    assert _returning_after_a_short_slot(RestorePrice()).restores  # nothing measured yet: tried, and so priced
    cpu = RestorePrice(prefill_per_token=3e-3, restore_per_byte={"ram": 1e-9})  # this machine: ms against us
    assert _returning_after_a_short_slot(cpu).restores
    # A state that costs more to load than 50 tokens take to prefill (a slow link) is left to the prefill.
    dear = RestorePrice(prefill_per_token=1e-4, restore_per_byte={"ram": 50 * 1e-4 / size * 2})
    assert not _returning_after_a_short_slot(dear).restores


def test_the_price_learns_from_the_steps():
    price = RestorePrice()
    for _ in range(50):
        price.observe_prefill(100, 0.3)
        price.observe_restore("ram", 10**6, 0.001)
    assert price.prefill_per_token == pytest.approx(3e-3) and price.restore_per_byte["ram"] == pytest.approx(1e-9)
    price.observe_prefill(0, 1.0)  # nothing to learn from
    assert price.prefill_per_token == pytest.approx(3e-3)


def test_small_losses_are_not_saved():
    cache = PrefixCache(FULL, ram_limit=10**7)
    s = Scheduler(n_slots=1, n_ctx=4096, n_batch=512, max_queue=4, prefix_cache=cache)
    first = Request(prompt=_prefix(1, 300), max_tokens=5, sink=None)
    s.admit(first)
    _run_to_end(s, first, [6])
    # shares all but a few of the slot's tokens: the slot keeps them, nothing to save
    again = Request(prompt=_prefix(1, 300 - SAVE_MIN_TOKENS // 2) + [7, 8], max_tokens=5, sink=None)
    s.admit(again)
    assert not s.schedule().saves


def test_a_restored_sliding_window_slot_is_not_cut_below_its_floor():
    cache = PrefixCache(SWA, ram_limit=10**7)
    cache.put(_prefix(1, 300), _state(300))
    s = Scheduler(n_slots=1, n_ctx=4096, n_batch=512, max_queue=4, prefix_cache=cache)
    x = Request(prompt=_prefix(1, 300) + [5, 6], max_tokens=5, sink=None)
    s.admit(x)
    _run_to_end(s, x, [7])
    assert x.cache_tier == "ram" and s.table.slots[0].floor == 300
    # A prompt sharing 250 tokens cannot use this slot: its window cells before 236 were never restored.
    y = Request(prompt=_prefix(1, 250) + [9], max_tokens=5, sink=None)
    s.admit(y)
    step = s.schedule()
    assert y.n_cached == 0 and step.trims == [(0, 0)] and s.table.slots[0].floor == 0


def test_keep_prefix_saves_a_pinned_entry_when_the_request_ends():
    cache = PrefixCache(FULL, ram_limit=10**7)
    s = Scheduler(n_slots=1, n_ctx=4096, n_batch=512, max_queue=4, prefix_cache=cache)
    req = Request(prompt=_prefix(1, 100), max_tokens=5, sink=None, keep_prefix=True)
    s.admit(req)
    _run_to_end(s, req, [1, 2])
    (save,) = s.schedule().saves
    assert save.pinned and save.tokens == tuple(_prefix(1, 100) + [1])
    assert as_tokens(save.tokens).shape == (101,)


# ---------------------------------------------------------------------------------------------------------- surfaces


def test_metrics_count_prefix_cache_hits_by_tier():
    from localllm import api
    from localllm.server.metrics import ServerMetrics

    class OneModel:
        def ps(self) -> api.ProcessResponse:
            return api.ProcessResponse(
                models=[
                    api.ProcessModel(
                        name="m:latest",
                        model="m:latest",
                        prefix_cache_hits={"slot": 3, "ram": 2, "disk": 1},
                        prefix_cache_tokens={"slot": 30, "ram": 2000, "disk": 900},
                        cache_ram_bytes=123,
                        cache_ram_limit=999,
                        cache_disk_bytes=45,
                    )
                ]
            )

    text = ServerMetrics(OneModel()).render().decode()
    assert 'localllm_prefix_cache_hits_total{model="m:latest",tier="ram"} 2.0' in text
    assert 'localllm_prefix_cache_hits_total{model="m:latest",tier="disk"} 1.0' in text
    assert 'localllm_prefix_cache_tokens_reused_total{model="m:latest",tier="ram"} 2000.0' in text
    assert 'localllm_prefix_cache_bytes{model="m:latest",tier="disk"} 45.0' in text


def test_ps_shows_the_prefix_cache():
    from rich.console import Console

    from localllm import api
    from localllm.cli.render import ps_table

    row = api.ProcessModel(
        name="m:latest",
        model="m:latest",
        cache_ram_bytes=50_000_000,
        cache_ram_limit=8_000_000_000,
        cache_disk_bytes=0,
        cache_disk_limit=4_000_000_000,
    )
    console = Console(width=200, record=True)
    console.print(ps_table([row]))
    assert "50 MB/8.0 GB RAM, 0 B/4.0 GB disk" in console.export_text()
