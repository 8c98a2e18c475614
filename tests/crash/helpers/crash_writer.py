"""A checkpoint writer for the crash tests: writes until it is killed, keeps a journal.

    python crash_writer.py TOP SUBDIR JOURNAL SEED [--lazy] [--max-bytes N] [--steps N]
                           [--keep-going]

Writes into TOP/SUBDIR (a directory it creates, on the mount) checkpoint-like files of
4 KiB..32 MiB of seeded random bytes, the way training jobs do: new files,
rewrites with O_TRUNC, temp file + os.replace (with and without an fsync of the
directory), a commit in the middle of a file (fsync), and the odd unlink.

JOURNAL lives outside the mount. Each line is written with one O_APPEND write,
so a SIGKILL loses at most the line being written, never half of it:

    begin PATH SHA          about to open PATH to give it content SHA
    committed PATH SHA      close (sync=close) or fsync returned: PATH holds SHA durably
    closed PATH SHA         --lazy only: close returned without an fsync (durable
                            within lazy_delay, or at a clean unmount)
    rename TMP DST SHA      about to os.replace(TMP, DST); TMP is committed with SHA
    unlink PATH             about to os.unlink(PATH)
    dirsync                 fsync of SUBDIR returned: every namespace change above is durable

With --lazy (for -o sync=lazy, where close alone is not durable) the writer
calls os.fsync before most closes and journals "committed" only then; the other
closes are journaled as "closed". Paths are
relative to the mount's top. The writer stops at the first error (the daemon
died under it); the test kills it anyway. With --keep-going a step that fails
with ENOSPC is left as it is in the journal (its "begin" without a "committed":
old or new content, whole) and the writer goes on; any other error ends it
with exit code 3 and the error on stderr.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import os
import random
import sys
import time

KiB, MiB = 1 << 10, 1 << 20


class Journal:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, *fields: str) -> None:
        os.write(self.fd, (" ".join(fields) + "\n").encode())


# The same in every writer: bytes that recur across files and writers, like
# frozen weights across checkpoint versions, so crashes hit shared chunks.
SHARED = random.Random(4242).randbytes(6 * MiB)


def dedupable(rng: random.Random, n: int) -> bytes:
    """n bytes of which about half are SHARED bytes (sometimes shifted), half new."""
    start = 0 if rng.random() < 0.5 else rng.randrange(len(SHARED))
    take = min(n, len(SHARED) - start, rng.randint(n // 4, n))
    return SHARED[start:start + take] + rng.randbytes(n - take)


def pick_size(rng: random.Random, max_bytes: int) -> int:
    r = rng.random()
    if r < 0.65:
        lo, hi = 4 * KiB, 256 * KiB
    elif r < 0.93:
        lo, hi = 256 * KiB, 4 * MiB
    else:
        lo, hi = 4 * MiB, 32 * MiB
    hi = min(hi, max_bytes)
    lo = min(lo, hi)
    # Odd sizes too: the tail of a file rarely ends on a page.
    return rng.randint(lo, hi) if rng.random() < 0.5 else rng.randint(lo // 4096, hi // 4096) * 4096


def write_all(fd: int, data: memoryview, rng: random.Random) -> None:
    # Half of the files are written at a training job's pace (serializing the
    # next tensor between writes): they stay open a while, so a crash often
    # finds several files half written.
    paced = rng.random() < 0.5
    pos = 0
    while pos < len(data):
        want = min(len(data) - pos, rng.choice((4 * KiB, 64 * KiB, 1 * MiB, 3 * MiB + 17)))
        pos += os.write(fd, data[pos:pos + want])
        if paced and rng.random() < 0.5:
            time.sleep(rng.uniform(0.002, 0.03))


class Writer:
    def __init__(self, top: str, subdir: str, journal: Journal, rng: random.Random,
                 lazy: bool, max_bytes: int) -> None:
        self.top = top
        self.subdir = subdir
        self.j = journal
        self.rng = rng
        self.lazy = lazy
        self.max_bytes = max_bytes
        self.tmp_seq = 0

    def path(self, rel: str) -> str:
        return os.path.join(self.top, rel)

    def content(self) -> tuple[bytes, str]:
        n = pick_size(self.rng, self.max_bytes)
        data = dedupable(self.rng, n) if self.rng.random() < 0.5 else self.rng.randbytes(n)
        return data, hashlib.sha256(data).hexdigest()

    def write_file(self, rel: str, data: bytes, sha: str, mid_commit: bool = False) -> None:
        """open(O_CREAT|O_TRUNC), write, [fsync], close; journal around it."""
        view = memoryview(data)
        half = self.rng.randint(1, len(data) - 1) if mid_commit and len(data) > 8 * KiB else 0
        # A file fsync'ed half way: that half is committed, then the rest follows.
        # The fsync may be durable before it returns, so the first begin names the half.
        half_sha = hashlib.sha256(view[:half]).hexdigest()
        self.j("begin", rel, half_sha if half else sha)
        fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            if half:
                write_all(fd, view[:half], self.rng)
                os.fsync(fd)
                self.j("committed", rel, half_sha)
                self.j("begin", rel, sha)
                write_all(fd, view[half:], self.rng)
            else:
                write_all(fd, view, self.rng)
            synced = not self.lazy or self.rng.random() < 0.7
            if self.lazy and synced:
                os.fsync(fd)
        finally:
            os.close(fd)   # sync=close: returns once the commit is durable
        self.j("committed" if synced else "closed", rel, sha)

    def dirsync(self) -> None:
        fd = os.open(self.path(self.subdir), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.j("dirsync")

    def step(self) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.45:
            # New file or rewrite in place (O_TRUNC) of one of a few names.
            rel = f"{self.subdir}/f{rng.randrange(4)}.bin"
            data, sha = self.content()
            self.write_file(rel, data, sha, mid_commit=rng.random() < 0.15)
        elif r < 0.85:
            # torch.save-style: temp name, then os.replace over the checkpoint.
            self.tmp_seq += 1
            tmp = f"{self.subdir}/.tmp{self.tmp_seq}"
            dst = f"{self.subdir}/c{rng.randrange(3)}.pt"
            data, sha = self.content()
            self.write_file(tmp, data, sha)
            self.j("rename", tmp, dst, sha)
            os.replace(self.path(tmp), self.path(dst))
            if rng.random() < 0.5:
                self.dirsync()
        elif r < 0.93:
            # Small metadata file, rewritten often.
            rel = f"{self.subdir}/meta.json"
            data = f'{{"step": {rng.randrange(10**6)}, "pad": "{"x" * rng.randrange(200)}"}}'.encode()
            self.write_file(rel, data, hashlib.sha256(data).hexdigest())
        else:
            names = [n for n in os.listdir(self.path(self.subdir)) if not n.startswith(".tmp")]
            if names:
                rel = f"{self.subdir}/{rng.choice(sorted(names))}"
                self.j("unlink", rel)
                os.unlink(self.path(rel))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("top", help="top of the mount")
    p.add_argument("subdir", help="this writer's directory below top")
    p.add_argument("journal")
    p.add_argument("seed", type=int)
    p.add_argument("--lazy", action="store_true", help="fsync before most closes (sync=lazy)")
    p.add_argument("--max-bytes", type=int, default=32 * MiB)
    p.add_argument("--steps", type=int, default=0, help="stop after N steps (0: until killed)")
    p.add_argument("--keep-going", action="store_true", help="go on after ENOSPC")
    args = p.parse_args(argv)
    w = Writer(args.top, args.subdir, Journal(args.journal), random.Random(args.seed),
               args.lazy, args.max_bytes)
    os.makedirs(w.path(args.subdir), exist_ok=True)
    n = 0
    while not args.steps or n < args.steps:
        try:
            w.step()
        except OSError as e:
            if not args.keep_going:
                raise
            if e.errno != errno.ENOSPC:
                print(f"crash_writer: {e!r}", file=sys.stderr, flush=True)
                return 3
            time.sleep(0.02)            # a full disk: try again in a moment
        n += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
