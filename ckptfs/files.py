"""Per-file extent maps: logical range -> chunk bytes; deduplication.

A file's committed map lives in the index (`extents`). While a file is open
for writing, its changes gather in an in-memory `DirtyFile` overlay: new
extents and a truncation point. `commit_file` folds the overlay into the
committed map in the index's open batch, so a file's new content becomes
visible to a crash all at once or not at all.

Deduplication (docs/DEDUP.md). Written bytes first land in the log as
*staged* data: a `StagedRecord` is log space the overlay points into whose
bytes are not yet cut into chunks. Staged bytes are then *settled*: cut into
content-defined chunks (`chunker.Chunker`), each named by its BLAKE3 id; a
chunk whose id is already stored is not kept twice: the overlay points at
the stored chunk and the staged bytes go back to the log at once.
- A sequential write stream (a file written front to back, what every
  checkpoint writer does) is cut as it arrives: its writes land
  contiguously in a reserved *arena*, so a chunk never straddles two
  places, and each completed chunk is settled right after its write.
- Anything else (random writes, overwrites, the stream's unfinished tail)
  is cut when the file is committed.

Chunk reference counts: a chunk's refcount in the index is the number of
committed extents pointing into it. Splitting an extent adds a reference,
dropping one removes one; a chunk reaching zero is deleted in the same batch
and its log space is released once that batch is durable. A stored chunk an
uncommitted overlay points at is *pinned*: if its last committed reference
goes meanwhile, its record is deleted as usual but its bytes stay (a
*zombie*) until the overlay either commits (the chunk is stored again, same
number, same bytes) or lets go. Chunks written but never committed are
released at once, since no durable index names them.

Everything here runs on the trio thread except the `*_blocking` functions,
which do the byte work and belong on a worker thread when large.
"""

from __future__ import annotations

import bisect
import errno
import functools
import logging
import os
import stat
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Union

import trio

from . import index as ix
from . import native
from .chunker import MAX_CHUNK_BYTES, Chunker, chunk_id
from .errors import CkptfsError, DamagedData, FileTooLarge, SourceRefused
from .index import CHUNK_LOG, CHUNK_PACK, CHUNK_SOURCE, Chunk, Extent, Index
from .overlay import ZERO_CHUNK, Overlay
from .pmemlog import PmemLog

log = logging.getLogger(__name__)

# The kernel's own limit for a FUSE file (MAX_LFS_FILESIZE): a write past it
# fails with EFBIG in write(2). A smaller limit here would fail only when the
# page is written back, after write(2) succeeded: the error would surface in
# close and in the next syncfs(2) of the whole filesystem, by any process.
MAX_FILE_BYTES = (1 << 63) - 1
CHUNK_STAGED = 0                 # in memory only: never in the index
ARENA_BYTES = 64 << 20           # log space a write stream reserves at a time
CUT_READ_BYTES = 4 << 20         # commit-time cutting reads staged bytes this much at a time


@dataclass(eq=False)
class StagedRecord:
    """Log space holding written bytes not yet cut into chunks.

    Bytes at chunk_off lie at log_off + chunk_off and belong to file offset
    file_base + chunk_off. `owned` is the log space still to be given back
    when the record retires (no overlay extent left, no stream writing into
    it); settling a chunk takes its range out.
    """

    chunk_no: int                    # negative: never collides with stored chunks
    log_off: int
    length: int
    file_base: int
    owned: list[tuple[int, int]]
    held: bool = False               # a stream still writes into it
    kind: int = CHUNK_STAGED

    def take(self, off: int, length: int) -> bool:
        """Remove [off, off+length) from the owned space; False if not all owned."""
        for i, (a, n) in enumerate(self.owned):
            if a <= off and off + length <= a + n:
                rest = []
                if off > a:
                    rest.append((a, off - a))
                if off + length < a + n:
                    rest.append((off + length, a + n - off - length))
                self.owned[i:i + 1] = rest
                return True
        return False

    def grow(self, nbytes: int) -> None:
        """The log space right after the record was reserved for it too."""
        end = self.log_off + self.length
        if self.owned and sum(self.owned[-1]) == end:
            a, n = self.owned[-1]
            self.owned[-1] = (a, n + nbytes)
        else:
            self.owned.append((end, nbytes))
        self.length += nbytes


@dataclass(slots=True)
class ChunkInfo:
    """A chunk cut out of staged bytes, named, not yet settled."""

    staged_no: int
    file_off: int
    length: int
    log_off: int
    chunk_id: bytes
    crcs: bytes
    zero: bool = False          # every byte is zero: becomes a hole


