"""`ckptfs export` (ckptfs/export.py) through a real mount: trees and single
files come out as plain files with their bytes, modes, owners, ns times,
symlinks, hard links and user xattrs; cold (tiered) data streams out; an
interrupted export leaves no half file under a final name; PATH outside a
mount and DEST inside one are refused.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import sys
from pathlib import Path

import pytest

from mounting import REPO, run_ckptfs
from posix_helpers import MiB, as_user, check_clean, pattern, read_file, unused_uid, write_file

from ckptfs import export as ex
from ckptfs.errors import UsageError
from ckptfs.export import TMP_PREFIX, run_export

T0 = 1_600_000_000_123_456_789       # ns timestamps with every digit significant


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MiB):
            h.update(block)
    return h.hexdigest()


def user_xattrs(path: Path) -> dict[str, bytes]:
    if path.is_symlink():
        return {}
    return {n: os.getxattr(path, n) for n in os.listxattr(path) if n.startswith("user.")}


def walk_without_following(root: Path) -> list[Path]:
    """Every path below root, found without following a symlink: following one
    (as Path.rglob does on Python 3.11.2) moves the link's atime on a local disk."""
    found = []
    with os.scandir(root) as it:
        for entry in it:
            found.append(Path(entry.path))
            if entry.is_dir(follow_symlinks=False):
                found += walk_without_following(Path(entry.path))
    return found


def describe(root: Path) -> dict:
    """Everything export must keep, per relative path, plus the hard-link groups.

    Metadata first (lstat of everything), then contents: reading does not
    disturb the atimes compared.
    """
    meta: dict[str, tuple] = {}
    inodes: dict[int, list[str]] = {}
    paths = [root] + sorted(walk_without_following(root))
    for p in paths:
        rel = str(p.relative_to(root))
        st = os.lstat(p)
        kind = stat.S_IFMT(st.st_mode)
        meta[rel] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                     None if stat.S_ISDIR(st.st_mode) else st.st_size,
                     None if stat.S_ISLNK(st.st_mode) else st.st_nlink,
                     st.st_mtime_ns,
                     # listing a directory moves its atime on the copy
                     None if stat.S_ISDIR(st.st_mode) else st.st_atime_ns)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            inodes.setdefault(st.st_ino, []).append(rel)
    content = {}
    for p in paths:
        rel = str(p.relative_to(root))
        if p.is_symlink():
            content[rel] = ("->", os.readlink(p))
        elif p.is_file():
            content[rel] = (sha256(p), user_xattrs(p))
        elif p.is_dir():
            content[rel] = ("dir", user_xattrs(p))
    groups = sorted(sorted(g) for g in inodes.values())
    return {"meta": meta, "content": content, "links": groups}


def leftovers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.name.startswith(TMP_PREFIX)]


def build_tree(top: Path) -> dict[str, bytes]:
    """A checkpoint-like tree with every kind of thing export must keep."""
    files = {
        "model.bin": pattern(40 * MiB, seed=7),               # large: many 8 MiB reads
        "a/optimizer.bin": pattern(3 * MiB + 17, seed=8),
        "a/b/c/deep.json": b'{"step": 100}\n',
        "empty": b"",
        "run.sh": b"#!/bin/sh\necho hi\n",
        "setuid-tool": b"\x7fELF-ish",
        "ro/inside.txt": b"read-only dir content\n",
        "a/shard.bin": pattern(300_000, seed=9),
    }
    for d in ("a/b/c", "ro"):
        (top / d).mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        write_file(top / rel, data)
    os.chmod(top / "a/optimizer.bin", 0o640)
    os.chmod(top / "run.sh", 0o755)
    os.chmod(top / "setuid-tool", 0o4755)
    os.chmod(top / "empty", 0o600)
    os.chown(top / "a/optimizer.bin", 1234, 5678)
    os.link(top / "a/shard.bin", top / "a/b/shard.hard")        # hard link pair
    os.symlink("model.bin", top / "latest")                       # relative symlink
    os.symlink("/nonexistent/target", top / "dangling")          # dangling symlink
    os.mkfifo(top / "a/fifo", 0o620)
    os.setxattr(top / "model.bin", "user.framework", b"torch 2.13")
    os.setxattr(top / "model.bin", "user.empty", b"")
    os.setxattr(top / "a", "user.dirtag", b"\x00\x01binary")
    os.setxattr(top / "a/shard.bin", "user.rank", b"3")
    # Times last, children before parents (a child's change moves its parent's mtime).
    entries = sorted(top.rglob("*"), key=lambda p: -len(p.parts)) + [top]
    for i, p in enumerate(entries):
        os.utime(p, ns=(T0 + 1000 * i + 1, T0 + 7 * i + 3), follow_symlinks=False)
    os.chmod(top / "ro", 0o555)          # a directory export cannot write into as-is
    os.utime(top / "ro", ns=(T0 + 11, T0 + 13))
    return files


