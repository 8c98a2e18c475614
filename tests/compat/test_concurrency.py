"""Eight data-parallel ranks saving shards at once while a reader watches.

Each rank is its own process (tests/compat/helpers/compat_rank_io.py) writing
`step-S/rank-R.bin` through a temp name, fsync and rename, plus a JSON
sidecar by tempfile + os.replace; a ninth process lists, stats and reads
the directories the whole time. A finished name must never show anything
but the exact shard. Every shard is verified again after a remount.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from compat_util import HELPERS, sha256_file

np = pytest.importorskip("numpy")
from compat_rank_io import shard_bytes  # noqa: E402  (numpy)

WORLD = 8
STEPS = 2


def test_eight_ranks_write_shards_while_reader_reads(make_mount, fsck_clean, tmp_path):
    m = make_mount(options=["pmem_size=512M"])
    root = m.path / "ckpt"
    root.mkdir()
    done = tmp_path / "writers-done"
    script = str(HELPERS / "compat_rank_io.py")
    reader = subprocess.Popen([sys.executable, script, "reader", str(root), str(WORLD),
                               str(STEPS), str(done)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writers = [subprocess.Popen([sys.executable, script, "writer", str(root), str(r), str(STEPS)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for r in range(WORLD)]
    try:
        for r, w in enumerate(writers):
            out, err = w.communicate(timeout=240)
            assert w.returncode == 0, f"rank {r} failed:\n{err[-3000:]}"
        done.touch()
        out, err = reader.communicate(timeout=240)
        assert reader.returncode == 0, f"reader failed:\n{err[-3000:]}"
    finally:
        for p in writers + [reader]:
            if p.poll() is None:
                p.kill()
                p.wait()
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["checked"] >= WORLD * STEPS and stats["listings"] > 0

    want = {}
    for s in range(1, STEPS + 1):
        for r in range(WORLD):
            want[f"step-{s}/rank-{r}.bin"] = hashlib.sha256(shard_bytes(s, r)).hexdigest()

    def verify() -> None:
        for s in range(1, STEPS + 1):
            names = sorted(os.listdir(root / f"step-{s}"))
            assert names == sorted([f"rank-{r}.bin" for r in range(WORLD)]
                                   + [f"rank-{r}.json" for r in range(WORLD)]), names
        for rel, digest in want.items():
            assert sha256_file(root / rel) == digest, rel
            meta = json.loads((root / rel).with_suffix(".json").read_text())
            assert meta["sha256"] == digest

    verify()
    m.remount()
    verify()
    fsck_clean(m)
