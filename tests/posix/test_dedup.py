"""Deduplication through the real mount: bytes already stored are not stored
again, whatever the file, path or write pattern; refcounts stay exact under
every namespace operation; stored totals are exact and come back to zero.

`stored_bytes` (ckptfs stat) is the sum of the chunk table's lengths, so these
tests see exactly what the index keeps.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import struct
import subprocess
import sys

import pytest

from posix_helpers import check_clean, pattern, read_file, remount_and_check, write_file

MiB = 1 << 20
KiB = 1 << 10


def _push_out_of_page_cache(fd: int) -> None:
    """Send dirty pages to the daemon (no fsync: nothing commits) and drop them,
    so the next read comes from the daemon."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong,
                                     ctypes.c_uint]
    if libc.sync_file_range(fd, 0, 0, 7) != 0:   # WAIT_BEFORE | WRITE | WAIT_AFTER
        raise OSError(ctypes.get_errno(), "sync_file_range")
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def stored(m) -> int:
    return m.stat()["stored_bytes"]


def test_same_bytes_in_two_files_are_stored_once(mounted, fsck_clean):
    data = pattern(24 * MiB, 1)
    write_file(mounted.path / "a", data)
    after_a = stored(mounted)
    assert after_a >= len(data)
    write_file(mounted.path / "b", data)
    st = mounted.stat()
    assert st["stored_bytes"] == after_a, "the second copy stored new bytes"
    assert st["logical_bytes"] == 2 * len(data)
    assert st["dedup_ratio"] == pytest.approx(2.0, rel=1e-3)
    mounted.remount()
    assert read_file(mounted.path / "a") == data
    assert read_file(mounted.path / "b") == data
    check_clean(fsck_clean, mounted)


