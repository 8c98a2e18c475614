"""The write stager: written bytes into the log, cut into chunks, stored once.

Written bytes first land in the log as *staged* data: a `StagedRecord` is
log space an open file's overlay points into whose bytes are not yet cut into
chunks. Staged bytes are then *settled* (docs/DEDUP.md): cut into
content-defined chunks (`chunker.Chunker`), each named by its BLAKE3 id, and
stored once (`store_once`): a chunk whose id is already stored is not kept
twice, the overlay points at the stored chunk and the staged bytes go back to
the log at once.
- A sequential write stream (a file written front to back, what every
  checkpoint writer does) is cut as it arrives: its writes land
  contiguously in a reserved *arena*, so a chunk never straddles two
  places, and each completed chunk is settled right after its write.
- Anything else (random writes, overwrites, the stream's unfinished tail)
  is cut when the file is committed (`cut_for_commit`).
With dedup off, each write piece is a chunk as it is (no id).

The stager decides what runs on a worker thread: byte work over
INLINE_BYTES, and a stream write whose turn to feed the chunker has not come
(it waits for the writes before it). `store` and `cut_for_commit` run on the
trio thread and offload; the `*_blocking` functions do the byte work and may
block; everything else runs on the trio thread without blocking.
"""

from __future__ import annotations

import bisect
import functools
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional, TypeVar

import trio

from .chunker import MAX_CHUNK_BYTES, Chunker, chunk_id
from .dirtyfile import MAX_FILE_BYTES, DirtyFile
from .errors import DamagedData, FileTooLarge
from .index import CHUNK_LOG, Chunk, Extent, Index
from . import index as ix
from .overlay import ZERO_CHUNK
from .pmemlog import PmemLog

T = TypeVar("T")

CHUNK_STAGED = 0                 # kind of a StagedRecord: in memory only, never in the index
ARENA_BYTES = 64 << 20           # log space a write stream reserves at a time
CUT_READ_BYTES = 4 << 20         # commit-time cutting reads staged bytes this much at a time
INLINE_BYTES = 64 * 1024         # byte work up to this size runs on the trio thread


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
    """A chunk cut out of staged bytes, named, not yet stored."""

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


@functools.lru_cache(maxsize=1024)
def _zero_id(length: int) -> bytes:
    """The id of `length` zero bytes (zero runs give chunks of few lengths)."""
    return chunk_id(bytes(length))


class WriteStager:
    """Puts written bytes in the log and in the overlay; cuts, names and
    stores them once; decides which of that work runs on a worker thread."""

    def __init__(self, index: Index, plog: PmemLog, dedup: bool,
                 io_limiter: trio.CapacityLimiter) -> None:
        self.index = index
        self.log = plog
        self.dedup = dedup
        self.io_limiter = io_limiter
        self._next_staged = -1
        self.dedup_hits = 0                       # chunks found already stored
        self.dedup_bytes = 0                      # their bytes, not stored again

    def count_duplicate(self, nbytes: int) -> None:
        self.dedup_hits += 1
        self.dedup_bytes += nbytes

    # ------------------------------------------------------------- a write

    def prepare_write(self, df: DirtyFile, off: int, nbytes: int) -> WritePlan:
        """Reserve log space for a write and put it in the file's overlay now.

        The overlay is updated before the bytes land so that overlapping
        writes keep their arrival order; readers wait at the file's gate.
        NoSpace if the log has no room.
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

    async def store(self, df: DirtyFile, plan: WritePlan, data: bytes) -> None:
        """Copy a prepared write's bytes into the log; a stream write is then
        cut and its complete chunks stored once. Inline when small and (for a
        stream) its turn has come, else on a worker thread. Any failure marks
        the file (a file that lost a write must not commit half of its new
        content); an I/O error is DamagedData."""
        try:
            if plan.stream is not None:
                if len(data) <= INLINE_BYTES and plan.stream.next_ticket == plan.ticket:
                    infos = self.store_stream_blocking(plan, data)   # nobody ahead of us
                else:
                    infos = await trio.to_thread.run_sync(
                        self.store_stream_blocking, plan, data, limiter=self.io_limiter)
                self.store_once(df, infos)
            else:
                await self._inline_if_small(len(data), self.store_blocking, plan, data)
        except BaseException as e:
            # Cancelled (a request aborted at unmount), an I/O error, anything:
            # the bytes may not be in the log, so this content must never commit.
            df.write_error = e
            if plan.stream is not None and df.stream is plan.stream:
                self.end_stream(df)       # the chunker missed these bytes
            if isinstance(e, OSError):
                raise DamagedData(f"log write failed: {e}") from e
            raise

    async def cut_for_commit(self, df: DirtyFile) -> None:
        """Cut every byte of df not yet cut into chunks and store each once:
        the stream's unfinished tail, then whatever was written out of order.
        New writes to the file wait meanwhile."""
        async with df.cutting():
            stream = df.stream
            if stream is not None and stream.alive and stream.chunker.position:
                infos = await self._inline_if_small(stream.chunker.position,
                                                    self.finish_stream_blocking, stream)
                self.store_once(df, infos)
            ranges = self.staged_ranges(df)
            if ranges:
                infos = await self._inline_if_small(sum(r[2] for r in ranges),
                                                    self.cut_blocking, ranges)
                self.store_once(df, infos)

    async def _inline_if_small(self, nbytes: int, fn: Callable[..., T], *args) -> T:
        if nbytes <= INLINE_BYTES:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args, limiter=self.io_limiter)

    # ----------------------------------------------------- log space, overlay

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
                target_no = self._new_staged(df, log_off, length, off).chunk_no
                plan.chunks.append(None)
            else:
                chunk = Chunk(self.index.allocate_id(b"next_chunk"), CHUNK_LOG, 0, length,
                              log_off=log_off)
                df.new_chunks[chunk.chunk_no] = chunk
                plan.chunks.append(chunk)
                target_no = chunk.chunk_no
            df.overlay.put(Extent(off, length, target_no, 0))
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
        self.retire_if_unused(df, staged)

    def retire_if_unused(self, df: DirtyFile, staged: StagedRecord) -> None:
        """A staged record no overlay extent names and no stream writes into
        gives its remaining log space back."""
        if staged.held or df.overlay.refs.get(staged.chunk_no, 0) > 0:
            return
        del df.staged[staged.chunk_no]
        for off, length in staged.owned:
            df.give_back(off, length, written=False)
        staged.owned.clear()

    # ------------------------------------------------------- the byte work

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

    # -------------------------------------------------------- storing once

    def store_once(self, df: DirtyFile, infos: list[ChunkInfo]) -> None:
        """Make named chunks of staged bytes chunks, each stored once: the
        overlay points at a stored chunk with the same id (the staged bytes go
        back at once) or at a new chunk made of the bytes where they lie."""
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
                self.count_duplicate(info.length)
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
            df.give_back(off, length, written=True)

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
