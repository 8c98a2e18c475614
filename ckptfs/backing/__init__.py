"""Backing storage: where cold chunks go, as pack files (`ckptfs.packs`).

`base` defines the interface (`Backend`, `BlobWriter`, blob names and errors),
`local` stores blobs in a directory (local disk, NFS, Lustre), `s3` in an S3
bucket (AWS, Ceph RGW, MinIO), `faulty` wraps any backend to fail on demand in
tests. `open_backend` picks a backend from a location string.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

from ..errors import UsageError
from .base import MARKER_NAME, Backend, BlobWriter, UuidLike, validate_name
from .local import LocalBackend

__all__ = ["Backend", "BlobWriter", "LocalBackend", "MARKER_NAME", "SCHEMES", "check_location",
           "is_url", "open_backend", "validate_name"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _file_location(location: str) -> str:
    """file:///DIR -> /DIR."""
    path = location[len("file://"):]
    if not path.startswith("/"):
        raise UsageError(f"backing store {location!r}: a file:// url names an absolute "
                         "directory (file:///DIR)")
    return path


def _s3_location(location: str) -> str:
    """s3://BUCKET/PREFIX/ -> s3://BUCKET/PREFIX (checked; botocore not imported)."""
    from .s3 import SCHEME, parse_url
    bucket, prefix = parse_url(SCHEME + location.split("://", 1)[1])
    return f"{SCHEME}{bucket}/{prefix}" if prefix else f"{SCHEME}{bucket}"


# The url schemes a backing store location may use: scheme -> a function that
# checks a location of that scheme (UsageError with one line) and returns it
# in the form the daemon uses. A new backend registers its scheme here.
SCHEMES: dict[str, Callable[[str], str]] = {"file": _file_location, "s3": _s3_location}


def is_url(location: str) -> bool:
    """A location (as check_location returns it) that is not a directory path."""
    return bool(_URL.match(location))


def check_location(location: str) -> str:
    """backing=: an absolute directory path, or a url of a scheme in SCHEMES.

    Returns the location normalized (a file:// url becomes its path). Anything
    else is a UsageError: a relative path would depend on the working
    directory of whoever mounts, and an unknown scheme must never become a
    directory named after it.
    """
    m = _URL.match(location)
    if m:
        check = SCHEMES.get(m.group(1).lower())
        if check is None:
            known = ", ".join(f"{s}://" for s in sorted(SCHEMES))
            raise UsageError(f"backing store {location!r}: unknown url scheme "
                             f"{m.group(1)!r} (known: {known}; or an absolute directory path)")
        return check(location)
    if not location or not os.path.isabs(location):
        raise UsageError(f"backing store {location!r}: the directory must be an absolute path")
    return os.path.normpath(location)


def open_backend(location: str, store_uuid: Optional[UuidLike] = None, *,
                 create: bool = False, must_exist: bool = False, **kw) -> Backend:
    """The backend at `location`: a directory path, a "file://" url, or an
    "s3://BUCKET/PREFIX" url (`kw` goes to `S3Backend`: profile=, timeouts).

    Without `create` or `must_exist` no I/O is done (the store may be away at
    startup; call `check()`); `must_exist` checks its marker (BackingUnavailable
    if there is none, or it names another store than `store_uuid`); `create`
    creates the store if needed (first use only: see `LocalBackend.create`).
    """
    location = check_location(location)
    if location.startswith("s3://"):
        from .s3 import S3Backend               # botocore only when S3 is used
        cls = S3Backend
    else:
        cls, kw = LocalBackend, {}
    if create:
        return cls.create(location, store_uuid, **kw)
    if must_exist:
        return cls.open(location, store_uuid, **kw)
    return cls(location, store_uuid, **kw)
