"""Pack files: immutable, self-describing blobs of many stored chunks.

A pack holds chunk payloads as the codec layer made them (opaque bytes
labelled with a codec number and a codec parameter) and a trailer that lists
them, so a pack can be checked, and its chunks found, from the pack alone.
All integers are little-endian. Layout (`size` = the pack's length):

    offset 0   header, 16 bytes
                 0  8s  magic b"CKPTPAK1"
                 8  u32 version (1)
                12  u32 flags (0)
    offset 16  payloads, back to back in the order they were added, no padding
    offset T   trailer: entry_count entries of 64 bytes, in payload order
                 0  32s chunk id (BLAKE3-256 of the chunk's logical bytes)
                32  u64 offset of the payload in the pack
                40  u64 stored length (bytes of payload in the pack)
                48  u64 logical length (bytes once decoded)
                56  u8  codec
                57  u8  codec param
                58  u16 reserved (0)
                60  u32 CRC-32C of the stored payload
    size - 32  footer, 32 bytes
                 0  u64 T, the trailer's offset
                 8  u64 entry_count
                16  u32 version (1)
                20  u32 trailer CRC: CRC-32C of the trailer's bytes followed
                    by the footer's first 20 bytes (chained)
                24  8s  end magic b"CKPTEND1"

So size == T + 64 * entry_count + 32, the first payload starts at 16, each
next one where the previous ends, and the last ends at T (T == 16 for an
empty pack). A pack holds at most MAX_PACK_ENTRIES chunks; a logical length
is at most MAX_CHUNK_BYTES (chunker.py) and a stored length at most the
logical one (the codecs store raw what does not shrink). `read_pack_index`
checks all of it before it reads the trailer or trusts an entry (BlobDamaged
on any mismatch, FormatError for a footer of another version), so a lying
pack never makes a reader allocate more than those bounds; `read_payload`
checks a payload's CRC-32C. Chunk ids are unique within a pack. The pack
does not decode payloads nor check ids: that is the codec layer's (and the
reader's BLAKE3 check).

Streaming: `PackWriter` writes each payload through to the backend's
BlobWriter as it is added and keeps only the 64-byte entries; readers read
the footer, the trailer, or one payload's range, never the whole pack.

Packs live under "packs/" (`pack_name`).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from . import native
from .backing.base import Backend, BlobWriter
from .chunker import MAX_CHUNK_BYTES
from .errors import BlobDamaged, FormatError, InvalidArgument

MAGIC = b"CKPTPAK1"
END_MAGIC = b"CKPTEND1"
VERSION = 1
CHUNK_ID_BYTES = 32
PACK_PREFIX = "packs/"
PACK_SUFFIX = ".pack"
# Chunks per pack: the trailer a reader loads is at most 4 MiB.
MAX_PACK_ENTRIES = 1 << 16

_HEADER = struct.Struct("<8sII")            # magic, version, flags
_ENTRY = struct.Struct("<32sQQQBBHI")       # id, offset, stored, length, codec, param, 0, crc
_FOOTER = struct.Struct("<QQII8s")          # trailer offset, count, version, crc, end magic
_FOOTER_CRC_COVERS = 20                     # footer bytes covered by the trailer CRC

HEADER_BYTES = _HEADER.size
ENTRY_BYTES = _ENTRY.size
FOOTER_BYTES = _FOOTER.size
assert (HEADER_BYTES, ENTRY_BYTES, FOOTER_BYTES) == (16, 64, 32)


@dataclass(frozen=True, slots=True)
class PackEntry:
    """Where one chunk's payload is in a pack, and how to check and decode it."""

    chunk_id: bytes
    offset: int
    stored_length: int
    length: int
    codec: int
    param: int
    crc: int

    def encode(self) -> bytes:
        return _ENTRY.pack(self.chunk_id, self.offset, self.stored_length, self.length,
                           self.codec, self.param, 0, self.crc)


def pack_name(pack_id: Union[bytes, int]) -> str:
    """The blob name of a pack.

    bytes ids (random or content ids): "packs/<first 2 hex>/<hex>.pack";
    int ids (a counter, 0 <= id < 2**64): "packs/<last 2 hex>/<16 hex>.pack",
    so consecutive packs spread over the 256 directories.
    """
    if isinstance(pack_id, bool):
        raise TypeError("pack id must be bytes or int")
    if isinstance(pack_id, int):
        if not 0 <= pack_id < 1 << 64:
            raise ValueError(f"pack id {pack_id} out of range")
        h = f"{pack_id:016x}"
        return f"{PACK_PREFIX}{h[-2:]}/{h}{PACK_SUFFIX}"
    if isinstance(pack_id, (bytes, bytearray)):
        if not pack_id:
            raise ValueError("empty pack id")
        h = bytes(pack_id).hex()
        return f"{PACK_PREFIX}{h[:2]}/{h}{PACK_SUFFIX}"
    raise TypeError(f"pack id must be bytes or int, not {type(pack_id).__name__}")