@dataclass(eq=False)
class ChunkStream:
    """A file being written front to back, cut into chunks as it arrives.

    Writes store their bytes in parallel, then take turns feeding the
    chunker in the order they arrived (`tickets`, handed out on the trio
    thread as writes arrive; `turn` wakes the worker thread whose turn it is).
    """

    base: int                        # file offset of the chunker's position 0
    next_off: int                    # where the next write must start to continue it
    chunker: Chunker
    arena: Optional[StagedRecord] = None
    cursor: int = 0                  # log offset for the next byte in the arena
    # (file offset, log offset, staged no) where each arena begins, for cuts.
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    alive: bool = True
    tickets: int = 0                 # handed out so far
    next_ticket: int = 0             # whose turn it is to feed the chunker
    turn: threading.Condition = field(default_factory=threading.Condition)

    def stop(self) -> None:
        """No more feeding: release every worker waiting for its turn."""
        with self.turn:
            self.alive = False
            self.turn.notify_all()

    def locate(self, file_off: int) -> tuple[int, int]:
        """(log offset, staged no) of a streamed byte."""
        i = bisect.bisect_right(self.segments, (file_off, 1 << 64, 0)) - 1
        seg_file, seg_log, staged_no = self.segments[i]
        return seg_log + (file_off - seg_file), staged_no


@dataclass
class WritePlan:
    """Where a write's bytes go: (log offset, offset in data, length) pieces."""

    file_off: int
    pieces: list[tuple[int, int, int]]
    chunks: list[Optional[Chunk]]        # dedup off: the chunk each piece is, for its CRCs
    stream: Optional[ChunkStream] = None
    stream_pos: int = 0                  # data[stream_pos:] continues the stream
    ticket: int = 0                      # stream writes: its place in the feeding order
    cut_at: Optional[int] = None         # a new arena: force a chunk cut at this file offset


@dataclass
class DirtyFile:
    """An open file's uncommitted changes, overlaid on its committed map."""

    ino: int
    size: int
    overlay: Overlay = field(default_factory=Overlay)   # new extents; FileData sets its owner
    new_chunks: dict[int, Chunk] = field(default_factory=dict)
    staged: dict[int, StagedRecord] = field(default_factory=dict)
    pending_ids: dict[bytes, int] = field(default_factory=dict)   # id -> new chunk no
    stream: Optional[ChunkStream] = None
    trunc_to: Optional[int] = None   # committed bytes at and after this are gone
    mtime_ns: Optional[int] = None
    ctime_ns: Optional[int] = None
    inflight: int = 0
    readers: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    committing: Optional[trio.Event] = None   # set while a commit cuts chunks
    write_error: Optional[BaseException] = None
    release_when_settled: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def dirty(self) -> bool:
        return bool(self.overlay) or self.trunc_to is not None or self.mtime_ns is not None


AnyChunk = Union[Chunk, StagedRecord]


@dataclass(slots=True)
class ReadPiece:
    dst_off: int
    length: int
    chunk: AnyChunk
    chunk_off: int


