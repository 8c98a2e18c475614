"""The snapshot format: how the backing store holds the filesystem's namespace.

One module owns it: the writer (`snapshots.py`) encodes with it and `ckptfs
recover` decodes and validates with it, so what one writes the other reads
(the layout, the write order and why: docs/STORE.md).

    objects/<first 2 hex>/<64 hex>    a namespace object, named by BLAKE3-256 of
                                      its bytes (so an unchanged directory or file
                                      is written once, whichever snapshot names it)
    heads/<gen 16 hex>-<seq 16 hex>   a head: the snapshot with that sequence
                                      number (a counter of the index, never reused)
                                      published under that lease generation

These names are inside a volume's part of the store, `volumes/<name>/`
(`volumes.py`). Before volumes, one filesystem owned the store's root and
its heads were `heads/<fs uuid hex>/<16 hex>` there (version 1 heads, still
read by recover).

Every object is one canonical JSON document (sorted keys, no spaces, ASCII):

    {"v":1,"t":"dir","attrs":A,"entries":[E,...]}      or  "pages":[ID,...]
    {"v":1,"t":"dirpage","entries":[E,...]}
    {"v":1,"t":"file","attrs":A,"extents":[X,...]}     or  "pages":[ID,...]
    {"v":1,"t":"extpage","extents":[X,...]}

    A  {"mode":M,"uid":U,"gid":G,"atime":NS,"mtime":NS,"ctime":NS,
        "size":N (files), "rdev":N (device nodes), "target":S (symlinks),
        "xattrs":[[NAME_HEX,VALUE_HEX],...] (sorted, omitted when none)}
    E  {"n":NAME,"d":ID}                  a directory (its "dir" object)
       {"n":NAME,"i":INO,"f":ID}          a regular file (its "file" object)
       {"n":NAME,"i":INO,"a":A}           anything else, inline: symlink, device,
                                          FIFO, socket
       {"n":NAME,"x":WHY}                 a name the writer could not describe
                                          (index damage): never restored, named
    X  [FILE_OFF,LENGTH,CHUNK_ID_HEX,CHUNK_OFF]   bytes in the store (a chunk
                                                  in some pack's trailer)
       [FILE_OFF,LENGTH]                          bytes not in the store (still
                                                  hot in the log, pre-existing in
                                                  SOURCE): not recoverable from it

Names and symlink targets are the file system's bytes decoded as UTF-8 with
surrogateescape (JSON writes an undecodable byte as \\udcXX). Entries are
sorted by name bytes, extents by offset; INO is the inode number in the
filesystem that wrote the snapshot, so hard links share it. A directory with
more than PAGE_ENTRIES entries (or PAGE_BYTES of them), or a file with more
than PAGE_EXTENTS extents, lists pages instead, in order: every object stays
below MAX_OBJECT_BYTES and can be written and read one page at a time.

A head is one JSON document too, with a BLAKE3 check of itself:

    {"format":"ckptfs-head","version":2,"volume":NAME,"gen":G,"fs_uuid":HEX,
     "seq":N,"time_ns":NS,"root":ID,"entries":N,"files":N,
     "incomplete_files":N,"check":HEX}

(version 1, before volumes, has neither "volume" nor "gen".)

`decode_*` check everything before returning (types, ranges, names, order,
the object's BLAKE3 against its name) and raise BadObject with what is wrong;
a bad entry of a directory is returned as a BadEntry so the rest of the
directory can still be used. Nothing here touches the store.
"""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from .chunker import chunk_id
from .errors import FormatError
from .files import MAX_FILE_BYTES
from .namespace import NAME_MAX, XATTR_NAME_MAX, XATTR_VALUE_MAX

VERSION = 1                    # namespace objects and legacy heads
HEAD_VERSION = 2               # heads of a volume
OBJECT_PREFIX = "objects/"
HEAD_PREFIX = "heads/"
HEAD_FORMAT = "ckptfs-head"
ID_BYTES = 32

