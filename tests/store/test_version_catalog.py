"""The tiering planner's catalog of versions (tierplan.VersionCatalog).

It is kept from pass to pass and reads again only what changed, so what it
says must always be what a catalog built from scratch says, whatever the
namespace went through: creates, rewrites, unlinks, renames across
directories, hard links and the unlink of one of their names.
"""

from __future__ import annotations

import random

import pytest

from ckptfs import index as ix
from ckptfs import tierplan
from ckptfs.tierplan import VersionCatalog

KiB, MiB = 1 << 10, 1 << 20


def shape(versions: list[tierplan.Version]) -> list[tuple]:
    return sorted((v.parent, tuple(v.files), v.oldest_ns, v.newest_ns) for v in versions)


def from_scratch(fs) -> list[tuple]:
    planner = fs.fs.tierer.planner
    fresh = VersionCatalog(fs.index, planner.catalog.gap_ns, planner.damaged_record)
    return shape(fresh.versions())


def count_calls(monkeypatch, name: str) -> list:
    calls: list = []
    real = getattr(tierplan.ix, name)

    def counting(kv, *args, **kwargs):
        calls.append(args[:1])
        return real(kv, *args, **kwargs)

    monkeypatch.setattr(tierplan.ix, name, counting)
    return calls


def test_a_plan_reads_only_the_directory_that_changed(inproc, monkeypatch):
    """A pass read every directory entry of the filesystem, after every commit
    (~1 s per 100,000 files on the trio thread). Once built, the catalog reads
    no entry when nothing changed, and only the changed directory's otherwise."""
    fs = inproc(["pmem_size=64M", "hot_versions=1"])

    async def save(fs, step: int, files: int = 3) -> None:
        fs.mkdir(f"step{step}")
        for i in range(files):
            await fs.write_file(f"step{step}/part{i}", b"x" * (4 * KiB))

    for step in range(4):
        fs.run(save, step, mover=False)
    planner = fs.fs.tierer.planner
    planner.plan(set(), set())                  # builds the catalog
    scans = count_calls(monkeypatch, "scan_entries")
    listed = count_calls(monkeypatch, "list_entries")
    planner.plan(set(), set())
    assert scans == [] and listed == []
    fs.run(save, 4, mover=False)
    versions = planner.versions()
    new_dir = fs.lookup("step4")
    assert scans == []
    assert set(listed) <= {(new_dir,), (ix.ROOT_INO,)}, listed
    assert versions[0].parent == new_dir and len(versions[0].files) == 3
    assert shape(versions) == from_scratch(fs)


@pytest.mark.parametrize("seed", range(8))
def test_the_catalog_follows_every_namespace_change(inproc, seed):
    """Random creates, rewrites, unlinks, renames (across directories and over
    files), hard links and unlinks of one of their names: after each round the
    kept catalog equals one built from scratch."""
    rng = random.Random(seed)
    fs = inproc(["pmem_size=64M"])
    dirs = ["", "a", "b", "c/d"]
    for d in dirs[1:]:
        fs.makedirs(d)
    planner = fs.fs.tierer.planner
    planner.versions()
    files: list[str] = []
    counter = iter(range(10**6))

    async def round_(fs) -> None:
        for _ in range(6):
            op = rng.choice(["create", "create", "rewrite", "unlink", "rename", "link"])
            if op == "create" or not files:
                path = f"{rng.choice(dirs)}/f{next(counter)}".lstrip("/")
                await fs.write_file(path, rng.randbytes(rng.choice([100, 70 * KiB])))
                files.append(path)
            elif op == "rewrite":
                await fs.write_file(rng.choice(files), rng.randbytes(200))
            elif op == "unlink":
                path = files.pop(rng.randrange(len(files)))
                fs.unlink(path)
            elif op == "rename":
                old = files.pop(rng.randrange(len(files)))
                new = (f"{rng.choice(dirs)}/f{next(counter)}".lstrip("/")
                       if rng.random() < 0.6 or not files else files.pop(rng.randrange(len(files))))
                fs.rename(old, new)
                files.append(new)
            else:
                new = f"{rng.choice(dirs)}/f{next(counter)}".lstrip("/")
                fs.link(rng.choice(files), new)
                files.append(new)

    async def prepare(fs) -> None:
        await planner.prepare()         # as each pass does first

    for _ in range(8):
        fs.run(round_, mover=False)
        planner.versions()              # a pass (what it cannot place, the next prepare reads)
        fs.run(prepare, mover=False)
        assert shape(planner.versions()) == from_scratch(fs)


