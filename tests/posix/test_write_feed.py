"""A stream write is answered before its chunks are cut (staging.py).

The chunk feed (gear scan, BLAKE3, CRC-32C) runs behind the writes: the
kernel gets its WRITE reply once the bytes are in the log and the overlay.
Everything that needs the chunks waits for the feed instead: a read of the
file, its fsync and close. The feed's debug hook (CKPTFS_DEBUG_PAUSE
"stream-feed") holds it at its first call, so these tests see each order
for certain, without sleeping and hoping.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from typing import Optional

import pytest

from posix_helpers import close_after_kill, in_thread, pattern, push_to_daemon, read_file

MiB = 1 << 20
WAIT_S = 60.0


def _wait_until(cond, what: str, timeout_s: float = WAIT_S) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.02)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[:MiB]):]


def _paused_mount(make_mount, monkeypatch, marker):
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"stream-feed:{marker}")
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    return m


def test_write_reply_does_not_wait_for_the_chunk_feed(make_mount, monkeypatch, tmp_path,
                                                      fsck_clean):
    """The WRITEs of a file written front to back are answered while its chunk
    feed is held; a read of the file and its fsync wait for the feed and then
    see every byte; after a remount the file is whole and fsck is clean."""
    marker = tmp_path / "feed-paused"
    m = _paused_mount(make_mount, monkeypatch, marker)
    data = pattern(8 * MiB, seed=14)
    path = m.path / "stream.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        # Every page written back and answered (no commit): with the reply
        # waiting for the chunks, this would wait as long as the feed is held.
        pushed, out = in_thread(push_to_daemon, fd)
        pushed.join(WAIT_S)
        assert not pushed.is_alive(), "the WRITE replies waited for the held chunk feed"
        assert out == [None], out
        # The feed starts on its worker when the trio thread gets to it, which
        # may be after the last reply went out.
        _wait_until(marker.exists, "the chunk feed never ran")
        # The page cache is dropped: a read goes to the daemon, which waits for
        # the feed; so does fsync.
        reader, got = in_thread(os.pread, fd, 2 * MiB, 3 * MiB)
        syncer, synced = in_thread(os.fsync, fd)
        time.sleep(0.5)
        assert reader.is_alive() and syncer.is_alive(), \
            f"a read or fsync did not wait for the chunk feed: {got} {synced}"
        marker.unlink()
        reader.join(WAIT_S)
        syncer.join(WAIT_S)
        assert got == [data[3 * MiB:5 * MiB]]
        assert synced == [None]
    finally:
        marker.unlink(missing_ok=True)      # a failed test must not hang in close
        os.close(fd)
    stat = m.stat()
    assert stat["files"] == 1
    m.remount()
    assert read_file(path) == data
    fsck_clean(m)


def test_crash_while_the_feed_is_behind_keeps_the_fsynced_content(make_mount, monkeypatch,
                                                                  tmp_path):
    """A file fsynced, then rewritten front to back and killed while the
    rewrite's chunk feed is held (its WRITEs answered): the file keeps what
    the fsync made durable, nothing of the unfinished rewrite."""
    marker = tmp_path / "feed-paused"
    m = _paused_mount(make_mount, monkeypatch, marker)
    first = pattern(3 * MiB + 4096, seed=1)
    path = m.path / "ckpt.bin"
    # Small writes stored and fed inline: the hook (first feed call on a
    # worker) stays armed for the rewrite below.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(first), 32 * 1024):
            os.pwrite(fd, first[off:off + 32 * 1024], off)
            push_to_daemon(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert not marker.exists()
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    _write_all(fd, pattern(6 * MiB, seed=2))
    pushed, out = in_thread(push_to_daemon, fd)
    pushed.join(WAIT_S)
    assert not pushed.is_alive() and out == [None], out
    _wait_until(marker.exists, "the chunk feed never ran")
    m.kill()
    close_after_kill(fd)
    marker.unlink()
    m.start()
    assert read_file(path) == first


def _log_pages(log_path: str) -> Optional[tuple[int, int]]:
    """(dirty, under writeback) pages of the log file in the page cache
    (cachestat(2), Linux 6.5); None where the kernel lacks it."""
    if platform.machine() != "x86_64":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    rng = (ctypes.c_uint64 * 2)(0, 0)             # off, len (0: to the end)
    st = (ctypes.c_uint64 * 5)()                  # cache, dirty, writeback, evicted, ...
    fd = os.open(log_path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, rng, st, 0) != 0:   # SYS_cachestat
            return None
    finally:
        os.close(fd)
    return int(st[1]), int(st[2])


@pytest.mark.parametrize("dedup", ["on", "off"])
def test_a_fed_stream_is_on_its_way_to_the_disk_before_its_fsync(make_mount, dedup):
    """The new chunks a stream's feed settles (dedup off: every large
    write's pieces, as they are stored) are handed to the disk's writeback
    as it goes, not first by the fsync that makes them durable: once 48 MiB
    are written, few of the log's pages are still only dirty. The fsync
    still makes the file durable: whole after a kill."""
    m = make_mount(options=["pmem_size=512M", "sync=close", f"dedup={dedup}"])
    # Mounted over its source: the log is reached through the daemon's fd.
    fds = f"/proc/{m.pid}/fd"
    log_path = next(f"{fds}/{n}" for n in os.listdir(fds)
                    if os.readlink(f"{fds}/{n}").endswith("/pmem.log"))
    if _log_pages(log_path) is None:
        pytest.skip("no cachestat(2) here")
    data = pattern(48 * MiB, seed=7)
    path = m.path / "stream.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        push_to_daemon(fd)              # every WRITE answered, nothing fsynced
        # The feed runs behind the replies; the last feed call's chunks wait
        # for the fsync. Without the writeback all 12,288 pages stay dirty
        # (unless the kernel's own writeback comes first: it waits 30 s, or
        # for a tenth of the memory dirty); with it, this takes milliseconds.
        _wait_until(lambda: _log_pages(log_path)[0] < len(data) // 4096 // 2,
                    f"the log's pages stay dirty until the fsync: {_log_pages(log_path)}",
                    timeout_s=2.0)
        os.fsync(fd)
    finally:
        os.close(fd)
    m.kill()
    m.start()
    assert read_file(path) == data


def test_writes_answered_in_c_run_ahead_of_a_held_feed(make_mount, monkeypatch, tmp_path,
                                                       fsck_clean):
    """A stream's WRITEs answered in C may run up to
    staging.WINDOW_BACKLOG_BYTES (128 MiB) ahead of its chunk feed, not
    FEED_BACKLOG_BYTES (32 MiB, what the daemon's own writes hold in memory):
    with the feed held, 40 MiB are written back and answered, none passed on
    to the daemon (where it would wait for the feed); then every byte is
    fed, and the file is whole after its fsync and a remount."""
    from ckptfs import control

    marker = tmp_path / "feed-paused"
    m = _paused_mount(make_mount, monkeypatch, marker)
    data = pattern(41 * MiB, seed=22)
    path = m.path / "stream.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        # The first write goes through the daemon (the stream, its log space)
        # and starts the feed, held at its first call.
        _write_all(fd, data[:MiB])
        push_to_daemon(fd)
        _wait_until(marker.exists, "the chunk feed never ran")
        before = control.request(str(m.path), "stat")
        _write_all(fd, data[MiB:])
        pushed, out = in_thread(push_to_daemon, fd)
        pushed.join(WAIT_S)
        assert not pushed.is_alive(), "a WRITE waited for the held chunk feed"
        assert out == [None], out
        after = control.request(str(m.path), "stat")
        assert after["fuse_write_passed_on"] == before["fuse_write_passed_on"], (before, after)
        assert after["fuse_write_bytes_in_c"] - before["fuse_write_bytes_in_c"] >= 32 * MiB
        marker.unlink()
        os.fsync(fd)
        assert pread_all_daemon(fd, len(data)) == data
    finally:
        marker.unlink(missing_ok=True)      # a failed test must not hang in close
        os.close(fd)
    m.remount()
    assert read_file(path) == data
    fsck_clean(m)


def pread_all_daemon(fd: int, n: int) -> bytes:
    """n bytes from offset 0, the page cache dropped first: read through the daemon."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    out = bytearray()
    while len(out) < n:
        piece = os.pread(fd, min(MiB, n - len(out)), len(out))
        assert piece, "short read"
        out += piece
    return bytes(out)


def test_a_full_log_waits_for_the_feed_to_give_back_duplicates(make_mount, monkeypatch,
                                                               tmp_path, fsck_clean):
    """WRITEs answered in C may run WINDOW_BACKLOG_BYTES (128 MiB) ahead of
    the chunk feed, and the daemon's own FEED_BACKLOG_BYTES (32 MiB): more
    than a 64 MiB log holds. With the feed held, a repeated block written
    on must wait for the feed (which gives back every duplicate's log
    bytes), not fill the log and fail with ENOSPC. (CI, session 21:
    test_repeated_content_within_a_file_fits_a_small_log failed so once its
    feed fell behind.)"""
    marker = tmp_path / "feed-paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"stream-feed:{marker}")
    m = make_mount(options=["pmem_size=64M", "sync=close"])
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    block = pattern(MiB, seed=23)
    blocks = 100
    path = m.path / "repeated.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

    def write_the_rest() -> None:
        for _ in range(blocks - 1):
            _write_all(fd, block)
        push_to_daemon(fd)

    try:
        _write_all(fd, block)
        push_to_daemon(fd)
        _wait_until(marker.exists, "the chunk feed never ran")
        pushed, out = in_thread(write_the_rest)
        # Until the writes stop: held by the backlog's bound (or failed).
        seen: list[int] = []

        def held_or_ended() -> bool:
            seen.append(m.stat()["pmem_free_bytes"])
            return not pushed.is_alive() or (len(seen) > 25 and len(set(seen[-25:])) == 1)

        _wait_until(held_or_ended, "the writes never stopped while the feed was held")
        marker.unlink()
        pushed.join(WAIT_S)
        assert not pushed.is_alive(), "the writes never ended after the feed went on"
        assert out == [None], f"the writes failed: {out}"
        os.fsync(fd)
    finally:
        marker.unlink(missing_ok=True)      # a failed test must not hang in close
        os.close(fd)
    assert m.stat()["stored_bytes"] < 3 * MiB
    m.remount()
    with open(path, "rb") as f:
        for i in range(blocks):
            assert f.read(MiB) == block, f"MiB {i} differs"
    fsck_clean(m)