PAGE_ENTRIES = 4096            # directory entries per object or page
PAGE_EXTENTS = 4096            # extents per object or page
PAGE_BYTES = 1 << 20           # a page is closed once its entries reach this many bytes
MAX_OBJECT_BYTES = 16 << 20    # objects larger than this are refused before parsing
MAX_HEAD_BYTES = 64 << 10
MAX_PAGES = (MAX_OBJECT_BYTES - 1024) // (2 * ID_BYTES + 3)
MAX_TARGET_BYTES = 4096        # PATH_MAX: a symlink target
MAX_INO = (1 << 63) - 1
MAX_WHY_CHARS = 300
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_I64 = (-(1 << 63), (1 << 63) - 1)
_NODE_TYPES = (stat.S_IFLNK, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK)


class BadObject(FormatError):
    """A head or namespace object that is damaged or not what it should be."""


# ------------------------------------------------------------------ names

def object_name(obj_id: bytes) -> str:
    h = obj_id.hex()
    return f"{OBJECT_PREFIX}{h[:2]}/{h}"


def object_id_from_name(name: str) -> Optional[bytes]:
    """The id an object blob's name stands for, or None if it is not one."""
    base = name.rpartition("/")[2]
    if len(base) != 2 * ID_BYTES or name != f"{OBJECT_PREFIX}{base[:2]}/{base}":
        return None
    try:
        return bytes.fromhex(base)
    except ValueError:
        return None


def heads_prefix(fs_uuid: bytes) -> str:
    return f"{HEAD_PREFIX}{fs_uuid.hex()}/"


def head_name(fs_uuid: bytes, seq: int) -> str:
    return f"{heads_prefix(fs_uuid)}{seq:016x}"


def head_seq_from_name(name: str) -> Optional[int]:
    base = name.rpartition("/")[2]
    if len(base) != 16 or base != base.lower():
        return None
    try:
        return int(base, 16)
    except ValueError:
        return None


def object_id(data: bytes) -> bytes:
    return chunk_id(data)


# ---------------------------------------------------------------- records

@dataclass
class Attrs:
    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    size: int = 0
    rdev: int = 0
    target: bytes = b""
    xattrs: list[tuple[bytes, bytes]] = field(default_factory=list)


@dataclass
class Entry:
    name: bytes
    kind: str                    # "d" directory, "f" regular file, "n" anything else,
                                 # "x" not describable (index damage)
    ino: int = 0
    obj: bytes = b""             # "d", "f": the object id
    attrs: Optional[Attrs] = None    # "n"
    why: str = ""                # "x"


@dataclass
class BadEntry:
    name: str                    # for messages: the name as far as it could be read
    why: str


@dataclass
class Extent:
    file_off: int
    length: int
    chunk_id: Optional[bytes]    # None: these bytes are not in the store
    chunk_off: int = 0


@dataclass
class DirObject:
    attrs: Attrs
    entries: list[Union[Entry, BadEntry]]
    pages: list[bytes]


@dataclass
class FileObject:
    attrs: Attrs
    extents: list[Extent]
    pages: list[bytes]


@dataclass
class Head:
    fs_uuid: bytes
    seq: int
    time_ns: int
    root: bytes
    entries: int
    files: int
    incomplete_files: int
    volume: str = ""             # "" for a version 1 head (before volumes)
    gen: int = 0


# --------------------------------------------------------------- encoding

