"""The index's overlay and group commit, without FUSE: real LMDB in a temp dir."""

from __future__ import annotations

import dataclasses
import os
import random
import time

import trio
from sortedcontainers import SortedDict

from ckptfs import index as ix
from ckptfs.index import Index


def keys(n: int) -> bytes:
    return ix.u64(n)


def random_changes(index: Index, model: dict, rng: random.Random, tables: tuple[str, ...],
                   n_keys: int, n: int, p_delete: float) -> None:
    """n random puts and deletes among keys(0..n_keys) of tables, made to
    the index and to model alike."""
    for _ in range(n):
        db = rng.choice(tables)
        key = keys(rng.randrange(n_keys))
        if rng.random() < p_delete:
            index._delete(db, key)
            model.pop((db, key), None)
        else:
            value = rng.randbytes(8)
            index._put(db, key, value)
            model[(db, key)] = value


def committed_index(tmp_path, values: dict[int, bytes]) -> Index:
    index = Index(str(tmp_path / "index"))
    index.write_direct(lambda txn: [txn._put("xattrs", keys(k), v) for k, v in values.items()])
    return index


def test_items_merges_pending_over_committed_in_both_directions(tmp_path):
    rng = random.Random(7)
    committed = {k: f"c{k}".encode() for k in rng.sample(range(200), 80)}
    index = committed_index(tmp_path, committed)
    model = dict(committed)
    for _ in range(120):
        k = rng.randrange(200)
        if rng.random() < 0.4:
            index._delete("xattrs", keys(k))
            model.pop(k, None)
        else:
            index._put("xattrs", keys(k), f"p{k}".encode())
            model[k] = f"p{k}".encode()
    for lo, hi in ((0, 200), (17, 150), (50, 51), (199, 400)):
        want = [(keys(k), model[k]) for k in sorted(model) if lo <= k < hi]
        assert list(index._items("xattrs", keys(lo), keys(hi))) == want
        assert list(index._items("xattrs", keys(lo), keys(hi), reverse=True)) == want[::-1]
    for k in range(200):
        assert index._get("xattrs", keys(k)) == model.get(k)
    index.close()


def test_floor_below_finds_what_a_reverse_scan_finds_first(tmp_path):
    """`_floor_below` (the commit's punch lookup) against the merged reverse
    scan, over committed keys under a sealed batch being committed and an open
    one, both with puts and pending deletions (runs of them: the floor may
    have to step down past several)."""
    rng = random.Random(11)
    committed = {k: f"c{k}".encode() for k in rng.sample(range(300), 150)}
    index = committed_index(tmp_path, committed)
    model = dict(committed)

    def change(n: int) -> None:
        for _ in range(n):
            k = rng.randrange(300)
            if rng.random() < 0.5:
                for j in range(k, min(k + rng.randrange(1, 6), 300)):
                    index._delete("xattrs", keys(j))
                    model.pop(j, None)
            else:
                index._put("xattrs", keys(k), f"p{k}".encode())
                model[k] = f"p{k}".encode()

    def check() -> None:
        for lo in (0, 40, 150, 299):
            for below in range(lo, 310):
                want = next(index._items("xattrs", keys(lo), keys(below), reverse=True), None)
                assert index._floor_below("xattrs", keys(lo), keys(below)) == want, (lo, below)
                live = [k for k in model if lo <= k < below]
                assert want == ((keys(max(live)), model[max(live)]) if live else None)

    change(60)
    check()
    # Seal the open batch as the committer does (it is then being committed).
    index._committing, index._open = index._open, ix.Batch(seq=index._open.seq + 1)
    change(60)
    check()
    index.close()


def test_batches_commit_in_order_and_become_durable(tmp_path):
    index = Index(str(tmp_path / "index"))
    persisted: list[list[tuple[int, int]]] = []

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, persisted.append, trio.CapacityLimiter(1))
            index._put("xattrs", keys(1), b"one")
            index.persist_before_commit(4096, 100)
            first = index.current_seq()
            await index.wait_durable(first)
            index._put("xattrs", keys(1), b"two")
            index._put("xattrs", keys(2), b"x")
            await index.wait_durable(index.current_seq())
            assert index.durable_seq >= first + 1
            index.stop()

    trio.run(main)
    assert persisted == [[(4096, 100)]]
    index.close()
    reopened = Index(str(tmp_path / "index"))
    assert reopened._get("xattrs", keys(1)) == b"two"
    assert reopened._get("xattrs", keys(2)) == b"x"
    reopened.close()


