"""Several nodes, one store: publishing, volumes, restore elsewhere, takeover.

A "node" here is a SOURCE directory with its own log and index, mounted by
its own daemon; the store they share is a directory (standing for NFS,
Lustre or CephFS mounted on every node) or a bucket on the session's real
Ceph RGW. Nothing is mocked: the daemons, `ckptfs recover`, `ckptfs
volumes` and `ckptfs sync --published` run as the commands they are.

The multi-node series (three nodes saving every 10 s, one killed and
restored on another) is marked `cluster` and left out of the default run
(`tools/test.sh -m cluster`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from ckptfs.backing import open_backend
from ckptfs import volumes

from mounting import CKPTFS, REPO, is_mounted, run_ckptfs
from posix_helpers import read_file, wait_until, write_file
from test_backing import s3_client
from test_s3 import aws_env
from test_tier import floats, verify, write_version

MiB = 1 << 20
DELAY_S = 2.0                       # publish_delay of these tests


class DirStore:
    """A directory outside every SOURCE: the shared filesystem of the nodes."""

    kind = "dir"

    def __init__(self, tmp_path: Path, monkeypatch) -> None:
        self.root = tmp_path / "shared" / "ckpt-store"
        self.location = str(self.root)

    def down(self) -> None:
        """Unreachable, as an NFS mount gone away."""
        self.root.rename(self.root.with_name("away"))

    def up(self) -> None:
        self.root.with_name("away").rename(self.root)

    def open(self):
        return open_backend(self.location, must_exist=True)

    def close(self) -> None:
        pass


class S3Store:
    """A fresh bucket on the session's RGW; the nodes find the endpoint and
    keys in the environment, the standard AWS way."""

    kind = "s3"

    def __init__(self, tmp_path: Path, monkeypatch, rgw) -> None:
        self.rgw = rgw
        self.admin = s3_client(rgw)
        self.bucket = f"ckptfs-cl-{uuid.uuid4().hex[:16]}"
        self.admin.create_bucket(Bucket=self.bucket)
        self.location = f"s3://{self.bucket}/ckpt"
        aws_env(monkeypatch, **rgw.env())

    def down(self) -> None:
        self.rgw.stop_gateway()

    def up(self) -> None:
        self.rgw.start_gateway()

    def open(self):
        return open_backend(self.location, must_exist=True)

    def close(self) -> None:
        if "rgw" not in self.rgw.pids:
            self.rgw.start_gateway()
        for up in self.admin.list_multipart_uploads(Bucket=self.bucket).get("Uploads", ()):
            self.admin.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"],
                                              UploadId=up["UploadId"])
        for page in self.admin.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            for obj in page.get("Contents", ()):
                self.admin.delete_object(Bucket=self.bucket, Key=obj["Key"])
        self.admin.delete_bucket(Bucket=self.bucket)


@pytest.fixture(params=["dir", "s3"])
def store(request, tmp_path, monkeypatch):
    if request.param == "dir":
        s = DirStore(tmp_path, monkeypatch)
    else:
        s = S3Store(tmp_path, monkeypatch, request.getfixturevalue("rgw"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def dir_store(tmp_path, monkeypatch):
    return DirStore(tmp_path, monkeypatch)


def node(make_mount, store, volume: str, *extra: str, start: bool = True):
    """A node's filesystem in the shared store as volume `volume`."""
    return make_mount(options=["pmem_size=128M", f"backing={store.location}",
                               f"volume={volume}", f"publish_delay={DELAY_S:g}", *extra],
                      start=start)


