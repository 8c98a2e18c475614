"""Crafting backing-store contents for recover tests: read a real snapshot the
daemon published, change one object (keeping every hash right, so the change
reaches recover's validation rather than its hash check), write legacy
manifests. Works on the store directory of an unmounted filesystem, on its
one volume (`volumes/<name>/`), or the one named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional, Union

from ckptfs import snapshot_format as sf


class Store:
    def __init__(self, root: Path, volume: Optional[str] = None) -> None:
        self.root = root
        marker = json.loads((root / "ckptfs-store").read_text())
        self.fs_uuid = bytes.fromhex(marker["uuid"].replace("-", ""))
        if volume is None:
            names = sorted(p.name for p in (root / "volumes").iterdir())
            assert len(names) == 1, f"the store holds volumes {names}: name one"
            volume = names[0]
        self.volume = volume
        self.vroot = root / "volumes" / volume

    # ------------------------------------------------------------ heads
    def head_paths(self) -> list[Path]:
        d = self.vroot / "heads"
        return sorted(d.iterdir()) if d.exists() else []

    def newest_head(self) -> tuple[Path, dict]:
        path = self.head_paths()[-1]
        return path, json.loads(path.read_bytes())

    def write_head(self, doc: dict, path: Optional[Path] = None) -> Path:
        """Write a head with a correct check (doc without "check")."""
        doc = {k: v for k, v in doc.items() if k != "check"}
        head = sf.Head(bytes.fromhex(doc["fs_uuid"]), doc["seq"], doc["time_ns"],
                       bytes.fromhex(doc["root"]), doc["entries"], doc["files"],
                       doc["incomplete_files"], doc["volume"], doc["gen"])
        path = path or self.vroot / "heads" / f"{doc['gen']:016x}-{doc['seq']:016x}"
        path.write_bytes(sf.encode_head(head))
        return path

    # ---------------------------------------------------------- objects
    def obj_path(self, oid_hex: str) -> Path:
        return self.vroot / "objects" / oid_hex[:2] / oid_hex

    def read(self, oid_hex: str) -> dict:
        return json.loads(self.obj_path(oid_hex).read_bytes())

    def put_raw(self, data: bytes) -> str:
        oid = sf.object_id(data).hex()
        p = self.obj_path(oid)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return oid

    def put(self, doc: Union[dict, list]) -> str:
        return self.put_raw(json.dumps(doc, separators=(",", ":"), sort_keys=True,
                                       ensure_ascii=True).encode())

    def entry_chain(self, rel: str) -> list[tuple[str, dict, int]]:
        """[(dir object id, dir doc, index of the next entry)] from the root to the
        directory holding rel's last component (inline entries only)."""
        _, head = self.newest_head()
        oid = head["root"]
        chain = []
        parts = rel.split("/")
        for i, part in enumerate(parts):
            doc = self.read(oid)
            idx = next(j for j, e in enumerate(doc["entries"]) if e["n"] == part)
            chain.append((oid, doc, idx))
            if i < len(parts) - 1:
                oid = doc["entries"][idx]["d"]
        return chain

    def rewrite(self, rel: str, change: Callable[[dict, "Store"], Optional[str]]) -> None:
        """Change the entry of rel in its directory (change(entry, store) edits it in
        place, may put new objects); rewrite every directory up to a new head."""
        _, head = self.newest_head()
        chain = self.entry_chain(rel)
        oid_dir, doc, idx = chain[-1]
        change(doc["entries"][idx], self)
        new = self.put(doc)
        for oid_dir, doc, idx in reversed(chain[:-1]):
            doc["entries"][idx]["d"] = new
            new = self.put(doc)
        head["root"] = new
        self.write_head(head)

    def file_doc(self, rel: str) -> dict:
        entry = self.entry_chain(rel)[-1][1]["entries"][self.entry_chain(rel)[-1][2]]
        return self.read(entry["f"])

    # -------------------------------------------------------- manifests
    def to_legacy(self) -> None:
        """Turn this store into one written before snapshots: volumes, heads and
        objects go, a format-1 manifest per file of the newest snapshot comes."""
        _, head = self.newest_head()
        out = self.root / "manifests" / self.fs_uuid.hex()
        out.mkdir(parents=True, exist_ok=True)
        todo = [("", head["root"])]
        while todo:
            prefix, oid = todo.pop()
            for e in self.read(oid)["entries"]:
                path = f"{prefix}{e['n']}"
                if "d" in e:
                    todo.append((path + "/", e["d"]))
                elif "f" in e:
                    self.write_manifest(e["i"], [path], self.read(e["f"]))
        for d in ("volumes", "leases"):
            for root, _, files in os.walk(self.root / d):
                for f in files:
                    os.unlink(os.path.join(root, f))

    def write_manifest(self, ino: int, paths: list[str], fdoc: dict,
                       raw: Optional[bytes] = None) -> Path:
        a = fdoc["attrs"]
        doc = {"format": 1, "fs_uuid": self.fs_uuid.hex(), "ino": ino, "paths": paths,
               **{k: a[k] for k in ("mode", "uid", "gid", "size") if k in a},
               "atime_ns": a["atime"], "mtime_ns": a["mtime"], "ctime_ns": a["ctime"],
               "xattrs": {k: v for k, v in a.get("xattrs", [])},
               "extents": fdoc["extents"]}
        path = self.root / "manifests" / self.fs_uuid.hex() / f"{ino}-{a['mtime']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw if raw is not None else json.dumps(doc).encode())
        return path
