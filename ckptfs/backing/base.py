"""The backing-store interface: where cold chunks (in pack files) go.

A backend stores *blobs*: immutable byte strings under names. Every call
blocks (callers run them on worker threads) and every backend is safe to use
from several threads at once.

Names are relative, "/"-separated paths such as
"packs/ab/<64 hex>.pack" or "manifests/<id>.json" (`validate_name`): not
empty, no leading or trailing "/", no empty, "." or ".." component, no
component starting with "." (reserved for a backend's own temporary
objects), no NUL, at most `MAX_COMPONENT_BYTES` UTF-8 bytes per component,
and not `MARKER_NAME` nor below it (the store's marker, which every backend
keeps at its root). A name cannot also be a prefix ending in "/" of another
blob's name ("a" and "a/b" cannot both exist: directories in LocalBackend).

Visibility: a new blob is written through a `BlobWriter` and becomes visible
under its name, whole and durable, only when `commit()` returns; until then
(and after `abort()`, or a crash) no reader or `list()` sees it. Committing
a name that exists replaces that blob atomically; pack files are never
replaced (their names are unique), small metadata blobs may be.

Batches (`Backend.batch`: a snapshot's namespace objects): small blobs put
together and made durable together by one `BlobBatch.sync()`. A blob put in
a batch is, until `sync()` returns, either not visible or visible whole
(never torn under its name, even after a power loss); once `sync()`
returns, every blob of the batch is visible and durable. What is written
after `sync()` (a snapshot head) can name them. A directory store syncs
them all at once (each file, then one fsync per directory); where every
write is durable when it returns (S3), `sync()` has nothing left to do.

Create-once: `create_once` writes a small blob only if its name is free, as
one atomic step of the store (S3: a single PUT with If-None-Match: *; a
directory: link(2) of a complete temporary file, which fails on an existing
name). Of several writers racing for one name, on one node or many, exactly
one succeeds. Leases and snapshot heads of volumes rely on it
(docs/STORE.md); nothing else about a store is conditional.

Errors are the project's own (`ckptfs.errors`), each naming the store (its
`url`) and the blob:

    BackingUnavailable  the store cannot be reached, or is not the store it
                        should be (missing marker, other store uuid)
    BackingFull         no room                                  (ENOSPC)
    BackingReadOnly     writes refused                           (EROFS)
    BlobMissing         no blob of that name (the store is there) (ENOENT)
    BlobDamaged         a blob shorter than the range read, or failing a check
    InvalidArgument     a bad name
"""

from __future__ import annotations

import json
import uuid as uuidlib
from abc import ABC, abstractmethod
from typing import Optional, Union

from ..errors import BackingUnavailable, InvalidArgument

MARKER_NAME = "ckptfs-store"
MARKER_FORMAT = "ckptfs-store"
MARKER_VERSION = 1
MAX_COMPONENT_BYTES = 200

UuidLike = Union[uuidlib.UUID, str, bytes]


def as_uuid(value: Optional[UuidLike]) -> Optional[uuidlib.UUID]:
    """A store uuid given as UUID, its string form, or its 16 bytes."""
    if value is None or isinstance(value, uuidlib.UUID):
        return value
    if isinstance(value, (bytes, bytearray)):
        return uuidlib.UUID(bytes=bytes(value))
    return uuidlib.UUID(str(value))


def marker_body(store_uuid: uuidlib.UUID) -> bytes:
    """The store marker every backend keeps at its root: one line of JSON,
    {"format": "ckptfs-store", "version": 1, "uuid": "<store uuid>"}."""
    return json.dumps({"format": MARKER_FORMAT, "version": MARKER_VERSION,
                       "uuid": str(store_uuid)}).encode() + b"\n"


