"""Data-parallel ranks writing shards, and a reader watching them (tests/compat/test_concurrency.py).

    compat_rank_io.py writer ROOT RANK STEPS
    compat_rank_io.py reader ROOT WORLD STEPS DONE_FILE

A writer, for each step, writes `step-S/rank-R.bin.tmp` in 1 MiB writes,
fsyncs it, renames it to `rank-R.bin` (as torch.save + rename users do) and
drops a small `rank-R.json` next to it with tempfile + os.replace. A
shard's bytes follow from (step, rank) alone, so anyone can check them.

The reader lists and stats the step directories while the writers run,
reads in-progress temp files (any prefix is fine, errors are not), and
reads every finished shard it sees in full: a finished name must always
show the whole, exact shard. It exits once DONE_FILE exists and it has
verified every shard, printing how many reads it checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time

import numpy as np

MiB = 1 << 20


def shard_bytes(step: int, rank: int) -> bytes:
    size = 12 * MiB + rank * 40_961 + step * 7
    return np.random.default_rng(step * 1000 + rank).bytes(size)


def writer(root: str, rank: int, steps: int) -> None:
    for step in range(1, steps + 1):
        d = os.path.join(root, f"step-{step}")
        os.makedirs(d, exist_ok=True)
        data = memoryview(shard_bytes(step, rank))
        tmp = os.path.join(d, f"rank-{rank}.bin.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for off in range(0, len(data), MiB):
                chunk = data[off:off + MiB]
                while chunk:
                    chunk = chunk[os.write(fd, chunk):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(d, f"rank-{rank}.bin"))
        meta = json.dumps({"rank": rank, "step": step, "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()}).encode()
        with tempfile.NamedTemporaryFile(dir=d, prefix=f".rank-{rank}.", delete=False) as f:
            f.write(meta)
        os.replace(f.name, os.path.join(d, f"rank-{rank}.json"))


def reader(root: str, world: int, steps: int, done_file: str) -> None:
    want = {(s, r): hashlib.sha256(shard_bytes(s, r)).hexdigest()
            for s in range(1, steps + 1) for r in range(world)}
    verified: set = set()
    checked = partial_reads = listings = 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        done = os.path.exists(done_file)
        for s in range(1, steps + 1):
            d = os.path.join(root, f"step-{s}")
            try:
                names = os.listdir(d)
            except FileNotFoundError:
                continue
            listings += 1
            for name in names:
                path = os.path.join(d, name)
                try:
                    st = os.stat(path)
                    with open(path, "rb") as f:
                        body = f.read()
                except FileNotFoundError:
                    continue            # renamed or replaced since the listing
                if name.endswith(".bin"):
                    r = int(name[len("rank-"):-len(".bin")])
                    assert len(body) == st.st_size, (path, len(body), st.st_size)
                    got = hashlib.sha256(body).hexdigest()
                    assert got == want[(s, r)], f"{path}: finished shard has wrong bytes"
                    verified.add((s, r))
                    checked += 1
                elif name.endswith(".json") and not name.startswith("."):
                    meta = json.loads(body)
                    assert meta["sha256"] == want[(meta["step"], meta["rank"])], path
                elif name.endswith(".bin.tmp"):
                    partial_reads += 1
        if done and len(verified) == len(want):
            print(json.dumps({"checked": checked, "partial_reads": partial_reads,
                              "listings": listings}))
            return
        if done and checked and len(verified) < len(want):
            continue                    # one more pass sees the last shards
    raise SystemExit(f"reader timed out: verified {len(verified)} of {len(want)}")


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "writer":
        writer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        reader(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