def sync_published(m, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return run_ckptfs("sync", "--published", str(m.path), "--timeout", f"{timeout_s:g}",
                      timeout=timeout_s + 30)


def recover(m, store, volume: str, *args: str) -> subprocess.CompletedProcess:
    return run_ckptfs("recover", str(m.source), "-o",
                      f"backing={store.location},volume={volume}", *args, check=False,
                      timeout=600)


def state_of(store, volume: str) -> volumes.VolumeState:
    with store.open() as backend:
        return volumes.read_state(backend, volume)


def gone(m) -> None:
    """The node dies (kill -9) and its log and index are lost with it."""
    m.kill()
    shutil.rmtree(m.source / ".ckptfs")


def restored_on_a_new_node(a, make_mount, store):
    """Node a is gone; a new node recovers volume a from the store alone and
    mounts it (publishing off): returns that mount."""
    gone(a)
    b = make_mount(options=["pmem_size=128M"], start=False)
    res = recover(b, store, "a")
    assert res.returncode == 0, res.stdout + res.stderr
    b.start([f"backing={store.location}", "volume=a", "publish_delay=off"])
    return b


# ------------------------------------------------------------------- publishing

def test_every_commit_is_published_within_the_delay_and_stays_hot(make_mount, store,
                                                                  fsck_clean):
    """A version is copied to the store and named by a head within
    publish_delay (plus the round's own time), while its bytes stay in the
    log; tiering it later writes no pack, it only drops the log copy."""
    a = node(make_mount, store, "a")
    files = write_version(a.path, 1, size=2 * MiB)
    closed = time.monotonic()
    lag = wait_until(lambda: (lambda st: st["publish_lag_s"] == 0 and st["publish_backlog_bytes"]
                            == 0 and st["published_copy_bytes"] > 0)(a.stat()),
                   DELAY_S + 20, "published")
    st = a.stat()
    assert st["cold_bytes"] == 0 and st["hot_bytes"] >= 3 * MiB, st     # still hot
    assert st["publish_state"] == "idle" and st["volume"] == "a", st
    newest = state_of(store, "a").newest_valid()
    assert newest is not None and newest[0] == 1
    # The bound this test holds the loop to (the delay, a round, slack for a loaded CI).
    assert time.monotonic() - closed < DELAY_S + 20 and lag < DELAY_S + 20
    res = run_ckptfs("volumes", store.location)
    assert res.stdout.splitlines()[1].split()[:3] == ["a", os.uname().nodename, "1"], res.stdout
    assert sync_published(a).returncode == 0
    before = a.stat()
    a.tier_now("--all")
    st = a.stat()
    assert st["tier_packs_written"] == before["tier_packs_written"], "tiering wrote a pack"
    assert st["cold_logical_bytes"] >= 3 * MiB and st["published_copy_bytes"] == 0, st
    verify(a.path, files)
    a.remount()
    verify(a.path, files)
    fsck_clean(a)


def test_sync_published_waits_for_a_head_naming_every_commit(make_mount, dir_store):
    """`ckptfs sync --published` returns once a head describes everything
    committed before it was asked, even with a long publish_delay."""
    a = node(make_mount, dir_store, "a", "publish_delay=600")
    time.sleep(1)
    write_file(a.path / "f.bin", b"x" * (3 * MiB))
    started = time.monotonic()
    assert sync_published(a).returncode == 0
    assert time.monotonic() - started < 30
    st = a.stat()
    assert st["publish_backlog_bytes"] == 0 and st["publish_lag_s"] == 0, st
    b = make_mount(options=["pmem_size=128M"], start=False)
    a.umount()                      # (the head is there already: nothing more to publish)
    assert recover(b, dir_store, "a").returncode == 0
    b.start(["publish_delay=off", f"backing={dir_store.location}", "volume=a"])
    assert read_file(b.path / "f.bin") == b"x" * (3 * MiB)


def test_a_store_outage_grows_the_lag_never_blocks_writers_and_catches_up(make_mount, store):
    a = node(make_mount, store, "a")
    first = write_version(a.path, 1, size=MiB)
    assert sync_published(a).returncode == 0
    store.down()
    try:
        started = time.monotonic()
        second = write_version(a.path, 2, size=2 * MiB)
        assert time.monotonic() - started < 10, "writers waited for the store"
        wait_until(lambda: a.stat()["publish_last_error"] is not None, 60, "the error shown")
        wait_until(lambda: a.stat()["publish_lag_s"] > DELAY_S + 1, 60, "the lag growing")
        st = a.stat()
        assert st["publish_state"] == "retrying" and st["publish_backlog_bytes"] > 0, st
    finally:
        store.up()
    assert sync_published(a, timeout_s=180).returncode == 0
    st = a.stat()
    assert st["publish_lag_s"] == 0 and st["publish_last_error"] is None, st
    b = restored_on_a_new_node(a, make_mount, store)
    verify(b.path, first)
    verify(b.path, second)


def test_a_round_failing_after_a_covering_head_leaves_no_stale_error(make_mount, store,
                                                                      monkeypatch, tmp_path):
    """A round that fails (the store away) and records its error only after
    another path (here a tiering pass: `ckptfs tier --now --all`) published a
    head covering everything that round had to publish is not the current
    error: `sync --published` returns, and right after it `ckptfs stat`
    shows lag 0 and no error. The round is held between its failure and
    the recording of its error by the debug hook."""
    marker = tmp_path / "round-failed"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"publish-failed:{marker}")
    a = make_mount(options=["pmem_size=128M", f"backing={store.location}", "volume=a",
                            f"publish_delay={DELAY_S:g}"], over_itself=False)  # its log readable
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    first = write_version(a.path, 1, size=MiB)
    assert sync_published(a).returncode == 0
    store.down()
    try:
        second = write_version(a.path, 2, size=MiB)
        wait_until(marker.exists, 120, "a round failed while the store was away")
    finally:
        store.up()
    a.tier_now("--all")             # everything into packs, then a head: it covers
    marker.unlink()                 # the failed round goes on: records its error or not
    daemon_log = a.source / ".ckptfs" / "daemon.log"
    wait_until(lambda: "debug pause at publish-failed over" in daemon_log.read_text(), 30,
             "the failed round went on")
    assert sync_published(a).returncode == 0
    st = a.stat()
    assert st["publish_lag_s"] == 0 and st["publish_last_error"] is None, st
    assert st["publish_state"] == "idle", st
    b = restored_on_a_new_node(a, make_mount, store)
    verify(b.path, first)
    verify(b.path, second)


