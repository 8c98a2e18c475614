"""A test hook: stop the tiering mover at a named point (crash tests).

CKPTFS_DEBUG_PAUSE="POINT:PATH". The first time the mover reaches POINT it
creates PATH and waits there while PATH exists, so that crash tests kill the
daemon exactly there instead of sleeping and hoping (or delete PATH to let it
go on). Points: pack-begin (an intent durable, no byte of the pack written),
pack-writing (a pack half written), unmount-pack-writing (the same,
in a clean unmount's last publishing round only), pack-written (committed in the store,
not yet named by the index), pass-done (a pass finished and durable),
pack-dead (a pack that lost its last chunk left the index, its blob not yet
deleted), publish-failed (a publishing round failed, its error not yet
recorded), stream-feed (a write stream's chunk feed, behind writes already
answered: staging.py), log-view (the log's in-place view for the chunk
feed, its pages populated, not read yet: pmemlog.py), mapped-read (a READ
answered from the log's mapping, its pages populated, not checked yet: read
by native/ckptfs_fuse.c itself, on the trio thread). Unset (always, outside tests), `pausing_at` is False everywhere.

`pause_blocking` waits on a worker thread (blocks); `pause` on the trio
thread (only the calling task waits).

CKPTFS_DEBUG_FAIL="POINT:PATH": once PATH exists, the first time the daemon
reaches POINT it raises an unexpected exception there (a bug standing in),
so tests see what the daemon does with one. Points: commit-durable (the
index committer, right after a batch became durable, before it is announced).
"""

from __future__ import annotations

import logging
import os
import time

import trio

log = logging.getLogger("ckptfs.tier")

DEBUG_PAUSE = os.environ.get("CKPTFS_DEBUG_PAUSE", "")
DEBUG_FAIL = os.environ.get("CKPTFS_DEBUG_FAIL", "")
_paused_once = False
_failed_once = False


def pausing_at(point: str) -> bool:
    """The test hook (DEBUG_PAUSE) names this point and has not paused yet."""
    return not _paused_once and DEBUG_PAUSE.partition(":")[0] == point


def failing_at(point: str) -> bool:
    """The failure hook (DEBUG_FAIL) names this point, its file exists, and it
    has not fired yet: the caller raises. May block (a stat, only when set)."""
    global _failed_once
    if _failed_once or not DEBUG_FAIL or DEBUG_FAIL.partition(":")[0] != point \
            or not os.path.exists(DEBUG_FAIL.partition(":")[2]):
        return False
    _failed_once = True
    log.warning("debug failure at %s (CKPTFS_DEBUG_FAIL)", point)
    return True


def _pause_begins(point: str) -> str:
    global _paused_once
    _paused_once = True
    path = DEBUG_PAUSE.partition(":")[2]
    log.warning("debug pause at %s (CKPTFS_DEBUG_PAUSE) until %s is removed", point, path)
    with open(path, "w") as f:
        f.write(point)
    return path


def pause_blocking(point: str) -> None:
    """The test hook reached its point on the mover's thread: say so with its
    file, wait while the file exists. Blocks."""
    path = _pause_begins(point)
    while os.path.exists(path):
        time.sleep(0.02)
    log.warning("debug pause at %s over", point)


async def pause(point: str) -> None:
    """The same on the trio thread: only the mover's task waits."""
    path = _pause_begins(point)
    while os.path.exists(path):
        await trio.sleep(0.02)
    log.warning("debug pause at %s over", point)
