#!/usr/bin/env python3
"""Dedup across nodes (issue 13, item 5): store bytes of a frozen fine-tune saved by
1 node and by 3 nodes sharing one store, and gc during two nodes' publishes.

    python3 tools/bench_cluster_dedup.py [--store dir|rgw] [--frozen-mib 64] [--trained-mib 8]
                                   [--steps 4] [--gc-steps 12] [--workdir DIR]

A "node" is a SOURCE mounted on this machine with its own volume of the store
(-o backing=STORE,volume=nodeN). Each node saves, per step, one safetensors
file: the frozen layers (float32, the same on every node and every step) and
the trained layers (float32, new per node and step), like a fine-tune whose
base model every node holds. After each phase: `ckptfs sync --published` on
every node, then the bytes of packs/ in the store (S3: the sizes of the
objects under the prefix's packs/), and again after 4 rounds of `ckptfs gc`
on every node. Series: 1 node; 3 nodes on one store; 3 nodes on a store
each (what the store would hold without dedup across nodes); and one node
saving the frozen layers alone once, which gives the ideal for 3 nodes (the
frozen layers once, every trained part once).

Phase gc: 2 nodes save --steps steps each (deleting the step before the last,
as a trainer's rotation does) while `ckptfs gc` runs in a loop on both; the
figures are the saves' and gcs' times, and then every kept file is read back
and checked on its node and, after both unmount, both volumes are recovered on
fresh SOURCEs from the store alone and checked again.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import log  # noqa: E402
from mounting import Mount, run_ckptfs  # noqa: E402

MiB = 1 << 20


def tensors(seed: int, mib: int, prefix: str) -> dict:
    """mib MiB of float32 weights in 1 MiB tensors, from a seed."""
    rng = np.random.default_rng(seed)
    return {f"{prefix}.{i}": rng.standard_normal((256, 1024), dtype=np.float32)
            for i in range(mib)}


class Store:
    def __init__(self, kind: str, work: Path) -> None:
        self.kind = kind
        self.gw = None
        if kind == "dir":
            self.path = work / "store"
            self.path.mkdir()
            self.url = str(self.path)
        else:
            import boto3
            import rgw as rgw_tool
            self.gw = rgw_tool.RGW.start(str(work / "rgw"), memstore_bytes=3 << 30)
            os.environ.update(self.gw.env())
            self.s3 = boto3.client("s3", endpoint_url=self.gw.endpoint_url,
                                   region_name=self.gw.region)
            self.bucket = f"bench-{os.urandom(4).hex()}"
            self.s3.create_bucket(Bucket=self.bucket)
            self.url = f"s3://{self.bucket}/store"

    def new_prefix(self, name: str) -> str:
        if self.kind == "dir":
            p = self.path / name
            p.mkdir()
            return str(p)
        return f"s3://{self.bucket}/{name}"

    def pack_bytes(self, url: str) -> int:
        if self.kind == "dir":
            return sum(f.stat().st_size for f in (Path(url) / "packs").rglob("*") if f.is_file())
        prefix = url.split("/", 3)[3] + "/packs/"
        total = 0
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                      Prefix=prefix):
            total += sum(o["Size"] for o in page.get("Contents", ()))
        return total

    def close(self) -> None:
        if self.gw is not None:
            self.gw.stop()


def mount_node(work: Path, store: str, name: str) -> Mount:
    src = work / name
    src.mkdir()
    m = Mount(src, src, ["pmem_size=768M", f"backing={store}", f"volume={name}"])
    m.start()
    return m


def save_step(m: Mount, node: int, step: int, frozen: dict, trained_mib: int) -> bytes:
    d = m.path / f"checkpoint-{step}"
    d.mkdir()
    state = dict(frozen)
    if trained_mib:
        state.update(tensors(1000 * node + step + 1, trained_mib, "trained"))
    tmp = d / "model.safetensors.tmp"
    save_file(state, str(tmp))
    os.rename(tmp, d / "model.safetensors")
    return hashlib.sha256((d / "model.safetensors").read_bytes()).digest()


def series(store: Store, work: Path, nodes: int, args, separate: bool = False,
           steps: int = 0, trained_mib: int = 0) -> dict:
    """nodes save `steps` steps each (default --steps; trained_mib 0 with
    steps 1: the frozen layers alone); `separate`: each node on a store of
    its own (no dedup across nodes)."""
    steps = steps or args.steps
    tag = f"series-{nodes}{'-separate' if separate else ''}{'-frozen' if steps == 1 else ''}"
    urls = [store.new_prefix(f"{tag}-{i}") for i in range(nodes)] if separate \
        else [store.new_prefix(tag)]
    frozen = tensors(7, args.frozen_mib, "frozen")
    (work / tag).mkdir()
    mounts = [mount_node(work / tag, urls[i % len(urls)], f"node{i}") for i in range(nodes)]
    started = time.monotonic()
    try:
        for step in range(steps):
            for i, m in enumerate(mounts):
                save_step(m, i, step, frozen, trained_mib if steps == 1 else args.trained_mib)
        for m in mounts:
            run_ckptfs("sync", "--published", str(m.path), timeout=1800)
        seconds = time.monotonic() - started
        held = sum(store.pack_bytes(url) for url in urls)
        saved = sum(m.stat().get("shared_bytes_saved", 0) for m in mounts)
        # Packs a node let go (copies two nodes packed at once) leave with the
        # heads that name them: gc on every node, past the 3 heads each keeps.
        for _ in range(4):
            for m in mounts:
                run_ckptfs("gc", str(m.path), timeout=1800)
        after_gc = sum(store.pack_bytes(url) for url in urls)
    finally:
        for m in mounts:
            m.cleanup()
    logical = nodes * steps * (args.frozen_mib + (trained_mib if steps == 1 else args.trained_mib)
                               ) * MiB
    return {"nodes": nodes, "logical_mib": logical / MiB, "store_mib": held / MiB,
            "store_mib_after_gc": after_gc / MiB,
            "shared_saved_mib": saved / MiB, "seconds": seconds}


def gc_phase(store: Store, work: Path, args) -> dict:
    url = store.new_prefix("gc")
    (work / "gc").mkdir()
    frozen = tensors(7, args.frozen_mib, "frozen")
    mounts = [mount_node(work / "gc", url, f"node{i}") for i in range(2)]
    kept: dict = {}
    errors: list = []
    save_s: list = []

    def saver(i: int, m: Mount) -> None:
        try:
            for step in range(args.gc_steps):
                t = time.monotonic()
                kept[(i, step)] = save_step(m, i, step, frozen, args.trained_mib)
                save_s.append(time.monotonic() - t)
                if step >= 2:
                    shutil.rmtree(m.path / f"checkpoint-{step - 2}")
                    kept.pop((i, step - 2))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(i, m)) for i, m in enumerate(mounts)]
    gc_s: list = []
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for m in mounts:
                t0 = time.monotonic()
                run_ckptfs("gc", str(m.path), timeout=1800)
                gc_s.append(time.monotonic() - t0)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for m in mounts:
            run_ckptfs("sync", "--published", str(m.path), timeout=1800)
            for _ in range(4):
                run_ckptfs("gc", str(m.path), timeout=1800)
        for (i, step), digest in kept.items():
            got = hashlib.sha256((mounts[i].path / f"checkpoint-{step}/model.safetensors")
                                 .read_bytes()).digest()
            assert got == digest, (i, step)
        held = store.pack_bytes(url)
        for m in mounts:
            m.umount()
        for i in range(2):
            src = work / "gc" / f"recovered{i}"
            src.mkdir()
            run_ckptfs("recover", str(src), "-o", f"backing={url},volume=node{i}", timeout=1800)
            r = Mount(src, src, ["pmem_size=768M", f"volume=node{i}"])
            r.start()
            try:
                for (j, step), digest in kept.items():
                    if j == i:
                        got = hashlib.sha256((r.path / f"checkpoint-{step}/model.safetensors")
                                             .read_bytes()).digest()
                        assert got == digest, ("recovered", i, step)
            finally:
                r.cleanup()
    finally:
        for m in mounts:
            m.cleanup()
    return {"saves": len(save_s), "save_s_median": sorted(save_s)[len(save_s) // 2],
            "save_s_max": max(save_s), "gcs": len(gc_s),
            "gc_s_median": sorted(gc_s)[len(gc_s) // 2], "gc_s_max": max(gc_s),
            "store_mib_after": held / MiB, "verified_files": len(kept)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", choices=("dir", "rgw"), default="dir")
    ap.add_argument("--frozen-mib", type=int, default=64)
    ap.add_argument("--trained-mib", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="saves per node in the series")
    ap.add_argument("--gc-steps", type=int, default=12, help="saves per node in the gc phase")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-", dir=args.workdir))
    store = Store(args.store, work)
    try:
        one = None
        for nodes, separate in ((1, False), (3, False), (3, True)):
            r = series(store, work, nodes, args, separate)
            one = r if nodes == 1 else one
            log(f"series, {nodes} node(s){' on a store each' if separate else ''}: "
                f"{r['logical_mib']:.0f} MiB saved, store holds "
                f"{r['store_mib']:.1f} MiB of packs ({r['store_mib_after_gc']:.1f} MiB after gc on "
                f"every node); {r['shared_saved_mib']:.1f} MiB taken "
                f"from other volumes instead of stored; {r['seconds']:.1f} s")
        f = series(store, work, 1, args, steps=1, trained_mib=0)["store_mib_after_gc"]
        trained = (one["store_mib_after_gc"] - f) / args.steps
        log(f"ideal for 3 nodes: the frozen layers once ({f:.1f} MiB stored) and "
            f"{3 * args.steps} trained parts ({trained:.2f} MiB each): "
            f"{f + 3 * args.steps * trained:.1f} MiB")
        r = gc_phase(store, work, args)
        log(f"gc during 2 nodes' publishes: {r['saves']} saves (median {r['save_s_median']:.2f} "
            f"s, max {r['save_s_max']:.2f} s), {r['gcs']} gc runs (median "
            f"{r['gc_s_median']:.2f} s, max {r['gc_s_max']:.2f} s), store {r['store_mib_after']:.1f}"
            f" MiB after, {r['verified_files']} kept files verified on their nodes and after "
            "recover")
    finally:
        store.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