def _dumps(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("ascii")


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def encode_attrs(a: Attrs) -> dict:
    doc: dict[str, Any] = {"mode": a.mode, "uid": a.uid, "gid": a.gid, "atime": a.atime_ns,
                           "mtime": a.mtime_ns, "ctime": a.ctime_ns}
    kind = stat.S_IFMT(a.mode)
    if kind == stat.S_IFREG:
        doc["size"] = a.size
    if kind in (stat.S_IFCHR, stat.S_IFBLK):
        doc["rdev"] = a.rdev
    if kind == stat.S_IFLNK:
        doc["target"] = _text(a.target)
    if a.xattrs:
        doc["xattrs"] = [[k.hex(), v.hex()] for k, v in sorted(a.xattrs)]
    return doc


def encode_entry(e: Entry) -> dict:
    """One directory entry as its JSON value (the writer pages these)."""
    if e.kind == "d":
        return {"n": _text(e.name), "d": e.obj.hex()}
    if e.kind == "f":
        return {"n": _text(e.name), "i": e.ino, "f": e.obj.hex()}
    if e.kind == "x":
        return {"n": _text(e.name), "x": e.why[:MAX_WHY_CHARS]}
    return {"n": _text(e.name), "i": e.ino, "a": encode_attrs(e.attrs)}


def encode_extent(x: Extent) -> list:
    if x.chunk_id is None:
        return [x.file_off, x.length]
    return [x.file_off, x.length, x.chunk_id.hex(), x.chunk_off]


def extent_fragment(file_off: int, length: int, chunk_id: Optional[bytes], chunk_off: int
                    ) -> bytes:
    """`fragment(encode_extent(Extent(file_off, length, chunk_id, chunk_off)))`,
    the same bytes without the JSON encoder (a snapshot walk encodes every
    extent of every file it has not cached: 32k for a 2 GiB file)."""
    if chunk_id is None:
        return b"[%d,%d]" % (file_off, length)
    return b'[%d,%d,"%s",%d]' % (file_off, length, chunk_id.hex().encode("ascii"), chunk_off)


def fragment(value: Any) -> bytes:
    """A JSON value in the canonical form, to be joined into an object."""
    return _dumps(value) if isinstance(value, dict) else json.dumps(
        value, separators=(",", ":"), sort_keys=True).encode("ascii")


def _join(fields: dict[str, bytes]) -> bytes:
    """A JSON object from canonical fragments: the same bytes _dumps would give."""
    return b"{" + b",".join(json.dumps(k).encode() + b":" + fields[k]
                            for k in sorted(fields)) + b"}"


def _list(parts: list[bytes]) -> bytes:
    return b"[" + b",".join(parts) + b"]"


def _ids(ids: list[bytes]) -> bytes:
    return _list([b'"' + i.hex().encode() + b'"' for i in ids])


def _paged(kind: bytes, attrs: Attrs, key: str, items: list[bytes],
           pages: list[bytes]) -> bytes:
    """A directory's or a file's object: its attributes and either its
    items under key or, when it has pages, their ids."""
    f = {"v": b"1", "t": kind, "attrs": _dumps(encode_attrs(attrs))}
    if pages:
        f["pages"] = _ids(pages)
    else:
        f[key] = _list(items)
    return _join(f)


def encode_dir(attrs: Attrs, entries: list[bytes], pages: list[bytes]) -> bytes:
    """A directory: its attributes and either its entries (fragments of
    `encode_entry` values, sorted by name) or its pages' ids."""
    return _paged(b'"dir"', attrs, "entries", entries, pages)


def encode_dir_page(entries: list[bytes]) -> bytes:
    return _join({"v": b"1", "t": b'"dirpage"', "entries": _list(entries)})


def encode_file(attrs: Attrs, extents: list[bytes], pages: list[bytes]) -> bytes:
    """A regular file: its attributes and either its extents (fragments of
    `encode_extent` values, by offset) or its pages' ids."""
    return _paged(b'"file"', attrs, "extents", extents, pages)


def encode_extent_page(extents: list[bytes]) -> bytes:
    return _join({"v": b"1", "t": b'"extpage"', "extents": _list(extents)})


def encode_head(h: Head) -> bytes:
    doc = {"format": HEAD_FORMAT, "version": VERSION, "fs_uuid": h.fs_uuid.hex(),
           "seq": h.seq, "time_ns": h.time_ns, "root": h.root.hex(), "entries": h.entries,
           "files": h.files, "incomplete_files": h.incomplete_files}
    if h.volume:
        doc.update(version=HEAD_VERSION, volume=h.volume, gen=h.gen)
    doc["check"] = object_id(_dumps(doc)).hex()
    return _dumps(doc)


# ------------------------------------------------------------- validation

def _load(raw: bytes, limit: int, what: str) -> dict:
    if len(raw) > limit:
        raise BadObject(f"{what}: {len(raw)} bytes, more than the {limit} an object may have")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadObject(f"{what}: not JSON ({str(e)[:80]})") from None
    if not isinstance(doc, dict):
        raise BadObject(f"{what}: not a JSON object")
    return doc


def _int(doc: dict, key: str, lo: int, hi: int, what: str) -> int:
    if key not in doc:
        raise BadObject(f"{what}: no {key!r}")
    v = doc[key]
    if type(v) is not int:
        raise BadObject(f"{what}: {key!r} is not a whole number")
    if not lo <= v <= hi:
        raise BadObject(f"{what}: {key!r} {v} is out of range [{lo}, {hi}]")
    return v


def _hex_id(v: Any, what: str) -> bytes:
    if not isinstance(v, str) or len(v) != 2 * ID_BYTES or v != v.lower():
        raise BadObject(f"{what}: not an object id")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise BadObject(f"{what}: not an object id") from None


def _bytes_of(v: Any, what: str) -> bytes:
    if not isinstance(v, str):
        raise BadObject(f"{what}: not a string")
    try:
        return v.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise BadObject(f"{what}: not encodable bytes") from None


def check_name(name: bytes) -> Optional[str]:
    """Why `name` cannot be a directory entry's name, or None."""
    if name in (b"", b".", b".."):
        return "is not a possible name"
    if b"/" in name or b"\0" in name:
        return "contains '/' or NUL"
    if len(name) > NAME_MAX:
        return f"is longer than {NAME_MAX} bytes"
    return None


def _xattrs(v: Any, what: str) -> list[tuple[bytes, bytes]]:
    if not isinstance(v, list):
        raise BadObject(f"{what}: xattrs is not a list")
    out: list[tuple[bytes, bytes]] = []
    for item in v:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(s, str)
                                                                  for s in item)):
            raise BadObject(f"{what}: an xattr is not a [name, value] pair")
        try:
            k, val = bytes.fromhex(item[0]), bytes.fromhex(item[1])
        except ValueError:
            raise BadObject(f"{what}: an xattr is not hex") from None
        if not 0 < len(k) <= XATTR_NAME_MAX or b"\0" in k:
            raise BadObject(f"{what}: xattr name {k[:40]!r} is not a possible name")
        if len(val) > XATTR_VALUE_MAX:
            raise BadObject(f"{what}: xattr {k[:40]!r} has {len(val)} bytes")
        if out and k <= out[-1][0]:
            raise BadObject(f"{what}: xattr names are not sorted and unique")
        out.append((k, val))
    return out