def test_a_batch_of_puts_only_and_one_with_deletes_commit_alike(tmp_path):
    """A table whose layer holds only puts goes into LMDB in one bulk call
    (`_apply_layers`); one with deletes key by key. Both end as the model."""
    committed = {k: f"c{k}".encode() for k in range(0, 400, 2)}
    index = committed_index(tmp_path, committed)
    model = dict(committed)
    rng = random.Random(5)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, lambda ranges: None, trio.CapacityLimiter(1))
            # puts only: new keys and overwrites of committed ones
            for k in rng.sample(range(400), 300):
                index._put("xattrs", keys(k), f"p{k}".encode())
                model[k] = f"p{k}".encode()
            await index.wait_durable(index.current_seq())
            # puts and deletes in one layer
            for k in rng.sample(range(400), 200):
                if k % 3:
                    index._delete("xattrs", keys(k))
                    model.pop(k, None)
                else:
                    index._put("xattrs", keys(k), f"q{k}".encode())
                    model[k] = f"q{k}".encode()
            await index.wait_durable(index.current_seq())
            index.stop()

    trio.run(main)
    index.close()
    reopened = Index(str(tmp_path / "index"))
    assert list(reopened._items("xattrs", keys(0), keys(400))) == [
        (keys(k), model[k]) for k in sorted(model)]
    reopened.close()


def test_freed_space_callback_runs_only_after_commit(tmp_path):
    index = Index(str(tmp_path / "index"))
    events: list[str] = []

    def persist(ranges):
        events.append("persist")

    async def main():
        async with trio.open_nursery() as nursery:
            index._put("xattrs", keys(3), b"v")
            index.after_durable(lambda: events.append("released"))
            index.persist_before_commit(0, 1)
            nursery.start_soon(index.run_committer, persist, trio.CapacityLimiter(1))
            await index.wait_durable(index.current_seq())
            index.stop()

    trio.run(main)
    assert events == ["persist", "released"]
    index.close()


def test_small_batch_carries_its_log_bytes_and_persists_them_before_dropping_them(tmp_path,
                                                                                 monkeypatch):
    """A batch with few new log bytes is durable without a log persist: its
    bytes are in its own transaction (logredo). Once enough wait, a later
    batch persists every waiting range first and drops the records in its
    transaction; stopping does the same for what is left."""
    log_bytes = bytearray(random.Random(3).randbytes(1 << 20))
    events: list[object] = []
    monkeypatch.setattr(ix, "REDO_PENDING_MAX_BYTES", 3 * 4096)

    def read_log(off: int, length: int) -> bytes:
        return bytes(log_bytes[off:off + length])

    def records() -> list[tuple[int, int, bytes]]:
        view = index.read_view()
        try:
            return [(off, no, bytes(data)) for _, off, _, no, data in ix.scan_log_redo(view)]
        finally:
            view.close()

    index = Index(str(tmp_path / "index"))

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, events.append, trio.CapacityLimiter(1),
                               0.0, read_log)
            for i in range(3):
                index._put("xattrs", keys(i), b"v")
                index.persist_before_commit(i * 8192, 4096, 100 + i)
                await index.wait_durable(index.current_seq())
            assert events == []                     # no persist: the bytes rode along
            assert records() == [(i * 8192, 100 + i, read_log(i * 8192, 4096))
                                 for i in range(3)]
            index._put("xattrs", keys(9), b"v")
            index.persist_before_commit(65536, 4096, 200)   # 4 would wait: persist first
            await index.wait_durable(index.current_seq())
            assert events == [[(65536, 4096), (0, 4096), (8192, 4096), (16384, 4096)]]
            assert records() == []
            index._put("xattrs", keys(10), b"v")
            index.persist_before_commit(131072, 4096, 201)
            await index.wait_durable(index.current_seq())
            assert len(events) == 1 and len(records()) == 1
            index.stop()

    trio.run(main)
    assert events[1:] == [[(131072, 4096)]]          # the last one persisted at stop
    assert records() == []
    index.close()


def test_add_chunks_in_bulk_puts_what_add_chunk_puts_one_by_one(tmp_path):
    """A file's commit adds its new chunks and extents in bulk (`add_chunks`,
    `put_extents`: one sorted merge per table): every table and total must
    come out as with `add_chunk` and `put_extent` per chunk, the kinds the
    bulk path leaves to `add_chunk` included, over keys already pending."""
    rng = random.Random(14)
    chunks = []
    for no in range(1, 400):
        kind = ix.CHUNK_LOG if no % 37 else ix.CHUNK_SOURCE
        chunks.append(ix.Chunk(no, kind, 1 + no % 3, 1000 + no, log_off=no << 16,
                               crcs=b"\1\2\3\4", chunk_id=rng.randbytes(32) if no % 5 else b"",
                               copied=kind == ix.CHUNK_LOG and no % 11 == 0,
                               pack_no=1 if no % 11 == 0 else 0, stored_length=500,
                               source_path=b"/x" if kind == ix.CHUNK_SOURCE else b""))
    extents = [ix.Extent(i * 4096, 4096, i + 1, 0) for i in range(399)]
    tables = ("chunks", "chunkids", "logmap", "unpublished", "extents", "packs")
    seen = []
    for bulk in (False, True):
        index = Index(str(tmp_path / f"index{bulk}"))
        ix.add_chunk(index, ix.Chunk(10_000, ix.CHUNK_LOG, 1, 5, log_off=1 << 40,
                                     chunk_id=b"\7" * 32))
        ix.put_extent(index, 3, ix.Extent(0, 5, 10_000, 0))
        if bulk:
            ix.put_extents(index, 3, extents)
            ix.add_chunks(index, chunks)
        else:
            for e in extents:
                ix.put_extent(index, 3, e)
            for c in chunks:
                ix.add_chunk(index, c)
        lo, hi = b"", b"\xff" * 64
        seen.append(({t: list(index._items(t, lo, hi)) for t in tables}, dict(index.counters)))
        index.close()
    assert seen[0][0]["logmap"] and seen[0][0]["unpublished"]
    assert seen[1] == seen[0]


