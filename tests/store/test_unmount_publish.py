"""A clean unmount with publishing on copies the last commits to the store.

The node may be gone after its unmount: what was committed before it must
be in the store then, not only in its log (publish.py `round_at_unmount`,
docs/STORE.md "Publishing"). A store that is down or slow holds the unmount
up for at most unmount_publish_timeout; what is left stays in the log, a
warning says how much, and the next mount publishes it.
"""

from __future__ import annotations

import os
import time

from mounting import run_ckptfs
from test_s3 import bucket, s3_env  # noqa: F401 - fixtures: a fresh bucket, the gateway's env
from test_shared_chunks import recover_and_check

MiB = 1 << 20


def daemon_log(m) -> str:
    return (m.source / ".ckptfs" / "daemon.log").read_text()


def write_now(m) -> dict[str, bytes]:
    """A checkpoint's files, then at once (no `sync --published`) nothing more."""
    want = {"model.bin": os.urandom(6 * MiB), "optim.bin": os.urandom(3 * MiB),
            "tick": os.urandom(100)}
    for name, data in want.items():
        (m.path / name).write_bytes(data)
    return want


def test_unmount_right_after_writing_publishes_every_byte(make_mount, tmp_path, fsck_clean):
    """Written, then unmounted before publishing's round (publish_delay=60):
    the store alone gives every byte back (ckptfs recover)."""
    store = tmp_path / "store"
    store.mkdir()
    src = tmp_path / "node"
    src.mkdir()
    m = make_mount(options=["pmem_size=256M", f"backing={store}", "volume=node",
                            "publish_delay=60"], source=src)
    want = write_now(m)
    m.umount()
    text = daemon_log(m)
    assert "unmount: every committed byte is in the store" in text, text[-3000:]
    assert "only on this node" not in text
    fsck_clean(m)
    recover_and_check(tmp_path, make_mount, str(store), "node", want)


def test_publishing_off_unmounts_as_before(make_mount, tmp_path, fsck_clean):
    """The default store inside SOURCE (publishing off): the unmount publishes
    its snapshot and copies nothing (what is hot stays only in the log)."""
    m = make_mount(options=["pmem_size=256M"])
    write_now(m)
    m.umount()
    text = daemon_log(m)
    assert "unmount: " not in text, text[-3000:]
    assert "snapshot" in text and "published" in text
    packs_dir = m.source / ".ckptfs" / "store" / "packs"
    assert not packs_dir.exists() or not [p for p in packs_dir.rglob("*") if p.is_file()]
    fsck_clean(m)


def test_gateway_down_at_unmount_warns_and_next_mount_publishes(
        make_mount, tmp_path, rgw, bucket, s3_env, monkeypatch, fsck_clean):  # noqa: F811
    """The S3 gateway is stopped when the node unmounts: the unmount completes
    (well within unmount_publish_timeout), a warning says how many bytes are
    only on this node; the next mount publishes them: recover then gives
    every byte."""
    url = f"s3://{bucket}/ckpt"
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    src = tmp_path / "node"
    src.mkdir()
    m = make_mount(options=["pmem_size=256M", f"backing={url}", "volume=node",
                            "publish_delay=60", "unmount_publish_timeout=120"], source=src)
    run_ckptfs("sync", "--published", str(m.path))     # the volume's first head is there
    want = write_now(m)
    rgw.stop_gateway()
    try:
        t = time.monotonic()
        m.umount()
        took_s = time.monotonic() - t
    finally:
        rgw.start_gateway()
    assert took_s < 60, took_s
    text = daemon_log(m)
    line = [x for x in text.splitlines() if "only on this node" in x]
    assert line and "WARNING" in line[-1] and "next mount publishes them" in line[-1], text[-3000:]
    only_here = int(line[-1].split("unmount: ")[1].split(" bytes")[0])
    assert only_here >= sum(len(d) for d in want.values()), line[-1]
    assert "every committed byte is in the store" not in text
    m.start()
    run_ckptfs("sync", "--published", str(m.path))
    m.umount()
    assert daemon_log(m).count("every committed byte is in the store") == 1
    fsck_clean(m)
    recover_and_check(tmp_path, make_mount, url, "node", want)


def test_slow_gateway_holds_the_unmount_up_no_longer_than_the_timeout(
        make_mount, tmp_path, rgw, bucket, s3_env, monkeypatch, fsck_clean):  # noqa: F811
    """The gateway stops answering (SIGSTOP: connections accepted, no reply)
    when the node unmounts: the unmount ends after unmount_publish_timeout=4
    (not after the S3 client's timeouts and retries), with the warning; the
    next mount publishes."""
    url = f"s3://{bucket}/ckpt"
    src = tmp_path / "node"
    src.mkdir()
    m = make_mount(options=["pmem_size=256M", f"backing={url}", "volume=node",
                            "publish_delay=60", "unmount_publish_timeout=4"], source=src)
    run_ckptfs("sync", "--published", str(m.path))
    want = write_now(m)
    rgw.pause()
    try:
        t = time.monotonic()
        m.umount()
        took_s = time.monotonic() - t
    finally:
        rgw.resume()
    assert took_s < 15, took_s             # the S3 client alone: 20 s read timeout x 4 tries
    text = daemon_log(m)
    line = [x for x in text.splitlines() if "only on this node" in x]
    assert line and "unmount_publish_timeout=4 s" in line[-1], text[-3000:]
    time.sleep(1)                          # requests queued in the pause finish
    m.start()
    run_ckptfs("sync", "--published", str(m.path), timeout=300)
    m.umount()
    fsck_clean(m)
    recover_and_check(tmp_path, make_mount, url, "node", want)


def test_pack_write_under_way_gives_up_at_the_timeout(make_mount, tmp_path, monkeypatch,
                                                       fsck_clean):
    """The final round's pack write stalls (the mover's debug hook holds it
    half written, as a store that stopped answering would): the unmount ends
    after unmount_publish_timeout; the pack's intent has the next mount
    delete what it wrote, and that mount publishes every byte."""
    store = tmp_path / "store"
    store.mkdir()
    src = tmp_path / "node"
    src.mkdir()
    marker = tmp_path / "paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"unmount-pack-writing:{marker}")
    # sync=lazy with a long lazy_delay: the files' commits are made durable by
    # the unmount's final commits, so no round of the loop can copy them first.
    m = make_mount(options=["pmem_size=256M", f"backing={store}", "volume=node",
                            "publish_delay=60", "unmount_publish_timeout=3", "sync=lazy",
                            "lazy_delay=600"], source=src)
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    run_ckptfs("sync", "--published", str(m.path))     # the mount's own round is done
    want = write_now(m)
    t = time.monotonic()
    try:
        m.umount(timeout_s=60)
        took_s = time.monotonic() - t
        assert marker.exists(), "the last round's pack write never reached the hook"
    finally:
        marker.unlink(missing_ok=True)
    assert took_s < 12, took_s
    text = daemon_log(m)
    line = [x for x in text.splitlines() if "only on this node" in x]
    assert line and "unmount_publish_timeout=3 s" in line[-1], text[-3000:]
    m.start()
    run_ckptfs("sync", "--published", str(m.path))
    m.umount()
    assert daemon_log(m).count("every committed byte is in the store") == 1
    fsck_clean(m)
    recover_and_check(tmp_path, make_mount, str(store), "node", want)
