"""Backing stores: one conformance suite run against every backend, then the
local backend's own rules and the fault injector.

Each backend kind has a *harness* that knows how to make a store of that kind
and how to put it in the states the suite needs (gone, read-only, full). The
conformance tests only talk to the `Backend` interface and the harness; to run
them against another backend, add a harness to `HARNESSES`: the local directory,
the fault injector with no fault set, the daemon's directory-fd store
(`FdRootBackend`) and S3.

Read-only and full stores use small tmpfs mounts (needs root: skipped, with
the reason, otherwise); every mount is undone in a `finally`. The S3 harness
runs against a real Ceph RADOS Gateway (the session's `rgw` fixture): a fresh
bucket per store, a read-only key pair for a read-only store, a 1 MiB bucket
quota for a full one.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import random
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import botocore.session
import pytest
from botocore.exceptions import ClientError

from ckptfs.backing import LocalBackend, open_backend
from ckptfs.backing import local as local_backing
from ckptfs.backing.base import MARKER_NAME, SPAN_ALIGN, Backend
from ckptfs.backing.faulty import FaultyBackend
from ckptfs.backing.fdroot import FdRootBackend
from ckptfs.backing.s3 import S3Backend
from ckptfs.mounts import is_mountpoint
from ckptfs.errors import (AlreadyExists, BackingError, BackingFull, BackingReadOnly,
                           BackingUnavailable, BlobDamaged, BlobMissing, InvalidArgument,
                           UsageError)

KIB = 1024
MIB = 1024 * KIB


# -- mounts ------------------------------------------------------------------------------

def _is_mountpoint(path: Path) -> bool:
    return is_mountpoint(str(path))


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` on `path`; skips the test when mounting is not possible."""
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                          str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        why = (res.stderr.strip().splitlines() or ["mount failed"])[0]
        pytest.skip(f"cannot mount a tmpfs (needs root): {why}")
    try:
        yield path
    finally:
        for args in (["umount", str(path)], ["umount", "-l", str(path)]):
            if not _is_mountpoint(path):
                break
            subprocess.run(args, capture_output=True)
        assert not _is_mountpoint(path), f"could not unmount {path}"


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True,
                   capture_output=True)


# -- harnesses -----------------------------------------------------------------------------

class LocalHarness:
    """LocalBackend in pytest's tmp dir; fd cache of 4 so eviction is exercised."""

    id = "local"

    def __init__(self, base: Path) -> None:
        self.base = base
        self.made: list[Backend] = []

    def _new(self, root: Path, **kw) -> Backend:
        b = LocalBackend.create(root, **kw)
        b.max_open_files = 4
        self.made.append(b)
        return b

    def wrap(self, backend: Backend) -> Backend:
        return backend

    def local(self, backend: Backend) -> LocalBackend:
        return backend.inner if isinstance(backend, FaultyBackend) else backend  # type: ignore

    def make(self, sub: str = "store") -> Backend:
        return self.wrap(self._new(self.base / sub))

    def reopen(self, backend: Backend, store_uuid=None) -> Backend:
        """Another handle on the same store (another process, after a restart)."""
        lb = self.local(backend)
        b = LocalBackend(lb.root, store_uuid or lb.store_uuid)
        self.made.append(b)
        return self.wrap(b)

    def path(self, backend: Backend) -> str:
        """Where the store's directory is (its real path)."""
        return self.local(backend).root

    def vanish(self, backend: Backend) -> None:
        """The store's directory is gone."""
        shutil.rmtree(self.path(backend))

    def unmount(self, backend: Backend) -> None:
        """The store's filesystem is gone, its empty mountpoint left behind."""
        root = Path(self.path(backend))
        shutil.rmtree(root)
        root.mkdir()

    def assert_not_recreated(self, backend: Backend, was_empty_dir: bool) -> None:
        root = Path(self.path(backend))
        if was_empty_dir:
            assert root.is_dir() and list(root.iterdir()) == [], "store recreated"
        else:
            assert not root.exists(), "store directory recreated"

    def leftovers(self, backend: Backend) -> list[str]:
        """Traces of uncommitted blobs (temp files)."""
        root = self.path(backend)
        out = []
        for dirpath, _dirs, files in os.walk(root):
            out += [os.path.join(dirpath, f) for f in files if f.startswith(".")]
        return out

    @contextlib.contextmanager
    def readonly_store(self, seed: dict[str, bytes]) -> Iterator[Backend]:
        """A store holding `seed`, whose filesystem is then remounted read-only."""
        mnt = self.base / "ro-mnt"
        with tmpfs(mnt, "8m"):
            b = self._new(mnt / "store")
            for name, data in seed.items():
                put(b, name, data)
            remount(mnt, "ro")
            try:
                yield self.wrap(b)
            finally:
                b.close()
                remount(mnt, "rw")

    @contextlib.contextmanager
    def full_store(self) -> Iterator[Backend]:
        """A store with about 1 MiB of room."""
        with tmpfs(self.base / "full-mnt", "1m") as mnt:
            b = self._new(mnt / "store")
            try:
                yield self.wrap(b)
            finally:
                b.close()

    def close(self) -> None:
        for b in self.made:
            b.close()


class FaultyLocalHarness(LocalHarness):
    """The fault injector with no fault set must be a conforming backend too."""

    id = "faulty(local)"

    def wrap(self, backend: Backend) -> Backend:
        return FaultyBackend(backend)


