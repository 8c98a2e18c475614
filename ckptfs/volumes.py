"""Volumes: every ckptfs filesystem is a named volume of its backing store.

Several nodes share one store (a bucket, a directory on a shared
filesystem); each node's filesystem publishes into its own volume, and any
node can restore a volume and take it over (docs/STORE.md, "Volumes";
docs/OPERATIONS.md, "Running on a cluster"). In the store:

    leases/<volume>/<gen 16 hex>            who holds the volume from that
                                            generation on (create-once)
    volumes/<volume>/heads/<gen>-<seq>      snapshot heads (16 hex each,
                                            create-once)
    volumes/<volume>/objects/...            the volume's namespace objects
    spaces/<8 hex>                          a pack-number space, claimed
                                            (create-once) by one lease

Leases are made with `Backend.create_once` only (S3: one PUT with
If-None-Match: *; a directory: link(2)): of two nodes racing for
generation g + 1, one wins. The holder of the newest lease may publish; a
node that finds a lease newer than its own stops publishing for good.

Fencing rule: a head (g, s) is *valid* unless a lease of a later generation
is based on a head older than it: `(g, s) <= lease.base` for every lease of
a generation above g. The node that takes over writes, in its lease, the
head its state starts from (the newest valid one it restored); whatever the
old holder published after that (in the moment before it saw the lease) is
invalid for everybody from the instant the lease exists, and recover,
`ckptfs volumes` and the new holder ignore it. Sequence numbers keep rising
across takeovers (recover starts the counter above every head of the
volume), so the newest valid head is simply the largest (gen, seq).

Pack numbers are 64 bits: the high 32 are a *space* that one lease claims
(`spaces/<8 hex>`, create-once), the low 32 count packs within it. So no two
filesystems writing into one store, nor an old holder still finishing a
pack after a takeover, ever write the same pack name.

Every function here may block (it talks to the store); none touches the
index.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

from .backing.base import Backend
from .backing.scoped import ScopedBackend
from .chunker import chunk_id
from .errors import BlobMissing, CkptfsError, Fenced, FormatError, UsageError, VolumeInUse

LEASE_PREFIX = "leases/"
VOLUME_PREFIX = "volumes/"
SPACE_PREFIX = "spaces/"
LEASE_FORMAT = "ckptfs-lease"
SPACE_FORMAT = "ckptfs-space"
LEASE_VERSION = 1
MAX_LEASE_BYTES = 16 << 10
MAX_NAME_CHARS = 64
SPACE_SHIFT = 32                  # pack number = space << SPACE_SHIFT | counter
SPACE_ATTEMPTS = 64

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEAD = re.compile(r"^heads/([0-9a-f]{16})-([0-9a-f]{16})$")
_LEASE = re.compile(r"^[0-9a-f]{16}$")

HeadKey = tuple[int, int]          # (generation, sequence number)


class BadLease(FormatError):
    """A lease blob that is damaged or not what its name says."""


# ------------------------------------------------------------------- names

def check_name(name: str) -> str:
    """A volume name as `-o volume=` takes it: 1-64 of letters, digits, '.',
    '_', '-', starting with a letter or digit (a host name fits)."""
    if not _NAME.match(name or "") or name in (".", ".."):
        raise UsageError(f"volume name {name!r}: 1 to {MAX_NAME_CHARS} letters, digits, "
                         "'.', '_' or '-', starting with a letter or digit")
    return name


def default_name() -> str:
    """This host's name, as a volume name (the default of `-o volume=`)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).lstrip("._-")
    return host[:MAX_NAME_CHARS] or "localhost"


def lease_name(volume: str, gen: int) -> str:
    return f"{LEASE_PREFIX}{volume}/{gen:016x}"


def volume_prefix(volume: str) -> str:
    return f"{VOLUME_PREFIX}{volume}/"


def head_name(gen: int, seq: int) -> str:
    """A head's name inside its volume's scope (`scope`)."""
    return f"heads/{gen:016x}-{seq:016x}"


def head_key(name: str) -> Optional[HeadKey]:
    """(gen, seq) of a head name inside a volume's scope, None if it is not one."""
    m = _HEAD.match(name)
    return (int(m.group(1), 16), int(m.group(2), 16)) if m else None


