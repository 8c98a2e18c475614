"""POSIX surface, attributes: chmod, chown, utimens (nanoseconds), umask,
setgid directories, xattrs, statfs, and attribute durability across remounts.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import time

import pytest

from posix_helpers import MiB, check_clean, expect_errno, pattern, wait_for, write_file


# ---------------------------------------------------------------- chmod / chown

def test_chmod(mounted, fsck_clean):
    f = mounted.path / "f"
    d = mounted.path / "d"
    write_file(f, b"x")
    os.mkdir(d)
    os.chmod(f, 0o4751)
    os.chmod(d, 0o1777)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o4751
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o1777
    assert stat.S_ISREG(os.stat(f).st_mode) and stat.S_ISDIR(os.stat(d).st_mode)
    mounted.remount()
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o4751
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o1777
    check_clean(fsck_clean, mounted)


def test_fchmod_on_open_file(mounted, fsck_clean):
    f = mounted.path / "f"
    fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"data")
        os.fchmod(fd, 0o600)
        os.write(fd, b"more")
    finally:
        os.close(fd)
    mounted.remount()
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert f.read_bytes() == b"datamore"
    check_clean(fsck_clean, mounted)


def test_chown(mounted, fsck_clean):
    f = mounted.path / "f"
    d = mounted.path / "d"
    write_file(f, b"x")
    os.mkdir(d)
    os.symlink("f", mounted.path / "l")
    os.chown(f, 1234, 5678)
    os.chown(d, 4321, -1)
    os.chown(mounted.path / "l", 99, 98, follow_symlinks=False)
    assert (os.stat(f).st_uid, os.stat(f).st_gid) == (1234, 5678)
    assert os.stat(d).st_uid == 4321 and os.stat(d).st_gid == os.getgid()
    assert (os.lstat(mounted.path / "l").st_uid, os.lstat(mounted.path / "l").st_gid) == (99, 98)
    mounted.remount()
    assert (os.stat(f).st_uid, os.stat(f).st_gid) == (1234, 5678)
    assert os.stat(d).st_uid == 4321
    assert (os.lstat(mounted.path / "l").st_uid, os.lstat(mounted.path / "l").st_gid) == (99, 98)
    check_clean(fsck_clean, mounted)


def test_chown_clears_setuid(mounted):
    f = mounted.path / "f"
    write_file(f, b"x")
    os.chmod(f, 0o6755)
    os.chown(f, 1000, 1000)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o755
    mounted.remount()
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o755


def test_new_files_get_caller_ids(mounted):
    f = mounted.path / "f"
    write_file(f, b"x")
    os.mkdir(mounted.path / "d")
    for p in (f, mounted.path / "d"):
        st = os.stat(p)
        assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())


def test_ctime_changes_on_chmod(mounted):
    f = mounted.path / "f"
    write_file(f, b"x")
    before = os.stat(f)
    time.sleep(0.01)
    os.chmod(f, 0o600)
    after = os.stat(f)
    assert after.st_ctime_ns > before.st_ctime_ns
    assert after.st_mtime_ns == before.st_mtime_ns


# ---------------------------------------------------------------------- utimens

def test_utimens_nanoseconds(mounted, fsck_clean):
    f = mounted.path / "f"
    d = mounted.path / "d"
    write_file(f, b"x")
    os.mkdir(d)
    os.symlink("f", mounted.path / "l")
    times = (1_234_567_890_123_456_789, 1_500_000_000_987_654_321)
    os.utime(f, ns=times)
    os.utime(d, ns=(times[0] + 1, times[1] + 1))
    os.utime(mounted.path / "l", ns=(times[0] + 2, times[1] + 2), follow_symlinks=False)
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == times
    mounted.remount()
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == times
    st = os.stat(d)
    assert (st.st_atime_ns, st.st_mtime_ns) == (times[0] + 1, times[1] + 1)
    st = os.lstat(mounted.path / "l")
    assert (st.st_atime_ns, st.st_mtime_ns) == (times[0] + 2, times[1] + 2)
    check_clean(fsck_clean, mounted)


def test_utimens_on_open_written_file(mounted, fsck_clean):
    """touch -d on a file still open for writing: the explicit time wins."""
    f = mounted.path / "f"
    fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"some data")
        os.utime(fd, ns=(1_000_000_000_000_000_001, 1_100_000_000_000_000_001))
    finally:
        os.close(fd)
    assert os.stat(f).st_mtime_ns == 1_100_000_000_000_000_001
    mounted.remount()
    assert os.stat(f).st_mtime_ns == 1_100_000_000_000_000_001
    assert f.read_bytes() == b"some data"
    check_clean(fsck_clean, mounted)


def test_utime_now_and_mtime_on_write(mounted):
    f = mounted.path / "f"
    write_file(f, b"x")
    os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    t0 = time.time_ns()
    with open(f, "ab") as fh:
        fh.write(b"y")
    st = os.stat(f)
    assert st.st_mtime_ns >= t0 - 10**9, "a write must advance mtime"
    os.utime(f)
    assert abs(os.stat(f).st_mtime_ns - time.time_ns()) < 5 * 10**9


def test_touch_atime_only_and_mtime_only(mounted):
    f = mounted.path / "f"
    write_file(f, b"x")
    os.utime(f, ns=(1_000_000_000_000_000_000, 1_100_000_000_000_000_000))
    subprocess.run(["touch", "-a", "-d", "@1200000000.5", str(f)], check=True)
    st = os.stat(f)
    assert st.st_atime_ns == 1_200_000_000_500_000_000
    assert st.st_mtime_ns == 1_100_000_000_000_000_000
    subprocess.run(["touch", "-m", "-d", "@1300000000.25", str(f)], check=True)
    st = os.stat(f)
    assert st.st_atime_ns == 1_200_000_000_500_000_000
    assert st.st_mtime_ns == 1_300_000_000_250_000_000
    mounted.remount()
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_200_000_000_500_000_000,
                                                1_300_000_000_250_000_000)


def test_mtime_survives_remount_after_write(mounted):
    f = mounted.path / "f"
    write_file(f, b"x" * 5000)
    st = os.stat(f)
    mounted.remount()
    assert os.stat(f).st_mtime_ns == st.st_mtime_ns
    assert os.stat(f).st_size == 5000


# ------------------------------------------------------------------------ umask

def test_umask_applied(mounted):
    old = os.umask(0o027)
    try:
        fd = os.open(mounted.path / "f", os.O_WRONLY | os.O_CREAT, 0o666)
        os.close(fd)
        os.mkdir(mounted.path / "d", 0o777)
        os.mknod(mounted.path / "n", 0o666 | stat.S_IFREG)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(mounted.path / "f").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(mounted.path / "d").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(mounted.path / "n").st_mode) == 0o640
    mounted.remount()
    assert stat.S_IMODE(os.stat(mounted.path / "f").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(mounted.path / "d").st_mode) == 0o750


def test_setgid_directory_inheritance(mounted, fsck_clean):
    d = mounted.path / "shared"
    os.mkdir(d)
    os.chown(d, -1, 4242)
    os.chmod(d, 0o2775)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o2775
    write_file(d / "f", b"x")
    os.mkdir(d / "sub")
    assert os.stat(d / "f").st_gid == 4242
    assert os.stat(d / "sub").st_gid == 4242
    assert os.stat(d / "sub").st_mode & stat.S_ISGID
    write_file(d / "sub" / "g", b"y")
    assert os.stat(d / "sub" / "g").st_gid == 4242
    mounted.remount()
    assert os.stat(d / "f").st_gid == 4242
    assert os.stat(d / "sub").st_mode & stat.S_ISGID
    assert os.stat(d / "sub" / "g").st_gid == 4242
    check_clean(fsck_clean, mounted)


# ----------------------------------------------------------------------- xattrs

def test_xattr_set_get_list_remove(mounted, fsck_clean):
    f = mounted.path / "f"
    write_file(f, b"x")
    os.setxattr(f, "user.a", b"alpha")
    os.setxattr(f, "user.b", b"")
    os.setxattr(f, "user.a", b"alpha2")          # replace
    assert os.getxattr(f, "user.a") == b"alpha2"
    assert os.getxattr(f, "user.b") == b""
    assert sorted(os.listxattr(f)) == ["user.a", "user.b"]
    os.removexattr(f, "user.b")
    assert os.listxattr(f) == ["user.a"]
    mounted.remount()
    assert os.listxattr(f) == ["user.a"]
    assert os.getxattr(f, "user.a") == b"alpha2"
    check_clean(fsck_clean, mounted)


def test_xattr_missing(mounted):
    f = mounted.path / "f"
    write_file(f, b"x")
    expect_errno(errno.ENODATA, os.getxattr, f, "user.nope")
    expect_errno(errno.ENODATA, os.removexattr, f, "user.nope")
    assert os.listxattr(f) == []


def test_xattr_create_replace_flags(mounted):
    f = mounted.path / "f"
    write_file(f, b"x")
    os.setxattr(f, "user.k", b"1", os.XATTR_CREATE)
    expect_errno(errno.EEXIST, os.setxattr, f, "user.k", b"2", os.XATTR_CREATE)
    expect_errno(errno.ENODATA, os.setxattr, f, "user.other", b"2", os.XATTR_REPLACE)
    os.setxattr(f, "user.k", b"3", os.XATTR_REPLACE)
    assert os.getxattr(f, "user.k") == b"3"
    assert os.listxattr(f) == ["user.k"]


def test_xattr_on_dir_and_symlink(mounted):
    d = mounted.path / "d"
    os.mkdir(d)
    os.setxattr(d, "user.dir", b"on a dir")
    assert os.getxattr(d, "user.dir") == b"on a dir"
    mounted.remount()
    assert os.getxattr(d, "user.dir") == b"on a dir"


def test_xattr_large_value(mounted, fsck_clean):
    f = mounted.path / "f"
    write_file(f, b"x")
    big = pattern(60 * 1024, 40)
    os.setxattr(f, "user.big", big)
    assert os.getxattr(f, "user.big") == big
    too_big = bytes(64 * 1024 + 1)
    with pytest.raises(OSError) as info:
        os.setxattr(f, "user.huge", too_big)
    assert info.value.errno in (errno.E2BIG, errno.ERANGE, errno.ENOSPC)
    mounted.remount()
    assert os.getxattr(f, "user.big") == big
    check_clean(fsck_clean, mounted)


def test_xattr_many_names(mounted):
    f = mounted.path / "f"
    write_file(f, b"x")
    names = [f"user.attr-{i:03d}-{'n' * (i % 50)}" for i in range(300)]
    for i, name in enumerate(names):
        os.setxattr(f, name, str(i).encode())
    assert sorted(os.listxattr(f)) == sorted(names)
    out = subprocess.run(["getfattr", "-d", "--absolute-names", str(f)], capture_output=True,
                         text=True)
    if out.returncode == 0:          # attr tools installed
        assert out.stdout.count("user.attr-") == 300
    mounted.remount()
    assert sorted(os.listxattr(f)) == sorted(names)
    assert os.getxattr(f, names[123]) == b"123"


def test_xattr_survives_rename_and_link(mounted):
    f = mounted.path / "f"
    write_file(f, b"x")
    os.setxattr(f, "user.tag", b"v1")
    os.rename(f, mounted.path / "g")
    os.link(mounted.path / "g", mounted.path / "h")
    assert os.getxattr(mounted.path / "h", "user.tag") == b"v1"


# ----------------------------------------------------------------------- statfs

def test_statfs(mounted):
    s = os.statvfs(mounted.path)
    assert s.f_bsize > 0 and s.f_frsize > 0
    assert s.f_blocks > 0
    assert 0 < s.f_bfree <= s.f_blocks
    assert 0 < s.f_bavail <= s.f_blocks
    assert s.f_namemax == 255
    assert s.f_files > 0 and s.f_ffree > 0
    df = os.popen(f"df -P {mounted.path}").read()
    assert str(mounted.path) in df


def test_statfs_free_space_drops_after_write(mounted):
    """f_bfree counts the log's free space plus the disk's; other processes change the
    disk's, so each sample subtracts the disk's own free space (taken right after)."""
    disk = mounted.path.parent.parent      # same filesystem, outside the mount

    def log_free_bytes() -> int:
        s = os.statvfs(mounted.path)
        d = os.statvfs(disk)
        return s.f_bfree * s.f_frsize - d.f_bfree * d.f_frsize

    before = log_free_bytes()
    write_file(mounted.path / "big", pattern(100 * MiB, 41))
    used = before - log_free_bytes()
    assert 90 * MiB <= used <= 110 * MiB, f"f_bfree dropped by {used} bytes after 100 MiB"
    os.unlink(mounted.path / "big")
    assert wait_for(lambda: before - log_free_bytes() < 10 * MiB), \
        "the space of a deleted file did not come back in f_bfree"


def test_statfs_inode_counts_change(mounted):
    before = os.statvfs(mounted.path).f_ffree
    for i in range(10):
        os.mknod(mounted.path / f"n{i}", 0o644 | stat.S_IFREG)
    assert os.statvfs(mounted.path).f_ffree < before