def test_a_head_of_gc_does_not_count_as_published(make_mount, dir_store, monkeypatch):
    """A head published while commits still wait for their copies (here gc's,
    the publishing loop held by the debug hook after a failed round)
    describes them as not in the store: `sync --published` does not return on
    it, but once the copies and a head naming them are in the store."""
    marker = dir_store.root.parent / "round-failed"
    a = make_mount(options=["pmem_size=128M", f"backing={dir_store.location}", "volume=a",
                            f"publish_delay={DELAY_S:g}"], start=False)
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"publish-failed:{marker}")
    a.start()
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    dir_store.down()
    try:
        second = write_version(a.path, 2, size=MiB)
        wait_until(marker.exists, 120, "a round failed while the store was away")
    finally:
        dir_store.up()
    assert run_ckptfs("gc", str(a.path)).returncode == 0     # a head: the copies still wait
    st = a.stat()
    assert st["publish_backlog_bytes"] > 0 and st["publish_lag_s"] > 0, st
    early = run_ckptfs("sync", "--published", str(a.path), "--timeout", "3", check=False)
    assert early.returncode != 0, "sync --published returned before the copies were made"
    marker.unlink()
    assert sync_published(a).returncode == 0
    st = a.stat()
    assert st["publish_backlog_bytes"] == 0 and st["publish_lag_s"] == 0, st
    b = restored_on_a_new_node(a, make_mount, dir_store)
    verify(b.path, second)


