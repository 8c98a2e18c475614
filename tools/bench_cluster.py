#!/usr/bin/env python3
"""Cluster benchmark (issue 13): publish lag, restore elsewhere, publish and cold-restore throughput.

    python3 tools/bench_cluster.py [--dir /var/tmp/bench-cluster] [--stores rgw,dir]
                                   [--nodes 3] [--saves 4] [--period 10] [--save-mib 32]
                                   [--big-mib 256] [--delay 5] [--json out.json]

Runs as root (mounts). For each store kind, a fresh store: "rgw" is a bucket on
Ceph's RADOS Gateway started by tools/rgw.py (one node, memstore, on this
machine: the network is loopback), "dir" a directory on this machine's disk
standing for a shared filesystem. Every "node" is a SOURCE directory of its
own under --dir, with its own log and index, mounted by its own daemon with
`backing=STORE,volume=nodeN,publish_delay=DELAY`.

(a) Publish lag. --nodes nodes save at once, one version every --period
    seconds (a directory of two files, --save-mib MiB of float32 weights in
    all, new values every save), --saves times. For each save: the time from
    its last close until the node's `ckptfs stat` says publish_lag_s == 0
    (every commit in a published head), polled every 0.1 s over the control
    socket. Target: within DELAY + one round.

(b) Node lost. Node 0 is killed (SIGKILL) and its .ckptfs (log and index)
    deleted; a spare SOURCE runs `ckptfs recover -o backing=STORE,volume=node0`
    and mounts with volume=node0 (taking it over); every byte of node 0's
    newest published version is compared (sha256) with what it saved.

(c) Publish throughput. A fresh node writes one --big-mib MiB file (float32
    weights); the time from its close to `ckptfs sync --published` returning,
    and the compressed bytes it put in the store.

(d) Cold restore throughput. A spare SOURCE recovers that volume and mounts
    it; page cache dropped; the file is read through the mount (every chunk
    fetched from the store, decompressed, verified): MiB/s, and the recover
    time itself.

Everything is under --dir and removed at the end, also on failure or Ctrl-C
(mounts unmounted, RGW stopped).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from benchlib import drop_caches, log  # noqa: E402
from mounting import Mount, run_ckptfs  # noqa: E402

from ckptfs import control  # noqa: E402

MiB = 1 << 20


def weights(nbytes: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(nbytes // 4, dtype=np.float32) * 0.02).tobytes()


def write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        for i in range(0, len(data), 4 * MiB):
            f.write(data[i:i + 4 * MiB])


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


class Store:
    def __init__(self, kind: str, base: Path) -> None:
        self.kind = kind
        self.rgw = None
        if kind == "dir":
            self.location = str(base / "shared-store")
            return
        import rgw as rgw_tool
        self.rgw = rgw_tool.RGW.start(str(base / "rgw"), memstore_bytes=3 << 30)
        for k, v in self.rgw.env().items():
            os.environ[k] = v
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        rgw_tool.create_bucket(self.rgw, bucket)
        self.location = f"s3://{bucket}/ckpt"

    def close(self) -> None:
        if self.rgw is not None:
            self.rgw.stop()


class Cluster:
    def __init__(self, base: Path, store: Store, delay_s: float) -> None:
        self.base = base
        self.store = store
        self.delay_s = delay_s
        self.mounts: list[Mount] = []

    def node(self, name: str, volume: str, pmem: str = "1G", start: bool = True) -> Mount:
        src = self.base / name
        src.mkdir(parents=True, exist_ok=True)
        m = Mount(src, src, [f"pmem_size={pmem}", f"backing={self.store.location}",
                             f"volume={volume}", f"publish_delay={self.delay_s:g}",
                             "hot_versions=2"])
        self.mounts.append(m)
        if start:
            m.start()
        return m

    def cleanup(self) -> None:
        for m in self.mounts:
            m.cleanup(abort=True)


def lag_after(m: Mount, closed: float, timeout_s: float = 600) -> float:
    while True:
        st = control.request(str(m.path), "stat", timeout_s=30)
        if st["publish_lag_s"] == 0 and st["publish_backlog_bytes"] == 0:
            return time.monotonic() - closed
        if time.monotonic() - closed > timeout_s:
            raise RuntimeError(f"{m.path}: not published after {timeout_s} s: {st}")
        time.sleep(0.1)


def bench_store(kind: str, args, base: Path) -> dict:
    out: dict = {"store": kind}
    store = Store(kind, base)
    cluster = Cluster(base, store, args.delay)
    try:
        # (a) publish lag, several nodes saving at once
        nodes = [cluster.node(f"node{i}", f"node{i}") for i in range(args.nodes)]
        lags: list[list[float]] = [[] for _ in nodes]
        saved: list[dict[str, str]] = [{} for _ in nodes]
        errors: list[BaseException] = []

        def saver(i: int) -> None:
            try:
                start = time.monotonic()
                for s in range(args.saves):
                    d = nodes[i].path / f"step_{s}"
                    d.mkdir()
                    files = {"model.bin": weights(args.save_mib * MiB * 2 // 3, 1000 * i + s),
                             "optim.bin": weights(args.save_mib * MiB // 3, 5000 * i + s)}
                    for name, data in files.items():
                        write(d / name, data)
                        saved[i][f"step_{s}/{name}"] = hashlib.sha256(data).hexdigest()
                    lags[i].append(lag_after(nodes[i], time.monotonic()))
                    time.sleep(max(0.0, start + (s + 1) * args.period - time.monotonic()))
            except BaseException as e:     # noqa: BLE001
                errors.append(e)

        log(f"[{kind}] (a) {args.nodes} nodes, {args.saves} saves of {args.save_mib} MiB "
            f"every {args.period} s, publish_delay={args.delay}")
        threads = [threading.Thread(target=saver, args=(i,)) for i in range(args.nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        flat = sorted(x for ls in lags for x in ls)
        out["lag_s"] = {"median": flat[len(flat) // 2], "max": flat[-1], "all": flat}
        log(f"[{kind}] lag close->published: median {flat[len(flat) // 2]:.2f} s, "
            f"max {flat[-1]:.2f} s")
        # (b) node 0 lost, restored on a spare
        nodes[0].kill()
        shutil.rmtree(nodes[0].source / ".ckptfs")
        spare = cluster.node("spare0", "node0", start=False)
        t0 = time.monotonic()
        res = run_ckptfs("recover", str(spare.source), "-o",
                         f"backing={store.location},volume=node0", check=False, timeout=1800)
        out["lost_node_recover_s"] = time.monotonic() - t0
        if res.returncode != 0:
            raise RuntimeError(f"recover failed: {res.stdout}{res.stderr}")
        spare.start()
        bad = [rel for rel, h in saved[0].items() if sha(spare.path / rel) != h]
        out["lost_node_bytes_verified"] = not bad
        log(f"[{kind}] (b) node0 killed, recovered on a spare in "
            f"{out['lost_node_recover_s']:.1f} s; every byte of its "
            f"{len(saved[0])} files {'verified' if not bad else 'WRONG: ' + str(bad)}")
        for m in nodes[1:] + [spare]:
            m.umount()
        # (c) publish throughput
        big = cluster.node("bignode", "big", pmem=f"{max(2 * args.big_mib, 512)}M")
        data = weights(args.big_mib * MiB, 7)
        digest = hashlib.sha256(data).hexdigest()
        t0 = time.monotonic()
        write(big.path / "big.bin", data)
        closed = time.monotonic()
        run_ckptfs("sync", "--published", str(big.path), timeout=3600)
        published = time.monotonic()
        st = big.stat()
        out["write_mib_s"] = args.big_mib / (closed - t0)
        out["publish_s"] = published - closed
        out["publish_mib_s"] = args.big_mib / (published - closed)
        out["published_copy_bytes"] = st["published_copy_bytes"]
        log(f"[{kind}] (c) {args.big_mib} MiB: written in {closed - t0:.1f} s; published "
            f"{published - closed:.1f} s after the close ({out['publish_mib_s']:.0f} MiB/s), "
            f"{st['published_copy_bytes'] / MiB:.0f} MiB in the store")
        big.umount()
        del data
        # (d) cold restore throughput
        spare = cluster.node("spare-big", "big", pmem=f"{max(2 * args.big_mib, 512)}M",
                             start=False)
        t0 = time.monotonic()
        run_ckptfs("recover", str(spare.source), "-o", f"backing={store.location},volume=big",
                   timeout=3600)
        out["restore_recover_s"] = time.monotonic() - t0
        spare.start()
        drop_caches()
        t0 = time.monotonic()
        ok = sha(spare.path / "big.bin") == digest
        out["cold_read_s"] = time.monotonic() - t0
        out["cold_read_mib_s"] = args.big_mib / out["cold_read_s"]
        out["cold_read_verified"] = ok
        log(f"[{kind}] (d) recover {out['restore_recover_s']:.1f} s; cold read "
            f"{out['cold_read_s']:.1f} s ({out['cold_read_mib_s']:.0f} MiB/s), bytes "
            f"{'verified' if ok else 'WRONG'}")
        spare.umount()
        return out
    finally:
        cluster.cleanup()
        store.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/var/tmp/bench-cluster")
    p.add_argument("--stores", default="rgw,dir")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--period", type=float, default=10.0)
    p.add_argument("--save-mib", type=int, default=32)
    p.add_argument("--big-mib", type=int, default=256)
    p.add_argument("--delay", type=float, default=5.0)
    p.add_argument("--json")
    args = p.parse_args()
    base = Path(args.dir)
    if base.exists():
        shutil.rmtree(base)
    results = []
    try:
        for kind in args.stores.split(","):
            results.append(bench_store(kind, args, base / kind))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\nnodes={args.nodes} saves={args.saves} period={args.period}s "
          f"save={args.save_mib}MiB big={args.big_mib}MiB publish_delay={args.delay}s "
          f"load {os.getloadavg()[0]:.1f}")
    print("store  lag median  lag max  node-lost recover  publish MiB/s  cold read MiB/s  "
          "restore recover")
    for r in results:
        print(f"{r['store']:<6} {r['lag_s']['median']:>8.2f}s {r['lag_s']['max']:>7.2f}s "
              f"{r['lost_node_recover_s']:>16.1f}s {r['publish_mib_s']:>14.0f} "
              f"{r['cold_read_mib_s']:>16.0f} {r['restore_recover_s']:>15.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r["lost_node_bytes_verified"] and r["cold_read_verified"]
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