def test_export_tree_keeps_everything(mounted, tmp_path, fsck_clean):
    m = mounted
    top = m.path / "step_100"
    top.mkdir()
    build_tree(top)
    want = describe(top)
    assert want["links"] == [["a/b/shard.hard", "a/shard.bin"]]

    out = tmp_path / "out"
    out.mkdir()
    assert run_export(str(top), str(out), progress=False) == 0      # existing dir: out/step_100
    got = describe(out / "step_100")
    assert got["meta"] == want["meta"]
    assert got["content"] == want["content"]
    assert got["links"] == want["links"]
    assert os.stat(out / "step_100/a/shard.bin").st_ino == \
        os.stat(out / "step_100/a/b/shard.hard").st_ino
    assert stat.S_ISFIFO(os.lstat(out / "step_100/a/fifo").st_mode)
    assert read_file(out / "step_100/model.bin") == read_file(top / "model.bin")
    assert not leftovers(out)

    # Again into the same place: merges (replaces every file), same result, no leftovers.
    assert run_export(str(top), str(out), progress=False) == 0
    assert describe(out / "step_100") == got
    assert not leftovers(out)

    # To a new name: DEST itself becomes the copy; a trailing slash on PATH too.
    assert run_export(str(top) + "/", str(tmp_path / "copy2"), progress=False) == 0
    assert describe(tmp_path / "copy2") == got

    # The whole mount.
    assert run_export(str(m.path), str(tmp_path / "whole"), progress=False) == 0
    assert describe(tmp_path / "whole" / "step_100") == got
    os.chmod(top / "ro", 0o755)
    check_clean(fsck_clean, m)


def test_export_single_file(mounted, tmp_path, fsck_clean, capsys):
    m = mounted
    data = pattern(5 * MiB + 3, seed=3)
    src = m.path / "ckpt.pt"
    write_file(src, data, mode=0o640)
    os.setxattr(src, "user.sha", b"abc")
    os.utime(src, ns=(T0, T0 + 5))
    os.symlink("ckpt.pt", m.path / "latest.pt")

    # to a new name
    assert run_export(str(src), str(tmp_path / "renamed.pt"), progress=False) == 0
    out = tmp_path / "renamed.pt"
    st = os.stat(out)           # before reading it: a read moves the copy's atime
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_mtime_ns == T0 + 5 and st.st_atime_ns == T0
    assert read_file(out) == data
    assert os.getxattr(out, "user.sha") == b"abc"

    # into an existing directory
    d = tmp_path / "dir"
    d.mkdir()
    assert run_export(str(src), str(d), progress=False) == 0
    assert read_file(d / "ckpt.pt") == data

    # over an existing file: replaced whole (a new inode, never rewritten in place)
    old = tmp_path / "old.pt"
    old.write_bytes(b"previous content that is longer than nothing")
    old_ino = os.stat(old).st_ino
    assert run_export(str(src), str(old), progress=False) == 0
    assert read_file(old) == data and os.stat(old).st_ino != old_ino

    # a symlink stays a symlink
    assert run_export(str(m.path / "latest.pt"), str(d), progress=False) == 0
    assert os.readlink(d / "latest.pt") == "ckpt.pt"

    # progress forced on: a bar and a summary on stderr, nothing on stdout
    capsys.readouterr()
    assert run_export(str(src), str(tmp_path / "p.pt"), progress=True) == 0
    cap = capsys.readouterr()
    assert cap.out == "" and "exported 1 files" in cap.err
    assert not leftovers(tmp_path)
    check_clean(fsck_clean, m)


