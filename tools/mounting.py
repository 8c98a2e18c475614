"""Mounting ckptfs from tests and benchmark scripts, and never leaving a mount behind.

The one mount helper of the checkout, for tests (tests/conftest.py puts tools/
on sys.path) and for scripts in tools/ (their neighbour). It needs nothing but
the checkout (no pytest):

    from mounting import Mount, force_unmount, is_mounted, run_ckptfs

`Mount` runs the real commands (`mount.ckptfs`, `ckptfs stat/umount/fsck/tier`)
of this checkout's package. Its `cleanup` (and `force_unmount`) is for whatever
a test or a benchmark leaves, passed, failed or interrupted: a lazy unmount
(`fusermount3 -u -z`, then `umount -l`), which ends the daemon's FUSE session so
it commits and exits; then the daemon is stopped (SIGTERM, SIGKILL after 10 s),
found by the pid asked of it at mount time, else in SOURCE/.ckptfs/lock (readable
once the mount is detached), else by its command line. With abort=True the
mount's FUSE connection is aborted first (only that one, through fusectl), so no
process stays blocked in a daemon that no longer answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))           # this checkout's ckptfs, from any directory

from ckptfs.mounts import mountinfo  # noqa: E402
from ckptfs.proc import stop_process, wait_exit  # noqa: E402

CKPTFS = [sys.executable, "-m", "ckptfs.cli"]
MOUNT_HELPER = [sys.executable, str(REPO / "mount.ckptfs")]
FUSECTL = Path("/sys/fs/fuse/connections")


class MountError(AssertionError):
    """A mount command failed (an AssertionError, so a test shows it as its failure)."""

    def __init__(self, returncode: int, stderr: str, what: str = "mount") -> None:
        super().__init__(f"{what} failed ({returncode}): {stderr.strip()}")
        self.returncode = returncode
        self.stderr = stderr


def run_ckptfs(*args: str, check: bool = True, timeout: float = 120,
               **kw) -> subprocess.CompletedProcess:
    """`ckptfs ARGS` of this checkout, output captured; check: exit 0 or MountError."""
    res = subprocess.run(CKPTFS + list(args), capture_output=True, text=True, timeout=timeout,
                         cwd=kw.pop("cwd", REPO), **kw)
    if check and res.returncode != 0:
        raise MountError(res.returncode, res.stderr, what=f"ckptfs {' '.join(args)}")
    return res


# ------------------------------------------------------------------ mount table

def mount_table() -> list[tuple[str, str, str]]:
    """(major:minor, mountpoint, filesystem type) of every mount this process sees."""
    return [(e.device, e.mountpoint, e.fstype) for e in mountinfo()]


def mounted_paths() -> set[str]:
    return {point for _, point, _ in mount_table()}


def is_mounted(path: os.PathLike | str) -> bool:
    """Something (live or dead) is mounted exactly at path. Never stats the path."""
    return os.path.realpath(path) in mounted_paths()


def mount_device(path: os.PathLike | str) -> Optional[str]:
    """major:minor of the topmost mount at path (its /sys/class/bdi/ entry), if any."""
    want = os.path.realpath(path)
    found = None
    for dev, point, _ in mount_table():
        if point == want:
            found = dev
    return found


def fuse_connection(path: os.PathLike | str) -> Optional[str]:
    """The fusectl connection number of the FUSE mount at path (its device minor)."""
    want = os.path.realpath(path)
    found = None
    for dev, point, fstype in mount_table():
        if point == want and fstype.startswith("fuse"):
            found = dev.split(":")[1]           # the topmost mount there
    return found


def abort_connection(path: os.PathLike | str) -> bool:
    """Abort the FUSE connection of the mount at path (only that one): every
    request in it fails at once. False if there is none or fusectl is absent."""
    conn = fuse_connection(path)
    if conn is None:
        return False
    try:
        (FUSECTL / conn / "abort").write_text("1\n")
    except OSError:
        return False
    return True


# -------------------------------------------------------------------- daemons

def _is_daemon_of(pid: int, source: Optional[Path]) -> bool:
    """pid runs ckptfs (a daemon, or a `mount -f` serving in the foreground), of
    source when given: never stop anything else, such as a stale lock's pid."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    daemon = any(b"ckptfs.daemon" in a for a in argv) or \
        (b"-f" in argv and any(b"ckptfs" in a for a in argv))
    if not daemon:
        return False
    return source is None or any(os.fsencode(p) in argv for p in
                                 (os.path.abspath(source), os.path.realpath(source)))


