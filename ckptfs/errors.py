"""The project's exceptions.

Inner layers raise these with context; only `fuse_ops` turns them into
`pyfuse3.FUSEError`, and only `cli` turns them into exit codes. Each class
carries the errno that the adapter answers with, so the mapping lives in one
place and reads like the POSIX rule it implements. `ExitCode` is every
command's exit status (the README's table): the commands (`cli`, `daemon`,
`fsck`, `recover`, `export`) return its members, never bare numbers.
"""

from __future__ import annotations

import enum
import errno
import re


class ExitCode(enum.IntEnum):
    OK = 0                   # also: fsck found nothing wrong, recover restored everything
    FAILED = 1               # the operation could not be done (one line on stderr says why)
    USAGE = 2                # bad command line or options
    REPAIRED = 3             # fsck found problems and repaired all of them
    UNCORRECTED = 4          # fsck: problems left (or not repairable); recover: some left out


class CkptfsError(Exception):
    """Base class: something went wrong inside ckptfs."""

    errno: int = errno.EIO
    logged: bool = False        # already logged where it was found: the edge stays quiet


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


class NoXattrSpace(CkptfsError):
    """An inode's xattrs would exceed their limit (ext4 says ENOSPC when its
    xattr space is full)."""

    errno = errno.ENOSPC


class FileTooLarge(CkptfsError):
    errno = errno.EFBIG


class TooManyLinks(CkptfsError):
    errno = errno.EMLINK


class NoSpace(CkptfsError):
    """The persistent-memory log (or the index map) has no room left."""

    errno = errno.ENOSPC


class IndexFull(NoSpace):
    """The filesystem holding the index has no room for this change. Changes
    that free index space (unlink, rmdir, truncate) still go through."""


class ReadOnly(CkptfsError):
    """The filesystem stopped accepting changes after an index failure."""

    errno = errno.EROFS


class NameReplaced(CkptfsError):
    """The name opened now leads to another file (the peer view: an own file
    made to replace a peer's at open with O_TRUNC). ESTALE: the kernel looks
    the name up again, once, and opens what it leads to now."""

    errno = errno.ESTALE


class DamagedData(CkptfsError):
    """Stored bytes failed their checksum: never hand them out."""

    errno = errno.EIO


class SourceRefused(DamagedData):
    """A pre-existing file below SOURCE is not reached safely or is not the file
    adopted: never read nor deleted. Logged once where it is found."""

    errno = errno.EIO
    logged = True


class IndexFailure(CkptfsError):
    """An index transaction could not be made durable."""

    errno = errno.EIO


class FormatError(CkptfsError):
    """On-disk state (log superblock, index) is not what this version expects."""

    errno = errno.EIO


class UsageError(CkptfsError):
    """A bad command line or mount option (unknown flag, bad value): one line,
    no traceback, exit code 2. Only for what the command line itself gets
    wrong; a well-formed command that cannot be done is an OperationFailed."""

    errno = errno.EINVAL


class OperationFailed(CkptfsError):
    """A well-formed command that cannot be carried out as things stand:
    already mounted, not mounted, no daemon answers, SOURCE is not a
    directory. One line that says what to do, exit code 1."""

    errno = errno.EINVAL


class NotSupported(CkptfsError):
    """An operation ckptfs does not implement (extended POSIX ACLs)."""

    errno = errno.EOPNOTSUPP


class BackingError(CkptfsError):
    """The backing store (where cold chunks go) failed; the subclasses say how.

    Messages name the store (its url) and the blob. Reads of data that the
    index names answer EIO whichever subclass is raised (the caller maps).
    """

    errno = errno.EIO


class BackingUnavailable(BackingError):
    """The backing store cannot be reached: its directory is missing or
    unmounted, its marker is gone or names another store, the server does not
    answer. EIO rather than ENOTCONN: applications see a failed read, not a
    dead mount."""

    errno = errno.EIO


class BackingCredentials(BackingUnavailable):
    """The backing store refused our credentials, or none were found (an S3
    store: no keys in the environment, the shared files or the profile;
    unknown key, bad secret, expired token). Not a passing outage: a mount
    that meets it fails with one line."""

    errno = errno.EIO


class BackingFull(BackingError):
    """The backing store has no room (ENOSPC, quota)."""

    errno = errno.ENOSPC


class BackingReadOnly(BackingError):
    """The backing store refuses writes (read-only mount, no permission)."""

    errno = errno.EROFS


class BlobMissing(BackingError):
    """A blob is not in the backing store (the store itself is there)."""

    errno = errno.ENOENT


class BlobDamaged(BackingError):
    """A blob's bytes are not what they should be: a checksum or layout check
    failed, or it is shorter than the range asked for."""

    errno = errno.EIO



class StoreAhead(BackingError):
    """The store holds a snapshot head of this filesystem numbered at or above
    the one this index would publish next: the index is older than the store
    (restored from a copy). Nothing is published, and nothing a newer head
    may name is deleted, until `ckptfs fsck --repair` raises the counter."""

    errno = errno.EIO


class VolumeInUse(OperationFailed):
    """A mount or takeover of a volume another filesystem holds (its lease is
    in the store), or that moved on since this one was recovered from it."""


class Fenced(CkptfsError):
    """This filesystem lost its volume: another node took it over (a lease of
    a newer generation is in the store). It publishes nothing more and is
    read-only from then on."""

    errno = errno.EROFS


_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def one_line(text: str) -> str:
    """A message as the one line it must be on stderr: control characters (a
    newline or tab in a path) are written as escapes (\\n, \\t, \\x01)."""
    return _CONTROL_CHARS.sub(lambda m: m.group().encode("unicode_escape").decode(), text)
