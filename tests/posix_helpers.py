"""Small helpers shared by the POSIX-surface tests (test_posix_*.py, test_mount_cli.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import importlib.util
import os
import platform
import pwd
import random
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from ckptfs import index as ix
from ckptfs.index import ROOT_INO, Index
from mounting import REPO, is_mounted

MiB = 1 << 20
GiB = 1 << 30

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def have_fsck() -> bool:
    return importlib.util.find_spec("ckptfs.fsck") is not None


def check_clean(fsck_clean, m) -> None:
    """End of a test that wrote: unmount, and fsck must be clean (once fsck exists).

    Without ckptfs.fsck the unmount still happens, so a clean unmount is checked.
    """
    if have_fsck():
        fsck_clean(m)
    elif is_mounted(m.path):
        m.umount()


def remount_and_check(fsck_clean, m, path, want: bytes) -> None:
    """End of a test that wrote path: after a remount it reads back as want,
    then the unmount and fsck are clean."""
    m.remount()
    got = read_file(path)
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                  min(len(got), len(want)))
        raise AssertionError(f"{path} after a remount: {len(got)} bytes, want {len(want)}; "
                             f"first difference at {at}")
    check_clean(fsck_clean, m)


def renameat2(old: os.PathLike | str, new: os.PathLike | str, flags: int) -> None:
    """rename(2) with flags, through libc or the raw syscall (316 on x86_64)."""
    o, n = os.fsencode(old), os.fsencode(new)
    fn = getattr(_libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                       ctypes.c_uint]
        rc = fn(AT_FDCWD, o, AT_FDCWD, n, flags)
    else:
        assert platform.machine() == "x86_64", "renameat2 syscall number known for x86_64 only"
        _libc.syscall.restype = ctypes.c_long
        rc = _libc.syscall(ctypes.c_long(316), ctypes.c_int(AT_FDCWD), o,
                           ctypes.c_int(AT_FDCWD), n, ctypes.c_uint(flags))
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), os.fsdecode(old), None, os.fsdecode(new))


SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4


def close_after_kill(fd: int) -> None:
    """Close fd of a file on a mount whose daemon was killed: ENOTCONN is
    what a dead mount says, and nothing else is expected of it."""
    try:
        os.close(fd)
    except OSError:
        pass


def push_to_daemon(fd: int) -> None:
    """Write the fd's dirty pages back to the daemon WITHOUT fsync (no commit), then drop
    the page cache, so that the next read is answered by the daemon's open-file overlay."""
    _libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_uint]
    rc = _libc.sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE
                               | SYNC_FILE_RANGE_WAIT_AFTER)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def expect_errno(code: int, fn: Callable, *args, **kw) -> OSError:
    with pytest.raises(OSError) as info:
        fn(*args, **kw)
    assert info.value.errno == code, \
        f"expected {errno.errorcode[code]}, got {errno.errorcode.get(info.value.errno)}: {info.value}"
    return info.value


def write_file(path, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)


def read_file(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pattern(n: int, seed: int = 0) -> bytes:
    """n reproducible pseudo-random bytes (a misplaced block shows)."""
    return random.Random(seed).randbytes(n)


def pread_all(fd: int, n: int, off: int, step: int = 1 << 20) -> bytes:
    """n bytes of fd from off, in preads of step bytes (fewer at its end)."""
    out = bytearray()
    while len(out) < n:
        got = os.pread(fd, min(step, n - len(out)), off + len(out))
        if not got:
            break
        out += got
    return bytes(out)


def drop_pages(fd: int) -> None:
    """The next reads of fd go to the daemon, not the kernel's page cache."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def check_random_reads(fd: int, want: bytes, seed: int, reads: int, max_bytes: int,
                       before_each: Callable[[], None] = lambda: None) -> None:
    """reads preads of fd at random offsets and lengths (1..max_bytes), each
    after dropping its pages (and before_each()), equal to want's bytes there."""
    rng = random.Random(seed)
    for _ in range(reads):
        drop_pages(fd)
        before_each()
        off = rng.randrange(len(want))
        n = rng.randrange(1, max_bytes)
        assert os.pread(fd, n, off) == want[off:off + n], (off, n)


def wait_for(pred: Callable[[], bool], timeout_s: float = 10.0, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return pred()


def wait_until(check: Callable[[], object], timeout_s: float, what: str) -> float:
    """Seconds until check() is true; fails (saying what) after timeout_s."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)
    return time.monotonic() - started


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ------------------------------------------------------- as another user

def unused_uid() -> int:
    """A uid no account and no leftover /tmp/ckptfs-UID belongs to: this test's own user."""
    taken = {p.pw_uid for p in pwd.getpwall()}
    for uid in range(61000 + os.getpid() % 500, 62000):
        if uid not in taken and not os.path.lexists(f"/tmp/ckptfs-{uid}"):
            return uid
    pytest.skip("no free uid")


def as_user(uid: int, argv: list[str], *, python_access: bool = False, env=None,
            timeout: float = 60) -> subprocess.CompletedProcess:
    """Run argv as uid:uid with no supplementary groups.

    python_access: keep CAP_DAC_READ_SEARCH (read and search only: no write, no
    ownership) so the user can run the test interpreter, which lives below
    root's 0700 home here. It changes no check ckptfs makes: those compare
    owners and modes, and connecting to or creating anything still needs write
    permission.
    """
    pre = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    if python_access:
        pre += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return subprocess.run(pre + argv, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)


def log_position(source: Path, name: str, file_off: int) -> int:
    """Where in the log file the byte at file_off of /name lives (unmounted fs)."""
    index = Index(str(source / ".ckptfs" / "index"))
    try:
        ino = ix.dirent_decode(index._get("dirents", ix.dirent_key(ROOT_INO, name.encode())))[0]
        for e in ix.iter_extents(index, ino, file_off, file_off + 1):
            chunk = ix.get_chunk(index, e.chunk_no)
            assert chunk.kind == ix.CHUNK_LOG
            return chunk.log_off + e.chunk_off + (file_off - e.file_off)
        raise AssertionError(f"{name} has no data at {file_off}")
    finally:
        index.close()


def flip_log_bit(source: Path, name: str, file_off: int) -> None:
    """Damage the log copy of /name's byte at file_off (unmounted fs): one bit flipped."""
    pos = log_position(source, name, file_off)
    with open(source / ".ckptfs" / "pmem.log", "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x40]))


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    """Run fn(*args) in a thread; the list gets its result or its exception."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:      # handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out
