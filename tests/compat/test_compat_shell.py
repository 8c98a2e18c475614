"""Shell tools on ckptfs: what operators do to checkpoint directories.

Most tests are differential: the same tool invocation runs against a plain
directory and against the mount, and the two trees must then be identical
(every byte by sha256, modes, sizes, mtimes, user xattrs, symlink targets,
hard-link structure) — before and after an unmount and remount. Where a tool
needs an operation pyfuse3 cannot offer (FICLONE, copy_file_range,
SEEK_DATA/SEEK_HOLE, fallocate), the test checks what the tool does instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from compat_util import assert_same, dir_mtimes, manifest, run, sha256_file

PMEM_SIZE = "256M"         # the log of each test's mount (compat/conftest.py)

MiB = 1 << 20
needs = pytest.mark.skipif(not (shutil.which("rsync") and shutil.which("getfattr")),
                           reason="rsync and attr (getfattr/setfattr) not installed; "
                                  "tools/setup-debian.sh --with-tests installs them")


def sh(script: str, cwd: os.PathLike, check: bool = True) -> subprocess.CompletedProcess:
    return run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, check=check)


def make_source_tree(root: Path) -> None:
    """A checkpoint-like tree with every kind of entry the tools must carry."""
    root.mkdir(parents=True, exist_ok=True)
    rnd = os.urandom
    (root / "ckpt" / "shards").mkdir(parents=True)
    (root / "ckpt" / "private").mkdir()
    (root / "empty-dir").mkdir()
    (root / "ckpt" / "model.bin").write_bytes(rnd(12 * MiB + 3))
    for i in range(8):
        (root / "ckpt" / "shards" / f"shard-{i:05d}.bin").write_bytes(rnd(i * 70_001 + 1))
    (root / "ckpt" / "config.json").write_text('{"hidden": 1024}\n')
    (root / "ckpt" / "empty").write_bytes(b"")
    (root / "ckpt" / "page").write_bytes(rnd(4096))
    (root / "ckpt" / "private" / "token").write_bytes(b"secret\n")
    (root / "name with spaces & ünïcode").write_bytes(rnd(999))
    # A sparse file: 64 MiB with 1 MiB of data at 10 MiB and a tail byte.
    with open(root / "ckpt" / "sparse.img", "wb") as f:
        f.truncate(64 * MiB)
        f.seek(10 * MiB)
        f.write(rnd(MiB))
        f.seek(64 * MiB - 1)
        f.write(b"\x01")
    os.link(root / "ckpt" / "model.bin", root / "ckpt" / "model.hardlink")
    os.symlink("model.bin", root / "ckpt" / "latest")
    os.symlink("shards", root / "ckpt" / "shards-link")
    os.symlink("/nonexistent/target", root / "dangling")
    os.mkfifo(root / "ckpt" / "fifo")
    os.chmod(root / "ckpt" / "private", 0o700)
    os.chmod(root / "ckpt" / "private" / "token", 0o600)
    os.chmod(root / "ckpt" / "shards", 0o2775)
    os.chmod(root / "ckpt" / "config.json", 0o640)
    os.chmod(root / "ckpt" / "page", 0o4755)
    sh("setfattr -n user.checksum -v sha256:abc ckpt/model.bin && "
       "setfattr -n user.empty ckpt/config.json && "
       "setfattr -n user.bin -v 0x00ff10 ckpt/page && "
       "setfattr -n user.dir -v yes ckpt/shards", cwd=root)
    # Distinct, nanosecond mtimes; directories last (creating entries bumps them).
    for i, p in enumerate(sorted(root.rglob("*"))):
        if not p.is_symlink() and not p.is_dir():
            os.utime(p, ns=(1_600_000_000_000_000_000 + i * 1_111_111_111,
                            1_500_000_000_123_456_789 + i * 1_000_000_007))
    pin_dir_times(root)


def pin_dir_times(root: Path) -> None:
    """Old, distinct directory mtimes, the root's too. rsync compares times to
    the second: a directory it changes in the same second as its source's
    mtime keeps the wrong time (on ext4 as well)."""
    for i, p in enumerate(sorted((d for d in root.rglob("*") if d.is_dir() and not d.is_symlink()),
                                 reverse=True) + [root]):
        os.utime(p, ns=(1_400_000_000_000_000_000, 1_450_000_000_987_654_321 + i))


def check_same(a: Path, b: Path, what: str) -> None:
    assert_same(manifest(a), manifest(b), what)
    assert dir_mtimes(a) == dir_mtimes(b), f"directory mtimes differ {what}"


def ls_columns(path: Path) -> list[tuple]:
    """ls -la fields, minus directory sizes (ckptfs shows 0, ext4 4096)."""
    out = run(["ls", "-la", "--time-style=+%s.%N", str(path)]).stdout.splitlines()[1:]
    rows = []
    for line in out:
        perms, nlink, user, group, size, when, name = line.split(None, 6)
        if name in (".", ".."):
            continue
        rows.append((perms, nlink, user, group, None if perms[0] == "d" else size, when, name))
    return rows


def stat_lines(root: Path) -> list[str]:
    fmt = "%n|%F|%A|%h|%U|%G|%Y|%y|%N"
    res = run(["bash", "-c", f"find . -mindepth 1 -print0 | sort -z | xargs -0 stat -c '{fmt}'"],
              cwd=root)
    lines = res.stdout.splitlines()
    # Sizes of non-directories too.
    res2 = run(["bash", "-c", "find . -mindepth 1 ! -type d -print0 | sort -z | xargs -0 stat -c '%n|%s'"],
               cwd=root)
    return lines + res2.stdout.splitlines()


def getfattr_blocks(out: str) -> list[str]:
    """getfattr -R output per file, in name order (readdir orders differ)."""
    return sorted(b.strip() for b in out.split("\n\n") if b.strip())


def raw_fallocate(fd: int, offset: int, length: int) -> None:
    """fallocate(2) itself, without glibc's posix_fallocate emulation."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, 0, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