def scope(backend: Backend, volume: str) -> ScopedBackend:
    """The volume's part of the store: heads and objects, named as in one store."""
    return ScopedBackend(backend, volume_prefix(volume))


def pack_space(pack_no: int) -> int:
    return pack_no >> SPACE_SHIFT


# ------------------------------------------------------------------ leases

@dataclass(frozen=True)
class Lease:
    volume: str
    gen: int
    node: str                      # host name of the node that took it
    fs_uuid: bytes                 # the filesystem (index) that holds it
    base: Optional[HeadKey]        # the head its state started from; None: a new volume
    space: int                     # the pack-number space it writes into
    time_ns: int


def _dumps(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("ascii")


def encode_lease(lease: Lease) -> bytes:
    doc = {"format": LEASE_FORMAT, "version": LEASE_VERSION, "volume": lease.volume,
           "gen": lease.gen, "node": lease.node, "fs_uuid": lease.fs_uuid.hex(),
           "base": list(lease.base) if lease.base is not None else None,
           "space": lease.space, "time_ns": lease.time_ns}
    doc["check"] = chunk_id(_dumps(doc)).hex()
    return _dumps(doc) + b"\n"


def _whole(doc: dict, key: str, hi: int, what: str) -> int:
    v = doc.get(key)
    if type(v) is not int or not 0 <= v <= hi:
        raise BadLease(f"{what}: {key!r} is not a whole number in [0, {hi}]")
    return v


def decode_lease(name: str, volume: str, raw: bytes) -> Lease:
    """A lease, every field checked (BadLease otherwise)."""
    what = f"lease {name}"
    if len(raw) > MAX_LEASE_BYTES:
        raise BadLease(f"{what}: {len(raw)} bytes, more than a lease has")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadLease(f"{what}: not JSON") from None
    if not isinstance(doc, dict):
        raise BadLease(f"{what}: not a JSON object")
    check = doc.pop("check", None)
    if not isinstance(check, str) or chunk_id(_dumps(doc)).hex() != check:
        raise BadLease(f"{what}: its check does not match (damaged)")
    if doc.get("format") != LEASE_FORMAT or doc.get("version") != LEASE_VERSION:
        raise BadLease(f"{what}: not a version {LEASE_VERSION} ckptfs lease")
    if doc.get("volume") != volume:
        raise BadLease(f"{what}: names volume {str(doc.get('volume'))[:80]!r}")
    gen = _whole(doc, "gen", (1 << 64) - 1, what)
    if name != lease_name(volume, gen):
        raise BadLease(f"{what}: says it is generation {gen}")
    base = doc.get("base")
    if base is not None:
        if (not isinstance(base, list) or len(base) != 2
                or any(type(v) is not int or not 0 <= v < 1 << 64 for v in base)):
            raise BadLease(f"{what}: 'base' is not [generation, sequence]")
        base = (base[0], base[1])
    node = doc.get("node")
    if not isinstance(node, str) or len(node) > 255:
        raise BadLease(f"{what}: 'node' is not a host name")
    try:
        fs_uuid = bytes.fromhex(doc.get("fs_uuid"))
    except (TypeError, ValueError):
        raise BadLease(f"{what}: 'fs_uuid' is not hex") from None
    return Lease(volume, gen, node, fs_uuid, base, _whole(doc, "space", (1 << 32) - 1, what),
                 _whole(doc, "time_ns", (1 << 63) - 1, what))


def read_lease(backend: Backend, volume: str, gen: int) -> Lease:
    name = lease_name(volume, gen)
    size = backend.size(name)
    return decode_lease(name, volume, backend.read(name, 0, min(size, MAX_LEASE_BYTES + 1)))


def newer_lease(backend: Backend, volume: str, gen: int) -> Optional[Lease]:
    """The lease that took the volume from generation `gen`, if there is one:
    the fence check before every publish (one request: leases are taken one
    generation at a time, so a newer one means generation gen + 1 exists)."""
    try:
        return read_lease(backend, volume, gen + 1)
    except BlobMissing:
        return None
    except BadLease as e:
        # Damaged, but its name is taken: the volume is someone else's now.
        return Lease(volume, gen + 1, f"(unreadable lease: {e})", b"", None, 0, 0)


# ---------------------------------------------------------- a volume's state

@dataclass
class VolumeState:
    """A volume as one listing of the store shows it."""

    name: str
    leases: list[Lease] = field(default_factory=list)       # by generation
    heads: list[HeadKey] = field(default_factory=list)      # every head, sorted
    damaged: list[str] = field(default_factory=list)        # leases that cannot be read

    @property
    def holder(self) -> Optional[Lease]:
        return self.leases[-1] if self.leases else None

    @property
    def generation(self) -> int:
        return self.holder.gen if self.holder is not None else 0

    def valid(self, head: HeadKey) -> bool:
        """The fencing rule (module docstring)."""
        return all(lease.base is not None and head <= lease.base
                   for lease in self.leases if lease.gen > head[0])

    def valid_heads(self) -> list[HeadKey]:
        return [h for h in self.heads if self.valid(h)]

    def newest_valid(self) -> Optional[HeadKey]:
        valid = self.valid_heads()
        return valid[-1] if valid else None

    @property
    def spaces(self) -> set[int]:
        """The pack-number spaces the volume's holders wrote into."""
        return {lease.space for lease in self.leases}


def read_state(backend: Backend, volume: str) -> VolumeState:
    """The volume's leases and heads, from the store. May block."""
    state = VolumeState(volume)
    for name in backend.list(f"{LEASE_PREFIX}{volume}/"):
        base = name.rpartition("/")[2]
        if not _LEASE.match(base) or name != lease_name(volume, int(base, 16)):
            continue
        try:
            state.leases.append(read_lease(backend, volume, int(base, 16)))
        except BlobMissing:
            continue
        except BadLease as e:
            state.damaged.append(str(e))
            # Its generation is taken and fences every older head: base unknown.
            state.leases.append(Lease(volume, int(base, 16), "(unreadable)", b"", None, 0, 0))
    state.leases.sort(key=lambda lease: lease.gen)
    state.heads = sorted(k for k in (head_key(n) for n in scope(backend, volume).list("heads/"))
                         if k is not None)
    return state


def volume_names(backend: Backend) -> list[str]:
    """Every volume with a lease in the store, by name. May block."""
    names = set()
    for name in backend.list(LEASE_PREFIX):
        volume = name[len(LEASE_PREFIX):].partition("/")[0]
        if _NAME.match(volume):
            names.add(volume)
    return sorted(names)


# ------------------------------------------------------------------ taking

def claim_space(backend: Backend, volume: str, gen: int, fs_uuid: bytes,
                want: Optional[int] = None) -> int:
    """A pack-number space of this store that no one else writes into: `want`
    if it is free (or already this volume's), else a new random one. May block."""
    doc = _dumps({"format": SPACE_FORMAT, "version": 1, "volume": volume, "gen": gen,
                  "fs_uuid": fs_uuid.hex(), "time_ns": time.time_ns()}) + b"\n"
    candidates = ([want] if want is not None else []) + \
        [secrets.randbelow((1 << 32) - 1) + 1 for _ in range(SPACE_ATTEMPTS)]
    for space in candidates:
        name = f"{SPACE_PREFIX}{space:08x}"
        if backend.create_once(name, doc):
            return space
        if space == want and _space_volume(backend, name) == volume:
            return space              # claimed before by this volume (a takeover continues it)
    raise CkptfsError(f"{backend.url}: no free pack space after {SPACE_ATTEMPTS} tries")


def _space_volume(backend: Backend, name: str) -> Optional[str]:
    try:
        doc = json.loads(backend.read(name, 0, min(backend.size(name), MAX_LEASE_BYTES)))
        return doc.get("volume") if isinstance(doc, dict) else None
    except (BlobMissing, ValueError, UnicodeDecodeError):
        return None


def take(backend: Backend, volume: str, gen: int, fs_uuid: bytes, base: Optional[HeadKey],
         space: Optional[int] = None, node: Optional[str] = None) -> Lease:
    """Create lease `gen` of the volume, naming `base` (the head this
    filesystem's state starts from) and a pack space (`space` if it is free
    or this volume's, else a new one). VolumeInUse if another node made
    that generation first. May block."""
    space = claim_space(backend, volume, gen, fs_uuid, space)
    lease = Lease(volume, gen, node or socket.gethostname(), fs_uuid, base, space,
                  time.time_ns())
    if backend.create_once(lease_name(volume, gen), encode_lease(lease)):
        return lease
    other = read_lease(backend, volume, gen)
    raise VolumeInUse(f"volume {volume} in {backend.url}: generation {gen} was just taken by "
                      f"node {other.node}")


def describe(lease: Optional[Lease]) -> str:
    if lease is None:
        return "no lease"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease.time_ns / 1e9))
    return f"node {lease.node}, generation {lease.gen} since {when}"


