"""The chunk reader: which chunk bytes make up a read, and reading them.

A read is planned on the trio thread (`plan`): the open file's overlay
first (new chunks, staged records, stored chunks it names), the committed
extent map under it (cut at a pending truncation), holes left out. The plan
is then executed (`read_blocking_into`): LOG chunks from the log, every 64 KiB
block CRC-checked; staged bytes from the log as they are (nothing committed
names them yet); PACK chunks from the cold store (`coldstore.ColdStore`,
given to the constructor: None when no backing store is attached); SOURCE
chunks from the pre-existing originals (`sources.SourceFiles`). A damaged
record or a short chunk is DamagedData (EIO), never a read past a chunk.

A file with no uncommitted changes is read from its *window*: the committed
map of a stretch of the file (WINDOW_BYTES from where a read first needs
it), its extents and their chunk records loaded in one pass over the index
and kept, so a sequential reader does not walk LMDB per request. The index
tells the reader of every change to an extent map or a chunk record as it
is made (`Index.watch_maps`: writes, truncation, commits, deletion,
tiering's flips, reclaim), and the window of every file it touches is
dropped there and then: a window is always the map as the index has it.
When every extent a read needs is a LOG chunk, the window's native form
(`native.ExtentTable`) reads them in one call without the GIL: one
`preadv` per run contiguous in the log, every block CRC-checked, into a
reply buffer reused once nothing holds it (never zeroed: holes are
written as zeros). A window whose extents are all LOG chunks is also
published to the FUSE channel's fast path (`publish_to`: fastpath.py),
which then answers the kernel's READs inside it from the page cache
without entering the interpreter; a window is withdrawn from it
whenever it is dropped, and it is dropped before the file's map, its
chunks or its size change, or the file gets uncommitted changes
(`changing`). A sequential reader served in C never comes here for its next
window: the published table carries a mark (`read_marks`), and the fast
path tells `load_ahead` (fastpath.serve_read_ahead) once the reader passes
it, NEXT_WINDOW_AT_BYTES before the window's end; the next window is loaded
then (the current one's extents reused, only the new stretch read from the
index) and replaces the table before the reader gets there. The index
pages of the stretches ahead are read into memory on a worker thread first
(`ix.touch_map`, through a read view: nothing decoded or kept there), so
the trio thread's load does not wait for the disk after a cache drop.

A read of cold chunks also asks the prefetcher for the cold chunks a
sequential reader will want next (`cold_ahead`), continuing from where the
last read's look-ahead stopped; it takes their records from the reader's
window, and those it reads from the index past the window's end go to the
next window's load (dropped, like windows, when the index changes them).
The window's cold pieces whose chunks the cold store holds verified are
published to the fast path's cold table (`_publish_cold`), which answers
READs inside them from that memory without the interpreter. A READ answered
there past the table's mark (a quarter of the look-ahead past the last
top-up) wakes `cold_refill` (fastpath.serve_cold_refills), which tops the
look-ahead up, moves the window on if it would cut the publication short,
and publishes further: a sequential restore sends no READ here for that.
After each refill, and each READ of cold chunks served here (a reader that
caught up with the fetches sends them), `warm_soon` has the index pages of
the map as far as the next refills can load read into memory on a worker
thread, as `load_ahead` does, so those window loads and look-aheads do not
wait for the disk on the trio thread. Each piece keeps
a view of its bytes until it is withdrawn (with the window, or trimmed
behind the reader and the replies that may still read it written: the trim
itself does not wait for them, `_trim_cold`), so the cache can evict a chunk
but not reuse or free what C may still read.

`read` holds the bytes it planned with in place while it runs (the file's
gate for uncommitted space, the reclaimer's read epochs for committed space)
and decides where the byte work runs: inline up to INLINE_BYTES, else on a
worker thread. `read_blocking_into` may block; the rest runs on the trio thread.
"""

from __future__ import annotations

import sys
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from operator import add
from typing import TYPE_CHECKING, Collection, Optional, Union

import trio

from . import index as ix
from . import native
from .dirtyfile import DirtyFile
from .errors import CkptfsError, DamagedData
from .index import CHUNK_LOG, CHUNK_PACK, CHUNK_SOURCE, Chunk, Extent, Index
from .overlay import ZERO_CHUNK
from .pmemlog import PmemLog
from .reclaim import Reclaimer
from .sources import SourceFiles
from .staging import CHUNK_STAGED, StagedRecord

if TYPE_CHECKING:
    from typing import Protocol

    from .coldstore import ColdStore, Prefetcher

    class ReadPublisher(Protocol):
        """Where read windows are published (fastpath.py's functions)."""

        def read_table(self, ino: int, log_fd: int, table: native.ExtentTable,
                       start: int, end: int) -> bool: ...

        def read_marks(self, ino: int, next_at: Optional[int], end_is_eof: bool) -> None: ...

        def read_forget(self, ino: int) -> None: ...

        def read_retire(self, ino: int) -> None: ...

        def read_bytes(self) -> int: ...

        def cold_publish(self, ino: int, offs: list[int], lens: list[int],
                         addresses: list[int], refill_at: int) -> int: ...

        def cold_trim(self, ino: int, below: int) -> None: ...

        def cold_trim_later(self, ino: int, below: int) -> int: ...

        def cold_drained(self, ino: int, epoch: int) -> bool: ...

        def cold_mark(self, ino: int, wake_at: int) -> bool: ...

        def cold_forget(self, ino: int) -> None: ...