def decode_attrs(doc: Any, kinds: tuple[int, ...], what: str) -> Attrs:
    if not isinstance(doc, dict):
        raise BadObject(f"{what}: attributes are not an object")
    mode = _int(doc, "mode", 0, _U32, what)
    if stat.S_IFMT(mode) not in kinds or mode & ~(stat.S_IFMT(mode) | 0o7777):
        raise BadObject(f"{what}: mode {mode:o} is not a possible mode here")
    a = Attrs(mode, _int(doc, "uid", 0, _U32, what), _int(doc, "gid", 0, _U32, what),
              _int(doc, "atime", *_I64, what), _int(doc, "mtime", *_I64, what),
              _int(doc, "ctime", *_I64, what))
    kind = stat.S_IFMT(mode)
    if kind == stat.S_IFREG:
        a.size = _int(doc, "size", 0, MAX_FILE_BYTES, what)
    if kind in (stat.S_IFCHR, stat.S_IFBLK):
        a.rdev = _int(doc, "rdev", 0, _U64, what)
    if kind == stat.S_IFLNK:
        a.target = _bytes_of(doc.get("target"), f"{what}: target")
        if not 0 < len(a.target) <= MAX_TARGET_BYTES or b"\0" in a.target:
            raise BadObject(f"{what}: symlink target of {len(a.target)} bytes")
        a.size = len(a.target)
    if "xattrs" in doc:
        a.xattrs = _xattrs(doc["xattrs"], what)
    return a


