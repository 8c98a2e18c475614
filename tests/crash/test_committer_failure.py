"""A bug in the index committer: the daemon neither hangs nor loses a commit.

The committer task commits every batch; a close or fsync waits for it. If
it raised an unexpected exception (a bug, in the loop or in a callback it
runs once a batch is durable), the daemon used to cancel its request
handlers, then wait forever in the shielded unmount for commits of a
committer that was gone: the mount stayed, every request on it blocked.

Now such an exception makes the filesystem read-only, as a failed commit
does (docs/CONSISTENCY.md): what waits for a commit gets EIO, changes get
EROFS, reads go on, an unmount completes, and the next mount has every
durable commit. The fault is real, in the real daemon: the
CKPTFS_DEBUG_FAIL hook raises in the committer right after a batch became
durable, before it is announced (the worst moment: the batch is on disk,
its waiters not told).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

from mounting import is_mounted
from posix_helpers import pattern, read_file, write_file

MiB = 1 << 20

WRITER = """
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, bytes(range(256)) * (size // 256))
        os.fsync(fd)
    finally:
        os.close(fd)
except OSError as e:
    print(e.errno)
    sys.exit(1)
print(0)
"""


def test_a_committer_bug_turns_the_mount_read_only_instead_of_hanging(make_mount, tmp_path,
                                                                      monkeypatch):
    trigger = tmp_path / "fail-now"
    monkeypatch.setenv("CKPTFS_DEBUG_FAIL", f"commit-durable:{trigger}")
    m = make_mount(options=["pmem_size=128M", "tiering=off"])
    monkeypatch.delenv("CKPTFS_DEBUG_FAIL")
    old = pattern(3 * MiB, seed=1)
    write_file(m.path / "old.bin", old)
    os.sync()
    trigger.touch()
    # The next batch becomes durable, then the committer raises: the fsync
    # that waits for it fails, it does not wait forever.
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-c", WRITER, str(m.path / "new.bin"),
                          str(2 * MiB)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert int(res.stdout.split()[-1]) in (errno.EIO, errno.EROFS), res.stdout
    assert time.monotonic() - started < 30
    # Reads go on; changes are refused; stat says why.
    assert read_file(m.path / "old.bin") == old
    st = m.stat()
    assert st["read_only"] and "CKPTFS_DEBUG_FAIL" in (st["last_error"] or ""), st
    try:
        os.mkdir(m.path / "d")
        raise AssertionError("mkdir on a read-only mount succeeded")
    except OSError as e:
        assert e.errno == errno.EROFS, e
    daemon_log = (m.source / ".ckptfs" / "daemon.log")
    m.umount(timeout_s=60)                  # completes: nothing waits for a dead committer
    assert not is_mounted(m.path)
    text = daemon_log.read_text()
    assert "the index committer failed unexpectedly at batch" in text, text[-2000:]
    # The next mount recovers every durable commit: the batch the committer
    # failed after was durable, so new.bin is whole, or absent if the
    # failure came with an earlier batch, or empty if it came with the
    # create's own batch (a create left waiting 50 ms commits alone: under
    # load the writer's bytes may come later); never part of its bytes.
    m.start()
    assert read_file(m.path / "old.bin") == old
    if (m.path / "new.bin").exists():
        assert read_file(m.path / "new.bin") in (b"", bytes(range(256)) * (2 * MiB // 256))
    write_file(m.path / "after.bin", b"x" * MiB)            # writable again
    m.umount()
    res = m.fsck()
    assert res.returncode == 0, res.stdout + res.stderr
