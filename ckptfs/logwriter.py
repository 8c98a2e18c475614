"""The log's large writes on C threads, awaited from trio.

A stream WRITE's bytes (1 MiB, the kernel's writeback requests) go into the
log with pwrite(2) before the reply. On a Python worker thread
(`trio.to_thread`) that is two thread hand-overs per request, each taking
and giving back the GIL while the feed, the committer and the trio thread
want it too. Here the trio thread queues the pwrite for C threads
(`native.WriterThreads`, native/ckptfs_logwr.c) that never take the GIL, and
one task waits on their eventfd in trio's own epoll and wakes the writers
whose bytes are in. Only for a log on an ordinary file (a DAX log's stores
are memory copies, done as before).

`write` never blocks the trio thread; like `trio.to_thread.run_sync` it is
not abandoned when cancelled: the bytes it was handed are being copied and
must stay alive (and the log space unreused) until the copy ends.
"""

from __future__ import annotations

import itertools
import os
from typing import Optional

import trio

from . import native
from .pmemlog import PmemLog

WRITER_THREADS = 2    # the log file's inode lock serializes buffered writes anyway


class _Pending:
    __slots__ = ("left", "error", "done")

    def __init__(self) -> None:
        self.left = 0                    # pieces still being written
        self.error = 0                   # the first failed piece's errno
        self.done = trio.Event()


class LogWriter:
    """Writes byte ranges into a log on C threads; `write` awaits them."""

    def __init__(self, plog: PmemLog) -> None:
        self.log = plog
        self._threads: Optional[native.WriterThreads] = None
        self._tokens = itertools.count(1)
        self._waiting: dict[int, _Pending] = {}
        self._reaping = False

    async def write(self, data: bytes, pieces: list[tuple[int, int, int]]) -> None:
        """Write data[pos:pos+length] at log offset log_off for each (log_off,
        pos, length) piece, in parallel; OSError if any pwrite failed."""
        threads = self._threads or self._start()
        job = _Pending()
        for log_off, pos, length in pieces:
            token = next(self._tokens)
            try:
                threads.submit(self.log.fd, data, pos, length, log_off, token)
            except OSError as e:
                job.error = job.error or e.errno
                continue
            job.left += 1
            self._waiting[token] = job
        if job.left:
            if not self._reaping:
                self._reaping = True
                trio.lowlevel.spawn_system_task(self._reap, name="ckptfs log writer")
            with trio.CancelScope(shield=True):     # the copy runs on: wait for it
                await job.done.wait()
        await trio.lowlevel.checkpoint_if_cancelled()
        if job.error:
            raise OSError(job.error, f"log write: {os.strerror(job.error)}")

    def _start(self) -> native.WriterThreads:
        # Started on the first write, after the daemon has forked into its own.
        self._threads = native.WriterThreads(WRITER_THREADS)
        self.log.on_close(self._threads.close)
        return self._threads

    async def _reap(self) -> None:
        """Wake the writers whose pieces are all in; ends when none waits."""
        threads = self._threads
        try:
            while self._waiting:
                await trio.lowlevel.wait_readable(threads.fd)
                try:
                    os.read(threads.fd, 8)          # reset the count, then take the jobs
                except BlockingIOError:
                    pass
                for token, result in threads.reap():
                    job = self._waiting.pop(token)
                    if result < 0 and not job.error:
                        job.error = -result
                    job.left -= 1
                    if not job.left:
                        job.done.set()
        finally:
            self._reaping = False