class FdRootHarness(LocalHarness):
    """FdRootBackend (the daemon's store below its own mount): the store made at a
    path, then reached through a directory fd opened on it, as the daemon does."""

    id = "fdroot"

    def _new(self, root: Path, **kw) -> Backend:
        made = LocalBackend.create(root, **kw)
        made.close()
        b = FdRootBackend.open_dir(str(root), made.store_uuid, max_open_files=4)
        self.made.append(b)
        return b

    def path(self, backend: Backend) -> str:
        return self.local(backend).shown_as

    def reopen(self, backend: Backend, store_uuid=None) -> Backend:
        fd_root = self.local(backend)
        try:
            b = FdRootBackend.open_dir(fd_root.shown_as, store_uuid or fd_root.store_uuid)
        except FileNotFoundError:        # gone: what the daemon sees is a store it cannot reach
            b = LocalBackend(fd_root.shown_as, store_uuid or fd_root.store_uuid)
        self.made.append(b)
        return self.wrap(b)


class S3Harness:
    """S3Backend on the test RGW: each store a fresh bucket (prefix "store"),
    reached through an AWS profile in shared config files, the standard way.
    Parts of 64 KiB (the test RGW allows them) so multipart uploads are
    exercised by every blob over 64 KiB."""

    id = "s3"
    needs_rgw = True
    PART_BYTES = 64 * KIB
    reads_per_thread = 100           # a GET each: keeps the default run short

    def __init__(self, base: Path, rgw) -> None:
        self.base = base
        self.rgw = rgw
        self.made: list[Backend] = []
        self.buckets: list[str] = []
        self.admin = s3_client(rgw)

    def session(self, read_only: bool = False):
        return s3_session(self.rgw, read_only)

    def _backend(self, url: str, store_uuid=None, read_only: bool = False,
                 create: bool = False) -> Backend:
        kw = dict(session=self.session(read_only), part_size_bytes=self.PART_BYTES,
                  connect_timeout_s=2, read_timeout_s=10, max_attempts=2)
        b = S3Backend.create(url, store_uuid, **kw) if create else S3Backend(url, store_uuid,
                                                                              **kw)
        self.made.append(b)
        return b

    def new_bucket(self) -> str:
        name = f"ckptfs-t-{uuid.uuid4().hex[:16]}"
        self.admin.create_bucket(Bucket=name)
        self.buckets.append(name)
        return name

    def make(self, sub: str = "store") -> Backend:
        return self._backend(f"s3://{self.new_bucket()}/{sub}", create=True)

    def reopen(self, backend: Backend, store_uuid=None) -> Backend:
        return self._backend(backend.url, store_uuid or backend.store_uuid)

    def keys(self, backend: Backend) -> list[str]:
        pages = self.admin.get_paginator("list_objects_v2").paginate(
            Bucket=backend.bucket, Prefix=backend.prefix + "/")
        return [o["Key"] for p in pages for o in p.get("Contents", ())]

    def uploads(self, backend: Backend) -> list[tuple[str, str]]:
        resp = self.admin.list_multipart_uploads(Bucket=backend.bucket)
        return [(u["Key"], u["UploadId"]) for u in resp.get("Uploads", ())]

    def empty(self, bucket: str) -> None:
        for key, upload in self.uploads(S3Backend(f"s3://{bucket}")):
            self.admin.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        pages = self.admin.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for key in [o["Key"] for p in pages for o in p.get("Contents", ())]:
            self.admin.delete_object(Bucket=bucket, Key=key)

    def vanish(self, backend: Backend) -> None:
        """The bucket is gone."""
        self.empty(backend.bucket)
        self.admin.delete_bucket(Bucket=backend.bucket)

    def unmount(self, backend: Backend) -> None:
        """Every object of the store is gone, the bucket left behind."""
        self.empty(backend.bucket)

    def assert_not_recreated(self, backend: Backend, was_empty_dir: bool) -> None:
        if was_empty_dir:
            assert self.keys(backend) == [] and self.uploads(backend) == [], "store recreated"
        else:
            with pytest.raises(ClientError, match="404|NoSuchBucket|Not Found"):
                self.admin.head_bucket(Bucket=backend.bucket)

    def leftovers(self, backend: Backend) -> list[str]:
        """Traces of uncommitted blobs: multipart uploads, probes."""
        return [k for k, _ in self.uploads(backend)] + \
            [k for k in self.keys(backend) if "/." in k]

    @contextlib.contextmanager
    def readonly_store(self, seed: dict[str, bytes]) -> Iterator[Backend]:
        """A store holding `seed`, reached with a key pair that may only read."""
        b = self.make()
        for name, data in seed.items():
            put(b, name, data)
        yield self._backend(b.url, b.store_uuid, read_only=True)

    @contextlib.contextmanager
    def full_store(self) -> Iterator[Backend]:
        """A store in a bucket with a quota of 1 MiB."""
        b = self.make()
        self.rgw.admin("quota", "set", "--quota-scope=bucket", f"--bucket={b.bucket}",
                       "--max-size=1048576")
        self.rgw.admin("quota", "enable", "--quota-scope=bucket", f"--bucket={b.bucket}")
        yield b

    def close(self) -> None:
        for b in self.made:
            b.close()
        for bucket in self.buckets:
            try:
                self.empty(bucket)
                self.admin.delete_bucket(Bucket=bucket)
            except ClientError:
                pass                             # vanished by the test itself


_SESSIONS: dict = {}


def s3_session(rgw, read_only: bool = False):
    """A botocore session reading the test RGW's AWS config and credentials
    files, profile ckptfs-rgw (or ckptfs-rgw-ro); one per kind, since loading
    the S3 model is slow."""
    key = (rgw.state_dir, read_only)
    if key not in _SESSIONS:
        config, creds = rgw.write_aws_files()
        sess = botocore.session.Session(profile="ckptfs-rgw-ro" if read_only else "ckptfs-rgw")
        sess.set_config_variable("config_file", config)
        sess.set_config_variable("credentials_file", creds)
        _SESSIONS[key] = sess
    return _SESSIONS[key]


