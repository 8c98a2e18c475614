"""A page of the log that cannot be read while the daemon reads it in place
(native/ckptfs_logfault.c): the log file cut short underneath a mounted
daemon, exactly between a READ's (or the chunk feed's) populate of the
log's mapping and its first touch, which raises a real SIGBUS. The
operation that touched it fails (EIO), never the daemon and never with
zeros for bytes; other files keep working. The debug hooks (CKPTFS_DEBUG_PAUSE
"mapped-read" in native/ckptfs_fuse.c, "log-view" in pmemlog.py) hold the
daemon at that point so the cut lands there for certain."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from posix_helpers import drop_pages, in_thread, log_position, pattern, push_to_daemon, read_file

MiB = 1 << 20
PAGE = 4096
WAIT_S = 60.0


def _log(m) -> Path:
    return m.source / ".ckptfs" / "pmem.log"


def _wait_until(cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_mapped_read_of_a_cut_log_is_eio_and_the_daemon_lives(make_mount, monkeypatch,
                                                              tmp_path):
    m = make_mount(options=["pmem_size=64M"], over_itself=False)
    keep, data = pattern(2 * MiB, seed=21), pattern(8 * MiB, seed=22)
    (m.path / "keep").write_bytes(keep)
    (m.path / "f").write_bytes(data)
    m.umount()
    cut = -(-(log_position(m.source, "keep", len(keep) - 1) + 1) // PAGE) * PAGE
    assert cut <= log_position(m.source, "f", 2 * MiB), "f is not after keep in the log"
    marker = tmp_path / "read-paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"mapped-read:{marker}")
    m.start()
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        # The first READ publishes the window; a later one is answered from
        # the mapping once the log's pages are in the page cache.
        assert os.pread(fd, MiB, 0) == data[:MiB]
        for _ in range(10):
            drop_pages(fd)
            reader, got = in_thread(os.pread, fd, MiB, 2 * MiB)
            if _wait_until(lambda: marker.exists() or not reader.is_alive(), WAIT_S) \
                    and marker.exists():
                break
            assert got == [data[2 * MiB:3 * MiB]]
        else:
            raise AssertionError("no READ was answered from the log's mapping")
        # Held with its pages populated: cut them off, then let it touch them.
        os.truncate(_log(m), cut)
        marker.unlink()
        reader.join(WAIT_S)
        assert not reader.is_alive()
        assert len(got) == 1 and isinstance(got[0], OSError), got
        assert got[0].errno == errno.EIO, got[0]
        stat = m.stat()                         # the daemon lives
        assert stat["log_faults"] >= 1, "the READ never touched a cut page"
        # Every other byte of f is gone too; keep is whole.
        drop_pages(fd)
        with pytest.raises(OSError) as err:
            os.pread(fd, MiB, 5 * MiB)
        assert err.value.errno == errno.EIO
    finally:
        marker.unlink(missing_ok=True)      # a failed test must not hang
        os.close(fd)
    assert read_file(m.path / "keep") == keep
    m.umount()
    problems = _check_cut_reported(m, expect_data_problems=True)
    # Each chunk past the cut is named with its file: f's, never keep's.
    data = [p for p in problems if p.startswith("problem [data]")]
    assert all(p.endswith("; in /f)") for p in data), data
    # Grown back as the refusal says, it mounts: keep is whole, f is EIO.
    m.start()
    assert read_file(m.path / "keep") == keep
    with pytest.raises(OSError) as err:
        read_file(m.path / "f")
    assert err.value.errno == errno.EIO
    m.umount()


def _check_cut_reported(m, expect_data_problems: bool) -> list[str]:
    """fsck names the cut and (only) the chunks past it; a mount refuses the
    cut log in one line until it is grown back to its size."""
    size = _log_size(m)
    res = m.fsck()
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    problems = [line for line in res.stdout.splitlines() if line.startswith("problem")]
    assert any(p.startswith("problem [log]") and "cut short" in p for p in problems), problems
    data = [p for p in problems if p.startswith("problem [data]")]
    assert all("ends before offset" in p for p in data), data
    assert bool(data) == expect_data_problems, problems
    assert len(problems) == 1 + len(data), problems
    with pytest.raises(Exception) as err:
        m.start()
    assert "cut short" in str(err.value), err.value
    os.truncate(_log(m), size)
    return problems


def _log_size(m) -> int:
    """The size the log's superblock gives (pmemlog's layout: magic, version, size)."""
    with open(_log(m), "rb") as f:
        head = f.read(20)
    return int.from_bytes(head[12:20], "little")


def test_chunk_feed_over_a_cut_log_fails_the_file_not_the_daemon(make_mount, monkeypatch,
                                                                 tmp_path):
    marker = tmp_path / "view-paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"log-view:{marker}")
    m = make_mount(options=["pmem_size=64M", "sync=close"], over_itself=False)
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    data = pattern(8 * MiB, seed=23)
    fd = os.open(m.path / "stream.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view[:MiB]):]
        pushed, out = in_thread(push_to_daemon, fd)
        pushed.join(WAIT_S)
        assert out == [None], out
        assert _wait_until(marker.exists, WAIT_S), "the feed never read the log in place"
        # The feed holds a view with its pages populated: cut every byte of
        # the log but its superblock, then let the feed read them.
        os.truncate(_log(m), PAGE)
        marker.unlink()
        with pytest.raises(OSError) as err:
            os.fsync(fd)
        assert err.value.errno == errno.EIO
        assert m.stat()["log_faults"] >= 1, "the feed never touched a cut page"
        # Failed by the fault itself (the view that faulted), not by a later
        # view's copy of bytes past the cut: the zeros were never named.
        daemon_log = (m.source / ".ckptfs" / "daemon.log").read_text()
        assert "could not be read while read in place" in daemon_log, daemon_log[-2000:]
    finally:
        marker.unlink(missing_ok=True)
        try:
            os.close(fd)
        except OSError:
            pass
    # The daemon lives and writes and reads other files (the log grows back).
    other = pattern(3 * MiB, seed=24)
    (m.path / "other").write_bytes(other)
    drop_pages_of = os.open(m.path / "other", os.O_RDONLY)
    try:
        drop_pages(drop_pages_of)
        assert read_file(m.path / "other") == other
    finally:
        os.close(drop_pages_of)
    m.umount()
    # No chunk named from zeros: stream.bin never committed its bytes, and
    # every chunk fsck reads (other's) matches its id.
    _check_cut_reported(m, expect_data_problems=False)
    m.start()
    assert read_file(m.path / "other") == other
    assert os.path.getsize(m.path / "stream.bin") in (0, len(data))
    if os.path.getsize(m.path / "stream.bin"):
        assert read_file(m.path / "stream.bin") == data
    m.umount()
