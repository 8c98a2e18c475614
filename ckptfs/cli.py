"""Command line: `ckptfs SUBCOMMAND` and the `mount.ckptfs` helper.

`main(argv)` and `mount_helper_main(argv)` can be called in-process by tests.
Errors print one line, no traceback: a bad command line or option
(UsageError) exits 2, a command that cannot be done (any other CkptfsError,
OSError) exits 1. Exit codes live in `errors.ExitCode` and are documented in the
README's table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Optional

from . import control
from .errors import CkptfsError, ExitCode, OperationFailed, UsageError, one_line
from .mounts import find_mount
from .options import options_help, parse_options
from .proc import wait_exit


MOUNT_DESCRIPTION = """Mount ckptfs with its state in SOURCE/.ckptfs (SOURCE may equal MOUNTPOINT:
mount over the checkpoint directory itself). Returns once the mount is live."""

MOUNT_USAGE = f"""usage: mount.ckptfs SOURCE MOUNTPOINT [-o OPT[,OPT...]] [-f] [-n] [-s] [-v]

{MOUNT_DESCRIPTION}
  -o OPT[,OPT...]       mount options (below); may be given more than once
  -f                    stay in the foreground (log to stderr)
  -n, -s, -v, -t TYPE   accepted for mount(8) compatibility
"""


def mount_helper_main(argv: Optional[list[str]] = None) -> int:
    """mount.ckptfs, called by hand or by mount(8) as mount.ckptfs SRC DIR -o OPTS."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(MOUNT_USAGE + "\n" + options_help())
        return ExitCode.OK
    positional: list[str] = []
    option_strings: list[str] = []
    foreground = False
    it = iter(argv)
    for arg in it:
        if arg == "-o":
            option_strings.append(next(it, ""))
        elif arg.startswith("-o") and len(arg) > 2:
            option_strings.append(arg[2:])
        elif arg == "-f":
            foreground = True
        elif arg in ("-n", "-s", "-v"):
            pass
        elif arg == "-t":
            next(it, None)
        elif arg.startswith("-"):
            return _fail(UsageError(f"unknown flag {arg} (see mount.ckptfs --help)"))
        else:
            positional.append(arg)
    if len(positional) != 2:
        return _fail(UsageError("need SOURCE and MOUNTPOINT (see mount.ckptfs --help)"))
    return _mount(positional[0], positional[1], option_strings, foreground)


def _mount(source: str, mountpoint: str, option_strings: list[str], foreground: bool) -> int:
    try:
        opts = parse_options(source, mountpoint, option_strings)
    except CkptfsError as e:
        return _fail(e)
    opts.foreground = opts.foreground or foreground
    if find_mount(opts.source) is not None:
        # Mounted over itself: SOURCE/.ckptfs (and the lock in it) is hidden below that mount.
        return _fail(OperationFailed(f"{opts.source} is already mounted by ckptfs "
                                     "(unmount it first)"))
    if find_mount(opts.mountpoint) is not None:
        return _fail(OperationFailed(f"{opts.mountpoint} is already a ckptfs mount "
                                     "(unmount it first: ckptfs umount "
                                     f"{opts.mountpoint})"))
    # The daemon's modules (trio, the index, the log) load only for a mount:
    # every other command is a client and starts in a fraction of the time.
    from .daemon import mount
    return mount(opts)


def _fail(e: Exception) -> int:
    print(one_line(f"ckptfs: {e}"), file=sys.stderr)
    return ExitCode.USAGE if isinstance(e, UsageError) else ExitCode.FAILED


# ---------------------------------------------------------------- ckptfs CMD

