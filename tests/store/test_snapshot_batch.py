"""A snapshot's namespace objects are made durable together (docs/STORE.md,
"Snapshots"): through one batch of the store, one fsync per object file and
one per directory the objects landed in, instead of two per object; and the
crash promise holds: an object's name appears only after its file was
fsynced, the head only after every directory of the batch was.

The filesystem is real (a mount writes the files, is unmounted); the publish
runs in this process (`publish_offline`) so its system calls can be counted
and ordered by pass-through wrappers of os.fsync, os.rename and os.link.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from mounting import run_ckptfs
from posix_helpers import read_file, write_file
from store_craft import Store

N_FILES = 200           # more objects than fan-out directories they land in


def _make_files(make_mount, n: int, tier: bool = False):
    m = make_mount(options=["pmem_size=64M"])
    (m.path / "d").mkdir()
    for i in range(n):
        write_file(m.path / "d" / f"f{i:03d}", b"file %d" % i)
    if tier:
        run_ckptfs("tier", str(m.path), "--now", "--all", timeout=600)
    m.umount()
    return m


def _store_root(m) -> Path:
    return m.source / ".ckptfs" / "store"


def _publish_offline(m):
    from ckptfs.backing.local import LocalBackend
    from ckptfs.index import Index
    from ckptfs.snapshots import publish_offline

    index = Index(str(m.source / ".ckptfs" / "index"))
    try:
        index.check_format()
        with LocalBackend.open(_store_root(m)) as backend:
            return publish_offline(index, backend)
    finally:
        index.close()


def test_a_snapshot_syncs_its_objects_together(make_mount, monkeypatch):
    m = _make_files(make_mount, N_FILES)
    vroot = Store(_store_root(m)).vroot
    shutil.rmtree(vroot / "objects")          # every object is new to the next publish
    objects_dir = str(vroot / "objects") + "/"
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_fsync, real_rename, real_link, real_mkdir = os.fsync, os.rename, os.link, os.mkdir

    def log(kind: str, path) -> None:
        with lock:
            events.append((kind, os.fspath(path)))

    def fsync(fd):
        log("fsync", os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def rename(src, dst, **kw):
        real_rename(src, dst, **kw)
        log("rename", dst)
        log("from", src)

    def link(src, dst, **kw):
        real_link(src, dst, **kw)
        log("link", dst)

    def mkdir(path, *a, **kw):
        real_mkdir(path, *a, **kw)
        log("mkdir", path)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "link", link)
    done = _publish_offline(m)
    monkeypatch.undo()

    head_at = next(i for i, (k, p) in enumerate(events)
                   if k == "link" and "/heads/" in p)
    before_head = events[:head_at]
    renamed = [p for k, p in before_head if k == "rename" and p.startswith(objects_dir)]
    dirs = {os.path.dirname(p) for p in renamed}
    file_syncs = [p for k, p in before_head if k == "fsync" and p.startswith(objects_dir)
                  and os.path.basename(p).startswith(".")]
    dir_syncs = [p for k, p in before_head if k == "fsync" and p.startswith(objects_dir)
                 and p.rstrip("/") in dirs]
    assert done.objects_written == len(renamed) >= N_FILES
    assert len(dirs) < len(renamed)
    # One fsync per object, one per directory: not one per object and rename.
    assert len(file_syncs) == len(renamed)
    assert sorted(dir_syncs) == sorted(dirs), (len(dir_syncs), len(dirs))
    # The crash promise: each file fsynced before its name appears; each
    # directory fsynced after the last object renamed into it, before the head.
    synced: set[str] = set()
    last_rename: dict[str, int] = {}
    for i, (k, p) in enumerate(before_head):
        if k == "fsync":
            synced.add(p)
        elif k == "from" and p.startswith(objects_dir):
            assert p in synced, f"{p} renamed into place before its fsync"
        elif k == "rename" and p.startswith(objects_dir):
            last_rename[os.path.dirname(p)] = i
    for d, i in last_rename.items():
        assert ("fsync", d) in before_head[i:], f"{d} not fsynced after its last object"
    # A directory the batch made is named durably in its parent before the head.
    made = [(i, p) for i, (k, p) in enumerate(before_head) if k == "mkdir"]
    assert {os.path.dirname(p) for p in renamed} <= {p for _, p in made}
    for i, d in made:
        assert ("fsync", os.path.dirname(d)) in before_head[i:], \
            f"{d} made, its parent not fsynced before the head"


KILL_AT_SYNC = r"""
import os, sys
sys.path[:0] = [{root!r}]
from ckptfs.backing import local
from ckptfs.backing.local import LocalBackend
from ckptfs.index import Index
from ckptfs.snapshots import publish_offline

def killed(self):
    os._exit(9)                 # the daemon killed between the objects and their sync

local._LocalBatch.sync = killed
index = Index({index!r})
index.check_format()
publish_offline(index, LocalBackend.open({store!r}))
"""


def test_a_kill_before_the_batch_sync_leaves_no_visible_object_and_no_head(make_mount):
    """Objects written, the batch not synced: nothing of them is visible (a
    later publish cannot take a torn one for present), no head is new; the
    next publish writes them all again and recover gives the files back."""
    m = _make_files(make_mount, 40, tier=True)
    store = Store(_store_root(m))
    shutil.rmtree(store.vroot / "objects")
    heads = store.head_paths()
    script = KILL_AT_SYNC.format(root=os.getcwd(), index=str(m.source / ".ckptfs" / "index"),
                                 store=str(_store_root(m)))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 9, res.stderr
    left = [p for p in (store.vroot / "objects").rglob("*") if p.is_file()]
    assert left and all(p.name.startswith(".") and ".tmp-" in p.name for p in left)
    assert store.head_paths() == heads
    done = _publish_offline(m)
    assert done.objects_written >= 40
    _, head = store.newest_head()
    assert head["seq"] == done.seq
    names = {e["n"] for e in store.read(next(
        e["d"] for e in store.read(head["root"])["entries"] if e["n"] == "d"))["entries"]}
    assert names == {f"f{i:03d}" for i in range(40)}
    shutil.rmtree(m.source / ".ckptfs" / "index")
    if (m.source / ".ckptfs" / "pmem.log").exists():
        os.unlink(m.source / ".ckptfs" / "pmem.log")
    res = run_ckptfs("recover", str(m.source), check=False, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    m.start()
    for i in range(40):
        assert read_file(m.path / "d" / f"f{i:03d}") == b"file %d" % i
    m.umount()
