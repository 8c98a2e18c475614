"""Rewrites answered in C from a file's rewrite window (native/ckptfs_fuse.c, staging.py).

After a write out of stream order the stager opens the file's rewrite
window: the fast path writes the next WRITEs at other offsets into log space
reserved for them, answers them, and folds each into the file's changes as
a staged record before any Python runs; a WRITE the daemon would stream
(the stream's next byte, or past where the file's changes end when it has
no stream) still goes to the daemon. These tests check that rewrites are
answered in C (the counters), that every byte is where it belongs through
fsyncs, reads from the daemon, a stream going on beside them, a truncate
and a remount, and that a kill keeps exactly what the last fsync made
durable.
"""

from __future__ import annotations

import os
import random

from ckptfs import control

from posix_helpers import (check_clean, close_after_kill, pattern, pread_all,
                           push_to_daemon, read_file, remount_and_check)

KiB = 1 << 10
MiB = 1 << 20


def _answered_in_c(m) -> int:
    # Asked in this process: `ckptfs stat` would be a child that inherits the
    # test's fds, and its exec closes them: a FLUSH, which commits the file.
    return control.request(str(m.path), "stat")["fuse_write_answered_in_c"]


def _rewrite(fd: int, want: bytearray, rng: random.Random, n: int, size: int, seed: int) -> None:
    """n writes of size bytes at random page-aligned offsets inside want."""
    for i in range(n):
        off = rng.randrange(len(want) // 4096 - size // 4096 + 1) * 4096
        piece = pattern(size, seed=seed * 1000 + i)
        assert os.pwrite(fd, piece, off) == size
        want[off:off + size] = piece


def test_rewrites_are_answered_in_c_and_byte_exact(make_mount, fsck_clean):
    """Cycles of 16 random 4 KiB rewrites (and some of 12 KiB) + fsync, the
    file read back from the daemon in between and after a remount."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    path = m.path / "rand.bin"
    want = bytearray(pattern(16 * MiB, seed=1))
    path.write_bytes(want)
    before = _answered_in_c(m)
    rng = random.Random(2)
    fd = os.open(path, os.O_RDWR)
    try:
        for cycle in range(40):
            _rewrite(fd, want, rng, 16, 12 * KiB if cycle % 5 == 4 else 4 * KiB, cycle)
            os.fsync(fd)
            if cycle % 10 == 9:
                push_to_daemon(fd)
                assert pread_all(fd, len(want), 0) == want, f"cycle {cycle}"
        # Rewrites not yet committed, read back from the open file's changes.
        _rewrite(fd, want, rng, 40, 4 * KiB, 99)
        push_to_daemon(fd)
        assert pread_all(fd, len(want), 0) == want
        answered = _answered_in_c(m) - before
        # The first rewrite after each fsync opens the window: about 15 of 16.
        assert answered >= 400, answered
        os.fsync(fd)
    finally:
        os.close(fd)
    remount_and_check(fsck_clean, m, path, want)


def test_the_window_stays_open_across_an_fsync(make_mount, fsck_clean):
    """A commit gives a file being rewritten its rewrite window back: every
    rewrite of the cycles after the first is answered in C (the first of
    each cycle went to the daemon before, which opened the window again),
    the bytes read back as written through fsyncs, reads and a remount."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    path = m.path / "rand.bin"
    want = bytearray(pattern(16 * MiB, seed=6))
    path.write_bytes(want)
    rng = random.Random(7)
    fd = os.open(path, os.O_RDWR)
    try:
        _rewrite(fd, want, rng, 16, 4 * KiB, 0)
        os.fsync(fd)
        stat = control.request(str(m.path), "stat")
        writes, in_c = stat["fuse_requests"].get("WRITE", 0), stat["fuse_write_answered_in_c"]
        for cycle in range(1, 25):
            _rewrite(fd, want, rng, 16, 4 * KiB, cycle)
            os.fsync(fd)
            if cycle % 8 == 0:
                push_to_daemon(fd)
                assert pread_all(fd, len(want), 0) == want, f"cycle {cycle}"
        stat = control.request(str(m.path), "stat")
        writes = stat["fuse_requests"]["WRITE"] - writes
        in_c = stat["fuse_write_answered_in_c"] - in_c
        # Only a write right after a read (a request about the file closes
        # the window in C) goes to the daemon: 2 here; 24 more before.
        assert writes >= 300 and writes - in_c <= 2, (writes, in_c)
    finally:
        os.close(fd)
    remount_and_check(fsck_clean, m, path, want)


def test_rewrites_beside_a_stream_and_a_truncate(make_mount, fsck_clean):
    """A file streamed a MiB at a time with rewrites of what it already has in
    between (the stream's next WRITE still goes to the daemon, which streams
    it), then truncated below some rewrites and rewritten again."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    path = m.path / "mixed.bin"
    want = bytearray()
    rng = random.Random(3)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for step in range(24):
            piece = pattern(MiB, seed=100 + step)
            assert os.pwrite(fd, piece, len(want)) == MiB
            want += piece
            if step >= 2:
                _rewrite(fd, want, rng, 8, 4 * KiB, 200 + step)
                push_to_daemon(fd)
            if step % 8 == 7:
                os.fsync(fd)
        assert _answered_in_c(m) > 0
        assert pread_all(fd, len(want), 0) == want
        cut = len(want) - 5 * MiB - 4096 * 3
        os.ftruncate(fd, cut)
        del want[cut:]
        _rewrite(fd, want, rng, 32, 4 * KiB, 300)
        push_to_daemon(fd)
        assert pread_all(fd, len(want) + MiB, 0) == want
        os.fsync(fd)
    finally:
        os.close(fd)
    remount_and_check(fsck_clean, m, path, want)


def test_kill_keeps_what_the_last_fsync_made_durable(make_mount, fsck_clean):
    """SIGKILL after rewrites answered in C that no fsync covered: after the
    remount the file is exactly what the last fsync made durable."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    path = m.path / "rand.bin"
    want = bytearray(pattern(8 * MiB, seed=4))
    path.write_bytes(want)
    rng = random.Random(5)
    fd = os.open(path, os.O_RDWR)
    try:
        for cycle in range(8):
            _rewrite(fd, want, rng, 16, 4 * KiB, cycle)
            os.fsync(fd)
        durable = bytes(want)
        before = _answered_in_c(m)
        _rewrite(fd, want, rng, 64, 4 * KiB, 50)
        push_to_daemon(fd)
        assert _answered_in_c(m) > before
        m.kill()
    finally:
        close_after_kill(fd)
    m.start()
    assert read_file(path) == durable
    check_clean(fsck_clean, m)