def s3_client(rgw):
    return s3_session(rgw).create_client("s3")


HARNESSES = [LocalHarness, FaultyLocalHarness, FdRootHarness, S3Harness]


@pytest.fixture(params=HARNESSES, ids=lambda h: h.id)
def harness(request, tmp_path):
    if getattr(request.param, "needs_rgw", False):
        h = request.param(tmp_path, request.getfixturevalue("rgw"))
    else:
        h = request.param(tmp_path)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def store(harness) -> Backend:
    return harness.make()


def put(backend: Backend, name: str, data: bytes) -> None:
    with backend.writer(name) as w:
        w.write(data)
        w.commit()


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


PACK_NAME = "packs/ab/" + "ab" * 32 + ".pack"


# -- conformance ---------------------------------------------------------------------------

def test_round_trip_size_and_url(store):
    data = blob(300 * KIB + 7)
    put(store, PACK_NAME, data)
    assert store.size(PACK_NAME) == len(data)
    assert store.read(PACK_NAME, 0, len(data)) == data
    assert store.list() == [PACK_NAME]
    assert isinstance(store.url, str) and store.url
    store.check()


def test_write_in_pieces_and_buffer_types(store):
    w = store.writer("m/x.bin")
    w.write(b"ab")
    w.write(bytearray(b"cd"))
    w.write(memoryview(b"--ef--")[2:4])
    w.write(memoryview(bytes(range(8))).cast("Q"))        # non-byte format: written as bytes
    w.write(b"")
    w.commit()
    assert w.committed
    assert store.read("m/x.bin", 0, 14) == b"abcdef" + bytes(range(8))


def test_nothing_visible_before_commit(store, harness):
    other = harness.reopen(store)
    w = store.writer(PACK_NAME)
    w.write(blob(64 * KIB))
    for b in (store, other):
        assert b.list() == []
        with pytest.raises(BlobMissing):
            b.size(PACK_NAME)
        with pytest.raises(BlobMissing):
            b.read(PACK_NAME, 0, 1)
    w.commit()
    assert other.list() == [PACK_NAME]
    assert other.read(PACK_NAME, 0, 64 * KIB) == blob(64 * KIB)


def test_abort_leaves_nothing(store, harness):
    w = store.writer(PACK_NAME)
    w.write(blob(100 * KIB))
    w.abort()
    w.abort()                                              # idempotent
    assert not w.committed
    assert store.list() == []
    assert harness.leftovers(store) == []
    with pytest.raises(InvalidArgument):
        w.write(b"x")
    with pytest.raises(InvalidArgument):
        w.commit()


def test_context_manager_aborts_unless_committed(store, harness):
    with pytest.raises(RuntimeError):
        with store.writer(PACK_NAME) as w:
            w.write(b"half a pack")
            raise RuntimeError("the tiering task died")
    with store.writer("m/b") as w:
        w.write(b"not committed either")
    assert store.list() == []
    assert harness.leftovers(store) == []


def test_crash_mid_write_leaves_no_visible_blob(store, harness):
    put(store, "m/old", b"committed")
    w = store.writer(PACK_NAME)                            # the writer "crashes": never committed
    w.write(blob(200 * KIB))
    after_restart = harness.reopen(store)
    assert after_restart.list() == ["m/old"]
    with pytest.raises(BlobMissing):
        after_restart.read(PACK_NAME, 0, 1)
    assert after_restart.remove_incomplete(older_than=3600) == 0   # too young to sweep
    traces = len(harness.leftovers(store))
    assert after_restart.remove_incomplete(older_than=0) == traces
    assert harness.leftovers(store) == []
    assert after_restart.list() == ["m/old"]
    with pytest.raises(BackingError):                      # its temp is gone: commit fails
        w.commit()
    assert after_restart.list() == ["m/old"]


def test_remove_incomplete_of_one_name_after_a_crash(store, harness):
    """The leftovers of one blob's interrupted write go, however young; the
    writes of other names (other writers, other filesystems) are left alone."""
    other = "packs/ab/" + "cd" * 32 + ".pack"
    crashed = store.writer(PACK_NAME)
    crashed.write(blob(200 * KIB))
    busy = store.writer(other)                             # still being written
    busy.write(blob(200 * KIB, 1))
    after_restart = harness.reopen(store)
    before = len(harness.leftovers(store))
    removed = after_restart.remove_incomplete_of(PACK_NAME)
    assert len(harness.leftovers(store)) == before - removed
    assert removed == (1 if before else 0)
    assert after_restart.remove_incomplete_of(PACK_NAME) == 0
    assert after_restart.remove_incomplete_of("packs/ef/nothing.pack") == 0
    busy.commit()
    assert after_restart.list() == [other]


def test_commit_replaces_a_name_atomically(store):
    put(store, "manifests/m.json", b"version 1")
    assert store.read("manifests/m.json", 0, 9) == b"version 1"     # caches an fd
    put(store, "manifests/m.json", b"version two")
    assert store.size("manifests/m.json") == 11
    assert store.read("manifests/m.json", 0, 11) == b"version two"
    assert store.list() == ["manifests/m.json"]


