"""The peer view (-o peers=): other volumes' published files, read-only, under one's own.

Two "nodes" are two SOURCEs mounted on this machine, each its own volume of
one store (a directory here; RGW in the multi-node DCP case). What one node
publishes shows on the other once its view is refreshed (peer_refresh);
the node's own names win; the peers' files are read-only; a name made in a
directory only a peer has is made as the node's own (docs/OPERATIONS.md,
"Running on a cluster").
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mounting import run_ckptfs
from test_s3 import bucket  # noqa: F401 - the fixture: a fresh bucket on the gateway

HELPERS = Path(__file__).resolve().parent.parent / "compat" / "helpers"
sys.path.insert(0, str(HELPERS))      # compat_util, compat_dcp_worker: shared with tests/compat
from compat_util import run_dcp_ranks  # noqa: E402

REFRESH_S = 0.5


def node(make_mount, tmp_path: Path, name: str, store: str, *more: str):
    src = tmp_path / name
    src.mkdir()
    return make_mount(options=["pmem_size=256M", f"backing={store}", f"volume={name}",
                               "peers=all", f"peer_refresh={REFRESH_S}", *more], source=src)


def published(*mounts) -> None:
    for m in mounts:
        run_ckptfs("sync", "--published", str(m.path))


def wait_for(check, timeout_s: float = 20.0):
    """Poll until check() is truthy (the view refreshes every REFRESH_S s and
    the kernel caches entries as long)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = check()
            if got:
                return got
        except OSError:
            pass
        if time.monotonic() > deadline:
            return check()
        time.sleep(0.1)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def two_nodes(make_mount, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    a = node(make_mount, tmp_path, "nodeA", str(store))
    b = node(make_mount, tmp_path, "nodeB", str(store))
    return a, b


def test_published_files_show_on_the_other_node(two_nodes):
    a, b = two_nodes
    (a.path / "ckpt" / "step1").mkdir(parents=True)
    (b.path / "ckpt" / "step1").mkdir(parents=True)
    big = os.urandom(5 << 20)
    (a.path / "ckpt/step1/__0_0.distcp").write_bytes(big)
    (a.path / "ckpt/step1/.metadata").write_bytes(b"meta from A")
    (b.path / "ckpt/step1/__1_0.distcp").write_bytes(b"B's shard" * 1000)
    os.symlink("step1", a.path / "ckpt/latest")
    (a.path / "only-a").mkdir()
    (a.path / "only-a/deep.bin").write_bytes(b"x" * 70000)
    published(a, b)
    for here, there in ((a, b), (b, a)):
        want = sorted([".metadata", "__0_0.distcp", "__1_0.distcp"])
        assert wait_for(lambda: sorted(os.listdir(here.path / "ckpt/step1")) == want), \
            os.listdir(here.path / "ckpt/step1")
    assert (b.path / "ckpt/step1/__0_0.distcp").read_bytes() == big
    assert (b.path / "ckpt/step1/.metadata").read_bytes() == b"meta from A"
    assert (a.path / "ckpt/step1/__1_0.distcp").read_bytes() == b"B's shard" * 1000
    assert os.readlink(b.path / "ckpt/latest") == "step1"
    assert (b.path / "ckpt/latest/.metadata").read_bytes() == b"meta from A"
    assert (b.path / "only-a/deep.bin").read_bytes() == b"x" * 70000
    st = os.stat(b.path / "ckpt/step1/__0_0.distcp")
    assert st.st_size == len(big) and st.st_ino >= 1 << 62
    # mmap and ranged reads of a peer's file (torch.load(mmap=True), DCP's ranged reads)
    with open(b.path / "ckpt/step1/__0_0.distcp", "rb") as f:
        f.seek(3_000_001)
        assert f.read(100_000) == big[3_000_001:3_100_001]


def test_peer_files_are_read_only_and_own_names_win(two_nodes):
    a, b = two_nodes
    (a.path / "d").mkdir()
    (a.path / "d/f").write_bytes(b"A's f")
    (a.path / "d/both").write_bytes(b"A's both")
    (b.path / "both-top").write_bytes(b"B's")
    (a.path / "both-top").write_bytes(b"A's")
    published(a)
    assert wait_for(lambda: (b.path / "d/f").exists())
    f = b.path / "d/f"
    for call in (lambda: open(f, "r+b"), lambda: open(f, "ab"), lambda: os.truncate(f, 0),
                 lambda: os.chmod(f, 0o600), lambda: os.unlink(f),
                 lambda: os.rename(f, b.path / "d/g"), lambda: os.rmdir(b.path / "d"),
                 lambda: os.setxattr(f, "user.x", b"1")):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.EROFS, call
    assert f.read_bytes() == b"A's f"
    assert (b.path / "both-top").read_bytes() == b"B's"      # own name wins
    # A name made in a directory only the peer has: the path becomes B's own.
    (b.path / "d/mine").write_bytes(b"B's new file")
    (b.path / "d/sub").mkdir()
    (b.path / "d/sub/x").write_bytes(b"deeper")
    assert sorted(os.listdir(b.path / "d")) == ["both", "f", "mine", "sub"]
    # ... and a rename onto a peer's name hides it (DCP's .metadata.tmp -> .metadata).
    (b.path / "d/both.tmp").write_bytes(b"B's both")
    os.rename(b.path / "d/both.tmp", b.path / "d/both")
    assert (b.path / "d/both").read_bytes() == b"B's both"
    os.unlink(b.path / "d/both")                      # B's own goes, A's shows again
    assert wait_for(lambda: (b.path / "d/both").read_bytes() == b"A's both")
    # B's own directory d is a real one: it survives the remount, A's entries merge in.
    b.remount()
    assert (b.path / "d/mine").read_bytes() == b"B's new file"
    assert wait_for(lambda: sorted(os.listdir(b.path / "d")) == ["both", "f", "mine", "sub"])


def test_open_with_truncation_over_a_peer_name_makes_an_own_file(two_nodes):
    """`open(path, "w")` over a name only a peer has (torch.save over a peer's
    checkpoint) makes this node's own file, which hides the peer's, as a
    rename onto it does; the peer's file is untouched, opening it for
    writing without O_TRUNC is still EROFS, and removing the own file shows
    the peer's again."""
    a, b = two_nodes
    (a.path / "d").mkdir()
    (a.path / "d/f").write_bytes(b"A's f" * 1000)
    (a.path / "top").write_bytes(b"A's top")
    os.chmod(a.path / "d/f", 0o640)
    published(a)
    assert wait_for(lambda: (b.path / "d/f").exists() and (b.path / "top").exists())
    with pytest.raises(OSError) as e:
        open(b.path / "d/f", "r+b")
    assert e.value.errno == errno.EROFS
    with open(b.path / "d/f", "wb") as fh:      # O_WRONLY|O_CREAT|O_TRUNC
        fh.write(b"B's f")
    fd = os.open(b.path / "top", os.O_RDWR | os.O_TRUNC)     # no O_CREAT: the same
    os.write(fd, b"B's top")
    os.close(fd)
    assert (b.path / "d/f").read_bytes() == b"B's f"
    assert (b.path / "top").read_bytes() == b"B's top"
    st = os.stat(b.path / "d/f")
    assert st.st_size == 5 and stat.S_IMODE(st.st_mode) == 0o640, st
    assert sorted(os.listdir(b.path / "d")) == ["f"]
    assert (a.path / "d/f").read_bytes() == b"A's f" * 1000     # the peer's is untouched
    b.remount()                                               # B's own, durable
    assert (b.path / "d/f").read_bytes() == b"B's f"
    os.unlink(b.path / "d/f")                                 # B's own goes, A's shows
    assert wait_for(lambda: (b.path / "d/f").read_bytes() == b"A's f" * 1000)


def test_newer_versions_and_deletions_follow_the_peer(two_nodes):
    a, b = two_nodes
    (a.path / "v").write_bytes(b"version 1")
    (a.path / "gone").write_bytes(b"soon deleted")
    published(a)
    assert wait_for(lambda: (b.path / "v").exists() and (b.path / "gone").exists())
    with open(b.path / "v", "rb") as held:            # an open file keeps its version
        assert held.read() == b"version 1"
        (a.path / "v.tmp").write_bytes(b"version 2, longer")
        os.rename(a.path / "v.tmp", a.path / "v")
        os.unlink(a.path / "gone")
        published(a)
        assert wait_for(lambda: (b.path / "v").read_bytes() == b"version 2, longer")
        assert wait_for(lambda: not (b.path / "gone").exists())
        held.seek(0)
        assert held.read() == b"version 1"


def test_a_file_not_wholly_in_the_store_is_not_shown(make_mount, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    # A copies nothing to the store by itself: its heads name the file as
    # still in the log (not recoverable from the store), so B must not show it.
    a = node(make_mount, tmp_path, "nodeA", str(store), "publish_delay=off")
    b = node(make_mount, tmp_path, "nodeB", str(store))
    (a.path / "late").write_bytes(b"not yet" * 1000)
    run_ckptfs("gc", str(a.path))                 # publishes a head naming it
    rows = json.loads(run_ckptfs("volumes", str(store), "--json").stdout)
    assert [r["incomplete_files"] for r in rows if r["volume"] == "nodeA"] == [1]
    time.sleep(3 * REFRESH_S)
    assert not (b.path / "late").exists()
    run_ckptfs("tier", str(a.path), "--now", "--all")     # now wholly in the store
    assert wait_for(lambda: (b.path / "late").exists())
    assert (b.path / "late").read_bytes() == b"not yet" * 1000


def test_peers_names_volumes_and_needs_a_store(make_mount, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    a = node(make_mount, tmp_path, "nodeA", str(store))
    c = node(make_mount, tmp_path, "nodeC", str(store))
    src = tmp_path / "nodeB"
    src.mkdir()
    b = make_mount(options=["pmem_size=256M", f"backing={store}", "volume=nodeB",
                            "peers=nodeC", f"peer_refresh={REFRESH_S}"], source=src)
    (a.path / "from-a").write_bytes(b"a")
    (c.path / "from-c").write_bytes(b"c")
    published(a, c)
    assert wait_for(lambda: (b.path / "from-c").exists())
    time.sleep(3 * REFRESH_S)
    assert not (b.path / "from-a").exists()
    src = tmp_path / "lonely"
    src.mkdir()
    with pytest.raises(AssertionError, match="peers= needs a backing store"):
        make_mount(options=["pmem_size=256M", "tiering=off", "peers=all"], source=src)


# ----------------------------------------------------------- DCP on 2 nodes

FULL_LOAD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed.checkpoint as dcp
from compat_dcp_worker import full_state
step, path = int(sys.argv[2]), sys.argv[3]
want = full_state(step)
sd = {g: {n: torch.zeros_like(t) for n, t in ts.items()} for g, ts in want.items()}
dcp.load(sd, checkpoint_id=path, no_dist=True)
for g, ts in want.items():
    for n, t in ts.items():
        assert torch.equal(sd[g][n], t), (g, n)
print("full load ok")
"""


@pytest.mark.cluster
@pytest.mark.parametrize("store_kind", ["dir", "rgw"])
def test_dcp_saved_on_two_nodes_loads_on_each(store_kind, make_mount, tmp_path, request,
                                              monkeypatch):
    pytest.importorskip("torch.distributed.checkpoint")
    if store_kind == "rgw":
        bucket = request.getfixturevalue("bucket")       # test_s3's: emptied after
        for k, v in request.getfixturevalue("rgw").env().items():
            monkeypatch.setenv(k, v)                     # the mounts find the gateway so
        store = f"s3://{bucket}/cluster"
    else:
        (tmp_path / "store").mkdir()
        store = str(tmp_path / "store")
    a = node(make_mount, tmp_path, "nodeA", store)
    b = node(make_mount, tmp_path, "nodeB", store)
    da, db = a.path / "run/step-7", b.path / "run/step-7"
    # Rank 0 on node A, rank 1 on node B: each writes its shards into its own mount.
    run_dcp_ranks(tmp_path, f"save:{da}+{db}:7")
    published(a, b)
    everything = sorted(set(os.listdir(da)) | set(os.listdir(db)))
    assert wait_for(lambda: sorted(os.listdir(da)) == everything == sorted(os.listdir(db)))
    # The same load, unchanged: each rank reads its node's mount, .metadata and
    # rank 0's non-tensor state come from node A's volume on node B.
    run_dcp_ranks(tmp_path, f"load:{da}+{db}:7")
    # One process on node B reads every shard (resharding to full tensors).
    res = subprocess.run([sys.executable, "-c", FULL_LOAD, str(HELPERS), "7", str(db)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
