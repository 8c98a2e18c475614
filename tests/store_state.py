"""What an unmounted filesystem's index and local store hold, for the tiering
and crash tests (tests/store/test_tier.py, tests/crash/test_crash_kill.py),
and a tiering pass stopped by a kill."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mounting import REPO
from posix_helpers import wait_until


def tier_in_background(m) -> subprocess.Popen:
    """`ckptfs tier --now` on m, left running (a test stops its pass at a
    debug hook the daemon was started with)."""
    return subprocess.Popen([sys.executable, "-m", "ckptfs.cli", "tier", str(m.path), "--now"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)


def kill_in_tier_pass(m, marker: Path, what: str) -> None:
    """A tiering pass on m until the mover stops at its debug hook (marker
    made; `what` names the hook when it never comes), then SIGKILL of the
    daemon."""
    proc = tier_in_background(m)
    try:
        wait_until(marker.exists, 120, what)
        m.kill()
    finally:
        proc.wait(timeout=60)


def store_packs(m) -> tuple[set[str], set[int], set[str], list[Path], set[int]]:
    """What an unmounted filesystem's index and store hold: (pack names the
    index records, pack intents, pack blobs in the store, temporaries, packs
    marked dead)."""
    from ckptfs import index as ix
    from ckptfs.packs import pack_name
    idx = ix.Index(str(m.source / ".ckptfs" / "index"))
    try:
        named = {pack_name(n) for n in ix.scan_pack_numbers(idx)}
        intents = set(ix.pack_intents(idx))
        dead = set(ix.dead_packs(idx))
    finally:
        idx.close()
    root = m.source / ".ckptfs" / "store"
    blobs = {str(p.relative_to(root)) for p in (root / "packs").rglob("*.pack")
             if not p.name.startswith(".")}
    temps = [p for p in root.rglob(".*") if ".tmp-" in p.name]
    return named, intents, blobs, temps, dead