def test_refuses_path_outside_a_mount_and_dest_inside(mounted, tmp_path):
    m = mounted
    write_file(m.path / "f", b"data")
    (m.path / "dir").mkdir()
    write_file(m.path / "dir" / "g", b"more")
    plain = tmp_path / "plain"
    plain.write_bytes(b"not on ckptfs")

    with pytest.raises(UsageError, match="not inside a ckptfs mount"):
        run_export(str(plain), str(tmp_path / "x"))
    with pytest.raises(UsageError, match="not inside a ckptfs mount"):
        run_export(str(tmp_path), str(tmp_path / "x"))
    # a symlink outside the mount that names something inside is itself outside
    (tmp_path / "link").symlink_to(m.path / "f")
    with pytest.raises(UsageError, match="not inside a ckptfs mount"):
        run_export(str(tmp_path / "link"), str(tmp_path / "x"))
    with pytest.raises(UsageError, match="no such file"):
        run_export(str(m.path / "missing"), str(tmp_path / "x"))

    # DEST inside the same mount: directly, as the mount root, through a symlink
    for dest in (m.path / "copy", m.path, m.path / "dir", tmp_path / "into"):
        if dest.name == "into":
            dest.symlink_to(m.path / "dir")
        with pytest.raises(UsageError, match="inside the ckptfs mount"):
            run_export(str(m.path / "f"), str(dest))
    with pytest.raises(UsageError, match="inside the ckptfs mount"):
        run_export(str(m.path / "dir"), str(m.path / "dir2"))
    assert sorted(os.listdir(m.path)) == ["dir", "f"]

    # DEST a file while PATH is a directory; DEST's parent missing; type clashes
    with pytest.raises(UsageError, match="is not a directory"):
        run_export(str(m.path / "dir"), str(plain))
    with pytest.raises(UsageError, match="no such directory"):
        run_export(str(m.path / "f"), str(tmp_path / "nope" / "x"))
    (tmp_path / "out" / "f").mkdir(parents=True)
    with pytest.raises(UsageError, match="cannot overwrite directory"):
        run_export(str(m.path / "f"), str(tmp_path / "out"))        # would be out/f
    (tmp_path / "out2").mkdir()
    (tmp_path / "out2" / "dir").write_bytes(b"")
    with pytest.raises(UsageError, match="cannot overwrite non-directory"):
        run_export(str(m.path / "dir"), str(tmp_path / "out2"))
    assert plain.read_bytes() == b"not on ckptfs"


def test_interrupted_export_leaves_no_half_file(mounted, tmp_path, monkeypatch, capsys,
                                                fsck_clean):
    m = mounted
    (m.path / "ck").mkdir()
    write_file(m.path / "ck" / "a.bin", pattern(2 * MiB, seed=1))
    write_file(m.path / "ck" / "b.bin", pattern(20 * MiB, seed=2))
    out = tmp_path / "out"
    out.mkdir()
    (out / "ck").mkdir()
    (out / "ck" / "b.bin").write_bytes(b"the previous export")

    real = ex._Copier._copy_bytes

    def failing(self, src_fd, dst_fd, st, src, tmp):
        if src.endswith("b.bin"):
            os.write(dst_fd, b"half of it")                 # some bytes are in the temp file
            raise OSError(errno.ENOSPC, "No space left on device", tmp)
        return real(self, src_fd, dst_fd, st, src, tmp)

    monkeypatch.setattr(ex._Copier, "_copy_bytes", failing)
    capsys.readouterr()
    assert run_export(str(m.path / "ck"), str(out), progress=False) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert (out / "ck" / "b.bin").read_bytes() == b"the previous export"   # untouched
    assert read_file(out / "ck" / "a.bin") == read_file(m.path / "ck" / "a.bin")
    assert not leftovers(out)

    monkeypatch.undo()
    assert run_export(str(m.path / "ck"), str(out), progress=False) == 0
    assert read_file(out / "ck" / "b.bin") == read_file(m.path / "ck" / "b.bin")
    check_clean(fsck_clean, m)


def test_export_of_cold_tiered_data(make_mount, tmp_path, fsck_clean):
    m = make_mount(options=["pmem_size=256M", "hot_versions=1"])
    files = {}
    for step in (1, 2):
        d = m.path / f"step_{step}"
        d.mkdir()
        files[f"step_{step}/model.bin"] = pattern(24 * MiB, seed=step)
        write_file(m.path / f"step_{step}/model.bin", files[f"step_{step}/model.bin"])
    run_ckptfs("tier", str(m.path), "--now", "--all", timeout=600)
    assert m.stat()["cold_bytes"] > 0
    # drop the page cache, so the export reads through the daemon (cold fetches)
    m.remount()
    before = m.stat()
    out = tmp_path / "out"
    assert run_export(str(m.path), str(out), progress=False) == 0
    for rel, data in files.items():
        assert read_file(out / rel) == data, rel
    assert m.stat()["cold_fetches"] > before.get("cold_fetches", 0)
    check_clean(fsck_clean, m)


