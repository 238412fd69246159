"""The prefix cache beyond the slots: sequence states saved when a slot is taken for another prefix, kept in host RAM
(LOCALLLM_CACHE_RAM) and spilled to disk (LOCALLLM_CACHE_DISK, on by default) so prefixes survive a restart.

The slots are the first tier (engine/slots.py). When a slot is about to lose at least SAVE_MIN_TOKENS of its cache,
the scheduler asks the engine to save the slot's state first; a new request then looks in the slots, then here, and a
saved prefix that beats the best slot is restored into the slot before its prompt's rest is prefilled, when restoring
its bytes costs less than prefilling the tokens it gains (RestorePrice, learnt from the engine's own steps). The
scheduler reads only the index (`lookup`, `holds`); the engine thread moves the bytes.

Which entry to evict: GreedyDual-Size-Frequency (Cherkasova 1998). Each entry's priority is
    H = L + (hits + 1) * tokens / bytes
where L rises to the priority of each evicted entry, so an entry not hit for a while ages below newer ones; a prefix
hit often (a system prompt shared by many conversations) or one that saves many prefill tokens per byte held stays.
Pinned entries (a request's keep_prefix) are never evicted while they hold at most half the budget.

A disk file is a small header (model digest, the load's CacheShape.fingerprint: slots, context, KV types, llama.cpp
build), the tokens and the state, authenticated by a keyed MAC (localllm/signing.py) over header, tokens and state;
it is written to a temporary name and renamed, and checked when the tier is scanned and again before it is loaded.
A file that is corrupt, was not made by this machine's server, or belongs to another model or load is deleted, never
loaded. Prompt-cache files (a
conversation's state handed to a client and back) are the same bytes: a state the server did not make, or one
changed since, is refused, so nothing another party computed ever reaches the slots. An imported state is also kept
to the conversation that loaded it (`Entry.scoped`) until a request has continued from it: only then does it serve
other prompts sharing a prefix, or go to disk."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import config, signing
from ..backends.base import CacheShape, LoadedModel
from ..errors import LocalLLMError
from ..models.plan import available_memory

log = logging.getLogger(__name__)

SAVE_MIN_TOKENS = 32  # a slot losing fewer cached tokens than this is not worth a save (a prefill that short is quick)
RESTORE_MIN_GAIN = 4  # a saved prefix must beat the best slot by this many tokens before its price is weighed
PIN_SHARE = 0.5  # pinned entries may hold at most this share of a tier's budget

MAGIC = b"LLMKV02\n"  # 01 carried an unkeyed checksum: such files are refused as foreign
_HEADER_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 16
MAC_PURPOSE = "prefix-cache state"
_READ_CHUNK = 1 << 20
UNFINISHED_AGE = 3600.0  # seconds after which a temporary file is a write that never finished, whoever made it


class CacheFileError(LocalLLMError):
    """A prefix-cache file that cannot be used: corrupt, truncated, or written for another model or load."""


@dataclass(eq=False)
class Entry:
    """One saved prefix: its tokens, the shortest cut it allows, and where its bytes are."""

    tokens: np.ndarray  # int32
    floor: int
    size: int  # bytes of the state
    data: bytes | None = None  # held in RAM
    path: Path | None = None  # written to disk
    hits: int = 0
    priority: float = 0.0
    pinned: bool = False
    # Imported from a prompt-cache file and not yet continued by a request: it serves only prompts that hold all of
    # its tokens (its own conversation), and stays out of the disk tier.
    scoped: bool = False

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def tier(self) -> str:
        return "ram" if self.data is not None else "disk"


@dataclass(frozen=True)
class Match:
    """A saved prefix a request can use: restore `entry` and keep its first `reuse` tokens."""

    entry: Entry
    reuse: int

    @property
    def tier(self) -> str:
        return self.entry.tier


@dataclass
class RestorePrice:
    """What restoring a saved prefix costs against prefilling the tokens it saves, from the engine's own timings:
    seconds per prefilled token (steps that carry prompt chunks) and per restored byte (read and load, per tier). On
    a CPU a prefilled token costs milliseconds and its state a few microseconds to copy; on a GPU, or from a slow
    disk, the two come closer. Until both are measured a restore is taken: it is tried, and so priced."""

    prefill_per_token: float | None = None
    restore_per_byte: dict[str, float] = field(default_factory=dict)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_per_token = _moving(self.prefill_per_token, seconds / tokens)

    def observe_restore(self, tier: str, size: int, seconds: float) -> None:
        if size > 0 and seconds > 0:
            self.restore_per_byte[tier] = _moving(self.restore_per_byte.get(tier), seconds / size)

    def pays(self, match: Match, gain: int) -> bool:
        """Whether restoring `match` beats prefilling the `gain` tokens it adds to what the best slot holds."""
        if gain < RESTORE_MIN_GAIN:
            return False
        per_byte = self.restore_per_byte.get(match.tier)
        if per_byte is None or self.prefill_per_token is None:
            return True
        return per_byte * match.entry.size < self.prefill_per_token * gain


def _moving(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else old + weight * (new - old)


@dataclass
class TierFigures:
    bytes_held: int = 0
    entries: int = 0
    limit: int = 0


@dataclass
class CacheFigures:
    ram: TierFigures = field(default_factory=TierFigures)
    disk: TierFigures = field(default_factory=TierFigures)


def ram_limit() -> int:
    """LOCALLLM_CACHE_RAM, or by default an eighth of the memory available now shared by the models that may be
    loaded at once, at most 8 GiB (llama-server's --cache-ram default): room for dozens of conversations' prefixes,
    never more than the machine can spare. It is a limit: the tier grows only as conversations outnumber the slots."""
    configured = config.CACHE_RAM.get()
    if configured is not None:
        return configured
    return min(8 * 1024**3, (available_memory() or 0) // (8 * config.MAX_LOADED_MODELS.get()))


DISK_SHARE = 20  # by default the disk tier may take a twentieth of the free disk...
DISK_CAP = 4 * 1024**3  # ...and at most this much per model


def disk_limit() -> int:
    """LOCALLLM_CACHE_DISK, or by default a twentieth of the disk free under LOCALLLM_HOME, at most 4 GiB, so that
    prefixes survive a restart without anyone knowing the setting's name."""
    configured = config.CACHE_DISK.get()
    if configured is not None:
        return configured
    where = config.prefix_cache_dir()
    while not where.exists() and where != where.parent:  # a home not created yet: the disk it will be on
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return 0
    return min(DISK_CAP, free // DISK_SHARE)


def make_prefix_cache(model: LoadedModel, digest: str) -> PrefixCache:
    """The tiers for one loaded model: RAM unless LOCALLLM_CACHE_RAM=0, disk unless LOCALLLM_CACHE_DISK=0, where
    the backend can describe its states (a fingerprint)."""
    shape = model.cache_shape()
    disk = None
    limit = disk_limit() if shape.fingerprint else 0
    if limit > 0:
        disk = DiskTier.under(config.prefix_cache_dir(), limit=limit, digest=digest, fingerprint=shape.fingerprint)
    return PrefixCache(shape, ram_limit=ram_limit(), disk=disk, digest=digest)


def as_tokens(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def shared_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """The RAM tier and, when given, the disk tier below it. The index is read by the scheduler; everything that
    moves bytes runs on the engine thread."""

    def __init__(self, shape: CacheShape, *, ram_limit: int, disk: DiskTier | None = None, digest: str = ""):
        self.shape = shape
        self.digest = digest  # the model's, written into exported states (prompt-cache files)
        self.ram_limit = max(0, ram_limit)
        self.disk = disk
        self.price = RestorePrice()
        self.entries: list[Entry] = disk.scan() if disk is not None else []
        self._inflation = 0.0  # GDSF's L
        for entry in self.entries:
            entry.priority = self._priority(entry)

    @property
    def enabled(self) -> bool:
        return self.ram_limit > 0 or self.disk is not None

    # ----------------------------------------------------------------------------------------------- index

    def lookup(self, prompt: Sequence[int], *, fits: Callable[[int, Match], bool] | None = None) -> Match | None:
        """The saved prefix that lets `prompt` skip the most tokens (RAM before disk on ties); None if none does.
        `fits(len(prompt), match)`: whether the caller could ever restore it (an entry it could not is passed by)."""
        if not self.entries or len(prompt) < 2:
            return None
        wanted = as_tokens(prompt)
        best: Match | None = None
        for entry in self.entries:
            shared = shared_length(entry.tokens, wanted)
            if entry.scoped and shared < entry.n_tokens:
                continue  # an imported state serves only its own conversation until one has continued from it
            # Keep the prompt's last token to decode: its output is the first generated token.
            shared = min(shared, len(prompt) - 1)
            reuse = shared if shared >= (entry.n_tokens if self.shape.recurrent else entry.floor) else 0
            if not reuse or (best is not None and (reuse, entry.tier == "ram") <= (best.reuse, best.tier == "ram")):
                continue
            match = Match(entry, reuse)
            if fits is None or fits(len(prompt), match):
                best = match
        return best

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether an entry already serves every request `tokens` would (saving them again would add nothing)."""
        wanted = as_tokens(tokens)
        floor = self.shape.saved_floor(len(tokens))
        return any(self._covers(entry, wanted, floor) for entry in self.entries)

    @staticmethod
    def _covers(entry: Entry, tokens: np.ndarray, floor: int) -> bool:
        """Whether `entry` serves every prompt a state of `tokens` would (a scoped entry serves fewer)."""
        n = tokens.shape[0]
        return (
            not entry.scoped
            and entry.n_tokens >= n
            and entry.floor <= floor
            and (n == 0 or entry.tokens[n - 1] == tokens[n - 1])  # most entries differ there: no array compare
            and shared_length(entry.tokens, tokens) == n
        )

    # ----------------------------------------------------------------------------------------------- engine thread

    def put(self, tokens: Sequence[int], data: bytes, *, pinned: bool = False, scoped: bool = False) -> Entry | None:
        """Keep a state saved after `tokens`; entries it makes redundant go. None when no tier has room. A scoped
        entry (an imported state) stays in RAM, serving its own conversation only, until `confirm`."""
        arr = as_tokens(tokens)
        entry = Entry(
            tokens=arr,
            floor=self.shape.saved_floor(len(tokens)),
            size=len(data),
            data=data,
            pinned=pinned,
            scoped=scoped,
        )
        covering = next((e for e in self.entries if self._covers(e, arr, entry.floor)), None)
        if covering is not None:  # an entry already serves every prompt this one would
            covering.pinned |= pinned
            return covering
        for old in [e for e in self.entries if not scoped and self._covers(entry, e.tokens, e.floor)]:
            entry.hits += old.hits
            entry.pinned |= old.pinned
            self._forget(old)
        entry.priority = self._priority(entry)
        kept = self._make_room_in_ram(entry)
        if not kept:
            entry.data = None
            kept = self._spill(entry, data)
        if not kept:
            return None
        entry.priority = self._priority(entry)  # at the inflation its evictions reached: it is the newest
        self.entries.append(entry)
        return entry

    def load(self, entry: Entry) -> bytes:
        """The entry's state; a disk file that fails its checks is deleted and raises CacheFileError."""
        if entry.data is not None:
            return entry.data
        if self.disk is None or entry.path is None:
            raise CacheFileError(f"the saved prefix of {entry.n_tokens} tokens was evicted before it was restored")
        try:
            return self.disk.read(entry)
        except CacheFileError:
            self._forget(entry)
            raise

    def hit(self, entry: Entry) -> None:
        entry.hits += 1
        entry.priority = self._priority(entry)

    def confirm(self, entry: Entry) -> None:
        """A request continued from `entry` without error: an imported state now serves every prompt it fits."""
        entry.scoped = False

    def drop(self, entry: Entry) -> None:
        """Forget an entry whose state did not load, or did not hold what it claimed (RAM and disk)."""
        self._forget(entry)

    def flush(self) -> None:
        """Write every RAM entry the disk lacks (the model is being unloaded: prefixes survive a restart)."""
        if self.disk is None:
            return
        for entry in sorted(self.entries, key=lambda e: e.priority, reverse=True):
            if entry.data is not None and entry.path is None:
                self._spill(entry, entry.data)

    def figures(self) -> CacheFigures:
        ram = [e for e in self.entries if e.data is not None]
        disk = [e for e in self.entries if e.path is not None]
        return CacheFigures(
            ram=TierFigures(sum(e.size for e in ram), len(ram), self.ram_limit),
            disk=TierFigures(sum(e.size for e in disk), len(disk), self.disk.limit if self.disk else 0),
        )

    # ----------------------------------------------------------------------------------------------- eviction

    def _priority(self, entry: Entry) -> float:
        return self._inflation + (entry.hits + 1) * entry.n_tokens / max(1, entry.size)

    def _make_room_in_ram(self, entry: Entry) -> bool:
        if entry.size > self.ram_limit:
            return False
        self._limit_pins([e for e in self.entries if e.data is not None] + [entry], self.ram_limit)
        while self._ram_bytes() + entry.size > self.ram_limit:
            victims = [e for e in self.entries if e.data is not None and not e.pinned]
            if not victims:
                return False
            victim = min(victims, key=lambda e: e.priority)
            self._inflation = max(self._inflation, victim.priority)
            self._evict_from_ram(victim)
        return True

    def _evict_from_ram(self, victim: Entry) -> None:
        data, victim.data = victim.data, None
        if victim.path is not None or (data is not None and self._spill(victim, data)):
            return  # it lives on, on disk
        self.entries.remove(victim)

    def _spill(self, entry: Entry, data: bytes) -> bool:
        if self.disk is None or entry.size > self.disk.limit or entry.scoped:
            return False
        on_disk = [e for e in self.entries if e.path is not None]
        self._limit_pins(on_disk + [entry], self.disk.limit)
        while sum(e.size for e in on_disk) + entry.size > self.disk.limit:
            victims = [e for e in on_disk if not e.pinned]
            if not victims:
                return False
            victim = min(victims, key=lambda e: e.priority)
            on_disk.remove(victim)
            self.disk.remove(victim)
            victim.path = None
            if victim.data is None:
                self.entries.remove(victim)
        entry.path = self.disk.write(entry, data)
        return entry.path is not None

    @staticmethod
    def _limit_pins(entries: Iterable[Entry], limit: int) -> None:
        """Unpin the oldest pins beyond PIN_SHARE of `limit`, so pins can never fill a tier."""
        pinned = [e for e in entries if e.pinned]
        total = sum(e.size for e in pinned)
        for entry in pinned:
            if total <= limit * PIN_SHARE:
                return
            entry.pinned = False
            total -= entry.size

    def _ram_bytes(self) -> int:
        return sum(e.size for e in self.entries if e.data is not None)

    def _forget(self, entry: Entry) -> None:
        if entry in self.entries:
            self.entries.remove(entry)
        if entry.path is not None and self.disk is not None:
            self.disk.remove(entry)
        entry.data, entry.path = None, None


class DiskTier:
    """Prefix files of one model and one load's fingerprint, in a folder of their own, within `limit` bytes."""

    def __init__(self, folder: Path, *, limit: int, digest: str, fingerprint: str):
        self.folder = folder
        self.limit = limit
        self.digest = digest
        self.fingerprint = fingerprint

    @classmethod
    def under(cls, root: Path, *, limit: int, digest: str, fingerprint: str) -> DiskTier:
        """The tier's folder: root/<model digest>/<hash of the fingerprint>."""
        key = hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()
        return cls(root / digest / key, limit=limit, digest=digest, fingerprint=fingerprint)

    def scan(self) -> list[Entry]:
        """Index the files already here; a file that fails its header or its MAC is deleted, and the scan goes
        on. Each file is read whole once, here, so a tampered one never waits in the folder to be read."""
        if not self.folder.is_dir():
            return []
        sweep_unfinished(self.folder)
        entries = []
        for path in sorted(self.folder.glob("*.kv")):
            try:
                entries.append(self._index(path))
            except (CacheFileError, OSError, ValueError) as exc:
                log.warning("dropping prefix-cache file %s: %s", path.name, exc)
                _unlink(path)
        return entries

    def write(self, entry: Entry, data: bytes) -> Path | None:
        tokens = entry.tokens.astype("<i4").tobytes()
        path = self.folder / f"{hashlib.blake2b(tokens, digest_size=16).hexdigest()}.kv"
        tmp = path.with_suffix(f".{os.getpid()}{_UNFINISHED}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as handle:
                for part in encode_state(
                    self.digest, self.fingerprint, entry.tokens, entry.floor, data, pinned=entry.pinned
                ):
                    handle.write(part)
            os.replace(tmp, path)
        except OSError as exc:  # a full or read-only disk costs the entry, never the request
            log.warning("could not write prefix-cache file %s: %s", path, exc)
            _unlink(tmp)
            return None
        return path

    def read(self, entry: Entry) -> bytes:
        assert entry.path is not None
        try:
            raw = entry.path.read_bytes()
        except OSError as exc:
            raise CacheFileError(f"prefix-cache file {entry.path.name} cannot be read: {exc}") from None
        try:
            state = decode_state(raw, self.digest, self.fingerprint)
        except CacheFileError as exc:
            _unlink(entry.path)
            raise CacheFileError(f"prefix-cache file {entry.path.name}: {exc}") from None
        if not np.array_equal(state.tokens, entry.tokens):
            _unlink(entry.path)
            raise CacheFileError(f"prefix-cache file {entry.path.name} changed since it was indexed")
        return state.data

    def remove(self, entry: Entry) -> None:
        if entry.path is not None:
            _unlink(entry.path)

    def _index(self, path: Path) -> Entry:
        with open(path, "rb") as handle:
            head = handle.read(len(MAGIC) + _HEADER_LEN.size + _MAX_HEADER)
            try:
                header, offset = read_header(head, self.digest, self.fingerprint)
                check_lengths(header, os.fstat(handle.fileno()).st_size - offset)  # before reading a byte more
            except CacheFileError as exc:
                raise CacheFileError(f"{path.name}: {exc}") from None
            handle.seek(offset)
            raw_tokens = handle.read(4 * header["n_tokens"])
            content = _content_hash(raw_tokens)
            while chunk := handle.read(_READ_CHUNK):  # the state, hashed as it is read: a tampered file goes now
                content.update(chunk)
        if not _mac_matches(header, content.digest()):
            raise CacheFileError(f"{path.name}: corrupt, or not made by this server (its MAC does not match)")
        tokens = np.frombuffer(raw_tokens, dtype="<i4").astype(np.int32)
        return Entry(
            tokens=tokens,
            floor=int(header["floor"]),
            size=int(header["size"]),
            path=path,
            pinned=bool(header.get("pinned")),
        )


_UNFINISHED = ".tmp"


def sweep_unfinished(folder: Path) -> None:
    """Delete the temporary files of prefix-cache writes that never finished under `folder` (a process killed while
    writing): those of processes that are gone, and any older than UNFINISHED_AGE."""
    if not folder.is_dir():
        return
    now = time.time()
    for stale in folder.rglob(f"*{_UNFINISHED}"):
        try:
            old = now - stale.stat().st_mtime > UNFINISHED_AGE
        except OSError:
            continue
        if old or not _writer_alive(stale):
            _unlink(stale)


def _writer_alive(tmp: Path) -> bool:
    """Whether the process that names `tmp` (<name>.<pid>.tmp) still runs: its write may be under way."""
    pid = tmp.name.removesuffix(_UNFINISHED).rpartition(".")[2]
    if not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # another user's process
    return True


@dataclass(frozen=True)
class SavedState:
    tokens: np.ndarray
    floor: int
    data: bytes


def encode_state(
    digest: str, fingerprint: str, tokens: np.ndarray, floor: int, data: bytes, *, pinned: bool = False
) -> tuple[bytes, bytes, bytes]:
    """A saved state as the parts of a file (disk tier, prompt-cache files): header, tokens, state; the header
    carries the MAC of everything (this machine's key, localllm/signing.py)."""
    raw_tokens = tokens.astype("<i4").tobytes()
    fields = {
        "digest": digest,
        "fingerprint": fingerprint,
        "floor": int(floor),
        "n_tokens": int(tokens.shape[0]),
        "size": len(data),
        "pinned": pinned,
    }
    header = json.dumps({**fields, "mac": _mac(fields, raw_tokens, data)}).encode()
    return MAGIC + _HEADER_LEN.pack(len(header)) + header, raw_tokens, data


def decode_state(raw: bytes, digest: str, fingerprint: str) -> SavedState:
    """Check and open what encode_state wrote; CacheFileError says why it cannot be used here."""
    header, offset = read_header(raw, digest, fingerprint)
    check_lengths(header, len(raw) - offset)
    end = offset + 4 * header["n_tokens"]
    tokens, data = raw[offset:end], raw[end:]
    content = _content_hash(tokens)
    content.update(data)
    if not _mac_matches(header, content.digest()):
        raise CacheFileError("corrupt, or not made by this server (its MAC does not match)")
    return SavedState(np.frombuffer(tokens, dtype="<i4").astype(np.int32), int(header["floor"]), data)


def read_header(raw: bytes, digest: str, fingerprint: str) -> tuple[dict, int]:
    """The header of a saved state and where its tokens start, checked against this model and load."""
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + _HEADER_LEN.size:
        raise CacheFileError("not a prefix-cache file of this version")
    (length,) = _HEADER_LEN.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + _HEADER_LEN.size
    if length > _MAX_HEADER or len(raw) < start + length:
        raise CacheFileError("truncated header")
    try:
        header = json.loads(raw[start : start + length])
        valid = isinstance(header, dict) and all(
            type(header.get(k)) is int and header[k] >= 0 for k in ("floor", "n_tokens", "size")
        )
    except ValueError:
        valid = False
    if not valid:
        raise CacheFileError("unreadable header")
    if header.get("digest") != digest:
        raise CacheFileError(f"written for another model ({str(header.get('digest'))[:80]})")
    if header.get("fingerprint") != fingerprint:
        raise CacheFileError(f"written for another load ({str(header.get('fingerprint'))[:200]})")
    return header, start + length


def check_lengths(header: dict, body: int) -> None:
    """The header's counts against the `body` bytes that follow it, before any of them is read: a header that
    claims more (2^40 tokens) than the file holds is refused here, not met by a failed allocation."""
    n_tokens, size, floor = header["n_tokens"], header["size"], header["floor"]
    if n_tokens < 1 or floor > n_tokens:
        raise CacheFileError(f"unreadable header ({n_tokens} tokens, floor {floor})")
    if 4 * n_tokens + size != body:
        raise CacheFileError(
            f"truncated or padded: its header claims {n_tokens:,} tokens and {size:,} bytes of state, "
            f"the file holds {body:,} bytes after it"
        )


def _content_hash(tokens: bytes):  # a hashlib object (its type is private)
    return hashlib.blake2b(tokens, digest_size=32)


def _signed(fields: dict, content: bytes) -> bytes:
    """What the MAC covers: the header's fields (canonical JSON) and a 256-bit hash of tokens and state (`content`),
    so a state of hundreds of MB is hashed where it lies rather than copied into one buffer."""
    return json.dumps(fields, sort_keys=True).encode() + b"\0" + content


def _mac(fields: dict, tokens: bytes, data: bytes) -> str:
    content = _content_hash(tokens)
    content.update(data)
    return signing.sign(MAC_PURPOSE, _signed(fields, content.digest())).hex()


def _mac_matches(header: dict, content: bytes) -> bool:
    fields = {k: v for k, v in header.items() if k != "mac"}
    mac = header.get("mac")
    return isinstance(mac, str) and signing.verify(MAC_PURPOSE, _signed(fields, content), _unhex(mac))


def _unhex(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        return b""


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
