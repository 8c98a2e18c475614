"""FaultyBackend: a Backend wrapper that fails on demand, for fault tests.

    fb = FaultyBackend(LocalBackend.create(tmp))
    fb.inject("unavailable", ops={"read"}, prefix="packs/", times=2)
    fb.inject("damage", after=3)              # 4th read onwards returns a flipped byte
    with fb.injected("full"):                 # only inside the block
        ...
    fb.clear()

Kinds (and the calls they hit when `ops` is not given):

    unavailable  BackingUnavailable   every call
    full         BackingFull          writer, write, commit; free_bytes answers 0
    readonly     BackingReadOnly      writer, write, commit, delete, check
    missing      BlobMissing          read, size
    damage       read returns its bytes with one byte flipped (at `position`,
                 default the middle; negative counts from the end)
    delay        sleeps `delay` seconds, then the call proceeds normally
    lost_commit  commit: the blob is committed, then BackingUnavailable is
                 raised (a reply lost after the store acted)

Call names for `ops`: writer, write, commit, abort, read, size, list, delete,
free_bytes, check (`create_once` counts as writer, then commit). A fault fires on matching calls whose blob name starts
with `prefix` (calls without a name match only prefix ""), skips the first
`after` of them, then fires `times` times (None: until cleared). Several
faults may be active; delays apply first, then the first failing fault.
A writer whose write or commit fails is aborted, as real backends do.
`calls` counts every call by name; `Fault.fired` counts firings.
Thread-safe.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

from ..errors import BackingFull, BackingReadOnly, BackingUnavailable, BlobMissing
from .base import Backend, BlobWriter

ALL_OPS = frozenset({"writer", "write", "commit", "abort", "read", "size", "list", "delete",
                     "free_bytes", "check"})
DEFAULT_OPS = {
    "unavailable": ALL_OPS - {"abort"},
    "full": frozenset({"writer", "write", "commit", "free_bytes"}),
    "readonly": frozenset({"writer", "write", "commit", "delete", "check"}),
    "missing": frozenset({"read", "size"}),
    "damage": frozenset({"read"}),
    "delay": ALL_OPS,
    "lost_commit": frozenset({"commit"}),
}


@dataclass(eq=False)
class Fault:
    kind: str
    ops: frozenset
    prefix: str = ""
    times: Optional[int] = None
    after: int = 0
    delay: float = 0.0
    position: Optional[int] = None
    seen: int = 0
    fired: int = 0
    active: bool = field(default=True)

    def _matches(self, op: str, name: Optional[str]) -> bool:
        if not self.active or op not in self.ops:
            return False
        if self.prefix and (name is None or not name.startswith(self.prefix)):
            return False
        self.seen += 1
        if self.seen <= self.after:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True


class FaultyBackend(Backend):
    """Wraps `inner`; passes every call through unless an injected fault fires."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url = f"faulty+{inner.url}"
        self.calls: Counter = Counter()
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    @property
    def store_uuid(self):                       # type: ignore[override]
        return self.inner.store_uuid

    # -- controlling faults ----------------------------------------------------------

    def inject(self, kind: str, *, ops: Optional[Iterable[str]] = None, prefix: str = "",
               times: Optional[int] = None, after: int = 0, delay: float = 0.0,
               position: Optional[int] = None) -> Fault:
        if kind not in DEFAULT_OPS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {sorted(DEFAULT_OPS)}")
        chosen = DEFAULT_OPS[kind] if ops is None else frozenset(ops)
        unknown = chosen - ALL_OPS
        if unknown:
            raise ValueError(f"unknown calls {sorted(unknown)}; one of {sorted(ALL_OPS)}")
        if kind == "delay" and delay <= 0:
            raise ValueError("a delay fault needs delay > 0")
        fault = Fault(kind, chosen, prefix, times, after, delay, position)
        with self._lock:
            self._faults.append(fault)
        return fault

    @contextlib.contextmanager
    def injected(self, kind: str, **kw) -> Iterator[Fault]:
        fault = self.inject(kind, **kw)
        try:
            yield fault
        finally:
            self.clear(fault)

    def clear(self, fault: Optional[Fault] = None) -> None:
        """Remove one fault, or all of them."""
        with self._lock:
            if fault is None:
                for f in self._faults:
                    f.active = False
                self._faults.clear()
            elif fault in self._faults:
                fault.active = False
                self._faults.remove(fault)

    def _fire(self, op: str, name: Optional[str]) -> list[Fault]:
        """Count the call, sleep for delay faults, raise the first failing fault;
        return the faults that alter results (damage, full on free_bytes, lost_commit)."""
        with self._lock:
            self.calls[op] += 1
            hits = [f for f in self._faults if f._matches(op, name)]
        for f in hits:
            if f.kind == "delay":
                time.sleep(f.delay)
        where = f"{self.url}: {name}" if name else self.url
        altering = []
        for f in hits:
            if f.kind == "unavailable":
                raise BackingUnavailable(f"{where}: {op}: injected fault: store unavailable")
            if f.kind == "full" and op != "free_bytes":
                raise BackingFull(f"{where}: {op}: injected fault: no space left")
            if f.kind == "readonly":
                raise BackingReadOnly(f"{where}: {op}: injected fault: read-only")
            if f.kind == "missing":
                raise BlobMissing(f"{where}: injected fault: no such blob")
            if f.kind in ("damage", "full", "lost_commit"):
                altering.append(f)
        return altering

    # -- Backend ---------------------------------------------------------------------

    def writer(self, name: str) -> BlobWriter:
        self._fire("writer", name)
        return _FaultyWriter(self, name, self.inner.writer(name))

    def create_once(self, name: str, data: bytes) -> bool:
        self._fire("writer", name)
        altering = self._fire("commit", name)
        made = self.inner.create_once(name, data)
        if any(f.kind == "lost_commit" for f in altering):
            raise BackingUnavailable(f"{self.url}: {name}: commit: injected fault: the reply "
                                     "was lost (the blob was made)")
        return made

    def read(self, name: str, offset: int, length: int) -> bytes:
        altering = self._fire("read", name)
        data = self.inner.read(name, offset, length)
        for f in altering:
            if f.kind == "damage" and data:
                pos = len(data) // 2 if f.position is None else f.position % len(data)
                buf = bytearray(data)
                buf[pos] ^= 0xFF
                data = bytes(buf)
        return data

    def size(self, name: str) -> int:
        self._fire("size", name)
        return self.inner.size(name)

    def list(self, prefix: str = "") -> list[str]:
        self._fire("list", None)
        return self.inner.list(prefix)

    def delete(self, name: str) -> None:
        self._fire("delete", name)
        self.inner.delete(name)

    def free_bytes(self) -> Optional[int]:
        if any(f.kind == "full" for f in self._fire("free_bytes", None)):
            return 0
        return self.inner.free_bytes()

    def check(self) -> None:
        self._fire("check", None)
        self.inner.check()

    def remove_incomplete(self, older_than: float = 3600.0) -> int:
        return self.inner.remove_incomplete(older_than)

    def remove_incomplete_of(self, name: str) -> int:
        return self.inner.remove_incomplete_of(name)

    def close(self) -> None:
        self.inner.close()


class _FaultyWriter(BlobWriter):
    def __init__(self, backend: FaultyBackend, name: str, inner: BlobWriter) -> None:
        self.name = name
        self._backend = backend
        self._inner = inner

    @property
    def committed(self) -> bool:
        return self._inner.committed

    def write(self, data) -> None:
        try:
            self._backend._fire("write", self.name)
        except Exception:
            self._inner.abort()
            raise
        self._inner.write(data)

    def commit(self) -> None:
        try:
            altering = self._backend._fire("commit", self.name)
        except Exception:
            self._inner.abort()
            raise
        self._inner.commit()
        if any(f.kind == "lost_commit" for f in altering):
            raise BackingUnavailable(f"{self._backend.url}: {self.name}: commit: injected "
                                     "fault: reply lost (the blob was committed)")

    def abort(self) -> None:
        try:
            self._backend._fire("abort", self.name)
        finally:
            self._inner.abort()
