"""File data: each file's committed extent map, and the open files' changes.

A file's committed map lives in the index (`extents`). While a file is open
for writing, its changes gather in a `DirtyFile` (dirtyfile.py: the overlay
of new extents, new chunks, staged bytes, a truncation point, and the gate
its I/O passes). `commit_file` folds those changes into the committed map in
the index's open batch, so a file's new content becomes visible to a crash
all at once or not at all.

`FileData` keeps the table of open files' changes (`dirty_files`) and wires
the parts that own the rest, each given what it needs when it is made:
- `WriteStager` (staging.py): a write's log space and overlay extents, the
  byte copy, cutting into chunks and storing each once (docs/DEDUP.md),
  and which of that runs on a worker thread;
- `Reclaimer` (reclaim.py): chunk refcounts, pins and zombies, and when
  freed log space may be used again;
- `ChunkReader` (chunkread.py): read plans and their execution, from the
  log, the cold store and the pre-existing originals.

FileData itself owns what a commit does to the committed map: folding an
overlay in (`commit_file`), punching ranges out (`_punch_ranges`: truncation,
overwrite, deletion), and the data ranges `ckptfs export` asks for. It may
not touch names or directory entries (namespace.py), nor the index's
encodings: extents and chunks are typed calls.

Everything here runs on the trio thread; byte work is offloaded by the
stager and the reader.
"""

from __future__ import annotations

import gc
import logging
import time
from bisect import bisect_right
from collections import Counter
from typing import TYPE_CHECKING, Awaitable, Callable, Optional, Union

import trio

from . import index as ix
from .chunkread import ChunkReader
from .dirtyfile import MAX_FILE_BYTES, DirtyFile, FileRetired
from .errors import CkptfsError, DamagedData, IndexFull, NoSpace
from .index import Extent, Index
from .overlay import ZERO_CHUNK
from .pmemlog import PmemLog
from .reclaim import Reclaimer
from .sources import SourceFiles
from .staging import INLINE_BYTES, WriteStager

if TYPE_CHECKING:
    from .coldstore import ColdStore, Prefetcher

log = logging.getLogger(__name__)

__all__ = ["MAX_FILE_BYTES", "FileData", "DirtyFile"]

LOG_FULL_WARNING_S = 60.0        # at most one "log full" warning this often
SMALL_PUNCH_BYTES = 64 * 1024    # a punch this small first looks for the one extent holding it

MakeRoom = Callable[[int], Awaitable[None]]