def _entry(v: Any, what: str) -> Union[Entry, BadEntry]:
    if not isinstance(v, dict) or not isinstance(v.get("n"), str):
        return BadEntry("?", f"{what}: an entry without a name")
    shown = v["n"].encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")[:300]
    try:
        name = _bytes_of(v["n"], what)
        bad = check_name(name)
        if bad:
            return BadEntry(shown, f"the name {bad}")
        kinds = [k for k in ("d", "f", "a", "x") if k in v]
        if len(kinds) != 1:
            return BadEntry(shown, "not exactly one of a directory, a file or inline "
                                   "attributes")
        if kinds[0] == "x":
            why = v["x"]
            if not isinstance(why, str):
                return BadEntry(shown, "an undescribed entry without a reason")
            return BadEntry(shown, "unreadable in the index when the snapshot was written "
                                   f"({why[:MAX_WHY_CHARS]})")
        if kinds[0] == "d":
            return Entry(name, "d", obj=_hex_id(v["d"], f"{what}: {shown}"))
        ino = _int(v, "i", 1, MAX_INO, f"{what}: {shown}")
        if kinds[0] == "f":
            return Entry(name, "f", ino=ino, obj=_hex_id(v["f"], f"{what}: {shown}"))
        return Entry(name, "n", ino=ino, attrs=decode_attrs(v["a"], _NODE_TYPES,
                                                            f"{what}: {shown}"))
    except BadObject as e:
        return BadEntry(shown, str(e))


def _pages(doc: dict, what: str) -> list[bytes]:
    pages = doc["pages"]
    if not isinstance(pages, list) or not 0 < len(pages) <= MAX_PAGES:
        raise BadObject(f"{what}: 'pages' is not a list of object ids")
    return [_hex_id(p, f"{what}: page") for p in pages]


def _doc(obj_id: bytes, raw: bytes, kind: str) -> dict:
    what = f"{kind} object {obj_id.hex()[:16]}"
    if object_id(raw) != obj_id:
        raise BadObject(f"{what}: bytes do not match the object id (damaged)")
    doc = _load(raw, MAX_OBJECT_BYTES, what)
    if doc.get("v") != VERSION or type(doc.get("v")) is not int:
        raise BadObject(f"{what}: version {doc.get('v')!r}, this ckptfs reads {VERSION}")
    if doc.get("t") != kind:
        raise BadObject(f"{what}: is a {str(doc.get('t'))[:20]!r} object")
    return doc


def _entry_list(doc: dict, what: str) -> list[Union[Entry, BadEntry]]:
    entries = doc.get("entries")
    if not isinstance(entries, list) or len(entries) > PAGE_ENTRIES:
        raise BadObject(f"{what}: 'entries' is not a list of at most {PAGE_ENTRIES}")
    return [_entry(e, what) for e in entries]


def _decode_paged(obj_id: bytes, raw: bytes, kind: str, mode: int, key: str,
                  items: Callable[[dict, str], list]) -> tuple[Attrs, list, list[bytes]]:
    """A directory's or a file's object (`_paged`): its attributes, and its
    items under key (read by items) or its pages' ids, one of the two."""
    doc = _doc(obj_id, raw, kind)
    what = f"{kind} object {obj_id.hex()[:16]}"
    attrs = decode_attrs(doc.get("attrs"), (mode,), what)
    if ("pages" in doc) == (key in doc):
        raise BadObject(f"{what}: needs either '{key}' or 'pages'")
    if "pages" in doc:
        return attrs, [], _pages(doc, what)
    return attrs, items(doc, what), []


