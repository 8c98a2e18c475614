"""Per-file extent maps: logical range -> chunk bytes.

A file's committed map lives in the index (`extents`). While a file is open
for writing, its changes gather in an in-memory `DirtyFile` overlay: new
extents (pointing at chunks whose bytes are already in the log) and a
truncation point. `commit_file` folds the overlay into the committed map in
the index's open batch, so a file's new content becomes visible to a crash
all at once or not at all.

Chunk reference counts: a chunk's refcount in the index is the number of
committed extents pointing into it. Splitting an extent adds a reference,
dropping one removes one; a chunk reaching zero is deleted in the same batch
and its log space is released once that batch is durable. Chunks written but
never committed (overwritten while still dirty) are released at once, since
no durable index names them.

Everything here runs on the trio thread except the `*_blocking` functions,
which do the byte work and belong on a worker thread when large.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import trio

from . import index as ix
from .errors import DamagedData, FileTooLarge
from .index import CHUNK_LOG, CHUNK_SOURCE, Chunk, Extent, Index
from .pmemlog import PmemLog

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 62


@dataclass
class DirtyFile:
    """An open file's uncommitted changes, overlaid on its committed map."""

    ino: int
    size: int
    extents: list[Extent] = field(default_factory=list)    # sorted, non-overlapping
    starts: list[int] = field(default_factory=list)         # file_off of each extent
    new_chunks: dict[int, Chunk] = field(default_factory=dict)
    new_chunk_refs: Counter = field(default_factory=Counter)
    trunc_to: Optional[int] = None   # committed bytes at and after this are gone
    mtime_ns: Optional[int] = None
    ctime_ns: Optional[int] = None
    inflight: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    write_error: Optional[BaseException] = None
    release_when_settled: list[Chunk] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def dirty(self) -> bool:
        return bool(self.extents) or self.trunc_to is not None or self.mtime_ns is not None


@dataclass(slots=True)
class ReadPiece:
    dst_off: int
    length: int
    chunk: Chunk
    chunk_off: int