INLINE_BYTES = 64 * 1024         # reads up to this size are assembled on the trio thread
AHEAD_RESCAN_BYTES = 64 << 20    # a reader this far behind its look-ahead starts it again
AHEAD_STEP_BYTES = 4 << 20       # the look-ahead is topped up by at least this much at once
AHEAD_RECORDS = 8192             # cold chunk records kept for the next windows, at most

WINDOW_BYTES = 32 << 20          # the committed map loaded at once for a reader
# A reader's next window keeps this much behind the read: the kernel sends
# the READs of its read-ahead (16 MiB) out of order.
WINDOW_BACK_BYTES = 20 << 20
# A published window's sequential reader this near its end gets the next one
# loaded ahead (load_ahead), so its READs keep being answered in C; that one
# reaches this far past the reader (fewer, longer loads than WINDOW_BYTES).
NEXT_WINDOW_AT_BYTES = 16 << 20
AHEAD_WINDOW_BYTES = 64 << 20
WARM_AHEAD_BYTES = 128 << 20     # the index pages of this much ahead are read in advance
WARM_STEP_BYTES = 16 << 20       # a cold reader's are read in this much further at once
MAX_TOUCHED = 4096               # files whose index pages read ahead are remembered
MAX_WINDOWS = 32                 # files whose windows are kept (least recently read go)
REPLY_BUFFER_BYTES = 1 << 20     # reused reply buffers: the largest FUSE read
MAX_REPLY_BUFFERS = 8            # more in use at once are allocated and dropped
HINT_BYTES = 16 << 20            # log read-ahead asked for ahead of a sequential reader
HINT_SLACK_BYTES = 4 << 20       # a read this near the last one's end is sequential

AnyChunk = Union[Chunk, StagedRecord]


@dataclass(slots=True)
class ReadPiece:
    dst_off: int
    length: int
    chunk: AnyChunk
    chunk_off: int


@dataclass(slots=True, eq=False)
class MapWindow:
    """The committed extent map of file bytes [start, end) of ino: the
    executor's table of its LOG extents, the chunk records of the others
    (None: a LOG extent, or a record missing; a read asks the index again)."""
    ino: int
    start: int
    end: int
    file_size: int                   # the file's size when loaded (a change drops the window)
    extents: list[Extent]
    ends: list[int]                  # each extent's end, for bisect
    offs: list[int]                  # each extent's file offset
    chunks: list[Optional[Chunk]]    # None for LOG extents the executor reads
    slow: list[int]                  # slow[k]: extents before k the executor cannot read
    # The table's rows (native.ExtentTable), for the next window; None when
    # the window was built from the records as stored (`_load_records`).
    rows: Optional[list[tuple]]
    table: Optional[native.ExtentTable]
    chunk_nos: Sequence[int]         # each extent's chunk (`_chunk_users`)
    published: bool = False          # the FUSE fast path answers reads inside it
    read_to: int = 0                 # where the last read ended (sequential or not)
    hinted_to: int = 0               # log read-ahead asked for up to this file offset
    # Its cold table on the fast path: (piece end, pin) of every published
    # piece, file order (None: nothing published); the extent to publish
    # next; the read it was published for and how far past it.
    cold_pins: Optional[deque] = None
    cold_next: int = 0
    cold_from: int = 0
    cold_depth: int = 0
    cold_to: int = 0                 # the published pieces' end
    cold_marked: bool = False        # its table's mark wakes cold_refill (fastpath.cold_mark)
    # Pins trimmed from the table whose bytes replies in flight may still
    # read: (epoch, pins) oldest first, kept until fastpath.cold_drained.
    cold_retired: Optional[deque] = None

    def span(self, off: int, end: int) -> tuple[int, int]:
        """Extents [i, j) that overlap [off, end)."""
        return bisect_right(self.ends, off), bisect_left(self.offs, end)


