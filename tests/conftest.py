"""Shared fixtures: real mounts of the real daemon in temporary directories.

`mounted` starts `mount.ckptfs SRC SRC` (mounted over its own source, as users
do) and always cleans up, even when a test fails: lazy unmount, then SIGTERM,
then SIGKILL of the daemon. `inproc` opens ckptfs in this process instead
(tests/inproc.py): the real Filesystem, index and log, no kernel in between,
for tests of handler behaviour. Generated data stays in pytest's tmp dirs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from ckptfs.proc import stop_process, wait_exit
from inproc import InProcess

REPO = Path(__file__).resolve().parent.parent
MOUNT_HELPER = [sys.executable, str(REPO / "mount.ckptfs")]
CKPTFS = [sys.executable, "-m", "ckptfs.cli"]


def run_ckptfs(*args: str, check: bool = True, timeout: float = 120,
               **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(CKPTFS + list(args), capture_output=True, text=True, timeout=timeout,
                         cwd=REPO, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"ckptfs {' '.join(args)} exited {res.returncode}: {res.stderr}")
    return res


def is_mounted(path: Path) -> bool:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes.
    target = os.fsencode(os.path.realpath(path))
    with open("/proc/self/mountinfo", "rb") as f:
        return any(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]),
                          line.split()[4]) == target for line in f)


def daemon_pid(source: Path) -> Optional[int]:
    """pid of the daemon serving source, from its lock file (readable when unmounted
    or when source differs from the mountpoint) or from the process list."""
    out = subprocess.run(["pgrep", "-f", f"ckptfs.daemon .* {source} "], capture_output=True,
                         text=True).stdout.split()
    return int(out[0]) if out else None


def force_unmount(path: Path, pid: Optional[int]) -> None:
    """Lazy unmount, then terminate, then kill: never leave a mount behind."""
    for _ in range(3):
        if not is_mounted(path):
            break
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)
        if is_mounted(path):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
    if pid is not None:
        stop_process(pid)


@dataclass
class Mount:
    """A live ckptfs mount of `source` on `path` (the same directory by default)."""

    source: Path
    path: Path
    options: list[str] = field(default_factory=list)
    pid: Optional[int] = None

    def start(self, extra: tuple[str, ...] = ()) -> None:
        args = MOUNT_HELPER + [str(self.source), str(self.path)]
        opts = ",".join(self.options + list(extra))
        if opts:
            args += ["-o", opts]
        res = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise AssertionError(f"mount failed ({res.returncode}): {res.stderr.strip()}")
        assert is_mounted(self.path), "mount.ckptfs returned 0 but nothing is mounted"
        self.pid = self.stat()["pid"]

    def stat(self) -> dict:
        return json.loads(run_ckptfs("stat", str(self.path), "--json").stdout)

    def umount(self) -> None:
        run_ckptfs("umount", str(self.path))
        assert not is_mounted(self.path)
        self.pid = None

    def remount(self) -> None:
        self.umount()
        self.start()

    def kill(self) -> None:
        """SIGKILL the daemon and detach the dead mount (a crash)."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        wait_exit(self.pid, 10)
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        self.pid = None

    def fsck(self, *args: str) -> subprocess.CompletedProcess:
        assert not is_mounted(self.path), "fsck needs the filesystem unmounted"
        return run_ckptfs("fsck", str(self.source), *args, check=False, timeout=600)

    def cleanup(self) -> None:
        force_unmount(self.path, self.pid or daemon_pid(self.source))


