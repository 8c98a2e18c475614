"""A PmemLog that can lose power: for the simulated power-loss tests.

`FaultLog` remembers, for every store, the bytes it overwrote, and which of its
bytes a persist barrier has since covered. Every store, persist and index
commit is one step; when step `cut_at` comes (or `cut()` is called) the power
is off: that step and every later one raises `PowerCut` instead of happening.

After the process state is dropped (no shutdown), `lose_unpersisted` decides
the fate of each store that no persist covered, newest first: dropped (the old
bytes come back), kept, or torn (a random subset of its 8-byte words reverts).
Words that a persist covered, or that a newer kept store wrote, are final.

The model is the one the design relies on: the log loses unpersisted stores,
LMDB's committed transactions and the index journal's appended records are
durable (both fsync before they return). `hook_index` makes each of those a
step: a cut lands before a journal append, before a checkpoint, or between
them (journaled batches not yet in LMDB, replayed at the next opening).
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ckptfs.index import Index
from ckptfs.pmemlog import PmemLog

WORD = 8


class PowerCut(Exception):
    """The power went off: nothing from here on reaches the log or the index."""


@dataclass
class Store:
    off: int
    old: bytes                      # what the store overwrote, in whole words
    persisted: list[tuple[int, int]] = field(default_factory=list)  # absolute [a, b)

    @property
    def end(self) -> int:
        return self.off + len(self.old)


class FaultLog(PmemLog):
    threaded_writes = False     # every store passes `write`, to be recorded

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.stores: list[Store] = []
        self.steps = 0
        self.cut_at: Optional[int] = None
        self.is_cut = False
        self._lock = threading.Lock()
        self.persist_calls = 0
        # First fit instead of next fit: freed space is handed out again as soon
        # as the allocator has it, so reuse-before-durable bugs show at once.
        self.first_fit = False

    # ------------------------------------------------------------ stepping

    def step(self) -> None:
        """One store, persist or commit is about to happen; raise if the power is off."""
        with self._lock:
            if not self.is_cut:
                self.steps += 1
                if self.cut_at is not None and self.steps >= self.cut_at:
                    self.is_cut = True
            if self.is_cut:
                raise PowerCut(f"power cut at step {self.steps}")

    def cut(self) -> None:
        with self._lock:
            self.is_cut = True

    def hook_index(self, index: Index) -> None:
        """Make every index commit a step too (cut before it: it never happened),
        on the worker thread (`_write_batch`) or, for a small batch, the
        trio thread and the journal's C thread (`_append_small`): one step
        per attempt either way."""
        write_batch = index._write_batch
        append_small = index._append_small
        stepped: set[int] = set()       # batches whose attempt stepped in append_small

        def guarded(batch, persist):
            if batch.seq in stepped:
                stepped.discard(batch.seq)  # not small after all: the same attempt
            else:
                self.step()
            write_batch(batch, persist)

        async def guarded_small(batch):
            self.step()
            stepped.add(batch.seq)
            done = await append_small(batch)
            if done:
                stepped.discard(batch.seq)
            return done

        index._write_batch = guarded
        index._append_small = guarded_small

    # --------------------------------------------------------- the log calls

    def allocate(self, nbytes: int) -> list[tuple[int, int]]:
        if self.first_fit:
            self._cursor = 0
        return super().allocate(nbytes)

    def reserve(self, nbytes: int, at: Optional[int] = None) -> Optional[int]:
        if self.first_fit and at is None:
            self._cursor = 0
        return super().reserve(nbytes, at)

    def write(self, off: int, data: memoryview) -> None:
        self.step()
        # Whole words: stores are byte-exact, so a word may hold two records' bytes.
        a = off // WORD * WORD
        b = -(-(off + len(data)) // WORD) * WORD
        old = os.pread(self.fd, b - a, a)
        with self._lock:
            self.stores.append(Store(a, old))
        super().write(off, data)

    def persist(self, ranges: list[tuple[int, int]]) -> None:
        self.step()
        with self._lock:
            self.persist_calls += 1
            for a, length in ranges:
                b = a + length
                for st in self.stores:
                    lo, hi = max(a, st.off), min(b, st.end)
                    if lo < hi:
                        st.persisted.append((lo, hi))
        super().persist(ranges)

    # ------------------------------------------------------------- the cut

    def lose_unpersisted(self, rng: random.Random,
                         choices: tuple[str, ...] = ("dropped", "kept", "torn")
                         ) -> dict[str, int]:
        """Apply the power loss to the (closed) log file, each store not
        persisted meeting one of choices. Returns what it did, by fate."""
        fates = {"persisted": 0, "dropped": 0, "kept": 0, "torn": 0}
        final = np.zeros(self.size_bytes // WORD, dtype=bool)
        nprng = np.random.default_rng(rng.randrange(1 << 63))
        fd = os.open(self.path, os.O_RDWR)
        try:
            for st in reversed(self.stores):
                w0, w1 = st.off // WORD, st.end // WORD
                covered = np.zeros(w1 - w0, dtype=bool)
                for a, b in st.persisted:
                    # A persist reaches whole cache lines, so a word it touches is safe.
                    covered[(a - st.off) // WORD:-(-(b - st.off) // WORD)] = True
                if covered.all():
                    fates["persisted"] += 1
                    final[w0:w1] = True
                    continue
                open_words = ~final[w0:w1] & ~covered
                fate = rng.choice(choices)
                fates[fate] += 1
                if fate == "kept":
                    revert = np.zeros_like(open_words)
                elif fate == "dropped":
                    revert = open_words
                else:
                    revert = open_words & (nprng.random(w1 - w0) < rng.choice((0.1, 0.5, 0.9)))
                keep = open_words & ~revert
                final[w0:w1] |= covered | keep
                if revert.any():
                    self._revert(fd, st, revert)
            os.fsync(fd)
        finally:
            os.close(fd)
        return fates

    @staticmethod
    def _revert(fd: int, st: Store, revert: np.ndarray) -> None:
        """Write st.old back over the words marked in revert (runs of them at once)."""
        cur = bytearray(os.pread(fd, len(st.old), st.off))
        mask = np.repeat(revert, WORD)
        buf = np.frombuffer(cur, dtype=np.uint8)
        old = np.frombuffer(st.old, dtype=np.uint8)
        buf[mask] = old[mask]
        os.pwrite(fd, bytes(cur), st.off)