class PackedExtents(Sequence):
    """A window's extents kept as the columns its loader read them in
    (`_load_records`): an `Extent` is made only when asked for."""

    __slots__ = ("offs", "lens", "chunk_nos", "chunk_offs")

    def __init__(self, offs: Sequence[int], lens: Sequence[int], chunk_nos: Sequence[int],
                 chunk_offs: Sequence[int]) -> None:
        self.offs, self.lens, self.chunk_nos, self.chunk_offs = offs, lens, chunk_nos, chunk_offs

    def __len__(self) -> int:
        return len(self.offs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [Extent(*t) for t in zip(self.offs[i], self.lens[i], self.chunk_nos[i],
                                             self.chunk_offs[i])]
        return Extent(self.offs[i], self.lens[i], self.chunk_nos[i], self.chunk_offs[i])


class ReplyBuffers:
    """Reply buffers used again once nothing holds them: no 1 MiB zero fill
    and no fresh pages per READ. A buffer is free when its only references
    are this pool's (pyfuse3 lets go of a reply as soon as it is sent; any
    other caller that keeps one just keeps it from being reused). Trio thread."""

    def __init__(self) -> None:
        self._bufs: list[bytearray] = []

    def take(self, length: int) -> bytearray:
        if length > REPLY_BUFFER_BYTES:
            return bytearray(length)
        for buf in self._bufs:
            # References: the list, `buf`, getrefcount's argument.
            if sys.getrefcount(buf) == 3:
                return buf
        buf = bytearray(REPLY_BUFFER_BYTES)
        if len(self._bufs) < MAX_REPLY_BUFFERS:
            self._bufs.append(buf)
        return buf


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
        # Cold chunk records the look-ahead read past a window's end, for the
        # next window's load (dropped when the index changes them).
        self._ahead_records: dict[int, Chunk] = {}
        self._touched_to: dict[int, int] = {}   # ino -> its index pages read ahead up to
        self._warms: Optional[trio.Nursery] = None      # where warm_soon starts cold_warm
        self._bytes_read = 0
        self._publisher: Optional["ReadPublisher"] = None
        self._windows: dict[int, MapWindow] = {}        # ino -> its window, oldest first
        self._chunk_users: dict[int, set[int]] = {}     # chunk_no -> inos whose window names it
        self._replies = ReplyBuffers()
        self.window_loads = 0
        self.windows_ahead = 0          # of those, loaded ahead of a reader in C (load_ahead)
        self.reads_waited = 0           # window reads that missed the page cache
        index.watch_maps(self._extents_changed, self._chunks_changed)

    @property
    def bytes_read(self) -> int:
        """File bytes read since the mount, the fast path's included."""
        extra = self._publisher.read_bytes() if self._publisher is not None else 0
        return self._bytes_read + extra

    def publish_to(self, publisher: "ReadPublisher") -> None:
        """From now on, windows whose extents are all LOG chunks are published
        to publisher (the FUSE fast path), which answers reads inside them."""
        self._publisher = publisher

    def changing(self, ino: int) -> None:
        """ino is about to get uncommitted changes: its window goes (reads
        are planned from its overlay until it commits)."""
        self._drop_window(ino)

    async def read(self, df: Optional[DirtyFile], ino: int, off: int, size: int,
                   file_size: int) -> bytes | bytearray:
        """The bytes of [off, off+size) of ino (df: its uncommitted changes,
        quiesced by the caller), short at the end of the file."""
        if df is None:
            end = min(off + size, file_size)
            if end <= off:
                return b""
            window = self._window(ino, off, end, file_size)
            i, j = window.span(off, end)
            if window.table is not None and window.slow[j] == window.slow[i]:
                return await self._read_window(window, i, j, off, end - off)
            length, pieces = end - off, self._window_pieces(window, i, j, off, end)
        else:
            length, pieces = self.plan(df, ino, off, size, file_size)
        if not pieces:
            return bytes(length)
        if self.prefetcher is not None and any(p.chunk.kind == CHUNK_PACK for p in pieces):
            self.prefetcher.prefetch(self.cold_ahead(ino, off + size, file_size,
                                                     window if df is None else None),
                                     partial(self._cold_fetched, ino))
            if df is None:
                if self._publisher is not None:
                    self._publish_cold(window, off, refill=True)
                self.warm_soon(ino, off + size)
        # The gate keeps uncommitted space it reads from being reused; the
        # epoch, committed space freed meanwhile.
        buf = self._replies.take(length)
        out = memoryview(buf)[:length]
        with df.reading() if df is not None else nullcontext():
            epoch = self.reclaimer.begin_read()
            try:
                if length <= INLINE_BYTES:
                    self.read_blocking_into(out, pieces)
                    await trio.lowlevel.checkpoint()
                elif self._read_cached_into(out, pieces):
                    await trio.lowlevel.checkpoint()
                else:
                    await trio.to_thread.run_sync(self.read_blocking_into, out, pieces,
                                                  limiter=self.io_limiter)
            finally:
                self.reclaimer.end_read(epoch)
        self._bytes_read += length
        return buf if length == len(buf) else out

    async def _read_window(self, window: MapWindow, i: int, j: int, off: int, length: int
                           ) -> bytearray | memoryview:
        """Extents [i, j) of window, all LOG chunks, into a reply buffer."""
        if i == j:
            return bytes(length)
        self._hint_ahead(window, off, off + length)
        buf = self._replies.take(length)
        out = memoryview(buf)[:length]
        epoch = self.reclaimer.begin_read()
        try:
            # From the page cache (the hints make it so for a sequential
            # reader): a copy and a CRC, GIL released, cheaper than a thread
            # hop. Else on a worker thread, which may wait for the disk.
            # Either way the request yields once, as every trio operation does
            # (a read that never yields changed the order of other tasks' steps).
            if length <= INLINE_BYTES:
                self.log.read_extents_into(out, window.table, i, j - i, off)
                await trio.lowlevel.checkpoint()
            elif self.log.read_extents_into(out, window.table, i, j - i, off, nowait=True):
                await trio.lowlevel.checkpoint()
            else:
                self.reads_waited += 1
                await trio.to_thread.run_sync(self.log.read_extents_into, out, window.table,
                                              i, j - i, off, limiter=self.io_limiter)
        finally:
            self.reclaimer.end_read(epoch)
        self._bytes_read += length
        return buf if length == len(buf) else out

    def _hint_ahead(self, window: MapWindow, off: int, end: int) -> None:
        """A sequential reader's next HINT_BYTES: the kernel reads their log
        bytes ahead (POSIX_FADV_WILLNEED), so its next reads find them in the
        page cache. A reader that jumps gets none."""
        sequential = window.read_to - HINT_SLACK_BYTES <= off <= window.read_to + HINT_SLACK_BYTES
        window.read_to = max(window.read_to, end) if sequential else end
        if not sequential or window.hinted_to >= end + HINT_BYTES // 2:
            return
        # From the read's own bytes if not asked for yet (the reader's first
        # read, or its first after a jump): their disk reads go first, not
        # behind the HINT_BYTES ahead of them.
        start = max(window.hinted_to, off)
        stop = min(end + HINT_BYTES, window.end)
        window.hinted_to = stop
        if stop > start:
            # GIL released; it only queues the reads (a thread hop costs more).
            window.table.hint(self.log.fd, start, stop - start)

    def forget(self, ino: int) -> None:
        """The kernel forgot ino: drop its look-ahead position and window."""
        self._ahead.pop(ino, None)
        self._touched_to.pop(ino, None)
        self._drop_window(ino)

    # ------------------------------------------------------------ windows

    def _window(self, ino: int, off: int, end: int, file_size: int) -> MapWindow:
        """A window of ino's committed map covering [off, end)."""
        window = self._windows.pop(ino, None)
        if window is not None and window.start <= off and end <= window.end:
            self._windows[ino] = window         # most recently read last
            return window
        w_start = off
        if window is not None:
            if window.start <= off:
                # Moving on: READs the kernel sent together arrive out of
                # order, so the last few MiB before this one still come.
                w_start = max(window.start, off - WINDOW_BACK_BYTES)
            self._drop_window(ino, window, moving=True)
        return self._load_window(ino, w_start, max(end, min(off + WINDOW_BYTES, file_size)),
                                 file_size)

    async def load_ahead(self, ino: int, read_to: int) -> None:
        """ino's sequential reader of its published window has reached
        read_to (fastpath.serve_read_ahead): near the window's end, load and
        publish the window it reads next now, so that its READs do not come
        here for it. The index pages windows need are read into memory on a
        worker thread first, well ahead of the reader (after a cache drop,
        each page fault on the trio thread stalled every READ for ms); each
        window is still loaded from the live index on the trio thread."""
        window = self._windows.get(ino)
        if window is None or not window.published or not window.start <= read_to <= window.end \
                or window.end == window.file_size:
            return                          # dropped, moved on, not read in C, or the last
        size = window.file_size
        if read_to < window.end - NEXT_WINDOW_AT_BYTES:
            # A reader's first window asks at once: only the index pages,
            # the next window's first.
            await self._touch_index_ahead(ino, window.end, min(window.end + WINDOW_BYTES, size))
            if self._windows.get(ino) is window:
                self._publisher.read_marks(ino, window.end - NEXT_WINDOW_AT_BYTES, False)
            await self._touch_index_ahead(ino, window.end, min(read_to + WARM_AHEAD_BYTES, size))
            return
        w_end = min(read_to + AHEAD_WINDOW_BYTES, size)
        if w_end <= window.end:
            return
        await self._touch_index_ahead(ino, window.end, w_end)
        if self._windows.get(ino) is not window:
            return                  # dropped (a change) or replaced meanwhile: nothing to do
        del self._windows[ino]
        self._drop_window(ino, window, moving=True)
        self._load_window(ino, max(window.start, read_to - WINDOW_BACK_BYTES), w_end, size,
                          reuse=window)
        self.windows_ahead += 1
        await self._touch_index_ahead(ino, w_end, min(read_to + WARM_AHEAD_BYTES, size))

    async def _touch_index_ahead(self, ino: int, start: int, end: int) -> None:
        """The index pages of ino's map in [start, end) are read into memory
        on a worker thread, those not asked for before (`_touched_to`)."""
        start = max(start, self._touched_to.get(ino, 0))
        if start >= end:
            return
        if len(self._touched_to) > MAX_TOUCHED:
            self._touched_to.clear()        # readers the kernel never forgot
        self._touched_to[ino] = end
        view = self.index.read_view()
        try:
            await trio.to_thread.run_sync(ix.touch_map, view, ino, start, end)
        finally:
            view.close()

    def _load_window(self, ino: int, w_start: int, w_end: int, file_size: int,
                     reuse: Optional[MapWindow] = None) -> MapWindow:
        """ino's committed map of [w_start, w_end) (w_end <= file_size),
        loaded, kept and published. reuse: ino's window until now, dropped
        just before (nothing changed: it is the index's map), with
        reuse.start <= w_start <= reuse.end < w_end; its part past w_start
        is taken from it, not read again. Trio thread."""
        if not self.log.dax:
            window = self._load_records(ino, w_start, w_end, file_size, reuse)
            if window is not None:
                return self._keep_window(window)
        if reuse is not None and reuse.rows is None:
            reuse = None                # built in C: read it all again
        extents: list[Extent] = []
        chunks: list[Optional[Chunk]] = []
        slow = [0]
        rows = []
        read_from = w_start
        if reuse is not None:
            k = bisect_right(reuse.ends, w_start)
            extents, chunks, rows = reuse.extents[k:], reuse.chunks[k:], reuse.rows[k:]
            for i in range(k, len(reuse.extents)):
                slow.append(slow[-1] + reuse.slow[i + 1] - reuse.slow[i])
            read_from = reuse.end
        for e in list(ix.iter_extents(self.index, ino, read_from, w_end)):
            if reuse is not None and e.file_off < read_from:
                continue                    # it overlaps reuse: taken from there
            extents.append(e)
            # Only what the index holds (the watch sees every change of it);
            # anything else is asked for again at each read.
            record = self._ahead_records.pop(e.chunk_no, None)
            if record is not None:
                loc = None                  # a cold chunk: no log location
            else:
                try:
                    loc, record = ix.window_chunk(self.index, e.chunk_no)
                except CkptfsError:
                    loc = record = None     # damaged: EIO for the reads that need it
            fast = loc is not None and e.chunk_off + e.length <= loc[1]
            if fast:
                log_off, chunk_len, crcs = loc
                rows.append((e.file_off, e.length, log_off, e.chunk_off, chunk_len, crcs))
                chunks.append(None)         # decoded when a read needs it (rarely)
            else:
                rows.append((e.file_off, e.length, 0, 0, e.length,
                             bytes(4 * -(-e.length // ix.CRC_BLOCK_BYTES))))
                if record is None and loc is not None:
                    # A LOG chunk the extent reaches past: its record says what is wrong.
                    try:
                        record = ix.get_chunk(self.index, e.chunk_no)
                    except CkptfsError:
                        pass
                chunks.append(record)
            slow.append(slow[-1] + (not fast))
        # A device-DAX log has no read(2): the mapping is read in Python.
        fast_any = slow[-1] < len(extents) and not self.log.dax
        window = MapWindow(ino, w_start, w_end, file_size, extents, [e.end for e in extents],
                           [e.file_off for e in extents], chunks, slow, rows,
                           native.ExtentTable(rows) if fast_any else None,
                           [e.chunk_no for e in extents])
        return self._keep_window(window)

    def _load_records(self, ino: int, w_start: int, w_end: int, file_size: int,
                      reuse: Optional[MapWindow] = None) -> Optional[MapWindow]:
        """`_load_window`'s window when LMDB alone holds the records of its
        extents (the common case of a committed file), from those records
        as stored: every extent a LOG chunk the executor reads, its table
        built in C, no Python object per extent; none a chunk in the log
        (a cold file's), its records decoded from them (`ix.window_chunks`),
        no LMDB lookup or extent decode per extent: a cold reader's window
        loads run on the trio thread, which answers no READ meanwhile.
        None otherwise (a mix of both, a damaged record). reuse: as for
        `_load_window`; a cold window built here gives its part past w_start
        (`_extend_cold`)."""
        if reuse is not None and reuse.table is None and reuse.rows is None \
                and isinstance(reuse.extents, PackedExtents):
            return self._extend_cold(ino, w_start, w_end, file_size, reuse)
        recs = ix.window_records(self.index, ino, w_start, w_end)
        if recs is None:
            return None
        n = recs.count
        extents = PackedExtents(recs.offs, recs.lens, recs.chunk_nos, recs.chunk_offs)
        ends = list(map(add, recs.offs, recs.lens))
        # The C table stops at the first record that is not a LOG chunk's.
        table = native.ExtentTable.from_records(recs.keys, recs.vals, recs.recs, recs.rec_lens,
                                                n, ix.MAX_CHUNK_BYTES, ix.CRC_BLOCK_BYTES)
        if table is not None:
            return MapWindow(ino, w_start, w_end, file_size, extents, ends, recs.offs,
                             [None] * n, [0] * (n + 1), None, table if n else None,
                             recs.chunk_nos)
        chunks = ix.window_chunks(recs, self._ahead_records)
        if chunks is None:
            return None
        # Every extent slow, as the decoding loader finds them: no table.
        return MapWindow(ino, w_start, w_end, file_size, extents, ends, recs.offs, chunks,
                         list(range(n + 1)), None, None, recs.chunk_nos)

    def _extend_cold(self, ino: int, w_start: int, w_end: int, file_size: int,
                     reuse: MapWindow) -> Optional[MapWindow]:
        """`_load_records`' cold window of [w_start, w_end) from reuse (a
        cold window built there, dropped just before: nothing changed) and
        the records of the stretch past its end only: a cold reader's
        refill moves its window on by about WINDOW_BYTES, and read it all
        again (~4 times each record, from LMDB, decoded) on the trio thread.
        None if the new stretch is not all cold (the decoding loader reads
        the whole window then)."""
        recs = ix.window_records(self.index, ino, reuse.end, w_end)
        if recs is None:
            return None
        new = ix.window_chunks(recs, self._ahead_records)
        if new is None:
            return None
        k = bisect_right(reuse.ends, w_start)
        # The extent reuse ends in, if any, is its last and the stretch's first.
        m = bisect_left(recs.offs, reuse.end)
        old = reuse.extents
        offs = old.offs[k:] + recs.offs[m:]
        extents = PackedExtents(offs, old.lens[k:] + recs.lens[m:],
                                old.chunk_nos[k:] + recs.chunk_nos[m:],
                                old.chunk_offs[k:] + recs.chunk_offs[m:])
        ends = reuse.ends[k:] + list(map(add, recs.offs[m:], recs.lens[m:]))
        n = len(offs)
        return MapWindow(ino, w_start, w_end, file_size, extents, ends, offs,
                         reuse.chunks[k:] + new[m:], list(range(n + 1)), None, None,
                         extents.chunk_nos)

    def _keep_window(self, window: MapWindow) -> MapWindow:
        """Keep and publish a window just loaded."""
        ino, w_start, w_end, file_size = window.ino, window.start, window.end, window.file_size
        slow = window.slow
        self._windows[ino] = window
        if self._publisher is not None and window.table is not None and slow[-1] == 0:
            # w_end <= file_size: the fast path never answers past the end.
            window.published = self._publisher.read_table(ino, self.log.fd, window.table,
                                                          w_start, w_end)
            if window.published:
                # A reader's first window asks at its next READ (the index
                # pages ahead are read then), the others near their end.
                next_at = None if w_end == file_size else w_start \
                    if ino not in self._touched_to else max(w_start, w_end - NEXT_WINDOW_AT_BYTES)
                self._publisher.read_marks(ino, next_at, w_end == file_size)
        users = self._chunk_users
        for chunk_no in window.chunk_nos:
            inos = users.get(chunk_no)
            if inos is None:
                users[chunk_no] = {ino}
            else:
                inos.add(ino)
        while len(self._windows) > MAX_WINDOWS:
            self._drop_window(next(iter(self._windows)))
        self.window_loads += 1
        return window

    def _window_pieces(self, window: MapWindow, i: int, j: int, off: int, end: int
                       ) -> list[ReadPiece]:
        pieces = []
        for e, chunk in zip(window.extents[i:j], window.chunks[i:j]):
            s, t = max(e.file_off, off), min(e.end, end)
            if chunk is None:
                chunk = self.reclaimer.chunk(e.chunk_no)     # says what is wrong
            pieces.append(ReadPiece(s - off, t - s, chunk, e.chunk_off + (s - e.file_off)))
        return pieces

    def _drop_window(self, ino: int, window: Optional[MapWindow] = None,
                     moving: bool = False, keep_cold: bool = False) -> None:
        """ino's window goes: before its table's memory can go, and before a
        change to its map or chunks is made. moving: only because a reader
        moved on past it (nothing changed). keep_cold (moving only): its cold
        table and pins stay, for the window that replaces it (cold_refill)."""
        if window is None:
            window = self._windows.pop(ino, None)
            if window is None:
                return
        if self._publisher is not None:
            if moving and window.published:
                # Nothing changed: the fast path's reads of it in flight may
                # finish (they carry copies of what they read with).
                self._publisher.read_retire(ino)
            else:
                # Waits for the fast path's reads of ino in flight, those of
                # tables retired before included: the change may free their space.
                self._publisher.read_forget(ino)
            window.published = False
        if window.cold_pins is not None and not (moving and keep_cold):
            # Likewise: the pins (the cold bytes' memory) go after the table.
            self._publisher.cold_forget(ino)
            window.cold_pins = window.cold_retired = None
        for chunk_no in window.chunk_nos:
            users = self._chunk_users.get(chunk_no)
            if users is not None:
                users.discard(ino)
                if not users:
                    del self._chunk_users[chunk_no]

    def _extents_changed(self, ino: int) -> None:
        self._touched_to.pop(ino, None)     # its new extents' pages are not read yet
        if ino in self._windows:
            self._drop_window(ino)

    def _chunks_changed(self, chunk_nos: Collection[int]) -> None:
        # A big file's commit tells ~16 new chunk numbers per MiB, which no
        # window names: the intersections find the few that matter in C.
        ahead = self._ahead_records
        if ahead:
            for chunk_no in ahead.keys() & chunk_nos:
                del ahead[chunk_no]
        users = self._chunk_users
        if users:
            for chunk_no in users.keys() & chunk_nos:
                # A drop may take other numbers' users with it: look each up again.
                for ino in list(users.get(chunk_no, ())):
                    self._drop_window(ino)

    # ------------------------------------------------- cold reads in C

    def _publish_cold(self, window: MapWindow, off: int, refill: bool = False,
                      behind: int = HINT_SLACK_BYTES) -> None:
        """Publish to the fast path's cold table of window's file the cold
        extents, from where publication stopped (or off, if the reader is past
        that), whose chunks the cold store holds verified, in file order, up
        to the prefetcher's depth past off; stop at the first not there yet.
        A published piece keeps (pins) the memory of its bytes until the
        window is dropped, or the reader is HINT_SLACK_BYTES past it and the
        replies that may read it are written (`_trim_cold`), so the cache
        may evict the chunk but never reuse or free what C reads from.

        refill (a READ the daemon serves at off): pieces more than behind
        bytes behind off go,
        and READs reaching past off + depth/2 come to the daemon again, which
        asks the prefetcher for more (cold_ahead) and publishes further.
        Trio thread."""
        pub = self._publisher
        if self.cold is None or window.published:
            return
        ino = window.ino
        if window.cold_pins is None:
            window.cold_pins = deque()
        pins = window.cold_pins
        if refill:
            window.cold_from = off
            window.cold_depth = (self.prefetcher.depth_for(ino) if self.prefetcher is not None
                                 else WINDOW_BYTES)
            self._trim_cold(window, off - behind)
        else:
            self._release_drained(window)
        off, depth = window.cold_from, window.cold_depth
        k = window.cold_next
        ends, starts, chunks = window.ends, window.offs, window.chunks
        if k < len(ends) and ends[k] <= off:
            k = bisect_right(ends, off)         # the reader jumped past
        stop = min(off + depth, window.end)
        j = bisect_left(starts, stop, k)        # extents [k, j) start before stop
        ext = window.extents
        coffs = ext.chunk_offs if isinstance(ext, PackedExtents) \
            else [0] * k + [e.chunk_off for e in ext[k:j]]
        last = j

        def cold_extents():
            # The cold extents of [k, j), in order; the first whose chunk is
            # not fetched yet (or damaged: the daemon's read says so) ends
            # the publication. Anything else (a LOG extent, a record
            # missing) is passed over: READs that need it come to the daemon.
            nonlocal last
            for i in range(k, j):
                chunk = chunks[i]
                if chunk is not None and chunk.kind == CHUNK_PACK:
                    last = i
                    if coffs[i] + ends[i] - starts[i] > chunk.length:
                        return
                    yield i, chunk
            last = j

        offs, lens, addresses, new_pins, at = [], [], [], [], []
        w_start, w_end = window.start, window.end
        for i, view, address in self.cold.cached_run(cold_extents()):
            s = max(starts[i], w_start, window.cold_to)
            t = min(ends[i], w_end)
            if t > s:
                offs.append(s)
                lens.append(t - s)
                addresses.append(address + coffs[i] + s - starts[i])
                new_pins.append((t, view))
                at.append(i)
        k = last                        # the first not published, or j
        if not pins and not new_pins:
            return                              # no table, none made
        # Without a mark, READs past half the depth come to the daemon for
        # the top-up; with one, the mark brings it (cold_refill) and only a
        # reader past everything asked for comes.
        added = pub.cold_publish(ino, offs, lens, addresses,
                                 off + (depth if window.cold_marked else depth // 2))
        pins.extend(new_pins[:added])
        if added:
            window.cold_to = offs[added - 1] + lens[added - 1]
        # A piece not added (no table slot free) is tried again next time.
        window.cold_next = at[added] if added < len(at) else k
        if (refill or not window.cold_marked) and pub.cold_mark(ino, off + depth // 4) \
                and not window.cold_marked:
            window.cold_marked = True
            pub.cold_publish(ino, [], [], [], off + depth)

    def _trim_cold(self, window: MapWindow, below: int) -> None:
        """The pieces of window's cold table that end at or before below
        go: C lets go of them at once, without waiting for the replies in
        flight (the trio thread answers no READ while it waits), and their
        pins are kept until those are written (`cold_retired`). Trio thread."""
        pins, pub, ino = window.cold_pins, self._publisher, window.ino
        if window.cold_retired is None:
            window.cold_retired = deque()
        retired = window.cold_retired
        if pins and pins[0][0] <= below:
            epoch = pub.cold_trim_later(ino, below)
            gone = []
            while pins and pins[0][0] <= below:
                gone.append(pins.popleft())
            if epoch >= 0:
                retired.append((epoch, gone))
        self._release_drained(window)

    def _release_drained(self, window: MapWindow) -> None:
        """Trimmed pins whose replies are all written go, oldest first."""
        retired, pub = window.cold_retired, self._publisher
        while retired and pub.cold_drained(window.ino, retired[0][0]):
            retired.popleft()

    def cold_refill(self, ino: int, read_to: int) -> None:
        """ino's reader, answered from its cold table in C, passed the
        table's mark (fastpath.serve_cold_refills), its READs reaching
        read_to: top the look-ahead up and publish further, as a READ served
        here would, so that no READ comes here for it. A window that would
        stop the publication short of the look-ahead is replaced by the next
        one first, its cold table and pins carried over. Trio thread."""
        window = self._windows.get(ino)
        if window is None or window.cold_pins is None or self.prefetcher is None \
                or not window.start <= read_to <= window.end:
            return                  # dropped, moved on, or not a cold reader in C
        size, depth = window.file_size, self.prefetcher.depth_for(ino)
        if read_to + depth > window.end and window.end < size:
            w_start = max(window.start, read_to - WINDOW_BACK_BYTES)
            old = window
            del self._windows[ino]
            self._drop_window(ino, old, moving=True, keep_cold=True)
            # The carried table keeps no piece the new window does not
            # name: a change to a chunk behind it would not reach it.
            self._trim_cold(old, w_start)
            pins, retired = old.cold_pins, old.cold_retired
            try:
                window = self._load_window(ino, w_start,
                                           min(read_to + depth + WINDOW_BYTES, size), size,
                                           reuse=old)
            except BaseException:
                self._publisher.cold_forget(ino)    # before the pins can go
                raise
            window.cold_pins, window.cold_marked = pins, old.cold_marked
            window.cold_retired = retired
            window.cold_from, window.cold_depth = old.cold_from, old.cold_depth
            # From the extent the last piece ended in: the old window cut
            # it at its end.
            window.cold_to = old.cold_to
            window.cold_next = bisect_right(window.ends, old.cold_to)
            self.windows_ahead += 1
        self.prefetcher.prefetch(self.cold_ahead(ino, read_to, size, window),
                                 partial(self._cold_fetched, ino))
        # read_to is the furthest READ's end: the kernel's read-ahead
        # sends the READs before it out of order, up to ~18 MiB behind.
        self._publish_cold(window, read_to, refill=True, behind=WINDOW_BACK_BYTES)

    async def serve_warms(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the cold readers' warm-aheads (`warm_soon`), each in a task of
        its own, until cancelled. Without it running, warm_soon does nothing."""
        async with trio.open_nursery() as nursery:
            self._warms = nursery
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._warms = None

    def warm_soon(self, ino: int, read_to: int) -> None:
        """ino's cold reader reached read_to: a READ of cold chunks served
        here, or a refill of its cold table in C (fastpath.serve_cold_refills).
        Unless the index pages (extents and chunk records) of the map its
        next refills can load are in memory already, `cold_warm` reads them
        in on a worker thread, in a task of its own, so that those window
        loads and look-aheads on the trio thread do not wait for the disk
        (after a cache drop each page is a disk read, and every READ waits
        behind it), as load_ahead does for LOG windows. Both ways matter: a
        reader that catches up with the fetches has its READs passed on to
        the daemon, and no refill comes until it falls behind again. Trio
        thread."""
        window = self._windows.get(ino)
        if self._warms is None or window is None:
            return
        size = window.file_size
        reach = min(read_to + self._warm_reach(ino), size)
        if self._touched_to.get(ino, 0) >= reach:
            return
        self._warms.start_soon(self.cold_warm, ino, read_to, min(reach + WARM_STEP_BYTES, size))

    def _warm_reach(self, ino: int) -> int:
        """How far past a cold reader's furthest READ its next refill may
        load the map: that refill comes at most one look-ahead depth further
        on (READs past what was published come here), and loads its window
        up to depth + WINDOW_BYTES past that."""
        depth = self.prefetcher.depth_for(ino) if self.prefetcher is not None else 0
        return max(WARM_AHEAD_BYTES, 2 * depth + WINDOW_BYTES)

    async def cold_warm(self, ino: int, read_to: int, warm_to: int) -> None:
        """The index pages of ino's map from read_to to warm_to (those not
        read in before) into memory on a worker thread (`warm_soon`)."""
        window = self._windows.get(ino)
        if window is None:
            return                  # dropped: the next READ loads it and asks again
        await self._touch_index_ahead(ino, max(read_to, window.start), warm_to)

    def _cold_fetched(self, ino: int) -> None:
        """The prefetcher fetched cold chunks for ino's reader: publish them."""
        window = self._windows.get(ino)
        if window is not None and window.cold_pins is not None:
            self._publish_cold(window, window.cold_from)

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

    def cold_ahead(self, ino: int, off: int, file_size: int,
                   window: Optional[MapWindow] = None) -> list[Chunk]:
        """Cold chunks a sequential reader of ino will want next, not asked for yet.

        Each read continues from where the last one's look-ahead stopped, so a
        sequential restore scans every extent once, not once per read; the
        part in the reader's window (if given) takes its records from there.
        Every read the daemon serves tops the look-ahead up to the full depth
        (once AHEAD_STEP_BYTES are missing): most READs of a cold file are
        answered in C and never come here, and a top-up only when half the
        depth was left let the reader catch up with the fetches.
        """
        depth = self.prefetcher.depth_for(ino)
        horizon = self._ahead.get(ino, 0)
        if horizon >= off + depth - AHEAD_STEP_BYTES:
            return []               # far enough ahead already
        start = max(off, horizon) if horizon <= off + AHEAD_RESCAN_BYTES else off
        stop = min(off + depth, file_size)
        out = []
        end = start
        if window is not None and window.start <= start < min(stop, window.end):
            w_stop = min(stop, window.end)
            i, j = window.span(start, w_stop)
            for e, chunk in zip(window.extents[i:j], window.chunks[i:j]):
                end = e.end
                if chunk is not None and chunk.kind == CHUNK_PACK:
                    out.append(chunk)
            start = max(end, w_stop)
        if start < stop:
            if len(self._ahead_records) > AHEAD_RECORDS:
                self._ahead_records.clear()     # windows that never came
            for e in ix.iter_extents(self.index, ino, start, stop):
                end = e.end
                chunk = ix.get_chunk(self.index, e.chunk_no)
                if chunk is not None and chunk.kind == CHUNK_PACK:
                    out.append(chunk)
                    self._ahead_records[e.chunk_no] = chunk
        self._ahead[ino] = max(end, start)
        return out

    # ----------------------------------------------------------- executing

    def _read_cached_into(self, view: memoryview, pieces: list[ReadPiece]) -> bool:
        """A read of cold chunks all in the cold store's cache (the prefetcher
        put them there): copies on the trio thread, cheaper than a thread
        hop. False (view holds anything) if one is not cached, or another
        kind of chunk is in the plan."""
        if self.cold is None or any(p.chunk.kind != CHUNK_PACK for p in pieces):
            return False
        pos = 0
        for p in pieces:
            ix.check_chunk_record(p.chunk)
            if p.dst_off > pos:
                view[pos:p.dst_off] = bytes(p.dst_off - pos)
            if not self.cold.read_cached_into(view[p.dst_off:p.dst_off + p.length],
                                              p.chunk, p.chunk_off):
                return False
            pos = p.dst_off + p.length
        if pos < len(view):
            view[pos:] = bytes(len(view) - pos)
        return True

    def read_blocking_into(self, view: memoryview, pieces: list[ReadPiece]) -> None:
        """Assemble the bytes of a read plan into view (a reused buffer: the
        holes between pieces are zeroed here), verifying every log block. May block."""
        pos = 0
        for p in sorted(pieces, key=lambda p: p.dst_off):
            if p.dst_off > pos:
                view[pos:p.dst_off] = bytes(p.dst_off - pos)
            pos = max(pos, p.dst_off + p.length)
        if pos < len(view):
            view[pos:] = bytes(len(view) - pos)
        if self.cold is not None:
            # The read's cold chunks the prefetcher has not brought yet, in one
            # call: neighbours in a pack are one backend read, not one each.
            missing = [p.chunk for p in pieces
                       if p.chunk.kind == CHUNK_PACK and not self.cold.cached(p.chunk)]
            if len(missing) > 1:
                self.cold.get_many(missing)
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
