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

A stream write is answered once its bytes are in the log and the overlay
names them; the chunk feed (gear scan, BLAKE3, CRC-32C: `BatchChunker`) runs
behind the writes, in their order, in a task of its own that hands a worker
thread every write ready to feed at once and settles the chunks back on the
trio thread (`_feed_behind`). Until it has caught up the bytes are staged
like any other: a read or a commit of the file waits for the feed
(`DirtyFile.quiesce`), and nothing staged is ever durable, so a crash before
the feed ends loses only bytes no fsync or close covered. At most
FEED_BACKLOG_BYTES wait for the feed; a write past that waits for it. Writes
answered in C (below) may run up to WINDOW_BACKLOG_BYTES ahead of the feed
(each at most a quarter of the log):
theirs are log bytes the feed reads back, not memory, and a WRITE the window
has no room for goes through the interpreter (pyfuse3's copy, the handler,
the wait), which on a CPU-bound writer cost more than the feed's lead.

With the FUSE channel's fast path on, a stream's next writes are answered
in C (native/ckptfs_fuse.h): after a stream write the stager opens the
file's *write window* (`open_window`: where the stream's next write starts,
the arena space it may fill, no more than the feed backlog allows), the C
module writes each WRITE that continues the stream into that space and
answers it, and before it returns to the interpreter the daemon folds them
in (`fold_written`: the overlay, the stream's position, a ticket for the
feed, which reads their bytes back from the log) exactly as `prepare_write`
and `store` would have. The window closes whenever anything else may
change the stream (`end_stream`, a commit's cut) and, in C, with any other
request about the file. A write out of stream order (a rewrite) opens the
file's *rewrite window* instead (`open_rewrite_window`): the C module writes
the file's next WRITEs at any offset one after another into log space
reserved for them (`DirtyFile.rewrite_space`), except a WRITE the stager
would stream (one holding the stream's next byte; with no stream, one
starting where the file's changes end), and each is folded in as a staged
record, as `_put_records` makes one; what the space has left goes back to the
log when the window closes.

The stager decides what runs on a worker thread: byte work over
INLINE_BYTES (a small stream write whose turn has come is fed inline, with no
task); a large write's copy into a log file goes to the log writer's C
threads instead (`logwriter.LogWriter`: no GIL taken there). `store` and `cut_for_commit` run on the trio thread and offload; the
`*_blocking` functions do the byte work and may block; everything else runs
on the trio thread without blocking.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence, TypeVar, Union

import trio

from .chunker import (DEFAULT_MIN_SIZE, MAX_CHUNK_BYTES, BatchChunker, NamedChunks,
                      name_whole_pieces)
from .debugpause import pause_blocking, pausing_at
from .dirtyfile import MAX_FILE_BYTES, DirtyFile
from .errors import DamagedData, FileTooLarge
from .index import CHUNK_LOG, Chunk, Extent, Index
from .logwriter import LogWriter
from . import index as ix
from .overlay import ZERO_CHUNK
from .pmemlog import PmemLog

T = TypeVar("T")

log = logging.getLogger(__name__)

CHUNK_STAGED = 0                 # kind of a StagedRecord: in memory only, never in the index
ARENA_BYTES = 64 << 20           # log space a write stream reserves at a time
CUT_READ_BYTES = 4 << 20         # commit-time cutting reads staged bytes this much at a time
INLINE_BYTES = 64 * 1024         # byte work up to this size runs on the trio thread
FEED_BACKLOG_BYTES = 32 << 20    # stream bytes answered but not yet fed, at most
# ... answered in C: log bytes the feed reads back as it goes, no memory held
WINDOW_BACKLOG_BYTES = 128 << 20
FEED_CALL_BYTES = 8 << 20        # fed in one worker-thread call, at most
FOLD_PIECE_BYTES = 2 << 20       # writes answered in C are fed in pieces of this much
REWRITE_SPACE_BYTES = 1 << 20    # log space a rewrite window reserves at a time, at most
REWRITE_REFILL_BYTES = 256 << 10  # less left than this: the window reserves afresh


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


class ChunkBatch:
    """Chunks cut out of staged bytes, named, not yet stored: one batch per
    write (or per commit-time cut), as columns, so that settling them is one
    pass (`WriteStager.store_once`) and no object is made per chunk."""

    __slots__ = ("staged_nos", "file_offs", "lengths", "log_offs", "ids", "crcs", "zero")

    def __init__(self) -> None:
        self.staged_nos: list[int] = []
        self.file_offs: list[int] = []
        self.lengths: list[int] = []
        self.log_offs: list[int] = []
        self.ids: list[bytes] = []           # BLAKE3; b"" for a zero chunk
        self.crcs: list[bytes] = []
        self.zero: list[bool] = []           # every byte is zero: becomes a hole

    def __len__(self) -> int:
        return len(self.file_offs)

    def add(self, named: NamedChunks, staged_no: int, file_base: int, log_base: int) -> None:
        """Chunks at stream offsets `named.offsets` of bytes that lie at file
        offset file_base + o and log offset log_base + o, in one staged record."""
        n = len(named)
        self.staged_nos.extend([staged_no] * n)
        self.file_offs.extend([file_base + o for o in named.offsets])
        self.log_offs.extend([log_base + o for o in named.offsets])
        self._add_names(named)

    def add_pieces(self, named: NamedChunks, staged_nos: list[int], file_offs: list[int],
                   log_offs: list[int]) -> None:
        """Chunks named one per piece (`name_whole_pieces`), each piece's place given."""
        self.staged_nos.extend(staged_nos)
        self.file_offs.extend(file_offs)
        self.log_offs.extend(log_offs)
        self._add_names(named)

    def _add_names(self, named: NamedChunks) -> None:
        self.lengths.extend(named.lengths)
        self.ids.extend(named.ids)
        self.crcs.extend(named.crcs)
        self.zero.extend(named.zero)


@dataclass(eq=False)
class ChunkStream:
    """A file being written front to back, cut into chunks as it arrives.

    Writes store their bytes in parallel; the chunker is fed their bytes in
    the order they arrived (`tickets`, handed out on the trio thread as
    writes arrive), behind them: each write whose bytes are in the log waits
    in `ready` until the feed reaches its ticket.
    """

    base: int                        # file offset of the chunker's position 0
    next_off: int                    # where the next write must start to continue it
    # None after a commit's cut until the stream's next bytes arrive (`cutter`):
    # a small file's stream, cut at its close, is never written again.
    chunker: Optional[BatchChunker]
    arena: Optional[StagedRecord] = None
    cursor: int = 0                  # log offset for the next byte in the arena
    # (file offset, log offset, staged no) where each arena begins, for cuts.
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    alive: bool = True
    tickets: int = 0                 # handed out so far
    next_ticket: int = 0             # whose turn it is to feed the chunker
    # ticket -> (plan, data) of writes in the log waiting for the feed
    ready: dict[int, tuple["WritePlan", Union[bytes, LogBytes]]] = field(default_factory=dict)
    ready_bytes: int = 0
    feeding: bool = False            # the feed task runs
    # Log ranges of new chunks settled from the stream, for the next feed
    # call to start writing back (`PmemLog.start_writeback`).
    to_write_back: list[tuple[int, int]] = field(default_factory=list)
    fed: trio.Event = field(default_factory=trio.Event)   # set (and replaced) per feed call

    def stop(self) -> None:
        """No more feeding: what is not fed yet is cut at commit."""
        self.alive = False
        self.ready.clear()
        self.ready_bytes = 0
        self.fed.set()

    def cutter(self) -> BatchChunker:
        """The chunker, made fresh if a cut left none."""
        if self.chunker is None:
            self.chunker = BatchChunker(detect_format=False)
        return self.chunker

    def locate(self, file_off: int) -> tuple[int, int]:
        """(log offset, staged no) of a streamed byte."""
        i = bisect.bisect_right(self.segments, (file_off, 1 << 64, 0)) - 1
        seg_file, seg_log, staged_no = self.segments[i]
        return seg_log + (file_off - seg_file), staged_no


class LogBytes:
    """Stream bytes already in the log (a WRITE the fast path answered):
    the feed reads them back from the log's page cache."""

    __slots__ = ("log_off", "length")

    def __init__(self, log_off: int, length: int) -> None:
        self.log_off = log_off
        self.length = length

    def __len__(self) -> int:
        return self.length


if TYPE_CHECKING:
    from typing import Protocol

    class WindowPublisher(Protocol):
        """Where write windows are opened (fastpath.py's functions)."""

        def write_window(self, ino: int, log_fd: int, file_off: int, log_off: int,
                         log_end: int) -> bool: ...

        def rewrite_window(self, ino: int, log_fd: int, stream_at: int, has_stream: bool,
                           log_off: int, log_end: int) -> bool: ...

        def write_close(self, ino: int) -> None: ...


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


class WriteStager:
    """Puts written bytes in the log and in the overlay; cuts, names and
    stores them once; decides which of that work runs on a worker thread."""

    def __init__(self, index: Index, plog: PmemLog, dedup: bool,
                 io_limiter: trio.CapacityLimiter) -> None:
        self.index = index
        self.log = plog
        self.dedup = dedup
        self.io_limiter = io_limiter
        # A stream's unfed bytes hold log space until the feed gives back the
        # duplicates among them: in a small log the backlogs are a quarter of
        # it each, or a repeated block fills the log ahead of its feed and
        # its writes fail with ENOSPC (a 64 MiB log, CI in session 21).
        self.feed_backlog_bytes = min(FEED_BACKLOG_BYTES, plog.capacity_bytes // 4)
        self.window_backlog_bytes = min(WINDOW_BACKLOG_BYTES, plog.capacity_bytes // 4)
        # Large writes' copies into a log file: C threads (a DAX log's are memory copies).
        self.writer = LogWriter(plog) if plog.threaded_writes and not plog.dax else None
        self._next_staged = -1
        # The fast path's write windows (`open_window`), when it answers WRITEs.
        self.windows: Optional["WindowPublisher"] = None
        self.dedup_hits = 0                       # chunks found already stored
        self.dedup_bytes = 0                      # their bytes, not stored again

    def count_duplicate(self, nbytes: int) -> None:
        self.dedup_hits += 1
        self.dedup_bytes += nbytes

    # ------------------------------------------------------- write windows

    def publish_windows(self, windows: Optional["WindowPublisher"]) -> None:
        """Let the fast path answer streams' next writes (a log on a file only:
        the C module writes with pwrite, as the log writer's threads do)."""
        self.windows = windows if self.writer is not None and self.dedup else None

    def open_window(self, df: DirtyFile) -> None:
        """After a stream write of df (its bytes in the log, handed to the
        feed) or a fold: the fast path may answer the stream's next writes in
        the arena space left, up to what the feed backlog allows."""
        if self.windows is None:
            return
        if df.rewrite_space is not None:
            self.open_rewrite_window(df)
            return
        stream = df.stream
        if stream is None or not stream.alive or stream.arena is None or df.retired:
            self._stop_answering(df)
            return
        arena = stream.arena
        room = min(arena.log_off + arena.length - stream.cursor,
                   self.window_backlog_bytes - stream.ready_bytes,
                   MAX_FILE_BYTES - stream.next_off)
        if room <= 0:
            self._stop_answering(df)
            return
        self.windows.write_window(df.ino, self.log.fd, stream.next_off, stream.cursor,
                                  stream.cursor + room)

    def close_window(self, df: DirtyFile) -> None:
        """No more of df's writes answered in C. None can be pending: the C
        module folds them before any Python runs on the trio thread. A
        rewrite window's space not written gives back."""
        self._stop_answering(df)
        self.drop_rewrite_space(df)

    def _stop_answering(self, df: DirtyFile) -> None:
        """The fast path answers none of df's writes from here (its window,
        if any, closes; the space behind it stays where it is)."""
        if self.windows is not None:
            self.windows.write_close(df.ino)

    def drop_rewrite_space(self, df: DirtyFile) -> None:
        """Give back what the rewrite window's space has left (its window
        closed, or about to be replaced by the stream's)."""
        space, df.rewrite_space = df.rewrite_space, None
        if space is not None and space[1] > space[0]:
            df.give_back(space[0], space[1] - space[0], written=False)

    def give_back_reserves(self, dfs: Iterable[DirtyFile]) -> int:
        """The log is full: the log space files reserved and have not written
        goes back (their rewrite windows' space, their streams' arenas past
        the bytes written); their windows close (a write reserves afresh,
        as little as the log has then). Returns the bytes given back.

        Without this, open files' reserves (an arena takes up to 1/8 of the
        free space, a rewrite window 1/16) could refuse a write with ENOSPC
        while the log held almost no data. Nothing writes into the space
        given back: the C module folded every WRITE it answered before any
        Python runs, and a stream's writes in flight lie below its cursor."""
        freed = 0
        for df in list(dfs):
            self._stop_answering(df)
            space, df.rewrite_space = df.rewrite_space, None
            if space is not None and space[1] > space[0]:
                self.log.release(space[0], space[1] - space[0])
                freed += space[1] - space[0]
            stream = df.stream
            arena = stream.arena if stream is not None else None
            if arena is not None:
                unused = arena.log_off + arena.length - stream.cursor
                if unused > 0 and arena.take(stream.cursor, unused):
                    arena.length -= unused
                    self.log.release(stream.cursor, unused)
                    freed += unused
        return freed

    def open_rewrite_window(self, df: DirtyFile) -> None:
        """After a write out of stream order (a rewrite): the fast path may
        answer df's next writes at other offsets too, each into the next
        bytes of log space reserved for them (`fold_written` makes each a
        staged record, as `_put_records` would), except the writes that
        would go to the stream (or begin one): those keep coming here."""
        if self.windows is None or df.retired:
            return
        space = df.rewrite_space
        if space is None or space[1] - space[0] < REWRITE_REFILL_BYTES:
            self.drop_rewrite_space(df)
            # Never much of a log that is filling up (tiering may be making room).
            size = min(REWRITE_SPACE_BYTES, self.log.free_bytes // 16)
            log_off = self.log.reserve(size) if size >= REWRITE_REFILL_BYTES else None
            if log_off is None:
                self._stop_answering(df)
                return
            space = df.rewrite_space = [log_off, log_off + size]
        stream = df.stream
        if stream is not None:      # as `prepare_write` asks
            opened = self.windows.rewrite_window(df.ino, self.log.fd, stream.next_off, True,
                                                 space[0], space[1])
        else:
            opened = self.windows.rewrite_window(df.ino, self.log.fd, df.overlay.end, False,
                                                 space[0], space[1])
        if not opened:
            self.drop_rewrite_space(df)

    def reopen_after_commit(self, df: DirtyFile) -> None:
        """df's changes are in the index's batch: a file being rewritten gets
        its rewrite window back on the space it kept through the cut, so the
        next cycle's first rewrite is answered in C like the others (it went
        to the daemon, which reserved space afresh: one Python WRITE per
        fsync of a random-write loop)."""
        if df.rewrite_space is not None:
            self.open_rewrite_window(df)

    def fold_written(self, df: DirtyFile, file_off: int, log_off: int, length: int) -> bool:
        """A stream write the fast path answered (its bytes at log_off, in
        the window `open_window` gave): into the overlay and the feed's order
        as `prepare_write` and `store` put one; a rewrite (its bytes at the
        rewrite space's next, `open_rewrite_window`): a staged record. False
        if the stream or the space is not where the window said (the window
        should have closed: the bytes are in the log, but the file cannot
        name them)."""
        space = df.rewrite_space
        if space is not None and log_off == space[0]:
            return self._fold_rewritten(df, file_off, log_off, length)
        stream = df.stream
        arena = stream.arena if stream is not None else None
        if stream is None or arena is None or not stream.alive or df.retired \
                or file_off != stream.next_off or log_off != stream.cursor \
                or log_off + length > arena.log_off + arena.length:
            return False
        stream.cursor += length
        stream.next_off += length
        df.overlay.put(Extent(file_off, length, arena.chunk_no, log_off - arena.log_off))
        df.size = max(df.size, file_off + length)
        # Fed in pieces: the feed's read-back buffer stays small.
        for at in range(0, length, FOLD_PIECE_BYTES):
            n = min(FOLD_PIECE_BYTES, length - at)
            plan = WritePlan(file_off + at, [(log_off + at, 0, n)], [None], stream, 0,
                             stream.tickets)
            stream.tickets += 1
            stream.ready[plan.ticket] = (plan, LogBytes(log_off + at, n))
        stream.ready_bytes += length
        self._start_feed(df, stream)
        return True

    def _fold_rewritten(self, df: DirtyFile, file_off: int, log_off: int, length: int) -> bool:
        """A write the fast path answered from df's rewrite window (its bytes
        at log_off, the space's next): a staged record of its own in the
        overlay, as `_put_records` makes one. False if it does not fit."""
        space = df.rewrite_space
        if df.retired or space is None or log_off + length > space[1] \
                or file_off + length > MAX_FILE_BYTES:
            return False
        space[0] += length
        staged = self._new_staged(df, log_off, length, file_off)
        df.overlay.put(Extent(file_off, length, staged.chunk_no, 0))
        df.size = max(df.size, file_off + length)
        return True

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
                stream = df.stream = ChunkStream(off, off, BatchChunker(detect_format=off == 0))
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
            stream = plan.stream
            if stream is not None and len(data) <= INLINE_BYTES \
                    and stream.next_ticket == plan.ticket and not stream.feeding \
                    and not stream.ready:
                # Nobody ahead of us: store and feed at once, no task.
                self.store_blocking(plan, data)
                self.store_once(df, self.feed_blocking(stream, [(plan, data)]))
            else:
                if self.writer is not None and len(data) > INLINE_BYTES \
                        and not any(plan.chunks):
                    await self.writer.write(data, plan.pieces)   # C threads, no GIL
                else:
                    await self._inline_if_small(len(data), self.store_blocking, plan, data)
                if stream is not None and stream.alive:
                    await self._hand_to_feed(df, stream, plan, data)
        except BaseException as e:
            # Cancelled (a request aborted at unmount), an I/O error, anything:
            # the bytes may not be in the log, so this content must never commit.
            df.write_error = e
            if plan.stream is not None and df.stream is plan.stream:
                self.end_stream(df)       # the chunker missed these bytes
            if isinstance(e, OSError):
                raise DamagedData(f"log write failed: {e}") from e
            raise

    async def _hand_to_feed(self, df: DirtyFile, stream: ChunkStream, plan: WritePlan,
                            data: bytes) -> None:
        """Queue a stored stream write for the feed, start the feed task if it
        is not running, and wait while too much waits to be fed."""
        stream.ready[plan.ticket] = (plan, data)
        stream.ready_bytes += len(data) - plan.stream_pos
        self._start_feed(df, stream)
        while stream.alive and stream.ready_bytes > self.feed_backlog_bytes:
            await stream.fed.wait()

    def _start_feed(self, df: DirtyFile, stream: ChunkStream) -> None:
        if not stream.feeding:
            stream.feeding = True
            df.feed_begins()
            trio.lowlevel.spawn_system_task(self._feed_behind, df, stream,
                                            name="ckptfs stream feed")

    async def _feed_behind(self, df: DirtyFile, stream: ChunkStream) -> None:
        """Feed the stream's ready writes in ticket order, a worker-thread call
        at a time, and settle their chunks; ends when the next write in order
        is not ready (its own hand-over starts the task again).

        A system task (nothing waits for it but `DirtyFile.quiesce`): any
        failure marks the file, whose commit then fails, as a failed write does."""
        try:
            while stream.alive:
                jobs: list[tuple[WritePlan, Union[bytes, LogBytes]]] = []
                nbytes = 0
                ticket = stream.next_ticket
                while ticket in stream.ready and nbytes < FEED_CALL_BYTES:
                    plan, data = stream.ready.pop(ticket)
                    jobs.append((plan, data))
                    nbytes += len(data) - plan.stream_pos
                    ticket += 1
                if not jobs:
                    break
                stream.ready_bytes -= nbytes
                write_back, stream.to_write_back = stream.to_write_back, []
                batch = await trio.to_thread.run_sync(self.feed_blocking, stream, jobs, True,
                                                      write_back, limiter=self.io_limiter)
                fed, stream.fed = stream.fed, trio.Event()
                fed.set()
                self.store_once(df, batch, stream.to_write_back)
        except BaseException as e:     # noqa: B036 - a system task must not raise
            if df.write_error is None:
                df.write_error = e
            if df.stream is stream:
                self.end_stream(df)        # the chunker missed these bytes
            if not isinstance(e, trio.Cancelled):
                log.error("inode %d: cutting written bytes into chunks failed: %r", df.ino, e)
        finally:
            stream.feeding = False
            df.feed_ends()

    async def cut_for_commit(self, df: DirtyFile) -> None:
        """Cut every byte of df not yet cut into chunks and store each once:
        the stream's unfinished tail, then whatever was written out of order.
        New writes to the file wait meanwhile (none is answered in C). A
        rewrite window's space stays the file's: `reopen_after_commit` opens
        the window on it again."""
        self._stop_answering(df)
        async with df.cutting():
            stream = df.stream
            if stream is not None and stream.alive and stream.chunker is not None \
                    and stream.chunker.position:
                batch = await self._inline_if_small(stream.chunker.position,
                                                    self.finish_stream_blocking, stream)
                self.store_once(df, batch)
            ranges = self.staged_ranges(df)
            if ranges:
                batch = await self._inline_if_small(sum(r[2] for r in ranges),
                                                    self.cut_blocking, ranges)
                self.store_once(df, batch)

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
        self.close_window(df)
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
        """Copy a write's bytes into the log. May block.

        A large write's new chunks (dedup off: every piece is one) start on
        their way to the disk at once, as a stream's do when fed: the commit
        then waits for less (`PmemLog.start_writeback`). Not small ones: a
        queued job per few KiB would cost more than the fsync saves."""
        view = memoryview(data)
        for (log_off, pos, length), chunk in zip(plan.pieces, plan.chunks):
            if chunk is None:
                self.log.write(log_off, view[pos:pos + length])
            else:
                chunk.crcs = self.log.store(log_off, view[pos:pos + length])
        if len(data) > INLINE_BYTES and any(plan.chunks):
            self.log.start_writeback([(log_off, length) for (log_off, _, length), chunk
                                      in zip(plan.pieces, plan.chunks) if chunk is not None])

    def feed_blocking(self, stream: ChunkStream,
                      jobs: list[tuple[WritePlan, Union[bytes, LogBytes]]],
                      behind: bool = False,
                      write_back: Sequence[tuple[int, int]] = ()) -> ChunkBatch:
        """Cut and name the chunks that consecutive stream writes (from the
        stream's next ticket on, in order) complete. May block: CPU work.
        behind: the feed task's call, on a worker thread, after the replies.
        write_back: log ranges of new chunks the last call settled, whose
        writeback to the disk starts first, so that the fsync or close that
        makes them durable later finds most of a stream on its way already
        (it still waits for all of it: nothing becomes durable sooner)."""
        if behind and pausing_at("stream-feed"):
            pause_blocking("stream-feed")
        if write_back:
            self.log.start_writeback(write_back)
        batch = ChunkBatch()
        for plan, data in jobs:
            if not stream.alive:
                break                   # stopped meanwhile: the rest is cut at commit
            assert plan.ticket == stream.next_ticket
            stream.next_ticket += 1
            if plan.cut_at is not None:
                stream.cutter().add_boundaries([plan.cut_at - stream.base])
            # One native pass names every chunk the write completes; a chunk
            # begun by earlier writes was hashed as they passed, nothing is read back.
            if isinstance(data, LogBytes):
                # Answered in C: its bytes are in the log (and its page
                # cache), read where they are (the chunker copies none).
                with self.log.unverified_view(data.log_off, data.length) as view:
                    named = stream.cutter().feed_named(view)
            else:
                named = stream.cutter().feed_named(memoryview(data)[plan.stream_pos:])
            self._locate(stream, named, batch)
        return batch

    def finish_stream_blocking(self, stream: ChunkStream) -> ChunkBatch:
        """Cut the stream's unfinished tail; later writes start a fresh chunker. May block."""
        batch = self._locate(stream, stream.cutter().finish_named())
        stream.base = stream.next_off
        stream.chunker = None           # made again if more bytes come (`cutter`)
        return batch

    @staticmethod
    def _locate(stream: ChunkStream, named: NamedChunks,
                batch: Optional[ChunkBatch] = None) -> ChunkBatch:
        """Where streamed chunks lie (added to batch): a chunk never straddles
        two arenas."""
        if batch is None:
            batch = ChunkBatch()
        base = stream.base
        for at in named.offsets:
            file_off = base + at
            log_off, staged_no = stream.locate(file_off)
            batch.staged_nos.append(staged_no)
            batch.file_offs.append(file_off)
            batch.log_offs.append(log_off)
        batch._add_names(named)
        return batch

    def cut_blocking(self, ranges: list[tuple[int, int, int, int]]) -> ChunkBatch:
        """Cut staged ranges (staged no, file offset, length, log offset) into named
        chunks: the commit-time path for bytes not cut as they streamed in. May block.

        A range shorter than the smallest chunk (a small rewrite) is one chunk
        whatever its bytes: consecutive ones are read together (one read per
        run adjacent in the log) and named in one native call, with no chunker
        each. A range at offset 0 goes through a chunker (format hints may
        cut it)."""
        batch = ChunkBatch()
        buf: Optional[memoryview] = None
        k = 0
        while k < len(ranges):
            j, nbytes = k, 0
            while j < len(ranges) and _whole_chunk(ranges[j]) \
                    and nbytes + ranges[j][2] <= CUT_READ_BYTES:
                nbytes += ranges[j][2]
                j += 1
            if j > k:
                self._name_short_blocking(ranges[k:j], nbytes, batch)
                k = j
                continue
            staged_no, file_off, length, log_off = ranges[k]
            k += 1
            if buf is None:
                buf = memoryview(bytearray(min(CUT_READ_BYTES, max(r[2] for r in ranges))))
            chunker = BatchChunker(detect_format=file_off == 0)
            pos = 0
            while pos < length:
                n = min(len(buf), length - pos)
                block = buf[:n]
                self.log.read_unverified_into(block, log_off + pos)
                batch.add(chunker.feed_named(block), staged_no, file_off, log_off)
                pos += n
            batch.add(chunker.finish_named(), staged_no, file_off, log_off)
        return batch

    def _name_short_blocking(self, ranges: list[tuple[int, int, int, int]], nbytes: int,
                             batch: ChunkBatch) -> None:
        """`cut_blocking` of ranges that are each one chunk (`_whole_chunk`),
        nbytes in all. May block."""
        data = memoryview(bytearray(nbytes))
        offs: list[int] = []
        pos = run_pos = 0
        run_log = ranges[0][3]
        for _, _, length, log_off in ranges:
            if log_off != run_log + (pos - run_pos):
                self.log.read_unverified_into(data[run_pos:pos], run_log)
                run_pos, run_log = pos, log_off
            offs.append(pos)
            pos += length
        self.log.read_unverified_into(data[run_pos:pos], run_log)
        named = name_whole_pieces(data, offs, [r[2] for r in ranges])
        batch.add_pieces(named, [r[0] for r in ranges], [r[1] for r in ranges],
                         [r[3] for r in ranges])

    # -------------------------------------------------------- storing once

    def store_once(self, df: DirtyFile, batch: ChunkBatch,
                   new_ranges: Optional[list[tuple[int, int]]] = None) -> None:
        """Make named chunks of staged bytes chunks, each stored once: the
        overlay points at a stored chunk with the same id (the staged bytes go
        back at once) or at a new chunk made of the bytes where they lie; the
        new chunks' log ranges are added to new_ranges if given (adjacent
        ones merged).

        One pass per batch: the usual case, a write's chunks all inside one
        staged extent, is one overlay splice (`Overlay.retarget_run`)."""
        freed: list[tuple[int, int]] = []
        ov = df.overlay
        staged_recs = df.staged
        pending_ids = df.pending_ids
        lookup = ix.chunk_no_finder(self.index)
        if not pending_ids:
            # The ids below are looked up now: a twin can only come later.
            df.ids_looked_up_at = self.index.chunk_ids_put
        run: list[tuple[int, int, int]] = []       # (a, b, target) inside run_extent
        run_extent: Optional[Extent] = None
        for k, staged_no in enumerate(batch.staged_nos):
            staged = staged_recs.get(staged_no)
            if staged is None:
                continue                     # retired: nothing points at these bytes
            a = batch.file_offs[k]
            length = batch.lengths[k]
            b = a + length
            i = ov.index_at(a)
            e = ov.extents[i] if i is not None else None
            whole = e is not None and e.chunk_no == staged.chunk_no and e.end >= b
            if run and (not whole or e is not run_extent):
                self._flush_run(ov, run_extent, run)
                run = []
                if whole:
                    i = ov.index_at(a)
            # the usual case: one staged extent holds it all
            covering = [e] if whole else \
                [x for x in ov.within(a, b) if x.chunk_no == staged.chunk_no]
            log_off = batch.log_offs[k]
            if not covering or not staged.take(log_off, length):
                continue                     # overwritten meanwhile: retires with the record
            # A chunk with these bytes already stored (committed, or new in this file)?
            if batch.zero[k]:
                target = ZERO_CHUNK          # zeros: a hole, stored nowhere
            else:
                cid = batch.ids[k]
                target = pending_ids.get(cid)
                if target is None:
                    target = lookup(cid)
            if target is None:
                chunk = Chunk(self.index.allocate_id(b"next_chunk"), CHUNK_LOG, 0, length,
                              log_off=log_off, crcs=batch.crcs[k], chunk_id=cid)
                df.new_chunks[chunk.chunk_no] = chunk
                pending_ids[cid] = chunk.chunk_no
                target = chunk.chunk_no
                if new_ranges is not None:
                    if new_ranges and sum(new_ranges[-1]) == log_off:
                        new_ranges[-1] = (new_ranges[-1][0], new_ranges[-1][1] + length)
                    else:
                        new_ranges.append((log_off, length))
            else:
                self.count_duplicate(length)
                # Neighbouring duplicates are neighbours in the log: one release.
                if freed and freed[-1][0] + freed[-1][1] == log_off:
                    freed[-1] = (freed[-1][0], freed[-1][1] + length)
                else:
                    freed.append((log_off, length))
            if whole:
                run_extent = e
                run.append((a, b, target))
                continue
            for x in covering:
                s, t = max(x.file_off, a), min(x.end, b)
                ov.put(Extent(s, t - s, target, s - a))
        if run:
            self._flush_run(ov, run_extent, run)
        for off, length in freed:
            df.give_back(off, length, written=True)

    @staticmethod
    def _flush_run(ov, extent: Extent, run: list[tuple[int, int, int]]) -> None:
        i = ov.index_at(run[0][0])
        assert i is not None and ov.extents[i] is extent
        ov.retarget_run(i, run)

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


def _whole_chunk(staged_range: tuple[int, int, int, int]) -> bool:
    """A staged range (staged no, file offset, length, log offset) no cut
    falls inside: shorter than the smallest chunk, and not at the file's
    start (where format hints may force cuts)."""
    return staged_range[2] < DEFAULT_MIN_SIZE and staged_range[1] > 0


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
