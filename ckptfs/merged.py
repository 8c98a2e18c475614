"""The merged namespace: this mount's own files laid over its peers' view.

With `-o peers=...` the adapter (fuse_ops.py) talks to a `MergedFilesystem`
instead of the `Filesystem`: the same calls, answered from the mount's own
namespace first and from the peer view (peerview.py) where the mount has no
such name. Like an overlay: the mount's own files are the upper layer
(read-write, all of ckptfs's guarantees), the peers' published files the
lower one (read-only). The rules (docs/OPERATIONS.md, "Running on a
cluster"):

- an own name hides a peer's name at the same path; own and peer
  directories at one path merge (listing, lookups);
- a peer's file, directory or symlink cannot be changed here: EROFS for
  writes, truncation, attribute and xattr changes, unlink, rmdir, rename;
- a name made here (create, mkdir, symlink, link, rename's target) is always
  an own one: in a directory only the peers have, its path is made as own
  directories first (with the peer directories' modes and owners), and it
  then hides any peer name it shares;
- opening a peer's file for writing with O_TRUNC (`open(path, "w")`, which
  discards its content anyway) makes an own empty file there (the peer
  file's mode and owner) that hides it, as a rename onto it would, and
  answers ESTALE: the kernel looks the name up again and opens the own file;
- peers' names and attributes are cached by the kernel for `peer_refresh`
  seconds, and so are failed lookups in merged directories.

Inode numbers of the view start at VIEW_INO_BASE (the index's counter never
gets there): a directory keeps its number while its path is shown, a file's
number stands for its content (a newer version at the same path is another
inode, so the page cache never shows stale bytes). File handles and readdir
cookies of the view are likewise above VIEW_FH_BASE and VIEW_COOKIE_BASE.

Runs on the trio thread; the store is read by `peerview` on worker threads.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Iterator, Optional

import trio

from .core import Attrs, Filesystem
from .errors import (BadFileHandle, CkptfsError, InvalidArgument, NameReplaced, NotADirectory,
                     NotFound, NoXattr, ReadOnly)
from .index import ROOT_INO, Inode
from .peerview import Path, PeerView, VNode

log = logging.getLogger(__name__)

VIEW_INO_BASE = 1 << 62
VIEW_FH_BASE = 1 << 62
VIEW_COOKIE_BASE = 1 << 62
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND


def _read_only(path: Path, what: str = "") -> ReadOnly:
    shown = b"/".join(path).decode("utf-8", "backslashreplace") or "/"
    return ReadOnly(f"{shown} is a peer volume's (read-only here){what}")


class MergedFilesystem:
    """`Filesystem`'s calls over the mount's namespace merged with a peer view.
    Anything not overridden here is the local Filesystem's."""

    def __init__(self, fs: Filesystem, view: PeerView) -> None:
        self.fs = fs
        self.view = view
        self.ns = _MergedNamespace(self)
        self.cache_timeout_s = view.refresh_s
        self._ino_of: dict[tuple, int] = {}
        self._nodes: dict[int, tuple[Path, Optional[VNode]]] = {}   # a dir: (path, None)
        self._lookups: dict[int, int] = {}
        self._next_ino = VIEW_INO_BASE + 1
        self._handles: dict[int, VNode] = {}
        self._next_fh = VIEW_FH_BASE + 1
        self._cookies: dict[Path, dict[bytes, int]] = {}
        self._names: dict[int, tuple[int, bytes]] = {}    # own dir -> (parent, name), a cache

    def __getattr__(self, name: str):
        return getattr(self.fs, name)

    # ---------------------------------------------------------------- paths

    @staticmethod
    def is_view(ino: int) -> bool:
        return ino >= VIEW_INO_BASE

    def _own_path(self, ino: int) -> Path:
        """The path of an own directory, from its parent links."""
        parts: list[bytes] = []
        while ino != ROOT_INO:
            parent = self.fs.ns.get(ino).parent or ROOT_INO
            name = self._name_in(parent, ino)
            parts.append(name)
            ino = parent
        return tuple(reversed(parts))

    def _name_in(self, parent: int, ino: int) -> bytes:
        cached = self._names.get(ino)
        if cached is not None and cached[0] == parent:
            try:
                if self.fs.ns.lookup(parent, cached[1]).ino == ino:
                    return cached[1]
            except NotFound:
                pass
        for name, child, _ in self.fs.ns.entries(parent, 0):
            if child == ino:
                self._names[ino] = (parent, name)
                return name
        raise NotFound(f"directory {ino} is in no directory (removed meanwhile)")

    def path_of(self, ino: int) -> Path:
        """The path of a directory, own or the view's."""
        if self.is_view(ino):
            return self._view_entry(ino)[0]
        return self._own_path(ino)

    def _own_dir(self, path: Path) -> Optional[Inode]:
        """The own directory at path, if there is one."""
        ino = ROOT_INO
        for name in path:
            try:
                inode = self.fs.ns.lookup(ino, name)
            except (NotFound, NotADirectory):
                return None
            if not stat.S_ISDIR(inode.mode):
                return None
            ino = inode.ino
        return self.fs.ns.get(ino)

    def _own_parent(self, parent: int) -> tuple[Optional[int], Path]:
        """(the own directory for a parent, or None; the parent's path)."""
        if not self.is_view(parent):
            return parent, ()
        path = self.path_of(parent)
        own = self._own_dir(path)
        return (own.ino if own is not None else None), path

    def _writable_dir(self, parent: int) -> int:
        """The own directory to make a name in: a view directory's path is made
        own first, each missing directory with its peer's mode and owner."""
        own, path = self._own_parent(parent)
        if own is not None:
            return own
        return self._writable_dir_at(path)

    def _writable_dir_at(self, path: Path) -> int:
        """The own directory at path, made (as `_writable_dir`) if missing."""
        ino = ROOT_INO
        for i, name in enumerate(path):
            try:
                inode = self.fs.ns.lookup(ino, name)
            except NotFound:
                node = self.view.tree.node(path[:i + 1])
                if node is None or node.kind != "d":
                    raise NotFound(f"{b'/'.join(path[:i + 1])!r} is gone from the peer view")
                a = node.attrs
                inode = self.fs.make_node(ino, name, stat.S_IFDIR | stat.S_IMODE(a.mode),
                                          a.uid, a.gid).inode
            if not stat.S_ISDIR(inode.mode):
                raise NotADirectory(f"{b'/'.join(path[:i + 1])!r} is not a directory here")
            ino = inode.ino
        return ino

    # ------------------------------------------------------------ view inodes

    def _view_entry(self, ino: int) -> tuple[Path, Optional[VNode]]:
        got = self._nodes.get(ino)
        if got is None:
            raise NotFound(f"inode {ino} of the peer view is no longer known")
        return got

    def _view_ino(self, path: Path, node: VNode) -> int:
        key = ("d", path) if node.kind == "d" else node.key
        ino = self._ino_of.get(key)
        if ino is None:
            ino = self._ino_of[key] = self._next_ino
            self._next_ino += 1
        self._nodes[ino] = (path, None if node.kind == "d" else node)
        return ino

    def _view_attrs(self, ino: int) -> Attrs:
        path, node = self._view_entry(ino)
        if node is None:                        # a directory: as the view shows it now
            own = self._own_dir(path)
            if own is not None:
                return Attrs(Inode(ino, own.mode, own.nlink, own.uid, own.gid, 0, 0,
                                   own.atime_ns, own.mtime_ns, own.ctime_ns),
                             0, own.mtime_ns, own.ctime_ns, 0, self.cache_timeout_s)
            node = self.view.tree.node(path)
            if node is None or node.kind != "d":
                raise NotFound(f"{b'/'.join(path)!r} is gone from the peer view")
            nlink = 2 + sum(1 for c in node.children.values() if c.kind == "d")
        else:
            nlink = node.nlink
        a = node.attrs
        size = a.size if node.kind != "d" else 0
        return Attrs(Inode(ino, a.mode, nlink, a.uid, a.gid, a.rdev, size, a.atime_ns,
                           a.mtime_ns, a.ctime_ns), size, a.mtime_ns, a.ctime_ns,
                     size if node.kind == "f" else 0, self.cache_timeout_s)

    def _view_lookup(self, path: Path) -> Attrs:
        node = self.view.tree.node(path)
        if node is None:
            raise NotFound(f"no {b'/'.join(path)!r} here nor in the peer view")
        ino = self._view_ino(path, node)
        self.count_lookup(ino)
        return self._view_attrs(ino)

    # ------------------------------------------------------------ attributes

    def attrs(self, ino: int) -> Attrs:
        return self._view_attrs(ino) if self.is_view(ino) else self.fs.attrs(ino)

    def lookup(self, parent: int, name: bytes) -> Attrs:
        own, path = self._own_parent(parent)
        if own is not None:
            try:
                return self.fs.lookup(own, name)
            except NotFound:
                pass
        if not self.is_view(parent):
            path = self._own_path(parent)
        return self._view_lookup(path + (name,))

    def count_lookup(self, ino: int) -> None:
        if self.is_view(ino):
            self._lookups[ino] = self._lookups.get(ino, 0) + 1
        else:
            self.fs.count_lookup(ino)

    def forget(self, ino: int, nlookup: int) -> None:
        if not self.is_view(ino):
            self.fs.forget(ino, nlookup)
            return
        left = self._lookups.get(ino, 0) - nlookup
        if left > 0:
            self._lookups[ino] = left
            return
        self._lookups.pop(ino, None)
        path, node = self._nodes.pop(ino, ((), None))
        self._ino_of.pop(("d", path) if node is None else node.key, None)

    def setattr(self, ino: int, **kw) -> Attrs:
        if self.is_view(ino):
            raise _read_only(self._view_entry(ino)[0])
        return self.fs.setattr(ino, **kw)

    # ------------------------------------------------------------ namespace

    def make_node(self, parent: int, name: bytes, mode: int, uid: int, gid: int, **kw) -> Attrs:
        return self.fs.make_node(self._writable_dir(parent), name, mode, uid, gid, **kw)

    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int):
        return self.fs.create(self._writable_dir(parent), name, mode, flags, uid, gid)

    def link(self, ino: int, parent: int, name: bytes) -> Attrs:
        if self.is_view(ino):
            raise _read_only(self._view_entry(ino)[0], ": a hard link to it cannot be made")
        return self.fs.link(ino, self._writable_dir(parent), name)

    def _remove(self, parent: int, name: bytes, remove) -> None:
        own, path = self._own_parent(parent)
        if own is not None:
            try:
                remove(own, name)
                return
            except NotFound:
                pass
        if not self.is_view(parent):
            path = self._own_path(parent)
        if self.view.tree.node(path + (name,)) is not None:
            raise _read_only(path + (name,))
        raise NotFound(f"no {name!r} to remove")

    def unlink(self, parent: int, name: bytes) -> None:
        self._remove(parent, name, self.fs.unlink)

    def rmdir(self, parent: int, name: bytes) -> None:
        self._remove(parent, name, self.fs.rmdir)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int) -> None:
        own, path = self._own_parent(old_parent)
        if own is None or not self._has_own(own, old_name):
            if not self.is_view(old_parent):
                path = self._own_path(old_parent)
            if self.view.tree.node(path + (old_name,)) is not None:
                raise _read_only(path + (old_name,))
            raise NotFound(f"no {old_name!r} to rename")
        self.fs.rename(own, old_name, self._writable_dir(new_parent), new_name, flags)

    def _has_own(self, parent: int, name: bytes) -> bool:
        try:
            self.fs.ns.lookup(parent, name)
            return True
        except NotFound:
            return False

    def entries(self, ino: int, after_cookie: int) -> Iterator[tuple[bytes, int, int]]:
        """Own entries in their order, then the view's names that no own entry
        hides, in the order they were first seen."""
        if self.is_view(ino):
            path = self.path_of(ino)
            own = self._own_dir(path)
            own_ino = own.ino if own is not None else None
        else:
            own_ino = ino
            path = self._own_path(ino)
        if own_ino is not None and after_cookie < VIEW_COOKIE_BASE:
            yield from self.fs.ns.entries(own_ino, after_cookie)
        node = self.view.tree.node(path)
        if node is None or node.kind != "d":
            return
        cookies = self._cookies.setdefault(path, {})
        for name in sorted(node.children):
            if name not in cookies:
                cookies[name] = VIEW_COOKIE_BASE + len(cookies) + 1
        for name, cookie in sorted(cookies.items(), key=lambda kv: kv[1]):
            child = node.children.get(name)
            if cookie <= after_cookie or child is None:
                continue
            if own_ino is not None and self._has_own(own_ino, name):
                continue
            yield name, self._view_ino(path + (name,), child), cookie

    # ---------------------------------------------------------------- files

    def open(self, ino: int, flags: int) -> int:
        if not self.is_view(ino):
            return self.fs.open(ino, flags)
        path, node = self._view_entry(ino)
        if node is None:
            raise InvalidArgument("a directory is not opened as a file")
        if flags & _WRITE_FLAGS:
            if flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY \
                    and node.kind == "f" and path:
                self._replace_peer_file(path, node)
            raise _read_only(path)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = node
        return fh

    def _replace_peer_file(self, path: Path, node: VNode) -> None:
        """open(path, "w") over a name only a peer has: an own empty file there
        (the peer file's mode and owner: it was opened as that file) hides
        the peer's, as a rename onto it would. NameReplaced (ESTALE): the
        kernel then looks the name up again and opens the own file."""
        parent = self._writable_dir_at(path[:-1])
        if not self._has_own(parent, path[-1]):
            a = node.attrs
            made = self.fs.make_node(parent, path[-1], stat.S_IFREG | stat.S_IMODE(a.mode),
                                     a.uid, a.gid)
            self.fs.forget(made.inode.ino, 1)       # the kernel holds the peer's inode
        raise NameReplaced(f"{b'/'.join(path)!r} is now this node's own file")

    async def read(self, fh: int, off: int, size: int) -> bytes:
        if fh < VIEW_FH_BASE:
            return await self.fs.read(fh, off, size)
        node = self._handles.get(fh)
        if node is None:
            raise BadFileHandle(f"no open file {fh}")
        return await trio.to_thread.run_sync(self.view.read_blocking, node, off, size,
                                             limiter=self.fs.io_limiter)

    async def write(self, fh: int, off: int, data: bytes) -> int:
        if fh >= VIEW_FH_BASE:
            raise BadFileHandle("a peer volume's file is open for reading only")
        return await self.fs.write(fh, off, data)

    async def flush(self, fh: int) -> None:
        if fh < VIEW_FH_BASE:
            await self.fs.flush(fh)

    async def fsync(self, fh: int) -> None:
        if fh < VIEW_FH_BASE:
            await self.fs.fsync(fh)

    async def release(self, fh: int) -> None:
        if fh < VIEW_FH_BASE:
            await self.fs.release(fh)
        else:
            self._handles.pop(fh, None)

    def stats(self) -> dict[str, object]:
        return {**self.fs.stats(), **self.view.stats(),
                "peer_open_files": len(self._handles)}

    # ------------------------------------------------------------- refresh

    async def run_refresh(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Refresh the view every peer_refresh seconds (the first before the
        mount goes live, so a load right after mounting sees the peers)."""
        started = False
        while True:
            try:
                self.view.tree = await trio.to_thread.run_sync(self.view.refresh_blocking)
                self.view.refreshes += 1
            except (CkptfsError, OSError) as e:
                self.view.last_error = str(e)
                log.warning("peer view not refreshed: %s", e)
            except Exception as e:  # noqa: BLE001 - a bug must not take the mount down
                self.view.last_error = str(e)
                log.exception("peer view refresh failed unexpectedly")
            if not started:
                task_status.started()
                started = True
            await trio.sleep(self.view.refresh_s)


class _MergedNamespace:
    """The namespace calls the adapter makes directly (`fs.ns.*`), merged."""

    def __init__(self, merged: MergedFilesystem) -> None:
        self.m = merged

    def __getattr__(self, name: str):
        return getattr(self.m.fs.ns, name)

    def lookup(self, parent: int, name: bytes) -> Inode:
        if not self.m.is_view(parent):
            return self.m.fs.ns.lookup(parent, name)
        if name == b".":
            a = self.m.attrs(parent)
            if not stat.S_ISDIR(a.inode.mode):
                raise NotADirectory(f"inode {parent} is not a directory")
            return a.inode
        return self.m.lookup(parent, name).inode

    def get(self, ino: int) -> Inode:
        if not self.m.is_view(ino):
            return self.m.fs.ns.get(ino)
        inode = self.m.attrs(ino).inode
        path, _ = self.m._view_entry(ino)
        parent_path = path[:-1]
        own = self.m._own_dir(parent_path)
        if own is not None:
            inode.parent = own.ino
        else:
            node = self.m.view.tree.node(parent_path)
            inode.parent = self.m._view_ino(parent_path, node) if node is not None else ROOT_INO
        return inode

    def entries(self, parent: int, after_cookie: int) -> Iterator[tuple[bytes, int, int]]:
        return self.m.entries(parent, after_cookie)

    def readlink(self, ino: int) -> bytes:
        if not self.m.is_view(ino):
            return self.m.fs.ns.readlink(ino)
        _, node = self.m._view_entry(ino)
        if node is None or not stat.S_ISLNK(node.attrs.mode):
            raise InvalidArgument(f"inode {ino} is not a symlink")
        return node.attrs.target

    def _xattrs(self, ino: int) -> list[tuple[bytes, bytes]]:
        path, node = self.m._view_entry(ino)
        if node is None:
            own = self.m._own_dir(path)
            if own is not None:
                return [(n, self.m.fs.ns.getxattr(own.ino, n))
                        for n in self.m.fs.ns.listxattr(own.ino)]
            node = self.m.view.tree.node(path)
        return node.attrs.xattrs if node is not None else []

    def getxattr(self, ino: int, name: bytes) -> bytes:
        if not self.m.is_view(ino):
            return self.m.fs.ns.getxattr(ino, name)
        for k, v in self._xattrs(ino):
            if k == name:
                return v
        raise NoXattr(f"no xattr {name!r}")

    def listxattr(self, ino: int) -> list[bytes]:
        if not self.m.is_view(ino):
            return self.m.fs.ns.listxattr(ino)
        return [k for k, _ in self._xattrs(ino)]

    def setxattr(self, ino: int, name: bytes, value: bytes, now_ns: int, uid: int) -> None:
        if self.m.is_view(ino):
            raise _read_only(self.m._view_entry(ino)[0])
        self.m.fs.ns.setxattr(ino, name, value, now_ns, uid)

    def removexattr(self, ino: int, name: bytes, now_ns: int, uid: int) -> None:
        if self.m.is_view(ino):
            raise _read_only(self.m._view_entry(ino)[0])
        self.m.fs.ns.removexattr(ino, name, now_ns, uid)