_COUNTER_NAME = re.compile(re.escape(PACK_PREFIX) + r"([0-9a-f]{2})/([0-9a-f]{16})"
                           + re.escape(PACK_SUFFIX))


def pack_number(name: str) -> Optional[int]:
    """The id of a pack named by `pack_name(int)`, or None for any other name."""
    m = _COUNTER_NAME.fullmatch(name)
    if m is None or m.group(2)[-2:] != m.group(1):
        return None
    return int(m.group(2), 16)


def _buffers(payload) -> Iterable[memoryview]:
    """A payload as byte views: one bytes-like object, or an iterable of them."""
    try:
        mv = memoryview(payload)
    except TypeError:
        for piece in payload:
            v = memoryview(piece)
            yield v if (v.format == "B" and v.ndim == 1) else v.cast("B")
        return
    yield mv if (mv.format == "B" and mv.ndim == 1) else mv.cast("B")


class PackWriter:
    """Writes one pack through a BlobWriter, payload by payload.

    Use as a context manager (aborts unless committed) or call `commit` /
    `abort`. An error from the backend aborts the pack. One thread at a time.
    """

    def __init__(self, writer: BlobWriter) -> None:
        self._w = writer
        self.name = writer.name
        self._entries: list[PackEntry] = []
        self._ids: set[bytes] = set()
        self._offset = 0
        self._payload_bytes = 0
        self._state = "open"
        self._write(_HEADER.pack(MAGIC, VERSION, 0))

    @classmethod
    def create(cls, backend: Backend, name: str) -> "PackWriter":
        return cls(backend.writer(name))

    @property
    def bytes_written(self) -> int:
        """Bytes written so far: header and payloads; after `commit`, the
        pack's whole size (trailer and footer included)."""
        return self._offset

    @property
    def payload_bytes(self) -> int:
        """Sum of the stored lengths of the payloads added."""
        return self._payload_bytes

    @property
    def entries(self) -> list[PackEntry]:
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, chunk_id: bytes) -> bool:
        return bytes(chunk_id) in self._ids

    def _write(self, data) -> None:
        try:
            self._w.write(data)
        except BaseException:
            self.abort()
            raise
        self._offset += len(data)

    def _need_open(self) -> None:
        if self._state != "open":
            raise InvalidArgument(f"pack {self.name}: writer is {self._state}")

    def add(self, chunk_id: bytes, codec: int, param: int, payload, length: int) -> PackEntry:
        """Append one chunk's stored payload (a bytes-like object, or an
        iterable of them for one payload streamed in pieces)."""
        self._need_open()
        chunk_id = bytes(chunk_id)
        if len(chunk_id) != CHUNK_ID_BYTES:
            raise ValueError(f"chunk id must be {CHUNK_ID_BYTES} bytes, not {len(chunk_id)}")
        if chunk_id in self._ids:
            raise ValueError(f"pack {self.name}: chunk {chunk_id.hex()} added twice")
        if not (0 <= codec <= 0xFF and 0 <= param <= 0xFF):
            raise ValueError(f"codec {codec} / param {param} do not fit in a byte")
        if not 0 <= length <= MAX_CHUNK_BYTES:
            raise ValueError(f"logical length {length} outside 0..{MAX_CHUNK_BYTES}")
        if len(self._entries) >= MAX_PACK_ENTRIES:
            raise ValueError(f"pack {self.name}: already holds {MAX_PACK_ENTRIES} chunks")
        start = self._offset
        crc = 0
        try:
            for piece in _buffers(payload):
                if piece.nbytes:
                    crc = native.crc32c(piece, crc)
                    self._write(piece)
        except BaseException:
            self.abort()                         # a half-written payload: the pack is lost
            raise
        entry = PackEntry(chunk_id, start, self._offset - start, length, codec, param, crc)
        if entry.stored_length > length:
            self.abort()                         # readers would refuse the pack
            raise ValueError(f"pack {self.name}: payload of {entry.stored_length} bytes for "
                             f"a {length}-byte chunk")
        self._payload_bytes += entry.stored_length
        self._entries.append(entry)
        self._ids.add(chunk_id)
        return entry

    def commit(self) -> list[PackEntry]:
        """Write the trailer and footer, commit the blob; return the entries."""
        self._need_open()
        trailer_offset = self._offset
        crc = 0
        batch = bytearray()
        for e in self._entries:
            batch += e.encode()
            if len(batch) >= 1 << 20:
                crc = native.crc32c(batch, crc)
                self._write(batch)
                batch = bytearray()
        head = struct.pack("<QQI", trailer_offset, len(self._entries), VERSION)
        crc = native.crc32c(head, native.crc32c(batch, crc))
        batch += _FOOTER.pack(trailer_offset, len(self._entries), VERSION, crc, END_MAGIC)
        self._write(batch)
        try:
            self._w.commit()
        except BaseException:
            self._state = "aborted"
            raise
        self._state = "committed"
        return list(self._entries)

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
            self._w.abort()

    def __enter__(self) -> "PackWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._state == "open":
            self.abort()


