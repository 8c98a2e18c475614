"""READs answered by the FUSE fast path (native/ckptfs_fuse.c): a file whose
read window is published is read without the interpreter. Through a real
mount: the bytes must be the file's (holes, window edges, an odd size), a
damaged block must still be EIO, and a file that gets uncommitted changes
must be read with them, never from the published window."""

from __future__ import annotations

import errno
import os
import random
import subprocess

import pytest

from posix_helpers import (check_clean, check_random_reads, drop_pages, flip_log_bit, pread_all,
                           push_to_daemon)

MiB = 1 << 20


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


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
        check_random_reads(fd, want, seed=7, reads=40, max_bytes=3 * MiB)
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


# ---------------------------------------------------------------- the read pool
# READs of a published window whose log bytes are not in the page cache are
# read, checked and answered on the fast path's C threads (native/
# ckptfs_readpool.h), not in Python.

def drop_log_pages(m) -> None:
    """The log's pages leave the page cache: the next READs miss it."""
    fd = os.open(m.source / ".ckptfs" / "pmem.log", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.mark.parametrize("dedup", ["on", "off"])
def test_cached_reads_are_answered_from_the_logs_mapping(make_mount, fsck_clean, dedup):
    """READs whose log bytes are in the page cache are checked and sent from
    a mapping of the log (no copy into a reply buffer first): the bytes are
    the file's at any offset and length, and the daemon's memory does not
    grow by what it sent (each READ's pages are unmapped after its reply)."""
    m = make_mount(options=["pmem_size=256M", f"dedup={dedup}"])
    want = rand(48 * MiB + 999, 31)
    (m.path / "f").write_bytes(want)
    m.remount()
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        assert pread_all(fd, len(want), 0) == want      # the log's pages now cached
        drop_pages(fd)
        before, hwm_kib = m.stat(), _vm_kib(m.pid, "VmHWM")
        assert pread_all(fd, len(want), 0) == want
        check_random_reads(fd, want, seed=32, reads=40, max_bytes=3 * MiB)
        after = m.stat()
        grew_kib = _vm_kib(m.pid, "VmHWM") - hwm_kib
    finally:
        os.close(fd)
    mapped = after["fuse_read_mapped"] - before["fuse_read_mapped"]
    assert mapped >= 40, f"only {mapped} READs were answered from the log's mapping"
    assert grew_kib < 16 * 1024, f"the daemon's peak RSS grew by {grew_kib} KiB"
    assert after["errors"] == {}
    check_clean(fsck_clean, m)


def _committed_and_dropped(make_mount, pmem_size: str, size_bytes: int, seed: int):
    """A mount with one file of random bytes, committed and remounted, the
    log's pages dropped: its first reads go to the disk. Returns the mount,
    the file's bytes and the daemon's counters before any read."""
    m = make_mount(options=[f"pmem_size={pmem_size}"], over_itself=False)
    want = rand(size_bytes, seed)
    (m.path / "f").write_bytes(want)
    m.remount()
    drop_log_pages(m)
    return m, want, m.stat()


def test_page_cache_misses_are_answered_on_c_threads(make_mount):
    m, want, before = _committed_and_dropped(make_mount, "256M", 40 * MiB + 4321, 11)
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        assert pread_all(fd, len(want), 0) == want
        check_random_reads(fd, want, seed=12, reads=30, max_bytes=2 * MiB,
                           before_each=lambda: drop_log_pages(m))
    finally:
        os.close(fd)
    after = m.stat()
    assert after["fuse_read_waited_in_c"] > before["fuse_read_waited_in_c"], \
        "no READ that missed the page cache was answered on the read pool's threads"
    assert after["fuse_read_handed_back"] == 0
    assert after["errors"] == {}
    m.umount()


def _log_mapped_kib(m) -> int:
    """Resident KiB of the daemon's read-only mapping of its log (the fast
    path's, which the mapped READs read from)."""
    import re

    log = str(m.source / ".ckptfs" / "pmem.log")
    total, inside = 0, False
    with open(f"/proc/{m.pid}/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                head = line.split()
                inside = head[1] == "r--s" and line.rstrip().endswith(log)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_mapped_reads_leave_no_log_pages_mapped(make_mount, fsck_clean):
    """A READ answered from the log's mapping unmaps every page its faults
    mapped, the rest of the large folios its bytes lie in too (the kernel
    maps whole folios and the pages around a fault): before, ~100 KiB per
    READ stayed mapped, so the daemon's RSS grew with what it sent."""
    m, want, before = _committed_and_dropped(make_mount, "256M", 96 * MiB + 123, 41)
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        assert pread_all(fd, len(want), 0) == want      # the read pool, then the page cache
        drop_pages(fd)
        assert pread_all(fd, len(want), 0) == want      # the trio thread, from the mapping
        check_random_reads(fd, want, seed=42, reads=30, max_bytes=3 * MiB)
        mapped_kib = _log_mapped_kib(m)
    finally:
        os.close(fd)
    after = m.stat()
    mapped = after["fuse_read_mapped"] - before["fuse_read_mapped"]
    assert mapped >= 90, f"only {mapped} READs were answered from the log's mapping"
    assert mapped_kib < 1024, f"{mapped_kib} KiB of the log stay mapped after {mapped} READs"
    assert after["errors"] == {}
    check_clean(fsck_clean, m)


def test_sequential_reader_gets_its_next_windows_ahead(make_mount, fsck_clean):
    """A sequential reader of a file many read windows long: the daemon
    loads each next window before the reader gets there (told by the fast
    path, not by a READ), so the READs that reach the daemon are the first
    few, not one per window, and every byte is the file's."""
    import time

    # seven 32 MiB windows and a bit
    m, want, before = _committed_and_dropped(make_mount, "512M", 224 * MiB + 777, 21)
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        got = bytearray()
        for off in range(0, len(want), MiB):
            got += os.pread(fd, MiB, off)
            # At most ~500 MB/s: the daemon's next window (a few ms of work)
            # is ready before the reader gets there even on a busy machine.
            time.sleep(0.002)
        assert got == want
    finally:
        os.close(fd)
    after = m.stat()
    reads = after["fuse_requests"]["READ"] - before["fuse_requests"].get("READ", 0)
    in_c = after["fuse_read_answered_in_c"] - before["fuse_read_answered_in_c"]
    # The first READ loads the first window; one more may come late.
    assert reads - in_c <= 2, f"{reads - in_c} of {reads} READs went to the daemon"
    assert after["read_windows_ahead"] - before["read_windows_ahead"] >= 4
    assert after["fuse_read_handed_back"] == 0
    check_clean(fsck_clean, m)


def test_damaged_block_read_on_a_c_thread_is_eio(make_mount):
    m = make_mount(options=["pmem_size=64M"], over_itself=False)
    data = rand(8 * MiB, 13)
    (m.path / "f").write_bytes(data)
    m.umount()
    flip_log_bit(m.source, "f", 6 * MiB + 777)
    m.start()
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        assert os.pread(fd, MiB, 0) == data[:MiB]       # publishes the window
        for _ in range(5):
            before = m.stat()["fuse_read_waited_in_c"]
            drop_pages(fd)
            drop_log_pages(m)
            assert os.pread(fd, MiB, 2 * MiB) == data[2 * MiB:3 * MiB]
            if m.stat()["fuse_read_waited_in_c"] > before:
                break
        else:
            raise AssertionError("the read pool never answered a READ of the window")
        drop_pages(fd)
        drop_log_pages(m)
        with pytest.raises(OSError) as err:
            os.pread(fd, MiB, 6 * MiB)
        assert err.value.errno == errno.EIO
        stats = m.stat()
        # Handed back to the daemon's read path, which found the damage too.
        assert stats["fuse_read_handed_back"] >= 1
        assert stats["errors"].get("DamagedData", 0) >= 1
        drop_pages(fd)
        drop_log_pages(m)
        assert os.pread(fd, MiB, 4 * MiB) == data[4 * MiB:5 * MiB]
    finally:
        os.close(fd)
    m.umount()


PAGE = 4096
WORD_INDEX_BITS = 40


def versioned(version: int, n_pages: int) -> bytes:
    """A file version whose every 8-byte word names its version and its place."""
    import numpy as np

    n_words = n_pages * PAGE // 8
    return ((np.uint64(version) << np.uint64(WORD_INDEX_BITS))
            | np.arange(n_words, dtype=np.uint64)).astype("<u8").tobytes()


def check_words(got: bytes, off: int, newest: int) -> None:
    """Each word read is zero (truncated) or the word at its place of some
    version written. Checked per word, not per page: a read racing a write
    through the kernel's page cache may see a page half written, which Linux
    allows; a read of reused or wrong log space names another place or none."""
    import numpy as np

    assert off % 8 == 0 and len(got) % 8 == 0
    words = np.frombuffer(got, dtype="<u8")
    place = np.arange(off // 8, off // 8 + len(words), dtype=np.uint64)
    mask = np.uint64((1 << WORD_INDEX_BITS) - 1)
    ok = (words == 0) | (((words & mask) == place)
                         & ((words >> np.uint64(WORD_INDEX_BITS)) <= np.uint64(newest)))
    if not ok.all():
        bad = int(np.argmin(ok))
        raise AssertionError(f"word at byte {off + 8 * bad}: {int(words[bad]):#x}")


def test_withdrawal_waits_for_reads_on_c_threads(make_mount, fsck_clean):
    """Readers keep the read pool busy while the file is rewritten, truncated,
    replaced and other files come and go in a small log (its space reused at
    once): every word read is one a version of the file held there."""
    import threading

    m = make_mount(options=["pmem_size=96M", "dedup=off"], over_itself=False)
    n_pages = 8 * MiB // PAGE
    (m.path / "f").write_bytes(versioned(0, n_pages))
    stop = threading.Event()
    newest = [0]
    failures: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                try:
                    fd = os.open(m.path / "f", os.O_RDONLY)
                except FileNotFoundError:
                    continue            # between the unlink and the rename
                try:
                    drop_pages(fd)
                    drop_log_pages(m)
                    off = rng.randrange(n_pages) * PAGE
                    got = os.pread(fd, rng.choice([MiB, 256 << 10, 3 * MiB]), off)
                    check_words(got, off, newest[0] + 1)
                finally:
                    os.close(fd)
        except BaseException as e:     # reported by the test's thread
            failures.append(e)
            stop.set()

    readers = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in readers:
        t.start()
    try:
        rng = random.Random(14)
        for version in range(1, 25):
            if stop.is_set():
                break
            newest[0] = version
            how = version % 3
            data = versioned(version, n_pages)
            if how == 0:                    # rewritten in place
                fd = os.open(m.path / "f", os.O_WRONLY)
                try:
                    os.pwrite(fd, data, 0)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            elif how == 1:                  # truncated, then written again
                fd = os.open(m.path / "f", os.O_WRONLY | os.O_TRUNC)
                try:
                    os.pwrite(fd, data[:rng.randrange(1, n_pages) * PAGE], 0)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            else:                           # replaced by a new file
                (m.path / "g").write_bytes(data)
                os.rename(m.path / "g", m.path / "f")
            # Another file written and deleted: the freed space is reused.
            (m.path / "junk").write_bytes(rand(16 * MiB, 100 + version))
            os.unlink(m.path / "junk")
            m.sync()
    finally:
        stop.set()
        for t in readers:
            t.join(60)
    if failures:
        raise failures[0]
    stats = m.stat()
    assert stats["fuse_read_waited_in_c"] > 0
    # A read of reused space would fail its CRCs and be handed back (the
    # daemon then reads it right): none may have been.
    assert stats["fuse_read_handed_back"] == 0
    assert stats["errors"] == {}, stats["errors"]
    check_clean(fsck_clean, m)


@pytest.mark.parametrize("how", ["umount", "sigkill"])
def test_session_end_with_reads_on_c_threads(make_mount, fsck_clean, how):
    """The daemon goes (a clean unmount, or SIGKILL) while readers keep the
    read pool busy: the unmount is prompt and clean, the readers get bytes
    or an error, never wrong bytes, and the data is whole after."""
    import threading
    import time

    m = make_mount(options=["pmem_size=128M"], over_itself=False)
    want = rand(24 * MiB, 15)
    (m.path / "f").write_bytes(want)
    m.remount()
    stop = threading.Event()
    wrong: list[str] = []
    answered = [0]

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            fd = os.open(m.path / "f", os.O_RDONLY)
        except OSError:
            return
        try:
            while not stop.is_set():
                try:
                    drop_pages(fd)
                    drop_log_pages(m)
                    off = rng.randrange(len(want) - MiB)
                    got = os.pread(fd, MiB, off)
                except OSError:
                    break           # the mount went
                if got != want[off:off + len(got)]:
                    wrong.append(f"{len(got)} bytes at {off}")
                answered[0] += 1
        finally:
            try:
                os.close(fd)
            except OSError:
                pass

    readers = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while m.stat()["fuse_read_waited_in_c"] < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m.stat()["fuse_read_waited_in_c"] >= 20, "the read pool was never busy"
        if how == "umount":
            pid = m.pid
            t0 = time.monotonic()
            # Lazy: the readers' open files keep the connection until they stop.
            subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=True)
            stop.set()
            for t in readers:
                t.join(30)
            while os.path.exists(f"/proc/{pid}") and time.monotonic() - t0 < 30:
                time.sleep(0.02)
            assert not os.path.exists(f"/proc/{pid}"), "the daemon did not exit"
            m.pid = None
        else:
            m.kill(detach=False)
            stop.set()
            for t in readers:
                t.join(30)
            m.detach()
    finally:
        stop.set()
        for t in readers:
            t.join(30)
    assert not wrong, wrong[:5]
    assert not any(t.is_alive() for t in readers)
    m.start()
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        drop_pages(fd)
        assert pread_all(fd, len(want), 0) == want
    finally:
        os.close(fd)
    check_clean(fsck_clean, m)


def _log_fds(m) -> int:
    """How many of the daemon's fds are open files of its log."""
    log = os.path.realpath(m.source / ".ckptfs" / "pmem.log")
    n = 0
    for name in os.listdir(f"/proc/{m.pid}/fd"):
        try:
            n += os.readlink(f"/proc/{m.pid}/fd/{name}") == log
        except OSError:
            pass                # closed meanwhile
    return n


def test_each_reader_reads_the_log_through_its_own_open_file(make_mount, fsck_clean):
    """Two files read at once after their log pages left the cache: each
    reader's table gets an open file of the log of its own (the kernel's
    read-ahead follows that reader alone, in large folios, instead of
    WILLNEED hints of 4 KiB pages through the one shared fd), and the
    bytes are the files'."""
    m = make_mount(options=["pmem_size=256M"], over_itself=False)
    want = [rand(40 * MiB + 99, 31), rand(40 * MiB + 7, 32)]
    for i, data in enumerate(want):
        (m.path / f"f{i}").write_bytes(data)
    m.remount()
    drop_log_pages(m)
    shared = _log_fds(m)
    fds = [os.open(m.path / f"f{i}", os.O_RDONLY) for i in range(2)]
    try:
        got = [bytearray(), bytearray()]
        for off in range(0, max(map(len, want)), MiB):
            for i, fd in enumerate(fds):
                got[i] += os.pread(fd, MiB, off)
            if off == 8 * MiB:
                assert _log_fds(m) >= shared + 2, "the readers read through the log's one fd"
        assert [bytes(g) for g in got] == want
    finally:
        for fd in fds:
            os.close(fd)
    after = m.stat()
    assert after["fuse_read_handed_back"] == 0
    assert after["errors"] == {}
    check_clean(fsck_clean, m)
