"""One member of a zip archive, read front to back from a stream of the archive's bytes (no seeking, no central
directory): its local file header is parsed and checked against what the caller expects, then its data is inflated
as the bytes arrive, bounded in memory, and its CRC-32 and sizes are checked at the end.

This is how a catalog mirror reads a file out of a zip that was split into pieces and shipped across wheels: the
pieces arrive one at a time, and only the member's own bytes are kept."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import IntegrityError, ModelFormatError

LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
LOCAL_SIGNATURE = 0x04034B50
STORED, DEFLATED = 0, 8
_ENCRYPTED, _DATA_DESCRIPTOR = 0x1, 0x8
OUTPUT_BLOCK = 1024 * 1024  # the most inflated bytes held at once, whatever the compression ratio


@dataclass(frozen=True)
class LocalHeader:
    name: str
    method: int
    flags: int
    crc32: int
    compressed_size: int
    size: int
    length: int  # of the header itself, name and extra field included: the member's data starts this far in


def parse_local_header(data: bytes) -> LocalHeader | None:
    """The header at the start of `data`, or None while `data` is too short to hold all of it.

    Raises:
        ModelFormatError: `data` does not start with a local file header.
    """
    if len(data) < LOCAL_HEADER.size:
        return None
    signature, _, flags, method, _, _, crc, compressed, size, name_len, extra_len = LOCAL_HEADER.unpack_from(data)
    if signature != LOCAL_SIGNATURE:
        raise ModelFormatError(f"no zip local file header here (signature {signature:#010x})")
    length = LOCAL_HEADER.size + name_len + extra_len
    if len(data) < length:
        return None
    name = data[LOCAL_HEADER.size : LOCAL_HEADER.size + name_len].decode("utf-8", "replace")
    return LocalHeader(name, method, flags, crc, compressed, size, length)


class MemberReader:
    """Feed it the archive's bytes from the member's local header on; it yields the member's bytes.

    The header must name `name`, be stored or deflated, unencrypted, with its sizes in the header (no data
    descriptor), and declare `size` bytes; the data must inflate to exactly that many bytes with the header's CRC-32.
    Bytes past the member's data are ignored."""

    def __init__(self, name: str, size: int):
        self.name = name
        self.size = size
        self.header: LocalHeader | None = None
        self.done = False
        self._pending = b""  # header bytes until the whole header has arrived
        self._left = 0  # compressed bytes of the member still to come
        self._out = 0
        self._crc = 0
        self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self.done:
            return
        if self.header is None:
            data = self._read_header(data)
            if self.header is None:
                return
        data = data[: self._left]
        self._left -= len(data)
        yield from self._emit(data)
        if self._left == 0:
            self._finish_data()

    def _read_header(self, data: bytes) -> bytes:
        self._pending += data  # at most one block past a header, whose lengths are 16-bit
        header = parse_local_header(self._pending)
        if header is None:
            return b""
        self._check(header)
        self.header, rest, self._pending = header, self._pending[header.length :], b""
        self._left = header.compressed_size
        return rest

    def _check(self, header: LocalHeader) -> None:
        problem = None
        if header.name != self.name:
            problem = f"the zip member here is {header.name!r}, expected {self.name!r}"
        elif header.flags & (_ENCRYPTED | _DATA_DESCRIPTOR):
            problem = f"{self.name} is encrypted or has no sizes in its header (flags {header.flags:#x})"
        elif header.method not in (STORED, DEFLATED):
            problem = f"{self.name} is compressed with method {header.method}; only stored and deflated are read"
        elif header.size != self.size:
            problem = f"{self.name} is {header.size} bytes in the zip, expected {self.size}"
        elif header.method == STORED and header.compressed_size != header.size:
            problem = f"{self.name} is stored but its sizes differ ({header.compressed_size} and {header.size})"
        if problem:
            raise IntegrityError(problem)

    def _emit(self, data: bytes) -> Iterator[bytes]:
        assert self.header is not None
        if self.header.method == STORED:
            yield from self._count(data)
            return
        while data:
            try:
                block = self._inflater.decompress(data, OUTPUT_BLOCK)
            except zlib.error as exc:
                raise IntegrityError(f"{self.name} is not a valid deflate stream: {exc}") from None
            data = self._inflater.unconsumed_tail
            yield from self._count(block)
            if self._inflater.eof:
                return

    def _count(self, block: bytes) -> Iterator[bytes]:
        self._out += len(block)
        if self._out > self.size:
            raise IntegrityError(f"{self.name} inflates to more than its {self.size} bytes")
        self._crc = zlib.crc32(block, self._crc)
        if block:
            yield block

    def _finish_data(self) -> None:
        assert self.header is not None
        if self.header.method == DEFLATED and not self._inflater.eof:
            raise IntegrityError(f"{self.name}: the deflate stream does not end where the zip header says")
        if self._out != self.size:
            raise IntegrityError(f"{self.name} inflated to {self._out} bytes, expected {self.size}")
        if self._crc != self.header.crc32:
            raise IntegrityError(f"{self.name} fails its CRC-32 ({self._crc:#010x}, header {self.header.crc32:#010x})")
        self.done = True

    def finish(self) -> None:
        """Raise unless the whole member arrived and checked out."""
        if not self.done:
            got = "no header" if self.header is None else f"{self._out} of {self.size} bytes"
            raise IntegrityError(f"the archive ended before all of {self.name} ({got})")
