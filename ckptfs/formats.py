"""Format hints for chunking: where checkpoint files keep their tensors.

The chunker cuts every stream content-defined; where the format tells where
tensors start and end it also forces cuts there, so a small changed tensor
never drags the bytes of an unchanged neighbour into a new chunk.  Hints only
move chunk boundaries: a wrong or missed hint costs dedup, never data.

Three formats, all readable from the front as the bytes stream in:

* safetensors: an 8-byte little-endian header length ``n``, then ``n`` bytes of
  JSON whose entries give each tensor's ``data_offsets`` ``[begin, end)``
  relative to the end of the header, ``8 + n``.
* torch.save (the zip format, and any zip written front to back, such as
  numpy's ``.npz``): every member is a local file header (``PK\\x03\\x04``, 30
  bytes, name, extra field) followed by its data.  torch 2.13 stores members
  uncompressed, pads the extra field so each member's data starts 64-byte
  aligned, and sets flag bit 3: the local header's sizes are zero and the size
  follows the data in a data descriptor (``PK\\x07\\x08``, CRC-32, sizes), so a
  member's end is known only once its descriptor has streamed in.  The
  archive's top directory is the file's stem (``step_100/data/0``), so member
  headers differ between checkpoint files even when the tensors do not.

* zstd frames back to back (tensorstore's OCDBT data files, where Orbax
  keeps each array chunk as one compressed value): a frame's extent follows
  from its frame header and its blocks' 3-byte headers.

TensorFlow's tensor bundles are not hinted: a `.data-*` file is bare tensor
bytes, and the `.index` naming their offsets is written after it
(:func:`tf_bundle_index` reads it, for measurements).

Every boundary the parsers report lies at or after the end of the bytes that
were needed to learn it, except a zip member's data end, which is learned from
the descriptor after it; :attr:`ZipBoundaries.stable` says up to where the
stream is settled so the chunker can hold back the few bytes behind it.
"""

from __future__ import annotations

import json
import struct
import sys
from typing import TYPE_CHECKING, NamedTuple, Optional

from ckptfs import native

if TYPE_CHECKING:
    if sys.version_info >= (3, 12):
        from collections.abc import Buffer
    else:
        from typing_extensions import Buffer

__all__ = [
    "SAFETENSORS_MAX_HEADER",
    "safetensors_header_size",
    "safetensors_boundaries",
    "torch_zip_boundaries",
    "ZipBoundaries",
    "ZstdFrames",
    "TensorBundleEntry",
    "tf_bundle_index",
    "FormatHints",
]

# The safetensors library refuses larger headers; so do we.
SAFETENSORS_MAX_HEADER = 100_000_000

_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = b"PK\x01\x02"
# What may follow a data descriptor: the next member, the central directory,
# the zip64 end record, the end record.
_AFTER_DESCRIPTOR = (b"PK\x03\x04", b"PK\x01\x02", b"PK\x06\x06", b"PK\x05\x06")
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
_ZIP64_EXTRA = 0x0001
_U32_MAX = 0xFFFFFFFF


def _as_bytes_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


# ---- safetensors -------------------------------------------------------------------


def safetensors_header_size(prefix: Buffer) -> Optional[int]:
    """``8 + n``, the offset where tensor data starts, if ``prefix`` (at least
    9 bytes) starts like a safetensors file; else None."""
    head = bytes(_as_bytes_view(prefix)[:9])
    if len(head) < 9 or head[8:9] != b"{":
        return None
    (n,) = struct.unpack_from("<Q", head)
    if not 2 <= n <= SAFETENSORS_MAX_HEADER:
        return None
    return 8 + n


def safetensors_boundaries(header_bytes_prefix: Buffer) -> Optional[list[int]]:
    """Tensor boundaries of a safetensors file from a prefix of it.

    Returns the sorted absolute file offsets where the header ends and where
    every tensor starts and ends (``8 + n + data_offsets``), or None when the
    prefix is not a safetensors file or does not yet hold the whole header.
    """
    view = _as_bytes_view(header_bytes_prefix)
    data_start = safetensors_header_size(view)
    if data_start is None or len(view) < data_start:
        return None
    try:
        header = json.loads(bytes(view[8:data_start]))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    bounds = {data_start}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            return None
        bounds.add(data_start + offsets[0])
        bounds.add(data_start + offsets[1])
    return sorted(bounds)


