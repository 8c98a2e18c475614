"""torch.distributed.checkpoint on ckptfs: two gloo ranks, each its own process.

DCP's FileSystemWriter has every rank write `__<rank>_<n>.distcp` (fsync'ed,
sync_files=True), then rank 0 writes `.metadata.tmp`, fsyncs it, removes an
old `.metadata` and renames the temp file into place. The ranks run
tests/compat/helpers/compat_dcp_worker.py, which saves a state built from a step
number and, when loading, checks every shard bit for bit against it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from compat_util import run_dcp_ranks, sha256_file

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

PMEM_SIZE = "256M"         # the log of each test's mount (compat/conftest.py)

WORLD = 2
HAS_ASYNC = hasattr(dcp, "async_save")


def shas(d: Path) -> dict[str, str]:
    return {n: sha256_file(d / n) for n in sorted(os.listdir(d))}


def test_dcp_save_async_save_overwrite_load(mounted, fsck_clean, tmp_path):
    a, b = mounted.path / "step-1", mounted.path / "step-3"
    second = "async_save" if HAS_ASYNC else "save"
    # a: one save. b: saved at step 2, then saved over at step 3 (DCP removes the
    # old .metadata and renames .metadata.tmp in). Loading a verifies before the remount.
    run_dcp_ranks(tmp_path, f"save:{a}:1", f"save:{b}:2", f"{second}:{b}:3", f"load:{a}:1",
                  world=WORLD, timeout=180)
    # thread_count=2: each rank writes two shard files.
    expected = [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]
    assert sorted(os.listdir(a)) == expected
    assert sorted(os.listdir(b)) == expected
    before = {d: shas(d) for d in (a, b)}
    mounted.remount()
    assert {d: shas(d) for d in (a, b)} == before
    run_dcp_ranks(tmp_path, f"load:{a}:1", f"load:{b}:3", world=WORLD, timeout=180)
    fsck_clean(mounted)