def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ckptfs", description="Operate ckptfs, the checkpoint filesystem.",
        epilog="Exit codes: 0 ok (fsck: clean), 1 failed, 2 usage error, "
               "3 fsck repaired everything it found, 4 fsck left problems (or could not "
               "check the log or the store), recover could not rebuild something (named).")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("mount", help="mount SOURCE on MOUNTPOINT (same as mount.ckptfs)",
                       description=MOUNT_DESCRIPTION, epilog=options_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", help="the checkpoint directory; its state "
                                                    "goes to SOURCE/.ckptfs")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="where to mount (may be SOURCE)")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPT[,OPT...]",
                   help="mount options (below); may be given more than once")
    p.add_argument("-f", dest="foreground", action="store_true",
                   help="stay in the foreground (log to stderr)")

    p = sub.add_parser("umount", help="unmount and wait until the daemon has committed and exited")
    p.add_argument("mountpoint")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    p.add_argument("-z", "--lazy", action="store_true", help="detach even if busy")

    p = sub.add_parser("stat", help="space, dedup and log use of a mounted ckptfs")
    p.add_argument("mountpoint")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("fsck", help="check an unmounted ckptfs (index, log, refcounts, checksums)")
    p.add_argument("source")
    p.add_argument("--repair", action="store_true", help="mend what can be mended")
    p.add_argument("--no-data", action="store_true", help="skip reading every data block")
    p.add_argument("-o", dest="options", action="append", default=[],
                   help="the mount options the filesystem uses (for pmem=)")

    p = sub.add_parser("sync", help="make everything written so far durable (--published: "
                                    "and published to the backing store)")
    p.add_argument("mountpoint")
    p.add_argument("--published", action="store_true",
                   help="wait until everything committed so far is in the backing store, "
                        "a snapshot head naming it published (what another node restores)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for --published (default 600)")

    p = sub.add_parser("volumes", help="list the volumes of a backing store",
                       description="List the volumes (filesystems) of a backing store "
                                   "(s3://BUCKET/PREFIX or a directory): the node holding "
                                   "each, its lease generation, its newest published "
                                   "snapshot.")
    p.add_argument("store", metavar="URL|DIR")
    p.add_argument("-o", dest="options", action="append", default=[],
                   help="aws_profile=NAME for an s3:// store")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("export", help="copy files or trees out of a mounted ckptfs as plain files",
                       description="Copy PATH (a file or a directory tree inside a mounted "
                                   "ckptfs) to DEST as plain files, like cp -a: modes, owners, "
                                   "ns times, symlinks, hard links and user xattrs are kept. "
                                   "If DEST is an existing directory the copy goes into it. "
                                   "Each file appears under its name only once complete.")
    p.add_argument("path")
    p.add_argument("dest")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar (default: when stderr is a terminal)")

    p = sub.add_parser("gc", help="publish a snapshot and delete what nothing needs from "
                                  "the backing store",
                       description="Publish a snapshot of the namespace, then delete what "
                                   "nothing needs any more from the backing store of a "
                                   "mounted ckptfs: packs whose chunks are all gone (or that "
                                   "a crash left unnamed), snapshot heads older than the "
                                   "newest 3 and the namespace objects only they reach, "
                                   "per-file manifests of older ckptfs versions, temporary "
                                   "files of interrupted writes. The index is never changed.")
    p.add_argument("mountpoint")

    p = sub.add_parser("recover", help="rebuild a lost index from the backing store alone",
                       description="Rebuild SOURCE/.ckptfs/index from the newest snapshot "
                                   "in the backing store: every directory, symlink, hard "
                                   "link and every file whose bytes are all in the store, "
                                   "exactly as that snapshot describes them. Files it cannot "
                                   "restore are named (exit 4). SOURCE must be unmounted and "
                                   "hold no index; nothing is left behind if it fails.")
    p.add_argument("source")
    p.add_argument("-o", dest="options", action="append", default=[],
                   help="mount options: backing= if the store is not the default, "
                        "volume=NAME to restore another node's volume (the next mount "
                        "with it takes the volume over)")
    p.add_argument("--head", type=int, metavar="SEQ",
                   help="restore this (older) snapshot instead of the newest")

    p = sub.add_parser("tier", help="move cold versions to the backing store now",
                       description="Move every chunk the tiering policy calls cold (all "
                                   "but the hot_versions newest versions) to the backing "
                                   "store now, and wait until it is durable.")
    p.add_argument("mountpoint")
    p.add_argument("--now", action="store_true", required=True,
                   help="run a tiering pass now (the background mover otherwise decides)")
    p.add_argument("--all", action="store_true",
                   help="move every committed file, the newest versions too")

    args = parser.parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()          # here, where a closed pipe can be told apart
        return code
    except BrokenPipeError:
        return _reader_went_away()
    except (CkptfsError, OSError) as e:
        return _fail(e)


