"""Writeback errors and the sync-file pattern (issue 10, item 11).

With the writeback cache, write(2) only fills the page cache; the daemon sees
the bytes later, when the kernel writes the pages back. An error the daemon
answers then cannot reach the write(2) that caused it: the kernel records it
on the file (close and fsync report it) and on the whole filesystem, where the
next syncfs(2) of any process on that mount reports it. stress-ng's io
stressor calls syncfs on every mount, which is how an EFBIG answered to one
file's writeback showed up as "syncfs failed, errno=27".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import random
import time

from posix_helpers import (SYNC_FILE_RANGE_WAIT_AFTER, SYNC_FILE_RANGE_WAIT_BEFORE,
                           SYNC_FILE_RANGE_WRITE, check_clean, expect_errno, read_file)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]

# The kernel's largest FUSE file size (MAX_LFS_FILESIZE): the last byte is at LIMIT - 1.
LIMIT = (1 << 63) - 1


def syncfs(fd: int) -> None:
    if _libc.syncfs(fd) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"syncfs: {os.strerror(e)}")


def sync_file_range(fd: int, off: int, length: int, flags: int) -> None:
    if _libc.sync_file_range(fd, off, length, flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"sync_file_range: {os.strerror(e)}")


def test_write_the_kernel_accepts_never_fails_at_writeback(mounted, fsck_clean):
    """Bytes at 2^62 and at the kernel's last offset: close and syncfs succeed, the
    bytes read back after a remount.

    Before the fix ckptfs's own limit was 2^62: write(2) succeeded, writeback got
    EFBIG, close said EIO and the next syncfs of the mount said EFBIG."""
    dir_fd = os.open(mounted.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        syncfs(dir_fd)
        far = mounted.path / "far"
        fd = os.open(far, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            assert os.pwrite(fd, b"A", 1 << 62) == 1
            assert os.pwrite(fd, b"Z", LIMIT - 1) == 1
            # Past the last byte the kernel refuses (offset + length overflows).
            expect_errno(errno.EINVAL, os.pwrite, fd, b"YZ", LIMIT - 1)
        finally:
            os.close(fd)                    # EIO here before the fix
        syncfs(dir_fd)                      # EFBIG here before the fix
    finally:
        os.close(dir_fd)
    assert os.stat(far).st_size == LIMIT
    mounted.remount()
    assert os.stat(far).st_size == LIMIT
    fd = os.open(far, os.O_RDONLY)
    try:
        assert os.pread(fd, 2, 1 << 62) == b"A\0"
        assert os.pread(fd, 2, LIMIT - 2) == b"\0Z"
    finally:
        os.close(fd)
    check_clean(fsck_clean, mounted)


def test_truncate_to_the_kernel_limit(mounted, fsck_clean):
    p = mounted.path / "t"
    p.write_bytes(b"head")
    os.truncate(p, LIMIT)
    mounted.remount()
    assert os.stat(p).st_size == LIMIT
    with open(p, "rb") as f:
        assert f.read(8) == b"head\0\0\0\0"
    check_clean(fsck_clean, mounted)


def test_sync_file_pattern_with_syncfs_beside(mounted, fsck_clean):
    """What stress-ng's sync-file stressor does (an unlinked file filled with zeros
    in 8 KiB writes, sync_file_range over forward, reverse and random ranges, then
    truncated and filled again), with syncfs of the mount between rounds as the io
    stressor does: no call fails, and a committed file beside it is untouched."""
    keep = os.urandom(3 << 20)
    (mounted.path / "keep").write_bytes(keep)
    size = 8 << 20
    rng = random.Random(11)
    modes = [SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE,
             SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER,
             SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WAIT_AFTER, 0]
    dir_fd = os.open(mounted.path, os.O_RDONLY | os.O_DIRECTORY)
    path = mounted.path / "sync-file.tmp"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.unlink(path)
    zeros = bytes(8192)
    deadline = time.monotonic() + 60
    try:
        for rnd in range(6):
            mode = modes[rnd % len(modes)]
            os.ftruncate(fd, 0)
            os.fdatasync(fd)
            os.lseek(fd, 0, os.SEEK_SET)
            for _ in range(size // len(zeros)):
                os.write(fd, zeros)
            off = 0
            while off < size:
                n = (rng.getrandbits(32) & 0x1fc00) + 1024
                start = off if rnd % 2 == 0 else size - off
                sync_file_range(fd, start, n, mode)
                off += n
            for _ in range(16):
                sync_file_range(fd, rng.randrange(size) & ~0x1ffff, 128 << 10, mode)
            syncfs(dir_fd)
            assert time.monotonic() < deadline, "the sync-file pattern is far too slow"
        os.fsync(fd)
        assert os.fstat(fd).st_size == size
        os.lseek(fd, 0, os.SEEK_SET)
        assert os.read(fd, 1 << 20) == bytes(1 << 20)
    finally:
        os.close(fd)
        os.close(dir_fd)
    assert read_file(mounted.path / "keep") == keep
    check_clean(fsck_clean, mounted)
