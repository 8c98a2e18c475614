"""The files that were in SOURCE before it was mounted over (adopt.py names
them as SOURCE chunks): read in place, deleted when their last reference goes.

Reached only beneath the SOURCE directory fd opened before the mount, with no
symlink at any component (`native.open_beneath`), and used only if still the
file adopted (device and inode); anything else is refused (EIO for that
file), logged once, never read and never deleted. Thread-safe. Every method
may block (small file system calls, reads): reads run on worker threads,
`identify` before the mount, `remove` on the trio thread once the batch that
dropped a file's last reference is durable.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections import Counter
from typing import Optional

from . import index as ix
from . import native
from .errors import DamagedData, SourceRefused
from .index import Chunk

log = logging.getLogger(__name__)


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