def _run(args: argparse.Namespace) -> int:
    """Dispatch one subcommand; its exit code."""
    if args.cmd == "mount":
        return _mount(args.source, args.mountpoint, args.options, args.foreground)
    if args.cmd == "umount":
        return umount(args.mountpoint, args.timeout, args.lazy)
    if args.cmd == "stat":
        return show_stat(args.mountpoint, args.json)
    if args.cmd == "fsck":
        from .fsck import run_fsck
        return run_fsck(args.source, args.options, repair=args.repair,
                        verify_data=not args.no_data)
    if args.cmd == "sync":
        return sync(args.mountpoint, args.published, args.timeout)
    if args.cmd == "volumes":
        return show_volumes(args.store, args.options, args.json)
    if args.cmd == "export":
        from .export import run_export
        return run_export(args.path, args.dest, progress=args.progress)
    if args.cmd == "gc":
        done = control.request(args.mountpoint, "gc")
        print(f"published snapshot {done['snapshot']}; deleted {done['dead_packs']} dead "
              f"packs, {done['old_heads']} older snapshot heads, {done['objects']} "
              f"namespace objects no kept head needs, {done['stale_manifests']} stale "
              f"manifests, {done['temporary_files']} temporary files"
              + (f"; {done['condemned_deleted']} packs other volumes no longer name "
                 f"deleted, {done['condemned_held']} kept for them; "
                 f"{done['repacked_chunks']} chunks rewritten out of packs that should "
                 "not stay for them"
                 if "condemned_deleted" in done else ""))
        return ExitCode.OK
    if args.cmd == "recover":
        from .recover import run_recover
        return run_recover(args.source, args.options, head=args.head)
    if args.cmd == "tier":
        return tier_now(args.mountpoint, everything=args.all)
    return ExitCode.USAGE


