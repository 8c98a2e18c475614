"""ScopedBackend: one part of a store, seen as a store of its own.

A volume's snapshots live below `volumes/<name>/` of the store
(docs/STORE.md). The snapshot writer and recover talk to that part as if it
were the whole store (`objects/...`, `heads/...`), so their names stay the
same whatever volume they describe. Every name given is the prefix plus the
name; `list` answers names without the prefix. The marker, credentials and
connections are the store's: closing a scoped view closes nothing, and
`remove_incomplete` is the whole store's business (gc), not a view's.
"""

from __future__ import annotations

from typing import Optional

from .base import Backend, BlobBatch, BlobWriter, validate_name, validate_prefix


class ScopedBackend(Backend):
    """The blobs of `inner` below `prefix` (which ends in "/")."""

    def __init__(self, inner: Backend, prefix: str) -> None:
        if not prefix.endswith("/"):
            raise ValueError(f"scope prefix {prefix!r} must end in '/'")
        validate_name(prefix[:-1])
        self.inner = inner
        self.prefix = prefix
        self.url = f"{inner.url}/{prefix[:-1]}"

    @property
    def store_uuid(self):                       # type: ignore[override]
        return self.inner.store_uuid

    @property
    def location(self) -> str:
        return self.inner.location

    def writer(self, name: str) -> BlobWriter:
        return self.inner.writer(self.prefix + validate_name(name))

    def batch(self) -> BlobBatch:
        return _ScopedBatch(self.inner.batch(), self.prefix)

    def create_once(self, name: str, data: bytes) -> bool:
        return self.inner.create_once(self.prefix + validate_name(name), data)

    def read(self, name: str, offset: int, length: int) -> bytes:
        return self.inner.read(self.prefix + validate_name(name), offset, length)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(self.prefix + validate_name(name), offset, out)

    def read_span_into(self, name: str, offset: int, length: int, out: memoryview) -> int:
        return self.inner.read_span_into(self.prefix + validate_name(name), offset, length, out)

    def will_read(self, name: str, offset: int, length: int) -> None:
        self.inner.will_read(self.prefix + validate_name(name), offset, length)

    def size(self, name: str) -> int:
        return self.inner.size(self.prefix + validate_name(name))

    def list(self, prefix: str = "") -> list[str]:
        n = len(self.prefix)
        return [name[n:] for name in self.inner.list(self.prefix + validate_prefix(prefix))]

    def delete(self, name: str) -> None:
        self.inner.delete(self.prefix + validate_name(name))

    def free_bytes(self) -> Optional[int]:
        return self.inner.free_bytes()

    def check(self) -> None:
        self.inner.check()


class _ScopedBatch(BlobBatch):
    """The store's own batch, with the scope's prefix on every name."""

    def __init__(self, inner: BlobBatch, prefix: str) -> None:
        self.inner = inner
        self.prefix = prefix
        self.put_threads = inner.put_threads

    def put(self, name: str, data: bytes) -> None:
        self.inner.put(self.prefix + validate_name(name), data)

    def sync(self) -> None:
        self.inner.sync()

    def abort(self) -> None:
        self.inner.abort()