# ---------------------------------------------------------------------- cp

@needs
def test_cp_a_in_within_out_ls_stat(mounted, fsck_clean, tmp_path):
    src = tmp_path / "src"
    make_source_tree(src)
    m = mounted.path
    run(["cp", "-a", src, m / "in"])                          # in
    check_same(src, m / "in", "after cp -a in")
    run(["cp", "-a", m / "in", m / "copy"])                   # within
    check_same(src, m / "copy", "after cp -a within")
    run(["cp", "--reflink=auto", m / "in/ckpt/model.bin", m / "reflinked"])
    res = run(["cp", "--reflink=always", m / "in/ckpt/model.bin", m / "cloned"], check=False)
    assert res.returncode != 0 and "not supported" in res.stderr.lower(), res.stderr  # no FICLONE
    assert not (m / "cloned").exists() or (m / "cloned").stat().st_size == 0
    (m / "cloned").unlink(missing_ok=True)
    assert ls_columns(m / "in/ckpt") == ls_columns(src / "ckpt")
    assert ls_columns(m / "in") == ls_columns(src)
    assert stat_lines(m / "in") == stat_lines(src)
    assert run(["stat", "-f", "-c", "%T", m]).stdout.strip() in ("fuseblk", "fuse")
    # getfattr shows the same user xattrs (values included) as on the source.
    dump = ["getfattr", "-R", "-h", "-d", "-m", "^user\\.", "--absolute-names", "."]
    assert getfattr_blocks(run(dump, cwd=m / "in").stdout) == \
        getfattr_blocks(run(dump, cwd=src).stdout)

    mounted.remount()
    check_same(src, m / "in", "after remount")
    check_same(src, m / "copy", "copy after remount")
    assert sha256_file(m / "reflinked") == sha256_file(src / "ckpt/model.bin")
    out = tmp_path / "out"
    run(["cp", "-a", m / "copy", out])                        # out
    check_same(src, out, "after cp -a out")
    # Sparse file: cp -a into ckptfs keeps the holes (cp seeks over them), out
    # comes out equal byte for byte (without SEEK_HOLE cp reads the zeros).
    assert os.stat(m / "in/ckpt/sparse.img").st_blocks * 512 < 4 * MiB
    fsck_clean(mounted)


