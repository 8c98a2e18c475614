"""The commit of small rewrites (4 KiB random writes + fsync, issue 14):
what the fsync of a cycle of 16 rewrites costs on the trio thread, and that
the file reads back right, now and after a crash. Real ckptfs in this
process, no FUSE."""

from __future__ import annotations

import os
import random

import pytest

from ckptfs import index as ix
from ckptfs import staging
from ckptfs.pmemlog import PmemLog

KiB, MiB = 1 << 10, 1 << 20
FILE_BYTES = 4 * MiB


@pytest.fixture
def commit_work(monkeypatch) -> dict[str, int]:
    """Chunkers made and log reads done by the commit-time cut, scans of
    committed extent maps, the committer's log reads for the index's copy of
    a small batch's bytes (`logredo`), and chunk records decoded (counted,
    not replaced)."""
    counts = {"chunkers": 0, "reads": 0, "map_scans": 0, "redo_reads": 0, "chunk_decodes": 0}
    real_chunker, real_read = staging.BatchChunker, PmemLog.read_unverified_into
    real_scan, real_read_raw = ix.iter_extents, PmemLog.read_raw
    real_decode = ix.Chunk.decode.__func__

    class CountedChunker(real_chunker):
        def __init__(self, *args, **kw):
            counts["chunkers"] += 1
            super().__init__(*args, **kw)

    def read(self, out, off):
        counts["reads"] += 1
        return real_read(self, out, off)

    def scan(*args, **kw):
        counts["map_scans"] += 1

        return real_scan(*args, **kw)

    def read_raw(self, off, length):
        counts["redo_reads"] += 1
        return real_read_raw(self, off, length)

    def decode(cls, chunk_no, raw):
        counts["chunk_decodes"] += 1
        return real_decode(cls, chunk_no, raw)

    monkeypatch.setattr(ix.Chunk, "decode", classmethod(decode))
    monkeypatch.setattr(ix, "iter_extents", scan)
    monkeypatch.setattr(PmemLog, "read_raw", read_raw)
    monkeypatch.setattr(staging, "BatchChunker", CountedChunker)
    monkeypatch.setattr(PmemLog, "read_unverified_into", read)
    return counts


