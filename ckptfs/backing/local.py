"""LocalBackend: blobs as files under a directory (local disk, NFS, Lustre).

Layout under the root directory:

    ckptfs-store            the marker: one line of JSON,
                            {"format": "ckptfs-store", "version": 1, "uuid": "<store uuid>"}
    <name>                  each committed blob, e.g. packs/ab/<hex>.pack
    <dir>/.<base>.tmp-<hex> a blob being written (never listed; a crash leaves
                            it behind for `remove_incomplete`)

The marker is made only by `LocalBackend.create` (or `open(..., create=True)`),
on first use. Everything else refuses to work without it, and never creates
the root: a store whose directory vanished (an NFS mount gone, leaving an
empty mountpoint) is reported as BackingUnavailable, never refilled with new
empty directories. Writers, `list`, `free_bytes`, `check` and `remove_incomplete`
read the marker first; a read that finds no file reads it to tell a missing
blob (BlobMissing) from a missing store (BackingUnavailable). When the backend
was given no store uuid, it adopts the first one it reads, so a directory
swapped for another store later is refused too.

Writes: a temporary file (mode 0600) in the blob's own directory, then at
commit fsync, close, rename over the name, fsync of the directory. Parent
directories are created as needed and each creation is fsync'ed in its parent.
Deletes unlink and fsync the directory.

Batches (`batch`: a snapshot's namespace objects): each `put` writes a
temporary file next to its name and fsyncs it through the fd that wrote it
(callers may put from several threads at once), and makes a missing
directory without an fsync of its parent;
`sync` then renames each into place and fsyncs, once each, every directory
they landed in and every parent of a directory the batch made: two fsyncs
per directory and object become one per object plus one per directory. The
rename follows the file's fsync, so a name never shows a torn or empty blob,
even after a power loss: a crash before `sync` leaves only temporaries (never
listed; `remove_incomplete` takes them), one during it whole blobs some of
which may be visible and not durable, which nothing durable names yet (the
caller writes what names them after `sync`).

Create-once (`create_once`: leases, heads): the same complete, fsync'ed
temporary file, then link(2) to the name instead of rename: link fails with
EEXIST on a name that exists, atomically, on every filesystem a store may be
shared on (local ones, NFSv3 and v4, Lustre, CephFS, GPFS: the server or the
metadata server decides). A reply lost and retransmitted over NFSv3 can
report EEXIST for a link that was made: the blob is then compared with what
this call wrote, so the call that made it is told so.

Reads: pread(2) on a cached read-only fd; at most `max_open_files` are kept
(least recently used first out). An fd is closed only when no thread is reading
through it, so several worker threads can read at once. A committed or deleted
name drops its cached fd; ESTALE (NFS) reopens once. `read_span_into` (the cold
store's pack reads) reads with O_DIRECT through a second fd of the same file,
the range rounded out to SPAN_ALIGN: the disk fills the caller's buffer, no
copy out of the page cache and no page-cache pages for bytes read once; a
store that refuses O_DIRECT (EINVAL at the open or the read) is read through
the page cache from then on, and so is every read when `direct_reads` is off.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import re
import secrets
import stat
import threading
import time
import uuid as uuidlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

from ..errors import (AlreadyExists, BackingError, BackingFull, BackingReadOnly,
                      BackingUnavailable, BlobDamaged, BlobMissing, CkptfsError,
                      InvalidArgument)
from .base import (MARKER_NAME, SPAN_ALIGN, Backend, BlobBatch, BlobWriter, UuidLike, as_uuid, marker_body,
                   parse_marker, validate_name, validate_prefix)

TMP_TAG = ".tmp-"
SYNC_THREADS = 8        # a batch's fsyncs at once: the journal commits them together
T = TypeVar("T")
_WRITE_OPS = frozenset({"write", "create", "commit", "delete", "mkdir", "check"})
_UNAVAILABLE_ERRNOS = frozenset({errno.ENOTCONN, errno.ESTALE, errno.EIO, errno.ETIMEDOUT,
                                 errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENODEV,
                                 errno.ENXIO, errno.ENETDOWN, errno.ENETUNREACH})


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):   # some filesystems refuse dir fsync
            raise
    finally:
        os.close(fd)


def _need_dir(path: str) -> None:
    """ENOTDIR unless `path` (which exists) is a directory."""
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)


def _tmp_name(base: str) -> str:
    return f".{base}{TMP_TAG}{secrets.token_hex(8)}"


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("nr_cache", "nr_dirty", "nr_writeback",
                                               "nr_evicted", "nr_recently_evicted")]


_SYS_CACHESTAT = 451            # Linux >= 6.5, the same number on every architecture
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_cachestat_works = True


def _all_in_page_cache(fd: int, offset: int, length: int) -> bool:
    """Whether every page of [offset, offset+length) of fd's file is in the
    page cache (cachestat(2)); False if it cannot be told. A few us."""
    global _cachestat_works
    if not _cachestat_works:
        return False
    page = mmap.PAGESIZE
    first = offset // page
    pages = -(-(offset + length) // page) - first
    rng, st = _CacheStatRange(first * page, pages * page), _CacheStat()
    if _libc.syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(rng),
                     ctypes.byref(st), ctypes.c_uint(0)) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):   # an older kernel, seccomp
            _cachestat_works = False
        return False
    return st.nr_cache >= pages


def _open_direct(fd: int) -> int:
    """The file open on fd, opened again with O_DIRECT (through /proc, so it
    is the same file even if its name was replaced meanwhile)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)


