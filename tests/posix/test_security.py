"""ckptfs runs as root over directories other users write into: attacks by
such a user, run as a real non-root user, must not reach anything the user
could not reach without ckptfs.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mounting import REPO, is_mounted
from posix_helpers import as_user, check_clean, unused_uid

from ckptfs import control
from ckptfs.mounts import mountinfo


# ------------------------------------------------------------------ helpers

def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]


# ------------------------------------------------- control socket directory

class FakeDaemon:
    """Another user's socket where a user's ckptfs looks for its daemon: it
    answers every request with made-up numbers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o666)
        self.sock.listen(4)
        self.answered = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                self.answered += 1
                conn.sendall(json.dumps({"v": 1, "ok": True,
                                         "result": {"pid": 4242, "forged": True}}).encode()
                             + b"\n")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def user_tmp():
    """(uid, its /tmp/ckptfs-UID path): removed afterwards, whoever made it."""
    uid = unused_uid()
    base = Path(f"/tmp/ckptfs-{uid}")
    yield uid, base
    if base.is_symlink():
        base.unlink()
    shutil.rmtree(base, ignore_errors=True)


def _plant(base: Path, owner: int, mode: int, mnt: Path) -> FakeDaemon:
    (base / "ckptfs").mkdir(parents=True)
    for d in (base, base / "ckptfs"):
        os.chown(d, owner, owner)
        os.chmod(d, mode)
    name = os.path.basename(control.socket_path(str(mnt)))
    return FakeDaemon(base / "ckptfs" / name)


@pytest.mark.parametrize("how", ["other_owner", "symlink", "group_open"])
def test_control_directory_another_user_controls_is_refused(user_tmp, tmp_path, how):
    """Without XDG_RUNTIME_DIR a user's control socket lives in /tmp/ckptfs-UID.
    Another user who made that directory first (or a symlink there, or one left
    open to others) could answer in the daemon's place: client and daemon refuse
    it with one line."""
    uid, base = user_tmp
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["PYTHONPATH"] = str(REPO)
    world = tmp_path / "w"
    world.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(world, 0o755)
    src = world / "src"
    src.mkdir()
    os.chown(src, uid, uid)
    if how == "other_owner":
        fake = _plant(base, 0, 0o755, src)             # made by root (another user)
    elif how == "symlink":
        real = tmp_path / "real"
        fake = _plant(real, uid, 0o700, src)           # the user's own, but reached by a symlink
        base.symlink_to(real)
    else:
        fake = _plant(base, uid, 0o755, src)           # the user's, but open to others
    try:
        res = as_user(uid, [sys.executable, "-m", "ckptfs.cli", "stat", str(src), "--json"],
                      python_access=True, env=env)
        assert "4242" not in res.stdout and fake.answered == 0, \
            f"the client took another user's answer: {res.stdout}"
        assert res.returncode == 1, res.stderr
        line = one_line(res.stderr)
        assert "control directory" in line and "refusing" in line, line
        # The daemon refuses it too, before anything is mounted.
        res = as_user(uid, [sys.executable, str(REPO / "mount.ckptfs"), str(src), str(src),
                            "-o", "pmem_size=64M"], python_access=True, env=env)
        assert res.returncode == 1, res.stderr
        assert "control directory" in one_line(res.stderr), res.stderr
        assert not is_mounted(src)
    finally:
        fake.close()


