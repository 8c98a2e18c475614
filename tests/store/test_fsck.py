"""fsck finds each kind of planted damage, repairs what it can, and says so by exit code.

fsck (the real command) is what these tests exercise; the filesystems it checks
are written, and looked at after a repair, in this process (tests/inproc.py):
the same handlers a mount runs, without the kernel. One test needs a live mount
(fsck refuses it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptfs import index as ix
from ckptfs.errors import DamagedData
from ckptfs.index import Index
from inproc import InProcess
from mounting import run_ckptfs

CLEAN, REPAIRED, LEFT = 0, 3, 4


@pytest.fixture
def written(inproc) -> InProcess:
    """An unmounted ckptfs holding a few files, a hard link, a symlink and an xattr."""
    fs = inproc(["pmem_size=64M"])

    async def fill(fs) -> None:
        fs.mkdir("d")
        await fs.write_file("d/a", b"a" * 5000)
        fs.link("d/a", "hard")
        await fs.write_file("big", os.urandom(3 << 20))
        fs.symlink("big", "sym")
        fs.setxattr("big", "user.k", b"v")
    fs.run(fill)
    fs.shutdown()
    assert fs.fsck().returncode == CLEAN
    return fs


def plant(m, fn) -> None:
    """Change the index of an unmounted ckptfs behind its back."""
    index = Index(str(m.source / ".ckptfs" / "index"))
    try:
        index.write_direct(fn)
    finally:
        index.close()


def lookup(txn, parent: int, name: bytes) -> tuple[int, int]:
    return ix.dirent_decode(txn._get("dirents", ix.dirent_key(parent, name)))


def first_chunk(txn, ino: int) -> ix.Chunk:
    lo, hi = ix.prefix_range(ino)
    k, v = next(txn._items("extents", lo, hi))
    return ix.get_chunk(txn, ix.extent_decode(k, v).chunk_no)


def expect_repair(m, needle: str) -> None:
    res = m.fsck()
    assert res.returncode == LEFT, res.stdout + res.stderr
    assert needle in res.stdout, res.stdout
    res = m.fsck("--repair")
    assert res.returncode == REPAIRED, res.stdout + res.stderr
    res = m.fsck()
    assert res.returncode == CLEAN, res.stdout + res.stderr


def test_refcount_too_high_is_repaired(written):
    def bump(txn):
        chunk = first_chunk(txn, lookup(txn, ix.ROOT_INO, b"big")[0])
        chunk.refcount += 2
        ix.put_chunk(txn, chunk)
    plant(written, bump)
    expect_repair(written, "[refcounts]")


def test_leaked_chunk_is_repaired(written):
    def leak(txn):
        ix.add_chunk(txn, ix.Chunk(999, ix.CHUNK_LOG, 1, 4096, log_off=60 << 20,
                                   crcs=b"\0\0\0\0"))
        txn._put("meta", b"next_chunk", ix.u64_le(1000))
    plant(written, leak)
    expect_repair(written, "referenced by nothing")


def test_entry_to_missing_inode_is_removed(written, inproc):
    def dangle(txn):
        txn._put("dirents", ix.dirent_key(ix.ROOT_INO, b"ghost"), ix.dirent_value(5555, 9999))
        txn._put("dirlist", ix.dirlist_key(ix.ROOT_INO, 9999), b"ghost")
        txn._put("meta", b"next_cookie", ix.u64_le(10000))
    plant(written, dangle)
    expect_repair(written, "missing inode 5555")
    assert "ghost" not in inproc(source=written.source).listdir()


def test_wrong_link_count_is_fixed(written, inproc):
    def wrong(txn):
        ino = lookup(txn, ix.ROOT_INO, b"hard")[0]
        inode = ix.get_inode(txn, ino)
        inode.nlink = 7
        ix.put_inode(txn, inode)
    plant(written, wrong)
    expect_repair(written, "[link counts]")
    assert inproc(source=written.source).attrs("hard").inode.nlink == 2


def test_unreachable_inode_goes_to_lost_found(written, inproc):
    def cut(txn):
        ino, cookie = lookup(txn, ix.ROOT_INO, b"big")
        txn._delete("dirents", ix.dirent_key(ix.ROOT_INO, b"big"))
        txn._delete("dirlist", ix.dirlist_key(ix.ROOT_INO, cookie))
        cut.ino = ino
    plant(written, cut)
    expect_repair(written, "is in no directory")
    assert inproc(source=written.source).size(f"lost+found/#{cut.ino}") == 3 << 20


def test_orphan_left_by_crash_is_purged(written):
    def orphan(txn):
        ino, cookie = lookup(txn, ix.ROOT_INO, b"big")
        txn._delete("dirents", ix.dirent_key(ix.ROOT_INO, b"big"))
        txn._delete("dirlist", ix.dirlist_key(ix.ROOT_INO, cookie))
        inode = ix.get_inode(txn, ino)
        inode.nlink = 0
        ix.put_inode(txn, inode)
        txn._put("orphans", ix.ino_key(ino), b"")
    plant(written, orphan)
    expect_repair(written, "[orphans]")


def test_missing_log_map_entry_is_restored(written):
    def unmap(txn):
        chunk = first_chunk(txn, lookup(txn, ix.ROOT_INO, b"big")[0])
        txn._delete("logmap", ix.u64(chunk.log_off))
    plant(written, unmap)
    expect_repair(written, "[logmap]")


def test_counter_behind_ids_in_use_is_raised(written):
    plant(written, lambda txn: txn._put("meta", b"next_ino", ix.u64_le(2)))
    expect_repair(written, "[counters]")


def test_damaged_data_is_reported_not_repaired(written, inproc):
    index = Index(str(written.source / ".ckptfs" / "index"))
    try:
        chunk = first_chunk(index, ix.dirent_decode(
            index._get("dirents", ix.dirent_key(ix.ROOT_INO, b"big")))[0])
    finally:
        index.close()
    log_path = written.source / ".ckptfs" / "pmem.log"
    with open(log_path, "r+b") as f:
        f.seek(chunk.log_off + 123)
        byte = f.read(1)
        f.seek(chunk.log_off + 123)
        f.write(bytes([byte[0] ^ 0x5A]))
    res = written.fsck()
    assert res.returncode == LEFT and "[data]" in res.stdout, res.stdout
    res = written.fsck("--repair")
    assert res.returncode == LEFT, res.stdout
    fs = inproc(source=written.source)
    with pytest.raises(DamagedData):        # EIO through a mount (fuse_ops)
        fs.run(lambda fs: fs.read_file("big"))
    assert fs.run(lambda fs: fs.read_file("d/a")) == b"a" * 5000


def test_missing_chunk_id_entry_is_restored(written):
    def drop(txn):
        chunk = first_chunk(txn, lookup(txn, ix.ROOT_INO, b"big")[0])
        assert chunk.chunk_id
        txn._delete("chunkids", chunk.chunk_id)
    plant(written, drop)
    expect_repair(written, "missing from the id table")


def test_id_entry_naming_the_wrong_chunk_is_removed(written):
    def wrong(txn):
        txn._put("chunkids", b"\x01" * 32, ix.u64(first_chunk(txn, lookup(
            txn, ix.ROOT_INO, b"big")[0]).chunk_no))
    plant(written, wrong)
    expect_repair(written, "does not hold it")


def test_wrong_chunk_totals_are_recounted(written, inproc):
    plant(written, lambda txn: txn._put("meta", b"stored_log_bytes", ix.u64_le(12345)))
    expect_repair(written, "stored_log_bytes is 12345")
    assert inproc(source=written.source).stats()["stored_bytes"] > 3 << 20


def test_wrong_file_totals_are_recounted(written, inproc):
    plant(written, lambda txn: (txn._put("meta", b"files", ix.u64_le(7)),
                                txn._put("meta", b"file_bytes", ix.u64_le(1))))
    expect_repair(written, "files is 7")
    s = inproc(source=written.source).stats()
    assert (s["files"], s["logical_bytes"]) == (2, 5000 + (3 << 20))


def test_format_3_index_gets_its_file_totals_at_the_next_mount(written, inproc):
    """Format 3 kept no file totals: fsck refuses it, a mount counts them."""
    import struct

    def to_format_3(txn):
        txn._delete("meta", b"files")
        txn._delete("meta", b"file_bytes")
        txn._put("meta", b"format", struct.pack("<I", 3))
    plant(written, to_format_3)
    res = written.fsck()
    assert res.returncode != 0 and "format 3" in res.stdout + res.stderr
    fs = inproc(source=written.source)          # opened as the daemon opens it
    s = fs.stats()
    assert (s["files"], s["logical_bytes"]) == (2, 5000 + (3 << 20))
    fs.shutdown()
    assert written.fsck().returncode == CLEAN


def test_chunk_bytes_that_do_not_match_their_id_are_damage(written):
    def swap(txn):
        chunk = first_chunk(txn, lookup(txn, ix.ROOT_INO, b"big")[0])
        txn._delete("chunkids", chunk.chunk_id)
        chunk.chunk_id = b"\x02" * 32            # CRCs still match: only the id check sees it
        ix.put_chunk(txn, chunk)
        txn._put("chunkids", chunk.chunk_id, ix.u64(chunk.chunk_no))
    plant(written, swap)
    res = written.fsck()
    assert res.returncode == LEFT and "do not match the chunk id" in res.stdout, res.stdout


def test_wrong_pack_record_is_repaired(inproc):
    fs = inproc(["pmem_size=64M", "hot_versions=0"])

    async def cold(fs) -> None:
        await fs.write_file("cold", os.urandom(2 << 20))
        await fs.tier_now(everything=True)
    fs.run(cold)
    fs.shutdown()

    def wrong(txn):
        for k, _ in list(txn._items("packs", ix.u64(0), ix.u64((1 << 64) - 1))):
            pack = ix.get_pack(txn, ix.read_u64(k))
            pack.live_chunks += 5
            ix.put_pack(txn, pack)
    plant(fs, wrong)
    expect_repair(fs, "[packs]")


def test_fsck_refuses_a_mounted_filesystem(mounted):
    res = run_ckptfs("fsck", str(mounted.source), check=False)
    assert res.returncode == 1 and "unmount it first" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_fsck_of_a_plain_directory_fails(tmp_path: Path):
    res = run_ckptfs("fsck", str(tmp_path), check=False)
    assert res.returncode == 1 and "holds no ckptfs" in res.stderr


# ------------------------------------------- what fsck did not check (issue 10, item 10)

def _damage_first_log_chunk(m, log_path: Path, name: bytes) -> None:
    index = Index(str(m.source / ".ckptfs" / "index"))
    try:
        chunk = first_chunk(index, ix.dirent_decode(
            index._get("dirents", ix.dirent_key(ix.ROOT_INO, name)))[0])
    finally:
        index.close()
    with open(log_path, "r+b") as f:
        f.seek(chunk.log_off + 77)
        byte = f.read(1)
        f.seek(chunk.log_off + 77)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_fsck_without_pmem_checks_the_log_the_mount_used(inproc, tmp_path):
    """The log placed elsewhere at mount: fsck without -o pmem= still checks it."""
    log_path = tmp_path / "elsewhere" / "ckpt.log"
    log_path.parent.mkdir()
    fs = inproc(["pmem_size=64M", f"pmem={log_path}"])
    fs.run(lambda fs: fs.write_file("f", os.urandom(1 << 20)))
    fs.shutdown()
    assert fs.fsck().returncode == CLEAN
    _damage_first_log_chunk(fs, log_path, b"f")
    res = fs.fsck()
    assert res.returncode == LEFT and "[data]" in res.stdout, res.stdout
    assert "clean" not in res.stdout
    again = inproc([], source=fs.source)         # and a mount finds it without pmem= too
    with pytest.raises(DamagedData):            # EIO through a mount (fuse_ops)
        again.run(lambda fs: fs.read_file("f"))


def test_fsck_with_the_log_missing_says_what_it_did_not_check(written):
    log_path = written.source / ".ckptfs" / "pmem.log"
    log_path.rename(log_path.with_name("pmem.away"))
    res = written.fsck()
    assert res.returncode == LEFT, res.stdout + res.stderr
    assert "clean" not in res.stdout
    lines = [ln for ln in res.stdout.splitlines() if "not checked" in ln]
    assert len(lines) == 1 and "pmem.log" in lines[0], res.stdout


def test_fsck_with_the_backing_store_gone_is_not_clean(inproc, tmp_path):
    store = tmp_path / "store"
    fs = inproc(["pmem_size=64M", f"backing={store}"])

    async def cold(fs) -> None:
        await fs.write_file("cold", os.urandom(2 << 20))
        await fs.tier_now(everything=True)
    fs.run(cold)
    fs.shutdown()
    assert fs.fsck().returncode == CLEAN
    store.rename(tmp_path / "store.away")
    res = fs.fsck()
    assert res.returncode == LEFT, res.stdout + res.stderr
    assert "clean" not in res.stdout
    lines = [ln for ln in res.stdout.splitlines() if "not checked" in ln]
    assert len(lines) == 1 and str(store) in lines[0], res.stdout


def test_fsck_no_data_does_not_claim_the_data_was_checked(written):
    res = written.fsck("--no-data")
    assert res.returncode == CLEAN
    assert "data not read" in res.stdout, res.stdout


# ------------------------------------------------------------- namespace damage

def _add_entry(txn, parent: int, name: bytes, ino: int) -> int:
    cookie = ix.read_counter(txn, b"next_cookie")
    txn._put("meta", b"next_cookie", ix.u64_le(cookie + 1))
    txn._put("dirents", ix.dirent_key(parent, name), ix.dirent_value(ino, cookie))
    txn._put("dirlist", ix.dirlist_key(parent, cookie), name)
    return cookie


def _rename_entry(txn, parent: int, old: bytes, new: bytes) -> None:
    ino, cookie = lookup(txn, parent, old)
    txn._delete("dirents", ix.dirent_key(parent, old))
    txn._put("dirents", ix.dirent_key(parent, new), ix.dirent_value(ino, cookie))
    txn._put("dirlist", ix.dirlist_key(parent, cookie), new)


@pytest.mark.parametrize("bad", [b".", b"..", b"", b"a/b", b"nul\0name"])
def test_entry_with_an_impossible_name_goes_to_lost_found(written, inproc, bad):
    plant(written, lambda txn: _rename_entry(txn, ix.ROOT_INO, b"big", bad))
    expect_repair(written, "[names]")
    fs = inproc(source=written.source)
    names = fs.listdir()
    assert "big" not in names and names.count("..") == 0 and names.count(".") == 0
    rescued = fs.listdir("lost+found")
    assert [fs.size(f"lost+found/{name}") for name in rescued] == [3 << 20]


def test_dotdot_listed_in_the_root_is_removed(written, inproc):
    plant(written, lambda txn: _add_entry(txn, ix.ROOT_INO, b"..", ix.ROOT_INO))
    expect_repair(written, "[names]")
    assert inproc(source=written.source).listdir() == ["big", "d", "hard", "sym"]


def test_name_listed_twice_in_a_directory_is_repaired(written, inproc):
    def twice(txn):
        cookie = ix.read_counter(txn, b"next_cookie")
        txn._put("meta", b"next_cookie", ix.u64_le(cookie + 1))
        txn._put("dirlist", ix.dirlist_key(ix.ROOT_INO, cookie), b"big")
    plant(written, twice)
    expect_repair(written, "twice")
    assert inproc(source=written.source).listdir() == ["big", "d", "hard", "sym"]


def test_directory_named_twice_keeps_one_name(written, inproc):
    def second_name(txn):
        d = lookup(txn, ix.ROOT_INO, b"d")[0]
        _add_entry(txn, ix.ROOT_INO, b"d2", d)
    plant(written, second_name)
    expect_repair(written, "[tree]")
    fs = inproc(source=written.source)
    assert fs.listdir() == ["big", "d", "hard", "sym"]
    assert fs.attrs("").inode.nlink == 3
    assert fs.run(lambda fs: fs.read_file("d/a")) == b"a" * 5000


def test_directory_cycle_is_broken(written, inproc):
    def cycle(txn):
        root = ix.get_inode(txn, ix.ROOT_INO)
        counters = {n: ix.read_counter(txn, n) for n in (b"next_ino",)}
        a, b = counters[b"next_ino"], counters[b"next_ino"] + 1
        txn._put("meta", b"next_ino", ix.u64_le(b + 1))
        for ino, parent in ((a, b), (b, a)):
            ix.put_inode(txn, ix.Inode(ino, 0o40755, 3, 0, 0, parent=parent,
                                       mtime_ns=root.mtime_ns))
        _add_entry(txn, a, b"b", b)
        _add_entry(txn, b, b"a", a)
    plant(written, cycle)
    expect_repair(written, "[tree]")
    fs = inproc(source=written.source)
    rescued = fs.listdir("lost+found")
    assert len(rescued) == 1
    inner = fs.listdir(f"lost+found/{rescued[0]}")
    assert len(inner) == 1 and fs.listdir(f"lost+found/{rescued[0]}/{inner[0]}") == []


def test_parent_pointer_that_disagrees_is_mended(written, inproc):
    def wrong(txn):
        d = ix.get_inode(txn, lookup(txn, ix.ROOT_INO, b"d")[0])
        d.parent = 12345
        ix.put_inode(txn, d)
    plant(written, wrong)
    expect_repair(written, "records parent")
    assert inproc(source=written.source).lookup("d/..") == ix.ROOT_INO
