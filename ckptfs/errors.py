"""The project's exceptions.

Inner layers raise these with context; only `fuse_ops` turns them into
`pyfuse3.FUSEError`, and only `cli` turns them into exit codes. Each class
carries the errno that the adapter answers with, so the mapping lives in one
place and reads like the POSIX rule it implements.
"""

from __future__ import annotations

import errno


class CkptfsError(Exception):
    """Base class: something went wrong inside ckptfs."""

    errno: int = errno.EIO


class NotFound(CkptfsError):
    errno = errno.ENOENT


class AlreadyExists(CkptfsError):
    errno = errno.EEXIST


class NotEmpty(CkptfsError):
    errno = errno.ENOTEMPTY


class NotADirectory(CkptfsError):
    errno = errno.ENOTDIR


class IsADirectory(CkptfsError):
    errno = errno.EISDIR


class NameTooLong(CkptfsError):
    errno = errno.ENAMETOOLONG


class InvalidArgument(CkptfsError):
    errno = errno.EINVAL


class NotPermitted(CkptfsError):
    errno = errno.EPERM


class StaleHandle(CkptfsError):
    """An inode the kernel still names is gone (ext4 answers ESTALE)."""

    errno = errno.ESTALE


class BadFileHandle(CkptfsError):
    errno = errno.EBADF


class NoXattr(CkptfsError):
    errno = errno.ENODATA


class ValueTooLarge(CkptfsError):
    errno = errno.E2BIG


class FileTooLarge(CkptfsError):
    errno = errno.EFBIG


class TooManyLinks(CkptfsError):
    errno = errno.EMLINK


class NoSpace(CkptfsError):
    """The persistent-memory log (or the index map) has no room left."""

    errno = errno.ENOSPC


class ReadOnly(CkptfsError):
    """The filesystem stopped accepting changes after an index failure."""

    errno = errno.EROFS


class DamagedData(CkptfsError):
    """Stored bytes failed their checksum: never hand them out."""

    errno = errno.EIO


class IndexFailure(CkptfsError):
    """An index transaction could not be made durable."""

    errno = errno.EIO


class FormatError(CkptfsError):
    """On-disk state (log superblock, index) is not what this version expects."""

    errno = errno.EIO


class UsageError(CkptfsError):
    """A user mistake on the command line: printed as one line, no traceback."""

    errno = errno.EINVAL


class NotSupported(CkptfsError):
    """An operation ckptfs does not implement (extended POSIX ACLs)."""

    errno = errno.EOPNOTSUPP