def test_read_exact_ranges(store):
    data = blob(MIB + 13, seed=1)
    put(store, PACK_NAME, data)
    rng = random.Random(2)
    ranges = [(0, 0), (0, 1), (len(data) - 1, 1), (len(data), 0), (0, len(data)),
              (65536, 65536), (MIB, 13)]
    ranges += [(o, rng.randrange(len(data) - o + 1))
               for o in (rng.randrange(len(data)) for _ in range(50))]
    for off, length in ranges:
        got = store.read(PACK_NAME, off, length)
        assert isinstance(got, bytes) and got == data[off:off + length], (off, length)
        into = bytearray(b"\xee" * (length + 2))
        store.read_into(PACK_NAME, off, memoryview(into)[1:length + 1])
        assert into == b"\xee" + data[off:off + length] + b"\xee", (off, length)
        span = mmap.mmap(-1, length + 2 * SPAN_ALIGN)
        start = store.read_span_into(PACK_NAME, off, length, memoryview(span))
        assert span[start:start + length] == data[off:off + length], (off, length)


def test_read_past_end_raises(store):
    put(store, "m/ten", b"0123456789")
    for off, length in ((0, 11), (5, 6), (10, 1), (11, 0), (1000, 5)):
        with pytest.raises(BlobDamaged, match="m/ten"):
            store.read("m/ten", off, length)
        with pytest.raises(BlobDamaged, match="m/ten"):
            store.read_into("m/ten", off, memoryview(bytearray(length)))
    for off, length in ((-1, 1), (0, -1)):
        with pytest.raises(InvalidArgument):
            store.read("m/ten", off, length)


def test_missing_blob(store):
    put(store, "m/there", b"x")
    with pytest.raises(BlobMissing, match="m/gone"):
        store.read("m/gone", 0, 1)
    with pytest.raises(BlobMissing, match="m/gone"):
        store.read_into("m/gone", 0, memoryview(bytearray(1)))
    with pytest.raises(BlobMissing):
        store.size("m/gone")
    with pytest.raises(BlobMissing):
        store.size("m")                                    # a "directory" is not a blob
    store.delete("m/gone")                                 # missing is fine
    store.delete("nodir/gone")


def test_list_and_delete(store):
    names = ["packs/ab/ab01.pack", "packs/ab/ab02.pack", "packs/ac/ac01.pack",
             "packs/b0/b001.pack", "manifests/1.json", "top"]
    for i, n in enumerate(names):
        put(store, n, n.encode() * (i + 1))
    assert store.list() == sorted(names)
    assert store.list("packs/") == sorted(n for n in names if n.startswith("packs/"))
    assert store.list("packs/a") == ["packs/ab/ab01.pack", "packs/ab/ab02.pack",
                                     "packs/ac/ac01.pack"]
    assert store.list("packs/ab/") == ["packs/ab/ab01.pack", "packs/ab/ab02.pack"]
    assert store.list("packs/ab/ab02") == ["packs/ab/ab02.pack"]
    assert store.list("t") == ["top"]
    assert store.list("nope/") == [] and store.list("packs/zz/") == []
    assert MARKER_NAME not in store.list()
    store.read("packs/ab/ab01.pack", 0, 3)                 # cached fd, then deleted
    store.delete("packs/ab/ab01.pack")
    store.delete("packs/ab/ab01.pack")
    with pytest.raises(BlobMissing):
        store.read("packs/ab/ab01.pack", 0, 3)
    store.delete("top")
    assert store.list() == sorted(set(names) - {"packs/ab/ab01.pack", "top"})
    put(store, "packs/ab/ab01.pack", b"again")             # a deleted name can be reused
    assert store.read("packs/ab/ab01.pack", 0, 5) == b"again"


