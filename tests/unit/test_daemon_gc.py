"""The daemon's cyclic-collector setting (daemon.quiet_collector)."""

from __future__ import annotations

import gc
import random

import pytest

from ckptfs import daemon, files
from ckptfs import index as ix

MiB = 1 << 20


def test_a_big_commits_records_cost_few_collections() -> None:
    # A 2 GiB file's commit makes ~200,000 container objects that live until
    # its batch is durable; at Python's default threshold (700) they ran ~350
    # young, 32 middle and 2 full collections, 69-88 ms of the fsync.
    was = gc.get_threshold()
    starts: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(info["generation"])

    try:
        daemon.quiet_collector()
        gc.collect()
        gc.callbacks.append(count)
        try:
            kept = [(i.to_bytes(8, "big"), [i]) for i in range(200_000)]
        finally:
            gc.callbacks.remove(count)
    finally:
        gc.set_threshold(*was)
    assert len(kept) == 200_000
    assert len(starts) <= 10, starts      # 400,000 new containers; the default ran ~570
    assert 2 not in starts


@pytest.fixture
def low_threshold():
    """A young collection every 100 new containers, collections counted by
    generation while `counting` holds a True."""
    was = gc.get_threshold()
    starts: list[int] = []
    counting = [False]

    def count(phase: str, info: dict) -> None:
        if phase == "start" and counting[0]:
            starts.append(info["generation"])

    gc.collect()
    gc.set_threshold(100, 10, 10)
    gc.callbacks.append(count)
    try:
        yield starts, counting
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*was)


def test_a_big_files_commit_runs_no_collection(inproc, low_threshold, monkeypatch):
    # commit_file makes ~10 containers per new chunk that are gone when it
    # returns; a collection in between traversed them with the writer waiting
    # (2-7 ms each, one per 50,000 in the daemon).
    starts, counting = low_threshold
    real = files.FileData.commit_file
    chunks: list[int] = []

    def commit_file(self, df, *args, **kw):
        chunks.append(len(df.new_chunks))
        counting[0] = True
        try:
            return real(self, df, *args, **kw)
        finally:
            counting[0] = False

    monkeypatch.setattr(files.FileData, "commit_file", commit_file)
    data = random.Random(5).randbytes(24 * MiB)
    fs = inproc(["pmem_size=64M"])
    fs.run(lambda fs: fs.write_file("/a", data))
    assert chunks and chunks[0] > 200          # ~16 per MiB: thousands of containers
    assert starts == []
    assert gc.isenabled()
    assert fs.run(lambda fs: fs.read_file("/a")) == data
    fs.close()


def test_a_commits_puts_into_lmdb_run_no_collection(tmp_path, low_threshold):
    # The committer's puts of a big batch: its (key, value) pairs made as
    # LMDB takes them, not a list of them all that a collection traverses.
    starts, counting = low_threshold
    index = ix.Index(str(tmp_path / "index"))
    try:
        batch = ix.Batch(seq=1)
        layer = ix.BatchLayer()
        layer.update([(i.to_bytes(8, "big"), b"v%d" % i) for i in range(20_000)])
        batch.ops["chunks"] = layer
        counting[0] = True
        index._lmdb_commit(batch, [], None)
        counting[0] = False
        assert starts == []
        with index.env.begin() as txn:
            assert txn.get((19_999).to_bytes(8, "big"), db=index._dbs["chunks"]) == b"v19999"
            assert txn.stat(index._dbs["chunks"])["entries"] == 20_000
    finally:
        index.close()
