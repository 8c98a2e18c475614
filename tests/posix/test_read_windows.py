"""Read windows (chunkread.py): a reader's cached piece of a file's committed
map must never outlive a change to it. Each test reads a file through a real
mount (so its window is loaded), changes the map another way, pushes the
pages out of the kernel's cache, and reads again: the new bytes, never the
old ones (a stale window gives old bytes, or EIO where the log space was
reused)."""

from __future__ import annotations

import os
import random

import pytest

from posix_helpers import check_clean, write_file

MiB = 1 << 20


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def pread_fresh(fd: int, n: int, off: int) -> bytes:
    """n bytes at off from the daemon, not from the kernel's page cache."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    out = bytearray()
    while len(out) < n:
        got = os.pread(fd, n - len(out), off + len(out))
        if not got:
            break
        out += got
    return bytes(out)


def read_fresh(path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return pread_fresh(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def windows_loaded(m) -> int:
    return m.stat()["read_window_loads"]


@pytest.mark.parametrize("sync", ["close", "lazy"])
def test_overwrite_by_another_fd_is_read_by_an_open_reader(make_mount, fsck_clean, sync):
    m = make_mount(options=["pmem_size=256M", f"sync={sync}"])
    old = rand(8 * MiB, 1)
    write_file(m.path / "f", old)
    reader = os.open(m.path / "f", os.O_RDONLY)
    try:
        loads = windows_loaded(m)
        assert pread_fresh(reader, 8 * MiB, 0) == old
        assert pread_fresh(reader, 1 * MiB, 2 * MiB) == old[2 * MiB:3 * MiB]
        assert windows_loaded(m) == loads + 1, "the second read did not use the window"
        new = rand(3 * MiB + 777, 2)
        writer = os.open(m.path / "f", os.O_WRONLY)
        try:
            os.pwrite(writer, new, 2 * MiB + 5)
        finally:
            os.close(writer)            # commits: the overlay is gone, the map changed
        want = old[:2 * MiB + 5] + new + old[2 * MiB + 5 + len(new):]
        assert pread_fresh(reader, 8 * MiB, 0) == want
    finally:
        os.close(reader)
    m.sync()
    assert read_fresh(m.path / "f") == want
    check_clean(fsck_clean, m)


def test_write_after_read_through_the_same_fd(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=256M"])
    old = rand(6 * MiB, 3)
    write_file(m.path / "f", old)
    fd = os.open(m.path / "f", os.O_RDWR)
    try:
        assert pread_fresh(fd, 6 * MiB, 0) == old
        new = rand(MiB, 4)
        os.pwrite(fd, new, 4 * MiB)
        os.fsync(fd)                    # committed while the fd stays open
        want = old[:4 * MiB] + new + old[5 * MiB:]
        assert pread_fresh(fd, 6 * MiB, 0) == want
    finally:
        os.close(fd)
    assert read_fresh(m.path / "f") == want
    check_clean(fsck_clean, m)


def test_truncate_then_extend_reads_zeros(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=256M"])
    old = rand(8 * MiB, 5)
    write_file(m.path / "f", old)
    reader = os.open(m.path / "f", os.O_RDONLY)
    try:
        assert pread_fresh(reader, 8 * MiB, 0) == old
    finally:
        os.close(reader)
    os.truncate(m.path / "f", 3 * MiB + 10)     # not open: punched out of the map now
    os.truncate(m.path / "f", 8 * MiB)
    want = old[:3 * MiB + 10] + bytes(5 * MiB - 10)
    assert read_fresh(m.path / "f") == want
    reader = os.open(m.path / "f", os.O_RDONLY)
    try:
        assert pread_fresh(reader, 8 * MiB, 0) == want
        os.truncate(m.path / "f", 2 * MiB)      # open for reading: changes, commits at close
        os.truncate(m.path / "f", 4 * MiB)
    finally:
        os.close(reader)
    assert read_fresh(m.path / "f") == old[:2 * MiB] + bytes(2 * MiB)
    check_clean(fsck_clean, m)


def test_rename_over_a_file_being_read(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=256M"])
    a, b = rand(5 * MiB, 6), rand(4 * MiB + 3, 7)
    write_file(m.path / "a", a)
    write_file(m.path / "b", b)
    reader = os.open(m.path / "a", os.O_RDONLY)
    try:
        assert pread_fresh(reader, 5 * MiB, 0) == a
        os.rename(m.path / "b", m.path / "a")
        assert read_fresh(m.path / "a") == b           # the name: the other file
        assert pread_fresh(reader, 5 * MiB, 0) == a    # the open file: still its bytes
        c = rand(5 * MiB, 8)
        write_file(m.path / "a", c)                    # O_TRUNC rewrite of what was b
        assert read_fresh(m.path / "a") == c
        assert pread_fresh(reader, 5 * MiB, 0) == a
    finally:
        os.close(reader)
    check_clean(fsck_clean, m)


def test_tiering_a_file_that_was_read_then_log_space_reused(make_mount, fsck_clean):
    """The file's chunks go to packs and their log space to another file: a
    window still naming the log would read the other file's bytes (EIO)."""
    m = make_mount(options=["pmem_size=64M", "hot_versions=0"])
    a = rand(24 * MiB, 9)
    write_file(m.path / "a", a)
    fd = os.open(m.path / "a", os.O_RDONLY)
    try:
        assert pread_fresh(fd, 24 * MiB, 0) == a       # its window names LOG chunks
    finally:
        os.close(fd)                                   # open files stay hot
    m.tier_now("--all")
    assert m.stat()["cold_logical_bytes"] >= 24 * MiB
    filler = rand(56 * MiB, 10)                        # more than the log has left
    write_file(m.path / "filler", filler)
    fd = os.open(m.path / "a", os.O_RDONLY)
    try:
        assert pread_fresh(fd, 24 * MiB, 0) == a
    finally:
        os.close(fd)
    assert read_fresh(m.path / "filler") == filler
    check_clean(fsck_clean, m)