def test_a_commit_is_durable_for_its_waiters_before_the_room_is_measured(tmp_path):
    """The reserve's upkeep after a commit (measuring the room, writing zeros
    ahead) runs after the commit's waiters are told, not on their fsync's
    path; the next transaction waits for it, and until it is done the
    batch's growth stays promised (the room counted is never more than there
    is)."""
    index = Index(str(tmp_path / "index"))
    index.keep_reserve()
    real_refill = index._refill_reserve
    upkeep: list[tuple[float, float]] = []
    commits: list[float] = []

    def slow_refill():
        started = time.monotonic()
        time.sleep(0.3)
        try:
            return real_refill()
        finally:
            upkeep.append((started, time.monotonic()))

    write_batch = index._write_batch

    def timed_write_batch(batch, persist):
        commits.append(time.monotonic())
        return write_batch(batch, persist)

    index._refill_reserve = slow_refill
    index._room_without_upkeep = lambda: None      # upkeep due after every commit
    index._write_batch = timed_write_batch
    waited: list[float] = []
    woke: list[float] = []
    promised_after_wait: list[int] = []

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, lambda ranges: None,
                               trio.CapacityLimiter(1))
            for batch in range(3):
                index.admit(10_000)
                index._put("xattrs", keys(batch), bytes(3000))
                t0 = time.monotonic()
                await index.wait_durable(index.current_seq())
                woke.append(time.monotonic())
                waited.append(woke[-1] - t0)
                promised_after_wait.append(index._promised_total)
                await trio.sleep(0.4)      # the writer's own work before its next fsync
            index.stop()

    trio.run(main)
    # Told before the upkeep that follows its commit ended (a wait that took
    # the upkeep's 0.3 s on top would end after it). Not a time limit: a
    # commit's own flushes took 0.33 s on a disk busy with other work.
    assert len(upkeep) >= 3, upkeep
    for i, at in enumerate(woke):
        assert at < upkeep[i][1], (i, waited, upkeep)
    assert promised_after_wait[0] >= 10_000       # still promised while the room is measured
    assert index._promised_total == 0
    # Each transaction after the first began once the upkeep before it ended.
    ends = [end for _, end in upkeep]
    for begun in commits[1:]:
        assert any(end <= begun for end in ends)
    index.close()


def test_a_commit_with_no_upkeep_due_measures_the_room_on_its_own_worker(tmp_path):
    """When the reserve needs no upkeep after a commit (no pages to count,
    nothing to preallocate or write ahead), the committer's worker measures
    the room right after the transaction: one thread hop per commit, not two,
    and the same room `_refill_reserve` measures. When upkeep is due, the
    second hop does it, after the waiters are told."""
    index = Index(str(tmp_path / "index"))
    index.keep_reserve()
    real_refill = index._refill_reserve
    refills: list[int] = []
    hops: list[str] = []

    def counted_refill():
        refills.append(1)
        return real_refill()

    index._refill_reserve = counted_refill
    real_to_thread = trio.to_thread.run_sync

    async def counted_to_thread(fn, *args, **kw):
        hops.append(getattr(fn, "__name__", repr(fn)))
        return await real_to_thread(fn, *args, **kw)

    rooms: list[tuple[int, int]] = []

    async def main():
        trio.to_thread.run_sync = counted_to_thread
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(index.run_committer, lambda ranges: None,
                                   trio.CapacityLimiter(1))
                for batch in range(20):
                    index.admit(10_000)
                    index._put("xattrs", keys(batch), os.urandom(3000))
                    await index.wait_durable(index.current_seq())
                    await trio.sleep(0.01)
                    # What the full upkeep would measure now (nothing due: no change).
                    rooms.append((index.room_bytes, real_refill()))
                index.stop()
        finally:
            trio.to_thread.run_sync = real_to_thread

    trio.run(main)
    assert refills == [], refills
    assert hops.count("counted_refill") == 0
    assert len(hops) == 20, hops
    assert all(measured == full for measured, full in rooms), rooms
    assert index._promised_total == 0
    index.close()


