"""Fixtures every test family shares.

The tests are grouped by family, one directory each; a family's own fixtures
are in its own conftest.py (compat/: the mount each framework needs; store/:
the S3 server):

    unit/    one module at a time: native helpers, chunker, codec, index, log,
             packs, metrics
    posix/   the filesystem through a real mount: POSIX calls, sync, dedup, security
    compat/  frameworks and shell tools on a real mount (their workers in compat/helpers/)
    crash/   SIGKILL of the daemon, power loss at handler level, a full index disk:
             the journal model, FaultLog, crash_writer
    store/   tiering, backends (the conformance suite, S3 on a real RGW), snapshots,
             recover, fsck and the fuzzers
    cli/     mount.ckptfs, mount -T, first mounts, export

Shared here:
- `make_mount` / `mounted`: real mounts of the real daemon in temporary
  directories through tools/mounting.py (the mount helper tests and tools
  share): `mount.ckptfs SRC SRC` (mounted over its own source, as users do),
  always cleaned up, even when a test fails: lazy unmount, then SIGTERM, then
  SIGKILL of the daemon; their stat() and sync() ask the daemon from this
  process (`DirectStatMount`). `fsck_clean`: unmount and require a clean fsck.
- `inproc`: ckptfs opened in this process (tests/inproc.py): the real
  Filesystem, index and log, no kernel in between, for tests whose subject is
  not the kernel's path (fsck and recover of what was written, power loss).
Generated data stays in pytest's tmp dirs. Test modules import helpers from
`mounting`, `inproc`, `posix_helpers` and `store_state`, never from a conftest:
with one conftest.py in several directories, `conftest` names whichever pytest
loaded last.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from ckptfs import control  # noqa: E402
from ckptfs.mounts import ckptfs_mounts  # noqa: E402
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))      # mounting.py, rgw.py: shared with the tools

from inproc import InProcess  # noqa: E402
from mounting import Mount, is_mounted  # noqa: E402


class DirectStatMount(Mount):
    """The Mount make_mount gives: stat() and sync() send the daemon the
    requests `ckptfs stat --json` and `ckptfs sync` send, from this process.
    Each command starts a Python (0.2-0.4 s on 2 cores), and every start()
    asks for the pid, many tests poll stat, some sync in loops; the commands
    themselves are tested in tests/cli (test_stat_json and its neighbours)
    and wherever a test runs them with run_ckptfs. The benchmarks keep
    Mount's (they may talk to another checkout's daemon)."""

    def stat(self) -> dict:
        return control.request(str(self.path), "stat", timeout_s=120)   # run_ckptfs's

    def sync(self, timeout_s: float = 600) -> None:
        control.request(str(self.path), "sync", timeout_s=timeout_s)


@pytest.fixture
def make_mount(tmp_path):
    """Factory: make_mount(options=[...], over_itself=True, source=None,
    mountpoint=None, start=True) -> Mount (started unless start=False)."""
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
        m = DirectStatMount(src, mnt, list(options or ["pmem_size=512M"]))
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
    ckptfs opened in this process over a fresh directory (or source). Whatever
    is still open at the end is closed as it is (no clean shutdown)."""
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
    leftovers = [point for _dev, point, _source in ckptfs_mounts() if point.startswith(base)]
    for path in leftovers:
        subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True)
