"""Content-defined chunking with forced cuts at tensor boundaries; chunk ids.

A :class:`Chunker` cuts one file's byte stream into chunks as it is fed, in
any pieces: the same bytes give the same chunks however they are split.  Cut
points come from the native gear-hash scan (``ckptfs.native.GearScanner``; the
rule is in native/ckptfs_native.h), so bytes inserted or removed early in a
file move the cuts with the content and later chunks still dedup.  Forced
boundaries, from the caller or learned from the stream by
:class:`ckptfs.formats.FormatHints`, end the pending chunk wherever they fall,
and the content-defined scan restarts after each: no chunk straddles a tensor
boundary, so a changed tensor only ever dirties its own chunks.

The chunker holds no data: it reports chunks as ``(offset, length)`` in the
stream, and the caller, who has the bytes, names each with :func:`chunk_id`.
The only bytes it keeps are the few (at most 27) a zip hint may still turn
into a boundary.  Default sizes and why: docs/CHUNKING.md.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Optional

from blake3 import blake3

from ckptfs import native
from ckptfs.formats import FormatHints

if TYPE_CHECKING:
    if sys.version_info >= (3, 12):
        from collections.abc import Buffer
    else:
        from typing_extensions import Buffer

__all__ = [
    "DEFAULT_MIN_SIZE",
    "DEFAULT_AVG_SIZE",
    "DEFAULT_MAX_SIZE",
    "MAX_CHUNK_BYTES",
    "CHUNK_ID_SIZE",
    "chunk_id",
    "Chunker",
    "BatchChunker",
    "NamedChunks",
    "name_whole_pieces",
    "chunk_buffer",
]

# Measured on GPT-style checkpoint series (tools/chunk_sizes.py, docs/CHUNKING.md).
DEFAULT_MIN_SIZE = 16 * 1024
DEFAULT_AVG_SIZE = 64 * 1024
DEFAULT_MAX_SIZE = 256 * 1024

# The largest chunk ckptfs ever stores in the log or in a pack: content-defined
# chunks are at most DEFAULT_MAX_SIZE; with dedup=off a write record is one
# chunk, and the kernel sends writes of at most 1 MiB (files.py cuts longer
# ones). Pre-existing (SOURCE) chunks never go to packs and are not bounded.
# Every decoder (packs, codec, cold reads, fsck) refuses a length above this
# before it allocates or decompresses anything.
MAX_CHUNK_BYTES = 1 << 20
assert DEFAULT_MAX_SIZE <= MAX_CHUNK_BYTES

CHUNK_ID_SIZE = 32


def chunk_id(data: Buffer) -> bytes:
    """BLAKE3-256 of the chunk's bytes.

    Single-threaded (``max_threads=1``): chunks are at most a few hundred KiB,
    where blake3's thread pool costs more than it gains, and the filesystem
    hashes many chunks in parallel anyway.  blake3 releases the GIL for inputs
    of 2 KiB and more.
    """
    return blake3(data).digest()


class Chunker:
    """Cuts one byte stream into content-defined chunks.

    ``feed(data)`` takes the next bytes and returns the chunks completed by
    them as ``(offset, length)``; ``finish()`` ends the stream and returns the
    rest.  Chunks tile the stream in order.  Every chunk is ``min_size`` to
    ``max_size`` bytes except one that ends at a forced boundary or at the end
    of the stream, which may be shorter.

    Forced boundaries come from ``boundaries`` and :meth:`add_boundaries` (at
    or after :attr:`scanned`: a boundary behind the scan cannot be honoured
    and raises ValueError) and, with ``detect_format``, from the stream's own
    safetensors header or zip (torch.save) member headers.
    """

    def __init__(
        self,
        min_size: int = DEFAULT_MIN_SIZE,
        avg_size: int = DEFAULT_AVG_SIZE,
        max_size: int = DEFAULT_MAX_SIZE,
        boundaries: Iterable[int] = (),
        detect_format: bool = True,
    ) -> None:
        self._scanner = native.GearScanner(min_size, avg_size, max_size)
        self._hints: Optional[FormatHints] = FormatHints() if detect_format else None
        self._forced: list[int] = []  # descending (next one last), all > self._start
        self._start = 0  # offset of the pending chunk
        self._scanned = 0  # bytes passed through the scanner
        self._fed = 0
        self._held = b""  # bytes [self._scanned, self._fed), waiting on a hint
        self._finished = False
        self.add_boundaries(boundaries)

    @property
    def position(self) -> int:
        """Bytes fed so far."""
        return self._fed

    @property
    def scanned(self) -> int:
        """Bytes already cut into chunks or into the pending chunk."""
        return self._scanned

    @property
    def format(self) -> Optional[str]:
        """The detected format ("safetensors", "zip", "unknown") or None."""
        return self._hints.format if self._hints is not None else None

    @property
    def boundaries(self) -> list[int]:
        """Forced boundaries not yet reached, ascending."""
        return self._forced[::-1]

    def add_boundaries(self, offsets: Iterable[int]) -> None:
        """Force cuts at these stream offsets (any order, duplicates fine)."""
        new = sorted(set(offsets))
        if not new:
            return
        if new[0] < self._scanned:
            raise ValueError(
                f"boundary {new[0]} lies before the scanned position {self._scanned}"
            )
        new = [b for b in new if b > self._start]
        if not new:
            return
        if self._forced and new[0] <= self._forced[0]:
            self._forced = sorted(set(self._forced).union(new), reverse=True)
        else:  # the usual case: all beyond those already known
            self._forced[:0] = new[::-1]

    def feed(self, data: Buffer) -> list[tuple[int, int]]:
        """Add the stream's next bytes; return the chunks they complete."""
        if self._finished:
            raise ValueError("feed() after finish()")
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        base = self._fed
        self._fed += len(view)
        limit = self._fed
        if self._hints is not None:
            self.add_boundaries(self._hints.feed(view))
            limit = min(limit, self._hints.stable)
        out: list[tuple[int, int]] = []
        if self._held:
            held, held_at = self._scan_held(limit, out)
            if self._scanned < base:  # the hint still holds back older bytes
                self._held = held[self._scanned - held_at :] + bytes(view)
                return out
        self._advance(view, base, limit, out)
        if self._scanned < self._fed:
            self._held = bytes(view[self._scanned - base :])
        return out

    def finish(self) -> list[tuple[int, int]]:
        """End the stream; return the remaining chunks."""
        if self._finished:
            return []
        out: list[tuple[int, int]] = []
        if self._held:
            self._scan_held(self._fed, out)
        if self._fed > self._start:
            out.append((self._start, self._fed - self._start))
            self._start = self._fed
        self._scanner.reset()
        self._forced.clear()
        self._finished = True
        return out

    def _scan_held(self, limit: int, out: list[tuple[int, int]]) -> tuple[bytes, int]:
        """Scan the bytes held back for a hint up to limit; returns them and
        their stream offset (feed holds back again what is not scanned yet)."""
        held, held_at = self._held, self._scanned
        self._held = b""
        self._advance(memoryview(held), held_at, limit, out)
        return held, held_at

    def _advance(
        self, view: memoryview, base: int, limit: int, out: list[tuple[int, int]]
    ) -> None:
        """Scan ``view`` (stream offsets ``base`` on) from the scanned position
        up to ``limit``, cutting at forced boundaries on the way."""
        pos = self._scanned
        stop = min(limit, base + len(view))
        forced = self._forced
        while pos < stop or (forced and forced[-1] == pos):
            if forced and forced[-1] == pos:
                # Forced cut: end the pending chunk, restart the scan here.
                forced.pop()
                if pos > self._start:
                    out.append((self._start, pos - self._start))
                    self._start = pos
                self._scanner.reset()
                continue
            seg_end = min(stop, forced[-1]) if forced else stop
            for cut in self._scanner.scan(view[pos - base : seg_end - base]):
                end = pos + cut
                out.append((self._start, end - self._start))
                self._start = end
            pos = seg_end
        self._scanned = max(self._scanned, pos)


