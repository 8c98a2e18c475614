"""The daemon's cyclic-collector setting (daemon.quiet_collector)."""

from __future__ import annotations

import gc

from ckptfs import daemon


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