def run_threads(fn, n: int) -> None:
    """fn(0) .. fn(n - 1) on n threads at once; what any of them raised fails the test."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:                       # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_concurrent_reads(store, harness):
    blobs = {f"packs/{i % 7:02x}/{i:04x}.pack": blob(64 * KIB + i * 977, seed=i)
             for i in range(24)}                           # more blobs than cached fds
    for n, d in blobs.items():
        put(store, n, d)
    names = sorted(blobs)

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(getattr(harness, "reads_per_thread", 400)):
            n = rng.choice(names)
            d = blobs[n]
            off = rng.randrange(len(d))
            length = rng.randrange(min(len(d) - off, 32 * KIB) + 1)
            got = store.read(n, off, length)
            assert got == d[off:off + length], (n, off, length)

    run_threads(reader, 8)


def test_concurrent_writers(store):
    def writer(i: int) -> None:
        for j in range(10):
            put(store, f"packs/{i:02x}/{j:04x}.pack", blob(10 * KIB, seed=i * 100 + j))
            put(store, "manifests/shared.json", f"{i} {j}".encode())   # last one wins

    run_threads(writer, 6)
    assert len(store.list("packs/")) == 60
    for i in range(6):
        assert store.read(f"packs/{i:02x}/0009.pack", 0, 10 * KIB) == blob(10 * KIB, i * 100 + 9)
    shared = store.read("manifests/shared.json", 0, store.size("manifests/shared.json"))
    assert shared.decode().split() in [[str(i), "9"] for i in range(6)]


BATCH_NAMES = [f"objects/{i % 5:02x}/{i:064x}" for i in range(24)]


def _put_batch(batch, names) -> None:
    """`put` from four threads at once, as the snapshot writer does."""
    def putter(k: int) -> None:
        for n in names[k::4]:
            batch.put(n, blob(300 + 7 * names.index(n), seed=names.index(n)))

    run_threads(putter, 4)


def _absent_or_whole(backend: Backend, names) -> list[str]:
    """The names visible in `backend`; each one must read whole."""
    seen = []
    for i, n in enumerate(names):
        try:
            size = backend.size(n)
        except BlobMissing:
            continue
        assert size == 300 + 7 * i and backend.read(n, 0, size) == blob(size, seed=i), n
        seen.append(n)
    return seen


def test_batch_is_visible_and_durable_after_sync(store, harness):
    other = harness.reopen(store)
    batch = store.batch()
    _put_batch(batch, BATCH_NAMES)
    batch.sync()
    assert other.list("objects/") == sorted(BATCH_NAMES)
    assert _absent_or_whole(other, BATCH_NAMES) == BATCH_NAMES
    assert harness.leftovers(store) == []
    batch.sync()                                           # nothing left: no-op
    store.batch().sync()


def test_batch_killed_before_sync_shows_no_torn_blob(store, harness):
    """The writer dies between its puts and the sync: every name is absent or
    whole (a directory store shows none), the leftovers go with
    remove_incomplete."""
    batch = store.batch()
    _put_batch(batch, BATCH_NAMES)
    after_restart = harness.reopen(store)
    seen = _absent_or_whole(after_restart, BATCH_NAMES)
    if isinstance(store, LocalBackend):                    # and FdRootBackend
        assert seen == [], "a directory store shows a batch's blobs only after its sync"
    assert after_restart.list("objects/") == sorted(seen)
    after_restart.remove_incomplete(older_than=0)
    assert harness.leftovers(store) == []
    assert _absent_or_whole(after_restart, BATCH_NAMES) == seen


def test_batch_abort_leaves_no_temporaries(store, harness):
    batch = store.batch()
    _put_batch(batch, BATCH_NAMES)
    batch.abort()
    batch.abort()                                          # idempotent
    assert harness.leftovers(store) == []
    assert store.list("objects/") == sorted(_absent_or_whole(store, BATCH_NAMES))


def test_create_once(store):
    """A name is made once; a second writer finds it taken and changes nothing."""
    name = "volumes/v1/lease/0000000000000001"
    assert store.create_once(name, b"first holder")
    assert store.read(name, 0, store.size(name)) == b"first holder"
    assert not store.create_once(name, b"second holder")
    assert store.read(name, 0, store.size(name)) == b"first holder"
    # The same bytes again: a retry of the first call after a lost reply.
    assert store.create_once(name, b"first holder")
    assert store.list("volumes/") == [name]


def test_create_once_race_has_one_winner(store, harness):
    """Writers racing for one name through their own clients: exactly one wins,
    and the blob holds the winner's bytes, whole."""
    name = "volumes/v1/lease/0000000000000002"
    clients = [harness.reopen(store) for _ in range(8)]
    start = threading.Barrier(len(clients))
    won: list[int] = []

    def racer(i: int) -> None:
        start.wait()
        if clients[i].create_once(name, f"holder {i} ".encode() * 100):
            won.append(i)

    run_threads(racer, len(clients))
    assert len(won) == 1
    assert store.read(name, 0, store.size(name)) == f"holder {won[0]} ".encode() * 100


def test_create_once_on_a_missing_store_is_unavailable(store, harness):
    harness.vanish(store)
    with pytest.raises(BackingUnavailable):
        store.create_once("volumes/v/lease/0000000000000001", b"x")


BAD_NAMES = ["", "/abs", "/", "a/../b", "..", ".", "a/./b", "a//b", "a/", "./a", "a\0b",
             ".hidden", "a/.x.tmp-1", MARKER_NAME, MARKER_NAME + "/x", "x" * 201,
             "ok/" + "y" * 201, "\udcff"]


@pytest.mark.parametrize("bad", BAD_NAMES, ids=repr)
def test_name_validation(store, bad):
    for call in (lambda: store.writer(bad), lambda: store.read(bad, 0, 1),
                 lambda: store.size(bad), lambda: store.delete(bad)):
        with pytest.raises(InvalidArgument):
            call()
    with pytest.raises(InvalidArgument):
        store.writer(b"bytes/name")                        # type: ignore[arg-type]


def test_good_names(store):
    for n in ["a", PACK_NAME, "manifests/2026-01-01T00:00:00Z.json", "x" * 200, "b/c/d/e/f",
              "ünïcode/名前", "a..b", "a.", "with space"]:
        put(store, n, n.encode())
        assert store.read(n, 0, len(n.encode())) == n.encode()
    assert len(store.list()) == 9
    for bad_prefix in ("/x", "a/../", "\0"):
        with pytest.raises(InvalidArgument):
            store.list(bad_prefix)


@pytest.mark.parametrize("how", ["vanish", "unmount"])
def test_missing_store_is_unavailable_and_not_recreated(store, harness, how):
    put(store, PACK_NAME, b"cold bytes")
    getattr(harness, how)(store)
    checks = [
        lambda: store.check(),
        lambda: store.writer("packs/cd/new.pack"),
        lambda: store.list(),
        lambda: store.list("packs/"),
        lambda: store.read(PACK_NAME, 0, 4),               # never read before: not cached
        lambda: store.size(PACK_NAME),
        lambda: store.delete(PACK_NAME),
        lambda: store.free_bytes(),
        lambda: store.remove_incomplete(0),
    ]
    for call in checks:
        with pytest.raises(BackingUnavailable, match="unavailable|marker|missing"):
            call()
    harness.assert_not_recreated(store, was_empty_dir=(how == "unmount"))
    # and a fresh handle (daemon restart) sees the same
    with pytest.raises(BackingUnavailable):
        harness.reopen(store).check()
    harness.assert_not_recreated(store, was_empty_dir=(how == "unmount"))


def test_another_store_is_refused(store, harness):
    put(store, "m/a", b"a")
    stranger = harness.reopen(store, store_uuid=uuid.uuid4())
    for call in (stranger.check, lambda: stranger.writer("m/b"), stranger.list):
        with pytest.raises(BackingUnavailable, match="not the expected"):
            call()
    assert store.list() == ["m/a"]