# --------------------------------------------------------- a held volume

class Volume:
    """The volume a mounted filesystem holds: where its heads and objects go
    (`scope`), its lease generation, and the fence check (`fence`)."""

    def __init__(self, backend: Backend, name: str, gen: int, fs_uuid: bytes) -> None:
        self.backend = backend
        self.name = name
        self.gen = gen
        self.fs_uuid = fs_uuid
        self.scope = scope(backend, name)
        self.fenced_by: Optional[Lease] = None

    def head_name(self, seq: int) -> str:
        return head_name(self.gen, seq)

    def fence(self) -> None:
        """Fenced if another node took the volume over (checked before every
        head and every deletion; once fenced, for good). May block."""
        if self.fenced_by is None:
            self.fenced_by = newer_lease(self.backend, self.name, self.gen)
        if self.fenced_by is not None:
            raise Fenced(f"volume {self.name} was taken over by {describe(self.fenced_by)}: "
                         f"this filesystem (generation {self.gen}) publishes nothing more and "
                         "is read-only")

    def state(self) -> VolumeState:
        return read_state(self.backend, self.name)


# ------------------------------------------------------------- attaching

@dataclass
class Attached:
    """What attaching a filesystem to its volume found (daemon.open_state)."""

    volume: Volume
    fenced: Optional[str] = None          # the mount goes on read-only, this is why
    notes: list[str] = field(default_factory=list)
    lease: Optional[Lease] = None         # the lease this attach made, if it made one

    def undo_blobs(self) -> list[str]:
        """What to delete if the first mount that made the volume fails."""
        if self.lease is None:
            return []
        return [lease_name(self.lease.volume, self.lease.gen),
                f"{SPACE_PREFIX}{self.lease.space:08x}"]


