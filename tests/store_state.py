"""What an unmounted filesystem's index and local store hold, for the tiering
and crash tests (tests/store/test_tier.py, tests/crash/test_crash_kill.py)."""

from __future__ import annotations

from pathlib import Path


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