# ---- zip (torch.save) --------------------------------------------------------------


class _StreamParser:
    """What a parser of a stream fed in pieces keeps between feeds: the bytes
    from `_keep_from` on (it may look back at them when the next feed comes)
    and, during a feed, that feed's bytes.  A subclass parses in `_step`."""

    def __init__(self) -> None:
        self.seen = 0  # bytes fed so far
        self._tail = b""  # bytes [self._tail_at, self.seen) kept for the next feed
        self._tail_at = 0
        # Scratch for the feed in progress.
        self._view = memoryview(b"")
        self._base = 0

    def feed(self, data: Buffer) -> list[int]:
        view = _as_bytes_view(data)
        self._view, self._base = view, self.seen
        self.seen += len(view)
        out: list[int] = []
        try:
            while self._step(out):
                pass
        finally:
            keep = min(self._keep_from(), self.seen)
            self._tail = self._bytes(keep, self.seen) or b""
            self._tail_at = keep
            self._view = memoryview(b"")
        return out

    def _step(self, out: list[int]) -> bool:
        """Parse on, appending boundaries to out; False when it needs more bytes."""
        raise NotImplementedError

    def _keep_from(self) -> int:
        """The first stream offset a later step may still read."""
        raise NotImplementedError

    def _bytes(self, start: int, stop: int) -> Optional[bytes]:
        """Stream bytes [start, stop) from the tail and the current feed, or
        None if they have not all arrived."""
        if stop > self.seen:
            return None
        base = self._base
        if start >= base:
            return bytes(self._view[start - base : stop - base])
        head = self._tail[start - self._tail_at :]
        if stop <= base:
            return head[: stop - start]
        return head + bytes(self._view[: stop - base])