def _damaged(backend: Backend, name: str, why: str) -> BlobDamaged:
    return BlobDamaged(f"{backend.url}: {name}: damaged pack: {why}")


def read_pack_index(backend: Backend, name: str, size: Optional[int] = None) -> list[PackEntry]:
    """The entries of pack `name`, after checking its header, footer, trailer
    CRC and layout (BlobDamaged on any mismatch). Pass `size` if known."""
    if size is None:
        size = backend.size(name)
    if size < HEADER_BYTES + FOOTER_BYTES:
        raise _damaged(backend, name, f"only {size} bytes (truncated?)")
    footer = backend.read(name, size - FOOTER_BYTES, FOOTER_BYTES)
    t_off, count, version, crc, end = _FOOTER.unpack(footer)
    if end != END_MAGIC:
        raise _damaged(backend, name, "no end magic (truncated, or not a pack)")
    other_version = FormatError(f"{backend.url}: {name}: pack version {version}, "
                                f"this ckptfs reads version {VERSION}")
    if t_off < HEADER_BYTES or t_off + count * ENTRY_BYTES + FOOTER_BYTES != size:
        if version != VERSION:
            raise other_version
        raise _damaged(backend, name, f"trailer at {t_off} with {count} entries does not "
                                      f"fit a pack of {size} bytes")
    if count > MAX_PACK_ENTRIES:
        raise _damaged(backend, name, f"footer claims {count} entries, a pack holds at most "
                                      f"{MAX_PACK_ENTRIES}")
    trailer = backend.read(name, t_off, count * ENTRY_BYTES) if count else b""
    got = native.crc32c(footer[:_FOOTER_CRC_COVERS], native.crc32c(trailer))
    if got != crc:
        raise _damaged(backend, name, f"trailer CRC {got:08x}, expected {crc:08x}")
    if version != VERSION:                       # intact, but not ours
        raise other_version
    magic, hversion, flags = _HEADER.unpack(backend.read(name, 0, HEADER_BYTES))
    if magic != MAGIC:
        raise _damaged(backend, name, f"bad magic {magic!r}")
    if hversion != VERSION or flags != 0:
        raise _damaged(backend, name, f"header says version {hversion} flags {flags:#x}, "
                                      f"footer says version {VERSION} flags 0")
    entries = []
    expect = HEADER_BYTES
    seen: set[bytes] = set()
    for i, fields in enumerate(_ENTRY.iter_unpack(trailer)):
        cid, off, stored, length, codec, param, reserved, pcrc = fields
        if off != expect or reserved != 0:
            raise _damaged(backend, name, f"entry {i} at offset {off}, expected {expect}")
        if cid in seen:
            raise _damaged(backend, name, f"chunk {cid.hex()} listed twice")
        if length > MAX_CHUNK_BYTES or stored > length:
            raise _damaged(backend, name, f"entry {i} claims {stored} stored bytes for a "
                                          f"{length}-byte chunk (at most {MAX_CHUNK_BYTES}, "
                                          "stored at most the chunk)")
        seen.add(cid)
        entries.append(PackEntry(cid, off, stored, length, codec, param, pcrc))
        expect = off + stored
    if expect != t_off:
        raise _damaged(backend, name, f"payloads end at {expect}, trailer starts at {t_off}")
    return entries


def read_payload(backend: Backend, name: str, entry: PackEntry) -> bytes:
    """The stored payload of `entry`, after checking its CRC-32C (BlobDamaged)."""
    data = backend.read(name, entry.offset, entry.stored_length)
    got = native.crc32c(data)
    if got != entry.crc:
        raise _damaged(backend, name, f"chunk {entry.chunk_id.hex()} at {entry.offset}: "
                                      f"payload CRC {got:08x}, expected {entry.crc:08x}")
    return data


def verify_pack(backend: Backend, name: str) -> list[PackEntry]:
    """Check a whole pack (index and every payload CRC), one payload at a time."""
    entries = read_pack_index(backend, name)
    for e in entries:
        read_payload(backend, name, e)
    return entries
