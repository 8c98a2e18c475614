"""Fuzz `ckptfs recover` with generated bad snapshots (hypothesis).

One real filesystem is written through a mount and tiered once; each example
copies its store, damages the snapshot in one generated way (a field set to
any JSON value or deleted, an object truncated, replaced, removed or
flipped, names that are no names, entries twice or out of order, an entry
naming an ancestor, hard links that disagree, a head that lies) with every
hash kept right where the damage should reach validation, and runs recover
in-process. Whatever the input: no exception but the project's own, exit 0, 1
or 4, a bad item named, no index left half built, and any index that is
built passes fsck with every data check.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings, strategies as st  # noqa: E402

from mounting import Mount, run_ckptfs  # noqa: E402
from store_craft import Store  # noqa: E402

from ckptfs.errors import CkptfsError  # noqa: E402
from ckptfs.fsck import run_fsck  # noqa: E402
from ckptfs.recover import run_recover  # noqa: E402

NASTY_NAMES = ["", ".", "..", "a/b", "nul\0", "x" * 256, "\udcff\udcfe", ".ckptfs", "b.bin"]
json_leaf = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
             | st.floats(allow_nan=False) | st.text(max_size=12) | st.sampled_from(NASTY_NAMES)
             | st.sampled_from(["ab" * 32, "00" * 32, "AB" * 32, "dir", "file", "dirpage"]))
json_values = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=8)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """SOURCE of a tiered filesystem (dirs, files, hard link, symlink, empty dir, a
    FIFO), unmounted, its index and log gone: what recover starts from."""
    src = tmp_path_factory.mktemp("fuzzbase") / "ckpt"
    src.mkdir()
    m = Mount(src, src, ["pmem_size=64M"])
    try:
        m.start()
        rng = random.Random(7)
        (src / "d").mkdir()
        (src / "d" / "e").mkdir()
        (src / "empty").mkdir()
        for rel in ("a.bin", "b.bin", "d/c.bin", "d/e/f.bin"):
            (src / rel).write_bytes(rng.randbytes(40_000 + rng.randrange(90_000)))
        os.link(src / "a.bin", src / "d" / "a-link.bin")
        os.symlink("d/c.bin", src / "latest")
        os.mkfifo(src / "d" / "fifo")
        os.setxattr(src / "d", "user.k", b"v")
        run_ckptfs("tier", str(src), "--now", "--all")
        m.umount()
    finally:
        m.cleanup()
    shutil.rmtree(src / ".ckptfs" / "index")
    os.unlink(src / ".ckptfs" / "pmem.log")
    return src


# ---------------------------------------------------------------- mutations

def _substitute(store: Store, old: str, new: str | None) -> None:
    """Replace object `old` by `new` wherever the newest head reaches it, rewriting
    every object on the way up (hashes stay right); new=None removes it."""
    if new is None:
        store.obj_path(old).unlink()
        return
    path, head = store.newest_head()
    memo: dict[str, str] = {}

    def sub(oid: str) -> str:
        if oid == old:
            return new
        if oid in memo:
            return memo[oid]
        memo[oid] = oid
        try:
            doc = store.read(oid)
        except (OSError, ValueError):
            return oid
        changed = False
        if isinstance(doc, dict):
            for key in ("pages",):
                if isinstance(doc.get(key), list):
                    doc[key] = [sub(p) if isinstance(p, str) else p for p in doc[key]]
            for e in doc.get("entries", []) if isinstance(doc.get("entries"), list) else []:
                for k in ("d", "f"):
                    if isinstance(e, dict) and isinstance(e.get(k), str):
                        e[k] = sub(e[k])
        result = store.put(doc)
        changed = result != oid
        memo[oid] = result if changed else oid
        return memo[oid]

    head["root"] = sub(head["root"])
    store.write_head(head, path)


def _reachable(store: Store) -> list[tuple[str, str]]:
    _, head = store.newest_head()
    out, todo, seen = [], [(head["root"], "dir")], set()
    while todo:
        oid, kind = todo.pop()
        if oid in seen:
            continue
        seen.add(oid)
        out.append((oid, kind))
        doc = store.read(oid)
        for p in doc.get("pages", []):
            todo.append((p, "dirpage" if kind == "dir" else "extpage"))
        for e in doc.get("entries", []):
            if "d" in e:
                todo.append((e["d"], "dir"))
            elif "f" in e:
                todo.append((e["f"], "file"))
    return out


def _slots(value, out: list) -> list:
    """Every (container, key) inside a JSON value."""
    if isinstance(value, dict):
        for k in list(value):
            out.append((value, k))
            _slots(value[k], out)
    elif isinstance(value, list):
        for i in range(len(value)):
            out.append((value, i))
            _slots(value[i], out)
    return out


def _paged(store: Store, oid: str, kind: str) -> str | None:
    """The same directory or file with its entries/extents on pages (valid)."""
    doc = store.read(oid)
    key, page_kind = ("entries", "dirpage") if kind == "dir" else ("extents", "extpage")
    items = doc.get(key)
    if not items:
        return None
    half = max(1, len(items) // 2)
    pages = [store.put({"v": 1, "t": page_kind, key: items[i:i + half]})
             for i in range(0, len(items), half)]
    del doc[key]
    doc["pages"] = pages
    return store.put(doc)


def mutate(store: Store, data) -> str:
    """Damage the store in one generated way; return what was done (for failures)."""
    objects = _reachable(store)
    op = data.draw(st.sampled_from([
        "set", "delete-key", "raw", "truncate", "remove", "flip", "names", "dup-entry",
        "reverse", "ancestor", "hardlink", "head-field", "head-truncate", "paged-then-set"]))
    if op.startswith("head"):
        path, head = store.newest_head()
        if op == "head-truncate":
            raw = path.read_bytes()
            path.write_bytes(raw[:data.draw(st.integers(0, len(raw) - 1))])
            return op
        field = data.draw(st.sampled_from(sorted(head)))
        head[field] = data.draw(json_values | st.sampled_from([0, 1, 2 ** 64, -1]))
        try:
            store.write_head(head, path)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
            doc = {k: v for k, v in head.items() if k != "check"}
            path.write_bytes(json.dumps(doc).encode())        # a head with a wrong check
        return f"{op} {field}={head[field]!r}"[:200]
    oid, kind = data.draw(st.sampled_from(objects))
    if op == "paged-then-set":
        if kind in ("dir", "file"):
            paged = _paged(store, oid, kind)
            if paged is not None:
                _substitute(store, oid, paged)
                objects = _reachable(store)
                oid, kind = data.draw(st.sampled_from(objects))
        op = "set"
    doc = store.read(oid)
    if op in ("set", "delete-key"):
        slots = _slots(doc, [])
        container, key = data.draw(st.sampled_from(slots))
        if op == "delete-key" and isinstance(container, dict):
            del container[key]
        else:
            container[key] = data.draw(json_values)
        _substitute(store, oid, store.put(doc))
        return f"{op} in {kind}"
    if op == "raw":
        _substitute(store, oid, store.put_raw(data.draw(st.binary(max_size=200))))
    elif op == "truncate":
        raw = store.obj_path(oid).read_bytes()
        _substitute(store, oid, store.put_raw(raw[:data.draw(st.integers(0, len(raw) - 1))]))
    elif op == "remove":
        _substitute(store, oid, None)
    elif op == "flip":
        p = store.obj_path(oid)
        raw = bytearray(p.read_bytes())
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
        p.write_bytes(bytes(raw))
    elif op in ("names", "dup-entry", "reverse", "ancestor", "hardlink"):
        entries = doc.get("entries")
        if not entries:
            return f"{op} skipped ({kind} has no entries)"
        i = data.draw(st.integers(0, len(entries) - 1))
        if op == "names":
            entries[i]["n"] = data.draw(st.sampled_from(NASTY_NAMES) | st.text(max_size=300))
        elif op == "dup-entry":
            entries.insert(i, dict(entries[i]))
        elif op == "reverse":
            entries.reverse()
        elif op == "ancestor":
            _, head = store.newest_head()
            entries[i] = {"n": entries[i]["n"], "d": head["root"]}
        else:
            files = [e for e in entries if "i" in e]
            if files:
                files[0]["i"] = data.draw(st.sampled_from(
                    [e["i"] for e in entries if "i" in e] + [files[0]["i"] + 1]))
                if len(files) > 1:
                    files[-1]["i"] = files[0]["i"]
        _substitute(store, oid, store.put(doc))
    return f"{op} on {kind}"


# -------------------------------------------------------------------- test

@settings(max_examples=int(os.environ.get("CKPTFS_FUZZ_EXAMPLES", "80")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(data=st.data())
def test_recover_survives_any_damage_to_the_snapshot(pristine, tmp_path, data):
    work = Path(tmp_path) / f"case{random.randrange(1 << 30)}"
    shutil.copytree(pristine, work, symlinks=True)
    try:
        store = Store(work / ".ckptfs" / "store")
        what = mutate(store, data)
        out = io.StringIO()
        try:
            rc = run_recover(str(work), [], out=out)
        except CkptfsError as e:          # the CLI prints it as one line, exit 1
            rc, out = 1, io.StringIO(f"ckptfs: {e}\n")
        text = out.getvalue()
        event(f"{what.split(' ')[0]} -> exit {rc}")
        state = work / ".ckptfs"
        assert rc in (0, 4, 1), (what, rc, text)
        assert not (state / "index.recover-tmp").exists(), (what, text)
        if rc == 4:
            assert "not recovered:" in text or "no index was built" in text, (what, text)
        if rc == 1 or "no index was built" in text:
            assert not (state / "index").exists(), (what, text)
        if (state / "index").exists():
            fout = io.StringIO()
            frc = run_fsck(str(work), [], verify_data=True, out=fout)
            assert frc == 0, (what, text, fout.getvalue())
    finally:
        shutil.rmtree(work, ignore_errors=True)