def daemon_pid(source: os.PathLike | str) -> Optional[int]:
    """pid of the daemon serving SOURCE: from its lock file (readable when SOURCE is
    not hidden by the mount), else from the process list."""
    source = Path(source)
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid = int((source / ".ckptfs" / "lock").read_text().split()[0])
        if _is_daemon_of(pid, source):      # a stale lock's pid may be anyone's now
            return pid
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _is_daemon_of(int(entry.name), source):
            return int(entry.name)
    return None


def force_unmount(path: os.PathLike | str, pid: Optional[int] = None,
                  source: Optional[os.PathLike | str] = None, abort: bool = False) -> None:
    """Leave nothing mounted at path and no daemon running: [abort the FUSE
    connection,] lazy unmount, then stop the daemon (pid, or found from source)."""
    path = Path(path)
    if abort and is_mounted(path):
        abort_connection(path)
    for cmd in (["fusermount3", "-u", "-z"], ["fusermount", "-u", "-z"], ["umount", "-l"],
                ["umount", "-l"]):
        if not is_mounted(path):
            break
        with contextlib.suppress(OSError):
            subprocess.run(cmd + [str(path)], capture_output=True, timeout=60)
    if pid is None and source is not None:
        pid = daemon_pid(source)
    if pid is not None and _is_daemon_of(pid, None):
        stop_process(pid)


# ---------------------------------------------------------------------- a mount

@dataclass
class Mount:
    """A ckptfs mount of `source` on `path` (the same directory by default, as
    users mount it), with `options` (-o, as a list). `start` returns once the
    mount is live (mount.ckptfs's contract) and asks the daemon for its pid."""

    source: Path
    path: Path
    options: list[str] = field(default_factory=list)
    pid: Optional[int] = None
    command: Sequence[str] = tuple(MOUNT_HELPER)    # or CKPTFS + ["mount"]
    mounts: int = 0                                 # how often start succeeded

    def __post_init__(self) -> None:
        self.source, self.path = Path(self.source), Path(self.path)

    def mount_argv(self, extra: Sequence[str] = ()) -> list[str]:
        argv = list(self.command) + [str(self.source), str(self.path)]
        opts = ",".join(list(self.options) + list(extra))
        return argv + (["-o", opts] if opts else [])

    def start(self, extra: Sequence[str] = (), timeout_s: float = 300) -> None:
        res = subprocess.run(self.mount_argv(extra), capture_output=True, text=True,
                             timeout=timeout_s, cwd=REPO)
        if res.returncode != 0:
            raise MountError(res.returncode, res.stderr)
        if not is_mounted(self.path):
            raise MountError(0, "the mount command returned 0 but nothing is mounted")
        self.mounts += 1
        self.pid = int(self.stat()["pid"])

    def stat(self) -> dict:
        return json.loads(run_ckptfs("stat", str(self.path), "--json").stdout)

    def sync(self, timeout_s: float = 600) -> None:
        run_ckptfs("sync", str(self.path), timeout=timeout_s)

    def tier_now(self, *args: str, timeout_s: float = 600) -> None:
        """`ckptfs tier --now [ARGS]`: returns when the pass is done."""
        run_ckptfs("tier", str(self.path), "--now", *args, timeout=timeout_s)

    def umount(self, timeout_s: float = 600) -> None:
        """`ckptfs umount --timeout T`: returns once the daemon has committed and
        exited (600 s is the command's own default)."""
        run_ckptfs("umount", str(self.path), "--timeout", f"{timeout_s:g}",
                   timeout=timeout_s + 60)
        if is_mounted(self.path):
            raise MountError(0, f"{self.path} is still mounted after ckptfs umount",
                             what="umount")
        self.pid = None

    def remount(self) -> None:
        self.umount()
        self.start()

    def kill(self, detach: bool = True) -> None:
        """SIGKILL the daemon (a crash) and detach the dead mount. detach=False
        leaves it attached, every call on it failing (ENOTCONN), until `detach`:
        once detached, the path leads to the directory below the mount."""
        assert self.pid is not None, "not mounted by this Mount"
        os.kill(self.pid, signal.SIGKILL)
        wait_exit(self.pid, 10)
        self.pid = None
        if detach:
            self.detach()

    def detach(self) -> None:
        """Lazy unmount of a dead mount (after `kill(detach=False)`)."""
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)

    def fsck(self, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
        """`ckptfs fsck SOURCE ARGS` of the unmounted filesystem; never raises on its exit."""
        if is_mounted(self.path):
            raise MountError(0, "fsck needs the filesystem unmounted", what="fsck")
        return run_ckptfs("fsck", str(self.source), *args, check=False, timeout=timeout_s)

    def cleanup(self, abort: bool = False) -> None:
        """Whatever state it is in: nothing mounted at path, no daemon left."""
        force_unmount(self.path, self.pid, source=self.source, abort=abort)
        self.pid = None