def test_free_bytes(store):
    free = store.free_bytes()
    assert free is None or (isinstance(free, int) and free > 0)


def test_read_only_store(harness):
    seed = {PACK_NAME: blob(50 * KIB), "m/a": b"meta"}
    with harness.readonly_store(seed) as store:
        with pytest.raises(BackingReadOnly):
            store.check()
        with pytest.raises(BackingReadOnly):
            put(store, "packs/cd/new.pack", b"x" * 1000)
        with pytest.raises(BackingReadOnly):
            put(store, "m/a", b"replacement")
        with pytest.raises(BackingReadOnly):
            store.delete("m/a")
        assert store.read(PACK_NAME, 0, 50 * KIB) == seed[PACK_NAME]   # reads still work
        assert store.list() == sorted(seed)


def test_full_store(harness):
    with harness.full_store() as store:
        put(store, "m/small", b"fits")
        free_before = store.free_bytes()
        with pytest.raises(BackingFull, match="packs/cd/big.pack"):
            with store.writer("packs/cd/big.pack") as w:
                for _ in range(8):
                    w.write(blob(256 * KIB))
                w.commit()
        assert store.list() == ["m/small"]
        assert harness.leftovers(store) == []
        assert free_before is None or store.free_bytes() == free_before   # space came back
        put(store, "m/after", b"still writable")           # the store is usable again
        assert store.read("m/after", 0, 14) == b"still writable"
        assert store.read("m/small", 0, 4) == b"fits"


# -- the local backend's own rules -----------------------------------------------------------

