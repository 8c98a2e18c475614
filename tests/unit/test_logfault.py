"""The log-fault guard (native/ckptfs_logfault.c): a SIGBUS on a page of a
guarded log mapping is a zero page and a counted fault that the reader sees
(`log_mapping_clean`), not a dead process; a SIGBUS anywhere else kills the
process as before. Each case runs in a fresh Python (the handler is
process-wide), on real file mappings the kernel really faults."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PRELUDE = textwrap.dedent("""
    import mmap, os, sys
    from ckptfs import native
    PAGE = mmap.PAGESIZE

    def cut_mapping(path, pages=4):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(fd, bytes([7]) * (pages * PAGE), 0)
        m = mmap.mmap(fd, pages * PAGE, flags=mmap.MAP_SHARED,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.ftruncate(fd, PAGE)      # pages 1.. are past the end: SIGBUS on touch
        return fd, m
""")


def run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_fault_in_a_guarded_mapping_is_seen_not_fatal(tmp_path):
    res = run(tmp_path, """
        fd, m = cut_mapping("log")
        slot = native.guard_log_mapping(m, writable=True)
        assert slot >= 0
        g0 = native.log_fault_gen()
        assert native.log_mapping_clean(slot, g0)
        assert m[0] == 7                          # inside the file: no fault
        assert native.log_mapping_clean(slot, g0)
        got = bytes(m[2 * PAGE:2 * PAGE + 16])    # past the end: SIGBUS, survived
        assert got == bytes(16), got
        assert native.log_faults() == 1
        assert not native.log_mapping_clean(slot, g0)
        g1 = native.log_fault_gen()
        assert not native.log_mapping_clean(slot, g1)   # a page is still zeroed
        assert native.repair_log_mapping(slot, fd) == 1
        g2 = native.log_fault_gen()
        assert g2 > g1 and native.log_mapping_clean(slot, g2)
        m[2 * PAGE]                               # still past the end: faults again
        assert native.log_faults() == 2 and not native.log_mapping_clean(slot, g2)
        os.ftruncate(fd, 4 * PAGE)                # the file whole again (a hole)
        assert native.repair_log_mapping(slot, fd) == 1
        os.pwrite(fd, b"back", 2 * PAGE)
        g3 = native.log_fault_gen()
        assert bytes(m[2 * PAGE:2 * PAGE + 4]) == b"back"   # the file's page again
        assert native.log_mapping_clean(slot, g3) and native.log_faults() == 2
        native.unguard_log_mapping(slot)
        m.close()
        print("ok")
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_sigbus_outside_the_guarded_mappings_still_kills(tmp_path):
    res = run(tmp_path, """
        fd, guarded = cut_mapping("log")
        assert native.guard_log_mapping(guarded, writable=True) >= 0
        other_fd, other = cut_mapping("other")
        print("touching", flush=True)
        other[2 * PAGE]
        print("survived", flush=True)
    """)
    assert res.stdout.strip() == "touching", res.stdout
    assert res.returncode == -signal.SIGBUS, (res.returncode, res.stderr)


def test_sigbus_outside_goes_to_the_handler_installed_before(tmp_path):
    """Python's faulthandler, enabled first, still reports a stray SIGBUS
    (and the process still dies of it)."""
    res = run(tmp_path, """
        import faulthandler
        faulthandler.enable()
        fd, guarded = cut_mapping("log")
        assert native.guard_log_mapping(guarded, writable=True) >= 0
        other_fd, other = cut_mapping("other")
        other[2 * PAGE]
        print("survived", flush=True)
    """)
    assert "survived" not in res.stdout
    assert res.returncode == -signal.SIGBUS, (res.returncode, res.stderr)
    assert "Bus error" in res.stderr, res.stderr


def test_sent_sigbus_still_kills(tmp_path):
    res = run(tmp_path, """
        import signal
        fd, guarded = cut_mapping("log")
        assert native.guard_log_mapping(guarded, writable=True) >= 0
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived", flush=True)
    """)
    assert "survived" not in res.stdout
    assert res.returncode == -signal.SIGBUS, (res.returncode, res.stderr)


def test_readers_racing_cuts_never_trust_a_zero_page(tmp_path):
    """Threads read a guarded mapping while its file is cut short and
    written back again and again: a read `log_mapping_clean` vouches for is
    always the file's bytes (every byte within the file's end is 7), never
    the zero page of a fault; the faults happen and are repaired."""
    res = run(tmp_path, """
        import threading, time
        fd, m = cut_mapping("log", pages=64)
        os.pwrite(fd, bytes([7]) * (64 * PAGE), 0)
        slot = native.guard_log_mapping(m, writable=True)
        stop = time.monotonic() + 2.0
        trusted = [0] * 4
        bad = []

        def reader(k):
            off = 0
            while time.monotonic() < stop and not bad:
                g0 = native.log_fault_gen()
                if not native.log_mapping_clean(slot, g0):
                    native.repair_log_mapping(slot, fd)
                    continue
                got = bytes(m[off:off + 16 * PAGE])
                if native.log_mapping_clean(slot, g0):
                    if got != bytes([7]) * len(got):
                        bad.append(off)
                    trusted[k] += 1
                else:
                    native.repair_log_mapping(slot, fd)
                off = (off + 5 * PAGE) % (48 * PAGE)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        cuts = 0
        while time.monotonic() < stop:
            os.ftruncate(fd, PAGE)
            os.pwrite(fd, bytes([7]) * (63 * PAGE), PAGE)   # grows as it writes
            cuts += 1
        for t in threads:
            t.join()
        assert not bad, bad
        assert native.log_faults() > 0 and min(trusted) > 0, (native.log_faults(), trusted)
        print("ok", cuts, native.log_faults(), trusted)
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok"), res.stdout
