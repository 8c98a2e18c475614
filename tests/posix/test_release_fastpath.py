"""RELEASE answered in C after a FLUSH that left the file nothing to commit
(fastpath.release_quiet, Filesystem.fold_released).

A small file's close is FLUSH (the commit, durable with sync=close) then
RELEASE: the RELEASE needs only the handle's bookkeeping, which the daemon
folds in before any Python runs. Every close must still be durable as
before (kill -9 after the closes, remount, every byte there), the handles
must be gone (no leak), and a RELEASE after any other request about the
file (an mmap's writeback, a second handle's writes) must not be answered
in C when it has something to commit.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import trio

from ckptfs import control

from posix_helpers import check_clean

KiB = 1 << 10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _stat(m) -> dict:
    return control.request(str(m.path), "stat")


def _settle(m, timeout_s: float = 10.0) -> dict:
    """The daemon's stat once no file is open or has uncommitted changes
    (the kernel sends RELEASE after close() returned)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = _stat(m)
        if (st["open_files"] == 0 and st["dirty_files"] == 0) or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


def _small(i: int) -> bytes:
    return (b"%06d" % i) * (4 * KiB // 6) + b"\n" * (4 * KiB % 6)


def test_small_closes_are_released_in_c_and_survive_a_crash(make_mount, fsck_clean):
    m = make_mount(["sync=close"])
    d = m.path / "small"
    d.mkdir()
    before = _stat(m)["fuse_release_answered_in_c"]
    for i in range(200):
        fd = os.open(d / f"f{i:03d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, _small(i))
        os.close(fd)
    st = _settle(m)
    assert st["open_files"] == 0 and st["dirty_files"] == 0     # no handle left behind
    assert st["fuse_release_answered_in_c"] - before >= 190, st["fuse_requests"]
    m.kill()                    # every close above returned durable
    m.start()
    for i in range(200):
        assert (d / f"f{i:03d}").read_bytes() == _small(i), i
    check_clean(fsck_clean, m)


def test_a_release_after_a_request_about_the_file_goes_to_the_daemon(make_mount, fsck_clean):
    m = make_mount(["sync=close"])
    p = m.path / "mapped"
    p.write_bytes(bytes(3 * 4096))
    _settle(m)
    before = _stat(m)["fuse_release_answered_in_c"]
    # Mapped without a second fd (Python's mmap dups it, and closing that
    # one is a FLUSH of its own): the fd's FLUSH commits, the mapping keeps
    # the file open, and at munmap its writeback (a WRITE of the inode)
    # comes between that FLUSH and the RELEASE, which has it to commit.
    fd = os.open(p, os.O_RDWR)
    addr = _libc.mmap(None, 3 * 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    os.close(fd)
    ctypes.memmove(addr + 4096, b"MMAP", 4)
    assert _libc.munmap(ctypes.c_void_p(addr), 3 * 4096) == 0
    st = _settle(m)
    assert st["open_files"] == 0 and st["dirty_files"] == 0
    assert st["fuse_release_answered_in_c"] == before, "a RELEASE with a commit to do in C"

    # Two handles: the first one's RELEASE is bookkeeping only (the file
    # stays open), the second one's writes commit at its own close.
    q = m.path / "two"
    fd1 = os.open(q, os.O_WRONLY | os.O_CREAT, 0o644)
    fd2 = os.open(q, os.O_WRONLY)
    os.write(fd1, b"a" * 4096)
    os.close(fd1)
    os.pwrite(fd2, b"b" * 4096, 4096)
    os.close(fd2)

    # Unlinked while open: gone at the last close, however it was released.
    r = m.path / "gone"
    fd1 = os.open(r, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd1, b"x" * 4096)
    fd2 = os.open(r, os.O_RDONLY)
    os.close(fd1)
    os.unlink(r)
    assert os.read(fd2, 4096) == b"x" * 4096
    os.close(fd2)

    st = _settle(m)
    assert st["open_files"] == 0 and st["dirty_files"] == 0
    m.sync()                    # the unlink: durable at the latest at the next sync
    m.kill()
    m.start()
    assert p.read_bytes()[4096:4100] == b"MMAP"
    assert q.read_bytes() == b"a" * 4096 + b"b" * 4096
    assert not r.exists()
    check_clean(fsck_clean, m)


def test_a_folded_release_whose_file_changed_is_released_whole(inproc):
    """fold_released of a last handle whose file has changes (the C module
    should never send one): the whole release runs on serve_owed_releases'
    task, so the changes are committed as at any last close."""
    fs = inproc(["pmem_size=64M", "sync=close"])

    async def main(h) -> None:
        await h.write_file("f", b"1" * 4096)
        ino = h.lookup("f")
        fh = h.fs.open(ino, os.O_WRONLY)
        await h.fs.write(fh, 0, b"2" * 4096)
        async with trio.open_nursery() as n:
            n.start_soon(h.fs.serve_owed_releases)
            h.fs.fold_released([fh])
            assert fh in h.fs.handles           # not released yet: owed
            with trio.fail_after(10):
                while fh in h.fs.handles or h.fs.files.dirty_files:
                    await trio.sleep(0.01)
            await h.fs.index.wait_durable(h.fs.index.current_seq())
            n.cancel_scope.cancel()
        assert h.fs.open_count.get(ino) is None

    fs.run(main)
    fs.close()                  # as a crash leaves it
    again = inproc(["pmem_size=64M", "sync=close"], source=fs.source)

    async def check(h) -> None:
        assert await h.read_file("f") == b"2" * 4096

    again.run(check)
    again.close()
