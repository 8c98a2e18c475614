"""FdRootBackend: a LocalBackend whose root is a directory fd opened before the mount.

The default store lies below the mount (SOURCE/.ckptfs/store): once mounted,
its path would lead through the mounting daemon itself. A directory fd opened
before the mount still reaches the real directory (/proc/self/fd/N jumps
straight to it), so the daemon's store is this backend. It behaves as a
LocalBackend in every way the conformance suite (tests/store/test_backing.py)
checks, and it shows the path it was opened as in its url.
"""

from __future__ import annotations

import os
from typing import Optional

from .base import UuidLike
from .local import LocalBackend


class FdRootBackend(LocalBackend):
    """A LocalBackend whose root is a directory fd; closing the backend closes the fd."""

    def __init__(self, fd: int, shown_as: str, store_uuid: Optional[UuidLike] = None,
                 **kw) -> None:
        super().__init__(f"/proc/self/fd/{fd}", store_uuid, **kw)
        self.shown_as = os.path.abspath(shown_as)
        self.url = "file://" + self.shown_as
        self._root_fd = fd

    @classmethod
    def open_dir(cls, path: str, store_uuid: Optional[UuidLike] = None,
                 **kw) -> "FdRootBackend":
        """A backend on the directory at path as it is now (OSError if there is none).
        No other I/O: call `check` to find out whether the store is in it."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return cls(fd, path, store_uuid, **kw)

    def close(self) -> None:
        super().close()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1
