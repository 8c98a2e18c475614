"""The index journal (ckptfs/journal.py): a durable commit is one record and
one flush; LMDB holds only checkpoints. Crashes between a journaled commit and
its checkpoint, torn and stale records, replaying twice, a crash during a
checkpoint, and a SIGKILL of a real mount: every acknowledged commit comes
back exactly, nothing unacknowledged comes back half, fsck is clean.

The in-process cases use tests/inproc.py: `close()` is a crash (nothing is
flushed or checkpointed at it), a new InProcess is the next mount.
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path

import lmdb
import pytest
import trio

from ckptfs import debugpause
from ckptfs import index as ix
from ckptfs import journal as jr
from inproc import InProcess

KiB = 1 << 10
OPTS = ["pmem_size=64M", "tiering=off"]


def contents(rng: random.Random, n: int) -> dict[str, bytes]:
    return {f"d/f{i:03d}": rng.randbytes(rng.choice((100, 4 * KiB, 70 * KiB))) for i in range(n)}


async def write_all(fs: InProcess, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        await fs.write_file(path, data)          # sync=close: durable when it returns


async def read_all(fs: InProcess, paths) -> dict[str, bytes]:
    return {p: await fs.read_file(p) for p in paths}


def mkdir_d(fs: InProcess) -> None:
    if fs.lookup("d") is None:
        fs.mkdir("d")


def crash_after_writing(inproc, files: dict[str, bytes]) -> InProcess:
    """An opening that wrote files (each closed: journaled), then crashed."""
    fs = inproc(OPTS)

    async def main(fs):
        mkdir_d(fs)
        await write_all(fs, files)

    fs.run(main)
    fs.close()
    return fs


def journal_state(source: Path) -> tuple[int, int]:
    """(generation, applied seq) as LMDB holds them, read without ckptfs
    (an Index would replay)."""
    env = lmdb.open(str(source / ".ckptfs" / "index"), max_dbs=32, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            raw = txn.get(b"journal", db=env.open_db(b"meta", txn=txn, create=False))
    finally:
        env.close()
    return ix._JOURNAL_META.unpack(raw)


def journal_path(source: Path) -> str:
    return str(source / ".ckptfs" / "index" / jr.JOURNAL_NAME)


def valid_records(source: Path) -> list[int]:
    gen, applied = journal_state(source)
    return [seq for seq, _ in jr.read_records(journal_path(source), gen, applied)]


def reopen(inproc, fs: InProcess, caplog) -> tuple[InProcess, int]:
    """The next mount, and how many journal records its opening replayed (the
    first opening of the index does it: the daemon's look for an index)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ckptfs.index"):
        again = inproc(OPTS, source=fs.source)
    found = [int(m.group(1)) for r in caplog.records
             for m in [re.search(r"replayed (\d+) journaled commits", r.getMessage())] if m]
    return again, sum(found)


def check_fsck(fs: InProcess) -> None:
    res = fs.fsck()
    assert res.returncode == 0, f"fsck:\n{res.stdout}\n{res.stderr}"


def test_journaled_commits_come_back_after_a_crash_before_any_checkpoint(inproc, tmp_path, caplog):
    """Files closed (sync=close) are journaled, not in LMDB; a crash before a
    checkpoint loses none of them: the next opening replays every record."""
    files = contents(random.Random(1), 40)
    fs = inproc(OPTS)

    async def main(fs):
        mkdir_d(fs)
        await write_all(fs, files)
        return fs.index.checkpoints, fs.index._journal.records

    checkpoints, records = fs.run(main)
    assert checkpoints == 0 and records >= 40
    fs.close()                                  # the crash: no checkpoint at it
    assert len(valid_records(fs.source)) == records
    again, n_replayed = reopen(inproc, fs, caplog)
    assert n_replayed == records
    assert again.run(lambda f: read_all(f, files)) == files
    again.close()
    check_fsck(again)


def test_a_torn_record_ends_the_replay_and_was_never_acknowledged(inproc):
    """A record whose bytes did not all reach the disk (its flush never
    returned, so nobody was told) fails its CRC: the replay stops there and
    the state is the one before it, whole."""
    fs = inproc(OPTS)
    rng = random.Random(2)
    first = {"d/a": rng.randbytes(5000)}
    second = {"d/b": rng.randbytes(5000)}

    async def main(fs):
        mkdir_d(fs)
        await write_all(fs, first)
        at = fs.index._journal.used_bytes
        await write_all(fs, second)
        return at, fs.index._journal.used_bytes

    torn_at, end = fs.run(main)
    fs.close()
    assert end > torn_at
    # Tear what came after `first`: the half of it a cut-off write may leave.
    fd = os.open(journal_path(fs.source), os.O_RDWR)
    try:
        half = (torn_at + end) // 2
        os.pwrite(fd, bytes(end - half), half)
    finally:
        os.close(fd)
    again = inproc(OPTS, source=fs.source)
    assert again.lookup("d/b") is None
    assert again.run(lambda f: read_all(f, first)) == first
    again.close()
    check_fsck(again)


def test_records_from_before_a_checkpoint_are_never_replayed(inproc, monkeypatch, caplog):
    """After a checkpoint the journal starts over at offset 0 with a new
    generation: the longer run of older records still on disk past the new
    ones is not replayed (it would bring an unlinked file back)."""
    monkeypatch.setattr(ix, "JOURNAL_IDLE_CHECKPOINT_S", 0.3)
    files = contents(random.Random(3), 30)
    fs = inproc(OPTS)

    async def main(fs):
        mkdir_d(fs)
        await write_all(fs, files)
        used = fs.index._journal.used_bytes
        while fs.index.checkpoints == 0:         # idle: the committer checkpoints
            await trio.sleep(0.05)
        assert fs.index._journal.used_bytes == 0
        fs.unlink("d/f000")
        await fs.index.wait_durable(fs.index.current_seq())
        return used, fs.index._journal.used_bytes

    old_end, new_end = fs.run(main)
    fs.close()
    assert 0 < new_end < old_end
    assert len(valid_records(fs.source)) == 1
    again, n_replayed = reopen(inproc, fs, caplog)
    assert n_replayed == 1
    assert again.lookup("d/f000") is None
    rest = {p: d for p, d in files.items() if p != "d/f000"}
    assert again.run(lambda f: read_all(f, rest)) == rest
    again.close()
    check_fsck(again)


def test_a_record_of_another_generation_is_never_replayed(inproc, caplog):
    """A whole record with the right seq but another generation (a leftover
    the new generation's records never overwrote) ends the replay."""
    fs = crash_after_writing(inproc, {"d/x": b"x" * 3000})
    gen, applied = journal_state(fs.source)
    records = list(jr.read_records(journal_path(fs.source), gen, applied))
    assert records
    # The same payloads, rewritten as another generation's.
    fd = os.open(journal_path(fs.source), os.O_RDWR)
    try:
        pos = 0
        for seq, payload in records:
            tables: dict[str, list] = {}
            for table, key, value in jr.decode_payload(payload):
                tables.setdefault(table, []).append((key, value))
            rec = jr.encode_record(gen ^ 1, seq, tables)
            os.pwrite(fd, rec, pos)
            pos += len(rec)
    finally:
        os.close(fd)
    again, n_replayed = reopen(inproc, fs, caplog)
    assert n_replayed == 0
    assert again.lookup("d") is None
    again.close()
    check_fsck(again)


def test_replaying_twice_gives_the_same_state(inproc, caplog):
    """The records hold values, not changes: replayed over a state that
    already has them (a crash right after the replay's transaction, with the
    old generation put back) the filesystem is the same, fsck clean."""
    rng = random.Random(5)
    files = contents(rng, 20)
    fs = inproc(OPTS)

    async def main(fs):
        mkdir_d(fs)
        await write_all(fs, files)
        fs.unlink("d/f001")
        await write_all(fs, {"d/f002": b"rewritten"})

    fs.run(main)
    fs.close()
    want = {p: d for p, d in files.items() if p != "d/f001"}
    want["d/f002"] = b"rewritten"
    before = journal_state(fs.source)
    first, n = reopen(inproc, fs, caplog)
    assert n > 0
    first.close()
    # Put the generation and seq of before the replay back: the next opening
    # replays the same records again, over their own results.
    env = lmdb.open(str(fs.source / ".ckptfs" / "index"), max_dbs=32)
    with env.begin(write=True) as txn:
        txn.put(b"journal", ix._JOURNAL_META.pack(*before),
                db=env.open_db(b"meta", txn=txn))
    env.close()
    second, n_replayed = reopen(inproc, fs, caplog)
    assert n_replayed == n
    assert second.lookup("d/f001") is None
    assert second.run(lambda f: read_all(f, want)) == want
    second.close()
    check_fsck(second)


def test_a_crash_during_a_checkpoint_loses_nothing(inproc, monkeypatch, tmp_path, caplog):
    """The checkpoint's LMDB transaction fails before it commits (LMDB keeps
    the checkpoint before it, whole): the journal still holds every batch,
    and the next opening replays them."""
    monkeypatch.setattr(ix, "JOURNAL_IDLE_CHECKPOINT_S", 0.3)
    flag = tmp_path / "fail-now"
    monkeypatch.setattr(debugpause, "DEBUG_FAIL", f"checkpoint:{flag}")
    monkeypatch.setattr(debugpause, "_failed_once", False)
    files = contents(random.Random(6), 25)
    fs = inproc(OPTS)

    async def main(fs):
        mkdir_d(fs)
        await write_all(fs, files)
        flag.write_bytes(b"")
        while fs.index.failure is None:          # the idle checkpoint fails
            await trio.sleep(0.05)
        return fs.index.checkpoints

    assert fs.run(main) == 0
    fs.close()
    again, n_replayed = reopen(inproc, fs, caplog)
    assert n_replayed > 0
    assert again.run(lambda f: read_all(f, files)) == files
    again.close()
    check_fsck(again)


def test_a_clean_unmount_checkpoints_everything(inproc, caplog):
    """At unmount the journaled batches go into LMDB: the next opening
    replays nothing."""
    files = contents(random.Random(7), 10)
    fs = inproc(OPTS)

    async def main(fs):
        mkdir_d(fs)
        await write_all(fs, files)
        return fs.index._journal.records

    assert fs.run(main) > 0
    fs.shutdown()
    assert valid_records(fs.source) == []
    again, n_replayed = reopen(inproc, fs, caplog)
    assert n_replayed == 0
    assert again.run(lambda f: read_all(f, files)) == files


def test_a_full_journal_checkpoints_and_goes_on(inproc, monkeypatch):
    """A record that does not fit in what is left of the journal commits as a
    checkpoint (its batch with every journaled one, in LMDB); the journal then
    starts over. Every file reads back after a crash."""
    monkeypatch.setattr(jr, "JOURNAL_BYTES", 256 * KiB)
    files = contents(random.Random(8), 60)
    fs = inproc(OPTS)

    async def main(fs):
        mkdir_d(fs)
        await write_all(fs, files)
        return fs.index.checkpoints

    assert fs.run(main) >= 2
    fs.close()
    again = inproc(OPTS, source=fs.source)
    assert again.run(lambda f: read_all(f, files)) == files
    again.close()
    check_fsck(again)


def test_a_small_files_commit_is_written_by_the_journals_c_thread(inproc, monkeypatch, caplog):
    """A small file's durable close: its record encoded on the trio thread and
    appended and flushed by the journal's C thread, no Python worker thread
    (`Index._append_small`); a file with more log bytes than the trio thread
    may copy still goes to the worker. Every record is the one the worker
    would write: a crash before any checkpoint replays them all, fsck clean."""
    worker: list[int] = []
    real = ix.Index._write_batch

    def counted(self, batch, persist):
        worker.append(batch.seq)
        return real(self, batch, persist)

    monkeypatch.setattr(ix.Index, "_write_batch", counted)
    rng = random.Random(11)
    small = {f"d/s{i:03d}": rng.randbytes(rng.choice((100, 4 * KiB))) for i in range(30)}
    large = {f"d/l{i:03d}": rng.randbytes(70 * KiB) for i in range(3)}
    fs = inproc(OPTS)

    async def main(fs):
        mkdir_d(fs)
        await fs.index.wait_durable(fs.index.current_seq())
        before = len(worker)
        await write_all(fs, small)
        by_worker_small = len(worker) - before
        await write_all(fs, large)
        return by_worker_small, len(worker) - before, fs.index._journal.records

    by_worker_small, by_worker, records = fs.run(main)
    assert by_worker_small == 0
    assert by_worker >= len(large)          # 70 KiB of log bytes: the worker's
    assert records >= len(small) + len(large)
    fs.close()                              # the crash: no checkpoint at it
    assert len(valid_records(fs.source)) == records
    again, n_replayed = reopen(inproc, fs, caplog)
    assert n_replayed == records
    both = {**small, **large}
    assert again.run(lambda f: read_all(f, both)) == both
    again.close()
    check_fsck(again)


def test_read_views_see_journaled_batches_and_never_change(inproc):
    """read_view (chunkread, fsck, publish, snapshots) sees the journaled
    batches over LMDB; a later batch does not change a view taken before it."""
    fs = inproc(OPTS)

    async def main(fs):
        mkdir_d(fs)
        await write_all(fs, {"d/v": b"1" * 100})
        ino = fs.lookup("d/v")
        view = fs.index.read_view()
        try:
            assert ix.get_inode(view, ino).size == 100
            await write_all(fs, {"d/v": b"2" * 200, "d/w": b"3"})
            assert ix.get_inode(view, ino).size == 100
            assert ix.lookup_entry(view, fs.lookup("d"), b"w") is None
        finally:
            view.close()
        with fs.index.read_view() as view:
            assert ix.get_inode(view, ino).size == 200
            assert [n for n, _, _ in ix.list_entries(view, fs.lookup("d"))] == [b"v", b"w"]
        assert fs.index.checkpoints == 0

    fs.run(main)


def test_a_view_taken_while_a_checkpoint_lands_sees_that_checkpoint_whole(inproc, monkeypatch):
    """A checkpoint's LMDB transaction commits on the committer's worker; the
    trio thread drops the journaled layer only after. A read_view taken in
    between sees LMDB with the layer and the checkpoint's own batch in it: the
    layer over that would give the batch's keys their older values, mixed
    with its newer ones elsewhere."""
    fs = inproc(OPTS)
    index = fs.index
    seen: list[tuple[int, bool]] = []
    real_commit = index._lmdb_commit

    def commit_then_look(batch, extra, journal):
        real_commit(batch, extra, journal)
        if batch.checkpointed:
            # What the publisher or a read window would take on the trio
            # thread right now, before the committer's trio side runs.
            view = trio.from_thread.run_sync(index.read_view)
            try:
                ino = trio.from_thread.run_sync(fs.lookup, "d/v")
                seen.append((ix.get_inode(view, ino).size,
                             ix.lookup_entry(view, trio.from_thread.run_sync(fs.lookup, "d"),
                                             b"w") is not None))
            finally:
                view.close()

    monkeypatch.setattr(index, "_lmdb_commit", commit_then_look)

    async def main(fs):
        mkdir_d(fs)
        await write_all(fs, {"d/v": b"1" * 100})        # journaled
        assert fs.index._journaled and fs.index.checkpoints == 0
        monkeypatch.setattr(jr.Journal, "fits", lambda self, n: False)
        await write_all(fs, {"d/v": b"2" * 200})        # does not fit: a checkpoint
        await write_all(fs, {"d/w": b"3"})
        assert fs.index.checkpoints >= 1

    fs.run(main)
    assert seen and seen[0] == (200, False), seen


def test_sigkill_between_journaled_commits_and_their_checkpoint(make_mount):
    """A real mount, files closed one by one with sync=close, then SIGKILL
    before the idle checkpoint: every closed file is there after the next
    mount (it replays the journal), fsck clean."""
    m = make_mount(["pmem_size=256M", "sync=close", "tiering=off"])
    rng = random.Random(9)
    files = {f"k{i:03d}": rng.randbytes(4 * KiB) for i in range(100)}
    for name, data in files.items():
        with open(m.path / name, "wb") as f:
            f.write(data)
    m.kill()
    assert len(valid_records(m.source)) > 0        # nothing checkpointed them
    m.start()
    for name, data in files.items():
        assert (m.path / name).read_bytes() == data, name
    m.umount()
    res = m.fsck()
    assert res.returncode == 0, res.stdout


def test_the_journal_is_never_made_or_opened_through_a_symlink(tmp_path):
    """The index directory is the daemon's, but a symlink planted under the
    journal's names (its temporary one included) is neither followed when the
    journal is made nor when it is opened: the target is left as it was."""
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    path = str(index_dir / jr.JOURNAL_NAME)
    os.symlink(target, path + ".creating")
    assert jr.create(path, 64 * KiB)
    assert target.read_bytes() == b"keep me"
    assert not os.path.islink(path) and os.path.getsize(path) == 64 * KiB
    os.unlink(path)
    os.symlink(target, path)
    with pytest.raises(OSError):
        jr.Journal(path, 1, 1)
    with pytest.raises(OSError):
        list(jr.read_records(path, 1, 0))
    assert target.read_bytes() == b"keep me"


def test_a_replay_without_room_for_one_transaction_applies_each_record_alone(
        inproc, monkeypatch, caplog):
    """On a full disk one transaction holding every journaled batch may not
    fit where the batches one by one did: the replay then applies each record
    in a transaction of its own (its seq with it), then the new generation.
    (tests/crash/test_index_full.py's kill -9 on a full ext4 lands here.)"""
    files = contents(random.Random(10), 15)
    fs = crash_after_writing(inproc, files)
    records = len(valid_records(fs.source))
    apply = ix.Index._apply_records
    sizes = []

    def no_room_for_many(self, recs, generation, last=None):
        sizes.append(len(recs))
        if len(recs) > 1:
            raise ix.IndexFull("no room (injected)")
        return apply(self, recs, generation, last)

    monkeypatch.setattr(ix.Index, "_apply_records", no_room_for_many)
    again, n_replayed = reopen(inproc, fs, caplog)
    assert n_replayed == records
    assert sizes[:records + 2] == [records] + [1] * records + [0]
    assert again.run(lambda f: read_all(f, files)) == files
    again.close()
    check_fsck(again)


def test_an_eio_at_replay_is_no_full_disk_unless_the_disk_is_full(inproc, monkeypatch):
    """The replay's transaction fails with EIO: on a disk with room that is a
    disk error (the opening fails with it), not "no room, free some space"
    (IndexFull, and one transaction per record first); with the disk's free
    space below the reserve's minimum it is the short write of a full disk
    (IndexFull). The free space comes from the index's path: no data.mdb fd
    is open at the replay."""
    files = contents(random.Random(11), 5)
    fs = crash_after_writing(inproc, files)
    assert valid_records(fs.source)

    def eio(self, txn, ops):
        raise lmdb.Error("mdb_txn_commit: Input/output error")

    monkeypatch.setattr(ix.Index, "_apply_ops", eio)
    with pytest.raises(lmdb.Error, match="Input/output error") as info:
        inproc(OPTS, source=fs.source)
    assert not isinstance(info.value, ix.IndexFull)
    monkeypatch.setattr(ix.Index, "_disk_free_bytes", lambda self: 0)
    with pytest.raises(ix.IndexFull, match="no room in .* to replay"):
        inproc(OPTS, source=fs.source)
    monkeypatch.undo()
    again = inproc(OPTS, source=fs.source)
    assert again.run(lambda f: read_all(f, files)) == files
    again.close()
    check_fsck(again)