class ZipBoundaries(_StreamParser):
    """Incremental parser of a zip stream's member data boundaries.

    :meth:`feed` takes the stream's bytes in order and returns the boundaries
    it learned from them, ascending: each member's data start (the end of its
    local header) and data end.  Sizes come from the local header or, with
    flag bit 3 (what torch.save writes), from the data descriptor found after
    the data: a ``PK\\x07\\x08`` whose size field equals the distance from the
    data start and that is followed by another zip signature.  Parsing stops
    at the central directory or at anything that is not a local header.
    Keeps only a partial header or the few bytes of a possible descriptor.
    """

    _HEADER, _SKIP, _SEARCH, _DONE, _NEXT = range(5)

    def __init__(self) -> None:
        super().__init__()
        self._mode = self._HEADER
        self._at = 0  # HEADER: header start; SKIP: data end; SEARCH: data start
        self._search = 0  # SEARCH/NEXT: first offset not yet ruled out as a descriptor/header
        self._compressed = False

    @property
    def done(self) -> bool:
        """True once no further boundary can come (central directory reached)."""
        return self._mode == self._DONE

    @property
    def stable(self) -> int:
        """Every boundary below this offset has been reported."""
        return self._tail_at if self._mode in (self._SEARCH, self._NEXT) else self.seen

    # -- internals

    def _keep_from(self) -> int:
        if self._mode == self._HEADER:
            return self._at
        if self._mode in (self._SEARCH, self._NEXT):
            return self._search
        return self.seen

    def _step(self, out: list[int]) -> bool:
        """Advance the state machine; False when it needs more bytes."""
        if self._mode == self._SKIP:
            if self._at > self.seen:
                return False
            self._mode = self._HEADER
            return True
        if self._mode == self._HEADER:
            return self._parse_header(out)
        if self._mode == self._SEARCH:
            return self._find_descriptor(out)
        if self._mode == self._NEXT:
            return self._find_next_zip(out)
        return False

    def _parse_header(self, out: list[int]) -> bool:
        start = self._at
        fixed = self._bytes(start, start + 30)
        if fixed is None:
            sig = self._bytes(start, min(start + 4, self.seen)) or b""
            if not (_LOCAL.startswith(sig) or _CENTRAL.startswith(sig)):
                self._mode = self._DONE
            return False
        (sig, _version, flags, method, _time, _date, _crc, csize, usize, name_len,
         extra_len) = _LOCAL_HEADER.unpack(fixed)
        if sig == _CENTRAL:
            # This zip's directory: another zip may follow it.
            self._mode = self._NEXT
            self._search = start
            return True
        if sig != _LOCAL:
            self._mode = self._DONE
            return False
        data_start = start + 30 + name_len + extra_len
        extra = self._bytes(start + 30 + name_len, data_start)
        if extra is None:
            return False
        out.append(data_start)
        self._compressed = method != 0
        if flags & 0x08:
            self._mode = self._SEARCH
            self._at = self._search = data_start
            return True
        if csize == _U32_MAX:
            csize = self._zip64_csize(extra, usize == _U32_MAX)
            if csize is None:
                self._mode = self._DONE
                return False
        out.append(data_start + csize)
        self._mode = self._SKIP
        self._at = data_start + csize
        return True

    @staticmethod
    def _zip64_csize(extra: bytes, has_usize: bool) -> Optional[int]:
        pos = 0
        while pos + 4 <= len(extra):
            tag, size = struct.unpack_from("<HH", extra, pos)
            body = extra[pos + 4 : pos + 4 + size]
            if tag == _ZIP64_EXTRA:
                off = 8 if has_usize else 0
                if len(body) >= off + 8:
                    return int(struct.unpack_from("<Q", body, off)[0])
                return None
            pos += 4 + size
        return None

    def _scan_for(self, sig: bytes) -> Optional[int]:
        """First offset at or after the search position where the 4-byte sig
        starts, or None (the search position then moves to a partial sig at
        the very end, or to the end)."""
        base, view = self._base, self._view
        q = self._search
        if q < base:
            # One starting in the kept tail: search tail + 3 bytes.
            region = self._bytes(q, min(self.seen, base + 3)) or b""
            hit = region.find(sig)
            q = q + hit if hit >= 0 else base
        if q >= base:
            hit = native.find4(view, sig, q - base)
            if hit < 0:
                end = self.seen
                for k in (3, 2, 1):
                    if end - k >= self._search and self._bytes(end - k, end) == sig[:k]:
                        self._search = end - k
                        break
                else:
                    self._search = end
                return None
            q = base + hit
        return q

    def _find_descriptor(self, out: list[int]) -> bool:
        while True:
            q = self._scan_for(_DESCRIPTOR)
            if q is None:
                return False
            verdict = self._check_descriptor(q)
            if verdict is None:  # needs bytes that have not arrived
                self._search = q
                return False
            if verdict:
                out.append(q)
                self._mode = self._HEADER
                self._at = q + verdict
                return True
            self._search = q + 1

    def _find_next_zip(self, out: list[int]) -> bool:
        """After a central directory: where the next zip's first local header is."""
        q = self._scan_for(_LOCAL)
        if q is None:
            return False
        out.append(q)           # the directory and end record end here: a chunk of their own
        self._mode = self._HEADER
        self._at = q
        return True

    def _check_descriptor(self, q: int) -> Optional[int]:
        """Length of the data descriptor at ``q`` (16 or 24), 0 if there is
        none there, or None if more bytes are needed to tell."""
        size = q - self._at
        if size <= _U32_MAX:
            b = self._bytes(q, q + 20)
            if b is None:
                return None
            c32, u32 = struct.unpack_from("<II", b, 8)
            if c32 == size and (self._compressed or u32 == size) and b[16:20] in _AFTER_DESCRIPTOR:
                return 16
        b = self._bytes(q, q + 28)
        if b is None:
            return None
        c64, u64 = struct.unpack_from("<QQ", b, 8)
        if c64 == size and (self._compressed or u64 == size) and b[24:28] in _AFTER_DESCRIPTOR:
            return 24
        return 0