def test_a_batch_carries_only_the_counters_that_changed(tmp_path):
    """Each sealed batch puts only the counters changed since the last sealed
    one (all 15 before); the durable counters stay exact across commits and
    a reopen, a counter changed and changed back included."""
    index = Index(str(tmp_path / "index"))
    index.format(bytes(16), 0, 0, 0)
    carried: list[set[bytes]] = []
    write_batch = index._write_batch

    def recording_write_batch(batch, persist):
        carried.append(set(batch.ops.get("meta", {})))
        return write_batch(batch, persist)

    index._write_batch = recording_write_batch

    async def commit(change) -> None:
        change()
        await index.wait_durable(index.current_seq())

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, lambda ranges: None,
                               trio.CapacityLimiter(1))
            await commit(lambda: (index.allocate_id(b"next_ino"),
                                  index._put("xattrs", keys(1), b"x")))
            await commit(lambda: (index.adjust_counter(b"chunks", 2),
                                  index.adjust_counter(b"file_bytes", 7),
                                  index._put("xattrs", keys(4), b"w")))
            await commit(lambda: index._put("xattrs", keys(2), b"y"))
            await commit(lambda: (index.adjust_counter(b"chunks", 1),
                                  index.adjust_counter(b"chunks", -1),
                                  index._put("xattrs", keys(3), b"z")))
            index.stop()

    trio.run(main)
    assert carried == [{b"next_ino"}, {b"chunks", b"file_bytes"}, set(), set()], carried
    expect = dict(index.counters)
    index.close()
    again = Index(str(tmp_path / "index"))
    assert again.counters == expect
    assert expect[b"chunks"] == 2 and expect[b"file_bytes"] == 7
    again.close()


def test_durable_batches_layers_are_emptied_and_reused(tmp_path, monkeypatch):
    """A batch's per-table layers (BatchLayers) are reused, emptied, by the
    batches after it once it is durable: after the first commits no new one
    is made. What every batch wrote reads back right (pending, durable, after
    a reopen): no key of an earlier batch shows through a reused layer."""
    made: list[int] = []

    class CountedLayer(ix.BatchLayer):
        def __init__(self, *args, **kw):
            made.append(1)
            super().__init__(*args, **kw)

    monkeypatch.setattr(ix, "BatchLayer", CountedLayer)
    index = Index(str(tmp_path / "index"))
    rng = random.Random(5)
    model: dict[tuple[str, bytes], bytes] = {}
    made_after_warmup: list[int] = []

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, lambda ranges: None,
                               trio.CapacityLimiter(1))
            for commit in range(30):
                if commit == 3:
                    made_after_warmup.append(len(made))
                random_changes(index, model, rng, ("xattrs", "symlinks", "orphans"), 50,
                               rng.randrange(1, 20), 0.3)
                for db in ("xattrs", "symlinks", "orphans"):
                    for k in range(50):
                        assert index._get(db, keys(k)) == model.get((db, keys(k)))
                await index.wait_durable(index.current_seq())
                for db in ("xattrs", "symlinks", "orphans"):
                    for k in range(50):
                        assert index._get(db, keys(k)) == model.get((db, keys(k)))
            index.stop()

    trio.run(main)
    assert len(made) == made_after_warmup[0], (len(made), made_after_warmup)
    index.close()
    again = Index(str(tmp_path / "index"))
    for db in ("xattrs", "symlinks", "orphans"):
        assert {k: bytes(v) for k, v in again._items(db, keys(0), keys(50))} == \
            {k: v for (d, k), v in model.items() if d == db}
    again.close()


def test_space_past_the_last_page_is_written_not_only_allocated(tmp_path):
    """LMDB's next pages land on written blocks (zeros flushed once), so a
    commit's fdatasync needs no journal commit for unwritten extents: ext4
    reports preallocated, never written space as a hole (SEEK_HOLE)."""
    index = Index(str(tmp_path / "index"))
    index.keep_reserve()

    def written_ahead() -> int:
        used = (index.env.info()["last_pgno"] + 1) * index.env.stat()["psize"]
        return os.lseek(index._data_fd, used, os.SEEK_HOLE) - used

    assert written_ahead() >= ix.WRITTEN_AHEAD_BYTES // 2
    # What matters is the space ahead when a transaction writes its pages
    # (the upkeep runs after the waiters of the one before are told).
    ahead_at_commit: list[int] = []
    write_batch = index._write_batch

    def checked(batch, persist):
        ahead_at_commit.append(written_ahead())
        return write_batch(batch, persist)

    index._write_batch = checked

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, lambda ranges: None,
                               trio.CapacityLimiter(1))
            for batch in range(40):        # ~12 MiB of new pages: past the first window
                for k in range(100):
                    index._put("xattrs", keys(batch * 100 + k), bytes(3000))
                await index.wait_durable(index.current_seq())
            index.stop()

    trio.run(main)
    assert len(ahead_at_commit) >= 40
    assert min(ahead_at_commit) >= ix.WRITTEN_AHEAD_BYTES // 2
    assert written_ahead() >= ix.WRITTEN_AHEAD_BYTES // 2
    size = os.fstat(index._data_fd).st_size
    assert (index.env.info()["last_pgno"] + 1) * index.env.stat()["psize"] > ix.WRITTEN_AHEAD_BYTES
    assert size > ix.WRITTEN_AHEAD_BYTES
    index.close()