def attach(backend: Backend, index, requested: Optional[str], fs_uuid: bytes) -> Attached:
    """Bring the filesystem (its index) and its volume in the store together,
    at mount, before the filesystem is live. May block.

    - an index that never had a volume (a new filesystem, or one from before
      volumes): the volume `requested` (default: the host name) is made,
      lease 1; a name in use in the store is refused (VolumeInUse);
    - an index recovered from the store (`takeover`): lease gen + 1 is taken,
      naming the head it was recovered from, unless the volume moved on since
      (published again, or taken by another node): refused, recover again;
    - otherwise its own volume: if a newer lease exists, it was taken over
      while this node was away: the mount goes on read-only (`fenced`).
    A store that cannot be reached is fine for the last case only (the fence
    is checked again before every publish)."""
    from . import index as ix                     # the index's encodings are index.py's
    record = ix.get_volume(index)
    if record is not None and requested is not None and requested != record.name:
        raise VolumeInUse(f"this filesystem is volume {record.name} of {backend.url}, not "
                          f"{requested} (a volume keeps its name; mount without volume= or "
                          f"with volume={record.name})")
    if record is None:
        name = requested or default_name()
        state = read_state(backend, name)
        if state.leases:
            raise VolumeInUse(
                f"volume {name} in {backend.url} is in use ({describe(state.holder)}): give "
                f"this filesystem another name (-o volume=NAME), or take {name} over with "
                f"`ckptfs recover SOURCE -o backing={backend.location},volume={name}` on a "
                "SOURCE without an index")
        packs_made = ix.read_counter(index, b"next_pack") > 0
        lease = take(backend, name, 1, fs_uuid, None,
                     space=pack_space(ix.read_counter(index, b"next_pack")) if packs_made
                     else None)
        _record(index, ix.VolumeRecord(name, 1), lease, packs_made)
        return Attached(Volume(backend, name, 1, fs_uuid),
                        notes=[f"new volume {name} in {backend.url}"], lease=lease)
    name = record.name
    if record.takeover:
        state = read_state(backend, name)
        newest = state.newest_valid()
        if state.generation != record.gen:
            raise VolumeInUse(
                f"volume {name} was taken over by {describe(state.holder)} after this "
                "filesystem was recovered from it: remove SOURCE/.ckptfs/index and recover "
                "again to take over its newest state")
        if newest != (record.seen or record.base):
            raise VolumeInUse(
                f"volume {name} published head {_show(newest)} after this filesystem was "
                f"recovered from head {_show(record.base)}: its state is newer; remove "
                "SOURCE/.ckptfs/index and recover again to take over the newest state")
        lease = take(backend, name, record.gen + 1, fs_uuid, record.base)
        _record(index, ix.VolumeRecord(name, lease.gen, record.base), lease, False)
        attached = Attached(Volume(backend, name, lease.gen, fs_uuid),
                            notes=[f"took over volume {name} from {describe(state.holder)} "
                                   f"at head {_show(record.base)} (generation {lease.gen})"])
        # The old holder may have published in the moment before our lease existed:
        # those heads are invalid now (fencing rule); say so.
        late = [h for h in read_state(backend, name).heads
                if h[0] < lease.gen and record.base is not None and h > record.base]
        if late:
            attached.notes.append(f"the old holder published {len(late)} head(s) during the "
                                  "takeover; they are fenced and ignored")
        return attached
    volume = Volume(backend, name, record.gen, fs_uuid)
    try:
        volume.fence()
        try:
            lease = read_lease(backend, name, record.gen)
        except BlobMissing:
            # Gone from the store (restored from an older copy, deleted by hand):
            # this filesystem still holds it, and says so again.
            take(backend, name, record.gen, fs_uuid, record.base,
                 space=pack_space(ix.read_counter(index, b"next_pack")))
            return Attached(volume, notes=[f"lease {record.gen} of volume {name} was missing "
                                           "from the store: made again"])
        if lease.fs_uuid != fs_uuid:
            raise VolumeInUse(f"volume {name} generation {record.gen} in {backend.url} is held "
                              f"by another filesystem ({describe(lease)}): this one may not "
                              "publish there")
    except Fenced as e:
        return Attached(volume, fenced=str(e))
    except VolumeInUse:
        raise
    except CkptfsError as e:
        return Attached(volume, notes=[f"lease of volume {name} not checked ({e}); it is "
                                       "checked again before every publish"])
    return Attached(volume)