def test_repeated_content_within_a_file_fits_a_small_log(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=64M"])
    block = pattern(MiB, 2)
    with open(m.path / "big", "wb") as f:
        for _ in range(200):        # 200 MiB through a 64 MiB log
            f.write(block)
    st = m.stat()
    assert st["logical_bytes"] == 200 * MiB
    assert st["stored_bytes"] < 3 * MiB
    m.remount()
    with open(m.path / "big", "rb") as f:
        for i in range(200):
            assert f.read(MiB) == block, f"MiB {i} differs"
    check_clean(fsck_clean, m)


def test_dedup_off_stores_every_copy(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=512M", "dedup=off"])
    data = pattern(8 * MiB, 3)
    write_file(m.path / "a", data)
    write_file(m.path / "b", data)
    st = m.stat()
    assert st["dedup"] is False
    assert st["stored_bytes"] == 2 * len(data)
    remount_and_check(fsck_clean, m, m.path / "b", data)


def test_inserted_bytes_do_not_break_dedup(mounted, fsck_clean):
    """Content-defined cuts move with the content: a shifted copy still dedups."""
    data = pattern(32 * MiB, 4)
    write_file(mounted.path / "v1", data)
    before = stored(mounted)
    shifted = b"inserted header bytes" * 7 + data[:10 * MiB] + b"x" * 1000 + data[10 * MiB:]
    write_file(mounted.path / "v2", shifted)
    added = stored(mounted) - before
    # New: the inserted bytes plus a few chunks around each change (max 256 KiB each).
    assert added < 2 * MiB, f"a shifted copy added {added} bytes"
    remount_and_check(fsck_clean, mounted, mounted.path / "v2", shifted)


def test_cp_of_a_checkpoint_within_the_mount_adds_almost_nothing(mounted, fsck_clean):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(256, 1024) for i in range(24)}
    torch.save(state, mounted.path / "step_100.pt")
    before = mounted.stat()
    os.mkdir(mounted.path / "latest")
    subprocess.run(["cp", "-a", str(mounted.path / "step_100.pt"),
                    str(mounted.path / "latest" / "model.pt")], check=True)
    after = mounted.stat()
    size = os.path.getsize(mounted.path / "step_100.pt")
    added = after["stored_bytes"] - before["stored_bytes"]
    assert after["logical_bytes"] - before["logical_bytes"] == size
    assert added <= 0.01 * size, f"cp added {added} of {size} bytes"
    mounted.remount()
    loaded = torch.load(mounted.path / "latest" / "model.pt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    check_clean(fsck_clean, mounted)


def _safetensors_bytes(tensors: dict[str, bytes]) -> bytes:
    """A safetensors file of uint8 tensors, written by hand (no framework)."""
    import json
    header, pos = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())


def test_small_changed_tensors_between_frozen_ones_cost_only_themselves(mounted, fsck_clean):
    """Forced cuts at tensor boundaries: an adapter-sized change does not drag
    its frozen neighbours into new chunks."""
    frozen = {f"base{i}": pattern(3 * MiB + 4099 * i, 100 + i) for i in range(8)}

    def version(v: int) -> dict[str, bytes]:
        out = {}
        for i in range(8):
            out[f"base{i}"] = frozen[f"base{i}"]
            out[f"lora{i}"] = pattern(8 * KiB + 24 * i, 1000 * v + i)
        return out

    write_file(mounted.path / "v1.safetensors", _safetensors_bytes(version(1)))
    before = stored(mounted)
    v2 = _safetensors_bytes(version(2))
    write_file(mounted.path / "v2.safetensors", v2)
    added = stored(mounted) - before
    changed = sum(len(pattern(8 * KiB + 24 * i, 0)) for i in range(8))
    header = struct.unpack_from("<Q", v2)[0] + 8
    assert added <= changed + header, f"added {added}, changed tensors {changed} + header {header}"
    remount_and_check(fsck_clean, mounted, mounted.path / "v2.safetensors", v2)


def test_out_of_order_writes_dedup_at_commit(mounted, fsck_clean):
    data = pattern(16 * MiB, 5)
    write_file(mounted.path / "seq", data)
    before = stored(mounted)
    blocks = list(range(0, len(data), 256 * KiB))
    random.Random(1).shuffle(blocks)
    fd = os.open(mounted.path / "random", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for off in blocks:
            os.pwrite(fd, data[off:off + 256 * KiB], off)
    finally:
        os.close(fd)
    added = stored(mounted) - before
    # Cut per write record at commit: chunks at record edges are new (<= 2 per record).
    assert added < len(data) // 2, f"out-of-order copy added {added} of {len(data)}"
    remount_and_check(fsck_clean, mounted, mounted.path / "random", data)


def test_refcounts_stay_exact_under_every_operation(mounted, fsck_clean):
    p = mounted.path
    base = pattern(6 * MiB, 6)
    for name in ("a", "b", "c"):
        write_file(p / name, base)
    os.link(p / "a", p / "a-link")
    # overwrite part of a shared file
    with open(p / "b", "r+b") as f:
        f.seek(2 * MiB)
        f.write(pattern(MiB, 7))
    os.truncate(p / "c", 3 * MiB + 17)               # truncate a shared file
    os.rename(p / "c", p / "a")                      # rename over: a's name goes, link stays
    write_file(p / "d", base[:4 * MiB])              # a prefix of the shared bytes
    mounted.remount()
    want_b = base[:2 * MiB] + pattern(MiB, 7) + base[3 * MiB:]
    assert read_file(p / "a-link") == base
    assert read_file(p / "a") == base[:3 * MiB + 17]
    assert read_file(p / "b") == want_b
    assert read_file(p / "d") == base[:4 * MiB]
    mounted.umount()
    assert mounted.fsck().returncode == 0            # refcounts match the extent maps
    mounted.start()
    for name in ("a", "a-link", "b", "d"):
        os.unlink(p / name)
    st = mounted.stat()
    assert st["stored_bytes"] == 0 and st["chunks"] == 0 and st["logical_bytes"] == 0
    check_clean(fsck_clean, mounted)
    mounted.start()
    assert mounted.stat()["hot_bytes"] == 0, "log space leaked"


def test_chunk_whose_last_owner_goes_while_another_file_uses_it(mounted, fsck_clean):
    """A stored chunk an open file points at survives its last committed owner."""
    p = mounted.path
    data = pattern(8 * MiB, 8)
    write_file(p / "old", data)
    with open(p / "new", "wb", buffering=0) as f:
        f.write(data)
        _push_out_of_page_cache(f.fileno())   # settled against old's chunks, not committed
        os.unlink(p / "old")                  # their last committed reference goes
        # Someone else takes log space meanwhile: freed bytes would be reused.
        write_file(p / "other", pattern(8 * MiB, 9))
    mounted.remount()
    assert read_file(p / "new") == data
    assert read_file(p / "other") == pattern(8 * MiB, 9)
    check_clean(fsck_clean, mounted)


def test_zombie_whose_bytes_were_stored_again_is_not_stored_twice(mounted, fsck_clean):
    """Pinned chunks lose their last owner, then the same bytes are written
    again by a third file before the pinning file commits: one copy, one id."""
    p = mounted.path
    data = pattern(8 * MiB, 12)
    write_file(p / "old", data)
    with open(p / "new", "wb", buffering=0) as f:
        f.write(data)
        _push_out_of_page_cache(f.fileno())
        os.unlink(p / "old")
        write_file(p / "again", data)
    assert stored(mounted) <= len(data) + 256 * KiB
    mounted.remount()
    assert read_file(p / "new") == data and read_file(p / "again") == data
    check_clean(fsck_clean, mounted)            # fsck: no two chunks with one id


def test_concurrent_writers_of_the_same_shard_store_it_once(mounted, fsck_clean):
    """Replicated shards written by several ranks at once."""
    data = pattern(16 * MiB, 10)
    src = mounted.path.parent / "shard.src"
    write_file(src, data)
    procs = [subprocess.Popen([sys.executable, "-c",
                               "import shutil,sys; shutil.copyfile(sys.argv[1], sys.argv[2])",
                               str(src), str(mounted.path / f"rank{r}.bin")]) for r in range(4)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    st = mounted.stat()
    assert st["logical_bytes"] == 4 * len(data)
    assert st["stored_bytes"] <= len(data) * 1.05, st
    mounted.remount()
    for r in range(4):
        assert read_file(mounted.path / f"rank{r}.bin") == data
    os.unlink(src)
    check_clean(fsck_clean, mounted)


def test_read_while_writing_sees_uncut_bytes(mounted, fsck_clean):
    p = mounted.path / "f"
    data = pattern(5 * MiB + 123, 11)
    with open(p, "wb", buffering=0) as w:
        w.write(data[:3 * MiB + 7])      # the stream's last chunk is not cut yet
        _push_out_of_page_cache(w.fileno())
        with open(p, "rb", buffering=0) as r:
            assert r.read() == data[:3 * MiB + 7]
        w.seek(MiB)                      # an overwrite: cut at commit
        w.write(data[MiB:MiB + 5000])
        w.seek(3 * MiB + 7)
        w.write(data[3 * MiB + 7:])
        _push_out_of_page_cache(w.fileno())
        with open(p, "rb", buffering=0) as r:
            assert r.read() == data
    assert read_file(p) == data
    remount_and_check(fsck_clean, mounted, p, data)


def test_zero_filled_checkpoint_is_almost_free(mounted, fsck_clean):
    write_file(mounted.path / "zeros", bytes(64 * MiB))
    assert stored(mounted) == 0                  # zeros are holes: stored nowhere
    mounted.remount()
    assert read_file(mounted.path / "zeros") == bytes(64 * MiB)
    check_clean(fsck_clean, mounted)


def test_copy_tree_with_shell_tools_dedups(mounted, fsck_clean):
    p = mounted.path
    os.makedirs(p / "run/step_1")
    for i in range(5):
        write_file(p / f"run/step_1/shard{i}.bin", pattern(2 * MiB, 20 + i))
    before = stored(mounted)
    subprocess.run(["cp", "-r", str(p / "run/step_1"), str(p / "run/step_2")], check=True)
    subprocess.run(["rsync", "-a", str(p / "run/step_1") + "/", str(p / "run/step_3")],
                   check=True)
    subprocess.run(f"tar -C {p}/run -cf - step_1 | tar -C {p} -xf -", shell=True, check=True)
    assert stored(mounted) - before <= 64 * KiB
    shutil.rmtree(p / "run/step_1")
    mounted.remount()
    for d in ("run/step_2", "run/step_3", "step_1"):
        for i in range(5):
            assert read_file(p / d / f"shard{i}.bin") == pattern(2 * MiB, 20 + i)
    check_clean(fsck_clean, mounted)


def test_zero_runs_are_holes_that_read_back_as_zeros(mounted, fsck_clean):
    """Zero-initialised optimizer moments, padding: stored nowhere, read exactly."""
    data = pattern(3 * MiB, 30) + bytes(8 * MiB) + pattern(MiB, 31) + bytes(100_000)
    write_file(mounted.path / "moments", data)
    st = mounted.stat()
    assert st["stored_bytes"] <= 4 * MiB + 2 * 256 * KiB
    assert os.stat(mounted.path / "moments").st_blocks * 512 < 5 * MiB    # du: holes
    remount_and_check(fsck_clean, mounted, mounted.path / "moments", data)


def test_dedup_off_write_records_stay_within_the_chunk_limit(tmp_path):
    """dedup=off stores each write as one chunk: a write longer than
    MAX_CHUNK_BYTES (the kernel sends at most 1 MiB, a direct caller may send
    more) becomes several, so no reader ever meets a longer one."""
    from ckptfs.chunker import MAX_CHUNK_BYTES
    from ckptfs.files import FileData
    from ckptfs.index import Index
    from ckptfs.pmemlog import PmemLog
    from ckptfs.sources import SourceFiles

    fs_uuid = b"u" * 16
    index = Index(str(tmp_path / "index"))
    index.format(fs_uuid, 0, 0, 0)
    plog = PmemLog.open(str(tmp_path / "log"), 16 * MiB, fs_uuid)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        plog.init_free_space([])
        files = FileData(index, plog, SourceFiles(fd), dedup=False)
        df = files.dirty_file(2, 0)
        size = 5 * MiB + 3
        plan = files.stager.prepare_write(df, 0, size)
        lengths = [c.length for c in plan.chunks]
        assert sum(lengths) == size
        assert max(lengths) == MAX_CHUNK_BYTES and len(lengths) == 6, lengths
    finally:
        os.close(fd)
        plog.close()
        index.close()
