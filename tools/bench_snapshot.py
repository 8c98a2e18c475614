#!/usr/bin/env python3
"""What a namespace snapshot costs (docs/STORE.md), and recover from it.

    python tools/bench_snapshot.py [--dir /var/tmp/bench-snapshot] [--files 10000]

Runs as root (mounts). Makes a tree of --files small files (100 per
directory) through a ckptfs mount, tiers everything, unmounts; then times, in
this process, on the unmounted index and store:

  first    a snapshot from a fresh publisher, nothing in the store yet (every
           object written: one blob each)
  again    the same publisher once more, nothing changed (every file's inode
           record unchanged: the walk only; no object written)
  fresh    a new publisher (as after a remount): every file's extents read and
           its object hashed again, none written
  one      one file changed (its object, its directory's, the root's written)

and `ckptfs recover` from the newest snapshot after the index is deleted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ckptfs import index as ix  # noqa: E402
from ckptfs.backing.local import LocalBackend  # noqa: E402
from ckptfs.index import Index  # noqa: E402
from ckptfs.snapshots import Publisher  # noqa: E402

CKPTFS = [sys.executable, "-m", "ckptfs.cli"]


def run(*args: str) -> str:
    res = subprocess.run(list(args), capture_output=True, text=True, cwd=REPO)
    if res.returncode not in (0, 4):
        raise SystemExit(f"{' '.join(args)}: {res.returncode} {res.stderr}")
    return res.stdout


def publish(index: Index, pub: Publisher) -> tuple[float, int]:
    seq = [0]

    def reserve(txn) -> None:
        seq[0] = ix.read_counter(txn, b"next_head")
        ix.write_counters(txn, {b"next_head": seq[0] + 1})

    index.write_direct(reserve)
    t0 = time.perf_counter()
    done = pub.publish_blocking(seq[0])
    return time.perf_counter() - t0, done.objects_written


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/var/tmp/bench-snapshot")
    ap.add_argument("--files", type=int, default=10000)
    args = ap.parse_args()
    top = Path(args.dir)
    shutil.rmtree(top, ignore_errors=True)
    src = top / "src"
    src.mkdir(parents=True)
    run(*CKPTFS, "mount", str(src), str(src), "-o", "pmem_size=256M")
    try:
        t0 = time.perf_counter()
        for i in range(args.files):
            d = src / f"d{i // 100:04d}"
            if i % 100 == 0:
                d.mkdir()
            (d / f"f{i:06d}").write_bytes(b"x%d" % i * 40)
        made = time.perf_counter() - t0
        run(*CKPTFS, "tier", str(src), "--now", "--all")
    finally:
        run(*CKPTFS, "umount", str(src))
    state = src / ".ckptfs"
    store = state / "store"
    shutil.rmtree(store / "objects", ignore_errors=True)      # "first": an empty store
    shutil.rmtree(store / "heads", ignore_errors=True)
    index = Index(str(state / "index"))
    fs_uuid = index.check_format()
    rows = []
    with LocalBackend.open(store) as backend:
        pub = Publisher(index, backend, fs_uuid)
        rows.append(("first", *publish(index, pub)))
        rows.append(("again", *publish(index, pub)))
        rows.append(("fresh", *publish(index, Publisher(index, backend, fs_uuid))))

        def touch(txn) -> None:
            d = ix.lookup_entry(txn, ix.ROOT_INO, b"d0000")[0]
            f = ix.get_inode(txn, ix.lookup_entry(txn, d, b"f000000")[0])
            f.mtime_ns += 1
            ix.put_inode(txn, f)

        index.write_direct(touch)
        rows.append(("one", *publish(index, pub)))
    index.close()
    print(f"{args.files} files in {args.files // 100} directories (made in {made:.1f} s "
          "through the mount)")
    for name, seconds, written in rows:
        print(f"  {name:<6} {seconds:7.2f} s  {written:6d} objects written")
    shutil.rmtree(state / "index")
    os.unlink(state / "pmem.log")
    t0 = time.perf_counter()
    out = run(*CKPTFS, "recover", str(src))
    print(f"  recover {time.perf_counter() - t0:6.2f} s: {out.strip().splitlines()[-1]}")
    shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
