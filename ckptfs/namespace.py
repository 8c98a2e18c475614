"""Inodes, directory entries and attributes, with the POSIX rules for them.

Every method runs synchronously on the trio thread and changes the index's
open batch, so each operation is atomic (one batch is one LMDB transaction)
and visible to the next request at once. Permission checks are the kernel's
(`default_permissions`); this layer enforces what the kernel leaves to the
filesystem: existence, types, emptiness, name length, link counts.

File bytes are not this module's business: when an inode's last link and
last user are gone, `Filesystem` asks `FileData` to drop its extents.
"""

from __future__ import annotations

import stat
import struct
from typing import Iterator, Optional

from . import index as ix
from .errors import (AlreadyExists, InvalidArgument, IsADirectory, NameTooLong,
                     NoXattr, NoXattrSpace, NotADirectory, NotEmpty, NotFound, NotPermitted,
                     NotSupported, StaleHandle, TooManyLinks, ValueTooLarge)
from .index import ROOT_INO, Index, Inode

NAME_MAX = 255
XATTR_NAME_MAX = 255
XATTR_VALUE_MAX = 64 * 1024
# Extended attributes of one inode, names and values together, at most: the
# most one listxattr or getxattr call can carry (the kernel's XATTR_LIST_MAX
# and XATTR_SIZE_MAX), so every attribute set can be listed and read back, and
# far more than checkpoints use (ext4 fits them in one 4 KiB block). It bounds
# what any user who may write a file can add to the index per inode; beyond
# it setxattr answers ENOSPC, as ext4 does when its xattr space is full.
XATTR_INODE_MAX_BYTES = 64 * 1024
LINK_MAX = 65000
STATE_DIR_NAME = b".ckptfs"
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
# POSIX ACL xattrs (the kernel passes them through: FUSE_POSIX_ACL is not negotiated).
ACL_ACCESS = b"system.posix_acl_access"
ACL_DEFAULT = b"system.posix_acl_default"
# The kernel leaves every check on system.* names to the filesystem: these two
# are the only ones ckptfs knows; any other is refused as ext4 refuses it.
SYSTEM_PREFIX = b"system."
_ACL_HEADER = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")
_ACL_VERSION = 2
_ACL_SHIFT = {0x01: 6, 0x04: 3, 0x20: 0}      # USER_OBJ, GROUP_OBJ, OTHER


def acl_mode_bits(value: bytes) -> int:
    """The rwx bits a minimal access ACL stands for (what cp -a and rsync -A set).

    Extended ACLs (named users or groups, a mask) are refused: ckptfs does not
    enforce them, and silently storing them would claim protection it lacks.
    """
    if len(value) < _ACL_HEADER.size or (len(value) - _ACL_HEADER.size) % _ACL_ENTRY.size \
            or _ACL_HEADER.unpack_from(value)[0] != _ACL_VERSION:
        raise InvalidArgument("malformed POSIX ACL")
    bits, seen = 0, set()
    for off in range(_ACL_HEADER.size, len(value), _ACL_ENTRY.size):
        tag, perm, _ = _ACL_ENTRY.unpack_from(value, off)
        if tag not in _ACL_SHIFT:
            raise NotSupported("extended POSIX ACLs are not supported")
        if tag in seen or perm & ~0o7:
            raise InvalidArgument("malformed POSIX ACL")
        seen.add(tag)
        bits |= perm << _ACL_SHIFT[tag]
    if len(seen) != 3:
        raise InvalidArgument("malformed POSIX ACL")
    return bits


