"""What a crash may leave of each path, from a writer's journal (crash and power-loss tests).

A writer (a process in test_crash_kill, a trio task in test_power_loss) owns its
paths and does one thing at a time. Around each step it records, in order:

    begin PATH SHA        about to give PATH the content SHA (O_TRUNC or in place)
    committed PATH SHA    close (sync=close) or fsync returned: PATH holds SHA durably
    closed PATH SHA       sync=lazy close without fsync: durable later
    rename TMP DST SHA    about to rename TMP (holding SHA) over DST
    unlink PATH           about to unlink PATH
    set PATH SHA          about to change PATH's content without a commit (truncate of
                          a closed file): durable at the latest with the next commit
    dirsync               fsync of a directory returned: everything above is durable

Batches become durable in order, so a "committed" also makes every earlier step
of the same writer durable. Only the same writer's records are used for that:
two writers' records are not ordered with respect to each other's operations.
States are sha256 hex digests, or ABSENT.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

ABSENT = "absent"
EMPTY = hashlib.sha256(b"").hexdigest()


class Model:
    """What each path of one writer may hold after a crash, from its journal."""

    def __init__(self, baseline: dict[str, str]) -> None:
        self.base: dict[str, set[str]] = {p: {s} for p, s in baseline.items()}
        self.inflight: dict[str, set[str]] = {}
        self.pending: dict[str, str] = {}   # state once the op's batch is durable
        self.final: dict[str, str] = dict(baseline)   # last state, if everything is durable

    def _base(self, p: str) -> set[str]:
        return self.base.setdefault(p, {ABSENT})

    def _fold(self, p: str) -> None:
        """An op on p returned: what was in flight is now one of its possible states."""
        self._base(p).update(self.inflight.pop(p, ()))

    def _settle(self) -> None:
        """A durable commit returned: every earlier op of this writer is durable."""
        for p, state in self.pending.items():
            self.base[p] = {state}
        self.pending.clear()

    def apply(self, line: str) -> None:
        op, *args = line.split()
        if op == "begin":
            p, sha = args
            s = self.inflight.setdefault(p, set())
            s.add(sha)
            if ABSENT in self._base(p) or ABSENT in s:
                s.add(EMPTY)   # created (namespace durable), content not committed
        elif op == "committed":
            p, sha = args
            self.base[p] = {sha}
            self.inflight.pop(p, None)
            self.pending.pop(p, None)
            self._settle()
            self.final[p] = sha
        elif op == "closed":     # sync=lazy close without fsync: durable later
            p, sha = args
            self._fold(p)
            self.pending[p] = sha
            self.final[p] = sha
        elif op == "rename":
            tmp, dst, sha = args
            for p, state in ((tmp, ABSENT), (dst, sha)):
                self._fold(p)
                self._base(p).add(state)
                self.pending[p] = state
                self.final[p] = state
        elif op in ("unlink", "set"):
            p, state = (args[0], ABSENT) if op == "unlink" else args
            self._fold(p)
            self._base(p).add(state)
            self.pending[p] = state
            self.final[p] = state
        elif op == "dirsync":
            self._settle()
        else:
            raise AssertionError(f"unknown journal record {line!r}")

    def allowed(self, p: str) -> set[str]:
        return self._base(p) | self.inflight.get(p, set())

    def paths(self) -> set[str]:
        return set(self.base) | set(self.inflight)


def writer_model(baseline: dict[str, str], subdir: str, lines: Iterable[str]) -> Model:
    """The model of the writer owning subdir: its paths as baseline has them,
    then its journal lines in order."""
    model = Model({p: s for p, s in baseline.items() if p.startswith(subdir + "/")})
    for line in lines:
        model.apply(line)
    return model


def short(state: str) -> str:
    if state == ABSENT:
        return state
    if state == EMPTY:
        return "empty"
    return state[:12]


def check(models: dict[str, Model], observed: dict[str, str], what: str) -> None:
    problems = []
    owned = set()
    for subdir, model in models.items():
        for p in sorted(model.paths()):
            owned.add(p)
            got = observed.get(p, ABSENT)
            allowed = model.allowed(p)
            if got not in allowed:
                problems.append(f"{p}: holds {short(got)}, journal allows "
                                f"{sorted(short(s) for s in allowed)}")
    for p, got in sorted(observed.items()):
        if p not in owned:
            problems.append(f"{p}: {short(got)}, but no journal explains it")
    assert not problems, f"{what}:\n" + "\n".join(problems)