# ---------------------------------------------------------------------- mv

MV_SCRIPT = r"""
mkdir -p a b c/empty d
printf 'one' > a/f1; printf 'two-two' > a/f2; printf 'old target' > b/target
printf 'new content' > a/new; mkdir -p a/sub/deeper; printf 'x' > a/sub/deeper/leaf
touch -d '2020-01-02 03:04:05.123456789' a/f1 a/new
mv a/f1 a/f1-renamed                 # within a directory
mv a/f2 b/                           # across directories
mv -f a/new b/target                 # over an existing file
mv a/sub b/                          # a directory across directories
mv -T b/sub c/empty                  # a directory over an empty directory
mv "$OUTSIDE/in-file" d/             # from another filesystem: copy + unlink
mv b/f2 "$OUTSIDE/out-dir/"          # to another filesystem
mv d d-renamed
"""


def test_mv_within_across_and_over(mounted, fsck_clean, tmp_path):
    trees = {}
    for name, root in (("plain", tmp_path / "plain"), ("ckptfs", mounted.path / "work")):
        root.mkdir()
        outside = tmp_path / f"outside-{name}"
        (outside / "out-dir").mkdir(parents=True)
        (outside / "in-file").write_bytes(b"from elsewhere" * 1000)
        os.utime(outside / "in-file", ns=(1, 1_234_567_890_123_456_789))
        os.setxattr(outside / "in-file", "user.origin", b"outside")
        run(["bash", "-euo", "pipefail", "-c", MV_SCRIPT], cwd=root,
            env=dict(os.environ, OUTSIDE=str(outside)))
        trees[name] = (root, outside)
    (plain, plain_out), (ck, ck_out) = trees["plain"], trees["ckptfs"]
    # Directory link counts follow the moves.
    assert os.stat(ck / "b").st_nlink == os.stat(plain / "b").st_nlink == 2
    assert os.stat(ck / "c").st_nlink == os.stat(plain / "c").st_nlink == 3

    def compare(what: str) -> None:
        # Files the script made have "now" mtimes; moved ones keep theirs.
        assert_same(manifest(plain, times=False), manifest(ck, times=False), what)
        assert_same(manifest(plain_out, times=False), manifest(ck_out, times=False),
                    f"outside, {what}")
        for name in ("a/f1-renamed", "b/target", "d-renamed/in-file"):
            assert os.stat(ck / name).st_mtime_ns == os.stat(plain / name).st_mtime_ns, name

    compare("after mv")
    mounted.remount()
    compare("after mv and remount")
    assert (ck / "b/target").read_bytes() == b"new content"
    assert os.getxattr(ck / "d-renamed/in-file", "user.origin") == b"outside"
    fsck_clean(mounted)


# ------------------------------------------------------------------- rsync

@needs
def test_rsync_in_out_checksum(mounted, fsck_clean, tmp_path):
    src = tmp_path / "src"
    make_source_tree(src)
    m = mounted.path
    rsync = ["rsync", "-aHAX"]
    verify = ["rsync", "-aHAXc", "--dry-run", "--itemize-changes"]
    run(rsync + [f"{src}/", f"{m}/r/"])
    assert run(verify + [f"{src}/", f"{m}/r/"]).stdout == ""
    check_same(src, m / "r", "after rsync in")
    # Change files the way a new checkpoint does: same size new bytes, growth,
    # a new file, a deletion. rsync writes .name.XXXXXX and renames it over.
    (src / "ckpt/model.bin").write_bytes(os.urandom(12 * MiB + 3))
    with open(src / "ckpt/shards/shard-00003.bin", "ab") as f:
        f.write(os.urandom(50_000))
    (src / "ckpt/new.bin").write_bytes(os.urandom(300_000))
    (src / "ckpt/shards/shard-00000.bin").unlink()
    pin_dir_times(src)
    run(rsync + ["--delete", f"{src}/", f"{m}/r/"])
    run(rsync + ["--inplace", "--no-whole-file", f"{src}/", f"{m}/r-inplace/"])
    (src / "ckpt/page").write_bytes(os.urandom(4096))
    os.utime(src / "ckpt/page", ns=(1, 1_700_000_000_000_000_001))
    run(rsync + ["--inplace", "--no-whole-file", f"{src}/", f"{m}/r-inplace/"])
    run(rsync + ["--delete", f"{src}/", f"{m}/r/"])

    mounted.remount()
    for d in ("r", "r-inplace"):
        assert run(verify + [f"{src}/", f"{m}/{d}/"]).stdout == "", d
        check_same(src, m / d, f"{d} after remount")
    out = tmp_path / "out"
    run(rsync + [f"{m}/r/", f"{out}/"])
    assert run(verify + [f"{m}/r/", f"{out}/"]).stdout == ""
    check_same(src, out, "after rsync out")
    assert [n for n in os.listdir(m / "r/ckpt") if n.startswith(".")] == []
    fsck_clean(mounted)


