"""The chunk reader: which chunk bytes make up a read, and reading them.

A read is planned on the trio thread (`plan`): the open file's overlay
first (new chunks, staged records, stored chunks it names), the committed
extent map under it (cut at a pending truncation), holes left out. The plan
is then executed (`read_blocking`): LOG chunks from the log, every 64 KiB
block CRC-checked; staged bytes from the log as they are (nothing committed
names them yet); PACK chunks from the cold store (`coldstore.ColdStore`,
given to the constructor: None when no backing store is attached); SOURCE
chunks from the pre-existing originals (`sources.SourceFiles`). A damaged
record or a short chunk is DamagedData (EIO), never a read past a chunk.

A read of cold chunks also asks the prefetcher for the cold chunks a
sequential reader will want next (`cold_ahead`), continuing from where the
last read's look-ahead stopped.

`read` holds the bytes it planned with in place while it runs (the file's
gate for uncommitted space, the reclaimer's read epochs for committed space)
and decides where the byte work runs: inline up to INLINE_BYTES, else on a
worker thread. `read_blocking` may block; the rest runs on the trio thread.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import trio

from . import index as ix
from .dirtyfile import DirtyFile
from .errors import DamagedData
from .index import CHUNK_LOG, CHUNK_PACK, CHUNK_SOURCE, Chunk, Index
from .overlay import ZERO_CHUNK
from .pmemlog import PmemLog
from .reclaim import Reclaimer
from .sources import SourceFiles
from .staging import CHUNK_STAGED, StagedRecord

if TYPE_CHECKING:
    from .coldstore import ColdStore, Prefetcher

INLINE_BYTES = 64 * 1024         # reads up to this size are assembled on the trio thread
AHEAD_RESCAN_BYTES = 64 << 20    # a reader this far behind its look-ahead starts it again

AnyChunk = Union[Chunk, StagedRecord]


@dataclass(slots=True)
class ReadPiece:
    dst_off: int
    length: int
    chunk: AnyChunk
    chunk_off: int


class ChunkReader:
    """Plans and executes reads of file bytes, wherever the chunks are."""

    def __init__(self, index: Index, plog: PmemLog, sources: SourceFiles,
                 reclaimer: Reclaimer, io_limiter: trio.CapacityLimiter,
                 cold: Optional["ColdStore"] = None,
                 prefetcher: Optional["Prefetcher"] = None) -> None:
        self.index = index
        self.log = plog
        self.sources = sources
        self.reclaimer = reclaimer
        self.io_limiter = io_limiter
        self.cold = cold
        self.prefetcher = prefetcher
        self._ahead: dict[int, int] = {}        # ino -> file offset looked ahead to
        self.bytes_read = 0

    async def read(self, df: Optional[DirtyFile], ino: int, off: int, size: int,
                   file_size: int) -> bytes | bytearray:
        """The bytes of [off, off+size) of ino (df: its uncommitted changes,
        quiesced by the caller), short at the end of the file."""
        length, pieces = self.plan(df, ino, off, size, file_size)
        if not pieces:
            return bytes(length)
        if self.prefetcher is not None and any(p.chunk.kind == CHUNK_PACK for p in pieces):
            self.prefetcher.prefetch(self.cold_ahead(ino, off + size, file_size))
        # The gate keeps uncommitted space it reads from being reused; the
        # epoch, committed space freed meanwhile.
        with df.reading() if df is not None else nullcontext():
            epoch = self.reclaimer.begin_read()
            try:
                if length > INLINE_BYTES:
                    data = await trio.to_thread.run_sync(self.read_blocking, length, pieces,
                                                         limiter=self.io_limiter)
                else:
                    data = self.read_blocking(length, pieces)
            finally:
                self.reclaimer.end_read(epoch)
        self.bytes_read += length
        return data

    def forget(self, ino: int) -> None:
        """The kernel forgot ino: drop its look-ahead position."""
        self._ahead.pop(ino, None)

    # ------------------------------------------------------------ planning

    def plan(self, df: Optional[DirtyFile], ino: int, off: int, size: int, file_size: int
             ) -> tuple[int, list[ReadPiece]]:
        """Which chunk bytes make up [off, off+size): (length, pieces). Holes are absent."""
        end = min(off + size, file_size)
        if end <= off:
            return 0, []
        pieces: list[ReadPiece] = []
        pos = off
        committed_end = end
        if df is not None:
            if df.trunc_to is not None:
                committed_end = min(end, df.trunc_to)
            for e in df.overlay.within(off, end):
                a = max(e.file_off, off)
                if a > pos:
                    self._committed_pieces(ino, pos, min(a, committed_end), off, pieces)
                b = min(e.end, end)
                pos = b
                if e.chunk_no == ZERO_CHUNK:
                    continue            # zeros: the buffer has them already
                chunk = df.new_chunks.get(e.chunk_no) or df.staged.get(e.chunk_no) \
                    or self.reclaimer.chunk(e.chunk_no)
                pieces.append(ReadPiece(a - off, b - a, chunk, e.chunk_off + (a - e.file_off)))
        if pos < committed_end:
            self._committed_pieces(ino, pos, committed_end, off, pieces)
        return end - off, pieces

    def _committed_pieces(self, ino: int, a: int, b: int, base: int,
                          pieces: list[ReadPiece]) -> None:
        if a >= b:
            return
        for e in ix.iter_extents(self.index, ino, a, b):
            s, t = max(e.file_off, a), min(e.end, b)
            pieces.append(ReadPiece(s - base, t - s, self.reclaimer.chunk(e.chunk_no),
                                    e.chunk_off + (s - e.file_off)))

    def cold_ahead(self, ino: int, off: int, file_size: int) -> list[Chunk]:
        """Cold chunks a sequential reader of ino will want next, not asked for yet.

        Each read continues from where the last one's look-ahead stopped, so a
        sequential restore scans every extent once, not once per read.
        """
        want = self.prefetcher.depth_chunks
        horizon = self._ahead.get(ino, 0)
        if horizon > off + want * 32 * 1024:
            return []               # far enough ahead already
        start = max(off, horizon) if horizon <= off + AHEAD_RESCAN_BYTES else off
        out = []
        end = start
        for e in ix.iter_extents(self.index, ino, start, file_size):
            end = e.end
            chunk = ix.get_chunk(self.index, e.chunk_no)
            if chunk is not None and chunk.kind == CHUNK_PACK:
                out.append(chunk)
                if len(out) >= want:
                    break
        self._ahead[ino] = max(end, start)
        return out

    # ----------------------------------------------------------- executing

    def read_blocking(self, length: int, pieces: list[ReadPiece]) -> bytearray:
        """Assemble the bytes of a read plan, verifying every log block. May block."""
        out = bytearray(length)
        view = memoryview(out)
        for p in pieces:
            dst = view[p.dst_off:p.dst_off + p.length]
            if p.chunk.kind in (CHUNK_LOG, CHUNK_PACK):
                # A damaged index record is EIO, never a read past the chunk.
                ix.check_chunk_record(p.chunk)
                if p.chunk_off + p.length > p.chunk.length:
                    raise DamagedData(f"an extent reaches byte {p.chunk_off + p.length} of "
                                      f"{p.chunk.length}-byte chunk {p.chunk.chunk_no}")
            if p.chunk.kind == CHUNK_LOG:
                self.log.read_into(dst, p.chunk.log_off, p.chunk.length, p.chunk.crcs,
                                   p.chunk_off)
            elif p.chunk.kind == CHUNK_STAGED:
                self.log.read_unverified_into(dst, p.chunk.log_off + p.chunk_off)
            elif p.chunk.kind == CHUNK_PACK:
                if self.cold is None:
                    raise DamagedData(f"chunk {p.chunk.chunk_no} is in the backing store, "
                                      "which is not attached")
                self.cold.read_into(dst, p.chunk, p.chunk_off)
            elif p.chunk.kind == CHUNK_SOURCE:
                self.sources.read_into(dst, p.chunk, p.chunk_off)
            else:
                raise DamagedData(f"chunk {p.chunk.chunk_no} has unknown kind {p.chunk.kind}")
        return out