def test_a_checkpoint_writes_no_more_than_its_journaled_batches_promised(tmp_path):
    """Batches that each change 100 keys spread over every page of a table,
    60 of them (6,000 keys on ~100 pages: randwrite's shape): their
    checkpoint may copy each page of the table once, not a page per key, so
    the journal holds them all until the unmount's checkpoint
    (`_checkpoint_need`; a page per key took the reserve after a dozen). And
    that checkpoint writes no more than they promised: a read transaction
    held from before the first batch keeps LMDB from reusing freed pages, so
    every page it writes lands past the file's last page."""
    index = Index(str(tmp_path / "index"))
    index.format(bytes(16), 0, 0, 0)
    n = 4000
    rng = random.Random(5)
    index.write_direct(lambda txn: [txn._put("xattrs", keys(k), rng.randbytes(40))
                                    for k in range(n)])
    index.keep_reserve()
    assert index.start_journal()
    psize = index.env.stat()["psize"]
    checkpoints: list[tuple[int, int]] = []
    lmdb_commit = index._lmdb_commit

    def measured(batch, extra, journal):
        before = index.env.info()["last_pgno"]
        promised = index._journaled_promised
        lmdb_commit(batch, extra, journal)
        checkpoints.append(((index.env.info()["last_pgno"] - before) * psize, promised))

    index._lmdb_commit = measured
    held = index.env.begin()

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, lambda ranges: None,
                               trio.CapacityLimiter(1))
            for _ in range(60):
                for k in rng.sample(range(n), 100):
                    index._put("xattrs", keys(k), rng.randbytes(40))
                await index.wait_durable(index.current_seq())
            index.stop()

    trio.run(main)
    held.abort()
    assert len(checkpoints) == 1, checkpoints          # the unmount's
    wrote, promised = checkpoints[0]
    assert 0 < wrote <= promised, checkpoints
    assert promised < 60 * 100 * ix.JOURNAL_PAGE_BYTES // 4
    index.close()
    again = Index(str(tmp_path / "index"))
    assert again.replayed_records == 0
    again.close()


def test_merge_layers_is_the_newest_value_of_every_key_not_deleted():
    # Layers newest first over LMDB's items; a None is a pending deletion.
    # Streams run out at different points, so the merge also goes on with
    # one stream left (a layer's deletions past LMDB's last key included).
    rng = random.Random(14)
    for _ in range(200):
        streams, want = [], {}
        for _s in range(rng.randint(0, 4)):
            ks = sorted(rng.sample(range(60), rng.randint(0, 25)))
            streams.append([(k.to_bytes(2, "big"), rng.choice([None, b"v%d" % _s]))
                            for k in ks])
        for stream in reversed(streams):        # the oldest first, the newest wins
            for k, v in stream:
                want[k] = v
        expect = sorted((k, v) for k, v in want.items() if v is not None)
        assert list(ix._merge_layers([iter(s) for s in streams], False)) == expect
        assert list(ix._merge_layers([iter(s[::-1]) for s in streams], True)) == expect[::-1]


def test_one_layer_over_lmdb_merges_as_the_k_way_merge_does(tmp_path):
    """`_merge_over` (one layer over LMDB: the journaled layer in a ReadView,
    the live index with one layer) yields what `_merge_layers` yields, both
    ways, with deletions, keys only in either, and bounds inside and outside."""
    rng = random.Random(3)
    committed = {k: bytes([k % 251]) * 3 for k in rng.sample(range(400), 150)}
    index = committed_index(tmp_path, committed)
    try:
        view = index.read_view()
        dbs = view.dbs
        for _ in range(200):
            layer = SortedDict({keys(k): (None if rng.random() < 0.3 else rng.randbytes(2))
                                for k in rng.sample(range(400), rng.randrange(0, 60))})
            lo, hi = sorted(rng.sample(range(-5, 410), 2))
            lo_k, hi_k = keys(max(lo, 0)), keys(max(hi, 0))
            for reverse in (False, True):
                want = list(ix._merge_layers([ix._layer_items(layer, lo_k, hi_k, reverse),
                                              view._lmdb_items("xattrs", lo_k, hi_k, reverse)],
                                             reverse))
                got = list(ix._merge_over(layer, lo_k, hi_k,
                                          view._lmdb_items("xattrs", lo_k, hi_k, reverse),
                                          reverse))
                assert got == want, (lo, hi, reverse)
                assert list(ix.ReadView(view.txn, dbs, {"xattrs": layer})._items(
                    "xattrs", lo_k, hi_k, reverse)) == want
        view.close()
    finally:
        index.close()


