"""The backing store's namespace snapshots and `ckptfs recover` (docs/STORE.md).

Through real mounts: files replaced as torch.save does, deleted, hard linked,
directories with their own modes, owners, times and xattrs, symlinks, empty
directories, a 1,100-level path; then the index and the log are lost and
recover must give back exactly the newest published state, or name what it
cannot. Crafted stores (bad sizes, bad JSON, missing fields, a damaged head,
legacy manifests) must give one clear line per bad item, exit 4, never a
traceback, never a partial index: the store those tests craft from is written,
and what recover gave back is read, in this process (tests/inproc.py, the
`tiered` fixture); recover and fsck are the real commands.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from inproc import InProcess
from mounting import run_ckptfs
from posix_helpers import check_clean, read_file, write_file
from store_craft import Store

MiB = 1 << 20


def floats(n_bytes: int, seed: int) -> bytes:
    import numpy as np
    return np.random.default_rng(seed).normal(0, 0.02, n_bytes // 4).astype(np.float32).tobytes()


def tier_all(m) -> None:
    run_ckptfs("tier", str(m.path), "--now", "--all", timeout=600)


def lose_index_and_log(m) -> None:
    state = m.source / ".ckptfs"
    shutil.rmtree(state / "index")
    if (state / "pmem.log").exists():
        os.unlink(state / "pmem.log")


def recover(m, *args: str):
    res = run_ckptfs("recover", str(m.source), *args, check=False, timeout=600)
    assert "Traceback" not in res.stderr, res.stderr
    return res


def store_of(m) -> Store:
    return Store(m.source / ".ckptfs" / "store")


def torch_save(path: Path, step: int) -> None:
    """torch.save to a temporary name, then rename over the checkpoint."""
    import torch
    torch.save({"w": torch.full((256, 1024), float(step)), "step": step},
               str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)


def torch_step(path: Path) -> int:
    import torch
    return torch.load(path, weights_only=True)["step"]


# --------------------------------------------------------- item 7: newest state

def test_recover_after_replace_and_delete_restores_the_newest_state(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=256M"])
    torch_save(m.path / "ckpt.pt", 1)
    write_file(m.path / "old.bin", floats(MiB, 1))
    tier_all(m)
    torch_save(m.path / "ckpt.pt", 2)            # replaces the tiered version 1
    os.unlink(m.path / "old.bin")                # a tiered file deleted
    tier_all(m)
    m.umount()
    lose_index_and_log(m)
    res = recover(m)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "name taken" not in res.stdout and "not recovered" not in res.stdout
    m.start()
    assert sorted(os.listdir(m.path)) == ["ckpt.pt"]
    assert torch_step(m.path / "ckpt.pt") == 2
    check_clean(fsck_clean, m)


def test_a_replaced_file_whose_newest_version_is_hot_is_named_never_older(make_mount,
                                                                           fsck_clean):
    m = make_mount(options=["pmem_size=256M", "hot_versions=100"])
    torch_save(m.path / "ckpt.pt", 1)
    tier_all(m)                                  # version 1 is in the store
    torch_save(m.path / "ckpt.pt", 2)            # version 2 stays hot (in the log)
    write_file(m.path / "notes.txt", b"hot too")
    m.umount()                                   # publishes a snapshot of the newest state
    lose_index_and_log(m)
    res = recover(m)
    assert res.returncode == 4, res.stdout + res.stderr
    named = [ln for ln in res.stdout.splitlines() if ln.startswith("not recovered")]
    assert sorted(ln.split(":")[1].strip() for ln in named) == ["ckpt.pt", "notes.txt"], named
    assert all("not wholly in the store" in ln for ln in named)
    m.start()
    assert os.listdir(m.path) == [], "an older version came back"
    check_clean(fsck_clean, m)


# ---------------------------------------------- item 8: what rebuilding needs

def _lstat_all(top: Path) -> dict[str, tuple]:
    out = {}
    for root, dirs, files in os.walk(top):
        for name in [""] + dirs + files if root == str(top) else dirs + files:
            p = Path(root) / name if name else Path(root)
            st = os.lstat(p)
            rel = str(p.relative_to(top))
            xattrs = {} if stat.S_ISLNK(st.st_mode) else {
                k: os.getxattr(p, k) for k in os.listxattr(p)}
            out[rel] = (stat.filemode(st.st_mode), st.st_uid, st.st_gid, st.st_nlink,
                        st.st_mtime_ns, st.st_ctime_ns,
                        st.st_size if not stat.S_ISDIR(st.st_mode) else 0, xattrs,
                        os.readlink(p) if stat.S_ISLNK(st.st_mode) else None)
    return out


def test_recover_restores_directories_symlinks_hard_links_and_empty_dirs(make_mount,
                                                                          fsck_clean):
    m = make_mount(options=["pmem_size=128M"])
    p = m.path
    (p / "private").mkdir()
    write_file(p / "private" / "w.bin", floats(MiB, 2))
    os.chown(p / "private", 1234, 5678)
    os.chmod(p / "private", 0o700)
    os.setxattr(p / "private", "user.owner", b"alice")
    (p / "step-200").mkdir()
    write_file(p / "step-200" / "model.bin", floats(2 * MiB, 3))
    os.link(p / "step-200" / "model.bin", p / "model-link.bin")
    os.symlink("step-200", p / "latest")
    (p / "empty").mkdir()
    os.chmod(p / "empty", 0o750)
    os.mkfifo(p / "fifo")
    os.mknod(p / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.utime(p / "private", ns=(1_000_000_123, 2_000_000_456))
    os.utime(p / "latest", ns=(3_000_000_001, 4_000_000_002), follow_symlinks=False)
    os.chmod(p, 0o751)
    tier_all(m)
    m.remount()             # what the index holds (the kernel's cached times may differ)
    before = _lstat_all(p)
    m.umount()
    lose_index_and_log(m)
    res = recover(m)
    assert res.returncode == 0, res.stdout + res.stderr
    m.start()
    after = _lstat_all(p)
    assert after == before
    assert os.path.samefile(p / "model-link.bin", p / "step-200" / "model.bin")
    assert read_file(p / "latest" / "model.bin") == floats(2 * MiB, 3)
    check_clean(fsck_clean, m)


# ------------------------------------------------------ item 9: any depth, bad input

def test_recover_a_1100_level_path(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=64M"])
    fd = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1100):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        leaf = os.open("leaf", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
        os.write(leaf, b"deep")
        os.close(leaf)
    finally:
        os.close(fd)
    tier_all(m)
    m.umount()
    lose_index_and_log(m)
    res = recover(m)
    assert res.returncode == 0, res.stdout + res.stderr
    m.start()
    fd = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1100):
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        leaf = os.open("leaf", os.O_RDONLY, dir_fd=fd)
        assert os.read(leaf, 10) == b"deep"
        os.close(leaf)
    finally:
        os.close(fd)
    check_clean(fsck_clean, m)


@pytest.fixture
def tiered(inproc) -> InProcess:
    """An unmounted ckptfs whose three files are all in the store, index and log lost."""
    fs = inproc(["pmem_size=64M"])

    async def fill(fs: InProcess) -> None:
        fs.mkdir("d")
        for name, seed in (("a.bin", 1), ("b.bin", 2), ("d/c.bin", 3)):
            await fs.write_file(name, floats(MiB, seed))
        await fs.tier_now(everything=True)
    fs.run(fill)
    fs.shutdown()
    lose_index_and_log(fs)
    return fs


def reopen(inproc, m: InProcess) -> InProcess:
    """What recover gave back, opened as a mount opens it."""
    return inproc(["pmem_size=64M"], source=m.source)


def read(fs: InProcess, path: str) -> bytes:
    return fs.run(lambda fs: fs.read_file(path))


def shut_down_clean(fs: InProcess) -> None:
    """A clean unmount, then fsck must be clean (check_clean of a mount)."""
    fs.shutdown()
    res = fs.fsck()
    assert res.returncode == 0, f"fsck found problems:\n{res.stdout}\n{res.stderr}"


def _expect_named(m, res, names: list[str]) -> None:
    assert res.returncode == 4, res.stdout + res.stderr
    bad = sorted(ln.split(":")[1].strip() for ln in res.stdout.splitlines()
                 if ln.startswith("not recovered"))
    assert bad == sorted(names), res.stdout
    assert (m.source / ".ckptfs" / "index").is_dir()
    assert not (m.source / ".ckptfs" / "index.recover-tmp").exists()


def _file_doc_with(field: str, value):
    def change(entry: dict, s: Store) -> None:
        doc = s.read(entry["f"])
        if field == "size":
            doc["attrs"]["size"] = value
        elif value is None:
            del doc[field]
        else:
            doc[field] = value(doc[field]) if callable(value) else value
        entry["f"] = s.put(doc)
    return change


def _entry_with(field: str, value):
    return lambda entry, s: entry.__setitem__(field, value)


@pytest.mark.parametrize("change, shown", [
    pytest.param(_file_doc_with("size", 1 << 64), "a.bin", id="size-2**64"),
    pytest.param(lambda e, s: e.__setitem__("f", s.put_raw(b'{"v":1,"t":"file","attrs":')),
                 "a.bin", id="malformed-json"),
    pytest.param(_file_doc_with("attrs", None), "a.bin", id="missing-field"),
    pytest.param(_file_doc_with("extents", [[0, 1 << 20, "00" * 32, 0]]), "a.bin",
                 id="chunk-in-no-pack"),
    pytest.param(_file_doc_with("extents", lambda x: x[::-1]), "a.bin",
                 id="extents-out-of-order"),
    pytest.param(_file_doc_with("extents", lambda x: [[0, 1 << 30, *x[0][2:]]] + x[1:]),
                 "a.bin", id="extent-past-its-chunk"),
    pytest.param(lambda e, s: e.__setitem__("f", "ab" * 32), "a.bin", id="object-missing"),
    pytest.param(_entry_with("n", "a/b.bin"), "a/b.bin", id="name-with-slash"),
    pytest.param(_entry_with("n", ".."), "..", id="name-dotdot"),
    pytest.param(_entry_with("n", "x" * 256), "x" * 256, id="name-too-long"),
    pytest.param(_entry_with("i", "seven"), "a.bin", id="ino-not-a-number"),
    pytest.param(_entry_with("i", 2 ** 64), "a.bin", id="ino-too-big"),
])
def test_a_bad_file_in_a_crafted_snapshot_is_named_and_the_rest_recovered(tiered, inproc,
                                                                          change, shown):
    Store(tiered.source / ".ckptfs" / "store").rewrite("a.bin", change)
    res = recover(tiered)
    _expect_named(tiered, res, [shown])
    fs = reopen(inproc, tiered)
    assert read(fs, "b.bin") == floats(MiB, 2)
    assert read(fs, "d/c.bin") == floats(MiB, 3)
    assert fs.listdir() == ["b.bin", "d"]
    shut_down_clean(fs)


def test_a_bad_directory_is_named_with_everything_below_it(tiered, inproc):
    store = Store(tiered.source / ".ckptfs" / "store")
    store.rewrite("d", lambda e, s: e.__setitem__("d", s.put({"v": 1, "t": "dir"})))
    res = recover(tiered)
    _expect_named(tiered, res, ["d"])
    assert "nothing below it" in res.stdout
    fs = reopen(inproc, tiered)
    assert fs.listdir() == ["a.bin", "b.bin"]
    shut_down_clean(fs)


def test_a_damaged_newest_head_builds_no_index_and_names_the_older_ones(tiered, inproc):
    store = Store(tiered.source / ".ckptfs" / "store")
    path, head = store.newest_head()
    older = dict(head, seq=head["seq"] - 1)
    store.write_head(older)                              # an older snapshot, same tree
    path.write_bytes(path.read_bytes()[:40])             # the newest: truncated
    res = recover(tiered)
    assert res.returncode == 4, res.stdout + res.stderr
    assert "no index was built" in res.stdout and f"{older['seq']}" in res.stdout
    assert not (tiered.source / ".ckptfs" / "index").exists()
    assert not (tiered.source / ".ckptfs" / "index.recover-tmp").exists()
    assert tiered.fsck().returncode == 1                  # "holds no ckptfs", never "clean"
    res = recover(tiered, "--head", str(older["seq"]))    # the operator's explicit choice
    assert res.returncode == 0, res.stdout
    assert f"snapshot {older['seq']}" in res.stdout
    fs = reopen(inproc, tiered)
    assert fs.listdir() == ["a.bin", "b.bin", "d"]
    shut_down_clean(fs)


def test_an_interrupted_recover_leaves_no_index_and_the_rerun_works(tiered, inproc):
    leftover = tiered.source / ".ckptfs" / "index.recover-tmp"
    leftover.mkdir()
    (leftover / "data.mdb").write_bytes(b"half a database")
    res = recover(tiered)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not leftover.exists()
    fs = reopen(inproc, tiered)
    assert read(fs, "a.bin") == floats(MiB, 1)
    shut_down_clean(fs)


# ---------------------------------------- stores written before snapshots

def test_legacy_manifests_are_read_newest_last_with_their_limits_said(tiered, inproc):
    store = Store(tiered.source / ".ckptfs" / "store")
    a_doc = store.file_doc("a.bin")
    b_doc = store.file_doc("b.bin")
    store.to_legacy()
    # a.bin replaced by rename: the older version's manifest is still there.
    old = dict(b_doc, attrs=dict(b_doc["attrs"], mtime=a_doc["attrs"]["mtime"] - 10**9))
    store.write_manifest(999, ["a.bin"], old)
    store.write_manifest(1000, ["x.bin"], a_doc, raw=b'{"format": 1, "paths": ')
    store.write_manifest(1001, ["y.bin"], dict(a_doc, attrs=dict(a_doc["attrs"],
                                                                 size=1 << 64)))
    bad = json.loads(json.dumps(dict(a_doc)))
    del bad["attrs"]["mode"]
    store.write_manifest(1002, ["z.bin"], bad)
    res = recover(tiered)
    assert res.returncode == 4, res.stdout + res.stderr
    assert "name taken" not in res.stdout
    assert "no snapshot" in res.stdout and "deletions" in res.stdout     # the limits, said
    named = [ln for ln in res.stdout.splitlines() if ln.startswith("not recovered")]
    assert len(named) == 3 and all("manifests/" in ln for ln in named), res.stdout
    fs = reopen(inproc, tiered)
    assert read(fs, "a.bin") == floats(MiB, 1)                           # the newer one
    assert fs.listdir() == ["a.bin", "b.bin", "d"]
    shut_down_clean(fs)


def test_large_directories_and_files_go_on_pages(make_mount, fsck_clean, monkeypatch):
    """Directories and files over the page limits are written page by page and
    come back whole (limits lowered in-process so a small tree crosses them)."""
    from ckptfs import snapshot_format as sf
    from ckptfs.backing.local import LocalBackend
    from ckptfs.index import Index
    from ckptfs.snapshots import publish_offline

    m = make_mount(options=["pmem_size=64M"])
    (m.path / "many").mkdir()
    for i in range(40):
        write_file(m.path / "many" / f"f{i:02d}", b"%d" % i)
    big = floats(2 * MiB, 9)
    write_file(m.path / "big.bin", big)
    tier_all(m)
    m.umount()
    monkeypatch.setattr(sf, "PAGE_ENTRIES", 8)
    monkeypatch.setattr(sf, "PAGE_EXTENTS", 4)
    index = Index(str(m.source / ".ckptfs" / "index"))
    try:
        fs_uuid = index.check_format()
        with LocalBackend.open(m.source / ".ckptfs" / "store") as backend:
            done = publish_offline(index, backend)
    finally:
        index.close()
    assert done.entries == 42 and done.incomplete_files == 0
    store = store_of(m)
    _, head = store.newest_head()
    assert head["seq"] == done.seq
    root = store.read(head["root"])
    many = store.read(next(e["d"] for e in root["entries"] if e["n"] == "many"))
    assert len(many["pages"]) == 5
    big_doc = store.read(next(e["f"] for e in root["entries"] if e["n"] == "big.bin"))
    assert len(big_doc["pages"]) >= 4
    lose_index_and_log(m)
    res = recover(m)
    assert res.returncode == 0, res.stdout + res.stderr
    m.start()
    assert sorted(os.listdir(m.path / "many")) == [f"f{i:02d}" for i in range(40)]
    assert read_file(m.path / "many" / "f17") == b"17"
    assert read_file(m.path / "big.bin") == big
    check_clean(fsck_clean, m)


def test_unchanged_objects_are_not_written_again(make_mount, tmp_path):
    """Content addressing: a change writes the changed file's object and the
    directories above it; every other object stays as it was, never rewritten."""
    m = make_mount(options=["pmem_size=64M", f"backing={tmp_path / 'store'}"])
    (m.path / "a").mkdir()
    (m.path / "b").mkdir()
    write_file(m.path / "a" / "x.bin", floats(MiB, 1))
    write_file(m.path / "b" / "y.bin", floats(MiB, 2))
    tier_all(m)
    objects = Store(tmp_path / "store").vroot / "objects"

    def listing() -> dict[str, tuple[int, int]]:
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
                for p in objects.rglob("*") if p.is_file()}

    before = listing()
    write_file(m.path / "b" / "y.bin", floats(MiB, 3))
    tier_all(m)
    after = listing()
    assert all(after[k] == v for k, v in before.items() if k in after), "rewritten"
    new = [json.loads((objects / k[:2] / k).read_bytes()) for k in after.keys() - before]
    # y.bin's object (one more if the background mover published it while hot),
    # b's and the root's (each once more for that too); nothing of a or x.bin.
    kinds = sorted((d["t"], sorted(e["n"] for e in d.get("entries", []))) for d in new)
    assert 3 <= len(new) <= 6, kinds
    for kind, names in kinds:
        assert (kind, names) in (("file", []), ("dir", ["y.bin"]), ("dir", ["a", "b"])), kinds
    m.umount()


def test_fsck_repair_publishes_a_snapshot_before_deleting_unnamed_packs(tiered, inproc):
    """A pack no index record names may be one the newest snapshot still names
    (its last chunk went, no snapshot since): fsck --repair publishes one of
    the repaired index first, so recover keeps working afterwards."""
    assert recover(tiered).returncode == 0
    reopen(inproc, tiered).shutdown()   # takes the volume over: only its holder publishes
    packs = sorted((tiered.source / ".ckptfs" / "store" / "packs").rglob("*.pack"))
    stray = packs[0].with_name("00000000deadbeef.pack")
    shutil.copy(packs[0], stray)
    heads_before = store_of(tiered).head_paths()
    res = tiered.fsck()
    assert res.returncode == 4 and "named by nothing" in res.stdout, res.stdout
    res = tiered.fsck("--repair")
    assert res.returncode == 3 and "published snapshot" in res.stdout, res.stdout
    assert not stray.exists()
    assert len(store_of(tiered).head_paths()) == len(heads_before) + 1
    lose_index_and_log(tiered)
    assert recover(tiered).returncode == 0
    fs = reopen(inproc, tiered)
    assert read(fs, "d/c.bin") == floats(MiB, 3)
    shut_down_clean(fs)


def test_index_damage_is_published_as_such_and_named_by_recover(make_mount, fsck_clean):
    """An entry the index cannot describe (here: naming a missing inode) goes into
    the snapshot as undescribable, so recover names it instead of taking it for
    deleted."""
    from ckptfs import index as ix
    from ckptfs.backing.local import LocalBackend
    from ckptfs.index import Index
    from ckptfs.snapshots import publish_offline

    m = make_mount(options=["pmem_size=64M"])
    write_file(m.path / "good.bin", floats(MiB, 4))
    tier_all(m)
    m.umount()
    index = Index(str(m.source / ".ckptfs" / "index"))
    try:
        def dangle(txn):
            cookie = ix.read_counter(txn, b"next_cookie")
            txn._put("meta", b"next_cookie", ix.u64_le(cookie + 1))
            txn._put("dirents", ix.dirent_key(ix.ROOT_INO, b"ghost"), ix.dirent_value(5555, cookie))
            txn._put("dirlist", ix.dirlist_key(ix.ROOT_INO, cookie), b"ghost")
        index.write_direct(dangle)
        with LocalBackend.open(m.source / ".ckptfs" / "store") as backend:
            done = publish_offline(index, backend)
    finally:
        index.close()
    assert done.skipped == 1
    lose_index_and_log(m)
    res = recover(m)
    assert res.returncode == 4, res.stdout
    assert "not recovered: ghost: unreadable in the index" in res.stdout, res.stdout
    m.start()
    assert os.listdir(m.path) == ["good.bin"]
    assert read_file(m.path / "good.bin") == floats(MiB, 4)
    check_clean(fsck_clean, m)


def test_fsck_finds_an_unusable_newest_snapshot_and_publishes_a_new_one(make_mount,
                                                                      fsck_clean):
    m = make_mount(options=["pmem_size=64M"])
    write_file(m.path / "f.bin", floats(MiB, 5))
    tier_all(m)
    m.umount()
    store = store_of(m)
    path, _ = store.newest_head()
    path.write_bytes(path.read_bytes()[:-30])
    res = m.fsck()
    assert res.returncode == 4 and "[snapshots]" in res.stdout, res.stdout
    res = m.fsck("--repair")
    assert res.returncode == 3 and "published snapshot" in res.stdout, res.stdout
    assert m.fsck().returncode == 0
    lose_index_and_log(m)
    assert recover(m).returncode == 0
    m.start()
    assert read_file(m.path / "f.bin") == floats(MiB, 5)
    check_clean(fsck_clean, m)


def test_fsck_raises_a_head_counter_below_the_store_heads(make_mount):
    """An index restored from an older copy must not number its next snapshot
    below one already in the store (recover would take the older state)."""
    from ckptfs import index as ix
    from ckptfs.index import Index
    m = make_mount(options=["pmem_size=64M"])
    write_file(m.path / "f.bin", b"x" * 1000)
    tier_all(m)
    m.umount()
    index = Index(str(m.source / ".ckptfs" / "index"))
    try:
        index.write_direct(lambda txn: txn._put("meta", b"next_head", ix.u64_le(0)))
    finally:
        index.close()
    res = m.fsck()
    assert res.returncode == 4 and "next_head is 0" in res.stdout, res.stdout
    assert m.fsck("--repair").returncode == 3
    assert m.fsck().returncode == 0


def test_a_store_from_before_snapshots_gets_one_and_loses_its_manifests(make_mount,
                                                                        fsck_clean):
    """A filesystem whose store holds only per-file manifests (written by the
    previous version) mounts as before; its first pass publishes a snapshot and
    the manifests go."""
    m = make_mount(options=["pmem_size=64M"])
    write_file(m.path / "old.bin", floats(MiB, 6))
    tier_all(m)
    m.umount()
    store = store_of(m)
    store.to_legacy()
    manifests = store.root / "manifests"
    assert any(p.is_file() for p in manifests.rglob("*"))
    m.start()
    assert read_file(m.path / "old.bin") == floats(MiB, 6)
    write_file(m.path / "new.bin", floats(MiB, 7))
    tier_all(m)
    m.umount()
    assert not any(p.is_file() for p in manifests.rglob("*"))
    assert store.head_paths()
    check_clean(fsck_clean, m)
    lose_index_and_log(m)
    assert recover(m).returncode == 0
    m.start()
    assert sorted(os.listdir(m.path)) == ["new.bin", "old.bin"]
    assert read_file(m.path / "new.bin") == floats(MiB, 7)
    check_clean(fsck_clean, m)
