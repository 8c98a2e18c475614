#!/usr/bin/env python3
"""What a tiering pass's plan costs the trio thread, at scale.

The planner runs on the trio thread after every commit, so its cost is a stall
of every FUSE request. Two scenarios, each run by this tree's code and, with
--ckptfs-base, by another tree's (one child process per tree, same data):

  files   an index of --files regular files, --per-dir per directory (one
          version each), written straight into LMDB once and kept in --dir. The
          child opens it and times: the first plan (the catalog built on the
          calling thread; the daemon builds it in a worker thread), a plan with
          nothing changed, a plan after one more version of --per-dir files
          was created, and one after a single file of it changed. It prints the
          child's anonymous RSS (what the planner keeps) and peak RSS.
  shared  --versions checkpoints of one --version-mib file each, every one
          the same bytes but its first MiB (dedup shares the rest), written
          through the filesystem's handlers (in-process, a real index and log
          and a local backing store), moved to packs (`tier --now`), then
          timed: three plans, and a plan after a commit into the newest
          version. With dedup the cold versions' chunks stay in the log as
          long as the hot versions name them.

  python3 tools/bench_planner.py [files|shared ...] [--files N] [--per-dir N]
      [--versions N] [--version-mib N] [--dir DIR] [--ckptfs-base TREE] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------------ children

def child_files(index_dir: str, per_dir: int) -> dict:
    from ckptfs import index as ix
    from ckptfs.index import Index, Inode
    from ckptfs.pmemlog import PmemLog
    from ckptfs.tierplan import Planner, TierPolicy

    index = Index(index_dir)
    scratch = tempfile.mkdtemp(prefix="bench-planner-log-")
    plog = PmemLog.create(os.path.join(scratch, "log"), 64 * MiB, ix.new_fs_uuid())
    planner = Planner(index, plog, TierPolicy())
    out: dict = {}

    def timed(name: str) -> None:
        t = time.perf_counter()
        planner.plan(set(), [])
        out[name] = round(time.perf_counter() - t, 4)

    try:
        timed("first_plan_s")
        timed("unchanged_plan_s")
        # One more checkpoint directory, through the live index (pending, as
        # the committer would have it between commits).
        ino = max(ix.scan_inode_numbers(index)) + 1
        now_ns = time.time_ns()
        d = ino
        ix.put_inode(index, Inode(d, stat.S_IFDIR | 0o755, 2, 0, 0, parent=ix.ROOT_INO,
                                  mtime_ns=now_ns))
        ix.add_entry(index, ix.ROOT_INO, b"new-version", d, 1 << 40)
        for i in range(per_dir):
            ix.put_inode(index, Inode(d + 1 + i, stat.S_IFREG | 0o644, 1, 0, 0, size=4096,
                                      mtime_ns=now_ns + i, data_bytes=4096))
            ix.add_entry(index, d, b"f%d" % i, d + 1 + i, i + 1)
        timed("new_version_plan_s")
        ix.put_inode(index, Inode(d + 1, stat.S_IFREG | 0o644, 1, 0, 0, size=8192,
                                  mtime_ns=now_ns + per_dir, data_bytes=8192))
        timed("one_file_changed_plan_s")
        out["rss_anon_mb"] = round(proc_status_mb("RssAnon"), 1)
        out["peak_rss_mb"] = round(proc_status_mb("VmHWM"), 1)
    finally:
        plog.close()
        shutil.rmtree(scratch)
    return out


def child_shared(work: str, versions: int, version_mib: int) -> dict:
    import trio

    from ckptfs import daemon
    from ckptfs.options import parse_options

    source = tempfile.mkdtemp(prefix="bench-planner-src-", dir=work)
    opts = parse_options(source, source, [f"pmem_size={max(1024, 4 * version_mib)}M",
                                          "hot_versions=2"])
    state = daemon.open_state(opts)
    fs = daemon.build_filesystem(state)
    fs.recover()
    planner = fs.tierer.planner
    base = bytearray(random.Random(1).randbytes(version_mib * MiB))
    out: dict = {}

    async def write_file(parent: int, name: bytes, data: bytes) -> None:
        fh, attrs = fs.create(parent, name, 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
        try:
            for off in range(0, len(data), MiB):
                await fs.write(fh, off, data[off:off + MiB])
            await fs.flush(fh)
        finally:
            await fs.release(fh)
            fs.forget(attrs.inode.ino, 1)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(fs.run_committer)
            await n.start(fs.tierer.run)
            newest = 0
            for step in range(versions):
                a = fs.make_node(1, b"step%d" % step, stat.S_IFDIR | 0o755, 0, 0)
                fs.forget(a.inode.ino, 1)
                newest = a.inode.ino
                data = bytearray(base)
                data[:MiB] = random.Random(step + 10).randbytes(MiB)
                await write_file(newest, b"model", bytes(data))
            fs.tierer.start_now(everything=False)
            while not fs.tierer.progress.finished:
                await trio.sleep(0.05)
            for i in range(3):
                t = time.perf_counter()
                planner.plan(set(), [])
                out[f"plan_{i}_s"] = round(time.perf_counter() - t, 4)
            await write_file(newest, b"config.json", b"{}")
            t = time.perf_counter()
            planner.plan(set(), [])
            out["after_commit_plan_s"] = round(time.perf_counter() - t, 4)
            await fs.tierer.stop()
            n.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        state.close()
        shutil.rmtree(source)
    return out


# ------------------------------------------------------------------ the parent

def build_index(index_dir: Path, files: int, per_dir: int) -> None:
    """files regular files, per_dir per directory, one version each. May block."""
    from ckptfs import index as ix
    from ckptfs.index import Index, Inode

    index = Index(str(index_dir))

    def fill(txn) -> None:
        ix.put_inode(txn, Inode(ix.ROOT_INO, stat.S_IFDIR | 0o755, 2, 0, 0))
        ino = ix.ROOT_INO + 1
        for d in range(files // per_dir):
            dino, ino = ino, ino + 1
            ix.put_inode(txn, Inode(dino, stat.S_IFDIR | 0o755, 2, 0, 0, parent=ix.ROOT_INO,
                                    mtime_ns=d))
            ix.add_entry(txn, ix.ROOT_INO, b"step%d" % d, dino, d + 1)
            for f in range(per_dir):
                ix.put_inode(txn, Inode(ino, stat.S_IFREG | 0o644, 1, 0, 0, size=4096,
                                        mtime_ns=d * 10**12 + f, data_bytes=4096))
                ix.add_entry(txn, dino, b"f%d" % f, ino, f + 1)
                ino += 1

    index.write_direct(fill)
    index.close()


def run_child(tree: Path, args: list[str]) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[1:]; "
            "sys.path.insert(1, sys.argv[1] + '/tools'); import bench_planner as b; "
            "print(json.dumps(b.child(sys.argv[1:])))")
    # The child runs THIS file's children with the tree's ckptfs package.
    env = dict(os.environ, PYTHONPATH="")
    res = subprocess.run([sys.executable, "-c", code, str(tree), str(HERE), *args],
                         capture_output=True, text=True, env=env, cwd=str(tree))
    if res.returncode != 0:
        raise SystemExit(f"{tree}: {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def child(argv: list[str]) -> dict:
    """In the child: argv[0] is this tool's repository (for this module), then
    the scenario and its arguments."""
    scenario, rest = argv[1], argv[2:]
    if scenario == "files":
        return child_files(rest[0], int(rest[1]))
    return child_shared(rest[0], int(rest[1]), int(rest[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", default=["files", "shared"])
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--per-dir", type=int, default=1000)
    ap.add_argument("--versions", type=int, default=30)
    ap.add_argument("--version-mib", type=int, default=64)
    ap.add_argument("--dir", default="/var/tmp/bench-planner")
    ap.add_argument("--ckptfs-base", help="another tree (native modules built) to run too")
    ap.add_argument("--json")
    args = ap.parse_args()
    trees = {"ckptfs": HERE}
    if args.ckptfs_base:
        trees["base"] = Path(args.ckptfs_base).resolve()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"load_average": os.getloadavg()}
    if "files" in args.scenarios:
        index_dir = work / f"index-{args.files}-{args.per_dir}"
        if not (index_dir / "data.mdb").exists():
            print(f"building an index of {args.files:,} files in {index_dir} ...", flush=True)
            sys.path.insert(0, str(HERE))
            build_index(index_dir, args.files, args.per_dir)
        for name, tree in trees.items():
            # A copy per run: a plan leaves nothing behind, but the open may.
            copy = Path(tempfile.mkdtemp(prefix="index-", dir=work))
            shutil.copytree(index_dir, copy, dirs_exist_ok=True)
            try:
                r = run_child(tree, ["files", str(copy), str(args.per_dir)])
            finally:
                shutil.rmtree(copy)
            results[f"files/{name}"] = r
            print(f"files   {name:7} {args.files:>9,} files: first plan {r['first_plan_s']:.2f} s, "
                  f"unchanged {1000 * r['unchanged_plan_s']:.1f} ms, after a new version "
                  f"{1000 * r['new_version_plan_s']:.1f} ms, after one file "
                  f"{1000 * r['one_file_changed_plan_s']:.1f} ms; anon RSS "
                  f"{r['rss_anon_mb']:.0f} MB, peak {r['peak_rss_mb']:.0f} MB", flush=True)
    if "shared" in args.scenarios:
        for name, tree in trees.items():
            r = run_child(tree, ["shared", str(work), str(args.versions), str(args.version_mib)])
            results[f"shared/{name}"] = r
            print(f"shared  {name:7} {args.versions} x {args.version_mib} MiB tiered: plans "
                  + ", ".join(f"{1000 * r[f'plan_{i}_s']:.0f}" for i in range(3))
                  + f" ms; after a commit {1000 * r['after_commit_plan_s']:.0f} ms", flush=True)
    print(f"load average {results['load_average'][0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