def test_control_directory_is_made_private_when_missing(user_tmp):
    uid, base = user_tmp
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["PYTHONPATH"] = str(REPO)
    res = as_user(uid, [sys.executable, "-c",
                        "from ckptfs import control; print(control.private_socket_dir(True))"],
                  python_access=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{base}/ckptfs"
    for d in (base, base / "ckptfs"):
        st = os.lstat(d)
        assert st.st_uid == uid and st.st_mode & 0o777 == 0o700, (d, oct(st.st_mode))
    # The client now finds the directory fine and says nobody answers.
    res = as_user(uid, [sys.executable, "-m", "ckptfs.cli", "stat", "/tmp"],
                  python_access=True, env=env)
    assert res.returncode == 1 and "no ckptfs daemon answers" in one_line(res.stderr)


# ------------------------------------------------------------- system.* xattrs

NOBODY = 65534


@pytest.fixture
def world_dir():
    """A directory every user can reach (pytest's own tmp dirs are 0700)."""
    import tempfile
    path = Path(tempfile.mkdtemp(prefix="ckptfs-sec-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    busy = any(e.mountpoint.startswith(str(path)) for e in mountinfo())
    if not busy:                # (a mount's own fixture unmounts it first)
        shutil.rmtree(path, ignore_errors=True)


# Run by Debian's own python as a plain non-root user (no capabilities): each
# step prints "ok", "ok <value>" or the errno name.
XATTR_STEPS = r'''
import errno, json, os, struct, sys
root_file, user_file, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])

def acl(mode):
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, (mode >> shift) & 7, 0xFFFFFFFF)
                                           for tag, shift in ((1, 6), (4, 3), (0x20, 0)))

def step(fn, *args):
    try:
        out = fn(*args)
        return "ok" if out is None else f"ok {out!r}"
    except OSError as e:
        return "EOPNOTSUPP" if e.errno == errno.EOPNOTSUPP else errno.errorcode[e.errno]

res = {
    "set_system_root": step(os.setxattr, root_file, "system.foo", b"x" * 1000),
    "set_system_own": step(os.setxattr, user_file, "system.foo", b"x"),
    "get_system": step(os.getxattr, root_file, "system.foo"),
    "remove_system": step(os.removexattr, root_file, "system.foo"),
    "set_acl_root": step(os.setxattr, root_file, "system.posix_acl_access", acl(0o777)),
    "remove_acl_root": step(os.removexattr, root_file, "system.posix_acl_access"),
    "set_default_acl_root": step(os.setxattr, root_file, "system.posix_acl_default", acl(0o777)),
    "set_acl_own": step(os.setxattr, user_file, "system.posix_acl_access", acl(0o640)),
    "list_root": step(os.listxattr, root_file),
}
# Fill the own file's xattrs in 4 KiB values until refused.
n = 0
while n < 1000:
    r = step(os.setxattr, user_file, f"user.k{n:03d}", bytes([n % 251]) * 4096)
    if r != "ok":
        res["fill_stopped"] = r
        break
    n += 1
res["filled"] = n
res["replace_same_size"] = step(os.setxattr, user_file, "user.k000", b"r" * 4096)
res["grow_one"] = step(os.setxattr, user_file, "user.k000", b"r" * 8192)
res["remove_one"] = step(os.removexattr, user_file, "user.k001")
res["after_remove"] = step(os.setxattr, user_file, "user.new", b"n" * 4000)
total = sum(len(k) + len(os.getxattr(user_file, k)) for k in os.listxattr(user_file))
res["total"] = total
print(json.dumps(res))
'''


def test_non_root_user_cannot_set_system_xattrs_nor_flood_an_inode(world_dir, make_mount):
    """A non-root user of an allow_other mount: system.* names other than the
    POSIX ACLs are refused as ext4 refuses them (EOPNOTSUPP), ACLs only by the
    file's owner (EPERM otherwise; the access ACL would chmod root's file), and
    no inode holds more than XATTR_INODE_MAX_BYTES of xattrs (ENOSPC)."""
    from ckptfs.namespace import XATTR_INODE_MAX_BYTES
    src = world_dir / "src"
    src.mkdir()
    m = make_mount(source=src, options=["pmem_size=64M", "allow_other"])
    os.umask(old_umask := os.umask(0o022))
    try:
        root_file = m.path / "roots"
        root_file.write_bytes(b"root's")
        user_file = m.path / "users"
        user_file.write_bytes(b"nobody's")
    finally:
        os.umask(old_umask)
    os.chown(user_file, NOBODY, NOBODY)
    res = as_user(NOBODY, ["/usr/bin/python3", "-c", XATTR_STEPS, str(root_file),
                           str(user_file), str(XATTR_INODE_MAX_BYTES)])
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["set_system_root"] == "EOPNOTSUPP", out
    assert out["set_system_own"] == "EOPNOTSUPP", out
    assert out["get_system"] == "EOPNOTSUPP", out
    assert out["remove_system"] == "EOPNOTSUPP", out
    assert out["set_acl_root"] == "EPERM", out           # the kernel's check, and ours
    assert out["remove_acl_root"] == "EPERM", out
    # (The kernel refuses a default ACL on a file itself: EACCES, as on ext4.)
    assert out["set_default_acl_root"] in ("EPERM", "EACCES"), out
    assert out["set_acl_own"] == "ok", out
    assert out["list_root"] == "ok []", out
    assert os.stat(root_file).st_mode & 0o7777 == 0o644
    assert os.stat(user_file).st_mode & 0o7777 == 0o640
    # The flood stops at the limit, with ext4's errno; replacing within it works.
    assert out["fill_stopped"] == "ENOSPC", out
    assert out["filled"] == XATTR_INODE_MAX_BYTES // (4096 + len("user.k000")), out
    assert out["replace_same_size"] == "ok" and out["grow_one"] == "ENOSPC", out
    assert out["remove_one"] == "ok" and out["after_remove"] == "ok", out
    assert out["total"] <= XATTR_INODE_MAX_BYTES, out
    # Root is held to the same per-inode limit, and nothing of the refused calls stayed.
    with pytest.raises(OSError) as e:
        os.setxattr(user_file, "user.root", b"x" * 60000)
    assert e.value.errno == errno.ENOSPC
    m.remount()
    assert "system.foo" not in os.listxattr(root_file)
    assert sorted(os.listxattr(user_file))[:2] == ["user.k000", "user.k002"]
    assert os.getxattr(user_file, "user.k000") == b"r" * 4096
    assert os.stat(user_file).st_mode & 0o7777 == 0o640


def test_acl_owner_rule_in_the_namespace(tmp_path):
    """Recent kernels check the ACL owner rule themselves before asking ckptfs;
    older ones pass system.posix_acl_* through as plain xattrs (FUSE_POSIX_ACL
    is not negotiated), so the namespace applies it too, with the caller's uid."""
    from ckptfs.errors import NotPermitted, NotSupported
    from ckptfs.index import ROOT_INO, Index
    from ckptfs.namespace import ACL_ACCESS, ACL_DEFAULT, Namespace
    index = Index(str(tmp_path / "index"))
    try:
        index.format(b"u" * 16, 1, 0, 0)
        ns = Namespace(index)
        ino = ns.create(ROOT_INO, b"f", 0o100644, 1000, 1000, 1).ino
        minimal = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, 7, 0xFFFFFFFF)
                                                  for tag in (1, 4, 0x20))
        for name in (ACL_ACCESS, ACL_DEFAULT):
            with pytest.raises(NotPermitted):
                ns.setxattr(ino, name, minimal, 2, uid=2000)
            with pytest.raises(NotPermitted):
                ns.removexattr(ino, name, 2, uid=2000)
        assert ns.get(ino).mode & 0o7777 == 0o644
        ns.setxattr(ino, ACL_ACCESS, minimal, 2, uid=1000)       # the owner
        assert ns.get(ino).mode & 0o7777 == 0o777
        ns.setxattr(ino, ACL_ACCESS, minimal[:4] + minimal[4:], 3, uid=0)   # root
        for uid in (0, 1000, 2000):
            with pytest.raises(NotSupported):
                ns.setxattr(ino, b"system.foo", b"x", 4, uid=uid)
            with pytest.raises(NotSupported):
                ns.getxattr(ino, b"system.nfs4_acl")
    finally:
        index.close()


# ------------------------------------------------ adopted originals below SOURCE

SECRET_ATIME_NS = 946_684_800_000_000_000        # 2000-01-01: any read would move it


def _adoption_tree(world: Path) -> tuple[Path, Path]:
    """SOURCE with a directory a user owns (files it adopted there) and, beside
    it, a directory only root may read. Returns (source, secret)."""
    src = world / "src"
    shared = src / "shared"
    (shared / "victim_dir" / "sub").mkdir(parents=True)
    (shared / "victim_dir" / "f1").write_bytes(b"user data 1")
    (shared / "victim_dir" / "sub" / "f2").write_bytes(b"user data 2")
    (shared / "file.bin").write_bytes(b"user file")
    (shared / "other.bin").write_bytes(b"user other")
    for p in [shared] + list(shared.rglob("*")):
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    (src / "rootfile").write_bytes(b"root's own, adopted")
    secret = world / "secret"
    (secret / "sub").mkdir(parents=True)
    os.chmod(secret, 0o700)
    for rel, data in (("f1", b"TOP SECRET 1"), ("sub/f2", b"TOP SECRET 2"),
                      ("secret_file", b"TOP SECRET FILE")):
        (secret / rel).write_bytes(data)
        os.chmod(secret / rel, 0o600)
        os.utime(secret / rel, ns=(SECRET_ATIME_NS, os.stat(secret / rel).st_mtime_ns))
    return src, secret


def _swap_for_symlinks(src: Path, secret: Path, replace_other: bool = True) -> None:
    """What the user does in the directory it owns: adopted directory and files
    replaced by symlinks into the root-only directory, another file by its own."""
    script = (f"cd {src}/shared && mv victim_dir old_dir && ln -s {secret} victim_dir && "
              f"mv file.bin file.old && ln -s {secret}/secret_file file.bin")
    if replace_other:
        script += " && printf evil > other.new && mv other.new other.bin"
    res = as_user(NOBODY, ["/bin/sh", "-c", script])
    assert res.returncode == 0, res.stderr


def _read_as_user(path: Path) -> subprocess.CompletedProcess:
    return as_user(NOBODY, ["/bin/cat", str(path)])


def _secret_untouched(secret: Path) -> None:
    """Neither read (its atime would have moved) nor deleted nor changed."""
    for rel, data in (("f1", b"TOP SECRET 1"), ("sub/f2", b"TOP SECRET 2"),
                      ("secret_file", b"TOP SECRET FILE")):
        assert (secret / rel).exists(), f"{rel} was deleted"
        assert os.stat(secret / rel).st_atime_ns == SECRET_ATIME_NS, f"{rel} was read"
        assert (secret / rel).read_bytes() == data, f"{rel} was changed"


SWAPPED = ("shared/victim_dir/f1", "shared/victim_dir/sub/f2", "shared/file.bin",
           "shared/other.bin")


def _expect_refused(mnt: Path, swapped=SWAPPED) -> None:
    for rel in swapped:
        for _ in range(2):
            res = _read_as_user(mnt / rel)
            assert b"TOP SECRET" not in res.stdout.encode() and "evil" not in res.stdout, \
                f"{rel}: {res.stdout!r}"
            assert res.returncode != 0 and "Input/output error" in res.stderr, (rel, res)
    assert (mnt / "rootfile").read_bytes() == b"root's own, adopted"


def _refusals_logged_once(log_text: str, swapped=SWAPPED) -> None:
    for rel in swapped:
        lines = [line for line in log_text.splitlines()
                 if repr(rel.encode()) in line and "its reads give EIO" in line]
        assert len(lines) == 1, (rel, lines)


def test_adopted_originals_swapped_for_symlinks_while_mounted(world_dir, make_mount, fsck_clean):
    """Mounted elsewhere with allow_other, SOURCE stays reachable: the user swaps
    an adopted directory (and files) for symlinks into a root-only directory,
    reads them through the mount, and root then runs rm -rf through the mount.
    Nothing of the root-only directory is read or deleted."""
    src, secret = _adoption_tree(world_dir)
    m = make_mount(source=src, mountpoint=world_dir / "mnt",
                   options=["pmem_size=64M", "allow_other"])
    os.chmod(world_dir / "mnt", 0o755)
    _swap_for_symlinks(src, secret)
    _expect_refused(m.path)
    res = subprocess.run(["rm", "-rf", str(m.path / "shared")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    m.umount()
    _secret_untouched(secret)
    log_text = (src / ".ckptfs" / "daemon.log").read_text()
    _refusals_logged_once(log_text)
    assert "did not remove pre-existing file b'shared/victim_dir/f1'" in log_text
    # The user's own files it moved aside are its own business: still there.
    assert (src / "shared" / "old_dir" / "f1").read_bytes() == b"user data 1"
    check_clean(fsck_clean, m)


def test_adopted_originals_swapped_while_unmounted(world_dir, make_mount, fsck_clean):
    """Unmounted, the user swaps an adopted directory for a symlink to a root-only
    directory; root mounts again (over SOURCE) and runs rm -rf through the mount."""
    src, secret = _adoption_tree(world_dir)
    m = make_mount(source=src, options=["pmem_size=64M", "allow_other"])
    assert (m.path / "shared" / "victim_dir" / "f1").read_bytes() == b"user data 1"
    m.umount()
    _swap_for_symlinks(src, secret)
    m.start()
    _expect_refused(m.path)
    res = subprocess.run(["rm", "-rf", str(m.path / "shared")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    m.umount()
    _secret_untouched(secret)
    _refusals_logged_once((src / ".ckptfs" / "daemon.log").read_text())
    check_clean(fsck_clean, m)


def test_upgrade_records_what_it_reaches_safely(world_dir, make_mount, fsck_clean):
    """An index of format 2 has no identity for its adopted files: the mount that
    upgrades it records each one through the same safe walk. Files swapped for
    symlinks before that stay unidentified: EIO, one log line, never deleted."""
    from ckptfs import index as ix
    from ckptfs.index import Index
    src, secret = _adoption_tree(world_dir)
    m = make_mount(source=src, options=["pmem_size=64M", "allow_other"])
    m.umount()
    index = Index(str(src / ".ckptfs" / "index"))

    def to_format_2(txn):
        """What format 2 wrote: a SOURCE chunk is its head and its paths."""
        for k, raw in list(txn._items("chunks", ix.u64(0), ix.u64((1 << 64) - 1))):
            chunk = ix.Chunk.decode(ix.read_u64(k), raw)
            if chunk.kind == ix.CHUNK_SOURCE:
                txn._put("chunks", k, struct.pack("<BIQ", chunk.kind, chunk.refcount,
                                                 chunk.length) + chunk.source_path)
        txn._put("meta", b"format", struct.pack("<I", 2))

    try:
        index.write_direct(to_format_2)
    finally:
        index.close()
    res = m.fsck()
    assert res.returncode != 0 and "format 2" in res.stdout + res.stderr, res
    swapped = SWAPPED[:3]
    _swap_for_symlinks(src, secret, replace_other=False)
    m.start()
    _expect_refused(m.path, swapped)
    assert (m.path / "shared" / "other.bin").read_bytes() == b"user other"
    res = subprocess.run(["rm", "-rf", str(m.path / "shared")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    m.umount()
    _secret_untouched(secret)
    log_text = (src / ".ckptfs" / "daemon.log").read_text()
    assert "upgraded index" in log_text and f"from format 2 to {ix.FORMAT_VERSION}" in log_text
    for rel in swapped:
        assert sum(repr(rel.encode()) in line and "could not be identified" in line
                   for line in log_text.splitlines()) == 1, rel
    assert not (src / "shared" / "other.bin").exists()     # identified, so deleted with it
    index = Index(str(src / ".ckptfs" / "index"))
    try:
        assert index.format_version() == ix.FORMAT_VERSION == 7
    finally:
        index.close()
    check_clean(fsck_clean, m)
