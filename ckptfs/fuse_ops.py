"""pyfuse3 adapter: each request becomes one `Filesystem` call.

No storage logic lives here. The only job is translation: pyfuse3 types in,
`EntryAttributes` out, and every exception turned into `FUSEError` at this
edge. A project exception carries its errno; anything unexpected is logged
with its traceback and answered with EIO, so a handler never lets an
exception escape (that would end `pyfuse3.main` and leave a dead mount).
"""

from __future__ import annotations

import errno
import functools
import logging
from typing import Any, Awaitable, Callable, TypeVar

import pyfuse3

from . import fastpath
from .core import Attrs, Filesystem
from .errors import CkptfsError, NoXattr
from .index import ROOT_INO
from .namespace import ACL_ACCESS

log = logging.getLogger(__name__)

T = TypeVar("T")

# ckptfs is the only writer of its namespace, so the kernel may cache names
# and attributes for long; negative entries too (creates invalidate them).
ENTRY_TIMEOUT_S = 300.0
ATTR_TIMEOUT_S = 300.0
NEGATIVE_TIMEOUT_S = 30.0
BLKSIZE = 1 << 20


def _errno_edge(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(fn)
    async def wrapper(self: "CkptfsOperations", *args: Any) -> T:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except CkptfsError as e:
            if e.errno == errno.EIO:
                if not e.logged:
                    log.error("%s: %s", fn.__name__, e)
                self.fs.errors_by_kind[type(e).__name__] = \
                    self.fs.errors_by_kind.get(type(e).__name__, 0) + 1
            else:
                log.debug("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except OSError as e:
            log.error("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            self.fs.errors_by_kind["unexpected"] = self.fs.errors_by_kind.get("unexpected", 0) + 1
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


class CkptfsOperations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = True

    def __init__(self, fs: Filesystem, negative_timeout_s: float = NEGATIVE_TIMEOUT_S) -> None:
        super().__init__()
        self.fs = fs        # or a merged.MergedFilesystem (-o peers=): the same calls
        self.negative_timeout_s = negative_timeout_s
        # A directory's attributes left for the fast path after a change in it
        # (_leave_attrs) are dropped as its inode record changes (every change
        # of the live index is seen by its watchers). Not with a peer view
        # (merged.py): its directories change from outside.
        self._attrs_in_c = isinstance(fs, Filesystem) and fastpath.lib is not None
        if self._attrs_in_c:
            fs.watch_attrs(fastpath.attr_drop)

    # ------------------------------------------------------------- helpers

    def _entry(self, a: Attrs) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        i = a.inode
        e.st_ino = i.ino
        e.generation = 0          # inode numbers are never reused
        if a.cache_timeout_s is None:
            e.entry_timeout = ENTRY_TIMEOUT_S
            e.attr_timeout = ATTR_TIMEOUT_S
        else:               # a peer volume's entry (merged.py): it may change
            e.entry_timeout = e.attr_timeout = a.cache_timeout_s
        e.st_mode = i.mode
        e.st_nlink = i.nlink
        e.st_uid = i.uid
        e.st_gid = i.gid
        e.st_rdev = i.rdev
        e.st_size = a.size
        e.st_blksize = BLKSIZE
        e.st_blocks = (a.data_bytes + 511) // 512
        e.st_atime_ns = i.atime_ns
        e.st_mtime_ns = a.mtime_ns
        e.st_ctime_ns = a.ctime_ns
        return e

    def _leave_attrs(self, ino: int) -> None:
        """The kernel drops a directory's attributes when a name in it is made
        or removed, and (default_permissions) asks for them before the next
        one: its next GETATTR is answered in C with what `getattr` would
        reply now. Call it last in a handler, after every change it makes."""
        if not self._attrs_in_c:
            return
        a = self.fs.attrs(ino)
        if a.cache_timeout_s is not None:
            return
        i = a.inode
        fastpath.attr_leave(ino, a.size, (a.data_bytes + 511) // 512, i.atime_ns, a.mtime_ns,
                            a.ctime_ns, i.mode, i.nlink, i.uid, i.gid, i.rdev & 0xFFFFFFFF,
                            BLKSIZE, ATTR_TIMEOUT_S)

    # ------------------------------------------------------------ namespace

    @_errno_edge
    async def lookup(self, parent_inode, name, ctx=None):
        try:
            return self._entry(self.fs.lookup(parent_inode, name))
        except pyfuse3.FUSEError:
            raise
        except CkptfsError as e:
            if e.errno != errno.ENOENT:
                raise
            neg = pyfuse3.EntryAttributes()
            neg.st_ino = 0             # a cacheable "no such entry"
            neg.entry_timeout = self.negative_timeout_s
            return neg

    async def forget(self, inode_list):
        # forget must never raise.
        for ino, nlookup in inode_list:
            try:
                self.fs.forget(ino, nlookup)
            except Exception:
                log.exception("forget(%d) failed", ino)

    @_errno_edge
    async def getattr(self, inode, ctx=None):
        return self._entry(self.fs.attrs(inode))

    @_errno_edge
    async def setattr(self, inode, attr, fields, fh, ctx):
        kw = {}
        if fields.update_mode:
            kw["mode"] = attr.st_mode
        if fields.update_uid:
            kw["uid"] = attr.st_uid
        if fields.update_gid:
            kw["gid"] = attr.st_gid
        if fields.update_size:
            kw["size"] = attr.st_size
        if fields.update_atime:
            kw["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            kw["mtime_ns"] = attr.st_mtime_ns
        if fields.update_ctime:
            kw["ctime_ns"] = attr.st_ctime_ns
        if fastpath.kill_asked(inode):      # a truncate or chown: suid/sgid go first
            self.fs.kill_privs(inode)
        return self._entry(self.fs.setattr(inode, **kw))

    @_errno_edge
    async def readlink(self, inode, ctx):
        return self.fs.ns.readlink(inode)

    @_errno_edge
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        attrs = self.fs.make_node(parent_inode, name, mode, ctx.uid, ctx.gid, rdev=rdev)
        fastpath.caps_absent(attrs.inode.ino)       # new: no xattrs yet
        self._leave_attrs(parent_inode)
        return self._entry(attrs)

    @_errno_edge
    async def mkdir(self, parent_inode, name, mode, ctx):
        entry = self._entry(self.fs.make_node(parent_inode, name, (mode & 0o7777) | 0o040000,
                                              ctx.uid, ctx.gid))
        self._leave_attrs(parent_inode)
        return entry

    @_errno_edge
    async def symlink(self, parent_inode, name, target, ctx):
        entry = self._entry(self.fs.make_node(parent_inode, name, 0o120777, ctx.uid, ctx.gid,
                                              target=target))
        self._leave_attrs(parent_inode)
        return entry

    @_errno_edge
    async def unlink(self, parent_inode, name, ctx):
        self.fs.unlink(parent_inode, name)
        self._leave_attrs(parent_inode)

    @_errno_edge
    async def rmdir(self, parent_inode, name, ctx):
        self.fs.rmdir(parent_inode, name)
        self._leave_attrs(parent_inode)

    @_errno_edge
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)
        self._leave_attrs(parent_inode_old)
        if parent_inode_new != parent_inode_old:
            self._leave_attrs(parent_inode_new)

    @_errno_edge
    async def link(self, inode, new_parent_inode, new_name, ctx):
        entry = self._entry(self.fs.link(inode, new_parent_inode, new_name))
        self._leave_attrs(new_parent_inode)
        return entry

    # -------------------------------------------------------------- readdir

    @_errno_edge
    async def opendir(self, inode, ctx):
        self.fs.ns.lookup(inode, b".")      # ENOTDIR / ESTALE checks
        return inode

    @_errno_edge
    async def readdir(self, fh, start_id, token):
        if start_id < 1:
            if not pyfuse3.readdir_reply(token, b".", self._entry(self.fs.attrs(fh)), 1):
                return
            start_id = 1
        if start_id < 2:
            parent = self.fs.ns.get(fh).parent or ROOT_INO
            if not pyfuse3.readdir_reply(token, b"..", self._entry(self.fs.attrs(parent)), 2):
                return
        for name, ino, cookie in self.fs.ns.entries(fh, max(start_id, 2)):
            if not pyfuse3.readdir_reply(token, name, self._entry(self.fs.attrs(ino)), cookie):
                return
            self.fs.count_lookup(ino)      # readdirplus counts as a lookup

    @_errno_edge
    async def releasedir(self, fh):
        pass

    @_errno_edge
    async def fsyncdir(self, fh, datasync):
        await self.fs.sync_all()

    # ---------------------------------------------------------------- files

    @_errno_edge
    async def open(self, inode, flags, ctx):
        if fastpath.kill_asked(inode):      # an O_TRUNC open: suid/sgid go first
            self.fs.kill_privs(inode)
        fh = self.fs.open(inode, flags)
        # Only ckptfs changes these files, so the page cache stays valid.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @_errno_edge
    async def create(self, parent_inode, name, mode, flags, ctx):
        fh, attrs = self.fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        fastpath.caps_absent(attrs.inode.ino)       # new: no xattrs yet
        self._leave_attrs(parent_inode)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True), self._entry(attrs)

    @_errno_edge
    async def read(self, fh, off, size):
        return await self.fs.read(fh, off, size)

    async def read_errno(self, fh: int, off: int, size: int) -> tuple[int, bytes]:
        """`read` for a READ answered outside pyfuse3 (the fast path's
        handed-back READs, fastpath.serve_handbacks): (0, bytes) or (errno, b"")."""
        try:
            return 0, await self.read(fh, off, size)
        except pyfuse3.FUSEError as e:
            return e.errno, b""

    @_errno_edge
    async def write(self, fh, off, buf):
        ino = self.fs.handle(fh).ino
        if fastpath.kill_asked(ino):        # before the bytes, as the VFS does
            self.fs.kill_privs(ino)
        return await self.fs.write(fh, off, buf)

    @_errno_edge
    async def flush(self, fh):
        await self.fs.flush(fh)

    @_errno_edge
    async def fsync(self, fh, datasync):
        await self.fs.fsync(fh)

    @_errno_edge
    async def release(self, fh):
        await self.fs.release(fh)

    # --------------------------------------------------------------- xattrs

    @_errno_edge
    async def getxattr(self, inode, name, ctx):
        try:
            return self.fs.ns.getxattr(inode, name)
        except NoXattr:
            if name == fastpath.CAPS_XATTR:
                # The kernel asks this before every write(); from now on the
                # fast path answers it without a round trip through Python.
                fastpath.caps_absent(inode)
            raise

    @_errno_edge
    async def setxattr(self, inode, name, value, ctx):
        if name == fastpath.CAPS_XATTR:
            fastpath.caps_unknown(inode)        # before it exists: ask us again
        self.fs.ns.setxattr(inode, name, value, self.fs.now_ns(), ctx.uid)
        if name == ACL_ACCESS:
            # It changed the mode: the kernel would go on showing (and checking)
            # the cached one. Attributes only, so no writeback to wait for.
            try:
                pyfuse3.invalidate_inode(inode, attr_only=True)
            except OSError as e:        # not cached by the kernel: nothing stale
                log.debug("invalidate_inode(%d): %s", inode, e)

    @_errno_edge
    async def listxattr(self, inode, ctx):
        return self.fs.ns.listxattr(inode)

    @_errno_edge
    async def removexattr(self, inode, name, ctx):
        self.fs.ns.removexattr(inode, name, self.fs.now_ns(), ctx.uid)

    # ----------------------------------------------------------------- misc

    @_errno_edge
    async def statfs(self, ctx):
        s = self.fs.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = out.f_frsize = s["bsize"]
        out.f_blocks = s["blocks"]
        out.f_bfree = s["bfree"]
        out.f_bavail = s["bavail"]
        out.f_files = s["files"]
        out.f_ffree = out.f_favail = s["ffree"]
        out.f_namemax = 255
        return out

    @_errno_edge
    async def access(self, inode, mode, ctx):
        # default_permissions: the kernel has checked already.
        return True