async def _rewrite_cycles(fs, ino: int, rng: random.Random, cycles: int,
                          expect: bytearray, counts: dict[str, int], per_fsync: list,
                          file_bytes: int = FILE_BYTES) -> None:
    """cycles x (16 random 4 KiB rewrites, one of them all zeros, + fsync)."""
    fh = fs.fs.open(ino, os.O_WRONLY)
    try:
        for _ in range(cycles):
            before = dict(counts)
            for k in range(16):
                off = rng.randrange(file_bytes // (4 * KiB)) * 4 * KiB
                data = bytes(4 * KiB) if k == 7 else rng.randbytes(4 * KiB)
                await fs.fs.write(fh, off, data)
                expect[off:off + len(data)] = data
            await fs.fs.fsync(fh)
            per_fsync.append({name: counts[name] - before[name] for name in counts})
    finally:
        await fs.fs.release(fh)


def test_a_cycle_of_small_rewrites_is_cut_without_a_chunker_each(inproc, commit_work):
    """The fsync after 16 random 4 KiB rewrites names them as 16 chunks with
    one native call over one read of the log (they lie next to each other
    there), not a chunker and a read per rewrite, and punches each out of
    the committed map with a lookup of the one extent holding it, not a scan
    each, and counts the reference the split extent's chunk gains without
    decoding its record; the file reads back right, and fsck finds every
    record (refcounts included) right after a crash. The committer reads the
    chunks' bytes for the index's copy of them (`logredo`) in one read per
    run adjacent in the log too."""
    rng = random.Random(5)
    expect = bytearray(rng.randbytes(FILE_BYTES))
    fs = inproc(["pmem_size=64M"])
    ino = fs.run(lambda fs: fs.write_file("/f", bytes(expect)))
    per_fsync: list[dict[str, int]] = []
    fs.run(_rewrite_cycles, ino, rng, 8, expect, commit_work, per_fsync)
    # (The first write after the open starts a stream, cut by a chunker of its own.)
    # The all-zero rewrite is a hole: its log space, between the others', goes
    # back, so the committer reads the other 15 in at most two pieces.
    assert all(cycle.pop("redo_reads") <= 2 for cycle in per_fsync[1:])
    # The chunk each rewrite splits gains a reference: its record's count
    # changes, nothing of it is decoded (only a chunk losing its last
    # reference is: a rewrite over an earlier one).
    assert all(cycle.pop("chunk_decodes") <= 3 for cycle in per_fsync[1:])
    assert per_fsync[1:] == [{"chunkers": 0, "reads": 1, "map_scans": 0}] * 7
    assert fs.run(lambda fs: fs.read_file("/f")) == expect
    fs.close()                      # as a crash leaves it: nothing more flushed
    assert fs.fsck().returncode == 0
    again = inproc(source=fs.source)
    assert again.run(lambda fs: fs.read_file("/f")) == expect
    # The rewrites are 4 KiB chunks of their own (the zero ones holes).
    assert sum(c.length == 4 * KiB for c in ix.scan_chunks(again.fs.index)) > 8 * 12


def test_a_small_file_written_and_closed_makes_one_chunker(inproc, commit_work):
    """A file written front to back and closed is cut by its stream's
    chunker; the cut at its commit leaves no fresh chunker behind for bytes
    that never come (one chunker per small file, not two: a chunker costs
    16-25 us to make). A stream written on after an fsync's cut gets one
    when its bytes arrive, and cuts them as before."""
    rng = random.Random(7)
    fs = inproc(["pmem_size=64M"])
    files = {f"/s{i}": rng.randbytes(4 * KiB) for i in range(20)}

    async def write_all(fs):
        for path, data in files.items():
            await fs.write_file(path, data)

    fs.run(write_all)
    assert commit_work["chunkers"] == len(files)
    # A stream continued after an fsync: its tail is cut by a chunker made
    # when the bytes after the cut arrive.
    head, tail = rng.randbytes(3 * MiB), rng.randbytes(2 * MiB + 5)

    async def write_on(fs):
        parent, name = fs._parent("/long")
        fh, attrs = fs.fs.create(parent, name, 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
        for off in range(0, len(head), MiB):
            await fs.fs.write(fh, off, head[off:off + MiB])
        await fs.fs.fsync(fh)
        made = commit_work["chunkers"]
        for off in range(0, len(tail), MiB):
            await fs.fs.write(fh, len(head) + off, tail[off:off + MiB])
        await fs.fs.flush(fh)
        await fs.fs.release(fh)
        fs.fs.forget(attrs.inode.ino, 1)
        return made

    made_at_fsync = fs.run(write_on)
    assert commit_work["chunkers"] == made_at_fsync + 1
    for path, data in files.items():
        assert fs.run(lambda fs: fs.read_file(path)) == data
    assert fs.run(lambda fs: fs.read_file("/long")) == head + tail
    fs.close()                      # as a crash leaves it
    assert fs.fsck().returncode == 0
    again = inproc(source=fs.source)
    assert again.run(lambda fs: fs.read_file("/long")) == head + tail
    assert again.run(lambda fs: fs.read_file("/s7")) == files["/s7"]


def test_rewrite_cycles_wait_for_a_checkpoint_of_their_own(inproc, commit_work, tmp_path):
    """A cycle of 16 random 4 KiB rewrites + fsync is one journaled record
    (with its 64 KiB of log bytes, `logredo`) that waits in the index's
    reserve for a checkpoint. With a 32 MiB reserve (the journal's minimum
    before) the page-per-key estimate of ~150 keys a cycle filled it every
    ~10 cycles: a `reserve` checkpoint, an LMDB transaction with its two
    syncs, at every tenth fsync. On a disk with room the reserve is 128 MiB
    and 48 cycles take no checkpoint for room; the file reads back right
    after a crash, fsck clean."""
    st = os.statvfs(tmp_path)
    if st.f_blocks * st.f_frsize // ix.JOURNAL_RESERVE_DISK_FRACTION < 128 * MiB:
        pytest.skip("a small disk keeps a smaller reserve")
    rng = random.Random(6)
    expect = bytearray(rng.randbytes(64 * MiB))
    fs = inproc(["pmem_size=256M"])
    ino = fs.run(lambda fs: fs.write_file("/f", bytes(expect)))
    fs.run(_rewrite_cycles, ino, rng, 160, expect, commit_work, [], len(expect))
    reasons = dict(fs.index.checkpoint_reasons)
    assert reasons.get("reserve", 0) == 0 and reasons.get("room", 0) == 0, reasons
    assert fs.index.journal_records_total >= 160
    fs.close()                              # the crash: what the journal holds is replayed
    again = inproc(["pmem_size=256M"], source=fs.source)
    assert again.run(lambda f: f.read_file("/f")) == bytes(expect)
    again.close()
    res = again.fsck()
    assert res.returncode == 0, f"fsck:\n{res.stdout}\n{res.stderr}"


def test_a_cycles_punches_look_the_map_up_once_and_change_it_in_one_step(inproc, monkeypatch):
    """The fsync after 16 random 4 KiB rewrites takes the extent map's
    layers once for every look-up of its punches (not once per look-up:
    17-33 a cycle), changes the map in one step (no extent deleted or split
    off one call at a time) and gives the 16 split extents' chunks their
    new references in one step too (no chunk record put one at a time but
    for a chunk losing references); the file reads back right, and after a
    crash too, fsck clean (refcounts and data_bytes included)."""
    counts = {"extents_layers": 0, "extents_one_by_one": 0, "chunks_one_by_one": 0}
    real_layers, real_put, real_delete = ix.Index._layers, ix.Index._put, ix.Index._delete

    def note(name: str) -> None:
        counts[name] += 1

    def layers(self, db):
        if db == "extents":
            note("extents_layers")
        return real_layers(self, db)

    def put(self, db, key, value):
        if db in ("extents", "chunks"):
            note(db + "_one_by_one")
        return real_put(self, db, key, value)

    def delete(self, db, key):
        if db == "extents":
            note("extents_one_by_one")
        return real_delete(self, db, key)

    monkeypatch.setattr(ix.Index, "_layers", layers)
    monkeypatch.setattr(ix.Index, "_put", put)
    monkeypatch.setattr(ix.Index, "_delete", delete)
    rng = random.Random(9)
    expect = bytearray(rng.randbytes(FILE_BYTES))
    fs = inproc(["pmem_size=64M"])
    ino = fs.run(lambda fs: fs.write_file("/f", bytes(expect)))
    per_fsync: list[dict[str, int]] = []
    fs.run(_rewrite_cycles, ino, rng, 8, expect, counts, per_fsync)
    for cycle in per_fsync:
        # Once, and twice more for a scan: a rewrite into a hole an earlier
        # all-zero rewrite left (nothing holds its first byte) is looked for
        # by a scan of the map, as before.
        assert cycle.get("extents_layers", 0) <= 3, per_fsync
        assert cycle.get("extents_one_by_one", 0) == 0, per_fsync
        # A chunk losing a reference (a rewrite over an earlier one) is put
        # on its own; the 16 gaining one are not.
        assert cycle.get("chunks_one_by_one", 0) <= 3, per_fsync
    assert fs.run(lambda fs: fs.read_file("/f")) == expect
    fs.close()
    assert fs.fsck().returncode == 0
    again = inproc(source=fs.source)
    assert again.run(lambda fs: fs.read_file("/f")) == expect


def test_rewrites_in_one_extent_touching_and_across_extents_punch_as_one_by_one(inproc):
    """A commit punches all its ranges out of the map as it was before any
    (one look-up set, one change): several rewrites inside one committed
    extent, touching ones (one run), ones across an extent boundary, a
    range longer than a small punch, a hole, a rewrite of bytes written a
    cycle before; the file reads back as written, its data_bytes and every
    chunk's refcount right (fsck, after a crash too)."""
    rng = random.Random(12)
    size = 3 * MiB + 5 * KiB
    expect = bytearray(rng.randbytes(size))
    fs = inproc(["pmem_size=64M"])
    ino = fs.run(lambda fs: fs.write_file("/f", bytes(expect)))

    async def cycles(fs):
        fh = fs.fs.open(ino, os.O_WRONLY)
        try:
            for cycle in range(12):
                writes = []
                base = rng.randrange(size - 400 * KiB)
                writes += [(base + 1000, 3000), (base + 9 * KiB, 4 * KiB)]        # one extent
                writes += [(base + 20 * KiB, 4 * KiB), (base + 24 * KiB, 6 * KiB)]  # touching
                writes.append((base + 40 * KiB, 100 * KiB))                       # past a small punch
                writes.append((rng.randrange(size - 8 * KiB), 7 * KiB + 3))        # anywhere
                writes.append((size - 2 * KiB - rng.randrange(4 * KiB), 2 * KiB))  # at the end
                if cycle:
                    writes.append((last, 4 * KiB))                                # last cycle's bytes
                for k, (off, n) in enumerate(writes):
                    data = bytes(n) if k == 3 and cycle % 3 == 0 else rng.randbytes(n)
                    await fs.fs.write(fh, off, data)
                    expect[off:off + n] = data
                last = base + 21 * KiB
                await fs.fs.fsync(fh)
                # Across the boundaries the last commit made: a small write over two extents.
                await fs.fs.write(fh, base + 22 * KiB, b"x" * 4 * KiB)
                expect[base + 22 * KiB:base + 26 * KiB] = b"x" * 4 * KiB
                await fs.fs.fsync(fh)
        finally:
            await fs.fs.release(fh)

    fs.run(cycles)
    assert fs.run(lambda fs: fs.read_file("/f")) == expect
    inode = ix.get_inode(fs.index, ino)
    assert inode.data_bytes == sum(e.length for e in ix.iter_extents(fs.index, ino))
    fs.close()
    res = fs.fsck()
    assert res.returncode == 0, f"fsck:\n{res.stdout}\n{res.stderr}"
    again = inproc(source=fs.source)
    assert again.run(lambda fs: fs.read_file("/f")) == expect
