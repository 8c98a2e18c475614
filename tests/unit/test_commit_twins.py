"""The commit's twin check (files.FileData._committed_twins): a new chunk
whose id another file committed after it was cut is replaced by that chunk.
The check looks every new chunk's id up again, unless no chunk id was put in
the index since the file's new chunks were looked up (`Index.chunk_ids_put`):
then none can have a twin. Real ckptfs in this process, no FUSE."""

from __future__ import annotations

import os
import random

import pytest

from ckptfs import files
from ckptfs import index as ix

MiB = 1 << 20


@pytest.fixture
def lookups_at_commit(monkeypatch) -> list[int]:
    """How many chunk ids each commit_file looked up (the real lookups, counted)."""
    counts: list[int] = []
    in_commit = [False]
    real_finder, real_commit = ix.chunk_no_finder, files.FileData.commit_file

    def finder(index):
        find = real_finder(index)

        def counted(chunk_id):
            if in_commit[0]:
                counts[-1] += 1
            return find(chunk_id)
        return counted

    def commit_file(self, *args, **kw):
        counts.append(0)
        in_commit[0] = True
        try:
            return real_commit(self, *args, **kw)
        finally:
            in_commit[0] = False

    monkeypatch.setattr(ix, "chunk_no_finder", finder)
    monkeypatch.setattr(files.FileData, "commit_file", commit_file)
    return counts


def test_a_file_alone_commits_without_looking_its_ids_up_again(inproc, lookups_at_commit):
    data = random.Random(3).randbytes(6 * MiB)
    fs = inproc(["pmem_size=64M"])
    fs.run(lambda fs: fs.write_file("/a", data))
    assert lookups_at_commit == [0]
    assert fs.run(lambda fs: fs.read_file("/a")) == data
    fs.close()


async def _two_writers_same_bytes(fs, data: bytes) -> None:
    """Both files settle the same chunks before either commits; then both commit."""
    fhs = []
    for name in ("a", "b"):
        fh, _ = fs.fs.create(1, name.encode(), 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0)
        fhs.append(fh)
    for off in range(0, len(data), MiB):
        for fh in fhs:
            await fs.fs.write(fh, off, data[off:off + MiB])
    for fh in fhs:
        await fs.fs.flush(fh)
        await fs.fs.release(fh)


def test_the_second_of_two_files_with_the_same_bytes_finds_its_twins(inproc,
                                                                      lookups_at_commit):
    """The first commit puts ids after the second file looked its chunks up:
    the second commit looks them up again and stores nothing twice."""
    data = random.Random(4).randbytes(4 * MiB)
    fs = inproc(["pmem_size=64M"])
    fs.run(_two_writers_same_bytes, data)
    assert lookups_at_commit[0] == 0 and lookups_at_commit[1] > 0
    stored = ix.read_counter(fs.fs.index, b"stored_log_bytes")
    assert len(data) <= stored < len(data) + MiB
    assert fs.run(lambda fs: fs.read_file("/a")) == data
    assert fs.run(lambda fs: fs.read_file("/b")) == data
    fs.close()
