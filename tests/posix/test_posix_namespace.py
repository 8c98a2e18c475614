"""POSIX surface, namespace: directories (large ones too), rename with every
flag and collision, unlink, hard links, symlinks, name limits, the hidden
state directory, and handles to deleted directories.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess

from posix_helpers import (RENAME_EXCHANGE, RENAME_NOREPLACE, check_clean, expect_errno,
                           read_file, renameat2, write_file)


# ------------------------------------------------------------------ directories

def test_mkdir_rmdir(mounted, fsck_clean):
    d = mounted.path / "d"
    os.mkdir(d)
    assert stat.S_ISDIR(os.stat(d).st_mode)
    os.makedirs(d / "a" / "b" / "c")
    assert os.listdir(d / "a" / "b") == ["c"]
    expect_errno(errno.EEXIST, os.mkdir, d)
    os.rmdir(d / "a" / "b" / "c")
    assert os.listdir(d / "a" / "b") == []
    os.rmdir(d / "a" / "b")
    os.rmdir(d / "a")
    os.rmdir(d)
    mounted.remount()
    assert os.listdir(mounted.path) == []
    check_clean(fsck_clean, mounted)


def test_rmdir_non_empty(mounted):
    d = mounted.path / "d"
    os.mkdir(d)
    write_file(d / "f", b"x")
    expect_errno(errno.ENOTEMPTY, os.rmdir, d)
    os.unlink(d / "f")
    os.mkdir(d / "sub")
    expect_errno(errno.ENOTEMPTY, os.rmdir, d)
    os.rmdir(d / "sub")
    os.rmdir(d)
    assert not d.exists()


def test_rmdir_and_unlink_wrong_type(mounted):
    write_file(mounted.path / "f", b"x")
    os.mkdir(mounted.path / "d")
    expect_errno(errno.ENOTDIR, os.rmdir, mounted.path / "f")
    expect_errno(errno.EISDIR, os.unlink, mounted.path / "d")
    expect_errno(errno.ENOENT, os.unlink, mounted.path / "missing")
    expect_errno(errno.ENOENT, os.rmdir, mounted.path / "missing")


def test_directory_nlink(mounted):
    d = mounted.path / "d"
    os.mkdir(d)
    assert os.stat(d).st_nlink == 2
    for i in range(3):
        os.mkdir(d / f"s{i}")
    write_file(d / "f", b"")
    assert os.stat(d).st_nlink == 5
    os.rmdir(d / "s0")
    assert os.stat(d).st_nlink == 4
    mounted.remount()
    assert os.stat(d).st_nlink == 4


def test_large_directory_listing(mounted, fsck_clean):
    d = mounted.path / "big"
    os.mkdir(d)
    names = {f"entry-{i:05d}-{'x' * (i % 40)}" for i in range(5000)}
    for name in names:
        os.mknod(d / name, 0o644 | stat.S_IFREG)
    assert set(os.listdir(d)) == names
    ls = subprocess.run(f"ls -f {d} | wc -l", shell=True, capture_output=True, text=True,
                        check=True)
    assert int(ls.stdout) == 5000 + 2     # -f also lists . and ..
    ls = subprocess.run(f"ls {d} | wc -l", shell=True, capture_output=True, text=True,
                        check=True)
    assert int(ls.stdout) == 5000
    mounted.remount()
    assert set(os.listdir(d)) == names
    check_clean(fsck_clean, mounted)


def test_readdir_while_deleting(mounted):
    """Entries deleted between getdents calls: no duplicates, every survivor seen."""
    d = mounted.path / "dir"
    os.mkdir(d)
    names = [f"f{i:04d}" for i in range(3000)]
    for name in names:
        os.mknod(d / name, 0o644 | stat.S_IFREG)
    seen: list[str] = []
    deleted: set[str] = set()
    with os.scandir(d) as it:
        for i, entry in enumerate(it):
            seen.append(entry.name)
            if i % 100 == 0:
                # delete a spread of names, some seen already, some not yet
                for victim in names[(i * 7) % 3000::97][:10]:
                    if victim not in deleted:
                        os.unlink(d / victim)
                        deleted.add(victim)
    assert len(seen) == len(set(seen)), "readdir returned duplicates"
    survivors = set(names) - deleted
    assert survivors <= set(seen), f"missed {sorted(survivors - set(seen))[:5]}"
    assert set(seen) <= set(names)
    assert set(os.listdir(d)) == survivors
    assert len(deleted) > 100


def test_readdir_while_creating(mounted):
    """Entries created during a listing: old ones all seen once, no duplicates."""
    d = mounted.path / "dir"
    os.mkdir(d)
    names = {f"old{i:04d}" for i in range(1500)}
    for name in names:
        os.mknod(d / name, 0o644 | stat.S_IFREG)
    seen = []
    with os.scandir(d) as it:
        for i, entry in enumerate(it):
            seen.append(entry.name)
            if i % 200 == 0:
                os.mknod(d / f"new{i:04d}", 0o644 | stat.S_IFREG)
    assert len(seen) == len(set(seen))
    assert names <= set(seen)


# ----------------------------------------------------------------------- rename

def test_rename_over_file(mounted, fsck_clean):
    write_file(mounted.path / "a", b"new content")
    write_file(mounted.path / "b", b"old content, longer")
    ino_a = os.stat(mounted.path / "a").st_ino
    os.rename(mounted.path / "a", mounted.path / "b")
    assert not (mounted.path / "a").exists()
    assert os.stat(mounted.path / "b").st_ino == ino_a
    assert read_file(mounted.path / "b") == b"new content"
    mounted.remount()
    assert os.listdir(mounted.path) == ["b"]
    assert read_file(mounted.path / "b") == b"new content"
    check_clean(fsck_clean, mounted)


def test_rename_tmp_then_rename_pattern(mounted, fsck_clean):
    """What checkpoint savers do: write a temp name, fsync, rename over the real one."""
    d = mounted.path / "ckpt"
    os.mkdir(d)
    for version in range(5):
        tmp = d / f".model.pt.tmp{version}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, f"version {version}".encode() * 1000)
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, d / "model.pt")
    mounted.remount()
    assert os.listdir(d) == ["model.pt"]
    assert read_file(d / "model.pt") == b"version 4" * 1000
    check_clean(fsck_clean, mounted)


def test_rename_across_directories(mounted, fsck_clean):
    os.makedirs(mounted.path / "a" / "sub")
    os.mkdir(mounted.path / "b")
    write_file(mounted.path / "a" / "sub" / "f", b"data")
    os.rename(mounted.path / "a" / "sub", mounted.path / "b" / "moved")
    assert os.stat(mounted.path / "a").st_nlink == 2
    assert os.stat(mounted.path / "b").st_nlink == 3
    assert read_file(mounted.path / "b" / "moved" / "f") == b"data"
    # '..' of the moved directory is its new parent
    assert os.stat(mounted.path / "b" / "moved" / "..").st_ino == os.stat(mounted.path / "b").st_ino
    mounted.remount()
    assert os.listdir(mounted.path / "a") == []
    assert read_file(mounted.path / "b" / "moved" / "f") == b"data"
    assert os.stat(mounted.path / "b").st_nlink == 3
    check_clean(fsck_clean, mounted)


def test_rename_dir_over_empty_dir(mounted, fsck_clean):
    os.mkdir(mounted.path / "src")
    write_file(mounted.path / "src" / "f", b"inside")
    os.mkdir(mounted.path / "dst")
    os.rename(mounted.path / "src", mounted.path / "dst")
    assert os.listdir(mounted.path) == ["dst"]
    assert read_file(mounted.path / "dst" / "f") == b"inside"
    assert os.stat(mounted.path).st_nlink == 3
    # across directories
    os.makedirs(mounted.path / "a" / "src2")
    os.makedirs(mounted.path / "b" / "dst2")
    os.rename(mounted.path / "a" / "src2", mounted.path / "b" / "dst2")
    assert os.stat(mounted.path / "a").st_nlink == 2
    assert os.stat(mounted.path / "b").st_nlink == 3
    mounted.remount()
    assert sorted(os.listdir(mounted.path)) == ["a", "b", "dst"]
    assert read_file(mounted.path / "dst" / "f") == b"inside"
    assert os.stat(mounted.path).st_nlink == 5
    assert os.listdir(mounted.path / "b") == ["dst2"]
    assert os.stat(mounted.path / "a").st_nlink == 2
    assert os.stat(mounted.path / "b").st_nlink == 3
    check_clean(fsck_clean, mounted)


def test_rename_onto_non_empty_dir(mounted):
    os.mkdir(mounted.path / "src")
    os.mkdir(mounted.path / "dst")
    write_file(mounted.path / "dst" / "f", b"x")
    expect_errno(errno.ENOTEMPTY, os.rename, mounted.path / "src", mounted.path / "dst")
    assert (mounted.path / "src").is_dir() and read_file(mounted.path / "dst" / "f") == b"x"


def test_rename_dir_onto_file(mounted):
    os.mkdir(mounted.path / "d")
    write_file(mounted.path / "f", b"x")
    expect_errno(errno.ENOTDIR, os.rename, mounted.path / "d", mounted.path / "f")
    assert (mounted.path / "d").is_dir() and read_file(mounted.path / "f") == b"x"


def test_rename_file_onto_dir(mounted):
    os.mkdir(mounted.path / "d")
    write_file(mounted.path / "f", b"x")
    expect_errno(errno.EISDIR, os.rename, mounted.path / "f", mounted.path / "d")
    assert (mounted.path / "d").is_dir() and read_file(mounted.path / "f") == b"x"


def test_rename_dir_into_own_subdir(mounted):
    os.makedirs(mounted.path / "a" / "b" / "c")
    expect_errno(errno.EINVAL, os.rename, mounted.path / "a", mounted.path / "a" / "b" / "x")
    expect_errno(errno.EINVAL, os.rename, mounted.path / "a", mounted.path / "a" / "x")
    assert (mounted.path / "a" / "b" / "c").is_dir()


def test_rename_onto_itself_and_hard_link(mounted):
    write_file(mounted.path / "a", b"x")
    os.link(mounted.path / "a", mounted.path / "b")
    os.rename(mounted.path / "a", mounted.path / "a")
    # POSIX: both names of one inode -> nothing happens
    os.rename(mounted.path / "a", mounted.path / "b")
    assert sorted(os.listdir(mounted.path)) == ["a", "b"]
    assert os.stat(mounted.path / "a").st_nlink == 2


def test_rename_missing_source(mounted):
    expect_errno(errno.ENOENT, os.rename, mounted.path / "nope", mounted.path / "x")


def test_rename_noreplace(mounted, fsck_clean):
    write_file(mounted.path / "a", b"A")
    write_file(mounted.path / "b", b"B")
    expect_errno(errno.EEXIST, renameat2, mounted.path / "a", mounted.path / "b", RENAME_NOREPLACE)
    os.mkdir(mounted.path / "d")
    expect_errno(errno.EEXIST, renameat2, mounted.path / "a", mounted.path / "d", RENAME_NOREPLACE)
    renameat2(mounted.path / "a", mounted.path / "c", RENAME_NOREPLACE)
    mounted.remount()
    assert sorted(os.listdir(mounted.path)) == ["b", "c", "d"]
    assert read_file(mounted.path / "b") == b"B"
    assert read_file(mounted.path / "c") == b"A"
    check_clean(fsck_clean, mounted)


def test_rename_exchange_files(mounted, fsck_clean):
    os.mkdir(mounted.path / "d")
    write_file(mounted.path / "a", b"AAAA")
    write_file(mounted.path / "d" / "b", b"BB")
    ino_a = os.stat(mounted.path / "a").st_ino
    renameat2(mounted.path / "a", mounted.path / "d" / "b", RENAME_EXCHANGE)
    assert read_file(mounted.path / "a") == b"BB"
    assert read_file(mounted.path / "d" / "b") == b"AAAA"
    assert os.stat(mounted.path / "d" / "b").st_ino == ino_a
    expect_errno(errno.ENOENT, renameat2, mounted.path / "a", mounted.path / "zz", RENAME_EXCHANGE)
    mounted.remount()
    assert read_file(mounted.path / "a") == b"BB"
    assert read_file(mounted.path / "d" / "b") == b"AAAA"
    check_clean(fsck_clean, mounted)


def test_rename_exchange_dirs(mounted, fsck_clean):
    os.makedirs(mounted.path / "x" / "d1" / "inner")
    os.mkdir(mounted.path / "y")
    write_file(mounted.path / "y" / "file", b"y-file")
    write_file(mounted.path / "x" / "d1" / "f1", b"one")
    # directory in x <-> file in y, then directory <-> directory
    renameat2(mounted.path / "x" / "d1", mounted.path / "y" / "file", RENAME_EXCHANGE)
    assert read_file(mounted.path / "x" / "d1") == b"y-file"
    assert read_file(mounted.path / "y" / "file" / "f1") == b"one"
    assert os.stat(mounted.path / "x").st_nlink == 2
    assert os.stat(mounted.path / "y").st_nlink == 3
    assert os.stat(mounted.path / "y" / "file" / "..").st_ino == os.stat(mounted.path / "y").st_ino
    os.mkdir(mounted.path / "x" / "e")
    write_file(mounted.path / "x" / "e" / "g", b"gee")
    renameat2(mounted.path / "x" / "e", mounted.path / "y" / "file", RENAME_EXCHANGE)
    mounted.remount()
    assert read_file(mounted.path / "x" / "e" / "f1") == b"one"
    assert (mounted.path / "x" / "e" / "inner").is_dir()
    assert read_file(mounted.path / "y" / "file" / "g") == b"gee"
    assert read_file(mounted.path / "x" / "d1") == b"y-file"
    assert os.stat(mounted.path / "x").st_nlink == 3
    assert os.stat(mounted.path / "y").st_nlink == 3
    # a directory cannot be exchanged with its own descendant
    expect_errno(errno.EINVAL, renameat2, mounted.path / "x", mounted.path / "x" / "e" / "inner",
                 RENAME_EXCHANGE)
    check_clean(fsck_clean, mounted)


def test_rename_over_open_file(mounted, fsck_clean):
    """The replaced file stays readable through an open fd, then goes away."""
    write_file(mounted.path / "old", b"old content")
    write_file(mounted.path / "new", b"new content")
    fd = os.open(mounted.path / "old", os.O_RDONLY)
    try:
        os.rename(mounted.path / "new", mounted.path / "old")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, 100, 0) == b"old content"
        assert os.fstat(fd).st_nlink == 0
    finally:
        os.close(fd)
    assert read_file(mounted.path / "old") == b"new content"
    mounted.remount()
    assert os.listdir(mounted.path) == ["old"]
    assert read_file(mounted.path / "old") == b"new content"
    check_clean(fsck_clean, mounted)


# ----------------------------------------------------------------------- unlink

def test_unlink(mounted, fsck_clean):
    write_file(mounted.path / "f", b"x" * 100000)
    write_file(mounted.path / "g", b"keep")
    os.unlink(mounted.path / "f")
    assert os.listdir(mounted.path) == ["g"]
    expect_errno(errno.ENOENT, os.stat, mounted.path / "f")
    mounted.remount()
    assert os.listdir(mounted.path) == ["g"]
    check_clean(fsck_clean, mounted)


# ------------------------------------------------------------------- hard links

def test_hard_links(mounted, fsck_clean):
    a, b = mounted.path / "a", mounted.path / "sub" / "b"
    os.mkdir(mounted.path / "sub")
    write_file(a, b"shared bytes")
    os.link(a, b)
    assert os.stat(a).st_nlink == 2 and os.stat(b).st_nlink == 2
    assert os.stat(a).st_ino == os.stat(b).st_ino
    with open(b, "r+b") as f:
        f.write(b"SHARED")
    assert read_file(a) == b"SHARED bytes"
    mounted.remount()
    assert os.stat(a).st_nlink == 2 and os.stat(b).st_nlink == 2
    os.unlink(a)
    assert os.stat(b).st_nlink == 1
    assert read_file(b) == b"SHARED bytes"
    mounted.remount()
    assert os.stat(b).st_nlink == 1
    assert read_file(b) == b"SHARED bytes"
    expect_errno(errno.EEXIST, os.link, b, b)
    check_clean(fsck_clean, mounted)


def test_hard_link_to_directory(mounted):
    os.mkdir(mounted.path / "d")
    expect_errno(errno.EPERM, os.link, mounted.path / "d", mounted.path / "d2")


# --------------------------------------------------------------------- symlinks

def test_symlinks(mounted, fsck_clean):
    write_file(mounted.path / "target", b"pointed at")
    os.symlink("target", mounted.path / "rel")
    os.symlink(str(mounted.path / "target"), mounted.path / "abs")
    os.symlink("does/not/exist", mounted.path / "dangling")
    assert os.readlink(mounted.path / "rel") == "target"
    assert read_file(mounted.path / "rel") == b"pointed at"
    assert read_file(mounted.path / "abs") == b"pointed at"
    st = os.lstat(mounted.path / "rel")
    assert stat.S_ISLNK(st.st_mode) and st.st_size == len("target")
    assert os.lstat(mounted.path / "dangling").st_size == len("does/not/exist")
    expect_errno(errno.ENOENT, os.stat, mounted.path / "dangling")
    expect_errno(errno.EINVAL, os.readlink, mounted.path / "target")
    mounted.remount()
    assert os.readlink(mounted.path / "dangling") == "does/not/exist"
    assert read_file(mounted.path / "rel") == b"pointed at"
    os.unlink(mounted.path / "rel")
    assert read_file(mounted.path / "target") == b"pointed at"
    check_clean(fsck_clean, mounted)


def test_symlink_long_target(mounted):
    target = "/".join(["component"] * 300)[:4000]
    os.symlink(target, mounted.path / "long")
    assert os.readlink(mounted.path / "long") == target
    assert os.lstat(mounted.path / "long").st_size == len(target)


# ------------------------------------------------------------------------ names

def test_name_too_long(mounted):
    ok = "n" * 255
    write_file(mounted.path / ok, b"x")
    assert ok in os.listdir(mounted.path)
    long = "n" * 256
    expect_errno(errno.ENAMETOOLONG, os.open, mounted.path / long, os.O_CREAT | os.O_WRONLY)
    expect_errno(errno.ENAMETOOLONG, os.mkdir, mounted.path / long)
    expect_errno(errno.ENAMETOOLONG, os.stat, mounted.path / long)
    expect_errno(errno.ENAMETOOLONG, os.rename, mounted.path / ok, mounted.path / long)
    expect_errno(errno.ENAMETOOLONG, os.symlink, "t", mounted.path / long)
    expect_errno(errno.ENAMETOOLONG, os.link, mounted.path / ok, mounted.path / long)
    # multi-byte: 128 two-byte characters = 256 bytes
    expect_errno(errno.ENAMETOOLONG, os.mkdir, mounted.path / ("é" * 128))
    os.mkdir(mounted.path / ("é" * 127))


def test_state_dir_hidden_at_root(mounted):
    write_file(mounted.path / "f", b"x")
    assert ".ckptfs" not in os.listdir(mounted.path)
    ls = subprocess.run(["ls", "-a", str(mounted.path)], capture_output=True, text=True,
                        check=True)
    assert ".ckptfs" not in ls.stdout.split()
    expect_errno(errno.ENOENT, os.stat, mounted.path / ".ckptfs")
    expect_errno(errno.ENOENT, os.stat, mounted.path / ".ckptfs" / "index")
    expect_errno(errno.EPERM, os.mkdir, mounted.path / ".ckptfs")
    expect_errno(errno.EPERM, os.open, mounted.path / ".ckptfs", os.O_CREAT | os.O_WRONLY)
    expect_errno(errno.EPERM, os.symlink, "x", mounted.path / ".ckptfs")
    expect_errno(errno.EPERM, os.rename, mounted.path / "f", mounted.path / ".ckptfs")
    expect_errno(errno.EPERM, os.link, mounted.path / "f", mounted.path / ".ckptfs")
    # below the root the name is an ordinary one
    os.mkdir(mounted.path / "sub")
    os.mkdir(mounted.path / "sub" / ".ckptfs")
    assert os.listdir(mounted.path / "sub") == [".ckptfs"]


def test_non_utf8_and_odd_names(mounted):
    names = [b"\xff\xfe-latin1-\xe9", "tab\tand newline\n".encode(), b" leading space",
             b"-dash", "ünïcödé-名前".encode()]
    base = os.fsencode(mounted.path)
    for name in names:
        fd = os.open(base + b"/" + name, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, name)
        os.close(fd)
    assert sorted(os.listdir(base)) == sorted(names)
    mounted.remount()
    assert sorted(os.listdir(base)) == sorted(names)
    for name in names:
        assert read_file(base + b"/" + name) == name


def test_special_files(mounted):
    os.mkfifo(mounted.path / "fifo", 0o640)
    os.mknod(mounted.path / "chr", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    mounted.remount()
    st = os.lstat(mounted.path / "fifo")
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    st = os.lstat(mounted.path / "chr")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    os.unlink(mounted.path / "fifo")
    os.unlink(mounted.path / "chr")
    assert os.listdir(mounted.path) == []


# --------------------------------------------------------------- stale handles

def test_fd_to_deleted_directory(mounted):
    d = mounted.path / "gone"
    os.mkdir(d)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rmdir(d)
        try:
            os.listdir(fd)
        except OSError as e:
            assert e.errno in (errno.ENOENT, errno.ESTALE)
        else:
            pass  # an empty listing is acceptable too
        try:
            os.listdir(f"/proc/self/fd/{fd}")
        except OSError as e:
            assert e.errno in (errno.ENOENT, errno.ESTALE)
        expect_errno_in((errno.ENOENT, errno.ESTALE), os.open, "new", os.O_CREAT | os.O_WRONLY,
                        0o644, dir_fd=fd)
        expect_errno_in((errno.ENOENT, errno.ESTALE), os.mkdir, "sub", dir_fd=fd)
        os.fstat(fd)
    finally:
        os.close(fd)
    # the daemon is fine
    os.mkdir(d)
    assert os.listdir(d) == []


def expect_errno_in(codes, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except OSError as e:
        assert e.errno in codes, f"unexpected {errno.errorcode.get(e.errno)}: {e}"
    else:
        raise AssertionError(f"{fn.__name__} succeeded in a deleted directory")


def test_cwd_in_deleted_directory(mounted):
    d = mounted.path / "d"
    os.mkdir(d)
    res = subprocess.run(f"cd {d} && rmdir {d} && ls . ; touch x; echo done",
                         shell=True, capture_output=True, text=True, timeout=30)
    assert "done" in res.stdout
    assert not d.exists()
