"""numpy's own save/load paths and Python's atomic-write idiom on ckptfs.

np.save / np.load (plain and mmap_mode='r'), np.savez(_compressed) (zipfile),
open_memmap and np.memmap (shared writable mmap, msync via flush),
tofile / fromfile; and tempfile + os.replace, the write-then-rename idiom
most checkpoint code uses for small files. Every byte is compared with the
same writes to a plain directory after a remount.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import threading
from pathlib import Path

import pytest

from compat_util import assert_same, manifest

np = pytest.importorskip("numpy")

PMEM_SIZE = "128M"         # the log of each test's mount (compat/conftest.py)


def arrays(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "weights": rng.standard_normal((2048, 1024), dtype=np.float32),      # 8 MiB
        "ids": rng.integers(0, 1 << 60, size=100_003, dtype=np.int64),
        "half": rng.standard_normal((333, 77)).astype(np.float16),
        "fortran": np.asfortranarray(rng.standard_normal((64, 48))),
        "record": np.array([(1, 2.5, b"ab"), (3, 4.5, b"cd")],
                           dtype=[("a", "<i4"), ("b", "<f8"), ("c", "S2")]),
        "empty": np.zeros((0, 3), dtype=np.uint8),
    }


def write_numpy(root: Path, a: dict) -> None:
    for name, arr in a.items():
        np.save(root / f"{name}.npy", arr)
    np.savez(root / "bundle.npz", **a)
    np.savez_compressed(root / "bundle_z.npz", **a)
    a["ids"].tofile(root / "ids.raw")
    # Shared writable mappings, flushed (msync) and closed.
    mm = np.lib.format.open_memmap(root / "memmap.npy", mode="w+", dtype=np.float32,
                                   shape=(1024, 1024))
    mm[:] = a["weights"][:1024]
    mm[::7, 3] = -1.0
    mm.flush()
    del mm
    raw = np.memmap(root / "grow.bin", dtype=np.int32, mode="w+", shape=(3, 500_000))
    raw[1] = np.arange(500_000, dtype=np.int32)
    raw.flush()
    del raw
    upd = np.memmap(root / "grow.bin", dtype=np.int32, mode="r+", shape=(3, 500_000))
    upd[2, ::1000] = 7
    upd.flush()
    del upd
    gc.collect()


def check_numpy(root: Path, a: dict) -> None:
    for name, arr in a.items():
        got = np.load(root / f"{name}.npy")
        assert got.dtype == arr.dtype and np.array_equal(got, arr), name
        if arr.dtype.hasobject is False and arr.size:
            mm = np.load(root / f"{name}.npy", mmap_mode="r")
            assert isinstance(mm, np.memmap) and np.array_equal(mm, arr), name
            del mm
    for bundle in ("bundle.npz", "bundle_z.npz"):
        with np.load(root / bundle) as z:
            assert sorted(z.files) == sorted(a)
            for name in a:
                assert np.array_equal(z[name], a[name]), (bundle, name)
    assert np.array_equal(np.fromfile(root / "ids.raw", dtype=np.int64), a["ids"])
    mm = np.load(root / "memmap.npy", mmap_mode="r")
    want = a["weights"][:1024].copy()
    want[::7, 3] = -1.0
    assert np.array_equal(mm, want)
    del mm
    grow = np.memmap(root / "grow.bin", dtype=np.int32, mode="r", shape=(3, 500_000))
    assert not grow[0].any()
    assert np.array_equal(grow[1], np.arange(500_000, dtype=np.int32))
    assert (grow[2, ::1000] == 7).all() and grow[2].sum() == 7 * 500
    del grow
    gc.collect()


def test_numpy_save_load_mmap(mounted, fsck_clean, tmp_path):
    ref = tmp_path / "plain"
    ref.mkdir()
    a = arrays(0)
    for root in (mounted.path, ref):
        write_numpy(root, a)
    check_numpy(mounted.path, a)                # before the remount too
    mounted.remount()
    assert_same(manifest(mounted.path, times=False), manifest(ref, times=False))
    check_numpy(mounted.path, a)
    fsck_clean(mounted)


def atomic_write(path: Path, data: bytes, *, fsync_dir: bool = True) -> None:
    """The idiom: NamedTemporaryFile in the same directory, fsync, os.replace."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.",
                                     delete=False) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)
    if fsync_dir:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def test_tempfile_os_replace_idiom(mounted, fsck_clean, tmp_path):
    d = mounted.path / "state"
    d.mkdir()
    target = d / "latest.json"
    # Many writers replacing the same file concurrently: readers only ever see a
    # whole version, and no temp file is left behind.
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        try:
            for i in range(40):
                body = {"writer": w, "i": i, "pad": "x" * (1000 * (i % 5))}
                atomic_write(target, json.dumps(body).encode(), fsync_dir=(i % 10 == 0))
        except BaseException as e:   # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def reader() -> None:
        try:
            while not stop.is_set():
                try:
                    json.loads(target.read_bytes())    # must always parse
                except FileNotFoundError:
                    pass                                # before the first replace
        except BaseException as e:   # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    rd = threading.Thread(target=reader)
    rd.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    rd.join()
    assert not errors, errors
    assert os.listdir(d) == ["latest.json"]
    final = target.read_bytes()

    # mkstemp + os.replace over an existing bigger file, and a binary payload.
    blob = os.urandom(3 << 20)
    (d / "weights.bin").write_bytes(os.urandom(5 << 20))
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.replace(tmp, d / "weights.bin")
    atomic_write(tmp_path / "ref.bin", blob)       # plain-directory reference
    mode = os.stat(d / "latest.json").st_mode

    mounted.remount()
    assert sorted(os.listdir(d)) == ["latest.json", "weights.bin"]
    assert target.read_bytes() == final
    assert os.stat(target).st_mode == mode
    assert (d / "weights.bin").read_bytes() == blob == (tmp_path / "ref.bin").read_bytes()
    assert os.stat(d / "weights.bin").st_mode & 0o777 == 0o600     # mkstemp's mode
    fsck_clean(mounted)
