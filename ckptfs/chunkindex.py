"""Chunks shared between the volumes of one store (docs/STORE.md, "Dedup across volumes").

Volumes that share a store keep identical chunks once: the frozen layers of a
fine-tune saved on 8 nodes are in the store once, not 8 times. As in restic
and borg (many clients, one repository), a node learns the other nodes'
chunks from index objects in the store, and uses a chunk another volume
stored by naming that volume's pack instead of writing its own copy.

    chunkindex/<last 2 hex>/<16 hex>.idx    a pack's chunk index (one per pack,
                                            written by the volume that wrote the
                                            pack, before the first head naming it)
    refs/<16 hex pack>/<volume>             that volume names chunks of that pack
                                            (another volume's); made before the
                                            volume's index does, gone after
    condemned/<16 hex pack>                 the pack's owner let it go; deleted
                                            once no volume holds a ref

An index object is the pack's trailer entries, framed and checked:

    0   8s  magic b"CKPTIDX1"
    8   u64 pack number
    16  u32 entry count, u32 0
    24  entries of 64 bytes (packs.py's trailer entry: id, offset, stored
        length, length, codec, param, CRC-32C)
    ... 32s BLAKE3-256 of everything before it

The protocol that keeps gc safe while other nodes publish (no locks, no
clocks; the store's listings must show a blob once its write returned, as S3,
RGW and a directory do):

- taking a chunk of pack P (`adopt`): 1. make `refs/P/<me>`; 2. P must not
  be condemned; 3. P must still exist; only then may the index name it.
  A failed check deletes the ref it made (and the chunk is written again);
- letting go of an own pack P (`delete_own_pack`): 1. make `condemned/P`;
  2. list `refs/P/`: none: delete P, its index object, the mark; else keep it
  (`sweep` deletes it once the last ref is gone);
- letting go of another's pack (`release`): delete `refs/P/<me>`, after a
  published head no longer names its chunks (the same rule as own packs).

Why it holds: if the deleter's listing (2) missed a taker's ref, that ref was
made after the condemned mark existed, so the taker's check (2) sees the mark
and does not use P. A ref left by a crash between (1) and the index commit
keeps P alive until an operator removes the volume (docs/OPERATIONS.md).

Every function here may block (it talks to the store); none touches the index.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import threading
import time
from typing import Iterable, Optional

from . import packs
from .backing.base import Backend
from .chunker import chunk_id
from .errors import BlobMissing, CkptfsError, FormatError

log = logging.getLogger(__name__)

INDEX_PREFIX = "chunkindex/"
REFS_PREFIX = "refs/"
CONDEMNED_PREFIX = "condemned/"
MAGIC = b"CKPTIDX1"
SPACE_SHIFT = 32
_HEAD = struct.Struct("<8sQII")
_NAME = re.compile(r"^chunkindex/([0-9a-f]{2})/([0-9a-f]{16})\.idx$")
MAX_INDEX_BYTES = _HEAD.size + packs.MAX_PACK_ENTRIES * packs.ENTRY_BYTES + 32


class BadIndex(FormatError):
    """A chunk index object that is damaged or not what its name says."""


def index_name(pack_no: int) -> str:
    h = f"{pack_no:016x}"
    return f"{INDEX_PREFIX}{h[-2:]}/{h}.idx"


def index_pack_number(name: str) -> Optional[int]:
    m = _NAME.match(name)
    if not m or m.group(1) != m.group(2)[-2:]:
        return None
    return int(m.group(2), 16)


def refs_prefix(pack_no: int) -> str:
    return f"{REFS_PREFIX}{pack_no:016x}/"


def ref_name(pack_no: int, volume: str) -> str:
    return refs_prefix(pack_no) + volume


def condemned_name(pack_no: int) -> str:
    return f"{CONDEMNED_PREFIX}{pack_no:016x}"


def encode_index(pack_no: int, entries: Iterable[packs.PackEntry]) -> bytes:
    entries = list(entries)
    body = _HEAD.pack(MAGIC, pack_no, len(entries), 0) + b"".join(e.encode() for e in entries)
    return body + chunk_id(body)


def decode_index(name: str, raw: bytes) -> tuple[int, list[packs.PackEntry]]:
    """(pack number, entries), every field checked (BadIndex otherwise)."""
    if len(raw) < _HEAD.size + 32 or len(raw) > MAX_INDEX_BYTES:
        raise BadIndex(f"{name}: {len(raw)} bytes is not a chunk index")
    body, check = raw[:-32], raw[-32:]
    if chunk_id(body) != check:
        raise BadIndex(f"{name}: its check does not match (damaged)")
    magic, pack_no, count, zero = _HEAD.unpack_from(body)
    if magic != MAGIC or zero != 0:
        raise BadIndex(f"{name}: not a version 1 chunk index")
    if index_pack_number(name) != pack_no:
        raise BadIndex(f"{name}: says it is the index of pack {pack_no:016x}")
    if len(body) != _HEAD.size + count * packs.ENTRY_BYTES:
        raise BadIndex(f"{name}: {count} entries do not fill {len(body)} bytes")
    entries = []
    for i in range(count):
        cid, off, stored, length, codec, param, _, crc = struct.unpack_from(
            "<32sQQQBBHI", body, _HEAD.size + i * packs.ENTRY_BYTES)
        entries.append(packs.PackEntry(cid, off, stored, length, codec, param, crc))
    return pack_no, entries


def referenced_packs(backend: Backend, volume: str) -> list[int]:
    """Other volumes' packs a volume holds refs to (recover names them). May block."""
    out = []
    for name in backend.list(REFS_PREFIX):
        pack, _, who = name[len(REFS_PREFIX):].partition("/")
        if who == volume:
            try:
                out.append(int(pack, 16))
            except ValueError:
                continue
    return out


