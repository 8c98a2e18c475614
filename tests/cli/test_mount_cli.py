"""The command line: mount.ckptfs and ckptfs mount/umount/stat, how a mount
ends (ckptfs umount, umount, fusermount3 -u, SIGTERM), options and errors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from mounting import CKPTFS, MOUNT_HELPER, REPO, is_mounted, run_ckptfs
from posix_helpers import MiB, as_user, check_clean, pattern, read_file, wait_for, write_file

from ckptfs import mounts
from ckptfs.options import OPTIONS


def helper(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(MOUNT_HELPER + list(args), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie (exited, not yet reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in (b"Z", b"X")


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]


def forget_daemon(m) -> None:
    """The daemon ended by other means than m.umount(): let the fixture know."""
    m.pid = None


# ------------------------------------------------------------------- mounting

def test_mount_returns_only_when_live(make_mount):
    m = make_mount(start=False)
    res = helper(str(m.source), str(m.path), "-o", "pmem_size=64M")
    assert res.returncode == 0, res.stderr
    # live at once: no retry, no sleep
    assert is_mounted(m.path)
    write_file(m.path / "f", b"x")
    assert os.listdir(m.path) == ["f"]
    m.pid = m.stat()["pid"]


@pytest.mark.parametrize("where", ["clone_parent", "root", "unrelated_package"])
def test_daemon_runs_the_callers_package_from_any_directory(make_mount, tmp_path, where):
    """Where a user stands must not matter: right after `git clone` the current
    directory holds the clone, a `ckptfs/` folder that `python -m` would import."""
    m = make_mount(start=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    if where == "root":
        cwd = "/"
    elif where == "clone_parent":
        (cwd / "ckptfs").symlink_to(REPO)
    else:
        (cwd / "ckptfs").mkdir()
        (cwd / "ckptfs" / "__init__.py").write_text("raise ImportError('not the ckptfs')\n")
    res = subprocess.run(MOUNT_HELPER + [str(m.source), str(m.path), "-o", "pmem_size=64M"],
                         capture_output=True, text=True, timeout=60, cwd=cwd)
    assert res.returncode == 0, res.stderr
    m.pid = m.stat()["pid"]
    with open(f"/proc/{m.pid}/maps") as f:
        assert str(REPO / "ckptfs" / "_native") in f.read(), "daemon runs another ckptfs"
    assert os.readlink(f"/proc/{m.pid}/cwd") == "/", "daemon keeps the caller's directory busy"
    write_file(m.path / "f", b"x")
    m.umount()


def test_ckptfs_mount_subcommand(make_mount):
    m = make_mount(start=False, over_itself=False)
    res = run_ckptfs("mount", str(m.source), str(m.path), "-o", "pmem_size=64M", check=False)
    assert res.returncode == 0, res.stderr
    assert is_mounted(m.path)
    m.pid = m.stat()["pid"]
    write_file(m.path / "f", b"x")
    m.umount()
    assert not is_mounted(m.path)
    # the data went to SOURCE's state, and the mountpoint is left empty
    assert os.listdir(m.path) == []
    assert os.path.isdir(m.source / ".ckptfs")


def test_unknown_option(make_mount):
    m = make_mount(start=False)
    res = helper(str(m.source), str(m.path), "-o", "pmem_size=64M,no_such_option")
    assert res.returncode == 2
    assert "no_such_option" in one_line(res.stderr)
    assert not is_mounted(m.path)
    assert not (m.source / ".ckptfs").exists()


def test_option_missing_value_and_bad_size(make_mount):
    m = make_mount(start=False)
    for opt in ("pmem_size", "pmem_size=12X", "sync=sometimes", "debug=1", "dedup=maybe",
                "tiering=yes", "hot_versions=-1", "hot_versions=two", "metrics_port=0",
                "metrics_port=99999", "backing", "aws_profile", "aws_profile=a b",
                "aws_profile=../../etc"):
        res = helper(str(m.source), str(m.path), "-o", opt)
        assert res.returncode == 2, opt
        one_line(res.stderr)
        assert not is_mounted(m.path)


SOURCE_NAMES = ["inj\\,allow_other", "inj,allow_other", "inj\\,ro", "ünïcødé-检查点",
                "with space", "tab\there", "new\nline", "trailing\\", "per%2Ccent"]


def _mountinfo_entry(path) -> tuple[bytes, bytes, bytes]:
    """(per-mount options, source as the kernel shows it, super options) of the mount at path."""
    entry = mounts.mount_at(str(path))
    assert entry is not None, f"{path} is not in mountinfo"
    return entry.mount_options, entry.source_shown, entry.super_options


@pytest.mark.parametrize("name", SOURCE_NAMES, ids=lambda n: n.encode("unicode_escape").decode())
def test_source_path_never_becomes_mount_options(make_mount, tmp_path, name):
    """SOURCE's path goes into the fsname: no name can add a mount option
    (`inj\\,allow_other` once mounted with allow_other), any name mounts
    (non-ASCII could not), /proc/mounts, df and findmnt show it, and ckptfs
    finds its own mounts by it."""
    from ckptfs.options import parse_options
    src = tmp_path / name
    src.mkdir()
    real = os.path.realpath(src)
    m = make_mount(source=src, options=["pmem_size=64M"])
    wanted = parse_options(str(src), str(src), ["pmem_size=64M"])
    per_mount, shown, super_opts = _mountinfo_entry(m.path)
    assert (b"allow_other" in super_opts.split(b",")) == wanted.allow_other, super_opts
    assert b"ro" not in per_mount.split(b","), per_mount
    assert mounts.find_mount(str(src))[1] == real
    write_file(m.path / "f", b"written")             # a read-write mount
    fsname_encode = mounts.fsname_encode
    assert shown == fsname_encode(real).encode() == fsname_encode(real).encode("ascii")
    assert not set(shown) & set(b", \t\n\\"), shown
    # What operators see.
    res = subprocess.run(["df", "--output=source,fstype", str(m.path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and fsname_encode(real) in res.stdout, res
    res = subprocess.run(["findmnt", "-n", "-r", "-o", "SOURCE,FSTYPE", "-M", real],
                         capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == [fsname_encode(real), "fuse.ckptfs"], res
    # Mounting again is refused as "already mounted", by SOURCE.
    res = helper(str(src), str(src), "-o", "pmem_size=64M")
    assert res.returncode == 1 and "already mounted" in one_line(res.stderr)
    m.umount()
    # Mounted elsewhere: recover knows SOURCE is in use by its fsname.
    mnt = tmp_path / (name + "-mnt")
    mnt.mkdir()
    m.path = mnt
    m.start()
    assert read_file(mnt / "f") == b"written"
    assert _mountinfo_entry(mnt)[1] == fsname_encode(real).encode()
    assert mounts.find_mount(str(mnt))[1] == real
    res = run_ckptfs("recover", str(src), check=False)
    assert res.returncode == 1 and "unmount it first" in one_line(res.stderr), res.stderr
    m.umount()


@pytest.mark.parametrize("location", ["s3://b/x", "s3://AKIA:secret@bucket/x",
                                      "s3://bucket/../x", "S3://bucket/.x", "gs://b/p",
                                      "s3:/bucket/x", "relative/store", "./store", "store",
                                      "file://relative/dir", "file://"])
def test_backing_must_be_absolute_or_a_known_scheme(make_mount, tmp_path, location):
    """backing= never becomes a directory below the working directory: an unknown
    url scheme or a relative path is refused with one line, exit 2, nothing made."""
    m = make_mount(start=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for argv in (MOUNT_HELPER + [str(m.source), str(m.path), "-o", f"backing={location}"],
                 CKPTFS + ["recover", str(m.source), "-o", f"backing={location}"],
                 CKPTFS + ["fsck", str(m.source), "-o", f"backing={location}"]):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert res.returncode == 2, (argv, res.stderr)
        line = one_line(res.stderr)
        assert "backing" in line, line
        assert os.listdir(cwd) == [], f"{location} created {os.listdir(cwd)} in the cwd"
        assert not (m.source / ".ckptfs").exists()
        assert not is_mounted(m.path)


def test_backing_file_url_is_its_directory(make_mount, tmp_path):
    store = tmp_path / "store"
    m = make_mount(options=["pmem_size=64M", f"backing=file://{store}"])
    write_file(m.path / "f", pattern(MiB))
    assert m.stat()["backing"] == f"file://{store}"
    assert (store / "ckptfs-store").exists()


@pytest.mark.parametrize("cmd", ["mount", "umount", "stat", "fsck", "sync", "export", "gc",
                                 "recover", "tier"])
def test_every_subcommand_has_help(cmd):
    res = run_ckptfs(cmd, "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: ckptfs " + cmd), res.stdout


def test_subcommands_on_a_directory_that_is_not_mounted(tmp_path):
    for args in (["gc", str(tmp_path)], ["tier", str(tmp_path), "--now"],
                 ["sync", str(tmp_path)]):
        res = run_ckptfs(*args, check=False)
        assert res.returncode == 1 and "Traceback" not in res.stderr, args
        assert "no ckptfs daemon answers" in one_line(res.stderr)


def test_missing_mountpoint(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    res = helper(str(src), str(tmp_path / "nope"))
    assert res.returncode != 0
    assert "nope" in one_line(res.stderr)
    assert not is_mounted(tmp_path / "nope")
    res = helper(str(tmp_path / "nosrc"), str(src))
    assert res.returncode != 0
    one_line(res.stderr)
    assert not is_mounted(src)
    res = helper(str(src))
    assert res.returncode != 0
    one_line(res.stderr)


def test_daemon_side_failure_is_one_line(make_mount, tmp_path):
    """A failure found by the daemon (unusable log path): one line, exit 1, no mount."""
    m = make_mount(start=False)
    res = helper(str(m.source), str(m.path), "-o", f"pmem={tmp_path}/no/such/dir/log,pmem_size=64M")
    assert res.returncode == 1
    one_line(res.stderr)
    assert not is_mounted(m.path)


# ------------------------------------------------------------------ exit codes
# 2: the command line or an option is bad; 1: a good command that cannot be done.

def test_exit_2_pmem_size_too_small(make_mount):
    m = make_mount(start=False)
    res = helper(str(m.source), str(m.path), "-o", "pmem_size=1K")
    assert res.returncode == 2, res.stderr
    assert "pmem_size 1K is too small" in one_line(res.stderr)
    assert not is_mounted(m.path)
    assert not (m.source / ".ckptfs").exists()


def test_exit_1_already_mounted(make_mount):
    m = make_mount(options=["pmem_size=64M"])
    res = helper(str(m.source), str(m.path), "-o", "pmem_size=64M")
    assert res.returncode == 1, res.stderr
    assert "already mounted" in one_line(res.stderr)
    assert m.stat()["pid"] == m.pid


def test_exit_1_no_daemon_answers(make_mount):
    m = make_mount(options=["pmem_size=64M"])
    os.kill(m.pid, signal.SIGKILL)
    assert wait_for(lambda: gone(m.pid), 10)
    for args in (["stat", str(m.path)], ["sync", str(m.path)]):
        res = run_ckptfs(*args, check=False)
        assert res.returncode == 1, (args, res.stderr)
        assert "no ckptfs daemon answers" in one_line(res.stderr)
    res = run_ckptfs("umount", str(m.path), check=False)    # detaches the dead mount
    assert res.returncode == 0, res.stderr
    forget_daemon(m)


def test_exit_1_source_not_a_directory(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    (tmp_path / "mnt").mkdir()
    res = helper(str(tmp_path / "file"), str(tmp_path / "mnt"))
    assert res.returncode == 1
    assert "is not a directory" in one_line(res.stderr)
    assert not is_mounted(tmp_path / "mnt")


def test_exit_1_fsck_while_mounted(make_mount):
    m = make_mount(options=["pmem_size=64M"])
    res = run_ckptfs("fsck", str(m.source), check=False)
    assert res.returncode == 1
    assert "unmount it first" in one_line(res.stderr)


def test_second_mount_of_same_source(make_mount, tmp_path):
    m = make_mount(options=["pmem_size=64M"])
    write_file(m.path / "f", b"first mount")
    other = tmp_path / "elsewhere"
    other.mkdir()
    res = helper(str(m.source), str(other), "-o", "pmem_size=64M")
    assert res.returncode != 0
    line = one_line(res.stderr)
    assert "already mounted" in line, line
    assert not is_mounted(other)
    # the first mount is unaffected
    assert read_file(m.path / "f") == b"first mount"
    write_file(m.path / "g", b"still writable")
    assert m.stat()["pid"] == m.pid
    m.remount()
    assert read_file(m.path / "g") == b"still writable"


def test_second_mount_of_same_source_not_over_itself(make_mount, tmp_path):
    m = make_mount(options=["pmem_size=64M"], over_itself=False)
    write_file(m.path / "f", b"first mount")
    other = tmp_path / "elsewhere"
    other.mkdir()
    res = helper(str(m.source), str(other), "-o", "pmem_size=64M")
    assert res.returncode != 0
    assert "already mounted" in one_line(res.stderr)
    assert not is_mounted(other)
    assert read_file(m.path / "f") == b"first mount"


def test_mount_on_a_ckptfs_mountpoint(make_mount, tmp_path):
    m = make_mount(options=["pmem_size=64M"], over_itself=False)
    src2 = tmp_path / "src2"
    src2.mkdir()
    res = helper(str(src2), str(m.path), "-o", "pmem_size=64M")
    assert res.returncode != 0
    one_line(res.stderr)
    assert m.stat()["pid"] == m.pid


def test_mount_help_lists_every_option():
    res = helper("--help")
    assert res.returncode == 0
    # DESIGN.md also names backing=DIR; it comes with the backing store (not built yet).
    for name in list(OPTIONS) + ["pmem", "pmem_size", "allow_other", "debug"]:
        assert name in res.stdout, f"option {name} missing from mount.ckptfs --help"
    res = subprocess.run(CKPTFS + ["mount", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert res.returncode == 0
    for name in OPTIONS:
        assert name in res.stdout


def test_ckptfs_mount_help_is_one_usage_that_describes_every_flag():
    out = run_ckptfs("mount", "--help").stdout
    assert out.count("usage:") == 1, out
    for flag in ("-o OPT[,OPT...]", "-f"):
        assert re.search(rf"^  {re.escape(flag)}\s+\S", out, re.M), f"{flag} undescribed:\n{out}"


# ------------------------------------------------------------------ unmounting

def test_ckptfs_umount_waits_for_daemon(mounted):
    pid = mounted.pid
    write_file(mounted.path / "f", pattern(MiB))
    run_ckptfs("umount", str(mounted.path))
    assert gone(pid), "ckptfs umount returned while the daemon was still running"
    assert not is_mounted(mounted.path)
    forget_daemon(mounted)
    mounted.start()
    assert read_file(mounted.path / "f") == pattern(MiB)


def test_ckptfs_umount_not_mounted(tmp_path):
    res = run_ckptfs("umount", str(tmp_path), check=False)
    assert res.returncode == 1
    assert "not a ckptfs mount" in one_line(res.stderr)


@pytest.mark.parametrize("tool", [["umount"], ["fusermount3", "-u"]])
def test_plain_unmount_is_clean(mounted, tool):
    pid = mounted.pid
    data = pattern(2 * MiB, 50)
    write_file(mounted.path / "f", data)
    os.mkdir(mounted.path / "d")
    res = subprocess.run(tool + [str(mounted.path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert not is_mounted(mounted.path)
    assert wait_for(lambda: gone(pid), 30), "daemon still running after the unmount"
    forget_daemon(mounted)
    log = (mounted.source / ".ckptfs" / "daemon.log").read_text()
    assert "not cleanly unmounted" not in log
    mounted.start()
    assert read_file(mounted.path / "f") == data
    assert (mounted.path / "d").is_dir()
    mounted.umount()
    log = (mounted.source / ".ckptfs" / "daemon.log").read_text()
    assert "not cleanly unmounted" not in log, "the unmount was not clean"


def test_sigterm_commits_and_unmounts(make_mount):
    m = make_mount(options=["pmem_size=128M", "sync=lazy"])
    files = {f"f{i}": pattern(300000 + i, 60 + i) for i in range(10)}
    for name, data in files.items():
        write_file(m.path / name, data)
    pid = m.pid
    os.kill(pid, signal.SIGTERM)
    assert wait_for(lambda: gone(pid), 30), "daemon did not exit on SIGTERM"
    assert wait_for(lambda: not is_mounted(m.path), 10), "SIGTERM left the mount behind"
    forget_daemon(m)
    log = (m.source / ".ckptfs" / "daemon.log").read_text()
    assert "SIGTERM" in log
    m.start()
    for name, data in files.items():
        assert read_file(m.path / name) == data
    m.umount()
    log = (m.source / ".ckptfs" / "daemon.log").read_text()
    assert "not cleanly unmounted" not in log, "SIGTERM did not end in a clean unmount"


# ------------------------------------------------------------------------ stat

def test_stat_json(mounted):
    sizes = [5 * MiB, 1000, 0]
    for i, n in enumerate(sizes):
        write_file(mounted.path / f"f{i}", pattern(n, i))
    os.mkdir(mounted.path / "d")
    res = run_ckptfs("stat", str(mounted.path), "--json")
    s = json.loads(res.stdout)
    for key in ("pid", "logical_bytes", "stored_bytes", "hot_bytes", "pmem_size", "cold_bytes",
                "chunks", "dedup_ratio", "files"):
        assert key in s, key
    assert s["pid"] == mounted.pid and not gone(s["pid"])
    assert s["files"] == 3
    assert s["logical_bytes"] == sum(sizes)
    assert sum(sizes) <= s["stored_bytes"] <= 2 * sum(sizes)
    assert sum(sizes) <= s["hot_bytes"] <= s["pmem_size"]
    assert s["pmem_size"] == 512 * MiB
    assert s["cold_bytes"] >= 0
    assert s["chunks"] >= 2
    assert 0 < s["dedup_ratio"] <= 100
    human = run_ckptfs("stat", str(mounted.path))
    assert str(mounted.pid) in human.stdout


def test_stat_file_totals_follow_every_change(make_mount, fsck_clean):
    """files and logical_bytes are counters kept with each change (no scan):
    they must match the tree after creates, writes, truncates, O_TRUNC,
    links, renames over a file, unlinks (an open one counts until its close),
    and a remount."""
    m = make_mount()
    root = m.path

    def expect(files: int, size: int) -> None:
        s = m.stat()
        assert (s["files"], s["logical_bytes"]) == (files, size)

    write_file(root / "a", pattern(3 * MiB, 1))
    write_file(root / "b", pattern(1000, 2))
    os.mkdir(root / "d")
    os.symlink("a", root / "d" / "sym")
    expect(2, 3 * MiB + 1000)
    os.truncate(root / "a", MiB)                    # shrink
    os.truncate(root / "b", 5000)                   # grow
    expect(2, MiB + 5000)
    write_file(root / "b", pattern(10, 3))          # O_TRUNC rewrite
    os.link(root / "a", root / "d" / "hard")        # one inode, two names
    expect(2, MiB + 10)
    write_file(root / "c", pattern(7, 4))
    os.rename(root / "c", root / "b")               # replaces b
    expect(2, MiB + 7)
    fd = os.open(root / "b", os.O_RDONLY)
    os.unlink(root / "b")                           # open: still an inode
    expect(2, MiB + 7)
    os.close(fd)
    os.unlink(root / "a")
    expect(1, MiB)                                  # d/hard keeps it
    m.remount()
    expect(1, MiB)
    fsck_clean(m)


def test_stat_json_fields_are_documented(make_mount):
    readme = (REPO / "README.md").read_text()
    start = readme.index("`ckptfs stat --json` prints")
    table = readme[start:readme.index("\n\n", readme.index("| field |", start))]
    documented = set(re.findall(r"`([a-z_0-9]+)`", table))
    for options in (["pmem_size=64M"], ["pmem_size=64M", "tiering=off"]):
        missing = set(make_mount(options=options).stat()) - documented
        assert not missing, f"stat --json fields the README does not name: {sorted(missing)}"


def test_stat_into_a_closed_pipe_is_quiet(mounted):
    """`ckptfs stat MP | head -1`: the reader goes away before the output is
    written; the command ends without a traceback, as cat does."""
    proc = subprocess.Popen(CKPTFS + ["stat", str(mounted.path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert err == "", err       # no traceback, no "Broken pipe" line
    assert proc.returncode == 1, (proc.returncode, err)

def test_stat_not_mounted(tmp_path):
    res = run_ckptfs("stat", str(tmp_path), "--json", check=False)
    assert res.returncode == 1
    one_line(res.stderr)


# --------------------------------------------------------------------- options

def test_sync_lazy_durable_after_umount(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=128M", "sync=lazy"])
    assert m.stat()["sync"] == "lazy"
    files = {f"f{i}": pattern(100000 * (i + 1), 70 + i) for i in range(20)}
    for name, data in files.items():
        write_file(m.path / name, data)
    m.umount()
    m.start()
    for name, data in files.items():
        assert read_file(m.path / name) == data
    check_clean(fsck_clean, m)


@pytest.mark.parametrize("text,size", [("98304K", 96 * MiB), ("100MiB", 100 * MiB),
                                       ("1G", 1024 * MiB)])
def test_pmem_size_suffixes(make_mount, text, size):
    m = make_mount(options=[f"pmem_size={text}"])
    assert m.stat()["pmem_size"] == size
    m.umount()
    assert os.path.getsize(m.source / ".ckptfs" / "pmem.log") == size


def test_pmem_size_grows_never_shrinks(make_mount):
    m = make_mount(options=["pmem_size=64M"])
    write_file(m.path / "f", b"x")
    m.umount()
    m.options = ["pmem_size=128M"]
    m.start()
    assert m.stat()["pmem_size"] == 128 * MiB
    m.umount()
    res = helper(str(m.source), str(m.path), "-o", "pmem_size=64M")
    assert res.returncode != 0
    assert "shrink" in one_line(res.stderr)
    assert not is_mounted(m.path)
    m.options = []
    m.start()
    assert m.stat()["pmem_size"] == 128 * MiB
    assert read_file(m.path / "f") == b"x"


# ------------------------------------------------------------- other users

NOBODY = 65534


@pytest.fixture
def reachable_dir():
    """A directory every user can reach (pytest's own tmp dirs are 0700).

    Request it before make_mount: fixtures are torn down in reverse order, and
    the mounts inside must be gone before the directory can be removed.
    """
    path = Path(tempfile.mkdtemp(prefix="ckptfs-users-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _files_for_others(m) -> None:
    old = os.umask(0)
    try:
        (m.path / "public").write_bytes(b"for everyone")
        os.chmod(m.path / "public", 0o644)
        (m.path / "private").write_bytes(b"root only")
        os.chmod(m.path / "private", 0o600)
        os.mkdir(m.path / "ro_dir", 0o755)
        os.mkdir(m.path / "shared", 0o777)
    finally:
        os.umask(old)


def test_root_mount_serves_other_users_by_file_modes(reachable_dir, make_mount):
    """Mounted by root (setup script, fstab, systemd), the training job's own
    user reads and writes what the modes allow, and nothing else."""
    src = reachable_dir / "ckpt"
    src.mkdir(mode=0o755)
    m = make_mount(source=src, options=["pmem_size=64M"])
    _files_for_others(m)
    res = as_user(NOBODY, ["cat", str(m.path / "public")])
    assert res.returncode == 0 and res.stdout == "for everyone", res.stderr
    res = as_user(NOBODY, ["cat", str(m.path / "private")])
    assert res.returncode != 0 and "Permission denied" in res.stderr, res
    res = as_user(NOBODY, ["touch", str(m.path / "ro_dir" / "x")])
    assert res.returncode != 0 and "Permission denied" in res.stderr, res
    res = as_user(NOBODY, ["touch", str(m.path / "shared" / "mine")])
    assert res.returncode == 0, res.stderr
    st = os.stat(m.path / "shared" / "mine")
    assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
    res = as_user(NOBODY, ["ls", str(m.path)])
    assert res.returncode == 0 and "public" in res.stdout.split(), res.stderr


def test_allow_other_off_keeps_the_mount_to_its_user(reachable_dir, make_mount):
    src = reachable_dir / "ckpt"
    src.mkdir(mode=0o755)
    m = make_mount(source=src, options=["pmem_size=64M", "allow_other=off"])
    _files_for_others(m)
    res = as_user(NOBODY, ["cat", str(m.path / "public")])
    assert res.returncode != 0 and "Permission denied" in res.stderr, res
    assert (m.path / "public").read_bytes() == b"for everyone"
    res = helper(str(reachable_dir), str(reachable_dir), "-o", "allow_other=maybe")
    assert res.returncode == 2
    assert "allow_other must be" in one_line(res.stderr)


def test_client_commands_load_neither_the_daemon_nor_trio():
    """`ckptfs stat`, `sync`, `umount`, `gc` are clients of the daemon's
    socket: loading the daemon's modules (trio, the index, the log) made
    every command take 0.2-0.35 s on this machine before it did anything
    (`python -X importtime -c 'import ckptfs.cli'`: 185 ms, now ~30 ms)."""
    probe = ("import sys, ckptfs.cli; "
             "print(sorted(m for m in ('trio', 'ckptfs.daemon', 'ckptfs.index', 'lmdb') "
             "if m in sys.modules))")
    out = subprocess.run([CKPTFS[0], "-c", probe], capture_output=True, text=True,
                         timeout=60, cwd=REPO, check=True).stdout.strip()
    assert out == "[]", f"importing the command line loads {out}"