class _CachedFd:
    __slots__ = ("fd", "direct_fd", "users", "evicted")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.direct_fd: Optional[int] = None     # the same file with O_DIRECT, once used
        self.users = 0
        self.evicted = False

    def fds(self) -> list[int]:
        return [self.fd] if self.direct_fd is None else [self.fd, self.direct_fd]


class LocalBackend(Backend):
    """A directory as a blob store; see the module docstring.

    The constructor does no I/O (a daemon may start while the store is away);
    use `open` or `check` to find out whether it is there.
    """

    def __init__(self, root: "os.PathLike[str] | str", store_uuid: Optional[UuidLike] = None,
                 *, max_open_files: int = 64, direct_reads: bool = True) -> None:
        if max_open_files < 1:
            raise ValueError("max_open_files must be at least 1")
        self.root = os.path.abspath(os.fspath(root))
        self.url = "file://" + self.root
        self.store_uuid = as_uuid(store_uuid)
        self.max_open_files = max_open_files
        self._lock = threading.Lock()
        self._fds: "OrderedDict[str, _CachedFd]" = OrderedDict()
        # read_span_into with O_DIRECT; off for good once the store refuses it
        self.direct_reads = direct_reads

    @property
    def location(self) -> str:
        return self.root

    # -- opening and creating ------------------------------------------------------

    @classmethod
    def open(cls, root: "os.PathLike[str] | str", store_uuid: Optional[UuidLike] = None,
             *, create: bool = False, **kw) -> "LocalBackend":
        """The store at `root`; BackingUnavailable unless its marker is there
        (and names `store_uuid`, if given). `create=True` makes it if needed."""
        if create:
            return cls.create(root, store_uuid, **kw)
        backend = cls(root, store_uuid, **kw)
        backend._verify_marker()
        return backend

    @classmethod
    def create(cls, root: "os.PathLike[str] | str", store_uuid: Optional[UuidLike] = None,
               **kw) -> "LocalBackend":
        """Make a new store at `root` (the directory and its marker), or open the
        one there if its marker names `store_uuid` (any uuid when None).

        Call this only on first use, when nothing says a store existed before;
        afterwards use `open`/the constructor with the uuid kept elsewhere.
        Refuses (AlreadyExists) a directory that holds another store, or
        anything besides lost+found.
        """
        backend = cls(root, store_uuid, **kw)
        wanted = backend.store_uuid
        root = backend.root
        try:
            backend._makedirs_abs(root)
            found = backend._read_marker()
            if found is not None:
                if wanted is not None and found != wanted:
                    raise AlreadyExists(f"{backend.url}: already holds ckptfs store {found}, "
                                        f"not {wanted}")
                backend.store_uuid = found
                return backend
            others = sorted(e for e in os.listdir(root) if e != "lost+found")
            if others:
                shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
                raise AlreadyExists(f"{backend.url}: not empty and not a ckptfs store "
                                    f"(holds {shown}); refusing to create a store there")
            new = wanted or uuidlib.uuid4()
            body = marker_body(new)
            tmp = os.path.join(root, _tmp_name(MARKER_NAME))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.rename(tmp, os.path.join(root, MARKER_NAME))
            except OSError:
                _unlink_quietly(tmp)
                raise
            _fsync_dir(root)
        except OSError as e:
            raise backend._os_error(e, "create", None) from e
        backend.store_uuid = new
        return backend

    def _read_marker(self) -> Optional[uuidlib.UUID]:
        """The uuid in the marker, None if there is no marker; raises on damage."""
        path = os.path.join(self.root, MARKER_NAME)
        try:
            with open(path, "rb") as f:
                raw = f.read(4096)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return parse_marker(raw, self.url)

    def _blob_parent(self, name: str) -> InvalidArgument:
        """ENOTDIR below name: one of its parents is a blob (once the store is
        known to be there: a vanished store says so instead)."""
        self._verify_marker()
        return InvalidArgument(f"{self.url}: {name}: a parent of this name is a blob "
                               "(a name cannot be both a blob and a prefix)")

    def _verify_marker(self) -> uuidlib.UUID:
        try:
            found = self._read_marker()
        except OSError as e:
            raise BackingUnavailable(f"{self.url}: cannot read the store marker: "
                                     f"{e.strerror or e}") from e
        if found is None:
            why = ("directory missing" if not os.path.isdir(self.root)
                   else "directory has no store marker: not mounted, or not a ckptfs store")
            raise BackingUnavailable(f"{self.url}: backing store unavailable ({why})")
        if self.store_uuid is None:
            self.store_uuid = found
        elif found != self.store_uuid:
            raise BackingUnavailable(f"{self.url}: holds ckptfs store {found}, "
                                     f"not the expected {self.store_uuid}")
        return found

    # -- errors ------------------------------------------------------------------

    def _os_error(self, e: OSError, op: str, name: Optional[str]) -> BackingError:
        """The project's exception for an OSError of `op` on blob `name`."""
        where = f"{self.url}: {name}" if name else self.url
        code = e.errno
        text = f"{op}: {e.strerror or e} ({errno.errorcode.get(code, code)})"
        if code in (errno.ENOSPC, errno.EDQUOT):
            return BackingFull(f"{where}: {text}")
        if code == errno.EROFS:
            return BackingReadOnly(f"{where}: {text}")
        if code in (errno.EACCES, errno.EPERM):
            cls = BackingReadOnly if op in _WRITE_OPS else BackingUnavailable
            return cls(f"{where}: {text}")
        if code in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR) and name is not None:
            try:
                self._verify_marker()
            except BackingError as missing_store:
                return missing_store
            if op in ("read", "size", "delete"):
                return BlobMissing(f"{where}: no such blob")
        return BackingUnavailable(f"{where}: {text}")

    # -- paths -------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.root, validate_name(name))

    def _makedirs_abs(self, path: str) -> None:
        """Create `path` and missing parents, fsync'ing each creation in its parent."""
        missing = []
        while not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o755)
            except FileExistsError:
                continue
            _fsync_dir(os.path.dirname(d))

    def _makedirs(self, rel_dir: str) -> None:
        """Create directories below the root (which must exist: never recreated)."""
        path = self.root
        for part in rel_dir.split("/"):
            parent, path = path, os.path.join(path, part)
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                if not os.path.isdir(path):
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR),
                                             path) from None
                continue
            _fsync_dir(parent)

    # -- Backend -----------------------------------------------------------------

    def writer(self, name: str) -> BlobWriter:
        path = self._path(name)
        self._verify_marker()
        rel_dir = os.path.dirname(name)
        try:
            if rel_dir and not os.path.isdir(os.path.dirname(path)):
                self._makedirs(rel_dir)
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                raise self._blob_parent(name) from e
            raise self._os_error(e, "mkdir", name) from e
        try:
            is_dir = os.path.isdir(path)
        except OSError:
            is_dir = False
        if is_dir:
            raise InvalidArgument(f"{self.url}: {name}: names a prefix of other blobs "
                                  "(a name cannot be both a blob and a prefix)")
        return _LocalWriter(self, name, path)

    def batch(self) -> BlobBatch:
        return _LocalBatch(self)

    def create_once(self, name: str, data: bytes) -> bool:
        with self.writer(name) as w:             # checks the marker, makes the directories
            assert isinstance(w, _LocalWriter)
            w.write(data)
            return w.link_once()

    def read(self, name: str, offset: int, length: int) -> bytes:
        validate_name(name)
        if offset < 0 or length < 0:
            raise InvalidArgument(f"{self.url}: {name}: bad range offset={offset} length={length}")
        return self._with_read_fd(name, lambda fd: self._pread_exact(fd, name, offset, length))

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """`read` into out with preadv: no new buffer, no copy in Python."""
        validate_name(name)
        if offset < 0:
            raise InvalidArgument(f"{self.url}: {name}: bad range offset={offset} "
                                  f"length={len(out)}")
        self._with_read_fd(name, lambda fd: self._preadv_exact(fd, name, offset, out))

    def read_span_into(self, name: str, offset: int, length: int, out: memoryview) -> int:
        """The range read with O_DIRECT, rounded out to SPAN_ALIGN, into out
        (see Backend.read_span_into); through the page cache if the store
        refuses O_DIRECT. May block."""
        validate_name(name)
        if offset < 0 or length < 0:
            raise InvalidArgument(f"{self.url}: {name}: bad range offset={offset} "
                                  f"length={length}")
        if len(out) < length + 2 * SPAN_ALIGN:
            raise InvalidArgument(f"{self.url}: {name}: a {len(out)}-byte buffer for "
                                  f"{length} bytes")
        if not (self.direct_reads and length):
            self.read_into(name, offset, out[:length])
            return 0
        return self._with_read_entry(
            name, lambda ent: self._read_span(ent, name, offset, length, out))

    def _read_span(self, ent: _CachedFd, name: str, offset: int, length: int,
                   out: memoryview) -> int:
        """read_span_into on ent (held by the caller): through the page cache
        if all of the range is there already (one copy, no disk read), else
        with O_DIRECT unless the store refuses it. May block."""
        if not _all_in_page_cache(ent.fd, offset, length):
            start = self._pread_direct(ent, name, offset, length, out)
            if start is not None:
                return start
        self._preadv_exact(ent.fd, name, offset, out[:length])
        return 0

    def _pread_direct(self, ent: _CachedFd, name: str, offset: int, length: int,
                      out: memoryview) -> Optional[int]:
        """Where in out [offset, offset+length) landed, read with O_DIRECT from
        the block boundary below offset; None (and direct reads off for good)
        if the store refuses O_DIRECT. The caller holds ent. May block."""
        fd, dfd, dfd_owned = ent.fd, ent.direct_fd, False
        if dfd is None:
            try:
                dfd = _open_direct(fd)
            except OSError:
                self.direct_reads = False        # no O_DIRECT here (EINVAL) or no /proc
                return None
            with self._lock:
                if ent.direct_fd is None and not ent.evicted:
                    ent.direct_fd = dfd          # closed with ent.fd
                else:
                    dfd_owned = True             # not kept: closed after this read
        try:
            start = offset % SPAN_ALIGN
            first = offset - start
            need = start + length
            size = -(-need // SPAN_ALIGN) * SPAN_ALIGN
            got = 0
            while got < need:
                if got % SPAN_ALIGN:             # a short read mid-block: the rest buffered
                    self._preadv_exact(fd, name, first + got, out[got:need])
                    break
                try:
                    n = os.preadv(dfd, [out[got:size]], first + got)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct_reads = False    # refused at the read (alignment, filesystem)
                    return None
                if n == 0:
                    end = os.fstat(fd).st_size
                    raise BlobDamaged(f"{self.url}: {name}: range [{offset}, {offset + length}) "
                                      f"goes past the end of the blob ({end} bytes)")
                got += n
            return start
        finally:
            if dfd_owned:
                os.close(dfd)

    def will_read(self, name: str, offset: int, length: int) -> None:
        """POSIX_FADV_WILLNEED: the kernel reads the range in the background,
        so the reads that follow find it in the page cache. Not while span
        reads bypass the page cache (they would read the disk twice)."""
        if self.direct_reads:
            return
        try:
            validate_name(name)
            self._with_read_fd(name, lambda fd: os.posix_fadvise(
                fd, offset, length, os.POSIX_FADV_WILLNEED))
        except (CkptfsError, OSError, ValueError):
            pass                # only a hint: the read reports what is wrong

    def _with_read_fd(self, name: str, read: Callable[[int], T]) -> T:
        """read(fd) on name's cached fd; on ESTALE (NFS: the file was replaced
        under the fd) once more on a fresh one. May block."""
        return self._with_read_entry(name, lambda ent: read(ent.fd))

    def _with_read_entry(self, name: str, read: Callable[[_CachedFd], T]) -> T:
        """`_with_read_fd` with the fd's cache entry. May block."""
        for attempt in (0, 1):
            ent = self._acquire(name)
            try:
                return read(ent)
            except OSError as e:
                if e.errno == errno.ESTALE and attempt == 0:
                    self._forget(name)
                    continue
                raise self._os_error(e, "read", name) from e
            finally:
                self._release(ent)
        raise AssertionError("unreachable")

    def _preadv_exact(self, fd: int, name: str, offset: int, out: memoryview) -> None:
        length = len(out)
        got = 0
        while got < length:
            n = os.preadv(fd, [out[got:]], offset + got)
            if n == 0:
                size = os.fstat(fd).st_size
                raise BlobDamaged(f"{self.url}: {name}: range [{offset}, {offset + length}) "
                                  f"goes past the end of the blob ({size} bytes)")
            got += n
        if length == 0 and offset > os.fstat(fd).st_size:
            raise BlobDamaged(f"{self.url}: {name}: offset {offset} is past the end of "
                              f"the blob ({os.fstat(fd).st_size} bytes)")

    def _pread_exact(self, fd: int, name: str, offset: int, length: int) -> bytes:
        data = os.pread(fd, length, offset)
        if len(data) == length:
            if length == 0 and offset > os.fstat(fd).st_size:
                raise BlobDamaged(f"{self.url}: {name}: offset {offset} is past the end of "
                                  f"the blob ({os.fstat(fd).st_size} bytes)")
            return data
        parts = [data]
        got = len(data)
        while got < length:
            more = os.pread(fd, length - got, offset + got)
            if not more:
                size = os.fstat(fd).st_size
                raise BlobDamaged(f"{self.url}: {name}: range [{offset}, {offset + length}) "
                                  f"goes past the end of the blob ({size} bytes)")
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def size(self, name: str) -> int:
        path = self._path(name)
        try:
            st = os.stat(path)
        except OSError as e:
            raise self._os_error(e, "size", name) from e
        if not stat.S_ISREG(st.st_mode):
            raise BlobMissing(f"{self.url}: {name}: not a blob")
        return st.st_size

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        self._verify_marker()
        head = prefix.rpartition("/")[0]
        start = os.path.join(self.root, head) if head else self.root
        out: list[str] = []

        def onerror(e: OSError) -> None:
            if e.errno in (errno.ENOENT, errno.ENOTDIR) and e.filename == start:
                return                           # nothing under that prefix
            raise self._os_error(e, "list", None) from e

        for dirpath, dirnames, filenames in os.walk(start, onerror=onerror):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel + "/"
            dirnames[:] = [d for d in dirnames if not d.startswith(".")
                           and ((rel + d + "/").startswith(prefix)
                                or prefix.startswith(rel + d + "/"))]
            for f in filenames:
                n = rel + f
                if f.startswith(".") or n == MARKER_NAME or not n.startswith(prefix):
                    continue
                out.append(n)
        out.sort()
        return out

    def delete(self, name: str) -> None:
        path = self._path(name)
        self._forget(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            self._verify_marker()                # a store that is gone is not "deleted"
            return
        except OSError as e:
            raise self._os_error(e, "delete", name) from e
        try:
            _fsync_dir(os.path.dirname(path))
        except OSError as e:
            raise self._os_error(e, "delete", name) from e

    def free_bytes(self) -> Optional[int]:
        self._verify_marker()
        try:
            st = os.statvfs(self.root)
        except OSError as e:
            raise self._os_error(e, "statfs", None) from e
        return st.f_bavail * st.f_frsize

    def check(self) -> None:
        self._verify_marker()
        try:
            if os.statvfs(self.root).f_flag & os.ST_RDONLY:
                raise BackingReadOnly(f"{self.url}: mounted read-only")
            probe = os.path.join(self.root, _tmp_name("probe"))
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise self._os_error(e, "check", None) from e

    def remove_incomplete(self, older_than: float = 3600.0) -> int:
        self._verify_marker()
        cutoff = time.time() - older_than
        removed = 0

        def onerror(e: OSError) -> None:
            raise self._os_error(e, "list", None) from e

        for dirpath, dirnames, filenames in os.walk(self.root, onerror=onerror):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for f in filenames:
                if not (f.startswith(".") and TMP_TAG in f):
                    continue
                path = os.path.join(dirpath, f)
                try:
                    if os.lstat(path).st_mtime <= cutoff:
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise self._os_error(e, "delete", os.path.relpath(path, self.root)) from e
        return removed

    def remove_incomplete_of(self, name: str) -> int:
        path = self._path(name)
        self._verify_marker()
        where, base = os.path.split(path)
        mine = re.compile(re.escape(f".{base}{TMP_TAG}") + "[0-9a-f]{16}")
        try:
            entries = os.listdir(where)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        except OSError as e:
            raise self._os_error(e, "list", name) from e
        removed = 0
        for f in entries:
            if mine.fullmatch(f):
                try:
                    os.unlink(os.path.join(where, f))
                    removed += 1
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise self._os_error(e, "delete", name) from e
        if removed:
            try:
                _fsync_dir(where)
            except OSError as e:
                raise self._os_error(e, "delete", name) from e
        return removed

    def close(self) -> None:
        with self._lock:
            ents = list(self._fds.values())
            self._fds.clear()
            to_close = []
            for ent in ents:
                ent.evicted = True
                if ent.users == 0:
                    to_close.extend(ent.fds())
        for fd in to_close:
            os.close(fd)

    # -- the fd cache ------------------------------------------------------------

    def _acquire(self, name: str) -> _CachedFd:
        with self._lock:
            ent = self._fds.get(name)
            if ent is not None:
                self._fds.move_to_end(name)
                ent.users += 1
                return ent
        try:                                     # open outside the lock: NFS may be slow
            fd = os.open(os.path.join(self.root, name), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise self._os_error(e, "read", name) from e
        try:
            is_file = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError as e:
            os.close(fd)
            raise self._os_error(e, "read", name) from e
        if not is_file:
            os.close(fd)
            raise BlobMissing(f"{self.url}: {name}: not a blob")
        to_close = []
        with self._lock:
            ent = self._fds.get(name)
            if ent is not None:                  # another thread opened it meanwhile
                to_close.append(fd)
                self._fds.move_to_end(name)
            else:
                ent = _CachedFd(fd)
                self._fds[name] = ent
                while len(self._fds) > self.max_open_files:
                    _, old = self._fds.popitem(last=False)
                    old.evicted = True
                    if old.users == 0:
                        to_close.extend(old.fds())
            ent.users += 1
        for f in to_close:
            os.close(f)
        return ent

    def _release(self, ent: _CachedFd) -> None:
        with self._lock:
            ent.users -= 1
            close = ent.evicted and ent.users == 0
        if close:
            for fd in ent.fds():
                os.close(fd)

    def _forget(self, name: str) -> None:
        """Drop the cached fd of `name` (closed once its readers are done)."""
        with self._lock:
            ent = self._fds.pop(name, None)
            if ent is None:
                return
            ent.evicted = True
            close = ent.users == 0
        if close:
            for fd in ent.fds():
                os.close(fd)

    def cached_fds(self) -> int:
        """How many fds the cache holds (for tests and stats)."""
        with self._lock:
            return len(self._fds)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class _LocalWriter(BlobWriter):
    """A temp file next to the final name; see LocalBackend. One thread at a time."""

    def __init__(self, backend: LocalBackend, name: str, path: str) -> None:
        self.name = name
        self._backend = backend
        self._path = path
        self._dir = os.path.dirname(path)
        self._tmp = os.path.join(self._dir, _tmp_name(os.path.basename(path)))
        self._state = "open"            # open -> committed | aborted | failed (visible, unknown)
        self.bytes_written = 0
        self._fd: Optional[int] = None
        try:
            self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                               0o600)
        except OSError as e:
            self._state = "aborted"
            raise backend._os_error(e, "create", name) from e

    @property
    def committed(self) -> bool:
        return self._state == "committed"

    def _need_open(self) -> int:
        if self._state != "open" or self._fd is None:
            raise InvalidArgument(f"{self._backend.url}: {self.name}: writer is {self._state}")
        return self._fd

    def write(self, data) -> None:
        fd = self._need_open()
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        try:
            while mv:
                n = os.write(fd, mv)
                mv = mv[n:]
                self.bytes_written += n
        except OSError as e:
            self.abort()
            raise self._backend._os_error(e, "write", self.name) from e

    def commit(self) -> None:
        fd = self._need_open()
        try:
            os.fsync(fd)
            self._fd = None
            os.close(fd)
            os.rename(self._tmp, self._path)
        except OSError as e:
            self.abort()
            raise self._backend._os_error(e, "commit", self.name) from e
        self._backend._forget(self.name)        # a replaced blob must not be read via an old fd
        try:
            _fsync_dir(self._dir)
        except OSError as e:
            self._state = "failed"               # visible, durability unknown
            raise self._backend._os_error(e, "commit", self.name) from e
        self._state = "committed"

    def link_once(self) -> bool:
        """Commit by link(2): True if the name was free and is now this blob,
        False if a blob of that name existed (then nothing is changed)."""
        fd = self._need_open()
        try:
            os.fsync(fd)
            try:
                os.link(self._tmp, self._path)
                made = True
            except FileExistsError:
                # Ours after all if a retransmitted link found its own work done.
                made = self._holds_our_bytes(fd)
            self.abort()                         # the temporary name goes either way
            if made:
                _fsync_dir(self._dir)
        except OSError as e:
            self.abort()
            if e.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                raise BackingUnavailable(
                    f"{self._backend.url}: {self.name}: the store's filesystem cannot make "
                    f"hard links ({e.strerror}): leases need link(2) (NFS, Lustre, CephFS, "
                    "GPFS and local filesystems have it)") from e
            raise self._backend._os_error(e, "commit", self.name) from e
        self._state = "committed" if made else "aborted"
        return made

    def _holds_our_bytes(self, fd: int) -> bool:
        try:
            st, ours = os.stat(self._path), os.fstat(fd)
        except FileNotFoundError:
            return False
        if (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino):
            return True
        if st.st_size != self.bytes_written:
            return False
        with open(self._path, "rb") as theirs:
            return theirs.read(st.st_size + 1) == os.pread(fd, st.st_size + 1, 0)

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        _unlink_quietly(self._tmp)

    def __del__(self) -> None:
        try:
            if getattr(self, "_state", None) == "open":
                self.abort()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<LocalBlobWriter {self._backend.url}: {self.name} ({self._state})>"


class _LocalBatch(BlobBatch):
    """Temporary files written and fsynced now, renamed into place and their
    directories fsynced together at `sync` (see LocalBackend). `put` from
    any thread."""

    # One: a put takes the GIL back after each of its open, write, fsync and
    # close; from eight threads at once those returns kept the trio thread
    # waiting for the GIL through a publish (small files, sync=close: the
    # writer stalled ~2 s per publish of 2,000 objects; 551-602 files/s
    # with 8, 694-743 with 1; a publish of 3,000 objects 1.6x longer for the
    # same CPU: docs/BENCHMARKS.md, session 14, small14).
    put_threads = 1

    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._staged: list[tuple[str, str, str]] = []     # (name, temporary, final path)
        # Parents of the directories this batch made: fsynced by `sync` with
        # the directories the objects land in (not one fsync per mkdir).
        self._new_dir_parents: set[str] = set()
        # Temporary names: one random tag per batch and a counter (16 hex
        # digits, as `_tmp_name`'s): O_EXCL refuses a clash either way, and
        # no getrandom(2) per object.
        self._tmp_tag = secrets.token_hex(4)
        self._tmp_count = itertools.count()
        self.fsyncs = 0                                    # for stats and tests

    def put(self, name: str, data: bytes) -> None:
        """Write `name`'s temporary file and fsync it on the fd that wrote it
        (no second open at `sync`). May block."""
        backend = self.backend
        path = backend._path(name)
        base = os.path.basename(path)
        tmp = os.path.join(os.path.dirname(path),
                           f".{base}{TMP_TAG}{self._tmp_tag}{next(self._tmp_count):08x}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:
                backend._verify_marker()        # never recreate a store that vanished
                if os.path.dirname(name):
                    self._makedirs(os.path.dirname(name))
                fd = os.open(tmp, flags, 0o600)
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                raise backend._blob_parent(name) from e
            raise backend._os_error(e, "create", name) from e
        op = "write"
        try:
            mv = memoryview(data)
            while mv:
                mv = mv[os.write(fd, mv):]
            op = "commit"
            os.fsync(fd)        # durable before `sync` gives it its name
        except OSError as e:
            os.close(fd)
            _unlink_quietly(tmp)
            raise backend._os_error(e, op, name) from e
        try:
            os.close(fd)
        except OSError as e:    # NFS may report a failed write-back only here
            _unlink_quietly(tmp)
            raise backend._os_error(e, "commit", name) from e
        with self._lock:
            self.fsyncs += 1
            self._staged.append((name, tmp, path))

    def _makedirs(self, rel_dir: str) -> None:
        """Make `rel_dir` (below the root, which is never made) and whatever
        of its parents is missing, the deepest tried first: where the parents
        exist (all but a store's first objects), one mkdir. Each new
        directory's parent is fsynced by `sync`, before anything names what
        lands in it. May block."""
        root = self.backend.root
        path = os.path.join(root, rel_dir)
        missing: list[str] = []
        made: list[str] = []
        while path != root:
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                _need_dir(path)
            except FileNotFoundError:
                missing.append(path)            # its parent first
                path = os.path.dirname(path)
                continue
            else:
                made.append(path)
            break
        for d in reversed(missing):             # top down: each one's parent is there now
            try:
                os.mkdir(d, 0o755)
                made.append(d)
            except FileExistsError:             # another put made it meanwhile
                _need_dir(d)
        with self._lock:
            self._new_dir_parents.update(os.path.dirname(d) for d in made)

    def sync(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, []
            new_parents, self._new_dir_parents = self._new_dir_parents, set()
        if not staged:
            return
        backend = self.backend
        try:
            backend._verify_marker()
        except BaseException:
            for _, tmp, _ in staged:
                _unlink_quietly(tmp)
            raise
        # Every file was fsynced by its put: a name never shows a torn object.
        for i, (name, tmp, path) in enumerate(staged):
            try:
                os.rename(tmp, path)
            except OSError as e:
                for _, rest, _ in staged[i:]:
                    _unlink_quietly(rest)
                raise backend._os_error(e, "commit", name) from e
            backend._forget(name)               # a replaced blob must not be read via an old fd
        self._fsync_dirs(sorted({os.path.dirname(p) for _, _, p in staged} | new_parents),
                         "commit")

    def _fsync_dirs(self, paths: list[str], op: str) -> None:
        """fsync every directory, several at once. May block."""
        def one(path: str) -> None:
            try:
                _fsync_dir(path)
            except OSError as e:
                raise self.backend._os_error(e, op, os.path.relpath(path, self.backend.root)
                                             ) from e

        self.fsyncs += len(paths)
        if len(paths) == 1:
            one(paths[0])
            return
        with ThreadPoolExecutor(min(SYNC_THREADS, len(paths)),
                                thread_name_prefix="ckptfs store sync") as pool:
            for f in [pool.submit(one, p) for p in paths]:
                f.result()

    def abort(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, []
        for _, tmp, _ in staged:
            _unlink_quietly(tmp)
