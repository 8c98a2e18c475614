"""WRITEs answered in C from a file's write window (native/ckptfs_fuse.c, staging.py).

A file written front to back gets a write window after its first stream
write: the fast path writes the next WRITEs' payload into the log space the
stream reserved, answers them, and folds them into the file's changes before
any Python runs. These tests check that it does (the counters), that every
byte is where it belongs whatever else happens to the file meanwhile (reads,
stat, truncate, rename, fsync from other threads, other files written in
between), that a crash keeps exactly what was made durable, that a full log
still says ENOSPC, and that nothing depends on it (turned off, the same).
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from ckptfs import control

from posix_helpers import (check_clean, close_after_kill, drop_pages, pattern,
                           pread_all, push_to_daemon, read_file, remount_and_check)

MiB = 1 << 20


def _stream(fd: int, data: bytes, at: int = 0, step: int = MiB) -> None:
    for off in range(0, len(data), step):
        piece = data[off:off + step]
        assert os.pwrite(fd, piece, at + off) == len(piece)


def _stats(m) -> dict:
    # Asked in this process: `ckptfs stat` would be a child that inherits the
    # test's fds, and its exec closes them: a FLUSH, which commits the file.
    return control.request(str(m.path), "stat")


def _answered_in_c(m) -> int:
    return _stats(m)["fuse_write_answered_in_c"]


def test_stream_writes_are_answered_in_c_and_byte_exact(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    data = pattern(48 * MiB + 12345, seed=3)
    path = m.path / "ckpt.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _stream(fd, data)
        push_to_daemon(fd)          # written back and dropped: reads ask the daemon
        stat = _stats(m)
        assert stat["fuse_write_answered_in_c"] > 0, stat
        assert stat["fuse_write_bytes_in_c"] >= 24 * MiB, stat
        assert pread_all(fd, len(data), 0) == data
        os.fsync(fd)
        drop_pages(fd)
        assert pread_all(fd, len(data), 0) == data
    finally:
        os.close(fd)
    remount_and_check(fsck_clean, m, path, data)


def test_interleaved_streams_and_overwrites(make_mount, fsck_clean):
    """Three files streamed a MiB at a time in turn, one of them overwritten
    inside what it already has now and then: each ends as written."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    want = {name: bytearray(pattern(20 * MiB, seed=i)) for i, name in enumerate("abc")}
    fds = {name: os.open(m.path / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
           for name in want}
    try:
        for step in range(20):
            for name, fd in fds.items():
                off = step * MiB
                os.pwrite(fd, bytes(want[name][off:off + MiB]), off)
                if name == "b" and step % 5 == 4:
                    patch = pattern(70000, seed=100 + step)
                    at = off - 3 * MiB + 4097
                    want[name][at:at + len(patch)] = patch
                    os.pwrite(fd, patch, at)
                    push_to_daemon(fd)
        assert _answered_in_c(m) > 0
        for name, fd in fds.items():
            push_to_daemon(fd)
            assert pread_all(fd, 20 * MiB, 0) == want[name], name
    finally:
        for fd in fds.values():
            os.close(fd)
    m.remount()
    for name, data in want.items():
        assert read_file(m.path / name) == data, name
    check_clean(fsck_clean, m)


def test_reads_stat_truncate_rename_fsync_race_a_writer(make_mount, fsck_clean):
    """While one thread streams a file, others read back what it has written
    (from the daemon, the page cache dropped), stat it, fsync it, rename it
    and truncate another file being streamed: every read sees the bytes
    written, and both files end exactly as a local file would."""
    m = make_mount(options=["pmem_size=1G", "sync=close"])
    data = pattern(96 * MiB, seed=7)
    path = m.path / "racing.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    other = m.path / "other.bin"
    ofd = os.open(other, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    done = threading.Event()
    written = [0]
    steps = [0]
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for off in range(0, len(data), MiB):
                while steps[0] < off // (2 * MiB) and not errors:
                    time.sleep(0.001)       # in step with the main thread's changes
                os.pwrite(fd, data[off:off + MiB], off)
                written[0] = off + MiB
        except BaseException as e:  # handed to the test
            errors.append(e)
        finally:
            done.set()

    def reader() -> None:
        try:
            rfd = os.dup(fd)
            try:
                k = 0
                while not done.is_set():
                    upto = written[0]
                    if upto >= 2 * MiB:
                        push_to_daemon(rfd)
                        at = (k * 7 * MiB + 4093) % (upto - MiB)
                        got = os.pread(rfd, MiB, at)
                        assert got == data[at:at + MiB], f"read at {at} of {upto} written"
                        assert os.fstat(rfd).st_size >= upto
                    k += 1
            finally:
                os.close(rfd)
        except BaseException as e:  # handed to the test
            errors.append(e)

    renamed = threading.Event()
    other_want = bytearray()
    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    try:
        step = 0
        while not done.is_set():
            # The other file: streamed, cut back now and then, streamed on.
            piece = pattern(MiB, seed=1000 + step)
            os.pwrite(ofd, piece, len(other_want))
            other_want += piece
            if step % 4 == 3:
                cut = len(other_want) - MiB // 2 - 4096 * step
                os.ftruncate(ofd, cut)
                del other_want[cut:]
            if step == 6:
                os.rename(path, m.path / "racing2.bin")
                renamed.set()
            if step % 3 == 1:
                os.fsync(fd)
            os.stat(m.path / ("racing2.bin" if renamed.is_set() else "racing.bin"))
            step += 1
            steps[0] = step
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert renamed.is_set(), "the writer finished before the rename: make it longer"
        os.fsync(fd)
        push_to_daemon(ofd)
        assert pread_all(ofd, len(other_want) + MiB, 0) == bytes(other_want)
    finally:
        done.set()
        for t in threads:
            t.join(120)
        os.close(fd)
        os.close(ofd)
    assert _answered_in_c(m) > 0
    m.remount()
    assert read_file(m.path / "racing2.bin") == data
    assert read_file(other) == bytes(other_want)
    check_clean(fsck_clean, m)


def test_a_setattr_of_times_leaves_the_window_open(make_mount, fsck_clean):
    """The kernel sends a SETATTR of the times whenever it writes back a
    written file's inode (mtime, ctime: ~60 per 2 GiB streamed), and utime
    sends one too: it changes no byte, so the stream's next WRITEs are still
    answered in C (before, it closed the window and the next WRITE went to
    the daemon). stat shows the times the kernel set, during the stream and
    after a remount."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    piece = 8 * MiB
    data = pattern(5 * piece, seed=60)
    path = m.path / "times.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        # Under load the kernel can send a whole piece's WRITEs before the
        # stager opens the window: stream on until C has answered some.
        at = 0
        while _answered_in_c(m) == 0 and at < 2 * piece:
            _stream(fd, data[at:at + piece], at=at)
            push_to_daemon(fd)
            at += piece
        assert _answered_in_c(m) > 0
        for k in range(1, 3):
            time.sleep(0.05)        # the WRITEs' fold done: the SETATTR comes alone
            times = (1_000_000_000 * k + 7, 2_000_000_000 * k + 11)
            os.utime(path, ns=times)
            st = os.stat(path)
            assert (st.st_atime_ns, st.st_mtime_ns) == times
            before = _stats(m)
            _stream(fd, data[at:at + piece], at=at)
            push_to_daemon(fd)
            at += piece
            after = _stats(m)
            writes = after["fuse_requests"]["WRITE"] - before["fuse_requests"]["WRITE"]
            assert writes > 0
            assert after["fuse_write_answered_in_c"] - before["fuse_write_answered_in_c"] \
                == writes, "a WRITE after the SETATTR went to the daemon"
            st = os.stat(path)
            assert st.st_mtime_ns > times[1] and st.st_size == at     # the writes' own times
        os.utime(path)              # now, as `touch` does
        _stream(fd, data[at:], at=at)
        os.fsync(fd)
        times = (3_000_000_000, 4_000_000_000)
        os.utime(path, ns=times)    # after the last write: these stay
        shown = os.stat(path)
        assert (shown.st_atime_ns, shown.st_mtime_ns) == times
    finally:
        os.close(fd)
    closed = os.stat(path)
    m.remount()
    st = os.stat(path)
    assert (st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns) == \
        (closed.st_atime_ns, closed.st_mtime_ns, closed.st_ctime_ns)
    assert (st.st_atime_ns, st.st_mtime_ns) == times
    assert read_file(path) == data
    check_clean(fsck_clean, m)


def test_kill_mid_write_keeps_what_fsync_made_durable(make_mount, fsck_clean):
    """SIGKILL while WRITEs are answered in C after an fsync: after the
    remount the file is exactly what the fsync covered."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    path = m.path / "ckpt.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        # Page-aligned pieces: the stream goes on after each fsync. Under load
        # the kernel can send a whole piece's WRITEs before the stager opens
        # the window, so stream on until C has answered some.
        first = b""
        before = 0
        for piece_no in range(8):
            piece = pattern(8 * MiB, seed=21 + 100 * piece_no)
            _stream(fd, piece, at=len(first))
            first += piece
            os.fsync(fd)
            before = _answered_in_c(m)
            if before > 0:
                break
        assert before > 0, "no WRITE answered in C after 64 MiB streamed"
        _stream(fd, pattern(24 * MiB, seed=22), at=len(first))
        push_to_daemon(fd)
        assert _answered_in_c(m) > before
        m.kill()
    finally:
        close_after_kill(fd)
    m.start()
    assert read_file(path) == first
    check_clean(fsck_clean, m)


def test_full_log_still_says_enospc(make_mount, fsck_clean):
    """A stream larger than the log: WRITEs answered in C stop at the space
    reserved, the daemon's own path says ENOSPC as before, the space comes
    back once the file goes."""
    m = make_mount(options=["pmem_size=64M"])
    keep = pattern(8 * MiB, seed=30)
    (m.path / "committed").write_bytes(keep)
    err = None
    fd = os.open(m.path / "huge", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for i in range(100):
            os.write(fd, pattern(MiB, 1000 + i))
    except OSError as e:
        err = e
    finally:
        try:
            os.close(fd)
        except OSError as e:
            err = err or e
    assert err is not None and err.errno == errno.ENOSPC, f"expected ENOSPC, got {err!r}"
    assert _answered_in_c(m) > 0
    assert read_file(m.path / "committed") == keep
    if (m.path / "huge").exists():
        os.unlink(m.path / "huge")
    os.unlink(m.path / "committed")
    again = pattern(40 * MiB, seed=32)
    (m.path / "again").write_bytes(again)
    remount_and_check(fsck_clean, m, m.path / "again", again)


@pytest.mark.parametrize("env", ["CKPTFS_NO_FAST_WRITES", "CKPTFS_NO_FASTPATH"])
def test_nothing_depends_on_it(make_mount, monkeypatch, fsck_clean, env):
    monkeypatch.setenv(env, "1")
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    monkeypatch.delenv(env)
    data = pattern(16 * MiB + 5, seed=40)
    (m.path / "f").write_bytes(data)
    assert _answered_in_c(m) == 0
    remount_and_check(fsck_clean, m, m.path / "f", data)


@pytest.mark.parametrize("spliced", [True, False])
def test_payload_spliced_into_the_log_or_copied(make_mount, monkeypatch, fsck_clean, spliced):
    """While a window is open the fast path takes requests with splice(), and
    an answered WRITE's payload goes from the kernel's pages into the log
    with one copy (CKPTFS_NO_FUSE_SPLICE=1: read() and pwrite(), as before);
    either way every byte lands, other requests in between included."""
    if not spliced:
        monkeypatch.setenv("CKPTFS_NO_FUSE_SPLICE", "1")
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    monkeypatch.delenv("CKPTFS_NO_FUSE_SPLICE", raising=False)
    data = pattern(40 * MiB + 4097, seed=50)
    path = m.path / "spliced.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(data), 3 * MiB):
            _stream(fd, data[off:off + 3 * MiB], at=off)
            os.stat(path)                       # a GETATTR among the WRITEs
        push_to_daemon(fd)
        stat = _stats(m)
        assert stat["fuse_write_answered_in_c"] > 0, stat
        if spliced:
            assert stat["fuse_write_spliced"] == stat["fuse_write_answered_in_c"], stat
        else:
            assert stat["fuse_write_spliced"] == 0, stat
        drop_pages(fd)
        assert pread_all(fd, len(data), 0) == data
        os.fsync(fd)
    finally:
        os.close(fd)
    remount_and_check(fsck_clean, m, path, data)