class SourceFiles:
    """Read-only access to files that were in SOURCE before it was mounted over.

    Paths resolve relative to a directory fd opened before the mount, so they
    reach the underlying directory even when the mount sits on top of it.
    """

    def __init__(self, source_fd: int, max_open: int = 64) -> None:
        self.source_fd = source_fd
        self._fds: dict[bytes, int] = {}
        self._max_open = max_open

    def read_into(self, out: memoryview, path: bytes, off: int) -> None:
        """May block."""
        fd = self._fd(path)
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], off + done)
            if n == 0:
                raise DamagedData(f"pre-existing file {path!r} is shorter than recorded "
                                  "(changed while unmounted?)")
            done += n

    def _fd(self, path: bytes) -> int:
        fd = self._fds.pop(path, None)
        if fd is None:
            if len(self._fds) >= self._max_open:
                oldest = next(iter(self._fds))
                os.close(self._fds.pop(oldest))
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.source_fd)
            except OSError as e:
                raise DamagedData(f"pre-existing file {path!r} is gone: {e.strerror}") from e
        self._fds[path] = fd        # most recently used last
        return fd

    def remove(self, path: bytes) -> None:
        """Delete a pre-existing file whose last reference is gone. May block."""
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(path, dir_fd=self.source_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove pre-existing file %r: %s", path, e.strerror)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class FileData:
    """Owns extent maps and chunk lifetimes; reads and writes file bytes."""

    def __init__(self, index: Index, plog: PmemLog, sources: SourceFiles) -> None:
        self.index = index
        self.log = plog
        self.sources = sources
        self.dirty: dict[int, DirtyFile] = {}
        self.bytes_written = 0
        self.bytes_read = 0

    # ------------------------------------------------------------- dirty state

    def dirty_file(self, ino: int, size: int) -> DirtyFile:
        df = self.dirty.get(ino)
        if df is None:
            df = self.dirty[ino] = DirtyFile(ino, size)
        return df

    def prepare_write(self, df: DirtyFile, off: int, nbytes: int
                      ) -> list[tuple[Chunk, int, int]]:
        """Reserve log space for a write and put it in the file's overlay now.

        Returns (chunk, offset in data, length) pieces for `store_blocking`.
        The overlay is updated before the bytes land so that overlapping
        writes keep their arrival order; readers wait for `df.idle` first.
        """
        if off + nbytes > MAX_FILE_BYTES:
            raise FileTooLarge(f"write beyond {MAX_FILE_BYTES} bytes")
        pieces = []
        pos = 0
        for log_off, usable in self.log.allocate(nbytes):
            chunk = Chunk(self.index.allocate_id(b"next_chunk"), CHUNK_LOG, 0, usable,
                          log_off=log_off)
            df.new_chunks[chunk.chunk_no] = chunk
            self._put_dirty(df, Extent(off + pos, usable, chunk.chunk_no, 0))
            pieces.append((chunk, pos, usable))
            pos += usable
        df.size = max(df.size, off + nbytes)
        return pieces

    def store_blocking(self, data: bytes, pieces: list[tuple[Chunk, int, int]]) -> None:
        """Copy a write's bytes into the log. May block."""
        view = memoryview(data)
        for chunk, pos, length in pieces:
            chunk.crcs = self.log.store(chunk.log_off, view[pos:pos + length])

    def _put_dirty(self, df: DirtyFile, e: Extent) -> None:
        self._cut_dirty(df, e.file_off, e.end)
        i = bisect.bisect_left(df.starts, e.file_off)
        df.extents.insert(i, e)
        df.starts.insert(i, e.file_off)
        df.new_chunk_refs[e.chunk_no] += 1

    def _cut_dirty(self, df: DirtyFile, a: int, b: int) -> None:
        """Remove [a, b) from the overlay, trimming extents that straddle it."""
        i = max(bisect.bisect_right(df.starts, a) - 1, 0)
        while i < len(df.extents):
            e = df.extents[i]
            if e.file_off >= b:
                break
            if e.end <= a:
                i += 1
                continue
            keep = []
            if e.file_off < a:
                keep.append(Extent(e.file_off, a - e.file_off, e.chunk_no, e.chunk_off))
            if e.end > b:
                keep.append(Extent(b, e.end - b, e.chunk_no, e.chunk_off + (b - e.file_off)))
            df.extents[i:i + 1] = keep
            df.starts[i:i + 1] = [k.file_off for k in keep]
            self._drop_dirty_ref(df, e.chunk_no, len(keep) - 1)
            i += len(keep)

    def _drop_dirty_ref(self, df: DirtyFile, chunk_no: int, delta: int) -> None:
        df.new_chunk_refs[chunk_no] += delta
        if df.new_chunk_refs[chunk_no] <= 0:
            del df.new_chunk_refs[chunk_no]
            chunk = df.new_chunks.pop(chunk_no, None)
            if chunk is not None:
                # Never committed, so no durable index names this space; but a
                # store into it may still be running in a worker thread.
                if df.inflight:
                    df.release_when_settled.append(chunk)
                else:
                    self.log.release(chunk.log_off, chunk.length)

    def writes_settled(self, df: DirtyFile) -> None:
        """No write of df is in flight any more: free the space overwritten meanwhile."""
        for chunk in df.release_when_settled:
            self.log.release(chunk.log_off, chunk.length)
        df.release_when_settled.clear()

    def truncate_dirty(self, df: DirtyFile, size: int) -> None:
        self._cut_dirty(df, size, MAX_FILE_BYTES)
        if size < df.size:
            df.trunc_to = size if df.trunc_to is None else min(df.trunc_to, size)
        df.size = size

    def discard(self, df: DirtyFile) -> None:
        """Forget uncommitted changes (file unlinked, or daemon giving up)."""
        self._cut_dirty(df, 0, MAX_FILE_BYTES)
        self.dirty.pop(df.ino, None)

    # ------------------------------------------------------------------ reads

    def read_plan(self, ino: int, off: int, size: int, file_size: int) -> tuple[int, list[ReadPiece]]:
        """Which chunk bytes make up [off, off+size): (length, pieces). Holes are absent."""
        end = min(off + size, file_size)
        if end <= off:
            return 0, []
        df = self.dirty.get(ino)
        pieces: list[ReadPiece] = []
        pos = off
        committed_end = end
        if df is not None:
            if df.trunc_to is not None:
                committed_end = min(end, df.trunc_to)
            i = max(bisect.bisect_right(df.starts, off) - 1, 0)
            while i < len(df.extents) and df.extents[i].file_off < end:
                e = df.extents[i]
                i += 1
                if e.end <= off:
                    continue
                a = max(e.file_off, off)
                if a > pos:
                    self._committed_pieces(ino, pos, min(a, committed_end), off, pieces)
                b = min(e.end, end)
                pieces.append(ReadPiece(a - off, b - a, df.new_chunks.get(e.chunk_no)
                                        or self._chunk(e.chunk_no), e.chunk_off + (a - e.file_off)))
                pos = b
        if pos < committed_end:
            self._committed_pieces(ino, pos, committed_end, off, pieces)
        return end - off, pieces

    def _committed_pieces(self, ino: int, a: int, b: int, base: int,
                          pieces: list[ReadPiece]) -> None:
        if a >= b:
            return
        for e in ix.iter_extents(self.index, ino, a, b):
            s, t = max(e.file_off, a), min(e.end, b)
            pieces.append(ReadPiece(s - base, t - s, self._chunk(e.chunk_no),
                                    e.chunk_off + (s - e.file_off)))

    def _chunk(self, chunk_no: int) -> Chunk:
        chunk = ix.get_chunk(self.index, chunk_no)
        if chunk is None:
            raise DamagedData(f"extent names missing chunk {chunk_no}")
        return chunk

    def read_blocking(self, length: int, pieces: list[ReadPiece]) -> bytearray:
        """Assemble the bytes of a read plan, verifying every log block. May block."""
        out = bytearray(length)
        view = memoryview(out)
        for p in pieces:
            dst = view[p.dst_off:p.dst_off + p.length]
            if p.chunk.kind == CHUNK_LOG:
                self.log.read_into(dst, p.chunk.log_off, p.chunk.length, p.chunk.crcs,
                                   p.chunk_off)
            elif p.chunk.kind == CHUNK_SOURCE:
                self.sources.read_into(dst, p.chunk.source_paths[0], p.chunk_off)
            else:
                raise DamagedData(f"chunk {p.chunk.chunk_no} has unknown kind {p.chunk.kind}")
        return out

    # ----------------------------------------------------------------- commit

    def commit_file(self, df: DirtyFile, inode: ix.Inode, now_ns: int) -> ix.Inode:
        """Fold the overlay into the index's open batch. Caller waited for df.idle."""
        if df.trunc_to is not None:
            inode.data_bytes -= self._punch(df.ino, df.trunc_to, MAX_FILE_BYTES)
        # A new file or an O_TRUNC rewrite has nothing left to punch out.
        overwrites = next(ix.iter_extents(self.index, df.ino), None) is not None
        refs: Counter = Counter()
        for e in df.extents:
            if overwrites:
                inode.data_bytes -= self._punch(df.ino, e.file_off, e.end)
            self.index.put("extents", ix.extent_key(df.ino, e.file_off), ix.extent_encode(e))
            inode.data_bytes += e.length
            refs[e.chunk_no] += 1
        for chunk_no, n in refs.items():
            chunk = df.new_chunks.pop(chunk_no, None)
            if chunk is not None:
                chunk.refcount = n
                ix.put_chunk(self.index, chunk)
                self.index.persist_before_commit(chunk.log_off, chunk.length)
            else:
                self._add_refs(chunk_no, n)
        inode.size = df.size
        if df.mtime_ns is not None:
            inode.mtime_ns = df.mtime_ns
            inode.ctime_ns = df.ctime_ns or now_ns
        ix.put_inode(self.index, inode)
        df.extents.clear()
        df.starts.clear()
        df.new_chunk_refs.clear()
        df.trunc_to = None
        df.mtime_ns = df.ctime_ns = None
        return inode

    def truncate_committed(self, inode: ix.Inode, size: int) -> None:
        """Truncate a file that is not open for writing, in the open batch."""
        if size < inode.size:
            inode.data_bytes -= self._punch(inode.ino, size, MAX_FILE_BYTES)
        inode.size = size

    def remove_all(self, ino: int) -> None:
        """Drop every committed extent of an inode being deleted."""
        self._punch(ino, 0, MAX_FILE_BYTES)

    def _punch(self, ino: int, a: int, b: int) -> int:
        """Remove [a, b) from the committed map; return the bytes removed."""
        removed = 0
        for e in list(ix.iter_extents(self.index, ino, a, b)):
            self.index.delete("extents", ix.extent_key(ino, e.file_off))
            kept = 0
            if e.file_off < a:
                head = Extent(e.file_off, a - e.file_off, e.chunk_no, e.chunk_off)
                self.index.put("extents", ix.extent_key(ino, head.file_off), ix.extent_encode(head))
                kept += 1
            if e.end > b:
                tail = Extent(b, e.end - b, e.chunk_no, e.chunk_off + (b - e.file_off))
                self.index.put("extents", ix.extent_key(ino, tail.file_off), ix.extent_encode(tail))
                kept += 1
            removed += min(e.end, b) - max(e.file_off, a)
            self._add_refs(e.chunk_no, kept - 1)
        return removed

    def _add_refs(self, chunk_no: int, delta: int) -> None:
        if delta == 0:
            return
        chunk = self._chunk(chunk_no)
        chunk.refcount += delta
        if chunk.refcount > 0:
            ix.put_chunk(self.index, chunk)
            return
        ix.delete_chunk(self.index, chunk)
        if chunk.kind == CHUNK_LOG:
            self.index.after_durable(lambda: self.log.release(chunk.log_off, chunk.length))
        elif chunk.kind == CHUNK_SOURCE:
            self.index.after_durable(lambda: [self.sources.remove(path)
                                              for path in chunk.source_paths])