def test_local_constructor_does_no_io(tmp_path):
    b = LocalBackend(tmp_path / "nowhere")
    with pytest.raises(BackingUnavailable, match="directory missing"):
        b.check()
    with pytest.raises(BackingUnavailable):
        LocalBackend.open(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()


def test_local_create_and_open(tmp_path):
    root = tmp_path / "a" / "b" / "store"
    su = uuid.uuid4()
    b = LocalBackend.create(root, su)
    assert b.store_uuid == su and (root / MARKER_NAME).is_file()
    assert b.url == "file://" + str(root)
    assert LocalBackend.create(root, su).store_uuid == su           # idempotent
    assert LocalBackend.create(root).store_uuid == su               # any uuid: adopts it
    assert LocalBackend.open(root, str(su)).store_uuid == su
    assert LocalBackend.open(root, su.bytes).store_uuid == su
    assert LocalBackend.open(root).store_uuid == su
    with pytest.raises(AlreadyExists, match="already holds"):
        LocalBackend.create(root, uuid.uuid4())
    with pytest.raises(BackingUnavailable, match="not the expected"):
        LocalBackend.open(root, uuid.uuid4())
    # a handle without a uuid adopts the first one it sees, then holds to it
    loose = LocalBackend(root)
    loose.check()
    assert loose.store_uuid == su
    shutil.rmtree(root)
    LocalBackend.create(root, uuid.uuid4())
    with pytest.raises(BackingUnavailable, match="not the expected"):
        loose.check()


def test_local_create_refuses_a_used_directory(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "somebody's file").write_text("x")
    with pytest.raises(AlreadyExists, match="not empty"):
        LocalBackend.create(tmp_path / "used")
    assert not (tmp_path / "used" / MARKER_NAME).exists()
    (tmp_path / "fresh-fs" / "lost+found").mkdir(parents=True)
    LocalBackend.create(tmp_path / "fresh-fs")


def test_local_damaged_marker(tmp_path):
    b = LocalBackend.create(tmp_path / "s")
    (tmp_path / "s" / MARKER_NAME).write_text("{not json")
    with pytest.raises(BackingUnavailable, match="damaged"):
        b.check()
    (tmp_path / "s" / MARKER_NAME).write_text('{"format": "ckptfs-store", "version": 99, '
                                              '"uuid": "%s"}' % uuid.uuid4())
    with pytest.raises(BackingUnavailable, match="version"):
        LocalBackend.open(tmp_path / "s")


def test_local_files_on_disk(tmp_path):
    b = LocalBackend.create(tmp_path / "s")
    w = b.writer(PACK_NAME)
    w.write(b"abc")
    tmps = [p for p in (tmp_path / "s" / "packs" / "ab").iterdir()]
    assert len(tmps) == 1 and tmps[0].name.startswith("." + PACK_NAME.rsplit("/", 1)[1])
    assert (tmps[0].stat().st_mode & 0o777) == 0o600
    w.commit()
    assert sorted(p.name for p in (tmp_path / "s" / "packs" / "ab").iterdir()) == \
        [PACK_NAME.rsplit("/", 1)[1]]
    assert (tmp_path / "s" / PACK_NAME).read_bytes() == b"abc"


def test_local_fd_cache_is_bounded_and_closes(tmp_path):
    b = LocalBackend.create(tmp_path / "s", max_open_files=3)
    for i in range(10):
        put(b, f"m/{i}", bytes([i]) * 10)
    fds_before = len(os.listdir("/proc/self/fd"))
    for i in range(10):
        assert b.read(f"m/{i}", 0, 10) == bytes([i]) * 10
        assert b.cached_fds() <= 3
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 3
    b.close()
    assert b.cached_fds() == 0
    assert len(os.listdir("/proc/self/fd")) <= fds_before
    assert b.read("m/0", 0, 1) == b"\0"                 # still usable after close
    b.close()


def test_local_eviction_while_reading_never_closes_a_busy_fd(tmp_path):
    """An fd evicted while another thread reads through it stays open until that
    read is done (else the number could be reused by another open: wrong bytes)."""
    b = LocalBackend.create(tmp_path / "s", max_open_files=1)
    put(b, "m/a", b"A" * 100)
    put(b, "m/b", b"B" * 100)
    ent = b._acquire("m/a")                             # a read in progress on m/a
    try:
        assert b.read("m/b", 0, 100) == b"B" * 100      # evicts m/a from the cache
        assert ent.evicted
        assert os.pread(ent.fd, 100, 0) == b"A" * 100   # still open, still m/a
    finally:
        b._release(ent)
    link = f"/proc/self/fd/{ent.fd}"                    # closed now (or the number reused)
    assert not os.path.lexists(link) or os.readlink(link) != str(tmp_path / "s" / "m" / "a")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_local_permission_denied_is_read_only(tmp_path):
    b = LocalBackend.create(tmp_path / "s")
    put(b, "m/a", b"a")
    os.chmod(tmp_path / "s" / "m", 0o555)
    try:
        with pytest.raises(BackingReadOnly):
            put(b, "m/b", b"b")
    finally:
        os.chmod(tmp_path / "s" / "m", 0o755)


def test_local_remove_incomplete_keeps_young_temps(tmp_path):
    b = LocalBackend.create(tmp_path / "s")
    w1 = b.writer("packs/aa/1.pack")
    w1.write(b"x")
    w2 = b.writer("m/2")
    w2.write(b"y")
    old = time.time() - 7200
    tmp1 = [p for p in (tmp_path / "s" / "packs" / "aa").iterdir()][0]
    os.utime(tmp1, (old, old))
    assert b.remove_incomplete(older_than=3600) == 1
    assert not tmp1.exists()
    w2.commit()
    assert b.list() == ["m/2"]
    w1.abort()


def test_open_backend(tmp_path):
    b = open_backend(str(tmp_path / "s"), create=True)
    assert isinstance(b, LocalBackend)
    assert open_backend("file://" + str(tmp_path / "s"), b.store_uuid).list() == []
    s3 = open_backend("s3://bucket/x/y/")                   # no I/O until used
    assert isinstance(s3, S3Backend) and s3.url == "s3://bucket/x/y"
    assert (s3.bucket, s3.prefix) == ("bucket", "x/y")
    for bad in ("s3://b/x", "s3://AKIA:secret@bucket/x", "s3://bucket/x?region=y",
                "s3://bucket/../x", "ftp://host/x", "relative/dir"):
        with pytest.raises(UsageError):
            open_backend(bad)


# -- the fault injector ----------------------------------------------------------------------

@pytest.fixture
def faulty(tmp_path):
    fb = FaultyBackend(LocalBackend.create(tmp_path / "s"))
    put(fb, PACK_NAME, bytes(range(256)) * 4)
    yield fb
    fb.close()


def test_fault_unavailable_then_cleared(faulty):
    with faulty.injected("unavailable") as f:
        for call in (faulty.check, faulty.list, faulty.free_bytes,
                     lambda: faulty.read(PACK_NAME, 0, 1), lambda: faulty.size(PACK_NAME),
                     lambda: faulty.delete(PACK_NAME), lambda: faulty.writer("m/x")):
            with pytest.raises(BackingUnavailable, match="injected"):
                call()
        assert f.fired == 7
    faulty.check()
    assert faulty.read(PACK_NAME, 0, 4) == b"\0\1\2\3"


def test_fault_times_after_prefix(faulty):
    put(faulty, "m/meta", b"meta")
    f = faulty.inject("unavailable", ops={"read"}, prefix="packs/", after=1, times=2)
    assert faulty.read(PACK_NAME, 0, 1) == b"\0"        # skipped (after=1)
    assert faulty.read("m/meta", 0, 4) == b"meta"       # other prefix
    for _ in range(2):
        with pytest.raises(BackingUnavailable):
            faulty.read(PACK_NAME, 0, 1)
    assert faulty.read(PACK_NAME, 0, 1) == b"\0"        # spent
    assert f.fired == 2
    assert faulty.calls["read"] == 5


def test_fault_full_and_readonly_abort_the_writer(faulty, tmp_path):
    faulty.inject("full", ops={"write"}, after=1)
    w = faulty.writer("packs/cd/x.pack")
    w.write(b"first write fits")
    with pytest.raises(BackingFull):
        w.write(b"second does not")
    assert faulty.free_bytes() > 0                      # that fault was for writes only
    faulty.clear()
    with faulty.injected("full"):
        assert faulty.free_bytes() == 0
        with pytest.raises(BackingFull):
            faulty.writer("m/y")
    assert faulty.free_bytes() > 0
    with faulty.injected("readonly"):
        with pytest.raises(BackingReadOnly):
            faulty.check()
        with pytest.raises(BackingReadOnly):
            faulty.delete(PACK_NAME)
        with pytest.raises(BackingReadOnly):
            faulty.writer("m/y")
        assert faulty.read(PACK_NAME, 0, 1) == b"\0"
    with faulty.injected("full", ops={"commit"}):
        w2 = faulty.writer("m/z")
        w2.write(b"z")
        with pytest.raises(BackingFull):
            w2.commit()
    assert faulty.list() == [PACK_NAME]
    leftovers = [f for _d, _s, fs in os.walk(tmp_path / "s") for f in fs if f.startswith(".")]
    assert leftovers == []


def test_fault_missing_and_damage(faulty):
    with faulty.injected("missing"):
        with pytest.raises(BlobMissing):
            faulty.read(PACK_NAME, 0, 1)
        with pytest.raises(BlobMissing):
            faulty.size(PACK_NAME)
    good = faulty.read(PACK_NAME, 0, 1024)
    with faulty.injected("damage", times=1):
        bad = faulty.read(PACK_NAME, 0, 1024)
        assert faulty.read(PACK_NAME, 0, 1024) == good
    diff = [i for i in range(1024) if good[i] != bad[i]]
    assert diff == [512] and bad[512] == good[512] ^ 0xFF
    with faulty.injected("damage", position=-1):
        assert faulty.read(PACK_NAME, 10, 10)[-1] == 19 ^ 0xFF


def test_fault_delay(faulty):
    with faulty.injected("delay", ops={"read"}, delay=0.2):
        t = time.monotonic()
        assert faulty.read(PACK_NAME, 0, 2) == b"\0\1"
        assert time.monotonic() - t >= 0.2
    t = time.monotonic()
    faulty.read(PACK_NAME, 0, 2)
    assert time.monotonic() - t < 0.2


def test_fault_lost_commit(faulty):
    with faulty.injected("lost_commit"):
        with pytest.raises(BackingUnavailable, match="reply lost"):
            put(faulty, "m/ambiguous", b"landed anyway")
    assert faulty.read("m/ambiguous", 0, 13) == b"landed anyway"


def test_fault_bad_arguments(faulty):
    with pytest.raises(ValueError):
        faulty.inject("gremlins")
    with pytest.raises(ValueError):
        faulty.inject("unavailable", ops={"reed"})
    with pytest.raises(ValueError):
        faulty.inject("delay")


def test_blob_and_prefix_conflict(store):
    put(store, "m/a", b"a")
    with pytest.raises(InvalidArgument, match="both a blob and a prefix"):
        store.writer("m/a/b")
    with pytest.raises(InvalidArgument, match="both a blob and a prefix"):
        store.writer("m")
    assert store.list() == ["m/a"]


# -- O_DIRECT span reads (the cold store's pack reads) ---------------------------------------

def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _span_ranges(size: int) -> list[tuple[int, int]]:
    rng = random.Random(5)
    ranges = [(0, 1), (1, SPAN_ALIGN), (SPAN_ALIGN - 1, 2), (SPAN_ALIGN, SPAN_ALIGN),
              (size - 1, 1), (size - 5000, 5000), (12345, MIB), (0, size)]
    return ranges + [(o, rng.randrange(1, min(2 * MIB, size - o) + 1))
                     for o in (rng.randrange(size) for _ in range(30))]


def test_local_span_reads_bypass_the_page_cache(tmp_path):
    """Pack ranges not in the page cache are read with O_DIRECT, rounded out to
    whole blocks, into the caller's aligned buffer: the right bytes at any
    offset and length, and the file's pages stay out of the page cache."""
    b = LocalBackend.create(tmp_path / "store")
    data = blob(4 * MIB + 77, seed=3)
    put(b, PACK_NAME, data)
    path = tmp_path / "store" / PACK_NAME
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, length in _span_ranges(len(data)):
            _drop_page_cache(path)
            span = mmap.mmap(-1, length + 2 * SPAN_ALIGN)
            start = b.read_span_into(PACK_NAME, off, length, memoryview(span))
            assert span[start:start + length] == data[off:off + length], (off, length)
            assert start == off % SPAN_ALIGN
            assert not local_backing._all_in_page_cache(fd, off, length), (off, length)
        assert b.direct_reads
        # a range all in the page cache is copied from there (no disk read)
        os.pread(fd, 3 * MIB, 0)
        span = mmap.mmap(-1, 2 * MIB + 2 * SPAN_ALIGN)
        assert b.read_span_into(PACK_NAME, 12345, 2 * MIB, memoryview(span)) == 0
        assert span[:2 * MIB] == data[12345:12345 + 2 * MIB]
        _drop_page_cache(path)
        for off, length in ((len(data) - 10, 11), (len(data) + 1, 1)):
            with pytest.raises(BlobDamaged, match="past the end"):
                b.read_span_into(PACK_NAME, off, length,
                                 memoryview(mmap.mmap(-1, length + 2 * SPAN_ALIGN)))
    finally:
        os.close(fd)
        b.close()


def test_local_span_reads_fall_back_where_o_direct_is_refused(tmp_path, monkeypatch):
    """A store that refuses O_DIRECT (EINVAL at the open: some FUSE and network
    filesystems; or at the read: a block size the buffer does not meet) is
    read through the page cache: the right bytes, and no more direct tries."""
    b = LocalBackend.create(tmp_path / "store")
    data = blob(2 * MIB + 5, seed=4)
    put(b, PACK_NAME, data)
    path = tmp_path / "store" / PACK_NAME
    # refused at the read: a buffer one byte off the alignment the disk needs
    # (the real kernel's EINVAL on this filesystem)
    _drop_page_cache(path)
    raw = mmap.mmap(-1, MIB + 3 * SPAN_ALIGN)
    odd = memoryview(raw)[1:]
    start = b.read_span_into(PACK_NAME, 4096, MIB, odd)
    assert odd[start:start + MIB] == data[4096:4096 + MIB]
    assert not b.direct_reads
    b.close()

    def refuse(fd):
        raise OSError(errno.EINVAL, "O_DIRECT not supported")
    monkeypatch.setattr(local_backing, "_open_direct", refuse)
    b = LocalBackend.open(tmp_path / "store")
    _drop_page_cache(path)
    span = mmap.mmap(-1, MIB + 2 * SPAN_ALIGN)
    start = b.read_span_into(PACK_NAME, 777, MIB, memoryview(span))
    assert span[start:start + MIB] == data[777:777 + MIB]
    assert not b.direct_reads
    b.close()