@pytest.fixture
def make_mount(tmp_path):
    """Factory: make_mount(options=[...], over_itself=True, source=None,
    mountpoint=None) -> started Mount."""
    mounts: list[Mount] = []

    def factory(options: Optional[list[str]] = None, over_itself: bool = True,
                source: Optional[Path] = None, start: bool = True,
                mountpoint: Optional[Path] = None) -> Mount:
        src = source or tmp_path / f"ckpt{len(mounts)}"
        src.mkdir(exist_ok=True)
        if mountpoint is not None:
            mnt = mountpoint
            mnt.mkdir(exist_ok=True)
        elif over_itself:
            mnt = src
        else:
            mnt = tmp_path / f"mnt{len(mounts)}"
            mnt.mkdir(exist_ok=True)
        m = Mount(src, mnt, list(options or ["pmem_size=512M"]))
        mounts.append(m)
        if start:
            m.start()
        return m

    yield factory
    for m in mounts:
        m.cleanup()
    for m in mounts:
        # Each log is fallocated (hundreds of MB of real blocks): free them now,
        # not when pytest prunes old tmp dirs, or a full run fills the disk.
        if not is_mounted(m.path):
            shutil.rmtree(m.source, ignore_errors=True)
            if m.path != m.source:
                shutil.rmtree(m.path, ignore_errors=True)


@pytest.fixture
def mounted(make_mount) -> Mount:
    """A fresh ckptfs mounted over its own source directory."""
    return make_mount()


@pytest.fixture
def fsck_clean():
    """Call at the end of a test that wrote: unmount, fsck must report clean."""
    def check(m: Mount) -> None:
        if is_mounted(m.path):
            m.umount()
        res = m.fsck()
        assert res.returncode == 0, f"fsck found problems:\n{res.stdout}\n{res.stderr}"
    return check


@pytest.fixture
def inproc(tmp_path):
    """Factory: inproc(options=["pmem_size=64M"], source=None, **kw) -> InProcess,
    ckptfs opened in this process over a fresh directory (or source), no FUSE
    mount (tests/inproc.py). Whatever is still open at the end is closed as it
    is (no clean shutdown)."""
    opened: list[InProcess] = []

    def factory(options: Optional[list[str]] = None, source: Optional[Path] = None,
                **kw) -> InProcess:
        src = source or tmp_path / f"fs{len(opened)}"
        src.mkdir(exist_ok=True)
        fs = InProcess(src, options if options is not None else ["pmem_size=64M"], **kw)
        opened.append(fs)
        return fs

    yield factory
    for fs in opened:
        fs.close()
        shutil.rmtree(fs.source, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    # Belt and braces: nothing mounted by the tests survives the run. Only this
    # session's own tmp dirs: another pytest run may have live mounts right now.
    basetemp = getattr(getattr(session.config, "_tmp_path_factory", None), "_basetemp", None)
    if basetemp is None:
        return      # no tmp dir made, so nothing mounted
    base = os.path.realpath(basetemp) + "/"
    with open("/proc/self/mountinfo") as f:
        leftovers = [line.split()[4] for line in f
                     if "fuse.ckptfs" in line and line.split()[4].startswith(base)]
    for path in leftovers:
        subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True)


# -- a real S3 server --------------------------------------------------------------------

def load_rgw_tool():
    """tools/rgw.py as a module (tools/ is not a package)."""
    import importlib.util
    name = "ckptfs_tools_rgw"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "rgw.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def rgw(tmp_path_factory):
    """Ceph's RADOS Gateway on a one-node Ceph in RAM (tools/rgw.py), started
    the first time a test asks for it and stopped at the end of the session,
    whatever the tests did (and by SIGTERM if pytest itself dies). Skips when
    Ceph is not installed, unless CKPTFS_REQUIRE_RGW=1 (tools/test.sh, CI)."""
    tool = load_rgw_tool()
    missing = tool.missing_binaries()
    if missing:
        why = (f"Ceph is not installed ({', '.join(missing)} missing): "
               "tools/setup-debian.sh --with-tests installs it")
        if os.environ.get("CKPTFS_REQUIRE_RGW") == "1":
            pytest.fail(why)
        pytest.skip(why)
    gw = tool.RGW.start(str(tmp_path_factory.mktemp("rgw")), memstore_bytes=2 << 30,
                        bound_to_parent=True)
    try:
        yield gw
    finally:
        gw.stop(keep=True)          # the logs stay in pytest's tmp dir