# --------------------------------------------------------------------- tar

@needs
def test_tar_create_extract_sha256sum(mounted, fsck_clean, tmp_path):
    src = tmp_path / "src"
    make_source_tree(src)
    m = mounted.path
    tar_opts = ["--xattrs", "--xattrs-include=user.*", "--sparse", "--numeric-owner"]
    run(["tar", "-cpf", tmp_path / "src.tar", *tar_opts, "-C", src, "."])
    (m / "x").mkdir()
    run(["tar", "-xpf", tmp_path / "src.tar", *tar_opts, "-C", m / "x"])   # x into the mount
    run(["tar", "-cpf", m / "again.tar", *tar_opts, "-C", m / "x", "."])    # c from the mount
    run(["tar", "-czpf", m / "again.tgz", *tar_opts, "-C", m / "x", "."])
    # sha256sum -c of the source's sums, run on the mount.
    sums = sh("find . -type f -print0 | sort -z | xargs -0 sha256sum", cwd=src).stdout
    (tmp_path / "SUMS").write_text(sums)
    mounted.remount()
    check_same(src, m / "x", "tar x into ckptfs")
    assert sh(f"sha256sum --quiet -c {tmp_path / 'SUMS'}", cwd=m / "x").stdout == ""
    for archive in ("again.tar", "again.tgz"):
        out = tmp_path / f"out-{archive}"
        out.mkdir()
        run(["tar", "-xpf", m / archive, *tar_opts, "-C", out])
        check_same(src, out, f"tar c on ckptfs ({archive}), x outside")
    run(["tar", "--compare", "-f", m / "again.tar", "-C", m / "x"])
    fsck_clean(mounted)


# ---------------------------------------- ln, truncate, chmod, touch, find

ATTR_SCRIPT = r"""
cp "$SEED" data
ln data data.hard                       # hard link
ln -s data data.sym                     # symlink
ln -s ../nowhere dangling
ln -sf data.hard data.sym2              # -sf onto a new name...
ln -sfn data data.sym2                  # ...and replacing an existing symlink
ln -f data data.hard2                   # -f: make the link
printf 'replace me' > victim
ln -f data victim                       # -f over an existing file
cp data t1; cp data t2; cp data t3; cp data t4
truncate -s 10 t1                       # shrink
truncate -s 5M t2                       # grow (hole)
truncate -s +4096 t3                    # relative grow
truncate -s -99 t4                      # relative shrink
truncate -s 1234 fresh                  # create
mkdir -p tree/a/b; cp data tree/a/b/f; cp data tree/g
chmod 0751 t1; chmod u=rw,g=r,o= t2; chmod a+x,g-w t3; chmod -R go-rwx tree
chmod 4755 t4; chmod g+s tree/a
touch -d '2001-02-03 04:05:06.123456789' t1
touch -m -d '@1234567890.987654321' t2
touch -a -d '2011-01-01 00:00:00' t2
touch -r t1 t3
touch -h -d '1999-12-31 23:59:59' data.sym
touch new-empty
touch -c not-created
"""