def torch_zip_boundaries(prefix: Buffer) -> Optional[list[int]]:
    """Member data boundaries of a torch.save zip from the bytes seen so far.

    Returns the sorted absolute offsets where each member's data starts and
    ends, as far as ``prefix`` tells them (a member whose data descriptor has
    not arrived yet contributes only its start), or None when ``prefix`` does
    not start with a zip local file header.
    """
    view = _as_bytes_view(prefix)
    if bytes(view[:4]) != _LOCAL:
        return None
    return ZipBoundaries().feed(view)


# ---- zstd frames (Orbax/tensorstore OCDBT data files) ------------------------------

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_MAX_BLOCK = 128 * 1024


def _zstd_skippable(sig: bytes) -> bool:
    """A skippable frame's magic, 0x184D2A50 to 0x184D2A5F."""
    return len(sig) == 4 and sig[1:] == b"\x2a\x4d\x18" and sig[0] & 0xF0 == 0x50


def _zstd_sig_prefix(partial: bytes) -> bool:
    """Could these first bytes (fewer than 4) still become a frame's magic?"""
    if _ZSTD_MAGIC.startswith(partial):
        return True
    return not partial or (partial[0] & 0xF0 == 0x50 and b"\x2a\x4d\x18".startswith(partial[1:]))


class ZstdFrames(_StreamParser):
    """Incremental parser of zstd frames in a stream that starts with one.

    tensorstore's OCDBT data files (what Orbax checkpoints are made of) hold
    values back to back; with Orbax's zarr3 layout each value is a shard: its
    array chunks as zstd frames, then a small shard index (16 bytes per chunk
    and a CRC-32C).  A frame's extent follows from its headers alone: the
    frame header (magic, descriptor, optional window, dictionary id and
    content size), blocks whose 3-byte headers give their sizes, an optional
    4-byte checksum; skippable frames give their size up front.  After
    anything that is not a frame (a shard index, B-tree nodes) the parser
    looks for the next frame magic.

    :meth:`feed` returns, ascending, every frame's end (learned from bytes
    before it) and the start of every frame that follows other bytes (learned
    from its magic, so :attr:`stable` holds back at most 3 bytes of a
    possible magic).  A bogus magic inside other bytes only moves a cut.
    """

    _FRAME, _BLOCK, _SEARCH = range(3)

    def __init__(self) -> None:
        super().__init__()
        self._mode = self._FRAME
        self._at = 0                    # FRAME/BLOCK: next header; SEARCH: first unsearched byte
        self._checksum = False

    @property
    def done(self) -> bool:
        return False                    # a frame may follow anything

    @property
    def stable(self) -> int:
        return min(self._at, self.seen) if self._mode == self._SEARCH else self.seen

    def _keep_from(self) -> int:
        return self._at

    def _step(self, out: list[int]) -> bool:
        """Parse or search at self._at; False when it needs more bytes."""
        at = self._at
        if at >= self.seen:
            return False
        if self._mode == self._SEARCH:
            return self._search(out)
        if self._mode == self._BLOCK:
            b = self._bytes(at, at + 3)
            if b is None:
                return False
            header = int.from_bytes(b, "little")
            last, kind, size = header & 1, (header >> 1) & 3, header >> 3
            if kind == 3 or size > _ZSTD_MAX_BLOCK:
                self._mode = self._SEARCH        # not a block after all
                return True
            self._at = at + 3 + (1 if kind == 1 else size)
            if last:
                self._at += 4 if self._checksum else 0
                out.append(self._at)
                self._mode = self._FRAME
            return True
        head = self._bytes(at, min(at + 8, self.seen)) or b""
        if len(head) < 4:
            if not _zstd_sig_prefix(head):
                self._mode = self._SEARCH
                return True
            return False
        if _zstd_skippable(head[:4]):
            if len(head) < 8:
                return False
            self._at = at + 8 + int.from_bytes(head[4:8], "little")
            out.append(self._at)
            return True
        if head[:4] != _ZSTD_MAGIC or (len(head) > 4 and head[4] & 0x08):
            self._mode = self._SEARCH           # not a frame (or a reserved bit set)
            return True
        if len(head) < 5:
            return False
        fhd = head[4]
        single = (fhd >> 5) & 1
        fcs = (1 if single else 0, 2, 4, 8)[fhd >> 6]
        header = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + fcs
        if at + header > self.seen:
            return False
        self._checksum = bool(fhd & 0x04)
        self._at = at + header
        self._mode = self._BLOCK
        return True

    def _search(self, out: list[int]) -> bool:
        """Find the next frame magic at or after self._at (the first byte there
        is known not to start a frame, so the search starts one byte later)."""
        q = self._at + 1
        base = self._base
        if q < base:                    # a magic may start in the kept tail
            region = self._bytes(q, min(self.seen, base + 3)) or b""
            hit = region.find(_ZSTD_MAGIC)
            if hit >= 0:
                return self._found(q + hit, out)
            q = base
        hit = native.find4(self._view, _ZSTD_MAGIC, q - base) if q < self.seen else -1
        if hit >= 0:
            return self._found(base + hit, out)
        # Keep a possible partial magic at the end; search again from there.
        for k in (3, 2, 1):
            if self.seen - k >= q and self._bytes(self.seen - k, self.seen) == _ZSTD_MAGIC[:k]:
                self._at = self.seen - k - 1
                return False
        self._at = self.seen - 1
        return False

    def _found(self, q: int, out: list[int]) -> bool:
        out.append(q)                   # what came before (a shard index, say) ends here
        self._at = q
        self._mode = self._FRAME
        return True