def _reader_went_away() -> int:
    """stdout's reader closed early (`ckptfs stat MP | head -1`): stop quietly,
    as cat does: no error line, and no traceback when Python flushes stdout at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return ExitCode.FAILED


def umount(mountpoint: str, timeout_s: float, lazy: bool) -> int:
    if find_mount(mountpoint) is None:
        raise OperationFailed(f"{mountpoint} is not a ckptfs mount (nothing to unmount)")
    try:
        pid = control.request(mountpoint, "ping", timeout_s=10)["pid"]
    except CkptfsError:
        pid = None          # daemon gone: just detach the dead mount
        lazy = True
    tool = shutil.which("fusermount3") or shutil.which("fusermount") or "umount"
    cmd = [tool, "-u"] if "fusermount" in tool else [tool]
    if lazy:
        cmd.append("-z" if "fusermount" in tool else "-l")
    res = subprocess.run(cmd + [mountpoint], capture_output=True, text=True)
    if res.returncode != 0:
        detail = (res.stderr.strip().splitlines() or ["unmount failed"])[-1]
        raise CkptfsError(f"cannot unmount {mountpoint}: {detail}")
    if pid is not None and not wait_exit(pid, timeout_s):
        raise CkptfsError(f"daemon {pid} still running after {timeout_s:.0f} s")
    return ExitCode.OK


def sync(mountpoint: str, published: bool, timeout_s: float) -> int:
    if not published:
        control.request(mountpoint, "sync")
        return ExitCode.OK
    try:
        control.request(mountpoint, "sync", timeout_s=timeout_s, published=True)
    except TimeoutError:
        stats = control.request(mountpoint, "stat", timeout_s=10)
        raise OperationFailed(f"not published within {timeout_s:g} s: publish lag "
                              f"{stats.get('publish_lag_s')} s, backlog "
                              f"{_human(stats.get('publish_backlog_bytes', 0))}"
                              + (f", last error: {stats['publish_last_error']}"
                                 if stats.get("publish_last_error") else "")) from None
    return ExitCode.OK


def show_volumes(location: str, option_strings: list[str], as_json: bool) -> int:
    import time

    from . import volumes
    from .backing import open_backend
    profile = None
    for item in filter(None, ",".join(option_strings).split(",")):
        name, _, value = item.partition("=")
        if name != "aws_profile" or not value:
            raise UsageError(f"ckptfs volumes takes -o aws_profile=NAME only, not {item!r}")
        profile = value
    with open_backend(location, must_exist=True, profile=profile) as backend:
        rows = [volumes.summary(backend, name) for name in volumes.volume_names(backend)]
    if as_json:
        json.dump(rows, sys.stdout, indent=2, sort_keys=True)
        print()
        return ExitCode.OK

    def when(t: Optional[float]) -> str:
        if t is None:
            return "never"
        return (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
                + f" ({_age(time.time() - t)} ago)")

    table = [("VOLUME", "NODE", "GEN", "NEWEST PUBLISH", "HEAD", "FILES")]
    for r in rows:
        files = "-" if r["files"] is None else (
            f"{r['files']}" + (f" ({r['incomplete_files']} not wholly in the store)"
                               if r["incomplete_files"] else ""))
        table.append((r["volume"], r["node"] or "-", str(r["generation"]),
                      when(r["published"]), r["head"] or "-", files))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)) + "  " + row[-1])
    for r in rows:
        for why in r["damaged_leases"]:
            print(f"note: {why}")
        if r.get("head_problem"):
            print(f"note: volume {r['volume']}: newest head unusable: {r['head_problem']}")
    return ExitCode.OK


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def tier_now(mountpoint: str, everything: bool) -> int:
    """Start a tiering pass in the daemon and follow it with a progress bar."""
    import time

    from tqdm import tqdm
    control.request(mountpoint, "tier", all=everything)
    bar = tqdm(unit="B", unit_scale=True, desc="tiering", disable=not sys.stderr.isatty(),
               file=sys.stderr)
    with bar:
        while True:
            status = control.request(mountpoint, "tier_status")
            bar.total = status["total_bytes"] or None
            bar.n = status["done_bytes"]
            bar.refresh()
            if status["finished"]:
                break
            time.sleep(0.2)
    if status["error"]:
        raise CkptfsError(f"tiering failed: {status['error']}")
    stats = control.request(mountpoint, "stat")
    print(f"moved {_human(status['done_bytes'])}; cold now {_human(stats['cold_bytes'])} "
          f"stored for {_human(stats['cold_logical_bytes'])}, log in use "
          f"{_human(stats['hot_bytes'])}")
    return ExitCode.OK


def show_stat(mountpoint: str, as_json: bool) -> int:
    stats = control.request(mountpoint, "stat")
    if as_json:
        json.dump(stats, sys.stdout, indent=2, sort_keys=True)
        print()
        return ExitCode.OK
    rows = [
        ("daemon pid", stats["pid"]),
        ("sync mode", stats["sync"]),
        ("files", stats["files"]),
        ("logical bytes", _human(stats["logical_bytes"])),
        ("stored bytes", _human(stats["stored_bytes"])),
        ("dedup ratio", f"{stats['dedup_ratio']:.2f}"),
        ("log in use", f"{_human(stats['hot_bytes'])} of {_human(stats['pmem_size'])}"
                       f" ({100 * stats['hot_bytes'] / max(stats['pmem_size'], 1):.1f}%)"),
        ("pre-existing bytes", _human(stats["source_bytes"])),
        ("cold bytes", f"{_human(stats['cold_bytes'])} stored for "
                       f"{_human(stats['cold_logical_bytes'])} "
                       f"(compression {stats['compression_ratio']:.2f})"),
        ("tiering", f"{stats.get('tier_state', 'off')}, backlog "
                    f"{_human(stats.get('tier_backlog_bytes', 0))}"
                    + (f", error: {stats['tier_last_error']}" if stats.get("tier_last_error")
                       else "")),
        *((("publishing", f"{stats['publish_state']}, lag {stats['publish_lag_s']:.1f} s, "
                          f"backlog {_human(stats['publish_backlog_bytes'])}"
                          + (f", error: {stats['publish_last_error']}"
                             if stats.get("publish_last_error") else "")),
           ("volume", f"{stats['volume']} (generation {stats['volume_generation']}"
                      + (", FENCED: another node holds it)" if stats["volume_fenced"]
                         else ")")))
          if "publish_state" in stats else ()),
        ("chunks", stats["chunks"]),
        ("open / dirty files", f"{stats['open_files']} / {stats['dirty_files']}"),
        ("commits", f"{stats['commits']} (avg {stats['commit_seconds_avg'] * 1000:.2f} ms)"),
        ("state", "READ-ONLY" if stats["read_only"] else "read-write"),
        ("last error", stats["last_error"] or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return ExitCode.OK


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


if __name__ == "__main__":
    sys.exit(main())