def test_ln_truncate_chmod_touch_find_du_df(mounted, fsck_clean, tmp_path):
    seed = tmp_path / "seed"
    seed.write_bytes(os.urandom(100_000))
    roots = {"plain": tmp_path / "plain", "ckptfs": mounted.path / "work"}
    for root in roots.values():
        root.mkdir()
        run(["bash", "-euo", "pipefail", "-c", ATTR_SCRIPT], cwd=root,
            env=dict(os.environ, SEED=str(seed)))
    plain, ck = roots["plain"], roots["ckptfs"]
    # touch -a (before anything reads t2: ext4 would move atime on a read).
    t2_atime = os.stat(ck / "t2").st_atime_ns
    assert t2_atime == os.stat(plain / "t2").st_atime_ns

    def compare(what: str) -> None:
        # touch'ed mtimes are explicit; the others are "now" and differ by run.
        a, b = manifest(plain, times=False), manifest(ck, times=False)
        assert_same(a, b, what)
        for name in ("t1", "t2", "t3", "data.sym"):
            sa, sb = os.lstat(plain / name), os.lstat(ck / name)
            assert sa.st_mtime_ns == sb.st_mtime_ns, (what, name)
        assert os.stat(ck / "t2").st_atime_ns == t2_atime      # ckptfs: reads keep atime
        assert os.stat(ck / "data").st_nlink == os.stat(plain / "data").st_nlink == 4
        assert os.readlink(ck / "data.sym2") == "data"
        # find: the same answers to the same questions.
        for q in (["-type", "f"], ["-type", "l"], ["-xtype", "l"], ["-links", "+1"],
                  ["-perm", "-4000"], ["-perm", "-g+s"], ["-size", "+4k"], ["-empty"],
                  ["-newer", "t2"], ["-name", "t*", "-type", "f", "-size", "-1k"]):
            got = run(["find", ".", *q], cwd=ck).stdout.split()
            want = run(["find", ".", *q], cwd=plain).stdout.split()
            assert sorted(got) == sorted(want), (what, q)
        # du: apparent sizes (directories are 0 bytes on ckptfs) and inodes.
        seen, apparent = set(), 0
        for p in ck.rglob("*"):
            st = os.lstat(p)
            if not stat.S_ISDIR(st.st_mode) and st.st_ino not in seen:
                seen.add(st.st_ino)
                apparent += st.st_size
        assert int(run(["du", "-sb", "."], cwd=ck).stdout.split()[0]) == apparent
        assert run(["du", "--inodes", "-s", "."], cwd=ck).stdout.split()[0] == \
            run(["du", "--inodes", "-s", "."], cwd=plain).stdout.split()[0]
        # t2 is 5 MiB with a 100 KB head: du counts allocated data, not holes.
        blocks = int(run(["du", "-B1", "t2"], cwd=ck).stdout.split()[0])
        assert 100_000 <= blocks < 1 * MiB, blocks

    compare("before remount")
    mounted.remount()
    compare("after remount")
    df = run(["df", "-B1", "--output=fstype,size,used,avail,itotal,iused", str(ck)])
    fstype, size, used, avail, itotal, iused = df.stdout.splitlines()[1].split()
    assert fstype == "fuse.ckptfs"
    assert int(size) > 0 and int(avail) > 0 and int(itotal) > int(iused) > 0
    assert run(["df", "-i", str(ck)]).returncode == 0
    fsck_clean(mounted)


# ---------------------------------------------------------------- rm -rf

def test_rm_rf_deep_wide_tree(make_mount, fsck_clean, tmp_path):
    m = make_mount(options=["pmem_size=128M", "sync=lazy"])
    root = m.path / "old-checkpoints"
    # 40 levels deep, and 2000 small files across 20 directories, made by cp -a.
    src = tmp_path / "src"
    deep = src / "/".join(f"level{i:02d}" for i in range(40))
    deep.mkdir(parents=True)
    (deep / "bottom.bin").write_bytes(os.urandom(10_000))
    for d in range(20):
        sub = src / f"step-{d:03d}"
        sub.mkdir()
        for f in range(100):
            (sub / f"rank{f:03d}.distcp").write_bytes(os.urandom(64 + f))
    run(["cp", "-a", src, root])
    before = os.statvfs(m.path).f_favail
    m.remount()
    assert_same(manifest(src), manifest(root), "big tree after remount")
    res = run(["rm", "-rf", root])
    assert res.stderr == ""
    assert not root.exists() and os.listdir(m.path) == []
    assert os.statvfs(m.path).f_favail >= before
    assert m.stat()["files"] == 0
    m.remount()
    assert os.listdir(m.path) == []
    assert m.stat()["files"] == 0 and m.stat()["hot_bytes"] < 64 * 1024
    fsck_clean(m)


