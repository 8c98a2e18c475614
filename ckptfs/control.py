"""The control channel of a running mount: versioned JSON over a unix socket.

One request per connection, one JSON object per line each way:

    -> {"v": 1, "op": "stat"}
    <- {"v": 1, "ok": true, "result": {...}}
    <- {"v": 1, "ok": false, "error": "one line"}

The socket lives in /run/ckptfs (root) or $XDG_RUNTIME_DIR/ckptfs, named after
the mountpoint, because SOURCE/.ckptfs is hidden below the mount when ckptfs
is mounted over its own source. Only the mount's owner may connect (0600).

Ops: "stat" (the numbers `ckptfs stat` prints), "sync" (commit everything,
wait until durable), "ping".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from typing import Any, Awaitable, Callable

import trio

from .errors import CkptfsError, OperationFailed, UsageError

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_REQUEST_BYTES = 64 * 1024


def socket_dir() -> str:
    if os.geteuid() == 0:
        return "/run/ckptfs"
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/ckptfs-{os.getuid()}",
                        "ckptfs")


def socket_path(mountpoint: str) -> str:
    digest = hashlib.sha256(os.path.realpath(mountpoint).encode()).hexdigest()[:20]
    return os.path.join(socket_dir(), f"{digest}.sock")


Handler = Callable[[dict], Awaitable[Any]]


async def serve(path: str, handlers: dict[str, Handler],
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Answer control requests until cancelled."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
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
        await trio.serve_listeners(answer, [listener], task_status=task_status)
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
    path = socket_path(mountpoint)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise OperationFailed(f"no ckptfs daemon answers for {mountpoint} (not mounted, "
                                  "or the daemon died: ckptfs umount it, then mount "
                                  "again)") from None
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
