"""DirtyFile: an open file's uncommitted changes, and the gate its I/O passes.

The changes are what a commit folds into the file's committed map
(`files.FileData.commit_file`): the overlay of new extents
(`overlay.Overlay`), the chunks new in this file and their ids, the staged
records the overlay points into and the write stream cutting them
(`staging.py`), a truncation point, new times, and the first write that
failed.

The gate orders the file's I/O; nothing outside this class reads its counts:
- `async with df.writing()`: a write changes the overlay and copies its
  bytes. It waits while a commit cuts the file's staged bytes into chunks;
  the write is in flight until the block ends.
- `async with df.reading()`: a read of bytes the overlay names.
- `async with df.cutting()`: a commit cutting staged bytes into chunks; new
  writes wait meanwhile.
- `df.feed_begins()` / `df.feed_ends()`: a write stream's chunk feed runs
  behind the writes it was handed (staging.py): a write is answered once
  its bytes are in the log and the overlay, its chunks are cut after.
- `await df.quiesce()`: until no write is in flight, no feed runs behind
  the writes and no cut runs (reads and commits see every write that
  arrived before them, cut into chunks as far as its stream goes).
- `give_back(off, length, written)`: log space the file no longer needs,
  released now or, if a read or write of the file in flight may still touch
  it, once that I/O ends.

Entering the gate yields to other tasks only when it has to wait: writes that
arrive together keep their order. Runs on the trio thread.
"""

from __future__ import annotations

from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator, Optional

import trio

from .overlay import Overlay

if TYPE_CHECKING:
    from .index import Chunk
    from .staging import ChunkStream, StagedRecord

# The kernel's own limit for a FUSE file (MAX_LFS_FILESIZE): a write past it
# fails with EFBIG in write(2). A smaller limit here would fail only when the
# page is written back, after write(2) succeeded: the error would surface in
# close and in the next syncfs(2) of the whole filesystem, by any process.
MAX_FILE_BYTES = (1 << 63) - 1


class FileRetired(Exception):
    """The file's changes were dropped (committed away, discarded) while a
    write waited at the gate: look the file up again. Never leaves files.py."""


class DirtyFile:
    """An open file's uncommitted changes, overlaid on its committed map."""

    def __init__(self, ino: int, size: int, release_space: Callable[[int, int], None],
                 on_first_ref: Callable[["DirtyFile", int], None],
                 on_last_ref: Callable[["DirtyFile", int], None]) -> None:
        self.ino = ino
        self.size = size
        # The owner (FileData) learns when a chunk gains its first overlay
        # extent and loses its last one: pins, staged records, new chunks.
        self.overlay = Overlay(lambda no: on_first_ref(self, no),
                               lambda no: on_last_ref(self, no))
        self.new_chunks: dict[int, Chunk] = {}          # cut in this file, not committed
        self.pending_ids: dict[bytes, int] = {}         # their ids -> chunk no
        self.staged: dict[int, StagedRecord] = {}       # by (negative) staged no
        self.stream: Optional[ChunkStream] = None
        # Log space [next, end) the fast path writes rewrites into (staging.py's
        # rewrite window); the stager gives back what is left when it closes.
        self.rewrite_space: Optional[list[int]] = None
        self.trunc_to: Optional[int] = None     # committed bytes at and after this are gone
        self.mtime_ns: Optional[int] = None
        self.ctime_ns: Optional[int] = None
        self.write_error: Optional[BaseException] = None
        # `Index.chunk_ids_put` when the oldest of new_chunks was looked up by id
        self.ids_looked_up_at: Optional[int] = None
        self.retired = False                    # dropped from the open files' table
        self._release_space = release_space
        self._writes = 0                        # writes in flight
        self._reads = 0                         # reads in flight
        self._writes_done = trio.Event()
        self._writes_done.set()
        self._cut: Optional[trio.Event] = None  # set when the running cut ends
        self._feeds = 0                         # feeds running behind the writes
        self._fed: Optional[trio.Event] = None  # set when the last of them ends
        self._held: list[tuple[int, int]] = []  # space given back while I/O was in flight

    @property
    def has_changes(self) -> bool:
        """Anything for a commit to fold in: extents, a truncation, new times."""
        return bool(self.overlay) or self.trunc_to is not None or self.mtime_ns is not None

    @property
    def quiet(self) -> bool:
        """No write in flight, no feed behind the writes, no cut running."""
        return self._writes == 0 and self._cut is None and self._fed is None

    def touch(self, now_ns: int) -> None:
        """The file's content changed at now_ns (mtime and ctime at commit)."""
        self.mtime_ns = self.ctime_ns = now_ns

    # ------------------------------------------------------------------ the gate

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """A write in flight (waits while a commit cuts this file's chunks).
        FileRetired if the file's changes were dropped while it waited."""
        if self.retired:
            raise FileRetired(self.ino)
        while self._cut is not None:
            await self._cut.wait()
            if self.retired:
                raise FileRetired(self.ino)
        if self._writes == 0:
            self._writes_done = trio.Event()
        self._writes += 1
        try:
            yield
        finally:
            self._writes -= 1
            if self._writes == 0:
                self._io_ended()
                self._writes_done.set()

    @contextmanager
    def reading(self) -> Iterator[None]:
        """A read of bytes the overlay names: their log space stays put."""
        self._reads += 1
        try:
            yield
        finally:
            self._reads -= 1
            self._io_ended()

    @asynccontextmanager
    async def cutting(self) -> AsyncIterator[None]:
        """A commit cutting staged bytes into chunks: new writes wait."""
        done = self._cut = trio.Event()
        try:
            yield
        finally:
            self._cut = None
            done.set()

    def feed_begins(self) -> None:
        """A stream's feed starts running behind the writes (a stream that
        ended may still finish its last feed call while a new one starts)."""
        if self._feeds == 0:
            self._fed = trio.Event()
        self._feeds += 1

    def feed_ends(self) -> None:
        self._feeds -= 1
        if self._feeds == 0:
            done, self._fed = self._fed, None
            done.set()

    async def quiesce(self) -> None:
        """Wait until no write is in flight, no feed runs and no cut runs.
        Returns at once, without yielding, if none does."""
        while True:
            if self._writes:
                await self._writes_done.wait()
            elif self._fed is not None:
                await self._fed.wait()
            elif self._cut is not None:
                await self._cut.wait()
            else:
                return

    def give_back(self, off: int, length: int, written: bool) -> None:
        """Uncommitted log space the file no longer names, released once no
        I/O of the file can touch it. written=True: its bytes are in place (no
        write into them is pending), so only a read in flight holds it up."""
        if self._reads or (self._writes and not written):
            self._held.append((off, length))
        else:
            self._release_space(off, length)

    def _io_ended(self) -> None:
        if self._writes or self._reads:
            return
        for off, length in self._held:
            self._release_space(off, length)
        self._held.clear()
