"""A committer cancelled with a batch sealed but not yet written, then run again.

The in-process harness runs a new committer for every trio run on the same
index (tests/inproc.py; the power-loss tests observe the files in one run and
write in the next). A committer cancelled between sealing a batch and its
LMDB transaction left that batch behind: its changes stayed visible through
the overlay, and the counters the next batch carried included them, but the
batch itself was never written. Durable: "files is N, the inode table holds
N+1", with the purged orphan still listed (what test_power_cut found after
read windows changed the scheduling, e23488e).

The batch here unlinks more files than a small batch may hold: a small one is
written by the journal's C thread without waiting for the commit limiter
(`Index._append_small`), so holding the limiter would not keep it sealed.
"""

from __future__ import annotations

import trio

from ckptfs import index as ix


def test_batch_sealed_when_the_committer_is_cancelled_commits_first_on_the_next_run(inproc):
    fs = inproc(["pmem_size=64M", "tiering=off"])

    # Two keys at least (the name, the inode) per file unlinked: past the keys
    # a small batch may hold.
    gone = [f"gone-{k}" for k in range(ix.JOURNAL_INLINE_KEYS // 2 + 1)]

    async def make(f):
        for k, name in enumerate(gone):
            await f.write_file(name, b"g" * (70_000 if k == 0 else 100))
        await f.write_file("kept", b"k" * 5_000)
    fs.run(make)

    turn = object()

    async def unlink_and_end_the_run(f):
        for name in gone:
            f.unlink(name)          # purged at once: inode, extents, chunk, files - 1
        # The committer seals that batch, then waits for its turn to write it
        # (the commit limiter, held here): the run ends right then.
        f.fs.commit_limiter.acquire_on_behalf_of_nowait(turn)
        with trio.fail_after(10):
            while f.fs.index._committing is None:
                await trio.sleep(0.005)
    fs.run(unlink_and_end_the_run)
    assert fs.fs.index._committing is not None, "the batch was not left sealed"

    async def go_on(f):
        f.fs.commit_limiter.release_on_behalf_of(turn)
        await f.write_file("new", b"n" * 3_000)        # its close waits for durability
    fs.run(go_on)
    fs.close()                                          # as a crash: no shutdown

    res = fs.fsck()
    assert res.returncode == 0, res.stdout
    index = ix.Index(str(fs.source / ".ckptfs" / "index"))
    try:
        assert ix.orphans(index) == []
        assert index.counters[b"files"] == 2
        for name in gone:
            assert ix.lookup_entry(index, ix.ROOT_INO, name.encode()) is None
    finally:
        index.close()