# ------------------------------------------ what tools do without the ops

def test_fallocate_copy_range_seek_clone_acl_fallbacks(mounted, fsck_clean, tmp_path):
    m = mounted.path
    data = os.urandom(3 * MiB + 5)
    (m / "a").write_bytes(data)
    # posix_fallocate: FUSE answers EOPNOTSUPP, glibc emulates by writing a zero
    # byte into each block past the data, keeping what is there.
    fd = os.open(m / "a", os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 8 * MiB)
        assert os.fstat(fd).st_size == 8 * MiB
        with pytest.raises(OSError) as info:
            raw_fallocate(fd, 0, 16 * MiB)            # the raw syscall has no fallback
        assert info.value.errno == errno.EOPNOTSUPP
        # lseek SEEK_DATA/SEEK_HOLE: the kernel's generic answer (all data, hole at EOF).
        assert os.lseek(fd, 4096, os.SEEK_DATA) == 4096
        assert os.lseek(fd, 0, os.SEEK_HOLE) == 8 * MiB
        with pytest.raises(OSError) as info:
            os.lseek(fd, 9 * MiB, os.SEEK_DATA)
        assert info.value.errno == errno.ENXIO
        # FICLONE is an ioctl pyfuse3 does not pass on.
        dst = os.open(m / "clone", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with pytest.raises(OSError) as info:
                fcntl.ioctl(dst, 0x40049409, fd)      # FICLONE
            assert info.value.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.ENOSYS,
                                        errno.EINVAL, errno.EXDEV)
            # copy_file_range: the kernel copies through the page cache instead.
            n = os.copy_file_range(fd, dst, 2 * MiB, 0, 0)
            assert n > 0
        finally:
            os.close(dst)
    finally:
        os.close(fd)
    # POSIX ACLs (no FUSE_POSIX_ACL): the minimal ACL that cp -a, rsync -A and
    # tar --acls write is the mode bits, as on ext4; extended ones are refused.
    def acl(*entries: tuple[int, int, int]) -> bytes:
        return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)

    nobody = 0xFFFFFFFF
    os.setxattr(m / "a", "system.posix_acl_access", acl((1, 6, nobody), (4, 4, nobody),
                                                        (0x20, 0, nobody)))
    assert stat.S_IMODE(os.stat(m / "a").st_mode) == 0o640
    assert "system.posix_acl_access" not in os.listxattr(m / "a")
    extended = acl((1, 7, nobody), (2, 4, 65534), (4, 5, nobody), (0x10, 5, nobody),
                   (0x20, 0, nobody))
    for path, name in ((m / "a", "system.posix_acl_access"), (m, "system.posix_acl_default")):
        with pytest.raises(OSError) as info:
            os.setxattr(path, name, extended)
        assert info.value.errno == errno.EOPNOTSUPP, name
    assert stat.S_IMODE(os.stat(m / "a").st_mode) == 0o640
    grown = data + bytes(8 * MiB - len(data))
    assert (m / "a").read_bytes() == grown
    assert (m / "clone").read_bytes() == grown[:len((m / "clone").read_bytes())]
    shutil.copyfile(m / "a", m / "sendfile-copy")        # sendfile(2)
    shutil.copyfile(m / "a", tmp_path / "out-copy")
    run(["cp", "--sparse=always", m / "a", m / "cp-sparse"])
    run(["fallocate", "-l", "1M", m / "util-linux"], check=False)   # EOPNOTSUPP, no crash
    mounted.remount()
    assert (m / "a").read_bytes() == grown
    for name in ("sendfile-copy", "cp-sparse"):
        assert sha256_file(m / name) == sha256_file(m / "a"), name
    assert sha256_file(tmp_path / "out-copy") == sha256_file(m / "a")
    fsck_clean(mounted)