def decode_dir(obj_id: bytes, raw: bytes) -> DirObject:
    return DirObject(*_decode_paged(obj_id, raw, "dir", stat.S_IFDIR, "entries", _entry_list))


def decode_dir_page(obj_id: bytes, raw: bytes) -> list[Union[Entry, BadEntry]]:
    doc = _doc(obj_id, raw, "dirpage")
    return _entry_list(doc, f"dirpage object {obj_id.hex()[:16]}")


def _extents(doc: dict, what: str, limit: int = PAGE_EXTENTS) -> list[Extent]:
    items = doc.get("extents")
    if not isinstance(items, list) or len(items) > limit:
        raise BadObject(f"{what}: 'extents' is not a list of at most {limit}")
    out = []
    for x in items:
        if not isinstance(x, list) or len(x) not in (2, 4):
            raise BadObject(f"{what}: an extent is not [offset, length(, id, chunk offset)]")
        if any(type(n) is not int for n in x[:2]) or (len(x) == 4 and type(x[3]) is not int):
            raise BadObject(f"{what}: an extent holds something other than numbers")
        off, length = x[0], x[1]
        if not (0 <= off < MAX_FILE_BYTES and 0 < length <= MAX_FILE_BYTES - off):
            raise BadObject(f"{what}: extent at {off} of {length} bytes is out of range")
        if len(x) == 2:
            out.append(Extent(off, length, None))
            continue
        if not 0 <= x[3] <= _U64:
            raise BadObject(f"{what}: extent at {off}: chunk offset {x[3]} is out of range")
        out.append(Extent(off, length, _hex_id(x[2], f"{what}: extent at {off}"), x[3]))
    return out


def decode_file(obj_id: bytes, raw: bytes) -> FileObject:
    return FileObject(*_decode_paged(obj_id, raw, "file", stat.S_IFREG, "extents", _extents))


def decode_extent_page(obj_id: bytes, raw: bytes) -> list[Extent]:
    doc = _doc(obj_id, raw, "extpage")
    return _extents(doc, f"extpage object {obj_id.hex()[:16]}")