def test_files_adopted_from_source_are_published_and_restored_elsewhere(make_mount, store,
                                                                         tmp_path):
    """A node mounted with a store over a directory that already holds
    checkpoints: those files (adopted, read in place until now) are packed
    into the store too, read beneath SOURCE as the file adopted; `sync
    --published` waits for them, and after the node is gone `ckptfs recover`
    on another SOURCE gives them back byte-exact, with what was written
    through the mount."""
    src = tmp_path / "ckpt0"
    (src / "old" / "deep").mkdir(parents=True)
    adopted = {"old/model.bin": floats(5 * MiB + 12345, 7),     # several packs' worth of cuts
               "old/deep/optim.bin": floats(700 * 1024, 8),
               "old/meta.json": b'{"step": 0}', "top.bin": os.urandom(300 * 1024)}
    for rel, data in adopted.items():
        (src / rel).write_bytes(data)
    os.link(src / "old" / "meta.json", src / "old" / "meta-link.json")
    os.symlink("deep/optim.bin", src / "old" / "optim-link")
    a = make_mount(options=["pmem_size=128M", f"backing={store.location}", "volume=a",
                            f"publish_delay={DELAY_S:g}"], source=src)
    new = write_version(a.path, 1, size=MiB)
    assert sync_published(a).returncode == 0
    st = a.stat()
    assert st["publish_lag_s"] == 0 and st["publish_backlog_bytes"] == 0, st
    assert st["publish_last_error"] is None, st
    verify(a.path, adopted)             # now read from the store, the same bytes
    a.remount()
    verify(a.path, {**adopted, **new})
    a.umount()
    res = a.fsck()
    assert res.returncode == 0, res.stdout + res.stderr
    shutil.rmtree(a.source)                 # the node is gone, with SOURCE's disk
    b = make_mount(options=["pmem_size=128M"], start=False)
    res = recover(b, store, "a")
    assert res.returncode == 0, res.stdout + res.stderr
    b.start([f"backing={store.location}", "volume=a", "publish_delay=off"])
    verify(b.path, {**adopted, **new})
    assert read_file(b.path / "old" / "meta-link.json") == adopted["old/meta.json"]
    assert os.stat(b.path / "old" / "meta-link.json").st_ino == \
        os.stat(b.path / "old" / "meta.json").st_ino
    assert os.readlink(b.path / "old" / "optim-link") == "deep/optim.bin"


def test_an_adopted_file_open_while_it_is_packed_keeps_its_changes(make_mount, dir_store,
                                                                  tmp_path):
    """An adopted file open for reading and another with uncommitted changes
    while publishing packs them: the reader reads the same bytes throughout,
    the writer's change commits over the packed extents, and the result is
    what recover elsewhere restores."""
    src = tmp_path / "ckpt0"
    src.mkdir()
    data = floats(3 * MiB, 11)
    (src / "read.bin").write_bytes(data)
    (src / "write.bin").write_bytes(data)
    a = make_mount(options=["pmem_size=128M", f"backing={dir_store.location}", "volume=a"],
                   source=src, start=False)
    a.start(["publish_delay=off"])      # adopted, not published yet
    a.umount()
    a.start([f"publish_delay={DELAY_S:g}"])
    with open(a.path / "read.bin", "rb") as r, open(a.path / "write.bin", "r+b") as w:
        assert r.read(MiB) == data[:MiB]
        w.seek(MiB + 100)
        w.write(b"changed while packed")
        w.flush()                       # to the daemon, not committed: still open
        wait_until(lambda: a.stat()["source_bytes"] == 0, 120, "the adopted files packed")
        assert r.read() == data[MiB:]
    changed = data[:MiB + 100] + b"changed while packed" + data[MiB + 120:]
    assert read_file(a.path / "write.bin") == changed
    assert sync_published(a).returncode == 0
    a.remount()
    verify(a.path, {"read.bin": data, "write.bin": changed})
    b = restored_on_a_new_node(a, make_mount, dir_store)
    verify(b.path, {"read.bin": data, "write.bin": changed})


