"""Backing storage: where cold chunks go, as pack files (`ckptfs.packs`).

`base` defines the interface (`Backend`, `BlobWriter`, blob names and errors),
`local` stores blobs in a directory (local disk, NFS, Lustre), `faulty` wraps
any backend to fail on demand in tests. `open_backend` picks a backend from a
location string.
"""

from __future__ import annotations

import os
from typing import Optional

from ..errors import UsageError
from .base import MARKER_NAME, Backend, BlobWriter, UuidLike, validate_name
from .local import LocalBackend

__all__ = ["Backend", "BlobWriter", "LocalBackend", "MARKER_NAME", "open_backend",
           "validate_name"]


def open_backend(location: str, store_uuid: Optional[UuidLike] = None, *,
                 create: bool = False) -> Backend:
    """The backend at `location`: a directory path or a "file://" url.

    Without `create` no I/O is done (the store may be away at startup; call
    `check()`); with it the store is created if needed (first use only: see
    `LocalBackend.create`).
    """
    if location.startswith("file://"):
        path = location[len("file://"):]
    elif "://" in location:
        raise UsageError(f"unsupported backing store {location!r}: only a directory "
                         "or a file:// url")
    else:
        path = location
    if not path or not os.path.isabs(path):
        raise UsageError(f"backing store {location!r}: the directory must be an absolute path")
    if create:
        return LocalBackend.create(path, store_uuid)
    return LocalBackend(path, store_uuid)
