"""Rewrite windows (native/ckptfs_fuse.c, staging.py) attacked from the side.

tests/posix/test_rewrite_fastpath.py checks one writer rewriting one file.
These drive the window with what a real workload mixes in: two fds and two
processes rewriting the same file at once, mmap and O_DIRECT writes,
writes past the end and into holes, ftruncate / fallocate / punch between
rewrites, an unlink or a rename over the file while its window is open, a
log too full for a window, dedup off (no window), a kill after an fsync.
Every byte is checked against a model (after a push to the daemon and a
remount), fsck must be clean, and the log space a window held must come
back when the file closes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import random
import subprocess
import sys
import threading
import time

from ckptfs import control

from posix_helpers import (check_clean, pattern, pread_all, push_to_daemon, read_file,
                           remount_and_check)

KiB = 1 << 10
MiB = 1 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2


def _stat(m) -> dict:
    # In this process: a `ckptfs stat` child would inherit the test's fds and
    # close them at exec (a FLUSH, which commits the file).
    return control.request(str(m.path), "stat")


def _answered_in_c(m) -> int:
    return _stat(m)["fuse_write_answered_in_c"]


def _fallocate(fd: int, mode: int, off: int, length: int) -> None:
    _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, mode, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _put(fd: int, want: bytearray, off: int, piece: bytes) -> None:
    assert os.pwrite(fd, piece, off) == len(piece)
    if off > len(want):
        want.extend(bytes(off - len(want)))
    want[off:off + len(piece)] = piece


def _rewrites(fd: int, want: bytearray, rng: random.Random, n: int, seed: int,
              limit: int | None = None) -> None:
    """n rewrites of 4-12 KiB at random (page-aligned or not) offsets below limit."""
    top = limit if limit is not None else len(want)
    for i in range(n):
        size = rng.choice((4 * KiB, 4 * KiB, 8 * KiB, 12 * KiB, 3000))
        off = rng.randrange(max(1, top - size))
        if rng.random() < 0.7:
            off &= ~4095
        _put(fd, want, off, pattern(size, seed=seed * 1000 + i))


def test_two_fds_and_two_processes_rewrite_one_file_at_once(make_mount, fsck_clean):
    """Two threads (each its own fd) and a child process rewrite disjoint
    quarters of one file at once, fsyncing now and then; one more fd reads
    it back from the daemon in between. Every byte ends where its writer
    put it, and most WRITEs were answered in C."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    path = m.path / "shared.bin"
    size = 8 * MiB
    want = bytearray(pattern(size, seed=11))
    path.write_bytes(want)
    before = _answered_in_c(m)
    q = size // 4
    child = subprocess.Popen([sys.executable, "-c", CHILD_REWRITES, str(path), str(3 * q),
                              str(q), "77"], stdout=subprocess.PIPE)
    models: list[bytearray] = []
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            rng = random.Random(k)
            part = bytearray(want[k * q:(k + 1) * q])
            fd = os.open(path, os.O_RDWR)
            try:
                for cycle in range(12):
                    for i in range(24):
                        off = rng.randrange(q // 4096) * 4096
                        piece = pattern(4096, seed=k * 100000 + cycle * 100 + i)
                        assert os.pwrite(fd, piece, k * q + off) == 4096
                        part[off:off + 4096] = piece
                    if cycle % 3 == 2:
                        os.fsync(fd)
            finally:
                os.close(fd)
            models.append((k, part))
        except BaseException as e:      # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    reader = os.open(path, os.O_RDONLY)
    try:
        for _ in range(6):
            push_to_daemon(reader)
            assert len(pread_all(reader, size, 0)) == size
    finally:
        os.close(reader)
    for t in threads:
        t.join()
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    assert not errors, errors
    for k, part in models:
        want[k * q:(k + 1) * q] = part
    want[3 * q:] = bytes.fromhex(out.decode().strip())
    assert read_file(path) == want
    assert _answered_in_c(m) - before >= 200
    remount_and_check(fsck_clean, m, path, want)


# The child's rewrites of [base, base + span): prints what that range holds after.
CHILD_REWRITES = r'''
import os, random, sys
path, base, span, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
fd = os.open(path, os.O_RDWR)
part = bytearray(os.pread(fd, span, base))
for cycle in range(12):
    for i in range(24):
        off = rng.randrange(span // 4096) * 4096
        piece = bytes((seed + cycle * 31 + i * 7 + j) & 0xFF for j in range(4096))
        assert os.pwrite(fd, piece, base + off) == 4096
        part[off:off + 4096] = piece
    if cycle % 4 == 3:
        os.fsync(fd)
os.close(fd)
print(part.hex())
'''


def test_rewrites_mixed_with_mmap_odirect_holes_truncate_and_punch(make_mount, fsck_clean):
    """Rewrites through a buffered fd with, in between: writes through a
    shared mapping of the same file, O_DIRECT rewrites (own fd), writes past
    the end (a hole between), ftruncate down and up, fallocate and a punched
    hole; the file read back from the daemon after each step and after a
    remount."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    path = m.path / "mixed.bin"
    want = bytearray(pattern(4 * MiB, seed=21))
    path.write_bytes(want)
    rng = random.Random(22)
    fd = os.open(path, os.O_RDWR)
    dfd = os.open(path, os.O_RDWR | os.O_DIRECT)
    before = _answered_in_c(m)
    buf = mmap.mmap(-1, 64 * KiB)           # page-aligned, as O_DIRECT wants

    def check(what: str) -> None:
        push_to_daemon(fd)
        got = pread_all(fd, len(want) + MiB, 0)
        assert len(got) == len(want), (what, len(got), len(want))
        if got != want:
            bad = next(i for i in range(len(want)) if got[i] != want[i])
            raise AssertionError(f"{what}: first wrong byte at {bad}")

    try:
        for step in range(10):
            _rewrites(fd, want, rng, 24, step)
            check(f"rewrites {step}")
            # Through a shared mapping: the kernel's writeback sends them.
            with mmap.mmap(fd, len(want) & ~(mmap.PAGESIZE - 1)) as mm:
                for i in range(8):
                    off = rng.randrange(len(mm) // 4096) * 4096
                    piece = pattern(4096, seed=5000 + step * 10 + i)
                    mm[off:off + 4096] = piece
                    want[off:off + 4096] = piece
                mm.flush()
            check(f"mmap {step}")
            # O_DIRECT rewrites, page-aligned.
            for i in range(6):
                n = rng.choice((4 * KiB, 16 * KiB, 64 * KiB))
                off = rng.randrange((len(want) - n) // 4096) * 4096
                piece = pattern(n, seed=6000 + step * 10 + i)
                buf[:n] = piece
                assert os.pwritev(dfd, [memoryview(buf)[:n]], off) == n
                want[off:off + n] = piece
            _rewrites(fd, want, rng, 8, 50 + step)
            check(f"odirect {step}")
            if step == 2:
                # Past the end, with a hole: then rewrites into the hole.
                _put(fd, want, len(want) + 3 * MiB + 123, pattern(5000, seed=7000))
                for i in range(10):
                    off = len(want) - 3 * MiB - 5000 + rng.randrange(3 * MiB - 8192)
                    _put(fd, want, off, pattern(4096, seed=7100 + i))
            elif step == 4:
                cut = len(want) - MiB - 777
                os.ftruncate(fd, cut)
                del want[cut:]
                _rewrites(fd, want, rng, 16, 80)
                os.ftruncate(fd, cut + 2 * MiB)      # up: zeros
                want.extend(bytes(2 * MiB))
                _rewrites(fd, want, rng, 16, 81)
            elif step == 6:
                # ckptfs has no FALLOCATE (EOPNOTSUPP): refused cleanly with
                # a window open, nothing changed; a shrink to mid-page instead.
                for mode in (0, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE):
                    try:
                        _fallocate(fd, mode, 64 * KiB, 256 * KiB)
                    except OSError as e:
                        assert e.errno == 95, e
                    else:
                        raise AssertionError("fallocate is answered now: model it here")
                check("fallocate refused")
                cut = len(want) - 5 * KiB - 1
                os.ftruncate(fd, cut)
                del want[cut:]
                _rewrites(fd, want, rng, 16, 82)
                _put(fd, want, len(want) + 1, pattern(3000, seed=7200))
                _rewrites(fd, want, rng, 16, 83, limit=512 * KiB)
            elif step == 8:
                os.fsync(fd)
            check(f"step {step} extra")
        assert _answered_in_c(m) - before >= 100
        os.fsync(fd)
    finally:
        buf.close()
        os.close(dfd)
        os.close(fd)
    assert read_file(path) == want
    remount_and_check(fsck_clean, m, path, want)


def test_unlink_and_rename_over_a_file_whose_rewrite_window_is_open(make_mount, fsck_clean):
    """A file with an open rewrite window is unlinked (its fd stays open and
    keeps being rewritten and read); another is renamed over by a third
    while rewritten. Reads through the open fds are exact, the names left
    hold what they should after a remount, and the log space comes back."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    free0 = _stat(m)["pmem_free_bytes"]
    a, b, c = m.path / "a.bin", m.path / "b.bin", m.path / "c.bin"
    wa = bytearray(pattern(4 * MiB, seed=31))
    wb = bytearray(pattern(4 * MiB, seed=32))
    wc = bytes(pattern(MiB, seed=33))
    a.write_bytes(wa)
    b.write_bytes(wb)
    c.write_bytes(wc)
    rng = random.Random(34)
    fa = os.open(a, os.O_RDWR)
    fb = os.open(b, os.O_RDWR)
    try:
        before = _answered_in_c(m)
        _rewrites(fa, wa, rng, 20, 1)
        _rewrites(fb, wb, rng, 20, 2)
        os.unlink(a)
        os.rename(c, b)             # b's inode: no name left, still open
        _rewrites(fa, wa, rng, 40, 3)
        _rewrites(fb, wb, rng, 40, 4)
        push_to_daemon(fa)
        push_to_daemon(fb)
        assert _answered_in_c(m) - before >= 40
        for fd, w in ((fa, wa), (fb, wb)):
            push_to_daemon(fd)
            assert pread_all(fd, len(w), 0) == w
        os.fsync(fa)
        _rewrites(fa, wa, rng, 20, 5)
        push_to_daemon(fa)
        assert pread_all(fa, len(wa), 0) == wa
    finally:
        os.close(fa)
        os.close(fb)
    assert not a.exists()
    assert read_file(b) == wc
    # The unlinked files' bytes and every window's reserve are given back
    # (c's bytes are b's now; a's and b's old content freed as they close).
    m.remount()
    assert read_file(b) == wc
    assert sorted(p.name for p in m.path.iterdir() if not p.name.startswith(".")) == ["b.bin"]
    assert _stat(m)["pmem_free_bytes"] >= free0 - 2 * MiB
    check_clean(fsck_clean, m)


def test_a_full_log_while_windows_hold_space(make_mount, fsck_clean):
    """A small log filled by a stream while files hold rewrite windows (all
    writes O_DIRECT: each one's outcome is its own): each write either
    succeeds or fails cleanly with ENOSPC, the files hold exactly what
    succeeded, rewrites succeed again once the filler is gone, and after the
    files close no window's reserve is left held."""
    m = make_mount(options=["pmem_size=64M", "sync=close", "tiering=off"])
    paths = [m.path / f"r{i}.bin" for i in range(4)]
    wants = [bytearray(pattern(2 * MiB, seed=40 + i)) for i in range(4)]
    for p, w in zip(paths, wants):
        p.write_bytes(w)
    free_before = _stat(m)["pmem_free_bytes"]
    rng = random.Random(41)
    buf = mmap.mmap(-1, MiB)
    fds = [os.open(p, os.O_RDWR | os.O_DIRECT) for p in paths]

    # A file that lost a write (ENOSPC) commits none of its changes since
    # its last commit (files.commit_error): its fsync fails, it is as then.
    bases = [bytes(w) for w in wants]
    lost = [False] * len(wants)

    def rewrite(fd: int, w: bytearray, seed: int) -> bool:
        off = rng.randrange(len(w) // 4096) * 4096
        piece = pattern(4096, seed=seed)
        buf[:4096] = piece
        try:
            assert os.pwritev(fd, [memoryview(buf)[:4096]], off) == 4096
        except OSError as e:
            assert e.errno == 28, e             # ENOSPC, nothing else
            lost[fds.index(fd)] = True
            return False
        w[off:off + 4096] = piece
        return True

    def fsync_all() -> None:
        for k, fd in enumerate(fds):
            try:
                os.fsync(fd)
            except OSError as e:
                assert lost[k] and e.errno == 28, (k, e)
                wants[k][:] = bases[k]
                lost[k] = False
            else:
                assert not lost[k], k
                bases[k] = bytes(wants[k])

    fillers = []
    full = None
    refused = 0
    try:
        before = _answered_in_c(m)
        for k, (fd, w) in enumerate(zip(fds, wants)):
            for j in range(8):
                assert rewrite(fd, w, k * 10 + j)   # each file's window open
        assert _answered_in_c(m) - before >= 16
        assert _stat(m)["pmem_free_bytes"] < free_before
        # Filler files until one cannot take its first MiB (a file that
        # lost a write drops what no fsync committed).
        for n in range(16):
            fillers.append(m.path / f"filler{n}.bin")
            ff = os.open(fillers[-1], os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
            written = 0
            try:
                for i in range(64):
                    buf[:] = pattern(MiB, seed=900 + n * 100 + i)
                    try:
                        assert os.pwritev(ff, [buf], written) == MiB
                        os.fsync(ff)    # kept when a later write of it fails
                        written += MiB
                    except OSError as e:
                        assert e.errno == 28, e          # ENOSPC, nothing else
                        break
                    # Rewrites go on while the log fills.
                    for k, (fd, w) in enumerate(zip(fds, wants)):
                        for j in range(4):
                            refused += not rewrite(fd, w, 1000 + i * 100 + k * 10 + j)
            finally:
                try:
                    os.close(ff)
                except OSError as e:
                    assert e.errno == 28, e
            if written == 0:
                full = n
                break
        for k, (fd, w) in enumerate(zip(fds, wants)):   # at the brim
            for j in range(512):
                refused += not rewrite(fd, w, 50000 + k * 100 + j)
        assert refused > 0, "the rewrites never met the full log"
        fsync_all()
        assert full is not None, "the 64 MiB log never filled"
        for f in fillers:
            os.unlink(f)
        # The fillers' space is back: rewrites succeed again.
        # (given back once the unlinks' commit is durable: wait for it)
        deadline = time.monotonic() + 30
        while _stat(m)["pmem_free_bytes"] < 16 * MiB:
            assert time.monotonic() < deadline, "the fillers' space never came back"
            time.sleep(0.05)
        before = _answered_in_c(m)
        for k, (fd, w) in enumerate(zip(fds, wants)):
            for j in range(16):
                assert rewrite(fd, w, 60000 + k * 100 + j)
        assert _answered_in_c(m) - before >= 16
        fsync_all()
    finally:
        buf.close()
        for fd in fds:
            try:
                os.close(fd)
            except OSError as e:
                raise AssertionError(f"close after fsync: {e}") from e
    m.remount()
    for p, w in zip(paths, wants):
        assert read_file(p) == w, p
    # Nothing held: at most the rewritten blocks' new chunks more than before.
    after = _stat(m)["pmem_free_bytes"]
    assert after >= free_before - 4 * 2 * MiB, (free_before, after, refused)
    check_clean(fsck_clean, m)


def test_window_space_comes_back_when_the_file_closes(make_mount, fsck_clean):
    """A rewrite window reserves log space; close gives back what was not
    written: the free space after close (and a commit) is what it was
    before less the bytes the rewrites stored, never the reserve."""
    m = make_mount(options=["pmem_size=256M", "sync=close", "tiering=off"])
    path = m.path / "f.bin"
    want = bytearray(pattern(4 * MiB, seed=51))
    path.write_bytes(want)
    free0 = _stat(m)["pmem_free_bytes"]
    fd = os.open(path, os.O_RDWR)
    rng = random.Random(52)
    try:
        before = _answered_in_c(m)
        for i in range(4):
            off = rng.randrange(len(want) // 4096) * 4096
            _put(fd, want, off, pattern(4096, seed=i))
        push_to_daemon(fd)
        assert _answered_in_c(m) > before           # the window was open
        held = free0 - _stat(m)["pmem_free_bytes"]
        assert held >= 256 * KiB, held              # its reserve
    finally:
        os.close(fd)
    after = _stat(m)["pmem_free_bytes"]
    # Four 4 KiB rewrites store at most a few chunks' worth; the reserve is back.
    assert free0 - after < 256 * KiB, (free0, after)
    assert read_file(path) == want
    check_clean(fsck_clean, m)


def test_no_window_without_dedup_and_lazy_sync_keeps_bytes(make_mount, fsck_clean):
    """-o nodedup: no rewrite is answered in C (no window opens); sync=lazy:
    windows do open, and the bytes are right after the lazy commit and a
    remount."""
    for options, in_c in ((["pmem_size=256M", "dedup=off"], False),
                          (["pmem_size=256M", "sync=lazy"], True)):
        m = make_mount(options=options)
        path = m.path / "f.bin"
        want = bytearray(pattern(4 * MiB, seed=61))
        path.write_bytes(want)
        before = _answered_in_c(m)
        rng = random.Random(62)
        fd = os.open(path, os.O_RDWR)
        try:
            for cycle in range(6):
                _rewrites(fd, want, rng, 16, cycle)
                if cycle % 2:
                    os.fsync(fd)
            push_to_daemon(fd)
            assert pread_all(fd, len(want), 0) == want
        finally:
            os.close(fd)
        answered = _answered_in_c(m) - before
        assert (answered > 0) == in_c, (options, answered)
        m.remount()
        assert read_file(path) == want, options
        check_clean(fsck_clean, m)


def test_kill_right_after_an_fsync_of_rewrites_keeps_them_all(make_mount, fsck_clean):
    """SIGKILL right after an fsync that covered rewrites answered in C
    (and, on a second file, after rewrites beyond the last fsync): after the
    remount the first holds every rewrite, the second what its fsync made
    durable, byte for byte."""
    m = make_mount(options=["pmem_size=512M", "sync=close"])
    p1, p2 = m.path / "synced.bin", m.path / "half.bin"
    w1 = bytearray(pattern(8 * MiB, seed=71))
    w2 = bytearray(pattern(8 * MiB, seed=72))
    p1.write_bytes(w1)
    p2.write_bytes(w2)
    rng = random.Random(73)
    f1, f2 = os.open(p1, os.O_RDWR), os.open(p2, os.O_RDWR)
    try:
        before = _answered_in_c(m)
        for cycle in range(5):
            _rewrites(f1, w1, rng, 32, cycle)
            _rewrites(f2, w2, rng, 32, 10 + cycle)
            os.fsync(f2)
        durable2 = bytes(w2)
        _rewrites(f1, w1, rng, 64, 20)
        _rewrites(f2, w2, rng, 64, 21)
        # Past the end too: the size is part of what fsync makes durable.
        _put(f1, w1, len(w1) + 5000, pattern(9000, seed=22))
        os.fsync(f1)
        push_to_daemon(f2)
        assert _answered_in_c(m) - before >= 200
        m.kill()
    finally:
        for fd in (f1, f2):
            try:
                os.close(fd)
            except OSError:
                pass
    m.start()
    assert read_file(p1) == w1
    assert read_file(p2) == durable2
    check_clean(fsck_clean, m)


def test_reserves_of_many_open_files_do_not_fill_the_log(make_mount, fsck_clean):
    """80 files open at once, each with 8 KiB written (a stream: its arena
    reserves log space) and its first page patched (a rewrite: its window
    reserves more), on a 64 MiB log: the reserves must not make a write
    fail with ENOSPC while the log holds well under 1 MiB of data; what a
    write lacks comes out of the other files' unwritten reserves. A 24 MiB
    file then fits too, and every file holds its bytes after a remount."""
    m = make_mount(options=["pmem_size=64M", "sync=close", "tiering=off"])
    buf = mmap.mmap(-1, 8192)
    fds, wants = [], []
    try:
        for i in range(80):
            fd = os.open(m.path / f"h{i}", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
            fds.append(fd)
            buf[:] = pattern(8192, seed=i)
            assert os.pwritev(fd, [buf], 0) == 8192
            want = bytearray(buf)
            buf[:4096] = pattern(4096, seed=1000 + i)
            assert os.pwritev(fd, [memoryview(buf)[:4096]], 0) == 4096     # the header
            want[:4096] = buf[:4096]
            wants.append(bytes(want))
        big = bytearray()
        with open(m.path / "big", "wb") as f:
            for i in range(24):
                piece = pattern(MiB, seed=5000 + i)
                f.write(piece)
                big += piece
            f.flush()
            os.fsync(f.fileno())
        for i, fd in enumerate(fds):        # the files' streams and windows go on
            buf[:4096] = pattern(4096, seed=2000 + i)
            assert os.pwritev(fd, [memoryview(buf)[:4096]], 4096) == 4096
            wants[i] = wants[i][:4096] + bytes(buf[:4096])
    finally:
        for fd in fds:
            os.close(fd)
    m.remount()
    for i, want in enumerate(wants):
        assert read_file(m.path / f"h{i}") == want, i
    assert read_file(m.path / "big") == big
    check_clean(fsck_clean, m)
