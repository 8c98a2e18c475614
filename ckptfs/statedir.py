"""SOURCE's state directory (SOURCE/.ckptfs): who holds it, and where its parts are.

Shared by the daemon, fsck and recover, which all work on an unmounted
SOURCE or mount it: the lock (`lock_source`: one holder at a time), whether
a formatted index is there (`index_exists`), where the log is (`log_path`,
remembered in the index by `remember_log_path`), where the backing store is
(`backing_root`), and the refusal to work on a mounted SOURCE
(`refuse_if_mounted`). All may block (small file I/O).
"""

from __future__ import annotations

import fcntl
import os

from . import index as ix
from .errors import OperationFailed
from .index import Index
from .mounts import mounted_from
from .options import MountOptions

LOCK_NAME = "lock"


def lock_source(state_dir: str) -> int:
    """Hold SOURCE for this process: a second mount (or fsck, recover) fails instead
    of corrupting. Returns the lock's fd; closing it lets go."""
    path = os.path.join(state_dir, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise OperationFailed(f"{os.path.dirname(state_dir)} is already mounted by ckptfs "
                              f"(daemon pid {holder or 'unknown'}; unmount it first)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def refuse_if_mounted(source: str, why: str = "") -> None:
    """OperationFailed if SOURCE is mounted by ckptfs (seen in mountinfo: a mount
    over SOURCE itself hides its lock from us)."""
    point = mounted_from(source)
    if point is not None:
        raise OperationFailed(f"{source} is mounted on {point}: unmount it first{why}")


def index_exists(index_dir: str) -> bool:
    """A formatted index is at index_dir. An unformatted one (an older ckptfs's
    first mount cut off between making and formatting it) holds nothing."""
    if not os.path.exists(os.path.join(index_dir, "data.mdb")):
        return False
    index = Index(index_dir)
    try:
        return index.is_formatted()
    finally:
        index.close()


def log_path(opts: MountOptions, index: Index) -> str:
    """pmem= if given, else the log this index was last mounted with, else the default."""
    if opts.pmem:
        return opts.pmem
    remembered = ix.get_log_path(index)
    if remembered:
        return os.path.join(opts.state_dir, os.fsdecode(remembered))    # absolute stays
    return opts.pmem_path


def remember_log_path(index: Index, opts: MountOptions) -> None:
    """Record the log's path in the index (relative when in the state directory, so
    a moved SOURCE keeps finding its own log), for mounts and fsck without pmem=."""
    path = os.path.abspath(opts.pmem_path)
    inside = os.path.commonpath([path, os.path.abspath(opts.state_dir)]) == \
        os.path.abspath(opts.state_dir)
    stored = os.fsencode(os.path.relpath(path, opts.state_dir) if inside else path)
    if ix.get_log_path(index) != stored:
        index.write_direct(lambda txn: ix.set_log_path(txn, stored))


def backing_root(opts: MountOptions, index: Index) -> str:
    """backing= if given, else where the store was created, else the default."""
    if opts.backing:
        return opts.backing
    remembered = ix.get_store_path(index)
    return remembered.decode() if remembered else opts.backing_dir
