"""Adopt what was already in SOURCE when ckptfs first mounts over it.

The first mount of a directory walks it once and gives every file, folder
and symlink an inode in the index, with its attributes and xattrs. File
bytes are not copied: each file becomes one SOURCE chunk that names the
original path and records the original's device and inode, so a 1 TB
directory adopts in the time it takes to list it. Writes through the mount
land in the log like any other; when the last reference to an adopted file's
bytes goes (unlink, overwrite, truncate), the original file is removed so its
disk space comes back (`sources.SourceFiles`, which also refuses an original
that is no longer the file adopted).

Other users may be changing the tree while it is walked. The walk never
follows a symlink: each directory is opened beneath the SOURCE fd with no
symlink at any component (`native.open_beneath`), and listed, stat'ed and
read through that fd (scandir on the fd, fstatat, readlinkat); a directory
or file whose device and inode differ from what its parent's listing showed
(swapped meanwhile) is skipped with a warning.

Runs once, before the mount is live, in one durable transaction. May block.
"""

from __future__ import annotations

import logging
import os
import stat

from . import index as ix
from . import native
from .index import CHUNK_SOURCE, ROOT_INO, Chunk, DirectTxn, Inode
from .namespace import ACL_ACCESS, ACL_DEFAULT, SYSTEM_PREFIX, XATTR_INODE_MAX_BYTES
from .options import STATE_DIR

log = logging.getLogger(__name__)


def adopt_tree(txn: DirectTxn, source_fd: int, counters: dict[bytes, int]) -> int:
    """Give every entry below source_fd an inode; return how many were adopted."""
    seen: dict[tuple[int, int], int] = {}     # (st_dev, st_ino) -> ino, for hard links
    adopted = 0
    root = ix.get_inode(txn, ROOT_INO)
    st = os.fstat(source_fd)
    source_dev = st.st_dev
    root.mode, root.uid, root.gid = st.st_mode, st.st_uid, st.st_gid
    root.mtime_ns, root.ctime_ns, root.atime_ns = st.st_mtime_ns, st.st_ctime_ns, st.st_atime_ns
    _copy_xattrs(txn, ROOT_INO, source_fd, b"")

    def next_id(name: bytes) -> int:
        value = counters[name]
        counters[name] = value + 1
        return value

    # Directories still to list: (inode, path below SOURCE, (st_dev, st_ino) listed).
    stack: list[tuple[Inode, bytes, tuple[int, int]]] = [(root, b"", (st.st_dev, st.st_ino))]
    while stack:
        parent, rel, identity = stack.pop()
        try:
            dir_fd = _open_dir(source_fd, rel, identity)
        except OSError as e:
            log.warning("cannot list pre-existing directory %r: %s", rel, e.strerror)
            ix.put_inode(txn, parent)
            continue
        try:
            with os.scandir(dir_fd) as it:
                entries = sorted(((os.fsencode(e.name), e) for e in it), key=lambda x: x[0])
        except OSError as e:
            log.warning("cannot list pre-existing directory %r: %s", rel, e.strerror)
            entries = []
        try:
            for name, entry in entries:
                if parent.ino == ROOT_INO and name == STATE_DIR.encode():
                    continue
                path = rel + b"/" + name if rel else name
                try:
                    est = entry.stat(follow_symlinks=False)     # fstatat on dir_fd
                except OSError as e:
                    log.warning("cannot stat pre-existing %r: %s", path, e.strerror)
                    continue
                key = (est.st_dev, est.st_ino)
                is_dir = stat.S_ISDIR(est.st_mode)
                if key in seen and not is_dir:
                    ino = seen[key]
                    inode = ix.get_inode(txn, ino)
                    inode.nlink += 1
                    ix.put_inode(txn, inode)
                    _add_original_name(txn, ino, path)
                else:
                    ino = next_id(b"next_ino")
                    seen[key] = ino
                    inode = Inode(ino, est.st_mode, 2 if is_dir else 1, est.st_uid, est.st_gid,
                                  rdev=est.st_rdev, atime_ns=est.st_atime_ns,
                                  mtime_ns=est.st_mtime_ns, ctime_ns=est.st_ctime_ns,
                                  parent=parent.ino if is_dir else 0)
                    if stat.S_ISLNK(est.st_mode):
                        try:
                            target = os.readlink(name, dir_fd=dir_fd)
                        except OSError as e:
                            log.warning("cannot read pre-existing symlink %r: %s", path,
                                        e.strerror)
                            continue
                        inode.size = len(target)
                        ix.put_symlink(txn, ino, target)
                    elif stat.S_ISREG(est.st_mode) and est.st_size > 0:
                        fs, dev = ((ix.SOURCE_FS_SAME, 0) if est.st_dev == source_dev
                                   else (ix.SOURCE_FS_OTHER, est.st_dev))
                        chunk = Chunk(next_id(b"next_chunk"), CHUNK_SOURCE, 1, est.st_size,
                                      source_path=path, source_fs=fs, source_dev=dev,
                                      source_ino=est.st_ino)
                        ix.add_chunk(txn, chunk)
                        ix.put_extent(txn, ino, ix.Extent(0, est.st_size, chunk.chunk_no, 0))
                        inode.size = inode.data_bytes = est.st_size
                    ix.put_inode(txn, inode)
                    if not stat.S_ISLNK(est.st_mode):
                        _copy_entry_xattrs(txn, ino, dir_fd, name, path, key)
                    if is_dir:
                        parent.nlink += 1
                        stack.append((inode, path, key))
                cookie = next_id(b"next_cookie")
                ix.add_entry(txn, parent.ino, name, ino, cookie)
                adopted += 1
        finally:
            if dir_fd != source_fd:
                os.close(dir_fd)
        ix.put_inode(txn, parent)
    ix.write_counters(txn, counters)
    return adopted