def parse_marker(raw: bytes, url: str) -> uuidlib.UUID:
    """The store uuid in a marker's bytes; BackingUnavailable if damaged."""
    try:
        doc = json.loads(raw)
        if doc.get("format") != MARKER_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}")
        if doc.get("version") != MARKER_VERSION:
            raise ValueError(f"version {doc.get('version')!r}")
        return uuidlib.UUID(doc["uuid"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BackingUnavailable(f"{url}: store marker {MARKER_NAME} is damaged "
                                 f"or of another version ({e})") from None


def validate_name(name: str) -> str:
    """Return `name` if it is a valid blob name, else raise InvalidArgument."""
    if not isinstance(name, str):
        raise InvalidArgument(f"blob name must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidArgument("empty blob name")
    if "\0" in name:
        raise InvalidArgument(f"blob name {name!r} contains NUL")
    if name.startswith("/"):
        raise InvalidArgument(f"blob name {name!r} is absolute")
    if name.partition("/")[0] == MARKER_NAME:
        raise InvalidArgument(f"blob name {name!r}: {MARKER_NAME!r} is the store marker")
    for part in name.split("/"):
        if part in ("", ".", ".."):
            raise InvalidArgument(f"blob name {name!r} has an empty, '.' or '..' component")
        if part.startswith("."):
            raise InvalidArgument(f"blob name {name!r}: components starting with '.' "
                                  "are reserved for temporary objects")
        try:
            encoded = part.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"blob name {name!r} is not valid UTF-8") from None
        if len(encoded) > MAX_COMPONENT_BYTES:
            raise InvalidArgument(f"blob name {name!r}: component longer than "
                                  f"{MAX_COMPONENT_BYTES} bytes")
    return name


def validate_prefix(prefix: str) -> str:
    """A `list()` prefix: "" or a name prefix whose complete components are valid."""
    if not isinstance(prefix, str):
        raise InvalidArgument(f"prefix must be a str, not {type(prefix).__name__}")
    if "\0" in prefix or prefix.startswith("/"):
        raise InvalidArgument(f"bad list prefix {prefix!r}")
    head, _, _tail = prefix.rpartition("/")
    if head:
        validate_name(head)
    return prefix


# `read_span_into`'s buffers: their address and spare bytes at each end.
SPAN_ALIGN = 4096


class BlobWriter(ABC):
    """One new blob, written front to back. Nothing is visible until `commit()`.

    A context manager: leaving the block without `commit()` aborts. After an
    error from `write()` or `commit()` the writer is aborted (nothing left
    behind, except what `commit()`'s docstring says).
    """

    name: str

    @abstractmethod
    def write(self, data) -> None:
        """Append `data` (any bytes-like object) to the blob. The caller may
        reuse `data` once this returns (a buffering writer copies it)."""

    @abstractmethod
    def commit(self) -> None:
        """Make the blob durable and visible under its name, atomically.

        If it raises, the blob was not made visible, with one exception: an
        error after the blob became visible (e.g. a failed directory fsync, a
        lost reply) can leave it visible but not known durable; callers treat
        a failed commit as "state unknown" and may delete or rewrite the name.
        """

    @abstractmethod
    def abort(self) -> None:
        """Drop the blob: nothing is left behind. Idempotent; no-op after commit."""

    @property
    @abstractmethod
    def committed(self) -> bool:
        """True once `commit()` returned."""

    def __enter__(self) -> "BlobWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.committed:
            self.abort()


class BlobBatch:
    """Small blobs written together, made durable together by `sync()` (see
    the module docstring). `put` may be called from several threads at once;
    `sync` and `abort` once, after the last `put` returned.

    This one is for stores where a committed blob is durable already (S3):
    each `put` is a write and commit through the backend's writer, `sync`
    has nothing left to do. A directory store overrides it (local.py).
    """

    # How many puts a caller should run at once: here each is a request to
    # the store, and their round trips overlap.
    put_threads: int = 8

    def __init__(self, backend: "Backend") -> None:
        self.backend = backend

    def put(self, name: str, data: bytes) -> None:
        """Blob `name` holds `data` (visible and durable by `sync()`). May block."""
        with self.backend.writer(name) as w:
            w.write(data)
            w.commit()

    def sync(self) -> None:
        """Every blob put is visible and durable once this returns. If it
        raises, some may be visible and not known durable (as a failed
        `BlobWriter.commit`): callers treat the batch's state as unknown.
        May block."""

    def abort(self) -> None:
        """Drop what was put and not synced yet, where the store can (blobs
        already visible stay). Idempotent."""


class Backend(ABC):
    """A store of immutable blobs; see the module docstring for the rules."""

    url: str                                   # for messages, e.g. "file:///mnt/cold"
    store_uuid: Optional[uuidlib.UUID] = None  # the store this must be (None: any)

    @property
    def location(self) -> str:
        """The store as backing= names it (a url, or a directory path)."""
        return self.url

    @abstractmethod
    def writer(self, name: str) -> BlobWriter:
        """Start a new blob `name`; nothing is visible until its `commit()`."""

    def batch(self) -> BlobBatch:
        """A batch of small blobs to be made durable together (BlobBatch)."""
        return BlobBatch(self)

    @abstractmethod
    def create_once(self, name: str, data: bytes) -> bool:
        """Make blob `name` hold `data` unless a blob of that name exists:
        True if this call made it (durable once this returns), False if it
        existed (left as it was). Atomic against every other writer of the
        store, whichever node it runs on; for small blobs (one request).

        `data` should be unique to this caller (a lease names its holder and
        a time): a retry after a lost reply finds the blob already there,
        and holding exactly `data` is how it is told that it made it itself.
        """

    @abstractmethod
    def read(self, name: str, offset: int, length: int) -> bytes:
        """Exactly `length` bytes of blob `name` from `offset`.

        A range past the blob's end raises BlobDamaged (the caller asked for
        bytes the blob should have); a missing blob raises BlobMissing.
        """

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """`read` of len(out) bytes into out (a writable byte buffer), with the
        same errors. Backends that can fill it without a copy do."""
        out[:] = self.read(name, offset, len(out))

    def read_span_into(self, name: str, offset: int, length: int, out: memoryview) -> int:
        """Read `length` bytes of blob `name` from `offset` into out, and say
        where in out they start. out holds at least length + 2 * SPAN_ALIGN
        bytes and starts at a SPAN_ALIGN-aligned address, so that a backend
        may read the range rounded out to whole blocks straight into it (a
        local store: O_DIRECT, no copy out of the page cache); the bytes
        around the range are then whatever the blob holds there. The same
        errors as `read`. Here: `read_into` at 0."""
        self.read_into(name, offset, out[:length])
        return 0

    def will_read(self, name: str, offset: int, length: int) -> None:
        """A hint: [offset, offset+length) of blob name will be read soon.
        Backends that can start reading it now do (a local store: the
        kernel's read-ahead); a wrong range or a missing blob is no error
        here (the read says what is wrong). May block briefly."""

    @abstractmethod
    def size(self, name: str) -> int:
        """The blob's length in bytes (BlobMissing if there is none)."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Names of committed blobs starting with `prefix`, sorted.

        Never lists uncommitted blobs or the marker. Raises BackingUnavailable
        rather than answer [] for a store that is not there.
        """

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove blob `name`, durably. A missing blob is fine."""

    @abstractmethod
    def free_bytes(self) -> Optional[int]:
        """Bytes that can still be written, or None if the store cannot say."""

    @abstractmethod
    def check(self) -> None:
        """Raise if the store is unusable: BackingUnavailable (not there, not
        this store), BackingReadOnly (cannot be written: reads still work)."""

    def remove_incomplete(self, older_than: float = 3600.0) -> int:
        """Remove the leftovers of blobs never committed (a crash mid-write)
        that are older than `older_than` seconds; return how many. Backends
        without such leftovers return 0."""
        return 0

    def remove_incomplete_of(self, name: str) -> int:
        """Remove the leftovers of uncommitted writes of blob `name`, whatever
        their age (the caller knows its writer is gone: a crash); return how
        many. Leftovers of other names are left alone (other writers, other
        filesystems sharing the store). Backends without such leftovers
        return 0."""
        return 0

    def close(self) -> None:
        """Release cached resources (open files, connections). Idempotent."""

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