def _record(index, record, lease: Lease, keep_counter: bool) -> None:
    """The index's volume record, and its pack counter moved into the lease's space."""
    from . import index as ix

    def write(txn) -> None:
        ix.set_volume(txn, record)
        current = ix.read_counter(txn, b"next_pack")
        if not (keep_counter and pack_space(current) == lease.space):
            ix.write_counters(txn, {b"next_pack": lease.space << SPACE_SHIFT})

    index.write_direct(write)


def _show(head: Optional[HeadKey]) -> str:
    return "none" if head is None else f"{head[0]}-{head[1]}"


# ------------------------------------------------------------- listing

def summary(backend: Backend, name: str) -> dict:
    """`ckptfs volumes`: one volume, as a JSON-able dict. May block."""
    from . import snapshot_format as sf
    state = read_state(backend, name)
    holder = state.holder
    newest = state.newest_valid()
    doc: dict = {"volume": name, "node": holder.node if holder else None,
                 "generation": state.generation,
                 "since": holder.time_ns / 1e9 if holder else None,
                 "head": f"{newest[0]}-{newest[1]}" if newest else None,
                 "published": None, "files": None, "incomplete_files": None,
                 "fenced_heads": len(state.heads) - len(state.valid_heads()),
                 "damaged_leases": state.damaged}
    if newest is not None:
        hname = head_name(*newest)
        view = scope(backend, name)
        try:
            head = sf.decode_volume_head(hname, name, newest, view.read(
                hname, 0, min(view.size(hname), sf.MAX_HEAD_BYTES + 1)))
            doc.update(published=head.time_ns / 1e9, files=head.files,
                       incomplete_files=head.incomplete_files)
        except (BlobMissing, sf.BadObject) as e:
            doc["head_problem"] = str(e)
    return doc