class ExtentCheck:
    """Extents of one file, page after page: in order, not overlapping, inside
    the file. `add` raises BadObject on the first that is not."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.end = 0

    def add(self, x: Extent) -> None:
        if x.file_off < self.end:
            raise BadObject(f"extent at {x.file_off} overlaps the one before or is out of "
                            "order")
        if x.file_off + x.length > self.size:
            raise BadObject(f"extent at {x.file_off} of {x.length} bytes reaches past the "
                            f"file's size {self.size}")
        self.end = x.file_off + x.length


def _head_doc(name: str, raw: bytes, version: int) -> dict:
    what = f"head {name}"
    doc = _load(raw, MAX_HEAD_BYTES, what)
    check = doc.pop("check", None)
    if not isinstance(check, str) or object_id(_dumps(doc)).hex() != check:
        raise BadObject(f"{what}: its check does not match (damaged)")
    if doc.get("format") != HEAD_FORMAT:
        raise BadObject(f"{what}: not a ckptfs head")
    if doc.get("version") != version or type(doc.get("version")) is not int:
        raise BadObject(f"{what}: version {doc.get('version')!r}, expected {version} here")
    return doc


def _head(doc: dict, what: str, fs_uuid: bytes, seq: int, volume: str = "",
          gen: int = 0) -> Head:
    return Head(fs_uuid, seq, _int(doc, "time_ns", *_I64, what),
                _hex_id(doc.get("root"), f"{what}: root"),
                _int(doc, "entries", 0, _U64, what), _int(doc, "files", 0, _U64, what),
                _int(doc, "incomplete_files", 0, _U64, what), volume, gen)


def decode_head(name: str, fs_uuid: bytes, raw: bytes) -> Head:
    """A version 1 head (`heads/<fs uuid>/<seq>`, before volumes), checked."""
    what = f"head {name}"
    doc = _head_doc(name, raw, VERSION)
    if doc.get("fs_uuid") != fs_uuid.hex():
        raise BadObject(f"{what}: names filesystem {str(doc.get('fs_uuid'))[:40]}")
    seq = _int(doc, "seq", 0, _U64, what)
    if head_seq_from_name(name) != seq:
        raise BadObject(f"{what}: says it is head {seq}")
    return _head(doc, what, fs_uuid, seq)


def decode_volume_head(name: str, volume: str, key: tuple[int, int], raw: bytes) -> Head:
    """A head of a volume (named `heads/<gen>-<seq>` in its scope), checked:
    it must say it is that volume's head of that generation and number."""
    what = f"head {name} of volume {volume}"
    doc = _head_doc(name, raw, HEAD_VERSION)
    if doc.get("volume") != volume:
        raise BadObject(f"{what}: names volume {str(doc.get('volume'))[:80]!r}")
    gen, seq = _int(doc, "gen", 0, _U64, what), _int(doc, "seq", 0, _U64, what)
    if (gen, seq) != key:
        raise BadObject(f"{what}: says it is head {gen}-{seq}")
    try:
        fs_uuid = bytes.fromhex(doc.get("fs_uuid"))
    except (TypeError, ValueError):
        raise BadObject(f"{what}: 'fs_uuid' is not hex") from None
    return _head(doc, what, fs_uuid, seq, volume, gen)


# -------------------------------------------------- manifests (before heads)

MANIFEST_DIR = "manifests"


@dataclass
class Manifest:
    """A per-file manifest written by ckptfs before snapshots (format 1)."""

    ino: int
    paths: list[bytes]
    attrs: Attrs
    extents: list[Extent]


def manifests_prefix(fs_uuid: bytes) -> str:
    return f"{MANIFEST_DIR}/{fs_uuid.hex()}/"


def decode_manifest(name: str, raw: bytes) -> Manifest:
    """Validate a format-1 manifest as strictly as a file object."""
    what = f"manifest {name}"
    doc = _load(raw, MAX_OBJECT_BYTES, what)
    if doc.get("format") != 1 or type(doc.get("format")) is not int:
        raise BadObject(f"{what}: format {doc.get('format')!r}, expected 1")
    ino = _int(doc, "ino", 1, MAX_INO, what)
    attrs = decode_attrs({"atime": doc.get("atime_ns"), "mtime": doc.get("mtime_ns"),
                          "ctime": doc.get("ctime_ns"),
                          **{k: doc.get(k) for k in ("mode", "uid", "gid", "size")
                             if k in doc}}, (stat.S_IFREG,), what)
    xattrs = doc.get("xattrs", {})
    if not isinstance(xattrs, dict):
        raise BadObject(f"{what}: xattrs is not an object")
    attrs.xattrs = _xattrs([[k, v] for k, v in sorted(xattrs.items())], what)
    paths = doc.get("paths")
    if not isinstance(paths, list) or not paths or len(paths) > 65000:
        raise BadObject(f"{what}: no paths")
    out_paths = []
    for p in paths:
        path = _bytes_of(p, f"{what}: path")
        parts = path.split(b"/")
        for part in parts:
            bad = check_name(part)
            if bad:
                raise BadObject(f"{what}: path {p[:200]!r}: a component {bad}")
        out_paths.append(path)
    extents = _extents(doc, what, limit=MAX_OBJECT_BYTES)     # unpaged in format 1
    check = ExtentCheck(attrs.size)
    for x in extents:
        if x.chunk_id is None:
            raise BadObject(f"{what}: extent at {x.file_off} has no chunk id")
        check.add(x)
    return Manifest(ino, out_paths, attrs, extents)
