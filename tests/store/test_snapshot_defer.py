"""A background tiering pass that moved nothing publishes its snapshot once the
writers pause, not in the middle of their burst (ckptfs/tier.py,
`snapshot_may_wait`); a pass that moved chunks, a long burst, and the unmount
still publish.
"""

from __future__ import annotations

import os
import threading
import time

from ckptfs.tier import SNAPSHOT_DEFER_MAX_S, SNAPSHOT_QUIET_S, snapshot_may_wait

KiB = 1 << 10


def test_snapshot_may_wait_only_behind_busy_writers_and_not_for_long():
    now = 1000.0
    busy = now - SNAPSHOT_QUIET_S / 2          # a commit just now
    quiet = now - SNAPSHOT_QUIET_S             # none for the quiet time
    assert snapshot_may_wait(0, now, busy, None)
    assert snapshot_may_wait(0, now, busy, now - SNAPSHOT_DEFER_MAX_S / 2)
    assert not snapshot_may_wait(0, now, busy, now - SNAPSHOT_DEFER_MAX_S)   # waited enough
    assert not snapshot_may_wait(0, now, quiet, None)
    assert not snapshot_may_wait(0, now, quiet, now - 1.0)
    assert not snapshot_may_wait(4 * KiB, now, busy, None)     # the pass moved chunks


def test_snapshot_waits_for_a_burst_of_small_files_then_is_published(make_mount):
    m = make_mount(["pmem_size=512M", "sync=close"])
    (m.path / "first").write_bytes(b"x" * 4 * KiB)
    deadline = time.monotonic() + 30
    while m.stat()["snapshot_seq"] is None:             # the first pass, writers idle
        assert time.monotonic() < deadline, "no snapshot after the first pass"
        time.sleep(0.2)
    seq0 = m.stat()["snapshot_seq"]

    stop = threading.Event()
    written = []

    def writer() -> None:
        d = m.path / "burst"
        d.mkdir()
        while not stop.is_set():
            p = d / f"f{len(written):06d}"
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, os.urandom(4 * KiB))
            finally:
                os.close(fd)            # sync=close: a durable commit each
            written.append(p)

    t = threading.Thread(target=writer)
    t.start()
    owed_seen = False
    try:
        # Two and a half pass intervals (5 s) of commits: each pass has
        # something new and moves nothing (every version is hot).
        burst_end = time.monotonic() + 12
        while time.monotonic() < burst_end:
            stat = m.stat()
            assert stat["snapshot_seq"] == seq0, "a snapshot was published during the burst"
            owed_seen = owed_seen or stat["snapshot_owed_s"] is not None
            time.sleep(0.25)
    finally:
        stop.set()
        t.join()
    assert written and owed_seen, (len(written), owed_seen)

    deadline = time.monotonic() + 4 * SNAPSHOT_QUIET_S + 5
    while m.stat()["snapshot_seq"] == seq0:
        assert time.monotonic() < deadline, "the owed snapshot was not published after the burst"
        time.sleep(0.2)
    assert m.stat()["snapshot_owed_s"] is None
    for p in written[:: max(1, len(written) // 50)]:
        assert p.stat().st_size == 4 * KiB