class SourceFiles:
    """The files that were in SOURCE before it was mounted over: read in place,
    deleted when their last reference goes.

    Other users may change SOURCE's tree while it is mounted (if it is reachable
    elsewhere) or unmounted, for instance swap an adopted directory for a symlink
    to a directory only root may read. So an original is reached only beneath
    the SOURCE directory fd opened before the mount, with no symlink at any
    component (`native.open_beneath`), and used only if it is still the file
    adopted: the device and inode its chunk recorded. Anything else is
    `SourceRefused` (EIO) for that file, logged once; it is never read, and
    never deleted.
    """

    def __init__(self, source_fd: int, max_open: int = 64) -> None:
        self.source_fd = source_fd
        self.source_dev = os.fstat(source_fd).st_dev
        self._fds: dict[bytes, int] = {}        # path -> checked fd, least recently used first
        self._in_use: Counter = Counter()       # path -> reads using its fd now
        self._doomed: list[int] = []            # fds to close once their reads are done
        self._lock = threading.Lock()           # reads run on several worker threads
        self._max_open = max_open
        self._refused: set[bytes] = set()      # logged once already

    def identify(self, paths: list[bytes]) -> tuple[int, int, int]:
        """(SOURCE_FS_*, st_dev, st_ino) of the regular file the first reachable
        of paths names, reached safely. OSError if none is. May block."""
        error: Optional[OSError] = None
        for path in paths:
            try:
                st = self._lstat_beneath(path)
            except OSError as e:
                error = error or e
                continue
            if not stat.S_ISREG(st.st_mode):
                error = error or OSError(errno.EINVAL, "not a regular file", path)
                continue
            return self.identity_of(st)
        raise error or OSError(errno.ENOENT, "no name", b"")

    def identity_of(self, st: os.stat_result) -> tuple[int, int, int]:
        if st.st_dev == self.source_dev:
            return ix.SOURCE_FS_SAME, 0, st.st_ino
        return ix.SOURCE_FS_OTHER, st.st_dev, st.st_ino

    def is_adopted(self, st: os.stat_result, chunk: Chunk) -> bool:
        """Is st (an lstat or fstat) the regular file this chunk adopted?"""
        if chunk.source_fs == ix.SOURCE_FS_SAME:
            dev = self.source_dev
        elif chunk.source_fs == ix.SOURCE_FS_OTHER:
            dev = chunk.source_dev
        else:
            return False            # identity unknown: nothing is provably the file
        return stat.S_ISREG(st.st_mode) and st.st_dev == dev and st.st_ino == chunk.source_ino

    def read_into(self, out: memoryview, chunk: Chunk, off: int) -> None:
        """May block."""
        path, fd = self._acquire(chunk)
        try:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], off + done)
                if n == 0:
                    raise DamagedData(f"pre-existing file {path!r} is shorter than recorded "
                                      "(changed while unmounted?)")
                done += n
        finally:
            self._release(path, fd)

    def stat(self, chunk: Chunk) -> os.stat_result:
        """The original's stat, reached and checked as a read would. May block."""
        path, fd = self._acquire(chunk)
        try:
            return os.fstat(fd)
        finally:
            self._release(path, fd)

    def _acquire(self, chunk: Chunk) -> tuple[bytes, int]:
        """An open fd of the file adopted, reached by one of its names; it stays
        open until _release (an fd closed under a reader could be reused for
        another file meanwhile)."""
        with self._lock:
            for path in chunk.source_paths:
                fd = self._fds.pop(path, None)
                if fd is not None:
                    break
            else:
                path, fd = self._open_any(chunk)
            self._fds[path] = fd                # most recently used last
            self._in_use[path] += 1
            for old in [p for p in self._fds if not self._in_use[p]]:
                if len(self._fds) <= self._max_open:
                    break
                os.close(self._fds.pop(old))
            return path, fd

    def _release(self, path: bytes, fd: int) -> None:
        with self._lock:
            self._in_use[path] -= 1
            if self._in_use[path] <= 0:
                del self._in_use[path]
                if fd in self._doomed:
                    self._doomed.remove(fd)
                    os.close(fd)

    def _open_any(self, chunk: Chunk) -> tuple[bytes, int]:
        why = "is gone"
        for path in chunk.source_paths:
            try:
                return path, self._open_checked(path, chunk)
            except OSError as e:
                why = _refusal(e)
        path = chunk.source_paths[0]
        message = f"pre-existing file {path!r} {why}: its reads give EIO"
        if path not in self._refused:
            self._refused.add(path)
            log.warning("%s", message)
        raise SourceRefused(message)

    def _open_checked(self, path: bytes, chunk: Chunk) -> int:
        """Open path for reading if it reaches the file adopted. May block."""
        pfd = native.open_beneath(self.source_fd, path, os.O_PATH)
        try:
            if not self.is_adopted(os.fstat(pfd), chunk):
                raise OSError(errno.ESTALE, "is not the file adopted", path)
            # Reopen what was checked (an O_PATH fd reads nothing), not the path.
            return os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(pfd)

    def _lstat_beneath(self, path: bytes) -> os.stat_result:
        pfd = native.open_beneath(self.source_fd, path, os.O_PATH)
        try:
            return os.fstat(pfd)
        finally:
            os.close(pfd)

    def remove(self, chunk: Chunk) -> None:
        """Delete the originals of a file whose last reference is gone: each name
        is unlinked in its safely reached parent, and only if it is still the
        file adopted. May block."""
        for path in chunk.source_paths:
            with self._lock:
                fd = self._fds.pop(path, None)
                if fd is not None:
                    if self._in_use[path]:
                        self._doomed.append(fd)     # closed by the last reader
                    else:
                        os.close(fd)
            parent, _, name = path.rpartition(b"/")
            try:
                dfd = native.open_beneath(self.source_fd, parent, os.O_PATH | os.O_DIRECTORY) \
                    if parent else self.source_fd
                try:
                    if not self.is_adopted(os.stat(name, dir_fd=dfd, follow_symlinks=False),
                                           chunk):
                        raise OSError(errno.ESTALE, "is not the file adopted", path)
                    os.unlink(name, dir_fd=dfd)
                finally:
                    if dfd != self.source_fd:
                        os.close(dfd)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("did not remove pre-existing file %r: it %s", path, _refusal(e))

    def close(self) -> None:
        with self._lock:
            for fd in list(self._fds.values()) + self._doomed:
                os.close(fd)
            self._fds.clear()
            self._doomed.clear()