def test_journaled_batches_wait_unsorted_until_read_in_key_order(tmp_path, monkeypatch):
    """A journaled batch's changes join the journaled layer with no sorted
    insert per key (`_merge_journaled`: one dict update a table); a table is
    sorted when something reads it in key order (`_fold`). Whatever the mix
    of reads, what reads back is the newest value of every key: by key,
    in key order both ways, by floor, through a read view taken midway (which
    never changes after), after the checkpoints the key limit forces (on the
    worker, of a layer partly unsorted) and after a reopen."""
    monkeypatch.setattr(ix, "JOURNAL_MAX_ENTRIES", 250)
    index = Index(str(tmp_path / "index"))
    index.format(bytes(16), 0, 0, 0)
    tables = ("xattrs", "symlinks", "orphans")
    rng = random.Random(11)
    model: dict[tuple[str, bytes], bytes] = {}
    sorted_inserts: list[int] = []
    real_setitem = SortedDict.__setitem__

    def counted_setitem(self, key, value):
        if merging:
            sorted_inserts.append(1)
        real_setitem(self, key, value)

    monkeypatch.setattr(SortedDict, "__setitem__", counted_setitem)
    merging = False
    real_merge = index._merge_journaled

    def merge(batch):
        nonlocal merging
        merging = True
        try:
            real_merge(batch)
        finally:
            merging = False

    index._merge_journaled = merge

    def check(view=None, expect=None):
        kv = view or index
        expect = model if expect is None else expect
        for db in tables:
            want = sorted((k, v) for (d, k), v in expect.items() if d == db)
            assert [(k, bytes(v)) for k, v in kv._items(db, keys(0), keys(200))] == want
            assert [(k, bytes(v)) for k, v in kv._items(db, keys(0), keys(200), True)] \
                == want[::-1]
            for k in range(0, 200, 7):
                got = kv._get(db, keys(k))
                assert (None if got is None else bytes(got)) == expect.get((db, keys(k)))
        if view is None:
            below = keys(rng.randrange(1, 200))
            want = [(k, v) for (d, k), v in sorted(model.items()) if d == "xattrs" and k < below]
            got = index._floor_below("xattrs", keys(0), below)
            assert (None if got is None else (got[0], bytes(got[1]))) == \
                (want[-1] if want else None)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, lambda ranges: None,
                               trio.CapacityLimiter(1))
            assert index.start_journal()
            view = frozen = None
            for commit in range(60):
                random_changes(index, model, rng, tables, 200, rng.randrange(1, 40), 0.25)
                await index.wait_durable(index.current_seq())
                if commit % 5 == 4:
                    check()                 # sorts every table in
                if commit == 20:
                    view, frozen = index.read_view(), dict(model)
                if view is not None and commit % 10 == 0:
                    check(view, frozen)
            view.close()
            index.stop()

    trio.run(main)
    assert index.checkpoint_reasons.get("keys", 0) >= 2, index.checkpoint_reasons
    assert index.journal_records_total >= 30
    assert not sorted_inserts, len(sorted_inserts)
    index.close()
    again = Index(str(tmp_path / "index"))
    for db in tables:
        assert {k: bytes(v) for k, v in again._items(db, keys(0), keys(200))} == \
            {k: v for (d, k), v in model.items() if d == db}
    again.close()


def test_a_batch_layer_reads_in_order_as_a_sorted_dict_does():
    """`BatchLayer` (a dict sorted on the first ordered read, kept sorted by
    later puts, sorted again after a bulk update) answers `irange` both ways,
    `bisect_left` and `peekitem` as a SortedDict of the same puts does, with
    reads and puts interleaved as a commit's punches do them; and an emptied
    layer (reused by a later batch) holds nothing of before."""
    rng = random.Random(3)
    layer, model = ix.BatchLayer(), SortedDict()
    for step in range(3000):
        op = rng.random()
        if op < 0.45:
            k, v = keys(rng.randrange(400)), rng.choice([None, rng.randbytes(4)])
            layer[k] = v
            model[k] = v
        elif op < 0.5:
            items = [(keys(rng.randrange(400)), rng.randbytes(4)) for _ in range(rng.randrange(20))]
            layer.update(items)
            model.update(items)
        elif op < 0.51:
            layer.clear()
            model.clear()
        else:
            lo, hi = sorted((keys(rng.randrange(410)), keys(rng.randrange(410))))
            for reverse in (False, True):
                assert list(layer.irange(lo, hi, inclusive=(True, False), reverse=reverse)) == \
                    list(model.irange(lo, hi, inclusive=(True, False), reverse=reverse))
            i = layer.bisect_left(lo)
            assert i == model.bisect_left(lo)
            if i:
                assert layer.peekitem(i - 1) == model.peekitem(i - 1)
        assert dict(layer) == dict(model) and len(layer) == len(model)


