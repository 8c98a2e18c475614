"""Fixtures of the compat family: frameworks and shell tools on a real mount.

Every module here runs a library's or tool's own code on a fresh mount (the
README's Compatibility table). Their workers and shared checks live in
helpers/ (compat_util, compat_rank_io, the *_worker.py scripts), put on
sys.path here. `mounted` is a fresh mount per test whose log is the module's
PMEM_SIZE (each test's log is preallocated on disk, so each module asks for
what its saves need).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


@pytest.fixture
def mounted(request, make_mount):
    """A fresh mount, over its own source, with a log of the module's PMEM_SIZE."""
    return make_mount(options=[f"pmem_size={request.module.PMEM_SIZE}"])