class Namespace:
    def __init__(self, index: Index) -> None:
        self.index = index

    # ----------------------------------------------------------------- inodes

    def get(self, ino: int) -> Inode:
        inode = ix.get_inode(self.index, ino)
        if inode is None:
            raise StaleHandle(f"inode {ino} no longer exists")
        return inode

    def put(self, inode: Inode) -> None:
        ix.put_inode(self.index, inode)

    def lookup(self, parent: int, name: bytes) -> Inode:
        self._check_name(name)
        if name == b".":
            return self.get(parent)
        if name == b"..":
            return self.get(self._dir(parent).parent)
        entry = ix.lookup_entry(self.index, parent, name)
        if entry is None:
            self._dir(parent)
            raise NotFound(f"{name!r} not in directory {parent}")
        return self.get(entry[0])

    def _dir(self, ino: int) -> Inode:
        inode = self.get(ino)
        if not stat.S_ISDIR(inode.mode):
            raise NotADirectory(f"inode {ino} is not a directory")
        return inode

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise NameTooLong(f"name of {len(name)} bytes")

    def _check_new_name(self, parent: int, name: bytes) -> None:
        self._check_name(name)
        if name in (b".", b"..", b"") or b"/" in name:
            raise InvalidArgument(f"bad name {name!r}")
        if parent == ROOT_INO and name == STATE_DIR_NAME:
            # The state directory below the mount is never part of the namespace.
            raise NotPermitted("'.ckptfs' at the top of a ckptfs mount is reserved")

    # ---------------------------------------------------------------- create

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, now_ns: int,
               rdev: int = 0, target: Optional[bytes] = None) -> Inode:
        """Make a file, directory, symlink or device node named name in parent."""
        self._check_new_name(parent, name)
        pdir = self._dir(parent)
        if ix.has_entry(self.index, parent, name):
            raise AlreadyExists(f"{name!r} exists in directory {parent}")
        if pdir.mode & stat.S_ISGID:
            # BSD group semantics on setgid directories, as ext4 does.
            gid = pdir.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        is_dir = stat.S_ISDIR(mode)
        if is_dir and pdir.nlink >= LINK_MAX:
            raise TooManyLinks(f"directory {parent} has too many subdirectories")
        ino = self.index.allocate_id(b"next_ino")
        inode = Inode(ino, mode, 2 if is_dir else 1, uid, gid, rdev=rdev,
                      atime_ns=now_ns, mtime_ns=now_ns, ctime_ns=now_ns,
                      parent=parent if is_dir else 0)
        if target is not None:
            inode.size = len(target)
            ix.put_symlink(self.index, ino, target)
        self.put(inode)
        self._add_entry(pdir, name, ino, now_ns, subdir=is_dir)
        return inode

    def _add_entry(self, pdir: Inode, name: bytes, ino: int, now_ns: int, subdir: bool) -> None:
        cookie = self.index.allocate_id(b"next_cookie")
        ix.add_entry(self.index, pdir.ino, name, ino, cookie)
        if subdir:
            pdir.nlink += 1
        pdir.mtime_ns = pdir.ctime_ns = now_ns
        self.put(pdir)

    def _remove_entry(self, pdir: Inode, name: bytes, now_ns: int, subdir: bool) -> None:
        entry = ix.lookup_entry(self.index, pdir.ino, name)
        assert entry is not None
        ix.remove_entry(self.index, pdir.ino, name, entry[1])
        if subdir:
            pdir.nlink -= 1
        pdir.mtime_ns = pdir.ctime_ns = now_ns
        self.put(pdir)

    def link(self, ino: int, parent: int, name: bytes, now_ns: int) -> Inode:
        self._check_new_name(parent, name)
        inode = self.get(ino)
        if stat.S_ISDIR(inode.mode):
            raise NotPermitted("hard links to directories are not allowed")
        if inode.nlink == 0:
            raise NotFound(f"inode {ino} was unlinked")
        if inode.nlink >= LINK_MAX:
            raise TooManyLinks(f"inode {ino} has {inode.nlink} links")
        pdir = self._dir(parent)
        if ix.has_entry(self.index, parent, name):
            raise AlreadyExists(f"{name!r} exists in directory {parent}")
        inode.nlink += 1
        inode.ctime_ns = now_ns
        self.put(inode)
        self._add_entry(pdir, name, ino, now_ns, subdir=False)
        return inode

    # ---------------------------------------------------------------- remove

    def unlink(self, parent: int, name: bytes, now_ns: int) -> Inode:
        """Remove a non-directory entry; return the inode with its new nlink."""
        pdir = self._dir(parent)
        child = self.lookup(parent, name)
        if stat.S_ISDIR(child.mode):
            raise IsADirectory(f"{name!r} is a directory")
        self._remove_entry(pdir, name, now_ns, subdir=False)
        return self._drop_link(child, now_ns)

    def rmdir(self, parent: int, name: bytes, now_ns: int) -> Inode:
        if name == b".":
            raise InvalidArgument("rmdir of '.'")
        if name == b"..":
            raise NotEmpty("rmdir of '..'")
        pdir = self._dir(parent)
        child = self.lookup(parent, name)
        if not stat.S_ISDIR(child.mode):
            raise NotADirectory(f"{name!r} is not a directory")
        self._check_empty(child.ino)
        self._remove_entry(pdir, name, now_ns, subdir=True)
        child.nlink = 0
        child.ctime_ns = now_ns
        self.put(child)
        ix.add_orphan(self.index, child.ino)
        return child

    def _check_empty(self, ino: int) -> None:
        if ix.has_entries(self.index, ino):
            raise NotEmpty(f"directory {ino} is not empty")

    def _drop_link(self, inode: Inode, now_ns: int) -> Inode:
        inode.nlink -= 1
        inode.ctime_ns = now_ns
        self.put(inode)
        if inode.nlink == 0:
            # Kept until the last open handle and kernel reference are gone;
            # the orphan record lets the next mount finish the job after a crash.
            ix.add_orphan(self.index, inode.ino)
        return inode

    def delete_inode(self, ino: int) -> None:
        """Drop an unlinked inode's record, xattrs and symlink target."""
        ix.delete_inode(self.index, ino)

    def orphans(self) -> list[int]:
        return ix.orphans(self.index)

    # ---------------------------------------------------------------- rename

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int, now_ns: int) -> Optional[Inode]:
        """Move an entry; return the inode it replaced (its nlink already dropped)."""
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == (RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise InvalidArgument(f"rename flags {flags:#x}")
        self._check_new_name(new_parent, new_name)
        src_dir = self._dir(old_parent)
        dst_dir = src_dir if new_parent == old_parent else self._dir(new_parent)
        src = self.lookup(old_parent, old_name)
        entry = ix.lookup_entry(self.index, new_parent, new_name)
        dst = None if entry is None else self.get(entry[0])
        src_is_dir = stat.S_ISDIR(src.mode)
        if src_is_dir and new_parent != old_parent:
            self._check_not_ancestor(src.ino, new_parent)

        if flags & RENAME_EXCHANGE:
            if dst is None:
                raise NotFound(f"{new_name!r} does not exist for RENAME_EXCHANGE")
            self._exchange(src_dir, old_name, src, dst_dir, new_name, dst, now_ns)
            return None
        if dst is not None and flags & RENAME_NOREPLACE:
            raise AlreadyExists(f"{new_name!r} exists")
        if dst is not None and dst.ino == src.ino:
            return None     # POSIX: renaming a link onto itself does nothing
        if dst is not None:
            dst_is_dir = stat.S_ISDIR(dst.mode)
            if src_is_dir and not dst_is_dir:
                raise NotADirectory(f"{new_name!r} is not a directory")
            if dst_is_dir and not src_is_dir:
                raise IsADirectory(f"{new_name!r} is a directory")
            if dst_is_dir:
                self._check_empty(dst.ino)

        self._remove_entry(src_dir, old_name, now_ns, subdir=src_is_dir)
        if dst_dir.ino == src_dir.ino:
            dst_dir = src_dir
        replaced = None
        if dst is not None:
            self._remove_entry(dst_dir, new_name, now_ns, subdir=stat.S_ISDIR(dst.mode))
            if stat.S_ISDIR(dst.mode):
                dst.nlink = 0
                dst.ctime_ns = now_ns
                self.put(dst)
                ix.add_orphan(self.index, dst.ino)
                replaced = dst
            else:
                replaced = self._drop_link(dst, now_ns)
        self._add_entry(dst_dir, new_name, src.ino, now_ns, subdir=src_is_dir)
        src = self.get(src.ino)
        src.ctime_ns = now_ns
        if src_is_dir:
            src.parent = dst_dir.ino
        self.put(src)
        return replaced

    def _exchange(self, a_dir: Inode, a_name: bytes, a: Inode, b_dir: Inode, b_name: bytes,
                  b: Inode, now_ns: int) -> None:
        if stat.S_ISDIR(b.mode) and a_dir.ino != b_dir.ino:
            self._check_not_ancestor(b.ino, a_dir.ino)
        for d, name, ino in ((a_dir, a_name, b.ino), (b_dir, b_name, a.ino)):
            ix.retarget_entry(self.index, d.ino, name, ino)
        if a_dir.ino != b_dir.ino:
            a_sub, b_sub = stat.S_ISDIR(a.mode), stat.S_ISDIR(b.mode)
            a_dir.nlink += b_sub - a_sub
            b_dir.nlink += a_sub - b_sub
            if a_sub:
                a.parent = b_dir.ino
            if b_sub:
                b.parent = a_dir.ino
        for d in (a_dir, b_dir):
            d.mtime_ns = d.ctime_ns = now_ns
            self.put(d)
        for n in (a, b):
            n.ctime_ns = now_ns
            self.put(n)

    def _check_not_ancestor(self, ino: int, new_parent: int) -> None:
        cur = new_parent
        while True:
            if cur == ino:
                raise InvalidArgument("cannot move a directory into itself")
            if cur == ROOT_INO:
                return
            cur = self.get(cur).parent

    # --------------------------------------------------------------- readdir

    def entries(self, parent: int, after_cookie: int) -> Iterator[tuple[bytes, int, int]]:
        """(name, ino, cookie) in cookie order, after the given cookie."""
        return ix.list_entries(self.index, parent, after_cookie)

    # ----------------------------------------------------------------- links

    def readlink(self, ino: int) -> bytes:
        target = ix.get_symlink(self.index, ino)
        if target is None:
            raise InvalidArgument(f"inode {ino} is not a symlink")
        return target

    # ----------------------------------------------------------------- xattrs

    def getxattr(self, ino: int, name: bytes) -> bytes:
        self.get(ino)
        _check_system_name(name)
        value = ix.get_xattr(self.index, ino, name)
        if value is None:
            raise NoXattr(f"no xattr {name!r} on inode {ino}")
        return value

    def setxattr(self, ino: int, name: bytes, value: bytes, now_ns: int, uid: int) -> None:
        """Set an xattr for the caller uid. The kernel has checked user.*,
        trusted.* and security.*; system.* is ours to check."""
        if not name or len(name) > XATTR_NAME_MAX:
            raise InvalidArgument(f"xattr name of {len(name)} bytes") if not name else \
                NameTooLong(f"xattr name of {len(name)} bytes")
        if len(value) > XATTR_VALUE_MAX:
            raise ValueTooLarge(f"xattr value of {len(value)} bytes")
        inode = self.get(ino)
        _check_system_name(name)
        if name.startswith(SYSTEM_PREFIX):
            _check_acl_owner(inode, uid, name)
        if name == ACL_ACCESS:
            # As ext4 does with an ACL equivalent to the mode: set the mode, store nothing.
            inode.mode = (inode.mode & ~0o777) | acl_mode_bits(value)
        elif name == ACL_DEFAULT:
            raise NotSupported("default POSIX ACLs are not supported")
        else:
            self._check_xattr_room(ino, name, value)
            self.index.admit(ix.GROWTH_PER_RECORD_BYTES + 2 * (len(name) + len(value)))
            ix.put_xattr(self.index, ino, name, value)
        inode.ctime_ns = now_ns
        self.put(inode)

    def _check_xattr_room(self, ino: int, name: bytes, value: bytes) -> None:
        used = sum(len(k) + len(v) for k, v in ix.xattrs_of(self.index, ino) if k != name)
        if used + len(name) + len(value) > XATTR_INODE_MAX_BYTES:
            raise NoXattrSpace(f"inode {ino}: xattrs would take {used + len(name) + len(value)} "
                               f"bytes, more than {XATTR_INODE_MAX_BYTES}")

    def listxattr(self, ino: int) -> list[bytes]:
        self.get(ino)
        return [k for k, _ in ix.xattrs_of(self.index, ino)]

    def removexattr(self, ino: int, name: bytes, now_ns: int, uid: int) -> None:
        inode = self.get(ino)
        _check_system_name(name)
        if name.startswith(SYSTEM_PREFIX):
            _check_acl_owner(inode, uid, name)
        if ix.get_xattr(self.index, ino, name) is None:
            raise NoXattr(f"no xattr {name!r} on inode {ino}")
        ix.delete_xattr(self.index, ino, name)
        inode.ctime_ns = now_ns
        self.put(inode)


def _check_system_name(name: bytes) -> None:
    if name.startswith(SYSTEM_PREFIX) and name not in (ACL_ACCESS, ACL_DEFAULT):
        raise NotSupported(f"xattr {name!r}: no such system attribute")


def _check_acl_owner(inode: Inode, uid: int, name: bytes) -> None:
    """POSIX ACLs are the owner's (or root's) to change, like the mode."""
    if uid != 0 and uid != inode.uid:
        raise NotPermitted(f"{name.decode()} of inode {inode.ino}: uid {uid} is not its owner")