def test_a_journaled_table_takes_each_commits_changes_without_a_pass_over_it(tmp_path, monkeypatch):
    """A journaled commit's changes to a table read in key order every
    commit (a rewrite cycle's extents, looked up by floor) stay a layer of
    their own over the table until they are an eighth of it: merged into it
    a few times in 150 commits, not once a commit (a pass over a table of
    ~10 k keys each time, or a sorted insert per key before). Floors, ordered
    reads both ways and reads by key give the newest value throughout, with
    a read view taken midway that never changes, and after a reopen."""
    monkeypatch.setattr(ix, "JOURNALED_PEND_MIN_FOLD", 64)     # 1024: folds in this test too
    index = Index(str(tmp_path / "index"))
    index.format(bytes(16), 0, 0, 0)
    rng = random.Random(21)
    model: dict[bytes, bytes] = {}
    merges: list[tuple[int, int, int]] = []      # changes, table, checkpoints so far
    real_fold = Index._fold

    def fold(self, db):
        if db == "xattrs" and self._jpend.get(db):
            merges.append((len(self._jpend[db]), len(self._journaled.get(db) or ()), self.checkpoints))
        real_fold(self, db)

    monkeypatch.setattr(Index, "_fold", fold)

    def check_floor():
        below = keys(rng.randrange(1, 3000))
        want = max((k for k in model if k < below), default=None)
        got = index._floor_below("xattrs", keys(0), below)
        assert got == (None if want is None else (want, model[want]))

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, lambda ranges: None,
                               trio.CapacityLimiter(1))
            assert index.start_journal()
            view = frozen = None
            for commit in range(150):
                for _ in range(rng.randrange(10, 40)):
                    key = keys(rng.randrange(3000))
                    if rng.random() < 0.2:
                        index._delete("xattrs", key)
                        model.pop(key, None)
                    else:
                        model[key] = rng.randbytes(8)
                        index._put("xattrs", key, model[key])
                await index.wait_durable(index.current_seq())
                check_floor()
                if commit % 25 == 24:
                    want = sorted(model.items())
                    got = [(k, bytes(v)) for k, v in index._items("xattrs", keys(0), keys(3000))]
                    assert got == want
                    got = [(k, bytes(v)) for k, v in
                           index._items("xattrs", keys(0), keys(3000), reverse=True)]
                    assert got == want[::-1]
                if commit == 70:
                    view, frozen = index.read_view(), dict(model)
            for k in range(0, 3000, 11):
                got = index._get("xattrs", keys(k))
                assert (None if got is None else bytes(got)) == model.get(keys(k))
            got = {k: bytes(v) for k, v in view._items("xattrs", keys(0), keys(3000))}
            assert got == frozen
            view.close()
            index.stop()

    trio.run(main)
    assert index.journal_records_total >= 150
    # Merged when the changes are 64 keys (the minimum, lowered here) and an
    # eighth of the table, and once for the read view: 20-35 times in 150
    # commits, with a floor look-up after each (150 merges before).
    assert 2 <= len(merges) <= 40, merges
    index.close()
    again = Index(str(tmp_path / "index"))
    assert {k: bytes(v) for k, v in again._items("xattrs", keys(0), keys(3000))} == model
    again.close()


def test_a_batch_goes_into_lmdb_in_key_order(tmp_path):
    """A batch's keys, put in any order, go into LMDB in key order: LMDB
    halves a full page unless the new key goes last, so 6,000 records in a
    shuffled order took ~1.6x the leaf pages of the same records sorted (a
    read after a cache drop faults every page in). Both kinds of layer:
    puts only (one bulk call) and puts with a delete (key by key)."""
    rng = random.Random(11)
    order = rng.sample(range(6000), 6000)
    value = bytes(72)

    def leaf_pages(index: Index, table: str) -> int:
        with index.env.begin() as txn:
            return txn.stat(index._dbs[table])["leaf_pages"]

    index = Index(str(tmp_path / "index"))

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(index.run_committer, lambda ranges: None, trio.CapacityLimiter(1))
            for k in order:                     # puts only
                index._put("xattrs", keys(k), value)
                index._put("symlinks", keys(k), value)
            index._delete("symlinks", keys(6001))   # this layer key by key
            await index.wait_durable(index.current_seq())
            index.stop()

    trio.run(main)
    packed = Index(str(tmp_path / "packed"))
    packed.write_direct(lambda txn: [txn._put("xattrs", keys(k), value) for k in range(6000)])
    want = leaf_pages(packed, "xattrs")
    assert leaf_pages(index, "xattrs") <= want + 1
    assert leaf_pages(index, "symlinks") <= want + 1
    assert list(index._items("symlinks", keys(0), keys(7000))) == [
        (keys(k), value) for k in range(6000)]
    index.close()
    packed.close()