def _marker(volume: str) -> bytes:
    return json.dumps({"volume": volume, "time_ns": time.time_ns()},
                      separators=(",", ":")).encode() + b"\n"


class SharedChunks:
    """What one volume knows of the other volumes' chunks in its store, and
    the ref/condemn protocol (module docstring). Thread-safe."""

    def __init__(self, backend: Backend, volume: str, own_spaces: set[int],
                 refresh_s: float = 10.0) -> None:
        self.backend = backend
        self.volume = volume
        self.own_spaces = set(own_spaces)
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._where: dict[bytes, tuple[int, packs.PackEntry]] = {}
        self._by_pack: dict[int, list[bytes]] = {}
        self._seen: set[str] = set()
        self._refreshed_at = -1e9
        self._held: set[int] = set()          # packs whose ref this process made or found
        self.announced: Optional[set[int]] = None     # own packs with an index object
        # Entries of own packs written by this mount and not announced yet
        # (the mover's, so announcing needs no read back of the trailer).
        self._unannounced: dict[int, list[packs.PackEntry]] = {}
        self.no_adopt: set[int] = set()       # dead in this volume's index: not taken again
        # Entries learned by refreshes since `take_fresh` (Tierer.share_known_chunks).
        self._fresh: list[tuple[bytes, int, packs.PackEntry]] = []
        self.adopted_chunks = 0
        self.adopted_bytes = 0
        self.kept_condemned = 0

    def is_own(self, pack_no: int) -> bool:
        return pack_no >> SPACE_SHIFT in self.own_spaces

    # ------------------------------------------------------------ learning

    def refresh_blocking(self, force: bool = False, max_age_s: Optional[float] = None) -> None:
        """Read the index objects of other volumes' packs not read yet, forget
        those gone, unless the last look is younger than max_age_s (default
        refresh_s) and not forced. One listing of chunkindex/. May block."""
        age_s = self.refresh_s if max_age_s is None else max_age_s
        if not force and time.monotonic() - self._refreshed_at < age_s:
            return
        names = set(self.backend.list(INDEX_PREFIX))
        new = {}
        for name in sorted(names - self._seen):
            pack_no = index_pack_number(name)
            if pack_no is None or self.is_own(pack_no):
                continue
            try:
                size = self.backend.size(name)
                new[name] = decode_index(name, self.backend.read(
                    name, 0, min(size, MAX_INDEX_BYTES + 1)))
            except BlobMissing:
                continue
            except CkptfsError as e:
                log.warning("chunk index %s unusable (its chunks are not shared): %s", name, e)
                new[name] = None
        with self._lock:
            for name in self._seen - names:
                pack_no = index_pack_number(name)
                for cid in self._by_pack.pop(pack_no, ()):
                    if self._where.get(cid, (None,))[0] == pack_no:
                        del self._where[cid]
            for name, got in new.items():
                if got is None:
                    continue
                pack_no, entries = got
                self._by_pack[pack_no] = [e.chunk_id for e in entries]
                for e in entries:
                    got = self._where.get(e.chunk_id)
                    if got is None or pack_no < got[0]:       # the smallest number wins
                        self._where[e.chunk_id] = (pack_no, e)
                    self._fresh.append((e.chunk_id, pack_no, e))
            self._seen = (self._seen & names) | set(new)
            self._refreshed_at = time.monotonic()

    def take_fresh(self, everything: bool = False) -> list[tuple[bytes, int, packs.PackEntry]]:
        """Chunk locations learned since the last call (everything: all known)."""
        with self._lock:
            fresh, self._fresh = self._fresh, []
            if everything:
                fresh = [(cid, p, e) for cid, (p, e) in self._where.items()]
        return fresh

    def keep_fresh(self, entries: list[tuple[bytes, int, packs.PackEntry]]) -> None:
        """Look at these again next time (their chunk here is not in the store yet)."""
        with self._lock:
            self._fresh.extend(entries)

    def lookup(self, cid: bytes) -> Optional[tuple[int, packs.PackEntry]]:
        """Another volume's pack holding chunk cid, as its index object says."""
        with self._lock:
            got = self._where.get(cid)
        if got is None or got[0] in self.no_adopt:
            return None
        return got

    def known_chunks(self) -> int:
        return len(self._where)

    # --------------------------------------------------------- announcing

    def written(self, pack_no: int, entries: list[packs.PackEntry]) -> None:
        """An own pack was written with these entries (the mover): announced
        with the first head that names it."""
        with self._lock:
            self._unannounced[pack_no] = entries

    def announce_blocking(self, pack_nos: Iterable[int],
                          entries: Optional[dict[int, list[packs.PackEntry]]] = None) -> int:
        """Index objects for own packs that have none yet (from `entries`, or
        what `written` was told, or read back from the pack's trailer).
        Before a head names them. May block."""
        pack_nos = set(pack_nos)
        with self._lock:
            known = {n: self._unannounced.pop(n) for n in pack_nos & set(self._unannounced)}
        known.update(entries or {})
        entries = known
        if self.announced is None:
            self.announced = {n for n in map(index_pack_number, self.backend.list(INDEX_PREFIX))
                              if n is not None and self.is_own(n)}
        made = 0
        for pack_no in sorted(set(pack_nos) - self.announced):
            if not self.is_own(pack_no):
                continue
            got = (entries or {}).get(pack_no)
            if got is None:
                try:
                    got = packs.read_pack_index(self.backend, packs.pack_name(pack_no))
                except BlobMissing:
                    continue
            self.backend.create_once(index_name(pack_no), encode_index(pack_no, got))
            self.announced.add(pack_no)
            made += 1
        return made

    # ------------------------------------------------------------- taking

    def adopt_blocking(self, pack_no: int) -> bool:
        """May this volume name chunks of another volume's pack? Makes its ref
        first (module docstring). May block."""
        if pack_no in self.no_adopt:
            return False
        with self._lock:
            if pack_no in self._held:
                return True
        ref = ref_name(pack_no, self.volume)
        made = self.backend.create_once(ref, _marker(self.volume))
        try:
            self.backend.size(condemned_name(pack_no))
            usable = False                   # its owner let it go
        except BlobMissing:
            try:
                self.backend.size(packs.pack_name(pack_no))
                usable = True
            except BlobMissing:
                usable = False
        if not usable:
            if made:
                self.backend.delete(ref)
            return False
        with self._lock:
            self._held.add(pack_no)
        return True

    def release_blocking(self, pack_no: int) -> None:
        """This volume names no chunk of another's pack any more. May block."""
        with self._lock:
            self._held.discard(pack_no)
        try:
            self.backend.delete(ref_name(pack_no, self.volume))
        except BlobMissing:
            pass

    # ------------------------------------------------------------ letting go

    def delete_pack_blocking(self, pack_no: int) -> bool:
        """Let go of a pack this volume's index named: another's: drop the ref;
        an own one: condemn it and delete it unless another volume holds a
        ref (then `sweep` deletes it later). True if the blob is gone. May block."""
        if not self.is_own(pack_no):
            self.release_blocking(pack_no)
            return False
        self.backend.create_once(condemned_name(pack_no), _marker(self.volume))
        if self.backend.list(refs_prefix(pack_no)):
            self.kept_condemned += 1
            return False
        self._delete_condemned(pack_no)
        return True

    def _delete_condemned(self, pack_no: int) -> None:
        for name in (packs.pack_name(pack_no), index_name(pack_no), condemned_name(pack_no)):
            try:
                self.backend.delete(name)
            except BlobMissing:
                pass
        if self.announced is not None:
            self.announced.discard(pack_no)

    def condemned_packs(self) -> list[int]:
        """Packs whose owner let them go, still in the store. May block."""
        out = []
        for name in self.backend.list(CONDEMNED_PREFIX):
            try:
                out.append(int(name[len(CONDEMNED_PREFIX):], 16))
            except ValueError:
                continue
        return out

    def sweep_blocking(self) -> tuple[int, int]:
        """gc: condemned packs no volume holds a ref to any more are deleted.
        Returns (deleted, still held). Any node may run it, while others publish. May block."""
        deleted = held = 0
        for pack_no in self.condemned_packs():
            if self.backend.list(refs_prefix(pack_no)):
                held += 1
                continue
            self._delete_condemned(pack_no)
            deleted += 1
        return deleted, held

    def stats(self) -> dict[str, object]:
        return {"shared_chunks_known": self.known_chunks(),
                "shared_chunks_used": self.adopted_chunks,
                "shared_bytes_saved": self.adopted_bytes,
                "shared_packs_held": len(self._held)}