def test_an_adopted_file_reached_through_a_symlink_is_not_read(make_mount, dir_store,
                                                               tmp_path):
    """Publishing reads an original only beneath SOURCE with no symlink on the
    way: a directory swapped for a symlink (to a file only root should read)
    before the mount is refused, logged, and never copied to the store; the
    other adopted files are published."""
    src = tmp_path / "ckpt0"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.bin").write_bytes(b"adopted" * 1000)
    (src / "ok.bin").write_bytes(b"fine" * 1000)
    a = make_mount(options=["pmem_size=128M", f"backing={dir_store.location}", "volume=a"],
                   source=src, start=False)
    a.start(["publish_delay=off"])      # adopted, not published yet
    a.umount()
    secret = tmp_path / "secret"
    secret.mkdir()
    secret_bytes = os.urandom(7000)     # incompressible: a pack would hold it as it is
    (secret / "f.bin").write_bytes(secret_bytes)
    os.rename(src / "d", tmp_path / "d-moved")
    os.symlink(secret, src / "d")
    a.start([f"publish_delay={DELAY_S:g}"])
    assert sync_published(a).returncode == 0
    assert read_file(a.path / "ok.bin") == b"fine" * 1000
    for path in dir_store.root.rglob("*"):
        if path.is_file():
            assert secret_bytes[1000:1100] not in path.read_bytes(), path
    gone(a)
    b = make_mount(options=["pmem_size=128M"], start=False)
    res = recover(b, dir_store, "a")
    assert res.returncode == 4 and "d/f.bin" in res.stdout, res.stdout + res.stderr
    b.start([f"backing={dir_store.location}", "volume=a", "publish_delay=off"])
    assert read_file(b.path / "ok.bin") == b"fine" * 1000


# ------------------------------------------------------- restore on another node

def test_restore_elsewhere_after_the_node_is_gone(make_mount, store, fsck_clean):
    """kill -9 of a node, its log and index deleted: another node recovers the
    volume from the store alone, every byte of its newest published version,
    takes it over and goes on saving there."""
    a = node(make_mount, store, "a")
    versions = {}
    for step in (1, 2):
        versions.update(write_version(a.path, step, size=2 * MiB))
    assert sync_published(a).returncode == 0
    gone(a)
    b = make_mount(options=["pmem_size=128M"], start=False)
    res = recover(b, store, "a")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "volume a" in res.stdout
    b.options += [f"backing={store.location}", "volume=a", f"publish_delay={DELAY_S:g}"]
    b.start()
    verify(b.path, versions)
    st = b.stat()
    assert st["volume"] == "a" and st["volume_generation"] == 2, st
    third = write_version(b.path, 3, size=MiB)
    assert sync_published(b).returncode == 0
    state = state_of(store, "a")
    assert state.generation == 2 and state.newest_valid()[0] == 2
    b.remount()
    verify(b.path, {**versions, **third})
    fsck_clean(b)


