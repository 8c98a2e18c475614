"""READs answered by the FUSE fast path (native/ckptfs_fuse.c): a file whose
read window is published is read without the interpreter. Through a real
mount: the bytes must be the file's (holes, window edges, an odd size), a
damaged block must still be EIO, and a file that gets uncommitted changes
must be read with them, never from the published window."""

from __future__ import annotations

import errno
import os
import random

import pytest

from posix_helpers import check_clean, flip_log_bit, push_to_daemon

MiB = 1 << 20


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def drop_pages(fd: int) -> None:
    """The next reads of fd go to the daemon, not the kernel's page cache."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def pread_all(fd: int, n: int, off: int, step: int = MiB) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = os.pread(fd, min(step, n - len(out)), off + len(out))
        if not got:
            break
        out += got
    return bytes(out)


def answered_in_c(m) -> int:
    return m.stat()["fuse_read_answered_in_c"]


@pytest.mark.parametrize("dedup", ["on", "off"])
def test_reads_answered_in_c_are_the_files_bytes(make_mount, fsck_clean, dedup):
    m = make_mount(options=["pmem_size=256M", f"dedup={dedup}"])
    # 41 MiB + 123 bytes: more than one 32 MiB window, a hole from 10 to
    # 14 MiB + 5, an end that is not on a page.
    head, tail = rand(10 * MiB, 1), rand(27 * MiB + 123 - 5, 2)
    want = head + bytes(4 * MiB + 5) + tail
    fd = os.open(m.path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, head, 0)
        os.pwrite(fd, tail, 14 * MiB + 5)
    finally:
        os.close(fd)
    m.remount()             # committed, nothing in the kernel's cache of the file
    before = answered_in_c(m)
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        assert pread_all(fd, len(want), 0) == want
        assert answered_in_c(m) > before, "no READ was answered by the fast path"
        # Again from the daemon, in pieces that begin and end anywhere.
        rng = random.Random(7)
        for _ in range(40):
            drop_pages(fd)
            off = rng.randrange(len(want))
            n = rng.randrange(1, 3 * MiB)
            assert os.pread(fd, n, off) == want[off:off + n], (off, n)
    finally:
        os.close(fd)
    stats = m.stat()
    assert stats["fuse_read_bytes_in_c"] > 0
    assert stats["bytes_read"] >= len(want)
    check_clean(fsck_clean, m)


def test_damaged_block_is_eio_on_the_fast_path(make_mount):
    m = make_mount(options=["pmem_size=64M"])
    data = rand(8 * MiB, 3)
    (m.path / "f").write_bytes(data)
    m.umount()
    bad_off = 6 * MiB + 12345
    flip_log_bit(m.source, "f", bad_off)
    m.start()
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        # The first READ publishes the window; the damaged block is read
        # after, where the fast path would answer it.
        assert os.pread(fd, MiB, 0) == data[:MiB]
        for _ in range(5):
            # Again until the fast path answers: a tiering pass after the
            # mount may update the chunk records (the window goes, the next
            # READ loads it again in Python).
            before = answered_in_c(m)
            drop_pages(fd)          # what read-ahead brought is asked for again
            assert os.pread(fd, MiB, 2 * MiB) == data[2 * MiB:3 * MiB]
            if answered_in_c(m) > before:
                break
        else:
            raise AssertionError("the window was never read by the fast path")
        drop_pages(fd)
        with pytest.raises(OSError) as err:
            os.pread(fd, MiB, 6 * MiB)
        assert err.value.errno == errno.EIO
        assert m.stat()["fuse_read_passed_on"] > 0
    finally:
        os.close(fd)
    m.umount()


@pytest.mark.parametrize("how", ["overwrite", "truncate"])
def test_uncommitted_change_is_read_not_the_published_window(make_mount, fsck_clean, how):
    m = make_mount(options=["pmem_size=256M"])
    old = rand(6 * MiB, 4)
    (m.path / "f").write_bytes(old)
    reader = os.open(m.path / "f", os.O_RDONLY)
    writer = os.open(m.path / "f", os.O_RDWR)
    try:
        drop_pages(reader)
        before = answered_in_c(m)
        assert pread_all(reader, len(old), 0) == old
        assert answered_in_c(m) > before
        if how == "overwrite":
            new = rand(MiB + 3, 5)
            os.pwrite(writer, new, 2 * MiB + 1)
            want = old[:2 * MiB + 1] + new + old[3 * MiB + 4:]
        else:
            os.ftruncate(writer, 3 * MiB + 7)
            os.ftruncate(writer, 5 * MiB)
            want = old[:3 * MiB + 7] + bytes(2 * MiB - 7)
        # Not committed (the writer is open): the daemon has the change only
        # in the file's overlay.
        push_to_daemon(writer)
        drop_pages(reader)
        assert m.stat()["dirty_files"] == 1
        assert pread_all(reader, 6 * MiB, 0) == want
    finally:
        os.close(writer)
        os.close(reader)
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        drop_pages(fd)
        assert pread_all(fd, 6 * MiB, 0) == want
    finally:
        os.close(fd)
    check_clean(fsck_clean, m)
