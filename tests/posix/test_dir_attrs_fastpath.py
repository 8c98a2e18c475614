"""A directory's GETATTR answered in C after a change in it (attr_leave /
attr_drop, 2b21018) attacked: every kind of change in a directory, then a
change of the directory itself (chmod, chown, utime, setxattr, another
create) by root or by another user, then a GETATTR the kernel must send
(an xattr change drops the kernel's copy of the attributes). stat must
show what the daemon itself answers after a remount: never a stale mode,
owner, nlink, size, mtime or ctime; and the kernel's permission check
(default_permissions) must see a chmod at once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ckptfs import control

from posix_helpers import as_user, check_clean

NOBODY = 65534


@pytest.fixture
def world_dir():
    """A directory every user can reach (pytest's own tmp dirs are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="ckptfs-dattr-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _fields(st: os.stat_result) -> tuple:
    return (st.st_mode, st.st_uid, st.st_gid, st.st_nlink, st.st_size,
            st.st_mtime_ns, st.st_ctime_ns)


def _answered(m) -> int:
    return control.request(str(m.path), "stat")["fuse_getattr_answered_in_c"]


def _change_in(d: Path, kind: str, n: int) -> None:
    """One change of d's entries, of the kind given."""
    if kind == "create":
        (d / f"f{n}").write_bytes(b"x")
    elif kind == "unlink":
        (d / f"u{n}").write_bytes(b"x")
        os.unlink(d / f"u{n}")
    elif kind == "mkdir":
        os.mkdir(d / f"d{n}")
    elif kind == "rmdir":
        os.mkdir(d / f"r{n}")
        os.rmdir(d / f"r{n}")
    elif kind == "symlink":
        os.symlink("target", d / f"s{n}")
    elif kind == "link":
        (d.parent / f"l{d.name}{n}").write_bytes(b"x")
        os.link(d.parent / f"l{d.name}{n}", d / f"l{n}")
    elif kind == "rename_in":
        (d.parent / f"m{d.name}{n}").mkdir()
        os.rename(d.parent / f"m{d.name}{n}", d / f"m{n}")     # nlink + 1
    elif kind == "rename_out":
        os.mkdir(d / f"o{n}")
        os.rename(d / f"o{n}", d.parent / f"o{d.name}{n}")     # nlink back
    else:
        raise AssertionError(kind)


CHANGES = ("create", "unlink", "mkdir", "rmdir", "symlink", "link", "rename_in", "rename_out")


def test_a_directory_s_attributes_are_never_stale_after_a_change_in_it(make_mount, fsck_clean):
    """For each change in a directory followed by each change of the
    directory itself and a forced GETATTR: stat equals what is expected
    (the chmod's mode, the chown's owner, the utime's mtime, ctime not
    older than the change), and after a remount equals the daemon's own
    answer for every directory."""
    m = make_mount(options=["pmem_size=64M"])
    before = _answered(m)
    seen: dict[str, tuple] = {}
    n = 0
    for kind in CHANGES:
        for then in ("chmod", "chown", "utime", "setxattr", "create2", "none"):
            n += 1
            d = m.path / f"dir{n}"
            d.mkdir(mode=0o755)
            st0 = os.stat(d)
            # No stat between: the attributes left for C stay unused.
            _change_in(d, kind, n)
            if then == "chmod":
                os.chmod(d, 0o710)
            elif then == "chown":
                os.chown(d, 1234, 5678)
            elif then == "utime":
                os.utime(d, ns=(1_000_000_123, 2_000_000_456))
            elif then == "setxattr":
                os.setxattr(d, "user.a", b"1")
            elif then == "create2":
                _change_in(d, "create", n + 100000)
            # The kernel drops its copy of the attributes: a GETATTR follows.
            os.setxattr(d, "user.poke", str(n).encode())
            os.removexattr(d, "user.poke")
            st = os.stat(d)
            if then == "chmod":
                assert st.st_mode & 0o7777 == 0o710, (kind, then, oct(st.st_mode))
            else:
                assert st.st_mode & 0o7777 == 0o755, (kind, then, oct(st.st_mode))
            if then == "chown":
                assert (st.st_uid, st.st_gid) == (1234, 5678), (kind, then)
            if then == "utime":
                assert st.st_mtime_ns == 2_000_000_456, (kind, then, st.st_mtime_ns)
            else:
                assert st.st_mtime_ns >= st0.st_mtime_ns, (kind, then)
            assert st.st_ctime_ns >= st0.st_ctime_ns, (kind, then)
            entries = sum(1 for e in os.scandir(d) if e.is_dir(follow_symlinks=False))
            assert st.st_nlink == 2 + entries, (kind, then, st.st_nlink, entries)
            # A different process sees the same.
            out = os.popen(f"stat -c '%f %u %g %h %s %Y' {d}").read().split()
            assert [int(out[0], 16), *map(int, out[1:])] == [
                st.st_mode, st.st_uid, st.st_gid, st.st_nlink, st.st_size,
                st.st_mtime_ns // 1_000_000_000], (kind, then, out)
            seen[d.name] = _fields(st)
    assert _answered(m) - before >= len(CHANGES), "no GETATTR was answered in C"
    m.remount()
    for name, fields in seen.items():
        assert _fields(os.stat(m.path / name)) == fields, name
    check_clean(fsck_clean, m)


# Run as a plain user: each step prints "ok" or the errno name.
USER_STEPS = r'''
import errno, json, os, sys
d = sys.argv[1]
def step(fn, *args):
    try:
        fn(*args)
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
def create(name):
    os.close(os.open(os.path.join(d, name), os.O_CREAT | os.O_WRONLY, 0o644))
print(json.dumps({"create": step(create, sys.argv[2]),
                  "stat_mode": oct(os.stat(d).st_mode & 0o7777)}))
'''


def _as_nobody(d: Path, name: str) -> dict:
    res = as_user(NOBODY, ["/usr/bin/python3", "-c", USER_STEPS, str(d), name])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_chmod_by_root_denies_a_users_next_create_at_once(world_dir, make_mount,
                                                            fsck_clean):
    """allow_other, default_permissions: a world-writable directory, a create
    in it (its attributes left for C), then root's chmod 0700 (and, another
    round, a chown away from the user after a chmod 0755): the user's next
    create is refused at once, with or without a forced GETATTR between; a
    chmod 0777 lets it in again."""
    src = world_dir / "src"
    src.mkdir()
    m = make_mount(source=src, options=["pmem_size=64M", "allow_other"])
    d = m.path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    for rnd in range(6):
        assert _as_nobody(d, f"u{rnd}")["create"] == "ok", rnd
        (d / f"root{rnd}").write_bytes(b"r")        # root's create: attrs left
        if rnd % 3 == 1:
            os.chown(d, NOBODY, NOBODY)
            os.chmod(d, 0o700)
            os.chown(d, 0, 0)                       # root's again, still 0700
        else:
            os.chmod(d, 0o700)
        if rnd % 2:
            os.setxattr(d, "user.poke", b"1")       # the kernel asks GETATTR next
        out = _as_nobody(d, f"denied{rnd}")
        assert out["create"] == "EACCES", (rnd, out)
        assert not (d / f"denied{rnd}").exists()
        assert os.stat(d).st_mode & 0o7777 == 0o700
        os.chmod(d, 0o777)
    m.remount()
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [f"u{r}" for r in range(6)] + [f"root{r}" for r in range(6)])
    check_clean(fsck_clean, m)
