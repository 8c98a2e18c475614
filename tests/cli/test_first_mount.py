"""The first mount of a directory: a failed one leaves nothing new behind, one
cut off by a kill is made again by the next mount, and every refusal says
what to do."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from mounting import MOUNT_HELPER, REPO, is_mounted
from posix_helpers import read_file, write_file


def helper(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(MOUNT_HELPER + list(args), capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_failed_first_mount_leaves_nothing_new(make_mount, tmp_path, taken_port):
    m = make_mount(start=False)
    write_file(m.source / "keep", b"was here before")
    before = tree(m.source)
    # Fails after the index, the log and the backing store (and its parents) were made.
    res = helper(str(m.source), str(m.path), "-o",
                 f"pmem_size=64M,backing={tmp_path}/new/parents/store,metrics_port={taken_port}")
    assert res.returncode == 1
    assert "metrics" in one_line(res.stderr)
    assert not is_mounted(m.path)
    assert tree(m.source) == before
    assert not (tmp_path / "new").exists()
    # Fails at the log, with a backing directory that existed (and stays, empty).
    store = tmp_path / "store"
    store.mkdir()
    res = helper(str(m.source), str(m.path), "-o",
                 f"pmem={tmp_path}/no/such/dir/log,pmem_size=64M,backing={store}")
    assert res.returncode == 1
    assert "cannot create the log" in one_line(res.stderr)
    assert tree(m.source) == before and os.listdir(store) == []
    # and the next mount is a first mount like any other
    m.start()
    assert read_file(m.path / "keep") == b"was here before"


def test_failed_mount_keeps_the_existing_filesystem(make_mount, taken_port):
    m = make_mount(options=["pmem_size=64M"])
    write_file(m.path / "f", b"committed")
    m.umount()
    before = tree(m.source / ".ckptfs")
    res = helper(str(m.source), str(m.path), "-o", f"metrics_port={taken_port}")
    assert res.returncode == 1
    assert not is_mounted(m.path)
    assert tree(m.source / ".ckptfs") == before
    m.start()
    assert read_file(m.path / "f") == b"committed"


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to kill at a syscall")
@pytest.mark.parametrize("name,syscall", [
    ("pmem.log", "fallocate"),      # while reserving the log's blocks
    ("pmem.log", "pwrite64"),       # while writing its superblock
    ("pmem.log", "rename"),         # whole, not yet in place
    ("index", "rename"),            # the index with the adopted tree, not yet in place
])
def test_first_mount_killed_while_creating_is_redone(make_mount, fsck_clean, name, syscall):
    m = make_mount(start=False)
    write_file(m.source / "keep", b"adopted")
    # strace SIGKILLs the daemon at that syscall on that file (or its temporary).
    paths = [str(m.source / ".ckptfs" / (name + suffix)) for suffix in ("", ".creating")]
    try:
        res = subprocess.run(
            ["strace", "-f", "-qq", "-o", "/dev/null", "-P", paths[0], "-P", paths[1],
             "-e", f"trace={syscall}", "-e", f"inject={syscall}:signal=KILL"]
            + MOUNT_HELPER + [str(m.source), str(m.path), "-o", "pmem_size=64M"],
            capture_output=True, text=True, timeout=60, cwd=REPO,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the daemon made {name} without {syscall}")
    assert res.returncode == 1, res.stderr
    assert not is_mounted(m.path)
    m.start()
    assert read_file(m.path / "keep") == b"adopted"
    write_file(m.path / "new", b"x" * 100_000)
    m.umount()
    assert [n for n in os.listdir(m.source / ".ckptfs") if n.endswith(".creating")] == []
    fsck_clean(m)


def test_blank_log_of_an_older_ckptfs_is_redone(make_mount):
    """Before logs were built under a temporary name, a first mount cut off
    between fallocate and the superblock left a full-size log of zeros."""
    m = make_mount(options=["pmem_size=64M"])
    m.umount()
    log = m.source / ".ckptfs" / "pmem.log"
    with open(log, "r+b") as f:
        f.write(bytes(4096))
    m.start()
    write_file(m.path / "f", b"written after")
    m.umount()
    m.start()
    assert read_file(m.path / "f") == b"written after"


def test_refusals_say_what_to_do(make_mount, tmp_path):
    m = make_mount(options=["pmem_size=64M"])
    write_file(m.path / "f", b"x")
    m.umount()
    other = make_mount(options=["pmem_size=64M"])
    other.umount()
    # another filesystem's log
    res = helper(str(m.source), str(m.path), "-o", f"pmem={other.source}/.ckptfs/pmem.log")
    assert res.returncode == 1
    assert "point pmem= at another path" in one_line(res.stderr)
    # not a log at all
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a log" * 1000)
    res = helper(str(other.source), str(other.path), "-o", f"pmem={junk}")
    assert res.returncode == 1
    assert "remove it if it holds nothing you need" in one_line(res.stderr)
    assert junk.read_bytes() == b"not a log" * 1000
    # the log is gone but the index names data in it
    os.rename(m.source / ".ckptfs" / "pmem.log", tmp_path / "moved.log")
    res = helper(str(m.source), str(m.path))
    assert res.returncode == 1
    assert "restore it, or mount with pmem=" in one_line(res.stderr)
    assert not (m.source / ".ckptfs" / "pmem.log").exists()
    os.rename(tmp_path / "moved.log", m.source / ".ckptfs" / "pmem.log")
    m.start()
    assert read_file(m.path / "f") == b"x"


@pytest.fixture
def loop_device(tmp_path):
    """A 64 MiB block device (a loop device over a file of zeros), detached after."""
    image = tmp_path / "device.img"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    res = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"no loop device: {res.stderr.strip()}")
    device = res.stdout.strip()
    yield device
    subprocess.run(["losetup", "--detach", device], capture_output=True)


def test_blank_device_is_formatted_and_one_with_data_refused(make_mount, loop_device):
    m = make_mount(options=[f"pmem={loop_device}"])
    assert m.stat()["pmem_size"] == 64 << 20          # all of it
    write_file(m.path / "f", b"on the device")
    m.umount()
    m.start()
    assert read_file(m.path / "f") == b"on the device"
    m.umount()
    other = make_mount(start=False)
    res = helper(str(other.source), str(other.path), "-o", f"pmem={loop_device}")
    assert res.returncode == 1
    assert "point pmem= at another path" in one_line(res.stderr)
    assert not (other.source / ".ckptfs").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 GiB filesystem (tmpfs) of its own: the default log size follows its free space."""
    where = tmp_path / "disk"
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1G,mode=0755", "tmpfs",
                          str(where)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_default_log_size_is_said_once(small_disk, make_mount):
    """A mount without pmem_size= reserves a quarter of the free disk (up to
    8 GiB) at once: one line on stderr and in the daemon log says so."""
    src = small_disk / "ckpt"
    src.mkdir()
    m = make_mount(source=src, options=[], start=False)
    res = helper(str(m.source), str(m.path))
    assert res.returncode == 0, res.stderr
    m.pid = m.stat()["pid"]
    line = one_line(res.stderr)
    assert "reserves 256 MiB of disk now" in line and "pmem_size=" in line, line
    assert m.stat()["pmem_size"] == 256 << 20
    m.umount()
    assert "reserves 256 MiB of disk now" in (src / ".ckptfs" / "daemon.log").read_text()
    res = helper(str(m.source), str(m.path))          # the log exists: nothing to say
    assert res.returncode == 0 and res.stderr == "", res.stderr
    m.pid = m.stat()["pid"]