def test_takeover_fences_the_old_node(make_mount, dir_store):
    """The node that takes a volume over creates the next lease; the old one,
    still running, finds it before its next publish: it turns read-only, says
    why, never publishes again, and a remount of it stays read-only."""
    a = node(make_mount, dir_store, "a")
    first = write_version(a.path, 1, size=MiB)
    assert sync_published(a).returncode == 0
    b = make_mount(options=["pmem_size=128M"], start=False)
    assert recover(b, dir_store, "a").returncode == 0
    b.options += [f"backing={dir_store.location}", "volume=a", f"publish_delay={DELAY_S:g}"]
    b.start()
    base = state_of(dir_store, "a").leases[-1].base
    # The old node saves again: committed locally, but never published.
    write_file(a.path / "late.bin", b"late" * 1000)
    wait_until(lambda: a.stat()["read_only"], 60, "the old node read-only")
    st = a.stat()
    assert st["volume_fenced"] and "taken over" in st["last_error"], st
    with pytest.raises(OSError) as e:
        write_file(a.path / "later.bin", b"x")
    assert e.value.errno == 30                                      # EROFS
    state = state_of(dir_store, "a")
    assert all(h <= base for h in state.valid_heads() if h[0] == 1), state
    assert not any(h[0] == 1 and h > base for h in state.valid_heads())
    # The new holder publishes; its state never has the old node's late file.
    write_file(b.path / "new.bin", b"new")
    assert sync_published(b).returncode == 0
    assert not (b.path / "late.bin").exists()
    verify(b.path, first)
    a.umount()
    res = subprocess.run(a.mount_argv(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "taken over" in res.stderr, res.stderr
    assert a.stat()["read_only"]
    a.umount()
    assert state_of(dir_store, "a").newest_valid()[0] == 2


def test_takeover_is_refused_when_the_volume_moved_on(make_mount, dir_store):
    """A filesystem recovered from head H does not take the volume over once
    the volume published a newer head: it would discard that newer state."""
    a = node(make_mount, dir_store, "a")
    write_version(a.path, 1, size=MiB)
    assert sync_published(a).returncode == 0
    b = make_mount(options=["pmem_size=128M"], start=False)
    assert recover(b, dir_store, "a").returncode == 0
    write_version(a.path, 2, size=MiB)
    assert sync_published(a).returncode == 0
    res = subprocess.run(b.mount_argv([f"backing={dir_store.location}", "volume=a"]),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and not is_mounted(b.path)
    assert len(res.stderr.strip().splitlines()) == 1 and "recover again" in res.stderr, res.stderr
    assert state_of(dir_store, "a").generation == 1                 # no lease was taken
    assert not a.stat()["read_only"]


def test_a_volume_name_in_use_is_refused(make_mount, store):
    a = node(make_mount, store, "a")
    c = node(make_mount, store, "a", start=False)
    res = subprocess.run(c.mount_argv(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and not is_mounted(c.path), res
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "volume a" in res.stderr and "in use" in res.stderr, res.stderr
    assert [lease.gen for lease in state_of(store, "a").leases] == [1]
    assert not (c.source / ".ckptfs" / "index").exists()           # the attempt left nothing
    c.options[-2] = "volume=c"
    c.start()
    res = run_ckptfs("volumes", store.location, "--json")
    import json
    assert sorted(v["volume"] for v in json.loads(res.stdout)) == ["a", "c"]
    assert not a.stat()["read_only"]


# ------------------------------------------------------------------ crash windows

def test_sigkill_while_a_copy_is_written_loses_nothing(make_mount, dir_store, monkeypatch,
                                                       tmp_path, fsck_clean):
    """kill -9 with a published copy's pack in the store but not yet named by
    the index (the mover's pause hook holds it there): the next mount undoes
    the leftover, every file is still hot, and publishing completes."""
    marker = tmp_path / "paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"pack-written:{marker}")
    a = node(make_mount, dir_store, "a", "tiering=on", "hot_versions=100")
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    files = write_version(a.path, 1, size=2 * MiB)
    wait_until(marker.exists, 60, "the copy paused after its pack was written")
    a.kill()
    a.start()
    verify(a.path, files)
    assert sync_published(a).returncode == 0
    st = a.stat()
    assert st["publish_backlog_bytes"] == 0 and st["cold_bytes"] == 0, st
    a.umount()
    assert a.fsck().returncode == 0
    b = make_mount(options=["pmem_size=128M"], start=False)
    assert recover(b, dir_store, "a").returncode == 0
    b.start([f"backing={dir_store.location}", "volume=a", "publish_delay=off"])
    verify(b.path, files)
    fsck_clean(b)


def test_a_tiering_pass_during_a_copy_packs_nothing_twice(make_mount, dir_store, monkeypatch,
                                                          tmp_path, fsck_clean):
    """A tiering pass begun while a publishing round writes its copies (the
    mover's pause hook holds that copy half written) waits for the round and
    then only drops the log copies: it writes no pack of its own. Before, it
    packed the same chunks again, a dead second copy that took the store's
    room (a 40 MiB store then gave writers ENOSPC)."""
    marker = tmp_path / "paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"pack-writing:{marker}")
    a = node(make_mount, dir_store, "a", "hot_versions=100")
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    files = write_version(a.path, 1, size=8 * MiB)
    wait_until(marker.exists, 60, "the round's copy paused half written")
    tier = subprocess.Popen(CKPTFS + ["tier", str(a.path), "--now", "--all"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: a.stat()["tier_state"] == "moving", 60, "the pass began")
        time.sleep(1)               # long enough for a pass that does not wait to plan
        marker.unlink()
        out, err = tier.communicate(timeout=300)
    finally:
        tier.kill()
    assert tier.returncode == 0, err
    st = a.stat()
    assert st["tier_packs_written"] == 0, st
    assert st["cold_bytes"] > 0 and st["publish_backlog_bytes"] == 0, st
    verify(a.path, files)
    a.umount()
    fsck_clean(a)


def test_an_index_from_before_publishing_publishes_its_hot_data(make_mount, dir_store):
    """An index of format 4 (no copies, no unpublished table) is upgraded at
    mount: every chunk still in its log is published, so the node can go."""
    from ckptfs import index as ix
    from ckptfs.index import Index
    a = node(make_mount, dir_store, "a", start=False)
    a.options[a.options.index(f"publish_delay={DELAY_S:g}")] = "publish_delay=off"
    a.start()
    files = write_version(a.path, 1, size=2 * MiB)
    a.umount()
    index = Index(str(a.source / ".ckptfs" / "index"))
    try:
        def to_format_4(txn):
            for no in ix.scan_unpublished(txn):
                ix.set_unpublished(txn, no, False)
            txn._put("meta", b"format", (4).to_bytes(4, "little"))
        index.write_direct(to_format_4)
    finally:
        index.close()
    a.options[a.options.index("publish_delay=off")] = f"publish_delay={DELAY_S:g}"
    a.start()
    assert sync_published(a).returncode == 0
    assert a.stat()["publish_backlog_bytes"] == 0
    b = restored_on_a_new_node(a, make_mount, dir_store)
    verify(b.path, files)


def test_an_index_of_format_3_keeps_its_adopted_files(make_mount, tmp_path):
    """Upgrading a format 3 index (adopted files with their identity recorded)
    must not read that identity as part of the file's path: the adopted file
    reads back, and is not reported as changed below the mount."""
    from ckptfs.index import Index
    src = tmp_path / "adopted"
    src.mkdir()
    write_file(src / "before.bin", b"there before ckptfs" * 1000)
    m = make_mount(options=["pmem_size=64M", "tiering=off"], source=src)
    m.umount()
    index = Index(str(src / ".ckptfs" / "index"))
    try:
        def to_format_3(txn):
            for name in (b"files", b"file_bytes"):
                txn._delete("meta", name)
            txn._put("meta", b"format", (3).to_bytes(4, "little"))
        index.write_direct(to_format_3)
    finally:
        index.close()
    m.start()
    assert read_file(m.path / "before.bin") == b"there before ckptfs" * 1000
    m.umount()
    assert m.fsck().returncode == 0
    from ckptfs import index as ix
    index = Index(str(src / ".ckptfs" / "index"))
    try:
        assert [c.source_path for c in ix.scan_chunks(index)] == [b"before.bin"]
    finally:
        index.close()


@pytest.mark.cluster
def test_three_nodes_save_every_10_s_and_one_is_restored_elsewhere(make_mount, rgw, tmp_path,
                                                                    monkeypatch):
    """Three nodes on one RGW save a version every 10 s; each save is
    published within the delay (plus a round); then node 0 is killed, its log
    and index deleted, and its volume restored on a spare: every byte of its
    newest published version."""
    import threading
    store = S3Store(tmp_path, monkeypatch, rgw)
    try:
        nodes = [node(make_mount, store, f"n{i}") for i in range(3)]
        saved: list[dict[str, bytes]] = [{} for _ in nodes]
        lags: list[float] = []
        errors: list[BaseException] = []

        def saver(i: int) -> None:
            try:
                start = time.monotonic()
                for step in range(3):
                    saved[i].update(write_version(nodes[i].path, step, size=4 * MiB))
                    lags.append(wait_until(lambda: (lambda st: st["publish_lag_s"] == 0 and
                                                  st["publish_backlog_bytes"] == 0)(
                                                      nodes[i].stat()), 120, "published"))
                    time.sleep(max(0.0, start + (step + 1) * 10 - time.monotonic()))
            except BaseException as e:       # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=saver, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert max(lags) < DELAY_S + 20, lags
        gone(nodes[0])
        spare = make_mount(options=["pmem_size=128M"], start=False)
        assert recover(spare, store, "n0").returncode == 0
        spare.start([f"backing={store.location}", "volume=n0", "publish_delay=off"])
        verify(spare.path, saved[0])
        for m in nodes[1:] + [spare]:
            m.umount()
        with store.open() as backend:
            assert volumes.volume_names(backend) == ["n0", "n1", "n2"]
    finally:
        store.close()