# ---- TensorFlow tensor bundle (tf.train.Checkpoint) ---------------------------------

_SSTABLE_MAGIC = 0xDB4775248B80FB57
_SSTABLE_FOOTER = 48


class TensorBundleEntry(NamedTuple):
    """One tensor of a TensorFlow checkpoint: where its bytes are."""

    key: str
    shard: int          # the NNNNN of `<prefix>.data-NNNNN-of-MMMMM`
    offset: int
    size: int


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _sstable_block(data: bytes, offset: int, size: int) -> list[tuple[bytes, bytes]]:
    """The (key, value) entries of one uncompressed leveldb-format table block."""
    if offset + size + 5 > len(data):
        raise ValueError("block beyond the end of the table")
    if data[offset + size] != 0:
        raise ValueError("compressed table block")      # TensorFlow writes none
    block = data[offset:offset + size]
    (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * restarts
    if end < 0:
        raise ValueError("bad restart array")
    out, pos, key = [], 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        vlen, pos = _varint(block, pos)
        if shared > len(key) or pos + unshared + vlen > end:
            raise ValueError("bad block entry")
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        out.append((key, block[pos:pos + vlen]))
        pos += vlen
    return out


def _bundle_entry(value: bytes) -> tuple[int, int, int]:
    """(shard_id, offset, size) of a BundleEntryProto (fields 3, 4, 5)."""
    fields = {3: 0, 4: 0, 5: 0}
    pos = 0
    while pos < len(value):
        tag, pos = _varint(value, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            v, pos = _varint(value, pos)
            if number in fields:
                fields[number] = v
        elif wire == 2:
            n, pos = _varint(value, pos)
            pos += n
        elif wire == 5:
            pos += 4
        elif wire == 1:
            pos += 8
        else:
            raise ValueError(f"wire type {wire} in a BundleEntryProto")
    if pos != len(value):
        raise ValueError("truncated BundleEntryProto")
    return fields[3], fields[4], fields[5]


def tf_bundle_index(index: Buffer) -> list[TensorBundleEntry]:
    """Every tensor a TensorFlow checkpoint's ``.index`` file names, by data file offset.

    The index is a leveldb-format table (48-byte footer with the index block's
    handle and the magic ``0xdb4775248b80fb57``; blocks of prefix-compressed
    keys) mapping each tensor's key to a BundleEntryProto (shard, offset and
    size in ``<prefix>.data-<shard>-of-<n>``); the empty key holds the
    bundle's header.  Raises ValueError if ``index`` is not such a table.
    """
    data = bytes(_as_bytes_view(index))
    if len(data) < _SSTABLE_FOOTER or \
            struct.unpack_from("<Q", data, len(data) - 8)[0] != _SSTABLE_MAGIC:
        raise ValueError("not a TensorFlow tensor bundle index")
    footer = data[len(data) - _SSTABLE_FOOTER:]
    _, pos = _varint(footer, 0)                   # metaindex handle: offset, size
    _, pos = _varint(footer, pos)
    index_off, pos = _varint(footer, pos)
    index_size, pos = _varint(footer, pos)
    out = []
    for _, handle in _sstable_block(data, index_off, index_size):
        off, p = _varint(handle, 0)
        size, _ = _varint(handle, p)
        for key, value in _sstable_block(data, off, size):
            if key:                                  # b"": the BundleHeaderProto
                shard, offset, nbytes = _bundle_entry(value)
                out.append(TensorBundleEntry(key.decode("utf-8", "replace"), shard, offset,
                                             nbytes))
    return sorted(out, key=lambda e: (e.shard, e.offset))


# ---- format detection --------------------------------------------------------------


class FormatHints:
    """Detects the format of a stream from its first bytes and reports its
    tensor boundaries as they become known.

    ``feed(data)`` returns the new boundaries, ascending; :attr:`stable` is the
    offset below which no further boundary can appear.  :attr:`format` is
    None until decided, then "safetensors", "zip", "zstd" (frames back to
    back: OCDBT data files) or "unknown" (no hints).
    A safetensors header longer than ``max_header`` is not collected: real
    ones are kilobytes, and a daemon should not buffer 100 MB per open file.
    """

    def __init__(self, max_header: int = 16 << 20) -> None:
        self.max_header = max_header
        self.format: Optional[str] = None
        self.seen = 0
        self._head = b""  # first bytes, until the format is decided
        self._zip: Optional[ZipBoundaries] = None
        self._zstd: Optional[ZstdFrames] = None
        self._header: Optional[bytearray] = None  # safetensors header so far
        self._header_size = 0

    @property
    def stable(self) -> int:
        if self._zip is not None and not self._zip.done:
            return self._zip.stable
        if self._zstd is not None:
            return self._zstd.stable
        return self.seen

    def feed(self, data: Buffer) -> list[int]:
        view = _as_bytes_view(data)
        self.seen += len(view)
        if self.format is None:
            head = self._head + bytes(view[: 9 - len(self._head)])
            earlier, self._head = self._head, head
            fmt = self._sniff(head)
            if fmt is None:
                return []
            self.format = fmt
            self._head = b""
            if fmt == "zip":
                self._zip = ZipBoundaries()
                return self._zip.feed(earlier) + self._zip.feed(view)
            if fmt == "zstd":
                self._zstd = ZstdFrames()
                return self._zstd.feed(earlier) + self._zstd.feed(view)
            if fmt == "safetensors":
                self._header = bytearray(earlier)
                return self._feed_safetensors(view)
            return []
        if self._zip is not None:
            return self._zip.feed(view) if not self._zip.done else []
        if self._zstd is not None:
            return self._zstd.feed(view) if not self._zstd.done else []
        if self._header is not None:
            return self._feed_safetensors(view)
        return []

    def _sniff(self, head: bytes) -> Optional[str]:
        if head[:4] == _LOCAL:
            return "zip"
        if head[:4] == _ZSTD_MAGIC:
            return "zstd"
        if len(head) < 9:
            return None
        size = safetensors_header_size(head)
        if size is None or size > self.max_header:
            return "unknown"
        self._header_size = size
        return "safetensors"

    def _feed_safetensors(self, view: memoryview) -> list[int]:
        assert self._header is not None
        need = self._header_size - len(self._header)
        self._header += view[:need]
        if len(self._header) < self._header_size:
            return []
        bounds = safetensors_boundaries(self._header)
        self._header = None
        if bounds is None:
            self.format = "unknown"
            return []
        return bounds
