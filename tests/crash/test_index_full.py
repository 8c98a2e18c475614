"""The disk holding the index fills up (issue 10, item 14).

SOURCE/.ckptfs (the LMDB index) goes on a small filesystem of its own, mounted
there before the first mount: a size-limited tmpfs with the log elsewhere, or
a loop-mounted ext4 image holding the log too. Writers and a filler file fill
it. What must hold (docs/OPERATIONS.md, "the index disk fills"):

- writers get ENOSPC, never EIO or EROFS; the filesystem does not turn
  read-only;
- deleting files still works on the full disk (the index keeps room for it);
- once the disk has room again, writes are accepted again, without a remount;
- after kill -9 and a remount (on the still full disk) every committed file is
  intact, every path is in a state its writer's journal allows, and fsck is
  clean.

The index-level test underneath: a commit that finds no room is kept and
retried, never dropped and never turned into a read-only filesystem.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from ckptfs import index as ix
from ckptfs.errors import IndexFull
from ckptfs.index import Index
from mounting import Mount, run_ckptfs
from journal_model import check, writer_model
from test_crash_kill import WRITER, crash, journal_models, observe, stop_writers

MiB = 1 << 20


# ------------------------------------------------------------------- disks

def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@contextlib.contextmanager
def small_disk(where: Path, size_mb: int, kind: str, image: Path):
    """A filesystem of size_mb mounted at where (tmpfs, or ext4 on a loop device)."""
    where.mkdir(parents=True, exist_ok=True)
    if kind == "tmpfs":
        _run("mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(where))
    else:
        with open(image, "wb") as f:
            f.truncate(size_mb * MiB)
        _run("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
        _run("mount", "-o", "loop", str(image), str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-d", str(where)], capture_output=True)
        if os.path.ismount(where):
            subprocess.run(["umount", "-l", "-d", str(where)], capture_output=True)


@contextlib.contextmanager
def state_on_small_disk(m: Mount, tmp_path: Path, size_mb: int, kind: str):
    """m's SOURCE/.ckptfs on a small disk of its own; yields a view of that disk
    from outside the mount (a bind mount), where the filler goes."""
    view = tmp_path / "state-view"
    view.mkdir()
    with small_disk(m.source / ".ckptfs", size_mb, kind, tmp_path / "state.img") as state:
        _run("mount", "--bind", str(state), str(view))
        try:
            yield view
        finally:
            m.cleanup()                 # the ckptfs mount over it goes first
            subprocess.run(["umount", "-l", str(view)], capture_output=True)


def fill(view: Path) -> Path:
    """Take every free byte of the disk view is on."""
    filler = view / "filler"
    with open(filler, "ab", buffering=0) as f:
        for block in (MiB, 64 << 10, 4096):
            try:
                while True:
                    f.write(bytes(block))
            except OSError as e:
                assert e.errno in (errno.ENOSPC, errno.EDQUOT), e
    return filler


def stat(m: Mount) -> dict:
    return json.loads(run_ckptfs("stat", str(m.path), "--json").stdout)


def wait_for(what: str, cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# --------------------------------------------------------- creator journal

class Creator:
    """The test's own writer: many small files with fresh names and an xattr each
    (the index grows with each), journaled like crash_writer (begin / committed /
    unlink)."""

    def __init__(self, top: Path, subdir: str, seed: int) -> None:
        self.top = top
        self.subdir = subdir
        self.rng = random.Random(seed)
        self.lines: list[str] = []
        self.committed: dict[str, str] = {}
        self.seq = 0
        (top / subdir).mkdir(exist_ok=True)

    def create(self) -> bool:
        """One new file; False if it failed with ENOSPC (any other error fails the test)."""
        self.seq += 1
        rel = f"{self.subdir}/n{self.seq:06d}"
        data = self.rng.randbytes(self.rng.choice((300, 3000, 20000)))
        sha = hashlib.sha256(data).hexdigest()
        self.lines.append(f"begin {rel} {sha}")
        try:
            fd = os.open(self.top / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as e:
            assert e.errno == errno.ENOSPC, f"{rel}: expected ENOSPC, got {e!r}"
            return False
        self.lines.append(f"committed {rel} {sha}")
        self.committed[rel] = sha
        try:
            # Metadata grows the index faster than file data: fills it sooner.
            os.setxattr(self.top / rel, "user.pad", self.rng.randbytes(8192))
        except OSError as e:
            assert e.errno == errno.ENOSPC, f"{rel}: expected ENOSPC, got {e!r}"
            return False
        return True

    def unlink_some(self, fraction: float) -> int:
        names = sorted(self.committed)
        gone = names[:int(len(names) * fraction)]
        for rel in gone:
            self.lines.append(f"unlink {rel}")
            os.unlink(self.top / rel)           # must work on a full disk
            del self.committed[rel]
        return len(gone)

    def until_enospc(self, failures: int, timeout_s: float = 180.0) -> int:
        """Create files until `failures` creates failed with ENOSPC; return the successes."""
        ok = failed = 0
        deadline = time.monotonic() + timeout_s
        while failed < failures:
            assert time.monotonic() < deadline, \
                f"no ENOSPC after {ok} files (the index did not fill the disk)"
            if self.create():
                ok += 1
            else:
                failed += 1
        return ok


def check_after_crash(m: Mount, journals: dict[str, Path], creator: Creator,
                      baseline: dict[str, str], what: str) -> dict[str, str]:
    observed = observe(m.path)
    models = journal_models(journals, baseline)
    models[creator.subdir] = writer_model(baseline, creator.subdir, creator.lines)
    check(models, observed, what)
    for rel, sha in creator.committed.items():
        assert observed.get(rel) == sha, f"{what}: committed {rel} lost or changed"
    return observed


def start_writers(m: Mount, journals: dict[str, Path], rng: random.Random
                  ) -> list[subprocess.Popen]:
    """crash_writer processes that go on after ENOSPC (and exit 3 on anything else)."""
    return [subprocess.Popen([sys.executable, str(WRITER), str(m.path), subdir, str(journal),
                              str(rng.randrange(1 << 32)), "--keep-going",
                              "--max-bytes", str(256 << 10)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
            for subdir, journal in journals.items()]


def writers_alive(procs: list[subprocess.Popen]) -> None:
    died = [(p.returncode, p.stderr.read().decode(errors="replace"))
            for p in procs if p.poll() is not None]
    assert not died, f"a writer failed (it gets nothing but ENOSPC): {died}"


# ------------------------------------------------------------ mount tests

def index_disk_fills(make_mount, tmp_path: Path, kind: str, size_mb: int,
                     options: list[str]) -> None:
    m = make_mount(options=options, start=False)
    with state_on_small_disk(m, tmp_path, size_mb, kind) as view:
        m.start()
        rng = random.Random(14)
        creator = Creator(m.path, "many", 1)
        journals = {f"w{i}": tmp_path / f"journal-w{i}" for i in range(2)}
        procs = start_writers(m, journals, rng)
        try:
            # 1. The disk fills: a filler takes what is free, the index grows into
            #    its reserve until growing changes are refused.
            filler = fill(view)
            creator.until_enospc(failures=20)
            s = stat(m)
            assert not s["read_only"] and s["errors"] == {}, s
            assert "index disk full" in (view / "daemon.log").read_text()
            writers_alive(procs)

            # 2. Deleting works on the full disk, and becomes durable.
            assert creator.unlink_some(0.5) > 0
            run_ckptfs("sync", str(m.path))
            assert not stat(m)["read_only"]

            # 3. Room again: writes are accepted again, no remount.
            filler.unlink()
            wait_for("the index to take writes again", lambda: not stat(m)["index_full"])
            for _ in range(20):
                assert creator.create(), "a write failed although the disk has room"
            writers_alive(procs)

            # 4. Full again, then kill -9 under the writers, remount on the full disk.
            fill(view)
            creator.until_enospc(failures=5)
            time.sleep(rng.uniform(0.2, 1.0))
            writers_alive(procs)
            crash(m, procs)
            m.start()
            check_after_crash(m, journals, creator, {}, f"{kind}: after kill -9 on a full disk")
            assert not stat(m)["read_only"]
            m.umount()
            res = m.fsck()
            assert res.returncode == 0, f"fsck exit {res.returncode}:\n{res.stdout}\n{res.stderr}"
        finally:
            stop_writers([p for p in procs if p.returncode is None])


def test_index_on_full_tmpfs_log_elsewhere(make_mount, tmp_path):
    index_disk_fills(make_mount, tmp_path, "tmpfs", 24,
                     [f"pmem={tmp_path / 'pmem.log'}", "pmem_size=256M", "tiering=off"])


def test_index_and_log_on_full_ext4(make_mount, tmp_path):
    # The default layout: log (fallocated at the first mount) and index on one disk.
    index_disk_fills(make_mount, tmp_path, "ext4", 96, ["pmem_size=48M", "tiering=off"])


# ------------------------------------------------------------ index level

def test_commit_without_room_is_kept_and_retried(tmp_path):
    """A batch LMDB cannot commit for lack of room stays pending (reads see it,
    waiters get ENOSPC, nothing turns read-only) and commits once there is
    room. Before: the filesystem turned read-only for good and waiters got EIO."""
    with small_disk(tmp_path / "disk", 4, "tmpfs", tmp_path / "unused.img") as disk:
        index = Index(str(disk / "index"))
        filler = fill(disk)
        values = {k: random.Random(k).randbytes(30000) for k in range(60)}   # 1.8 MB
        outcome = {}

        async def main():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(index.run_committer, lambda ranges: None,
                                   trio.CapacityLimiter(1))
                for k, v in values.items():
                    index._put("xattrs", ix.u64(k), v)
                seq = index.current_seq()
                with pytest.raises(IndexFull) as info:
                    await index.wait_durable(seq)
                outcome["errno"] = info.value.errno
                assert index.failure is None and index.stalled is not None
                assert index._get("xattrs", ix.u64(7)) == values[7]      # still pending
                index._put("xattrs", ix.u64(1000), b"later")           # still accepted
                filler.unlink()                                        # room again
                with trio.fail_after(30):
                    while True:
                        try:
                            await index.wait_durable(index.current_seq())
                            break
                        except IndexFull:
                            await trio.sleep(0.1)
                assert index.stalled is None
                index.stop()

        trio.run(main)
        assert outcome["errno"] == errno.ENOSPC
        index.close()
        again = Index(str(disk / "index"))
        try:
            assert all(again._get("xattrs", ix.u64(k)) == v for k, v in values.items())
            assert again._get("xattrs", ix.u64(1000)) == b"later"
        finally:
            again.close()
