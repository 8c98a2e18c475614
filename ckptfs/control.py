"""The control channel of a running mount: versioned JSON over a unix socket.

One request per connection, one JSON object per line each way:

    -> {"v": 1, "op": "stat"}
    <- {"v": 1, "ok": true, "result": {...}}
    <- {"v": 1, "ok": false, "error": "one line"}

The socket lives in /run/ckptfs (root) or $XDG_RUNTIME_DIR/ckptfs (else
/tmp/ckptfs-EUID/ckptfs), named after the mountpoint, because SOURCE/.ckptfs
is hidden below the mount when ckptfs is mounted over its own source. Only
the mount's owner may connect (0600), and both the daemon and its clients
refuse a directory another user could control (`private_socket_dir`).

Ops (the daemon's handlers, `daemon._control_handlers`):
    "stat"         the numbers `ckptfs stat` prints
    "sync"         commit everything, wait until durable (`ckptfs sync`)
    "ping"         the daemon's pid (`ckptfs umount` waits for it to exit)
    "tier"         start a tiering pass now, "all": true for every file (`ckptfs tier --now`)
    "tier_status"  progress of that pass (`ckptfs tier` follows it)
    "gc"           delete what nothing names from the backing store (`ckptfs gc`)
    "data_ranges"  where a file holds data, by inode number (`ckptfs export` keeps holes)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    import trio

from .errors import CkptfsError, OperationFailed, UsageError

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_REQUEST_BYTES = 64 * 1024


def socket_dir() -> str:
    """Where control sockets live: /run/ckptfs for root, else the user's runtime
    directory, else a private /tmp/ckptfs-EUID."""
    if os.geteuid() == 0:
        return "/run/ckptfs"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "ckptfs")
    return os.path.join(f"/tmp/ckptfs-{os.geteuid()}", "ckptfs")


def socket_path(mountpoint: str) -> str:
    digest = hashlib.sha256(os.path.realpath(mountpoint).encode()).hexdigest()[:20]
    return os.path.join(socket_dir(), f"{digest}.sock")


def private_socket_dir(create: bool) -> str:
    """socket_dir(), checked as ssh-agent checks its directory; created 0700 if
    missing and create is set (else FileNotFoundError). Raises OperationFailed
    (one line) when it is unsafe.

    Whoever controls the directory can answer in the daemon's place, so the
    directory and, below /tmp, its /tmp/ckptfs-EUID parent (which any user
    could have made first) must each be a real directory (lstat: not a
    symlink), owned by this user, with no group or other permissions.
    """
    path = socket_dir()
    parent = os.path.dirname(path)
    if parent == f"/tmp/ckptfs-{os.geteuid()}":
        _check_private(parent, create)
    _check_private(path, create)
    return path


def _check_private(path: str, create: bool) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass                       # made meanwhile: checked below like any other
        st = os.lstat(path)
    why = None
    if not stat.S_ISDIR(st.st_mode):
        why = "not a directory" + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else "")
    elif st.st_uid != os.geteuid():
        why = f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & 0o077:
        why = f"open to other users (mode {stat.S_IMODE(st.st_mode):o}, want 700)"
    if why:
        raise OperationFailed(f"control directory {path} is {why}: refusing to use it (another "
                              "user could answer in the daemon's place); remove it or set "
                              "XDG_RUNTIME_DIR")


Handler = Callable[[dict], Awaitable[Any]]


async def serve(path: str, handlers: dict[str, Handler], task_status=None) -> None:
    """Answer control requests until cancelled."""
    # trio here, not at the top: `request` is all a command needs, and
    # importing trio is a third of a command's start.
    import trio
    private_socket_dir(create=True)
    try:
        os.unlink(path)      # left by a daemon that was killed
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)

    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                raw = await _read_line(stream)
                request = json.loads(raw)
                if request.get("v") != PROTOCOL_VERSION:
                    raise UsageError(f"control protocol version {request.get('v')} "
                                     f"not supported (this daemon speaks {PROTOCOL_VERSION})")
                handler = handlers.get(request.get("op"))
                if handler is None:
                    raise UsageError(f"unknown control op {request.get('op')!r}")
                reply = {"v": PROTOCOL_VERSION, "ok": True, "result": await handler(request)}
            except (CkptfsError, ValueError) as e:
                reply = {"v": PROTOCOL_VERSION, "ok": False, "error": str(e)}
            except Exception as e:  # the channel must outlive a failed request
                log.exception("control request failed")
                reply = {"v": PROTOCOL_VERSION, "ok": False, "error": f"internal error: {e}"}
            try:
                await stream.send_all(json.dumps(reply).encode() + b"\n")
            except trio.BrokenResourceError:
                pass

    try:
        await trio.serve_listeners(answer, [listener], task_status=(
            trio.TASK_STATUS_IGNORED if task_status is None else task_status))
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


async def _read_line(stream: trio.SocketStream) -> bytes:
    buf = b""
    while b"\n" not in buf:
        data = await stream.receive_some(4096)
        if not data:
            break
        buf += data
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError("control request too large")
    return buf.split(b"\n", 1)[0]


def request(mountpoint: str, op: str, timeout_s: float = 600.0, **args: Any) -> Any:
    """Send one request to the daemon serving mountpoint; return its result. Blocks."""
    no_daemon = OperationFailed(f"no ckptfs daemon answers for {mountpoint} (not mounted, "
                                "or the daemon died: ckptfs umount it, then mount again)")
    try:
        private_socket_dir(create=False)
    except FileNotFoundError:
        raise no_daemon from None
    path = socket_path(mountpoint)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise no_daemon from None
        s.sendall(json.dumps({"v": PROTOCOL_VERSION, "op": op, **args}).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            data = s.recv(65536)
            if not data:
                break
            buf += data
    reply = json.loads(buf.split(b"\n", 1)[0] or b"{}")
    if reply.get("v") != PROTOCOL_VERSION:
        raise CkptfsError(f"daemon answered with protocol version {reply.get('v')}")
    if not reply.get("ok"):
        raise CkptfsError(reply.get("error", "daemon gave no reason"))
    return reply["result"]