class FileData:
    """Owns extent maps and the open files' changes; reads and writes file bytes."""

    def __init__(self, index: Index, plog: PmemLog, sources: SourceFiles,
                 dedup: bool = True, cold: Optional["ColdStore"] = None,
                 prefetcher: Optional["Prefetcher"] = None,
                 io_limiter: Optional[trio.CapacityLimiter] = None) -> None:
        self.index = index
        self.log = plog
        self.dedup = dedup
        self.io_limiter = io_limiter or trio.CapacityLimiter(4)
        self.reclaimer = Reclaimer(index, plog, sources)
        self.stager = WriteStager(index, plog, dedup, self.io_limiter)
        self.reader = ChunkReader(index, plog, sources, self.reclaimer, self.io_limiter,
                                  cold=cold, prefetcher=prefetcher)
        self.dirty_files: dict[int, DirtyFile] = {}     # ino -> its uncommitted changes
        self.bytes_written = 0
        self._log_full_warned_at = -1e9

    @property
    def dedup_hits(self) -> int:
        return self.stager.dedup_hits

    @property
    def dedup_bytes(self) -> int:
        return self.stager.dedup_bytes

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    # ------------------------------------------------------ open files' changes

    def dirty_file(self, ino: int, size: Union[int, Callable[[], int]]) -> DirtyFile:
        """ino's uncommitted changes, made (with size, or size()) if it has none."""
        df = self.dirty_files.get(ino)
        if df is None:
            self.reader.changing(ino)
            df = self.dirty_files[ino] = DirtyFile(
                ino, size() if callable(size) else size, self.log.release,
                self._first_ref, self._last_ref)
        return df

    def _first_ref(self, df: DirtyFile, chunk_no: int) -> None:
        if chunk_no > 0 and chunk_no not in df.new_chunks:
            self.reclaimer.pin(chunk_no)      # a stored chunk: keep its bytes for us

    def _last_ref(self, df: DirtyFile, chunk_no: int) -> None:
        if chunk_no < 0:
            staged = df.staged.get(chunk_no)
            if staged is not None:
                self.stager.retire_if_unused(df, staged)
            return
        chunk = df.new_chunks.pop(chunk_no, None)
        if chunk is None:
            self.reclaimer.unpin(chunk_no)
            return
        if chunk.chunk_id:
            df.pending_ids.pop(chunk.chunk_id, None)
        # Never committed, so no durable index names this space. A chunk with
        # an id was cut from bytes already stored; one without may still be
        # being written (dedup off).
        df.give_back(chunk.log_off, chunk.length, written=bool(chunk.chunk_id))

    def forget(self, ino: int) -> None:
        """The kernel forgot ino (its read-ahead position goes)."""
        self.reader.forget(ino)

    async def quiesced(self, ino: int) -> Optional[DirtyFile]:
        """ino's changes once no write or cut of it is in flight (None: it has none)."""
        while True:
            df = self.dirty_files.get(ino)
            if df is None or df.quiet:
                return df
            await df.quiesce()

    def settled(self, ino: int) -> bool:
        """Nothing of ino to commit and no write or cut of it in flight."""
        df = self.dirty_files.get(ino)
        return df is None or (df.quiet and not df.has_changes)

    def open_attrs(self, ino: int) -> Optional[tuple[int, Optional[int], Optional[int]]]:
        """(size, mtime_ns, ctime_ns) of an open file's changes; times None if unchanged."""
        df = self.dirty_files.get(ino)
        if df is None:
            return None
        return df.size, df.mtime_ns, df.ctime_ns

    def open_inos(self) -> set[int]:
        """Files with uncommitted changes."""
        return set(self.dirty_files)

    def truncate_open(self, ino: int, size: int, now_ns: int, committed_size: int) -> None:
        """Truncate an open file (O_TRUNC, ftruncate): the truncation commits with
        its other changes, atomically. committed_size: its size if it has none."""
        df = self.dirty_file(ino, committed_size)
        self.truncate_dirty(df, size)
        df.touch(now_ns)

    def truncate_dirty(self, df: DirtyFile, size: int) -> None:
        if df.stream is not None and size < df.stream.next_off:
            self.stager.end_stream(df)
        df.overlay.cut(size, MAX_FILE_BYTES)
        if size < df.size:
            df.trunc_to = size if df.trunc_to is None else min(df.trunc_to, size)
        df.size = size

    def set_open_mtime(self, ino: int, mtime_ns: int) -> None:
        """utimens on a file whose changes carry a new mtime: the commit keeps this one."""
        df = self.dirty_files.get(ino)
        if df is not None and df.mtime_ns is not None:
            df.mtime_ns = mtime_ns

    def replay_log_redo(self) -> int:
        """Mount-time: write back to the log every chunk the index carries for it
        (`logredo`: small batches committed without persisting the log, which a
        crash may have lost), persist the log, then drop the records. A chunk is
        written only while its record still places it there (chunk numbers are
        never reused) and the bytes match its CRCs; anything else is space the
        index no longer names. Returns how many chunks were written. May block."""
        written: list[tuple[int, int]] = []
        damaged: list[str] = []
        seen = False
        for _, off, length, chunk_no, data in ix.scan_log_redo(self.index, damaged.append):
            seen = True
            try:
                chunk = ix.get_chunk(self.index, chunk_no)
            except CkptfsError:
                continue            # damaged: fsck names it
            if (chunk is None or chunk.kind != ix.CHUNK_LOG or chunk.log_off != off
                    or chunk.length != length or self.log.crcs_of(data) != chunk.crcs):
                continue
            self.log.write(off, data)
            written.append((off, length))
        for why in damaged:
            log.error("damaged index record: %s (the chunks it held read as the log has them)",
                      why)
        if written:
            self.log.persist(written)
        if seen or damaged:
            self.index.write_direct(ix.clear_log_redo)
        return len(written)

    def discard(self, ino: int) -> None:
        """Forget ino's uncommitted changes (file unlinked, a write lost, daemon giving up)."""
        df = self.dirty_files.pop(ino, None)
        if df is None:
            return
        df.retired = True
        self.stager.end_stream(df)
        df.overlay.cut(0, MAX_FILE_BYTES)

    def last_close(self, ino: int) -> None:
        """The file's last handle closed (after its commit): stop cutting it as it
        streams; forget its changes if none are left and no I/O is in flight."""
        df = self.dirty_files.get(ino)
        if df is not None and df.quiet:
            self.stager.end_stream(df)
            if not df.has_changes:
                del self.dirty_files[ino]
                df.retired = True

    # ---------------------------------------------------------------- writes

    async def write(self, ino: int, off: int, data: bytes, size: Callable[[], int],
                    clock: Callable[[], int], make_room: Optional[MakeRoom] = None) -> None:
        """Write data at off into ino's changes (made with size() if it has
        none; clock() is the new mtime). When the log is full and make_room is
        given, wait for it (backpressure) and try once more.

        A write that fails marks the file: a file that lost a write must not
        commit half of its new content (`commit_error`)."""
        df = self.dirty_file(ino, size)
        waited = gave_back = False
        while True:
            try:
                async with df.writing():
                    try:
                        # Its commit will need index room: say ENOSPC now, as a full disk does.
                        self.index.check_room()
                        plan = self.stager.prepare_write(df, off, len(data))
                    except NoSpace as e:
                        if not isinstance(e, IndexFull) and not gave_back:
                            # Open files' unwritten reserves first (once a write).
                            gave_back = True
                            if self.stager.give_back_reserves(self.dirty_files.values()):
                                continue
                        if isinstance(e, IndexFull) or make_room is None or waited:
                            self._lost_write(df, e)
                            raise
                    except CkptfsError as e:
                        self._lost_write(df, e)
                        raise
                    else:
                        df.touch(clock())
                        if plan.stream is not None and len(data) > INLINE_BYTES:
                            # The stream's next writes may be answered in C
                            # (behind this one in the log and the feed's order);
                            # small ones stay fed inline, with no task.
                            self.stager.drop_rewrite_space(df)
                            self.stager.open_window(df)
                        await self.stager.store(df, plan, data)
                        self.bytes_written += len(data)
                        if plan.stream is not None and len(data) > INLINE_BYTES:
                            self.stager.open_window(df)     # the feed's backlog went down
                        elif plan.stream is None:
                            # A rewrite: the file's next ones may be answered in C.
                            self.stager.open_rewrite_window(df)
                        return
            except FileRetired:
                # A commit dropped the file's changes while this write waited for
                # it: start from the file's new state.
                if waited:
                    raise NoSpace("the file changed while waiting for log space") from None
                df = self.dirty_file(ino, size)
                continue
            # The log is full: wait while tiering moves cold data out.
            try:
                await make_room(len(data))
            except CkptfsError as e:
                self._lost_write(df, e)
                raise
            waited = True
            if self.dirty_files.get(ino) is not df:
                e = NoSpace("the file changed while waiting for log space")
                self._lost_write(df, e)
                raise e

    def fold_written(self, extents: list[tuple[int, int, int, int]],
                     clock: Callable[[], int]) -> None:
        """WRITEs the fast path answered in C, (ino, file offset, log offset,
        length) in the order answered, into their files' changes as `write`
        would have put them (clock() the new mtime); then their windows again.
        Never raises: a WRITE that cannot be folded (the window should have
        closed first) marks its file, whose commit then fails as after a
        lost write."""
        touched: dict[int, DirtyFile] = {}
        now_ns = clock()
        for ino, file_off, log_off, length in extents:
            df = self.dirty_files.get(ino)
            try:
                if df is None or not self.stager.fold_written(df, file_off, log_off, length):
                    raise CkptfsError(f"inode {ino}: a write answered in C at file offset "
                                      f"{file_off} is not where its stream is (internal error)")
            except Exception as e:        # noqa: BLE001 - called from C: must not raise
                log.error("%s", e)
                if df is not None:
                    if df.write_error is None:
                        df.write_error = e
                    self.stager.end_stream(df)
                continue
            df.touch(now_ns)
            self.bytes_written += length
            touched[ino] = df
        try:
            # Room and writability as a write checks them: else the next WRITE
            # goes to `write`, which says ENOSPC or EROFS.
            self.index.check_writable()
            self.index.check_room()
        except CkptfsError:
            for df in touched.values():
                self.stager.close_window(df)
            return
        for df in touched.values():
            self.stager.open_window(df)

    def _lost_write(self, df: DirtyFile, e: CkptfsError) -> None:
        df.write_error = e
        if isinstance(e, NoSpace) and not isinstance(e, IndexFull) \
                and time.monotonic() - self._log_full_warned_at > LOG_FULL_WARNING_S:
            self._log_full_warned_at = time.monotonic()
            log.warning("log full (%d of %d bytes free): writes fail with ENOSPC until "
                        "files are deleted", self.log.free_bytes, self.log.capacity_bytes)

    # ----------------------------------------------------------------- reads

    async def read(self, ino: int, off: int, size: int, file_size: Callable[[], int]
                   ) -> bytes | bytearray:
        """[off, off+size) of ino as it is now: committed bytes under its changes.
        file_size() is asked once no write of the file is in flight."""
        df = await self.quiesced(ino)
        return await self.reader.read(df, ino, off, size, file_size())

    # ---------------------------------------------------------------- commit

    def commit_error(self, df: DirtyFile) -> Optional[CkptfsError]:
        """Why df must not commit (a write of it was lost), if it must not; its
        changes are then discarded."""
        err = df.write_error
        if err is None:
            return None
        self.discard(df.ino)
        kind = NoSpace if isinstance(err, NoSpace) else DamagedData
        return kind(f"a write to inode {df.ino} failed ({err}); its changes since the last "
                    "commit are discarded")

    async def cut_for_commit(self, df: DirtyFile) -> bool:
        """Cut and store once every staged byte of df (dedup on); False if its
        changes were discarded meanwhile."""
        if self.dedup:
            await self.stager.cut_for_commit(df)
        return self.dirty_files.get(df.ino) is df

    def commit_file(self, df: DirtyFile, inode: ix.Inode, now_ns: int) -> ix.Inode:
        """Fold the overlay into the index's open batch.

        The caller quiesced df and cut every staged byte into chunks.
        """
        # A 2 GiB file's commit makes ~10 tracked objects per chunk, ~32 k
        # chunks, nearly all gone when it returns: the cyclic collector's young
        # collections in between (one per GC_YOUNG_OBJECTS, 2-7 ms each, the
        # writer waiting) would traverse what is about to die. Paused, its
        # next collection finds the few that are left.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._commit_file(df, inode, now_ns)
        finally:
            if was_enabled:
                gc.enable()

    def _commit_file(self, df: DirtyFile, inode: ix.Inode, now_ns: int) -> ix.Inode:
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
                self.reclaimer.add_refs(chunk_no, n)
        if df.trunc_to is not None:
            inode.data_bytes -= self._punch(df.ino, df.trunc_to, MAX_FILE_BYTES)
        # A new file or an O_TRUNC rewrite has nothing left to punch out.
        find = ix.ExtentFinder(self.index, df.ino)
        if find.any():
            inode.data_bytes -= self._punch_ranges(
                df.ino, [(e.file_off, e.end) for e in extents], find)
        new_extents = [e for e in extents if e.chunk_no != ZERO_CHUNK]   # holes read as zeros
        inode.data_bytes += sum(e.length for e in new_extents)
        # The overlay's extents never overlap, so none of them is punched by
        # another's punch: all of them go in at once, after.
        ix.put_extents(self.index, df.ino, new_extents)
        new_chunks = []
        take = df.new_chunks.pop
        for chunk_no, n in refs.items():
            chunk = take(chunk_no, None)
            if chunk is not None:
                chunk.refcount = n
                new_chunks.append(chunk)
        self.index.persist_chunks_before_commit(
            [(chunk.log_off, chunk.length, chunk.chunk_no) for chunk in new_chunks])
        ix.add_chunks(self.index, new_chunks)
        for chunk_no in pinned:
            self.reclaimer.unpin(chunk_no)
        inode.size = df.size
        if df.mtime_ns is not None:
            inode.mtime_ns = df.mtime_ns
            inode.ctime_ns = df.ctime_ns or now_ns
        ix.put_inode(self.index, inode)
        ov.hand_over()              # the index holds every reference now
        df.pending_ids.clear()
        df.trunc_to = None
        df.mtime_ns = df.ctime_ns = None
        self.stager.reopen_after_commit(df)
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
        find = ix.chunk_no_finder(self.index)    # one per commit: a big file has 16 per MiB
        # No chunk id was put since the oldest new chunk was looked up: none can
        # have a twin (a 2 GiB file's 32,768 lookups at its fsync, skipped).
        others_stored = df.ids_looked_up_at != self.index.chunk_ids_put
        for chunk_no, chunk in list(df.new_chunks.items()) if others_stored else ():
            if not chunk.chunk_id:
                continue
            stored_no = find(chunk.chunk_id)
            if stored_no is not None and stored_no != chunk_no:
                twins[chunk_no] = stored_no
                del df.new_chunks[chunk_no]
                self.stager.count_duplicate(chunk.length)
                df.give_back(chunk.log_off, chunk.length, written=True)
        # A zombie we point at lost its id entry when it was deleted; if the
        # same bytes were stored again since, use that chunk: storing the
        # zombie again would leave two chunks with one id.
        for chunk_no in list(df.overlay.refs):
            zombie = self.reclaimer.zombies.get(chunk_no)
            if zombie is not None and zombie.chunk_id:
                stored = ix.find_chunk(self.index, zombie.chunk_id)
                if stored is not None:
                    twins[chunk_no] = stored.chunk_no
        return twins

    # ------------------------------------------------------- committed maps

    def data_ranges(self, ino: int, size: int, start: int, max_ranges: int
                    ) -> tuple[list[tuple[int, int]], Optional[int]]:
        """Where [start, size) of a file holds data: merged [a, b) ranges, holes
        left out, at most max_ranges; and the offset to ask from next (None: no
        more). A file with uncommitted changes is data from start to its end
        (an overlay may fill holes: never call bytes a hole that may not be)."""
        df = self.dirty_files.get(ino)
        if df is not None and df.has_changes:
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
        return self._punch_ranges(ino, [(a, b)], ix.ExtentFinder(self.index, ino))

    def _punch_ranges(self, ino: int, ranges: list[tuple[int, int]],
                      find: ix.ExtentFinder) -> int:
        """Remove each [a, b) of ranges (in file order, not overlapping) from
        the committed map; return the bytes removed. find: made after the
        map's last change.

        Every extent under the ranges is looked up first, in the map as it
        is, then what is left of each (a head, a tail, pieces between ranges)
        replaces it in one step, and each chunk's references change once by
        the net count: a commit's 16 rewrites were 16 punches of a look-up, a
        delete, two puts and a refcount change each."""
        runs: list[list[int]] = []
        for a, b in ranges:
            if runs and runs[-1][1] == a:
                runs[-1][1] = b             # touching ranges: one run, one look-up
            else:
                runs.append([a, b])
        over = self._extents_over(ino, runs, find)
        if not over:
            return 0
        removed = 0
        left: list[Extent] = []
        deltas: Counter = Counter()
        ends = [b for _, b in runs]
        for e in sorted(over.values(), key=lambda e: e.file_off):
            pos, pieces = e.file_off, 0
            i = bisect_right(ends, e.file_off)          # the first run ending past e's start
            while i < len(runs) and runs[i][0] < e.end:
                a, b = runs[i]
                if a > pos:
                    left.append(Extent(pos, a - pos, e.chunk_no, e.chunk_off + (pos - e.file_off)))
                    pieces += 1
                removed += min(b, e.end) - max(a, e.file_off)
                pos = max(pos, b)
                i += 1
            if pos < e.end:
                left.append(Extent(pos, e.end - pos, e.chunk_no, e.chunk_off + (pos - e.file_off)))
                pieces += 1
            deltas[e.chunk_no] += pieces - 1
        ix.replace_extents(self.index, ino, over, left)
        self.reclaimer.add_refs_many(deltas)
        return removed

    def _extents_over(self, ino: int, runs: list[list[int]], find: ix.ExtentFinder
                      ) -> dict[int, Extent]:
        """The committed extents overlapping any run [a, b), by file offset. A
        small run (a rewrite) lies inside one extent or across the boundary of
        two touching ones: the extents holding a and b - 1 are then all there
        is (extents never overlap), two look-ups with no scan of the map."""
        over: dict[int, Extent] = {}
        last: Optional[Extent] = None
        for a, b in runs:
            if last is not None and last.file_off <= a and b <= last.end:
                continue                    # inside the extent the run before found
            if b - a <= SMALL_PUNCH_BYTES:
                first = find.at(a)
                if first is not None:
                    if first.end >= b:
                        over[first.file_off] = last = first
                        continue
                    end = find.at(b - 1)
                    if end is not None and end.file_off == first.end:
                        over[first.file_off] = first
                        over[end.file_off] = last = end
                        continue
            for e in ix.iter_extents(self.index, ino, a, b):
                over[e.file_off] = last = e
        return over