def _refusal(e: OSError) -> str:
    """Why an original was not used, for the one log line."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return "is reached through a symlink (changed below the mount?)"
    if e.errno == errno.ESTALE:
        return "is not the file adopted (replaced below the mount?)"
    if e.errno == errno.ENOENT:
        return "is gone"
    return f"cannot be reached: {e.strerror}"


@functools.lru_cache(maxsize=1024)
def _zero_id(length: int) -> bytes:
    """The id of `length` zero bytes (zero runs give chunks of few lengths)."""
    return chunk_id(bytes(length))


class FileData:
    """Owns extent maps and chunk lifetimes; reads, writes and deduplicates file bytes."""

    def __init__(self, index: Index, plog: PmemLog, sources: SourceFiles,
                 dedup: bool = True) -> None:
        self.index = index
        self.log = plog
        self.sources = sources
        self.dedup = dedup
        self.dirty: dict[int, DirtyFile] = {}
        self.pinned: Counter = Counter()          # stored chunk no -> overlays naming it
        self.zombies: dict[int, Chunk] = {}       # pinned chunks deleted from the index
        self._next_staged = -1
        # Reads in flight by the epoch they started in; space freed while they
        # run waits for every read that started before it was freed.
        self._epoch = 0
        self._reads: Counter = Counter()
        self._freed_during_reads: list[tuple[int, int, int]] = []
        self.cold = None            # tier.ColdStore once a backing store is attached
        self.bytes_written = 0
        self.bytes_read = 0
        self.dedup_hits = 0                       # chunks found already stored
        self.dedup_bytes = 0                      # their bytes, not stored again

    # ------------------------------------------------------------- dirty state

    def dirty_file(self, ino: int, size: int) -> DirtyFile:
        df = self.dirty.get(ino)
        if df is None:
            df = self.dirty[ino] = DirtyFile(ino, size)
            df.overlay = Overlay(functools.partial(self._first_ref, df),
                                 functools.partial(self._last_ref, df))
        return df

    def prepare_write(self, df: DirtyFile, off: int, nbytes: int) -> WritePlan:
        """Reserve log space for a write and put it in the file's overlay now.

        The overlay is updated before the bytes land so that overlapping
        writes keep their arrival order; readers wait for `df.idle` first.
        """
        if off + nbytes > MAX_FILE_BYTES:
            raise FileTooLarge(f"write beyond {MAX_FILE_BYTES} bytes")
        plan = WritePlan(off, [], [])
        streamed = False
        if self.dedup and nbytes:
            stream = df.stream
            if stream is None and not df.overlay.end > off:
                # Nothing written past here yet: a stream may start (also into a
                # file first grown with ftruncate, as safetensors does).
                stream = df.stream = ChunkStream(off, off, Chunker(detect_format=off == 0))
            head = None
            if stream is not None and off == stream.next_off:
                head = 0
            elif stream is not None and stream.base <= off < stream.next_off < off + nbytes:
                # The kernel sends a page again that the stream has the start of
                # (written back half full): that start is an overwrite, the rest
                # goes on streaming.
                head = stream.next_off - off
            if head is not None:
                if head:
                    self._put_records(df, plan, off, head, 0)
                streamed = self._stream_reserve(df, stream, plan, off + head, nbytes - head,
                                                head)
                if not streamed:       # no contiguous room left: stop cutting as it streams
                    self.end_stream(df)
                    self._put_records(df, plan, off + head, nbytes - head, head)
                    streamed = True
        if not streamed:
            self._put_records(df, plan, off, nbytes, 0)
        df.size = max(df.size, off + nbytes)
        return plan

    def _put_records(self, df: DirtyFile, plan: WritePlan, off: int, nbytes: int,
                     pos: int) -> None:
        """Log space for bytes written out of stream order (cut at commit).

        With dedup off each piece is a chunk as it is: none is longer than
        MAX_CHUNK_BYTES, the bound every reader checks."""
        pieces = self.log.allocate(nbytes)
        if not self.dedup:
            pieces = _cut(pieces, MAX_CHUNK_BYTES)
        for log_off, length in pieces:
            if self.dedup:
                target: AnyChunk = self._new_staged(df, log_off, length, off)
                plan.chunks.append(None)
            else:
                target = Chunk(self.index.allocate_id(b"next_chunk"), CHUNK_LOG, 0, length,
                               log_off=log_off)
                df.new_chunks[target.chunk_no] = target
                plan.chunks.append(target)
            df.overlay.put(Extent(off, length, target.chunk_no, 0))
            plan.pieces.append((log_off, pos, length))
            off += length
            pos += length

    def _new_staged(self, df: DirtyFile, log_off: int, length: int, file_base: int
                    ) -> StagedRecord:
        staged = StagedRecord(self._next_staged, log_off, length, file_base, [(log_off, length)])
        self._next_staged -= 1
        df.staged[staged.chunk_no] = staged
        return staged

    def _stream_reserve(self, df: DirtyFile, stream: ChunkStream, plan: WritePlan, off: int,
                        nbytes: int, pos: int) -> bool:
        """Room for the stream's next bytes right after its previous ones (False: none).

        They are data[pos:] of the write that `plan` describes.
        """
        arena = stream.arena
        cut_at = None
        if arena is None or stream.cursor + nbytes > arena.log_off + arena.length:
            end = None if arena is None else arena.log_off + arena.length
            need = stream.cursor + nbytes - end if end is not None else nbytes
            grow = max(need, min(ARENA_BYTES, self.log.free_bytes // 8))
            if end is not None and self.log.reserve(grow, at=end) is not None:
                arena.grow(grow)
            else:
                size = max(nbytes, min(ARENA_BYTES, self.log.free_bytes // 8))
                log_off = self.log.reserve(size)
                if log_off is None:
                    size = nbytes
                    log_off = self.log.reserve(size)
                    if log_off is None:
                        return False
                if arena is not None:
                    # The rest of the old arena is unused: give it back now.
                    unused = arena.log_off + arena.length - stream.cursor
                    if unused and arena.take(stream.cursor, unused):
                        arena.length -= unused
                        self.log.release(stream.cursor, unused)
                    self._unhold(df, arena)
                    cut_at = off        # a chunk never straddles two arenas
                # Bytes at chunk offset c belong to file offset off + c.
                arena = stream.arena = self._new_staged(df, log_off, size, off)
                arena.held = True
                stream.cursor = log_off
                stream.segments.append((off, log_off, arena.chunk_no))
        log_off = stream.cursor
        stream.cursor += nbytes
        stream.next_off += nbytes
        df.overlay.put(Extent(off, nbytes, arena.chunk_no, log_off - arena.log_off))
        plan.pieces.append((log_off, pos, nbytes))
        plan.chunks.append(None)
        plan.stream, plan.stream_pos, plan.cut_at = stream, pos, cut_at
        plan.ticket = stream.tickets
        stream.tickets += 1
        return True

    def end_stream(self, df: DirtyFile) -> None:
        """Stop cutting df's writes as they arrive; what is left is cut at commit."""
        stream = df.stream
        if stream is None:
            return
        stream.stop()
        df.stream = None
        if stream.arena is not None:
            self._unhold(df, stream.arena)

    def _unhold(self, df: DirtyFile, staged: StagedRecord) -> None:
        staged.held = False
        self._maybe_retire(df, staged)

    def _maybe_retire(self, df: DirtyFile, staged: StagedRecord) -> None:
        if staged.held or df.overlay.refs.get(staged.chunk_no, 0) > 0:
            return
        del df.staged[staged.chunk_no]
        for off, length in staged.owned:
            self._release(df, off, length, stored=False)
        staged.owned.clear()

    def store_blocking(self, plan: WritePlan, data: bytes) -> None:
        """Copy a write's bytes into the log. May block."""
        view = memoryview(data)
        for (log_off, pos, length), chunk in zip(plan.pieces, plan.chunks):
            if chunk is None:
                self.log.write(log_off, view[pos:pos + length])
            else:
                chunk.crcs = self.log.store(log_off, view[pos:pos + length])

    def store_stream_blocking(self, plan: WritePlan, data: bytes) -> list[ChunkInfo]:
        """Copy a stream write into its arena, then, in its turn, cut the chunks
        it completes. May block (also waiting for earlier writes' turns)."""
        self.store_blocking(plan, data)
        stream = plan.stream
        with stream.turn:
            while stream.alive and stream.next_ticket != plan.ticket:
                stream.turn.wait()
            try:
                return self._feed(stream, plan, data) if stream.alive else []
            finally:
                stream.next_ticket = plan.ticket + 1
                stream.turn.notify_all()

    def _feed(self, stream: ChunkStream, plan: WritePlan, data: bytes) -> list[ChunkInfo]:
        if plan.cut_at is not None:
            stream.chunker.add_boundaries([plan.cut_at - stream.base])
        view = memoryview(data)[plan.stream_pos:]
        infos = []
        for at, length in stream.chunker.feed(view):
            file_off = stream.base + at
            rel = file_off - (plan.file_off + plan.stream_pos)
            # Name it from the write's own bytes when they hold the whole chunk.
            inside = view[rel:rel + length] if rel >= 0 and rel + length <= len(view) else None
            infos.append(self._name_streamed(stream, file_off, length, inside))
        return infos

    def finish_stream_blocking(self, stream: ChunkStream) -> list[ChunkInfo]:
        """Cut the stream's unfinished tail; later writes start a fresh chunker. May block."""
        infos = [self._name_streamed(stream, stream.base + at, length)
                 for at, length in stream.chunker.finish()]
        stream.base = stream.next_off
        stream.chunker = Chunker(detect_format=False)
        return infos

    def _name_streamed(self, stream: ChunkStream, file_off: int, length: int,
                       data: Optional[memoryview] = None) -> ChunkInfo:
        log_off, staged_no = stream.locate(file_off)
        return self._name(staged_no, file_off, length, log_off, data)

    def _name(self, staged_no: int, file_off: int, length: int, log_off: int,
              data: Optional[memoryview] = None) -> ChunkInfo:
        """BLAKE3 id and CRCs of chunk bytes (read back from the log if not given). May block.

        Read with pread, not through the mapping: touching mapped pages would
        count the whole log as the daemon's resident memory.
        """
        if data is None:
            data = memoryview(bytearray(length))
            self.log.read_unverified_into(data, log_off)
        cid = chunk_id(data)
        if data[0] == 0 and data[-1] == 0 and cid == _zero_id(length):
            return ChunkInfo(staged_no, file_off, length, log_off, b"", b"", zero=True)
        return ChunkInfo(staged_no, file_off, length, log_off, cid, self.log.crcs_of(data))

    def cut_blocking(self, ranges: list[tuple[int, int, int, int]]) -> list[ChunkInfo]:
        """Cut staged ranges (staged no, file offset, length, log offset) into named
        chunks: the commit-time path for bytes not cut as they streamed in. May block."""
        infos = []
        buf = memoryview(bytearray(min(CUT_READ_BYTES, max(r[2] for r in ranges))))
        for staged_no, file_off, length, log_off in ranges:
            chunker = Chunker(detect_format=file_off == 0)
            pos = 0
            while pos < length:
                n = min(len(buf), length - pos)
                block = buf[:n]
                self.log.read_unverified_into(block, log_off + pos)
                cuts = chunker.feed(block)
                if pos + n == length:
                    cuts += chunker.finish()
                for at, m in cuts:
                    rel = at - pos
                    inside = block[rel:rel + m] if rel >= 0 and rel + m <= n else None
                    infos.append(self._name(staged_no, file_off + at, m, log_off + at, inside))
                pos += n
        return infos

    def settle(self, df: DirtyFile, infos: list[ChunkInfo]) -> None:
        """Turn named chunks of staged bytes into chunks, stored once."""
        freed: list[tuple[int, int]] = []
        ov = df.overlay
        for info in infos:
            staged = df.staged.get(info.staged_no)
            if staged is None:
                continue                     # retired: nothing points at these bytes
            a, b = info.file_off, info.file_off + info.length
            i = ov.index_at(a)
            whole = i is not None and ov.extents[i].chunk_no == staged.chunk_no and \
                ov.extents[i].end >= b       # the usual case: one staged extent holds it all
            covering = [ov.extents[i]] if whole else \
                [e for e in ov.within(a, b) if e.chunk_no == staged.chunk_no]
            if not covering or not staged.take(info.log_off, info.length):
                continue                     # overwritten meanwhile: retires with the record
            # A chunk with these bytes already stored (committed, or new in this file)?
            if info.zero:
                target = ZERO_CHUNK          # zeros: a hole, stored nowhere
            else:
                target = df.pending_ids.get(info.chunk_id)
                if target is None:
                    target = ix.find_chunk_no(self.index, info.chunk_id)
            if target is None:
                chunk = Chunk(self.index.allocate_id(b"next_chunk"), CHUNK_LOG, 0, info.length,
                              log_off=info.log_off, crcs=info.crcs, chunk_id=info.chunk_id)
                df.new_chunks[chunk.chunk_no] = chunk
                df.pending_ids[info.chunk_id] = chunk.chunk_no
                target = chunk.chunk_no
            else:
                self.dedup_hits += 1
                self.dedup_bytes += info.length
                # Neighbouring duplicates are neighbours in the log: one release.
                if freed and freed[-1][0] + freed[-1][1] == info.log_off:
                    freed[-1] = (freed[-1][0], freed[-1][1] + info.length)
                else:
                    freed.append((info.log_off, info.length))
            if whole:
                ov.retarget(i, a, b, target)
                continue
            for e in covering:
                s, t = max(e.file_off, a), min(e.end, b)
                ov.put(Extent(s, t - s, target, s - a))
        for off, length in freed:
            self._release(df, off, length, stored=True)

    def staged_ranges(self, df: DirtyFile) -> list[tuple[int, int, int, int]]:
        """Every staged byte range the overlay still points at, for `cut_blocking`."""
        ranges: list[tuple[int, int, int, int]] = []
        for staged in list(df.staged.values()):
            if not df.overlay.refs.get(staged.chunk_no):
                continue
            lo = staged.file_base
            for e in df.overlay.within(lo, lo + staged.length):
                if e.chunk_no != staged.chunk_no:
                    continue
                log_off = staged.log_off + e.chunk_off
                last = ranges[-1] if ranges else None
                if last and last[0] == staged.chunk_no and last[1] + last[2] == e.file_off:
                    ranges[-1] = (last[0], last[1], last[2] + e.length, last[3])
                else:
                    ranges.append((staged.chunk_no, e.file_off, e.length, log_off))
        return ranges

    def _first_ref(self, df: DirtyFile, chunk_no: int) -> None:
        """df's overlay names chunk_no for the first time."""
        if chunk_no > 0 and chunk_no not in df.new_chunks:
            self.pinned[chunk_no] += 1        # a stored chunk: keep its bytes for us

    def _last_ref(self, df: DirtyFile, chunk_no: int) -> None:
        """df's overlay no longer names chunk_no."""
        if chunk_no < 0:
            staged = df.staged.get(chunk_no)
            if staged is not None:
                self._maybe_retire(df, staged)
            return
        chunk = df.new_chunks.pop(chunk_no, None)
        if chunk is None:
            self._unpin(chunk_no)
            return
        if chunk.chunk_id:
            df.pending_ids.pop(chunk.chunk_id, None)
        # Never committed, so no durable index names this space. A chunk with
        # an id was cut from bytes already stored; one without may still be
        # being written (dedup off).
        self._release(df, chunk.log_off, chunk.length, stored=bool(chunk.chunk_id))

    def _release(self, df: DirtyFile, off: int, length: int, stored: bool) -> None:
        """Give uncommitted log space back once no I/O of df can touch it.

        stored=True: the bytes are in place (no write into them is pending),
        so only a read in flight holds them up.
        """
        if df.readers or (df.inflight and not stored):
            df.release_when_settled.append((off, length))
        else:
            self.log.release(off, length)

    def _unpin(self, chunk_no: int) -> None:
        self.pinned[chunk_no] -= 1
        if self.pinned[chunk_no] > 0:
            return
        del self.pinned[chunk_no]
        zombie = self.zombies.pop(chunk_no, None)
        if zombie is not None and zombie.kind == CHUNK_LOG:
            # Its deletion is in this batch or an earlier one: reuse after it is durable.
            self.release_after_durable(zombie.log_off, zombie.length)

    def begin_read(self) -> int:
        """A read (or the mover) is about to use chunk bytes found in the index."""
        self._reads[self._epoch] += 1
        return self._epoch

    def end_read(self, epoch: int) -> None:
        self._reads[epoch] -= 1
        if self._reads[epoch] <= 0:
            del self._reads[epoch]
        oldest = min(self._reads, default=None)
        while self._freed_during_reads and (oldest is None
                                            or self._freed_during_reads[0][0] < oldest):
            _, off, length = self._freed_during_reads.pop(0)
            self.log.release(off, length)

    def release_after_durable(self, off: int, length: int) -> None:
        """Committed space the open batch stops naming: reusable once that batch is
        durable and no read that may have planned with it is still running."""
        self.index.after_durable(lambda: self._release_after_reads(off, length))

    def _release_after_reads(self, off: int, length: int) -> None:
        if not self._reads:
            self.log.release(off, length)
            return
        self._freed_during_reads.append((self._epoch, off, length))
        self._epoch += 1

    def io_settled(self, df: DirtyFile) -> None:
        """No read or write of df is in flight: free the space given up meanwhile."""
        if df.inflight or df.readers:
            return
        for off, length in df.release_when_settled:
            self.log.release(off, length)
        df.release_when_settled.clear()

    def truncate_dirty(self, df: DirtyFile, size: int) -> None:
        if df.stream is not None and size < df.stream.next_off:
            self.end_stream(df)
        df.overlay.cut(size, MAX_FILE_BYTES)
        if size < df.size:
            df.trunc_to = size if df.trunc_to is None else min(df.trunc_to, size)
        df.size = size

    def discard(self, df: DirtyFile) -> None:
        """Forget uncommitted changes (file unlinked, or daemon giving up)."""
        self.end_stream(df)
        df.overlay.clear()
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
            for e in df.overlay.within(off, end):
                a = max(e.file_off, off)
                if a > pos:
                    self._committed_pieces(ino, pos, min(a, committed_end), off, pieces)
                b = min(e.end, end)
                pos = b
                if e.chunk_no == ZERO_CHUNK:
                    continue            # zeros: the buffer has them already
                chunk = df.new_chunks.get(e.chunk_no) or df.staged.get(e.chunk_no) \
                    or self._chunk(e.chunk_no)
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
            pieces.append(ReadPiece(s - base, t - s, self._chunk(e.chunk_no),
                                    e.chunk_off + (s - e.file_off)))

    def _chunk(self, chunk_no: int) -> Chunk:
        chunk = ix.get_chunk(self.index, chunk_no) or self.zombies.get(chunk_no)
        if chunk is None:
            raise DamagedData(f"extent names missing chunk {chunk_no}")
        return chunk

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

    # ----------------------------------------------------------------- commit

    def commit_file(self, df: DirtyFile, inode: ix.Inode, now_ns: int) -> ix.Inode:
        """Fold the overlay into the index's open batch.

        The caller waited for df.idle and cut every staged byte into chunks.
        """
        ov = df.overlay
        if df.staged and any(ov.refs.get(no) for no in df.staged):
            raise CkptfsError(f"inode {df.ino}: uncut bytes at commit (internal error)")
        pinned = [no for no in ov.refs if no > 0 and no not in df.new_chunks]
        twins = self._committed_twins(df)
        extents = [Extent(e.file_off, e.length, twins[e.chunk_no], e.chunk_off)
                   if e.chunk_no in twins else e for e in ov]
        refs: Counter = Counter(e.chunk_no for e in extents if e.chunk_no != ZERO_CHUNK)
        # References to stored chunks first: a file rewritten with bytes it
        # already had never takes those chunks to zero on the way.
        for chunk_no, n in refs.items():
            if chunk_no not in df.new_chunks:
                self._add_refs(chunk_no, n)
        if df.trunc_to is not None:
            inode.data_bytes -= self._punch(df.ino, df.trunc_to, MAX_FILE_BYTES)
        # A new file or an O_TRUNC rewrite has nothing left to punch out.
        overwrites = next(ix.iter_extents(self.index, df.ino), None) is not None
        for e in extents:
            if overwrites:
                inode.data_bytes -= self._punch(df.ino, e.file_off, e.end)
            if e.chunk_no == ZERO_CHUNK:
                continue                # a hole reads as the zeros written
            ix.put_extent(self.index, df.ino, e)
            inode.data_bytes += e.length
        for chunk_no, n in refs.items():
            chunk = df.new_chunks.pop(chunk_no, None)
            if chunk is not None:
                chunk.refcount = n
                ix.add_chunk(self.index, chunk)
                self.index.persist_before_commit(chunk.log_off, chunk.length)
        for chunk_no in pinned:
            self._unpin(chunk_no)
        inode.size = df.size
        if df.mtime_ns is not None:
            inode.mtime_ns = df.mtime_ns
            inode.ctime_ns = df.ctime_ns or now_ns
        ix.put_inode(self.index, inode)
        ov.hand_over()              # the index holds every reference now
        df.pending_ids.clear()
        df.trunc_to = None
        df.mtime_ns = df.ctime_ns = None
        return inode

    @staticmethod
    def commit_growth_bytes(df: DirtyFile) -> int:
        """The most `commit_file` of df may add to the index: a record per extent
        and per new chunk (with its id and log map entries), and the inode."""
        if not df.overlay:
            return 0            # a truncation or new times only: nothing grows
        records = len(df.overlay) + 3 * len(df.new_chunks)
        return ix.GROWTH_PER_FILE_COMMIT_BYTES + records * ix.GROWTH_PER_RECORD_BYTES

    def _committed_twins(self, df: DirtyFile) -> dict[int, int]:
        """New chunks whose bytes another file committed since they were cut:
        use the stored chunk and give this copy back."""
        twins: dict[int, int] = {}
        for chunk_no, chunk in list(df.new_chunks.items()):
            if not chunk.chunk_id:
                continue
            stored = ix.find_chunk(self.index, chunk.chunk_id)
            if stored is not None and stored.chunk_no != chunk_no:
                twins[chunk_no] = stored.chunk_no
                del df.new_chunks[chunk_no]
                self.dedup_hits += 1
                self.dedup_bytes += chunk.length
                self._release(df, chunk.log_off, chunk.length, stored=True)
        # A zombie we point at lost its id entry when it was deleted; if the
        # same bytes were stored again since, use that chunk: storing the
        # zombie again would leave two chunks with one id.
        for chunk_no in list(df.overlay.refs):
            zombie = self.zombies.get(chunk_no)
            if zombie is not None and zombie.chunk_id:
                stored = ix.find_chunk(self.index, zombie.chunk_id)
                if stored is not None:
                    twins[chunk_no] = stored.chunk_no
        return twins

    def data_ranges(self, ino: int, size: int, start: int, max_ranges: int
                    ) -> tuple[list[tuple[int, int]], Optional[int]]:
        """Where [start, size) of a file holds data: merged [a, b) ranges, holes
        left out, at most max_ranges; and the offset to ask from next (None: no
        more). A file with uncommitted changes is data from start to its end
        (an overlay may fill holes: never call bytes a hole that may not be)."""
        df = self.dirty.get(ino)
        if df is not None and df.dirty:
            return ([(start, size)] if start < size else []), None
        ranges: list[tuple[int, int]] = []
        for e in ix.iter_extents(self.index, ino, start, size):
            a, b = max(e.file_off, start), min(e.end, size)
            if a >= b:
                continue
            if ranges and ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], b)
            elif len(ranges) == max_ranges:
                return ranges, a
            else:
                ranges.append((a, b))
        return ranges, None

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
            ix.delete_extent(self.index, ino, e.file_off)
            kept = 0
            if e.file_off < a:
                head = Extent(e.file_off, a - e.file_off, e.chunk_no, e.chunk_off)
                ix.put_extent(self.index, ino, head)
                kept += 1
            if e.end > b:
                tail = Extent(b, e.end - b, e.chunk_no, e.chunk_off + (b - e.file_off))
                ix.put_extent(self.index, ino, tail)
                kept += 1
            removed += min(e.end, b) - max(e.file_off, a)
            self._add_refs(e.chunk_no, kept - 1)
        return removed

    def _add_refs(self, chunk_no: int, delta: int) -> None:
        if delta == 0:
            return
        zombie = self.zombies.pop(chunk_no, None)
        if zombie is not None:
            # A pinned chunk whose last reference went: stored again, same bytes.
            zombie.refcount = delta
            ix.add_chunk(self.index, zombie)
            return
        chunk = self._chunk(chunk_no)
        chunk.refcount += delta
        if chunk.refcount > 0:
            ix.put_chunk(self.index, chunk)
            return
        ix.delete_chunk(self.index, chunk)
        if self.pinned.get(chunk_no):
            self.zombies[chunk_no] = chunk       # an open file still points at it
            return
        if chunk.kind == CHUNK_LOG:
            why = ix.chunk_record_problem(chunk)
            if why is not None:
                # Its lengths cannot be trusted to give back only its own space:
                # leave it used (the next mount recomputes free space).
                log.error("chunk %d deleted with a damaged record (%s): its log space "
                          "stays used until the next mount", chunk_no, why)
                return
            self.release_after_durable(chunk.log_off, chunk.length)
        elif chunk.kind == CHUNK_SOURCE:
            self.index.after_durable(lambda: self.sources.remove(chunk))


def _cut(pieces: list[tuple[int, int]], most: int) -> list[tuple[int, int]]:
    """(offset, length) pieces, the longer ones cut into pieces of at most `most`."""
    out = []
    for off, length in pieces:
        while length > most:
            out.append((off, most))
            off += most
            length -= most
        out.append((off, length))
    return out
