"""The filesystem core: the calls `fuse_ops` makes, on top of the layers.

`Filesystem` ties namespace, file data, the log and the index together and
owns what only exists while mounted: open handles, kernel lookup counts, the
commit policy (sync=close / sync=lazy) and the worker-thread limiters. It
raises the project's exceptions; `fuse_ops` maps them to errno.

Runs on the trio thread and never blocks: file data (`files.FileData`)
offloads its byte work to worker threads under `io_limiter`; commits go
through the index's committer under `commit_limiter` (one LMDB write
transaction at a time). Core reaches an open file's changes only through
FileData's calls: it never reads or sets their fields.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import trio

from . import index as ix
from .errors import BadFileHandle, IndexFull, InvalidArgument, IsADirectory, ReadOnly
from .files import FileData
from .index import Index, Inode
from .namespace import Namespace
from .pmemlog import SUPERBLOCK_BYTES, PmemLog
from .sources import SourceFiles

if TYPE_CHECKING:
    from .tier import Tierer
    from .tierplan import TierSetup

log = logging.getLogger(__name__)

# What creating a name may add to the index: inode, entry, listing entry.
NODE_GROWTH_BYTES = 4 * ix.GROWTH_PER_RECORD_BYTES


@dataclass
class CommitPolicy:
    sync: str = "close"             # "close" | "lazy"
    lazy_max_delay_s: float = 1.0   # lazy: close waits only if commits lag this much

    @property
    def idle_commit_delay_s(self) -> float:
        """How long changes nobody waits for may gather before they are committed.

        Bounds how long a rename or mkdir takes to become durable without an
        fsync; a waiting close or fsync always commits at once.
        """
        return 0.05 if self.sync == "close" else self.lazy_max_delay_s / 2

    def __post_init__(self) -> None:
        if self.sync not in ("close", "lazy"):
            raise InvalidArgument(f"sync must be 'close' or 'lazy', not {self.sync!r}")


@dataclass
class Handle:
    ino: int
    flags: int


@dataclass
class Attrs:
    """What the adapter needs to answer getattr: inode plus open-file overrides."""

    inode: Inode
    size: int
    mtime_ns: int
    ctime_ns: int
    data_bytes: int     # bytes that hold data (holes excluded): st_blocks
    cache_timeout_s: Optional[float] = None     # None: the adapter's long default (merged.py)


class Filesystem:
    def __init__(self, index: Index, plog: PmemLog, sources: SourceFiles,
                 policy: CommitPolicy, dedup: bool = True,
                 tiering: Optional["TierSetup"] = None) -> None:
        """tiering: the backing store to tier to (None: no tiering, no cold reads)."""
        self.index = index
        self.log = plog
        self.ns = Namespace(index)
        self.io_limiter = trio.CapacityLimiter(4)
        cold = prefetcher = None
        if tiering is not None:
            # Compression libraries only when tiering.
            from .coldstore import ColdStore, Prefetcher
            cold = ColdStore(tiering.backend, tiering.policy.cache_bytes)
            prefetcher = Prefetcher(cold, tiering.policy.prefetch_bytes)
        self.files = FileData(index, plog, sources, dedup=dedup, cold=cold,
                              prefetcher=prefetcher, io_limiter=self.io_limiter)
        self.policy = policy
        self.handles: dict[int, Handle] = {}
        self.open_count: dict[int, int] = {}
        self.lookups: dict[int, int] = {}
        self._next_fh = 1
        # A FLUSH that left its file settled tells this (watch_flushed), and
        # the RELEASE that follows is answered outside Python (fold_released).
        self._flushed_settled: Optional[Callable[[int, int], None]] = None
        # Handles released outside Python whose file changed after all: the
        # whole release, on serve_owed_releases' task.
        self._owed_releases: list[int] = []
        self._owed = trio.Event()
        self.commit_limiter = trio.CapacityLimiter(1)
        self.started_at = time.time()
        self.errors_by_kind: dict[str, int] = {}
        self.tierer: Optional["Tierer"] = None
        if tiering is not None:
            from . import tier
            self.tierer = tier.Tierer(index, plog, self.files.reclaimer, self._hot_inos,
                                      tiering, cold, prefetcher)

    def _hot_inos(self) -> set[int]:
        """Files tiering leaves alone: open, or with uncommitted changes."""
        return set(self.open_count) | self.files.open_inos()

    # ------------------------------------------------------------- lifecycle

    def recover(self) -> int:
        """Mount-time recovery: free space from the index, purge orphans.

        Reads the index only (no log scan): uncommitted log bytes are free
        space by definition. Log bytes the index carries for the log (small
        batches, `logredo`) are written back to it first. Returns how many
        orphans were purged. May block.
        """
        replayed = self.files.replay_log_redo()
        if replayed:
            log.info("wrote back %d log records the index held for the log", replayed)
        damaged: list[str] = []
        self.log.init_free_space(ix.used_log_space(self.index, SUPERBLOCK_BYTES,
                                                   self.log.size_bytes, damaged))
        for why in damaged:
            log.error("damaged index record: %s (its reads give EIO; run ckptfs fsck)", why)
        orphans = self.ns.orphans()
        for ino in orphans:
            self._purge(ino)
        if not self.index.was_clean():
            log.warning("index was not cleanly unmounted: recovered to the last durable "
                        "commit, purged %d orphaned inodes", len(orphans))
        self.index.set_clean(False)
        return len(orphans)

    async def run_committer(self) -> None:
        # On DAX a persist is a few cache-line flushes: no flush to save.
        await self.index.run_committer(self.log.persist, self.commit_limiter,
                                       idle_delay_s=self.policy.idle_commit_delay_s,
                                       read_log=None if self.log.dax else self.log.read_raw)

    async def shutdown(self) -> None:
        """Commit what was closed, purge orphans, mark clean. Committer keeps running."""
        await self._release_owed()
        for ino in list(self.files.dirty_files):
            try:
                if self.open_count.get(ino):
                    # Still open: the daemon is being stopped under its writer (a
                    # signal). Never closed nor fsync'ed, so as after a crash it
                    # keeps its last committed content.
                    await self.files.quiesced(ino)
                    self.files.discard(ino)
                    continue
                await self._commit(ino)
            except Exception as e:  # keep going: the rest still deserves a commit
                log.error("final commit of inode %d failed: %s", ino, e)
        self.handles.clear()
        self.open_count.clear()
        self.lookups.clear()
        try:
            for ino in self.ns.orphans():
                self._purge(ino)
            self.index.set_clean(True)
        except ReadOnly as e:
            if self.index.fenced is None and self.index.failure is None:
                raise
            # Fenced (another node holds the volume) or failed (the index took
            # no more changes): nothing more is written; the next mount
            # purges orphans as after a crash.
            log.warning("unmounting read-only (%s): orphans left for the next mount", e)
        try:
            await self.index.wait_durable(self.index.current_seq())
        except IndexFull as e:
            # The committer keeps trying a while after stop(); what it cannot
            # commit is lost as in a crash (the index stays marked unclean).
            log.error("unmounting while the index has no room (%s): the last changes "
                      "may not be durable", e)

    @staticmethod
    def now_ns() -> int:
        return time.time_ns()

    # ------------------------------------------------------------ attributes

    def attrs(self, ino: int) -> Attrs:
        inode = self.ns.get(ino)
        changed = self.files.open_attrs(ino)
        if changed is None:
            return Attrs(inode, inode.size, inode.mtime_ns, inode.ctime_ns, inode.data_bytes)
        size, mtime_ns, ctime_ns = changed
        # Until commit, count the whole new size as data: du may overstate holes.
        return Attrs(inode, size, mtime_ns or inode.mtime_ns, ctime_ns or inode.ctime_ns, size)

    def watch_attrs(self, changed: Callable[[int], None]) -> None:
        """changed(ino) as each change of an inode's record (or its extents)
        is made, on the trio thread, before any other request can see it:
        a cache of attributes outside Python (the adapter's, for the fast
        path) drops what changed."""
        self.index.watch_maps(changed)

    def lookup(self, parent: int, name: bytes) -> Attrs:
        inode = self.ns.lookup(parent, name)
        self.count_lookup(inode.ino)
        return self.attrs(inode.ino)

    def count_lookup(self, ino: int) -> None:
        """The kernel now holds one more reference to ino (until forget)."""
        self.lookups[ino] = self.lookups.get(ino, 0) + 1

    def forget(self, ino: int, nlookup: int) -> None:
        left = self.lookups.get(ino, 0) - nlookup
        if left > 0:
            self.lookups[ino] = left
            return
        self.lookups.pop(ino, None)
        self.files.forget(ino)
        self._maybe_purge(ino)

    def setattr(self, ino: int, *, mode: Optional[int] = None, uid: Optional[int] = None,
                gid: Optional[int] = None, size: Optional[int] = None,
                atime_ns: Optional[int] = None, mtime_ns: Optional[int] = None,
                ctime_ns: Optional[int] = None) -> Attrs:
        now = self.now_ns()
        inode = self.ns.get(ino)
        if size is not None:
            if stat.S_ISDIR(inode.mode):
                raise IsADirectory("truncate of a directory")
            if not stat.S_ISREG(inode.mode):
                raise InvalidArgument("truncate of a special file")
            if self.open_count.get(ino) or self.files.open_attrs(ino) is not None:
                # An open file's truncate commits with its data, atomically.
                self.files.truncate_open(ino, size, now, inode.size)
            else:
                self.files.truncate_committed(inode, size)
                inode.mtime_ns = inode.ctime_ns = now
        if mode is not None:
            inode.mode = stat.S_IFMT(inode.mode) | (mode & 0o7777)
        if uid is not None:
            inode.uid = uid
        if gid is not None:
            inode.gid = gid
        if atime_ns is not None:
            inode.atime_ns = atime_ns
        if mtime_ns is not None:
            inode.mtime_ns = mtime_ns
            self.files.set_open_mtime(ino, mtime_ns)
        inode.ctime_ns = ctime_ns if ctime_ns is not None else now
        self.ns.put(inode)
        return self.attrs(ino)

    def kill_privs(self, ino: int) -> None:
        """What a write, truncate or chown by a caller without CAP_FSETID does
        to a regular file on Linux: set-user-ID goes, set-group-ID too when
        the group may execute. The kernel leaves it to the file system when
        the mount handles FUSE_HANDLE_KILLPRIV_V2 (fastpath.kill_asked)."""
        inode = self.ns.get(ino)
        mode = inode.mode & ~stat.S_ISUID
        if mode & stat.S_IXGRP:
            mode &= ~stat.S_ISGID
        if mode != inode.mode and stat.S_ISREG(inode.mode):
            inode.mode = mode
            inode.ctime_ns = self.now_ns()
            self.ns.put(inode)

    # -------------------------------------------------------------- creating

    def make_node(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                  rdev: int = 0, target: Optional[bytes] = None) -> Attrs:
        growth = NODE_GROWTH_BYTES + len(name) + len(target or b"")
        self.index.check_room()             # counted once it exists (EEXIST costs nothing)
        inode = self.ns.create(parent, name, mode, uid, gid, self.now_ns(), rdev=rdev,
                               target=target)
        self.index.promise(growth)
        self.count_lookup(inode.ino)
        return self.attrs(inode.ino)

    def link(self, ino: int, parent: int, name: bytes) -> Attrs:
        self.index.check_room()
        inode = self.ns.link(ino, parent, name, self.now_ns())
        self.index.promise(NODE_GROWTH_BYTES + len(name))
        self.count_lookup(inode.ino)
        return self.attrs(ino)

    def unlink(self, parent: int, name: bytes) -> None:
        inode = self.ns.unlink(parent, name, self.now_ns())
        if inode.nlink == 0:
            self._maybe_purge(inode.ino)

    def rmdir(self, parent: int, name: bytes) -> None:
        inode = self.ns.rmdir(parent, name, self.now_ns())
        self._maybe_purge(inode.ino)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int) -> None:
        replaced = self.ns.rename(old_parent, old_name, new_parent, new_name, flags,
                                  self.now_ns())
        if replaced is not None and replaced.nlink == 0:
            self._maybe_purge(replaced.ino)

    def _maybe_purge(self, ino: int) -> None:
        if self.lookups.get(ino) or self.open_count.get(ino):
            return
        inode = ix.get_inode(self.index, ino)
        if inode is not None and inode.nlink == 0:
            self._purge(ino)

    def _purge(self, ino: int) -> None:
        self.files.discard(ino)
        self.files.remove_all(ino)
        self.ns.delete_inode(ino)

    # ----------------------------------------------------------- open files

    def open(self, ino: int, flags: int) -> int:
        inode = self.ns.get(ino)
        if stat.S_ISDIR(inode.mode):
            raise IsADirectory("open of a directory for I/O")
        if flags & os.O_TRUNC and (flags & os.O_ACCMODE) != os.O_RDONLY:
            self.files.truncate_open(ino, 0, self.now_ns(), inode.size)
        return self._new_handle(ino, flags)

    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int
               ) -> tuple[int, Attrs]:
        attrs = self.make_node(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid)
        return self._new_handle(attrs.inode.ino, flags), attrs

    def _new_handle(self, ino: int, flags: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(ino, flags)
        self.open_count[ino] = self.open_count.get(ino, 0) + 1
        return fh

    def handle(self, fh: int) -> Handle:
        h = self.handles.get(fh)
        if h is None:
            raise BadFileHandle(f"unknown file handle {fh}")
        return h

    async def write(self, fh: int, off: int, data: bytes) -> int:
        self.index.check_writable()
        ino = self.handle(fh).ino
        # Backpressure: a write that finds the log full waits while tiering
        # moves cold data out.
        await self.files.write(ino, off, data, size=lambda: self.ns.get(ino).size,
                               clock=self.now_ns,
                               make_room=None if self.tierer is None else self.tierer.make_room)
        return len(data)

    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray:
        ino = self.handle(fh).ino
        return await self.files.read(ino, off, size, lambda: self.attrs(ino).size)

    async def _commit(self, ino: int) -> int:
        """Put the file's changes in the open batch; return the batch to wait for."""
        df = await self.files.quiesced(ino)
        if df is None or not df.has_changes:
            return 0        # nothing of this file to wait for
        lost = self.files.commit_error(df)
        if lost is not None:
            raise lost
        inode = self.ns.get(ino)
        if inode.nlink == 0:
            # Unlinked: nothing to commit (an orphan never comes back), but open
            # handles still read and write these bytes; `_purge` drops them.
            return self.index.current_seq()
        if self.files.dedup:
            if not await self.files.cut_for_commit(df):
                return await self._commit(ino)      # discarded while cutting: look again
            inode = self.ns.get(ino)
            if inode.nlink == 0:
                return self.index.current_seq()     # unlinked while cutting
        growth = self.files.commit_growth_bytes(df)
        try:
            if growth:
                self.index.admit(growth)
        except IndexFull:
            # No room to commit it: the file keeps its last committed content.
            self.files.discard(ino)
            raise
        self.files.commit_file(df, inode, self.now_ns())
        return self.index.current_seq()

    async def flush(self, fh: int) -> None:
        ino = self.handle(fh).ino
        seq = await self._commit(ino)
        await self._wait_per_policy(seq)
        if self._flushed_settled is not None and self.files.settled(ino):
            # Its RELEASE has nothing to commit: only the handle's bookkeeping.
            self._flushed_settled(fh, ino)

    async def fsync(self, fh: int) -> None:
        await self._commit(self.handle(fh).ino)
        # Everything so far, not just this commit: an earlier sync=lazy close of
        # this file, or the create that named it, may not be durable yet.
        await self.index.wait_durable(self.index.current_seq())

    async def sync_all(self) -> None:
        """fsyncdir and `ckptfs sync`: every change made so far durable.

        Files still open keep their uncommitted bytes out of it: committing
        them here would publish half-written checkpoints.
        """
        await self.index.wait_durable(self.index.current_seq())

    async def _wait_per_policy(self, seq: int) -> None:
        if self.policy.sync == "close" or self.index.pending_age_s() > self.policy.lazy_max_delay_s:
            await self.index.wait_durable(seq)

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            raise BadFileHandle(f"unknown file handle {fh}")
        left = self.open_count.get(h.ino, 1) - 1
        try:
            if left == 0:
                seq = await self._commit(h.ino)
                self.files.last_close(h.ino)
                await self._wait_per_policy(seq)
        finally:
            # Count again: an open of the same inode may have arrived during the awaits.
            left = self.open_count.get(h.ino, 1) - 1
            if left > 0:
                self.open_count[h.ino] = left
            else:
                self.open_count.pop(h.ino, None)
                self._maybe_purge(h.ino)

    def watch_flushed(self, settled: Callable[[int, int], None]) -> None:
        """settled(fh, ino) as a FLUSH of handle fh returns that left its file
        with nothing to commit and nothing in flight (on the trio thread,
        before the FLUSH is answered): its RELEASE, if nothing about the
        file comes before it, may be answered outside Python and given to
        `fold_released`."""
        self._flushed_settled = settled

    def fold_released(self, fhs: list[int]) -> None:
        """Handles whose RELEASE was answered outside Python (watch_flushed):
        what `release` does for a file with nothing to commit, at once (the
        handle, the open count, the last close's end of the stream, an
        unlinked file's purge). A last close whose file has changes or I/O
        after all (not expected: any request about the file since its FLUSH
        keeps its RELEASE in Python) is given the whole `release` on
        serve_owed_releases' task. Never blocks, never raises for a handle."""
        for fh in fhs:
            h = self.handles.get(fh)
            if h is None:
                log.error("a RELEASE answered in C names no open handle (%d)", fh)
                continue
            left = self.open_count.get(h.ino, 1) - 1
            if left <= 0 and not self.files.settled(h.ino):
                self._owed_releases.append(fh)
                self._owed.set()
                continue
            del self.handles[fh]
            if left > 0:
                self.open_count[h.ino] = left
                continue
            self.open_count.pop(h.ino, None)
            try:
                self.files.last_close(h.ino)
                self._maybe_purge(h.ino)
            except Exception:  # noqa: BLE001 - a fold must not raise; release would say EIO
                log.exception("release of inode %d (answered in C) failed", h.ino)

    async def serve_owed_releases(self) -> None:
        """The whole `release` of handles `fold_released` could not finish."""
        while True:
            await self._owed.wait()
            await self._release_owed()

    async def _release_owed(self) -> None:
        self._owed = trio.Event()
        owed, self._owed_releases = self._owed_releases, []
        for fh in owed:
            try:
                await self.release(fh)
            except Exception:  # noqa: BLE001 - its RELEASE is answered: nobody to tell
                log.exception("release of handle %d (answered in C) failed", fh)

    def data_ranges(self, ino: int, start: int, max_ranges: int) -> dict[str, object]:
        """Where a regular file holds data (for `ckptfs export`, which cannot ask
        with SEEK_DATA through FUSE): {"size", "ranges": [[a, b], ...], "next"}."""
        attrs = self.attrs(ino)
        if not stat.S_ISREG(attrs.inode.mode):
            raise InvalidArgument(f"inode {ino} is not a regular file")
        ranges, next_off = self.files.data_ranges(ino, attrs.size, start, max_ranges)
        return {"size": attrs.size, "ranges": [list(r) for r in ranges], "next": next_off}

    # ----------------------------------------------------------------- misc

    def statfs(self) -> dict[str, int]:
        # fstatvfs: the log's path may lie below this very mount (SOURCE/.ckptfs);
        # a path lookup from the daemon would wait for itself.
        disk = os.fstatvfs(self.log.fd)
        return {
            "bsize": 4096,
            "blocks": (self.log.capacity_bytes + disk.f_blocks * disk.f_frsize) // 4096,
            "bfree": (self.log.free_bytes + disk.f_bfree * disk.f_frsize) // 4096,
            "bavail": (self.log.free_bytes + disk.f_bavail * disk.f_frsize) // 4096,
            "files": 1 << 32,
            "ffree": (1 << 32) - self.index.counters[b"next_ino"],
        }

    def stats(self) -> dict[str, object]:
        """The numbers `ckptfs stat` shows: counters kept by the index, no scan."""
        counters = self.index.counters
        files, logical = counters[b"files"], counters[b"file_bytes"]
        source = counters[b"stored_source_bytes"]
        cold = counters[b"stored_pack_bytes"]
        stored = counters[b"stored_log_bytes"] + source + cold
        cold_logical = counters[b"pack_logical_bytes"]
        chunks = counters[b"chunks"]
        hot = self.log.capacity_bytes - self.log.free_bytes
        return {
            "version": 1,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 1),
            "sync": self.policy.sync,
            "files": files,
            "logical_bytes": logical,
            "stored_bytes": stored,
            "hot_bytes": hot,
            "pmem_size": self.log.size_bytes,
            "pmem_free_bytes": self.log.free_bytes,
            "pmem_dax": self.log.dax,
            "source_bytes": source,
            "cold_bytes": cold,
            "cold_logical_bytes": cold_logical,
            "compression_ratio": round(cold_logical / cold, 4) if cold else 1.0,
            "chunks": chunks,
            "dedup": self.files.dedup,
            "dedup_ratio": round(logical / stored, 4) if stored else 1.0,
            "dedup_hits": self.files.dedup_hits,
            "dedup_saved_bytes": self.files.dedup_bytes,
            "open_files": len(self.open_count),
            "dirty_files": len(self.files.dirty_files),
            "commits": self.index.commits,
            "commit_seconds_avg": (round(self.index.commit_seconds_total / self.index.commits, 6)
                                   if self.index.commits else 0.0),
            "bytes_written": self.files.bytes_written,
            "bytes_read": self.files.bytes_read,
            "read_window_loads": self.files.reader.window_loads,
            "read_windows_ahead": self.files.reader.windows_ahead,
            "errors": dict(self.errors_by_kind),
            "read_only": self.index.failure is not None or self.index.fenced is not None,
            "last_error": (str(self.index.failure) if self.index.failure
                           else self.index.fenced),
            **self.index.stats(),
            **(self.tierer.stats() if self.tierer is not None else {"tiering": False}),
        }