def _sparse_files(root: Path) -> dict[str, tuple[int, list[tuple[int, bytes]]]]:
    """name -> (size, [(offset, data)]): a 200 MiB file with 1 KiB of data, data
    across a 4 KiB boundary and at the very end, a file with no data at all, and
    a dense one with a zero run in the middle (written as zeros: ckptfs keeps
    all-zero chunks as holes too)."""
    files = {
        "sparse-200M": (200 * MiB, [(100 * MiB + 3000, pattern(1024, seed=3))]),
        "edges": (64 * MiB + 5, [(4096 - 10, b"x" * 20), (64 * MiB, b"tail!")]),
        "empty-but-big": (50 * MiB, []),
        "dense": (3 * MiB, [(0, pattern(MiB, seed=4)), (MiB, bytes(MiB)),
                            (2 * MiB, pattern(MiB, seed=5))]),
    }
    for name, (size, pieces) in files.items():
        fd = os.open(root / name, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for off, data in pieces:
                os.pwrite(fd, data, off)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    return files


def _check_sparse_copy(out: Path, files) -> None:
    for name, (size, pieces) in files.items():
        st = os.stat(out / name)
        assert st.st_size == size, name
        data_bytes = sum(len(d.strip(b"\0")) for _, d in pieces)
        # Each piece takes at most its 4 KiB blocks (plus one at either end).
        assert st.st_blocks * 512 <= sum(len(d) + 2 * 4096 for _, d in pieces if d.strip(b"\0")), \
            (name, st.st_blocks)
        if data_bytes == 0:
            assert st.st_blocks == 0, name
        with open(out / name, "rb") as f:
            for off, d in pieces:
                f.seek(off)
                assert f.read(len(d)) == d, (name, off)
    # and byte for byte (holes read as zeros)
    with open(out / "sparse-200M", "rb") as f:
        f.seek(100 * MiB)
        assert f.read(8192) == bytes(3000) + pattern(1024, seed=3) + bytes(8192 - 4024)


def _rchar() -> int:
    """Bytes this process has read with read(2) and friends."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


# `ckptfs export PATH DEST`, then how many bytes the process read.
EXPORT_AND_COUNT = """
import sys
from ckptfs.cli import main
rc = main(["export", sys.argv[1], sys.argv[2], "--no-progress"])
print(next(l for l in open("/proc/self/io") if l.startswith("rchar:")).split()[1])
sys.exit(rc)
"""


def test_export_keeps_holes(mounted, tmp_path, fsck_clean):
    """A 200 MiB file with 1 KiB of data exports as a 200 MiB file taking a
    few KiB (it was 200 MiB of zeros): the daemon tells export where the data
    is, so holes are never read."""
    m = mounted
    (m.path / "ck").mkdir()
    files = _sparse_files(m.path / "ck")
    m.remount()                       # committed; nothing in the page cache
    before = _rchar()
    out = tmp_path / "out"
    assert run_export(str(m.path / "ck"), str(out), progress=False) == 0
    read = _rchar() - before
    _check_sparse_copy(out, files)
    for name in files:
        assert sha256(out / name) == sha256(m.path / "ck" / name), name
    # Holes were never read: the export read only the data (3 MiB of 317).
    print(f"export read {read} bytes")
    assert read < 4 * MiB, read
    check_clean(fsck_clean, m)


def test_export_keeps_holes_without_the_control_channel(make_mount, tmp_path, fsck_clean):
    """A user exporting from root's allow_other mount cannot reach root's control
    socket: export reads every block and leaves the zero ones holes, as
    cp --sparse=always does."""
    m = make_mount(options=["pmem_size=512M", "allow_other"])
    (m.path / "ck").mkdir()
    files = _sparse_files(m.path / "ck")
    m.remount()                       # nothing in the page cache: reads reach the daemon
    uid = unused_uid()
    out = tmp_path / "user-out"
    out.mkdir()
    os.chown(out, uid, uid)
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["PYTHONPATH"] = str(REPO)
    res = as_user(uid, [sys.executable, "-c", EXPORT_AND_COUNT, str(m.path / "ck"), str(out)],
                  python_access=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.split()[-1]) >= 260 * MiB            # it did read the holes
    _check_sparse_copy(out / "ck", files)
    assert not os.path.lexists(f"/tmp/ckptfs-{uid}")         # asked nobody's daemon
    check_clean(fsck_clean, m)
