"""The FUSE channel fast path (ckptfs/fastpath.py, native/ckptfs_fuse.c) on real mounts.

The kernel asks GETXATTR("security.capability") before every write(); the
fast path answers it in C for inodes the daemon knows have none. These tests
check that it does, and that it never hides a capability that exists: a
write must still strip it, as on ext4.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfs.mounts import mount_at

CAPS = "security.capability"
# vfs_cap_data revision 2, effective, permitted CAP_NET_RAW.
CAP_NET_RAW = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)


def write_pieces(path: Path, pieces: int, size: int = 8192, flags: int = 0) -> None:
    fd = os.open(path, os.O_WRONLY | flags, 0o644)
    try:
        block = os.urandom(size)
        for _ in range(pieces):
            os.write(fd, block)
    finally:
        os.close(fd)


def test_small_writes_are_answered_without_python(make_mount, monkeypatch):
    """Without FUSE_HANDLE_KILLPRIV_V2 (CKPTFS_NO_KILLPRIV_V2=1) the kernel asks
    before every write() and C answers."""
    monkeypatch.setenv("CKPTFS_NO_KILLPRIV_V2", "1")
    mounted = make_mount()
    before = mounted.stat()
    assert before["fuse_fastpath"] is True
    assert before["fuse_killpriv_v2"] is False
    write_pieces(mounted.path / "f", 1024, flags=os.O_CREAT | os.O_EXCL)
    after = mounted.stat()
    asked = after["fuse_requests"]["GETXATTR"] - before["fuse_requests"].get("GETXATTR", 0)
    in_c = after["fuse_getxattr_answered_in_c"] - before["fuse_getxattr_answered_in_c"]
    assert asked >= 1024                    # one per write(): the kernel asks
    assert in_c >= asked - 2, (asked, in_c)  # and Python answered (almost) none
    assert after["fuse_write_bytes"] - before["fuse_write_bytes"] == 1024 * 8192


def test_with_killpriv_v2_the_kernel_does_not_ask_before_every_write(mounted):
    """The INIT reply takes FUSE_HANDLE_KILLPRIV_V2: the mount is SB_NOSEC, so
    the kernel asks about security.capability once, not once per write()."""
    before = mounted.stat()
    assert before["fuse_killpriv_v2"] is True
    write_pieces(mounted.path / "f", 1024, flags=os.O_CREAT | os.O_EXCL)
    after = mounted.stat()
    asked = after["fuse_requests"].get("GETXATTR", 0) - before["fuse_requests"].get("GETXATTR", 0)
    assert asked <= 2, asked
    assert after["fuse_write_bytes"] - before["fuse_write_bytes"] == 1024 * 8192


# What a caller without CAP_FSETID does to a set-user-ID / set-group-ID file
# (root, its bounding set without CAP_FSETID), and what ext4 leaves after it.
_NO_FSETID = ["setpriv", "--bounding-set=-fsetid", "--inh-caps=-fsetid"]
_ACTIONS = {
    "write": "fd = os.open(p, os.O_WRONLY); os.write(fd, b'y' * 10); os.close(fd)",
    "truncate": "os.truncate(p, 100)",
    "open O_TRUNC": "os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))",
    "chown": "os.chown(p, 0, 0)",
}


@pytest.mark.parametrize("killpriv", [True, False])
@pytest.mark.parametrize("action", sorted(_ACTIONS))
def test_set_id_bits_go_as_on_ext4(make_mount, monkeypatch, fsck_clean, killpriv, action):
    """With FUSE_HANDLE_KILLPRIV_V2 the kernel leaves clearing suid/sgid to the
    daemon (the request's flag): a write, truncate, O_TRUNC open or chown by a
    caller without CAP_FSETID clears both (sgid: the group may execute), as on
    ext4; a write by root with CAP_FSETID keeps them. Without it (before
    seq17), the kernel's own SETATTR did it, except for the O_TRUNC open."""
    if not killpriv:
        monkeypatch.setenv("CKPTFS_NO_KILLPRIV_V2", "1")
    m = make_mount()
    assert m.stat()["fuse_killpriv_v2"] is killpriv
    p = m.path / "tool"
    write_pieces(p, 1, flags=os.O_CREAT | os.O_EXCL)
    os.chmod(p, 0o6777)
    subprocess.run([sys.executable, "-c", f"import os; p = {str(p)!r}; {_ACTIONS['write']}"],
                   check=True)      # root, with CAP_FSETID: kept
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o6777
    subprocess.run(_NO_FSETID + [sys.executable, "-c", f"import os; p = {str(p)!r}; "
                                 f"{_ACTIONS[action]}"], check=True)
    if not killpriv and action == "open O_TRUNC":
        return          # the kernel's own path never cleared them there (ckptfs before seq17)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o0777
    m.remount()
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o0777          # committed, not a cache
    fsck_clean(m)


@pytest.mark.parametrize("killpriv", [True, False])
@pytest.mark.parametrize("created_here", [True, False])
def test_a_write_strips_a_capability_set_after_the_fast_path_answered(make_mount, fsck_clean,
                                                                      monkeypatch, created_here,
                                                                      killpriv):
    """killpriv: with FUSE_HANDLE_KILLPRIV_V2 the kernel asks once per file
    (S_NOSEC), and again after security.capability is set: it still strips it."""
    if not killpriv:
        monkeypatch.setenv("CKPTFS_NO_KILLPRIV_V2", "1")
    m = make_mount()
    path = m.path / "tool"
    if created_here:
        write_pieces(path, 4, flags=os.O_CREAT | os.O_EXCL)      # marked at create
    else:
        write_pieces(path, 1, flags=os.O_CREAT | os.O_EXCL)
        m.remount()
        write_pieces(path, 4)       # marked when Python answered ENODATA once
    answered = m.stat()["fuse_getxattr_answered_in_c"]
    assert answered >= (0 if killpriv else 3)
    os.setxattr(path, CAPS, CAP_NET_RAW)
    assert os.getxattr(path, CAPS) == CAP_NET_RAW
    write_pieces(path, 1)       # the kernel must see the capability and remove it
    with pytest.raises(OSError) as e:
        os.getxattr(path, CAPS)
    assert e.value.errno == errno.ENODATA
    # Gone for good, not only from a cache.
    m.remount()
    with pytest.raises(OSError) as e:
        os.getxattr(path, CAPS)
    assert e.value.errno == errno.ENODATA
    os.setxattr(path, CAPS, CAP_NET_RAW)
    m.remount()
    assert os.getxattr(path, CAPS) == CAP_NET_RAW    # kept while nobody writes
    fsck_clean(m)


def test_read_ahead_is_raised_when_the_mount_returns(make_mount):
    for _ in range(3):
        m = make_mount()
        dev = mount_at(str(m.path)).device
        assert Path(f"/sys/class/bdi/{dev}/read_ahead_kb").read_text().strip() == "16384"
        m.umount()


def _connection(m) -> Path:
    """The mount's directory in the FUSE control filesystem (its device number)."""
    conn = Path("/sys/fs/fuse/connections") / str(os.stat(m.path).st_dev)
    if not conn.is_dir():
        pytest.skip("the FUSE control filesystem is not mounted at /sys/fs/fuse/connections")
    return conn


def test_init_asks_for_more_background_requests(make_mount, monkeypatch):
    """The INIT reply asks for 48 readahead/writeback requests in flight and a
    congestion threshold of 36; CKPTFS_MAX_BACKGROUND=0 leaves the kernel's 12 and 9."""
    m = make_mount()
    conn = _connection(m)
    assert (conn / "max_background").read_text().strip() == "48"
    assert (conn / "congestion_threshold").read_text().strip() == "36"
    m.umount()
    monkeypatch.setenv("CKPTFS_MAX_BACKGROUND", "0")
    m = make_mount()
    conn = _connection(m)
    assert (conn / "max_background").read_text().strip() == "12"
    assert (conn / "congestion_threshold").read_text().strip() == "9"


def _attrs(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_size,
            st.st_blocks, st.st_blksize, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)


def test_a_directory_getattr_after_a_create_is_answered_in_c_with_the_daemons_attributes(
        make_mount, fsck_clean):
    m = make_mount()
    d = m.path / "d"
    d.mkdir()
    before = m.stat()
    seen = []
    for i in range(20):
        fd = os.open(d / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"x" * 4096)
        os.close(fd)
        seen.append(_attrs(os.stat(d)))     # the kernel asks: its attributes were dropped
    after = m.stat()
    in_c = after["fuse_getattr_answered_in_c"] - before["fuse_getattr_answered_in_c"]
    asked = after["fuse_requests"]["GETATTR"] - before["fuse_requests"].get("GETATTR", 0)
    assert in_c >= 20 and asked - in_c <= 2, (asked, in_c)
    # Each answer was the directory as it was then: a new mtime every create.
    assert len({s[-2] for s in seen}) == 20
    # Changes the kernel does not drop the attributes for must drop what the
    # daemon left: a chmod after a create is seen by the next stat.
    fd = os.open(d / "g", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    os.chmod(d, 0o700)
    os.setxattr(d, "user.k", b"v")
    assert os.stat(d).st_mode & 0o7777 == 0o700
    os.unlink(d / "f0")
    os.rename(d / "f1", m.path / "f1")
    os.mkdir(d / "sub")
    last = _attrs(os.stat(d))
    # What Python answers after a remount (a LOOKUP, then its attributes) is
    # what C answered.
    m.remount()
    assert _attrs(os.stat(d)) == last
    fsck_clean(m)
