"""Adopt what was already in SOURCE when ckptfs first mounts over it.

The first mount of a directory walks it once and gives every file, folder
and symlink an inode in the index, with its attributes and xattrs. File
bytes are not copied: each file becomes one SOURCE chunk that points at the
original path, so a 1 TB directory adopts in the time it takes to list it.
Writes through the mount land in the log like any other; when the last
reference to an adopted file's bytes goes (unlink, overwrite, truncate), the
original file is removed so its disk space comes back.

Runs once, before the mount is live, in one durable transaction. May block.
"""

from __future__ import annotations

import logging
import os
import stat

from . import index as ix
from .index import CHUNK_SOURCE, ROOT_INO, Chunk, DirectTxn, Inode
from .options import STATE_DIR

log = logging.getLogger(__name__)


def adopt_tree(txn: DirectTxn, source_fd: int, counters: dict[bytes, int]) -> int:
    """Give every entry below source_fd an inode; return how many were adopted."""
    seen: dict[tuple[int, int], int] = {}     # (st_dev, st_ino) -> ino, for hard links
    adopted = 0
    root = ix.get_inode(txn, ROOT_INO)
    st = os.fstat(source_fd)
    root.mode, root.uid, root.gid = st.st_mode, st.st_uid, st.st_gid
    root.mtime_ns, root.ctime_ns, root.atime_ns = st.st_mtime_ns, st.st_ctime_ns, st.st_atime_ns
    base = f"/proc/self/fd/{source_fd}".encode()
    _copy_xattrs(txn, ROOT_INO, base)

    def next_id(name: bytes) -> int:
        value = counters[name]
        counters[name] = value + 1
        return value

    stack: list[tuple[Inode, bytes]] = [(root, b"")]
    while stack:
        parent, rel = stack.pop()
        try:
            entries = sorted(os.scandir(base + b"/" + rel if rel else base),
                             key=lambda e: e.name)
        except OSError as e:
            log.warning("cannot list pre-existing directory %r: %s", rel, e.strerror)
            continue
        for entry in entries:
            name = entry.name
            if parent.ino == ROOT_INO and name == STATE_DIR.encode():
                continue
            path = rel + b"/" + name if rel else name
            try:
                est = entry.stat(follow_symlinks=False)
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
                    target = os.readlink(base + b"/" + path)
                    inode.size = len(target)
                    txn.put("symlinks", ix.ino_key(ino), target)
                elif stat.S_ISREG(est.st_mode) and est.st_size > 0:
                    chunk = Chunk(next_id(b"next_chunk"), CHUNK_SOURCE, 1, est.st_size,
                                  source_path=path)
                    ix.add_chunk(txn, chunk)
                    txn.put("extents", ix.extent_key(ino, 0),
                            ix.extent_encode(ix.Extent(0, est.st_size, chunk.chunk_no, 0)))
                    inode.size = inode.data_bytes = est.st_size
                ix.put_inode(txn, inode)
                if not stat.S_ISLNK(est.st_mode):
                    _copy_xattrs(txn, ino, base + b"/" + path)
                if is_dir:
                    parent.nlink += 1
                    stack.append((inode, path))
            cookie = next_id(b"next_cookie")
            txn.put("dirents", ix.dirent_key(parent.ino, name), ix.dirent_value(ino, cookie))
            txn.put("dirlist", ix.dirlist_key(parent.ino, cookie), name)
            adopted += 1
        ix.put_inode(txn, parent)
    for name, value in counters.items():
        txn.put("meta", name, ix.u64_le(value))
    return adopted


def _add_original_name(txn: DirectTxn, ino: int, path: bytes) -> None:
    """Another hard link to an adopted file: its space comes back only when every
    original name is removed, so the chunk remembers them all."""
    raw = txn.get("extents", ix.extent_key(ino, 0))
    if raw is None:
        return          # empty file: no bytes to give back
    chunk = ix.get_chunk(txn, ix.extent_decode(ix.extent_key(ino, 0), raw).chunk_no)
    chunk.source_path += b"\0" + path
    ix.put_chunk(txn, chunk)


def _copy_xattrs(txn: DirectTxn, ino: int, path) -> None:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return
    for name in names:
        try:
            value = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue
        txn.put("xattrs", ix.xattr_key(ino, name.encode()), value)