def _open_dir(source_fd: int, rel: bytes, identity: tuple[int, int]) -> int:
    """The directory rel below SOURCE, reached with no symlink on the way, if it
    is still the one its parent listed."""
    if not rel:
        return source_fd
    fd = native.open_beneath(source_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != identity:
        os.close(fd)
        raise OSError(0, "replaced while it was being adopted", rel)
    return fd


def _add_original_name(txn: DirectTxn, ino: int, path: bytes) -> None:
    """Another hard link to an adopted file: its space comes back only when every
    original name is removed, so the chunk remembers them all."""
    extent = ix.first_extent(txn, ino)
    if extent is None:
        return          # empty file: no bytes to give back
    chunk = ix.get_chunk(txn, extent.chunk_no)
    chunk.source_path += b"\0" + path
    ix.put_chunk(txn, chunk)


def _copy_entry_xattrs(txn: DirectTxn, ino: int, dir_fd: int, name: bytes, path: bytes,
                       identity: tuple[int, int]) -> None:
    """xattrs of a listed entry (not a symlink), through an O_PATH fd of it."""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == identity:
            _copy_xattrs(txn, ino, fd, path)
    finally:
        os.close(fd)


def _copy_xattrs(txn: DirectTxn, ino: int, fd: int, path: bytes) -> None:
    """Copy what the namespace would accept: system.* only the ACL names, at most
    XATTR_INODE_MAX_BYTES in all (the rest is left out, with a warning)."""
    where = f"/proc/self/fd/{fd}"        # works for O_PATH fds, unlike f*xattr
    try:
        names = os.listxattr(where)
    except OSError:
        return
    room = XATTR_INODE_MAX_BYTES
    for name in sorted(names):
        raw_name = os.fsencode(name)
        if raw_name.startswith(SYSTEM_PREFIX) and raw_name not in (ACL_ACCESS, ACL_DEFAULT):
            continue
        try:
            value = os.getxattr(where, name)
        except OSError:
            continue
        if len(raw_name) + len(value) > room:
            log.warning("pre-existing %r: xattr %s and any after it left out (over %d bytes "
                        "of xattrs)", path or b".", name, XATTR_INODE_MAX_BYTES)
            return
        room -= len(raw_name) + len(value)
        ix.put_xattr(txn, ino, raw_name, value)