def test_a_layer_not_read_in_order_since_its_last_update_is_not_kept_sorted(monkeypatch):
    """A journaled table's pending changes that one scan sorted (a publish
    pass reading `unpublished`) take later commits' changes as a plain dict
    update, the order dropped, not merged into the sorted keys each time (a
    pass over them every commit, ~5 % of the trio thread's samples on a
    mounted rewrite run); a layer read in order between updates (`extents`,
    every commit's punches) keeps merging. Both read back in order right."""
    merged: list[int] = []
    real_bisect = ix.bisect_left

    def counted(keys, key, lo=0, *args):
        merged.append(1)
        return real_bisect(keys, key, lo, *args)

    rng = random.Random(5)
    layer, model = ix.BatchLayer(), SortedDict()
    items = [(keys(rng.randrange(5000)), rng.randbytes(4)) for _ in range(2000)]
    layer.update(items)
    model.update(items)
    assert list(layer.irange(keys(0), keys(5000))) == list(model)      # one scan sorts it
    monkeypatch.setattr(ix, "bisect_left", counted)
    for _ in range(20):                 # commits, no ordered read in between
        items = [(keys(rng.randrange(5000)), rng.randbytes(4)) for _ in range(30)]
        layer.update(items)
        model.update(items)
    # The first update after the scan merges (it was read in order since):
    # 30 keys at most; the 19 after it none (~570 before).
    assert len(merged) <= 30, len(merged)
    monkeypatch.setattr(ix, "bisect_left", real_bisect)
    assert list(layer.irange(keys(0), keys(5000))) == list(model)
    monkeypatch.setattr(ix, "bisect_left", counted)
    for _ in range(20):                 # read in order after every update: merged
        items = [(keys(rng.randrange(5000)), rng.randbytes(4)) for _ in range(30)]
        layer.update(items)
        model.update(items)
        assert layer.peekitem(len(model) - 1)[0] == model.peekitem(-1)[0]
    assert merged
    assert list(layer.irange(keys(0), keys(5000))) == list(model)
    assert {k: layer[k] for k in layer} == dict(model)


def test_a_files_new_chunks_are_told_to_chunk_watchers_at_once(tmp_path):
    # A 2 GiB file's commit adds ~32 k chunks: one call per chunk watcher, none
    # to a watcher of extents only (a call per chunk and watcher took ~1 us).
    index = Index(str(tmp_path / "index"))
    try:
        extents: list[int] = []
        told: list[list[int]] = []
        only_extents: list[int] = []
        index.watch_maps(extents.append, lambda numbers: told.append(sorted(numbers)))
        index.watch_maps(only_extents.append)
        new = [ix.Chunk(10 + i, ix.CHUNK_LOG, 1, 4096, log_off=i * 4096,
                        chunk_id=bytes([i + 1]) * 32, crcs=b"\1\2\3\4") for i in range(3)]
        ix.add_chunks(index, new)
        assert told == [[10, 11, 12]]
        ix.put_extents(index, 7, [ix.Extent(0, 4096, 10, 0), ix.Extent(4096, 4096, 11, 0)])
        assert extents == only_extents == [7]
        assert ix.more_refs(index, 11, 1)
        assert told == [[10, 11, 12], [11]]
        assert only_extents == [7]
    finally:
        index.close()


def test_a_files_new_chunk_records_are_what_add_chunk_writes(tmp_path):
    # add_chunks packs a LOG chunk's record itself (one pack, one join):
    # the same bytes as Chunk.encode, the same id, log map and totals.
    rnd = random.Random(9)
    new = [ix.Chunk(100 + i, ix.CHUNK_LOG, 1 + i % 3, 60_000 + i, log_off=i * 70_000,
                    chunk_id=rnd.randbytes(32) if i % 4 else b"", crcs=rnd.randbytes(4 * (1 + i % 2)))
           for i in range(12)]
    copied = ix.Chunk(200, ix.CHUNK_LOG, 1, 5000, log_off=10 ** 7, chunk_id=rnd.randbytes(32),
                      crcs=b"\0" * 4, pack_no=3, pack_off=64, stored_length=900, copied=True)
    tables = ("chunks", "chunkids", "logmap", "unpublished", "meta")
    seen = []
    for bulk in (True, False):
        index = Index(str(tmp_path / f"index{bulk}"))
        try:
            chunks = [dataclasses.replace(c) for c in new + [copied]]
            if bulk:
                ix.add_chunks(index, chunks)
            else:
                for c in chunks:
                    ix.add_chunk(index, c)
            seen.append({t: dict(index._open.ops.get(t, {})) for t in tables})
            for c in new:
                assert index._open.ops["chunks"][ix.u64(c.chunk_no)] == c.encode()
        finally:
            index.close()
    assert seen[0] == seen[1]