def test_unlinking_one_name_of_a_linked_file_rebuilds_in_a_thread(inproc, monkeypatch):
    """A file's entry goes from the directory it was grouped in, while another
    entry elsewhere stays (nothing said which directory): the next prepare
    reads everything again in a worker thread, not the plan on the trio thread."""
    fs = inproc(["pmem_size=64M"])

    async def linked(fs) -> None:
        fs.mkdir("a")
        fs.mkdir("z")
        await fs.write_file("a/model", b"m" * 4096)
        fs.link("a/model", "z/model")

    fs.run(linked, mover=False)
    planner = fs.fs.tierer.planner
    planner.versions()
    fs.unlink("a/model")
    scans = count_calls(monkeypatch, "scan_entries")
    planner.versions()                          # a plan now: no full read here
    assert scans == []

    async def prepare(fs) -> None:
        await planner.prepare()

    fs.run(prepare, mover=False)
    assert len(scans) == 1
    assert shape(planner.versions()) == from_scratch(fs)
    assert [v.files for v in planner.versions()] == [[fs.lookup("z/model")]]


def test_moved_versions_are_settled_and_not_walked_again(inproc, monkeypatch):
    """A version whose chunks all went to packs is skipped by later plans (a
    pass walked every extent of every cold version, after every commit) until
    one of its files changes."""
    fs = inproc(["pmem_size=64M", "hot_versions=1"])

    async def main(fs) -> None:
        for step in range(3):
            fs.mkdir(f"step{step}")
            await fs.write_file(f"step{step}/model", random.Random(step).randbytes(MiB))
        await fs.tier_now()

    fs.run(main)
    planner = fs.fs.tierer.planner
    walked = count_calls(monkeypatch, "iter_extents")
    cold = {(fs.lookup("step0/model"),), (fs.lookup("step1/model"),)}
    assert planner.plan(set(), set()).chunks == []     # sees them out of the log
    assert cold <= set(walked)
    walked.clear()
    assert planner.plan(set(), set()).chunks == []
    assert walked == []                         # both cold versions are settled
    old = fs.lookup("step0/model")

    async def rewrite(fs) -> None:
        await fs.write_file("step0/model", random.Random(7).randbytes(MiB))

    fs.run(rewrite, mover=False)
    chunks = planner.plan(set(), set()).chunks
    assert (old,) in walked
    assert sum(c.length for c in chunks) == MiB


def test_a_catalog_built_in_a_thread_sees_what_was_pending(inproc):
    """The first pass builds the catalog from a read view, in a worker thread;
    what was written before the catalog watched (and not yet durable) is in it."""
    fs = inproc(["pmem_size=64M", "sync=lazy"])

    async def main(fs) -> None:
        fs.mkdir("v")
        await fs.write_file("v/a", b"a" * 4096)
        planner = fs.fs.tierer.planner
        fresh = VersionCatalog(fs.index, planner.catalog.gap_ns, planner.damaged_record)
        await fs.write_file("v/b", b"b" * 4096)       # after it watches: read again
        await fresh.prepare()
        assert shape(fresh.versions()) == from_scratch(fs)
        assert sorted(len(v.files) for v in fresh.versions()) == [2]

    fs.run(main, mover=False)


def test_a_cold_version_the_hot_one_shares_is_walked_again_only_when_that_changes(
        inproc, monkeypatch):
    """With dedup a cold version's chunks are mostly the hot version's, so they
    stay in the log and the version never settles: every pass walked it, extent
    by extent. Now it is walked again only when what keeps its chunks changed."""
    fs = inproc(["pmem_size=64M", "hot_versions=1"])
    shared = random.Random(1).randbytes(2 * MiB)

    async def two_versions(fs) -> None:
        for step in range(2):
            fs.mkdir(f"step{step}")
            await fs.write_file(f"step{step}/model", shared)

    fs.run(two_versions, mover=False)
    planner = fs.fs.tierer.planner
    assert planner.plan(set(), set()).chunks == []      # step0's chunks are step1's
    old = fs.lookup("step0/model")
    walked = count_calls(monkeypatch, "iter_extents")

    async def more_of_step1(fs) -> None:
        await fs.write_file("step1/config.json", b"{}")

    fs.run(more_of_step1, mover=False)
    assert planner.plan(set(), set()).chunks == []
    assert (old,) not in walked                 # step1 changed, but still holds step0
    walked.clear()

    async def step1_trained(fs) -> None:
        await fs.write_file("step1/model", random.Random(2).randbytes(2 * MiB))

    fs.run(step1_trained, mover=False)
    chunks = planner.plan(set(), set()).chunks
    assert (old,) in walked
    assert sum(c.length for c in chunks) == 2 * MiB