class NamedChunks:
    """Chunks cut and named in one batch, as columns (no object per chunk):
    stream offset, length, BLAKE3 id (b"" for an all-zero chunk), per-block
    CRC-32Cs, zero flag."""

    __slots__ = ("offsets", "lengths", "ids", "crcs", "zero")

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.ids: list[bytes] = []
        self.crcs: list[bytes] = []
        self.zero: list[bool] = []

    def __len__(self) -> int:
        return len(self.offsets)


class BatchChunker(Chunker):
    """A :class:`Chunker` that also names what it cuts: BLAKE3 id, CRC-32C per
    ``crc_block`` and zero flag of every chunk, computed as the bytes pass
    (one native call per buffer: cut, checksum, zero test; BLAKE3 per chunk,
    a chunk spanning buffers hashed incrementally), so no byte is read back.
    Same cuts as :class:`Chunker` for the same stream."""

    def __init__(self, min_size: int = DEFAULT_MIN_SIZE, avg_size: int = DEFAULT_AVG_SIZE,
                 max_size: int = DEFAULT_MAX_SIZE, boundaries: Iterable[int] = (),
                 detect_format: bool = True, crc_block: int = 64 * 1024,
                 hash_in_c: bool = True) -> None:
        # BLAKE3 in the same C call when the module has it (one GIL release
        # per buffer, not one per chunk); else here, with the blake3 package.
        self._feeder = native.ChunkFeeder(min_size, avg_size, max_size, crc_block,
                                          hash_ids=hash_in_c)
        self._hasher = None            # BLAKE3 of the pending chunk's bytes so far
        self._named = NamedChunks()
        super().__init__(min_size, avg_size, max_size, boundaries, detect_format)

    def feed_named(self, data: Buffer) -> NamedChunks:
        """`feed`, returning the completed chunks named."""
        self.feed(data)
        return self._take()

    def finish_named(self) -> NamedChunks:
        """`finish`, returning the remaining chunks named."""
        self.finish()
        return self._take()

    def _take(self) -> NamedChunks:
        named, self._named = self._named, NamedChunks()
        return named

    def _advance(self, view: memoryview, base: int, limit: int,
                 out: list[tuple[int, int]]) -> None:
        pos = self._scanned
        stop = max(pos, min(limit, base + len(view)))
        forced = self._forced
        rel = []
        while forced and forced[-1] <= stop:
            rel.append(forced.pop() - pos)
        seg = view[pos - base:stop - base]
        ends, lengths, zero, crcs, ids = self._feeder.feed(seg, rel)
        named = self._named
        hasher = self._hasher
        block = self._feeder.crc_block
        last = 0
        for k, end in enumerate(ends):
            length = lengths[k]
            start = end - length
            if zero[k]:
                cid = b""
            elif ids:
                cid = ids[32 * k:32 * k + 32]
            elif start >= 0:
                cid = blake3(seg[start:end]).digest()
            else:                      # begun in an earlier buffer
                hasher.update(seg[:end])
                cid = hasher.digest()
            hasher = None
            named.offsets.append(pos + start)
            named.lengths.append(length)
            named.ids.append(cid)
            named.crcs.append(crcs[64 * k:64 * k + 4 * (-(-length // block))])
            named.zero.append(bool(zero[k]))
            out.append((pos + start, length))
            last = end
        if len(seg) > last and not self._feeder.hashes:
            if hasher is None:
                hasher = blake3(seg[last:])
            else:
                hasher.update(seg[last:])
        self._hasher = hasher
        if ends:
            self._start = pos + last
        self._scanned = stop

    def finish(self) -> list[tuple[int, int]]:
        if self._finished:
            return []
        out: list[tuple[int, int]] = []
        if self._held:
            self._scan_held(self._fed, out)
        length, zero, crcs, cid = self._feeder.finish()
        if length:
            assert self._start + length == self._fed, (self._start, length, self._fed)
            named = self._named
            named.offsets.append(self._start)
            named.lengths.append(length)
            named.ids.append(b"" if zero else cid or self._hasher.digest())
            named.crcs.append(crcs)
            named.zero.append(zero)
            out.append((self._start, length))
            self._start = self._fed
        self._hasher = None
        self._forced.clear()
        self._finished = True
        return out


def name_whole_pieces(data: Buffer, offs: list[int], lens: list[int],
                      crc_block: int = 64 * 1024, hash_in_c: bool = True) -> NamedChunks:
    """Name pieces of ``data``, each a stream of its own shorter than
    ``DEFAULT_MIN_SIZE`` and with no forced cut (no format hints): each is
    one chunk, named exactly as a :class:`BatchChunker` with
    ``detect_format=False`` fed only that piece would name it, in one native
    call for them all (one GIL release, not two per piece). ``offsets`` are
    the pieces' offsets in ``data``."""
    for length in lens:
        if not 0 < length < DEFAULT_MIN_SIZE:
            raise ValueError(f"piece of {length} bytes: a cut may fall inside it")
    zero, crcs, ids = native.name_pieces(data, offs, lens, crc_block, hash_ids=hash_in_c)
    view = memoryview(data)
    named = NamedChunks()
    for k, (off, length) in enumerate(zip(offs, lens)):
        named.offsets.append(off)
        named.lengths.append(length)
        if zero[k]:
            named.ids.append(b"")
        elif ids:
            named.ids.append(ids[32 * k:32 * k + 32])
        else:
            named.ids.append(blake3(view[off:off + length]).digest())
        named.crcs.append(crcs[64 * k:64 * k + 4 * (-(-length // crc_block))])
        named.zero.append(bool(zero[k]))
    return named


def chunk_buffer(
    data: Buffer,
    min_size: int = DEFAULT_MIN_SIZE,
    avg_size: int = DEFAULT_AVG_SIZE,
    max_size: int = DEFAULT_MAX_SIZE,
    boundaries: Iterable[int] = (),
    detect_format: bool = True,
) -> list[tuple[int, int]]:
    """Chunks of a whole buffer: one :class:`Chunker` fed once, then finished.

    The commit-time path for files written out of order."""
    chunker = Chunker(min_size, avg_size, max_size, boundaries, detect_format)
    return chunker.feed(data) + chunker.finish()
