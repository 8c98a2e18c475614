"""S3Backend: blobs as objects in an S3 bucket (AWS S3, Ceph's RADOS Gateway, MinIO).

    backing=s3://BUCKET/PREFIX

Layout under PREFIX (the whole bucket when there is none):

    ckptfs-store            the marker, the same JSON as LocalBackend's
    <name>                  each committed blob, e.g. packs/ab/<hex>.pack
    .probe-<hex>            `check()`'s write probe, deleted at once (a crash
                            leaves it for `remove_incomplete`)

plus, invisible to listings, the multipart uploads of blobs being written.
The bucket must exist: ckptfs never creates nor deletes a bucket. The marker
is made only by `S3Backend.create` on first use, into an empty prefix; every
other call refuses to work without it, so a bucket or prefix whose objects
were deleted is BackingUnavailable, never silently re-marked and refilled.

Where the endpoint, region and credentials come from: the standard AWS chain,
as the aws CLI and boto3 find them - AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
(/ AWS_SESSION_TOKEN), AWS_PROFILE or the `profile` argument, the shared files
~/.aws/credentials and ~/.aws/config (AWS_SHARED_CREDENTIALS_FILE,
AWS_CONFIG_FILE), web identity, SSO, container and instance metadata; the
endpoint from AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, or `endpoint_url` in the
profile (in its `s3 =` section or at its top); retries from AWS_MAX_ATTEMPTS /
AWS_RETRY_MODE or the profile. Never from the mount options: they show in
/proc/mounts.

The client is botocore, the library under boto3 and the aws CLI: ranged GETs,
the multipart API, retries with exponential backoff and jitter on throttling
(503 SlowDown), 5xx and connection errors ("standard" mode), a pool of
keep-alive connections, one client shared by every thread (botocore clients
are thread-safe), and the whole AWS credential chain above, which is the part
that is hard to get right. Created lazily: the constructor does no I/O.

Writes: a writer buffers up to `part_size_bytes`. A blob that fits is one
PUT at commit; a longer one becomes a multipart upload, each full part sent
as soon as the next byte arrives (so the writer holds one part, never the
whole blob), completed at commit. S3 makes a PUT or a completed upload
visible atomically, whole, under its name, and a replaced name is never seen
half-written. An aborted or failed writer aborts its upload; one that cannot
(the endpoint is gone) leaves it to `remove_incomplete`, which aborts the
uploads under the prefix older than its cutoff.

Create-once (`create_once`: leases, heads): one PUT with If-None-Match: *,
which S3, Ceph RGW (measured on 16.2) and MinIO refuse with 412 when the key
exists. Never a multipart upload (RGW ignores conditions on
CompleteMultipartUpload) and never on a versioned bucket (conditions break
there). A 412 after a retried PUT may be this call's own first attempt: the
object is read back and compared. A server without conditional writes (501)
cannot hold leases: that is an error, never an unconditional PUT.

Reads: one ranged GET per read (a body cut off mid-transfer is read again,
up to 3 times); the answer must be exactly the range asked for.

The rule "a name cannot also be a prefix of other names" (a directory in
LocalBackend) is kept here too, so a store can move between a directory and
a bucket: a writer checks that no parent of its name is a blob (parents seen
holding blobs are remembered) and that nothing lies below its name.

Errors: 404s are BlobMissing once the marker is found, else
BackingUnavailable; a missing bucket, an endpoint that does not answer, and
5xx/SlowDown after the retries are BackingUnavailable; rejected or missing
credentials BackingCredentials; AccessDenied on a write BackingReadOnly (on
a read BackingUnavailable); QuotaExceeded BackingFull; a range past the end
BlobDamaged. Every message names the store (s3://BUCKET/PREFIX), the blob,
and the endpoint when it is about reaching it.

Every call may block (network); all are safe from several threads at once.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
import uuid as uuidlib
from typing import Any, Optional

from ..errors import (AlreadyExists, BackingCredentials, BackingError, BackingFull,
                      BackingReadOnly, BackingUnavailable, BlobDamaged, BlobMissing,
                      InvalidArgument, UsageError)
from .base import (MARKER_NAME, Backend, BlobWriter, UuidLike, as_uuid, marker_body,
                   parse_marker, validate_name, validate_prefix)

log = logging.getLogger(__name__)

SCHEME = "s3://"
DEFAULT_PART_BYTES = 8 << 20         # S3's smallest part is 5 MiB (but the last)
MAX_PARTS = 10_000                   # S3's limit per upload
MAX_KEY_BYTES = 1024                 # S3's limit per key
PROBE_PREFIX = ".probe-"
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_READ_TIMEOUT_S = 20.0
DEFAULT_MAX_ATTEMPTS = 4             # the first try and 3 retries, unless AWS config says
BODY_READ_ATTEMPTS = 3
CONFLICT_ATTEMPTS = 20               # create_once against another conditional write in flight
KNOWN_DIRS_MAX = 4096

_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]$")
_WRITE_OPS = frozenset({"write", "create", "commit", "delete", "check"})
_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})
_CREDENTIALS = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                          "InvalidToken", "TokenRefreshRequired", "InvalidClientTokenId",
                          "AuthorizationHeaderMalformed", "RequestTimeTooSkewed"})
_FULL = frozenset({"QuotaExceeded", "EntityTooLarge", "InsufficientCapacity"})
_OVERLOADED = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
                         "ThrottlingException", "Throttling", "503", "500"})


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of "s3://BUCKET[/PREFIX]"; UsageError with one line if bad.
    The prefix has no leading or trailing "/" and follows the blob name rules."""
    if not url.startswith(SCHEME):
        raise UsageError(f"{url!r} is not an s3://BUCKET/PREFIX url")
    if "@" in url or "?" in url:
        raise UsageError("backing store s3 url: no credentials or parameters in the url "
                         "(they would show in /proc/mounts); use the AWS environment, "
                         "shared files or a profile")
    bucket, _, prefix = url[len(SCHEME):].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise UsageError(f"backing store {url!r}: {bucket!r} is not a valid bucket name "
                         "(3-63 letters, digits, '.', '-'; see the S3 naming rules)")
    prefix = prefix.strip("/")
    if prefix:
        try:
            validate_name(prefix)
        except InvalidArgument as e:
            raise UsageError(f"backing store {url!r}: bad prefix ({e})") from None
    return bucket, prefix


def _code(e: Exception) -> tuple[str, Optional[int], str]:
    """(error code, HTTP status, message) of a botocore ClientError."""
    resp: dict = getattr(e, "response", None) or {}
    err = resp.get("Error") or {}
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(err.get("Code") or status or ""), status, str(err.get("Message") or "")


class S3Backend(Backend):
    """A bucket (and prefix) as a blob store; see the module docstring.

    `profile`: an AWS profile of the shared files (else AWS_PROFILE or the
    default chain). `session`: a botocore session to take everything from
    (tests, embedding). `part_size_bytes`: multipart part size (at least
    5 MiB on AWS; a test server may allow less). Timeouts and attempts apply
    to each request; AWS_MAX_ATTEMPTS / the profile's max_attempts win over
    `max_attempts`.
    """

    def __init__(self, url: str, store_uuid: Optional[UuidLike] = None, *,
                 profile: Optional[str] = None, session: Any = None,
                 part_size_bytes: int = DEFAULT_PART_BYTES,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                 max_pool_connections: int = 32) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.url = f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix \
            else f"{SCHEME}{self.bucket}"
        self._root = self.prefix + "/" if self.prefix else ""
        self.store_uuid = as_uuid(store_uuid)
        if part_size_bytes < 1:
            raise ValueError("part_size_bytes must be positive")
        self.part_size_bytes = part_size_bytes
        self.profile = profile
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_attempts = max_attempts
        self.max_pool_connections = max_pool_connections
        self._session = session
        self.created = False                     # create() wrote the marker
        self._s3: Any = None
        self._lock = threading.Lock()
        self._known_dirs: set[str] = set()       # name prefixes seen holding blobs

    # -- the client -----------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """Where requests go (for messages): resolved when the client is made."""
        s3 = self._s3
        return s3.meta.endpoint_url if s3 is not None else "(the AWS default endpoint)"

    def _client(self) -> Any:
        s3 = self._s3
        if s3 is not None:
            return s3
        with self._lock:
            if self._s3 is None:
                self._s3 = self._make_client()
            return self._s3

    def _make_client(self) -> Any:
        import botocore.session
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError

        try:
            session = self._session
            if session is None:
                session = botocore.session.Session(profile=self.profile)
            retries: dict[str, Any] = {}
            # What the AWS environment or profile says about retries wins.
            if not _configured(session, "retry_mode", "AWS_RETRY_MODE"):
                retries["mode"] = "standard"
            if not _configured(session, "max_attempts", "AWS_MAX_ATTEMPTS"):
                retries["total_max_attempts"] = self.max_attempts
            config = Config(connect_timeout=self.connect_timeout_s,
                            read_timeout=self.read_timeout_s, retries=retries,
                            max_pool_connections=self.max_pool_connections,
                            user_agent_extra="ckptfs")
            return session.create_client("s3", config=config)
        except BotoCoreError as e:
            # ProfileNotFound, a bad endpoint url, a broken config file.
            raise BackingCredentials(f"{self.url}: cannot set up the S3 client from the AWS "
                                     f"configuration: {e}") from e
        except ValueError as e:
            raise BackingUnavailable(f"{self.url}: bad S3 endpoint configuration: {e}") from e

    def _key(self, name: str) -> str:
        key = self._root + name
        if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
            raise InvalidArgument(f"{self.url}: {name}: longer than S3's {MAX_KEY_BYTES}-byte "
                                  "key limit with the prefix")
        return key

    # -- errors -----------------------------------------------------------------------

    def _error(self, e: Exception, op: str, name: Optional[str]) -> BackingError:
        """The project's exception for a botocore error of `op` on blob `name`."""
        from botocore.exceptions import (ClientError, ConnectTimeoutError,
                                         EndpointConnectionError, NoCredentialsError,
                                         PartialCredentialsError, ReadTimeoutError)

        where = f"{self.url}: {name}" if name else self.url
        if isinstance(e, ClientError):
            code, status, message = _code(e)
            detail = f"{code}{': ' + message if message and message != code else ''}"
            if code == "NoSuchBucket":
                return BackingUnavailable(f"{self.url}: backing store unavailable (bucket "
                                          f"{self.bucket} does not exist at {self.endpoint_url})")
            if code in _CREDENTIALS:
                return BackingCredentials(f"{where}: {op}: {self.endpoint_url} rejects the "
                                          f"credentials ({detail}); check the AWS keys, "
                                          "profile or token")
            if code in _FULL:
                return BackingFull(f"{where}: {op}: no room ({detail})")
            if code in ("AccessDenied", "AllAccessDisabled", "403") or status == 403:
                cls = BackingReadOnly if op in _WRITE_OPS else BackingUnavailable
                return cls(f"{where}: {op}: access denied ({detail}) by {self.endpoint_url}")
            if code in _MISSING:
                return BlobMissing(f"{where}: no such blob")
            if code == "InvalidRange" or status == 416:
                return BlobDamaged(f"{where}: {op}: range past the end of the blob")
            if code == "NoSuchUpload":
                return BackingUnavailable(f"{where}: {op}: the multipart upload is gone "
                                          "(aborted by gc, or the store was reset)")
            if code in _OVERLOADED or (status or 0) >= 500:
                return BackingUnavailable(f"{where}: {op}: backing store unavailable: "
                                          f"{self.endpoint_url} answers {detail} "
                                          f"(HTTP {status}) after retries")
            return BackingUnavailable(f"{where}: {op}: {detail} (HTTP {status})")
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return BackingCredentials(f"{self.url}: no usable AWS credentials ({e}): set "
                                      "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile in "
                                      "~/.aws/credentials, or AWS_PROFILE")
        if isinstance(e, (EndpointConnectionError, ConnectTimeoutError)):
            return BackingUnavailable(f"{where}: {op}: backing store unavailable: cannot "
                                      f"reach {self.endpoint_url} ({e})")
        if isinstance(e, ReadTimeoutError):
            return BackingUnavailable(f"{where}: {op}: backing store unavailable: "
                                      f"{self.endpoint_url} did not answer within "
                                      f"{self.read_timeout_s:g} s")
        return BackingUnavailable(f"{where}: {op}: backing store unavailable: {e}")

    def _call(self, op: str, name: Optional[str], method: str, **kw: Any) -> Any:
        """One S3 request with the bucket filled in; errors mapped."""
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            return getattr(self._client(), method)(Bucket=self.bucket, **kw)
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, op, name) from e

    # -- the marker -------------------------------------------------------------------

    @classmethod
    def open(cls, url: str, store_uuid: Optional[UuidLike] = None, *, create: bool = False,
             **kw: Any) -> "S3Backend":
        """The store at `url`; BackingUnavailable unless its marker is there
        (and names `store_uuid`, if given). `create=True` makes it if needed."""
        if create:
            return cls.create(url, store_uuid, **kw)
        backend = cls(url, store_uuid, **kw)
        backend._verify_marker()
        return backend

    @classmethod
    def create(cls, url: str, store_uuid: Optional[UuidLike] = None, **kw: Any) -> "S3Backend":
        """Make a new store under `url` (its marker), or open the one there if
        its marker names `store_uuid` (any uuid when None). The bucket must
        exist; a prefix holding anything else is refused (AlreadyExists).
        Call this only on first use, as `LocalBackend.create`."""
        backend = cls(url, store_uuid, **kw)
        wanted = backend.store_uuid
        found = backend._read_marker()
        if found is None:
            listed = backend._call("create", None, "list_objects_v2", Prefix=backend._root,
                                   MaxKeys=6)
            others = [o["Key"][len(backend._root):] for o in listed.get("Contents", [])]
            if others:
                shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
                raise AlreadyExists(f"{backend.url}: not empty and not a ckptfs store (holds "
                                    f"{shown}); refusing to create a store there")
            new = wanted or uuidlib.uuid4()
            if backend._put_marker(new):
                backend.store_uuid = new
                backend.created = True
                return backend
            found = backend._read_marker()       # another process made it meanwhile
            if found is None:
                raise BackingUnavailable(f"{backend.url}: the store marker came and went "
                                         "while creating the store")
        if wanted is not None and found != wanted:
            raise AlreadyExists(f"{backend.url}: already holds ckptfs store {found}, "
                                f"not {wanted}")
        backend.store_uuid = found
        return backend

    def remove_if_empty(self) -> bool:
        """Undo `create`: delete the marker of a store that holds nothing else
        (a first mount that failed after making it), so the prefix is as it
        was. False, and nothing deleted, if anything else is there."""
        self._verify_marker()
        listed = self._call("delete", None, "list_objects_v2", Prefix=self._root, MaxKeys=2)
        keys = [o["Key"] for o in listed.get("Contents", ())]
        if keys != [self._key(MARKER_NAME)]:
            log.warning("%s: not removing the store marker: the store is not empty", self.url)
            return False
        self._call("delete", None, "delete_object", Key=self._key(MARKER_NAME))
        return True

    def _put_marker(self, new: uuidlib.UUID) -> bool:
        """Write the marker unless one exists (If-None-Match: *, where the
        server supports it); False if another got there first."""
        from botocore.exceptions import BotoCoreError, ClientError
        key = self._key(MARKER_NAME)
        try:
            self._client().put_object(Bucket=self.bucket, Key=key, Body=marker_body(new),
                                      IfNoneMatch="*")
            return True
        except ClientError as e:
            code, status, _ = _code(e)
            if code == "PreconditionFailed" or status == 412:
                return False
            if code != "NotImplemented" and status != 501:
                raise self._error(e, "create", None) from e
        except BotoCoreError as e:
            raise self._error(e, "create", None) from e
        self._call("create", None, "put_object", Key=key, Body=marker_body(new))
        return True

    def _read_marker(self) -> Optional[uuidlib.UUID]:
        """The uuid in the marker, None if there is none; raises when the store
        cannot be asked (missing bucket, endpoint down, credentials)."""
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            resp = self._client().get_object(Bucket=self.bucket, Key=self._key(MARKER_NAME))
            raw = resp["Body"].read()
        except ClientError as e:
            if _code(e)[0] in _MISSING:
                return None
            raise self._error(e, "read marker", None) from e
        except BotoCoreError as e:
            raise self._error(e, "read marker", None) from e
        return parse_marker(raw, self.url)

    def _verify_marker(self) -> uuidlib.UUID:
        found = self._read_marker()
        if found is None:
            raise BackingUnavailable(f"{self.url}: backing store unavailable (no store marker "
                                     f"{MARKER_NAME}: its objects were deleted, or this is not "
                                     "a ckptfs store)")
        if self.store_uuid is None:
            self.store_uuid = found
        elif found != self.store_uuid:
            raise BackingUnavailable(f"{self.url}: holds ckptfs store {found}, "
                                     f"not the expected {self.store_uuid}")
        return found

    # -- names and prefixes -----------------------------------------------------------

    def _exists(self, name: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            self._client().head_object(Bucket=self.bucket, Key=self._key(name))
            return True
        except ClientError as e:
            if _code(e)[0] in _MISSING:
                return False
            raise self._error(e, "stat", name) from e
        except BotoCoreError as e:
            raise self._error(e, "stat", name) from e

    def _note_dirs(self, name: str) -> None:
        parts = name.split("/")[:-1]
        with self._lock:
            if len(self._known_dirs) > KNOWN_DIRS_MAX:
                self._known_dirs.clear()
            for i in range(1, len(parts) + 1):
                self._known_dirs.add("/".join(parts[:i]))

    def _check_blob_not_prefix(self, name: str) -> None:
        """No parent of `name` is a blob and nothing lies below `name`."""
        parts = name.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in self._known_dirs:
                continue
            if self._exists(parent):
                raise InvalidArgument(f"{self.url}: {name}: a parent of this name is a blob "
                                      "(a name cannot be both a blob and a prefix)")
        below = self._call("create", name, "list_objects_v2", Prefix=self._key(name) + "/",
                           MaxKeys=1)
        if below.get("KeyCount") or below.get("Contents"):
            raise InvalidArgument(f"{self.url}: {name}: names a prefix of other blobs "
                                  "(a name cannot be both a blob and a prefix)")

    # -- Backend ----------------------------------------------------------------------

    def writer(self, name: str) -> BlobWriter:
        validate_name(name)
        key = self._key(name)
        self._verify_marker()
        self._check_blob_not_prefix(name)
        return _S3Writer(self, name, key)

    def create_once(self, name: str, data: bytes) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError
        validate_name(name)
        key = self._key(name)
        self._verify_marker()
        for attempt in range(1, CONFLICT_ATTEMPTS + 1):
            try:
                self._client().put_object(Bucket=self.bucket, Key=key, Body=bytes(data),
                                          IfNoneMatch="*")
                self._note_dirs(name)
                return True
            except ClientError as e:
                code, status, _ = _code(e)
                if code == "PreconditionFailed" or status == 412:
                    return self._holds(name, data)
                if code == "ConditionalRequestConflict" or status == 409:
                    # Another conditional write of this key is in flight: see who won.
                    if self._exists(name):
                        return self._holds(name, data)
                    time.sleep(0.05 * attempt)
                    continue
                if code == "NotImplemented" or status == 501:
                    raise BackingUnavailable(
                        f"{self.url}: {name}: {self.endpoint_url} does not support conditional "
                        "writes (If-None-Match), which volume leases need (docs/OPERATIONS.md)"
                    ) from e
                raise self._error(e, "create", name) from e
            except BotoCoreError as e:
                raise self._error(e, "create", name) from e
        raise BackingUnavailable(f"{self.url}: {name}: create: conditional writes of this key "
                                 f"kept conflicting ({CONFLICT_ATTEMPTS} attempts)")

    def _holds(self, name: str, data: bytes) -> bool:
        """Whether blob `name` holds exactly `data` (a create-once made by us)."""
        try:
            size = self.size(name)
            return size == len(data) and self.read(name, 0, size) == bytes(data)
        except BlobMissing:
            return False

    def read(self, name: str, offset: int, length: int) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError
        validate_name(name)
        key = self._key(name)
        if offset < 0 or length < 0:
            raise InvalidArgument(f"{self.url}: {name}: bad range offset={offset} length={length}")
        if length == 0:
            size = self.size(name)
            if offset > size:
                raise BlobDamaged(f"{self.url}: {name}: offset {offset} is past the end of "
                                  f"the blob ({size} bytes)")
            return b""
        rng = f"bytes={offset}-{offset + length - 1}"
        for attempt in range(1, BODY_READ_ATTEMPTS + 1):
            try:
                resp = self._client().get_object(Bucket=self.bucket, Key=key, Range=rng)
            except ClientError as e:
                code, status, _ = _code(e)
                if code in _MISSING:
                    self._verify_marker()
                    raise BlobMissing(f"{self.url}: {name}: no such blob") from None
                if code == "InvalidRange" or status == 416:
                    raise BlobDamaged(f"{self.url}: {name}: range [{offset}, {offset + length}) "
                                      f"goes past the end of the blob ({self.size(name)} "
                                      "bytes)") from None
                raise self._error(e, "read", name) from e
            except BotoCoreError as e:
                raise self._error(e, "read", name) from e
            try:
                data = resp["Body"].read()
                break
            except BotoCoreError as e:           # cut off mid-body: ask again
                if attempt == BODY_READ_ATTEMPTS:
                    raise self._error(e, "read", name) from e
                log.debug("%s: %s: body read failed (%s), reading again", self.url, name, e)
        if "ContentRange" not in resp:           # a server that ignored the range
            data = data[offset:offset + length]
        if len(data) != length:
            total = str(resp.get("ContentRange", "")).rpartition("/")[2] or "?"
            raise BlobDamaged(f"{self.url}: {name}: range [{offset}, {offset + length}) "
                              f"goes past the end of the blob ({total} bytes)")
        return data

    def size(self, name: str) -> int:
        from botocore.exceptions import BotoCoreError, ClientError
        validate_name(name)
        try:
            resp = self._client().head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as e:
            if _code(e)[0] in _MISSING:
                self._verify_marker()
                raise BlobMissing(f"{self.url}: {name}: no such blob") from None
            raise self._error(e, "size", name) from e
        except BotoCoreError as e:
            raise self._error(e, "size", name) from e
        return int(resp["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError
        validate_prefix(prefix)
        self._verify_marker()
        out: list[str] = []
        try:
            pages = self._client().get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._root + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    name = obj["Key"][len(self._root):]
                    if name != MARKER_NAME and _is_blob_name(name):
                        out.append(name)
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, "list", None) from e
        out.sort()
        for name in out[:KNOWN_DIRS_MAX]:
            self._note_dirs(name)
        return out

    def delete(self, name: str) -> None:
        validate_name(name)
        key = self._key(name)
        self._verify_marker()                   # a store that is gone is not "deleted"
        self._call("delete", name, "delete_object", Key=key)

    def free_bytes(self) -> Optional[int]:
        self._verify_marker()
        return None                              # S3 has no free-space call

    def check(self) -> None:
        self._verify_marker()
        probe = self._key(PROBE_PREFIX + secrets.token_hex(8))
        self._call("check", None, "put_object", Key=probe, Body=b"")
        self._call("check", None, "delete_object", Key=probe)

    def remove_incomplete(self, older_than: float = 3600.0) -> int:
        from botocore.exceptions import BotoCoreError, ClientError
        self._verify_marker()
        cutoff = time.time() - older_than
        stale: list[tuple[str, Optional[str]]] = []          # (key, upload id)
        try:
            s3 = self._client()
            for page in s3.get_paginator("list_multipart_uploads").paginate(
                    Bucket=self.bucket, Prefix=self._root):
                for up in page.get("Uploads", ()):
                    if up["Initiated"].timestamp() <= cutoff:
                        stale.append((up["Key"], up["UploadId"]))
            for page in s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=self._root + PROBE_PREFIX):
                for obj in page.get("Contents", ()):
                    if obj["LastModified"].timestamp() <= cutoff:
                        stale.append((obj["Key"], None))
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, "list", None) from e
        removed = 0
        for key, upload_id in stale:
            name = key[len(self._root):]
            try:
                if upload_id is None:
                    s3.delete_object(Bucket=self.bucket, Key=key)
                else:
                    s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except ClientError as e:
                if _code(e)[0] == "NoSuchUpload":
                    continue                     # completed or aborted meanwhile
                raise self._error(e, "delete", name) from e
            except BotoCoreError as e:
                raise self._error(e, "delete", name) from e
            removed += 1
        return removed

    def remove_incomplete_of(self, name: str) -> int:
        """Abort the multipart uploads of `name` still open (a crash mid-upload)."""
        from botocore.exceptions import BotoCoreError, ClientError
        validate_name(name)
        self._verify_marker()
        key = self._key(name)
        removed = 0
        try:
            s3 = self._client()
            for page in s3.get_paginator("list_multipart_uploads").paginate(
                    Bucket=self.bucket, Prefix=key):
                for up in page.get("Uploads", ()):
                    if up["Key"] != key:
                        continue
                    try:
                        s3.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                  UploadId=up["UploadId"])
                        removed += 1
                    except ClientError as e:
                        if _code(e)[0] != "NoSuchUpload":     # finished meanwhile
                            raise
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, "delete", name) from e
        return removed

    def close(self) -> None:
        with self._lock:
            s3, self._s3 = self._s3, None
        if s3 is not None:
            s3.close()

    def incomplete_uploads(self) -> list[str]:
        """Names with a multipart upload in progress (for tests and fsck)."""
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            out = []
            for page in self._client().get_paginator("list_multipart_uploads").paginate(
                    Bucket=self.bucket, Prefix=self._root):
                out += [u["Key"][len(self._root):] for u in page.get("Uploads", ())]
            return out
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, "list", None) from e


def _configured(session: Any, name: str, env_var: str) -> bool:
    """Did the environment or the profile set `name`? (botocore's own default
    for retry_mode is "legacy": only an explicit setting should win over ours)"""
    import os
    if os.environ.get(env_var):
        return True
    try:
        return session.get_scoped_config().get(name) is not None
    except Exception:                            # noqa: BLE001 - ProfileNotFound: reported later
        return False


def _is_blob_name(name: str) -> bool:
    """A listed key that is one of ours: not a probe, not a folder placeholder
    some S3 console made ("dir/"), every component a valid one."""
    try:
        validate_name(name)
        return True
    except InvalidArgument:
        return False


class _S3Writer(BlobWriter):
    """One PUT, or a multipart upload of `part_size_bytes` parts; one thread at a time."""

    def __init__(self, backend: S3Backend, name: str, key: str) -> None:
        self.name = name
        self._backend = backend
        self._key = key
        self._buf = bytearray()
        self._upload_id: Optional[str] = None
        self._parts: list[dict] = []
        self._state = "open"            # open -> committed | aborted
        self.bytes_written = 0

    @property
    def committed(self) -> bool:
        return self._state == "committed"

    def _need_open(self) -> None:
        if self._state != "open":
            raise InvalidArgument(f"{self._backend.url}: {self.name}: writer is {self._state}")

    def write(self, data) -> None:
        self._need_open()
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        part = self._backend.part_size_bytes
        try:
            while mv:
                if len(self._buf) >= part:       # full, and more is coming: send it
                    self._send_part()
                take = mv[:part - len(self._buf)]
                self._buf += take
                mv = mv[len(take):]
                self.bytes_written += len(take)
        except BackingError:
            self.abort()
            raise

    def _send_part(self) -> None:
        b = self._backend
        if len(self._parts) >= MAX_PARTS:
            raise BackingFull(f"{b.url}: {self.name}: more than {MAX_PARTS} parts of "
                              f"{b.part_size_bytes} bytes: too large for one S3 object")
        if self._upload_id is None:
            resp = b._call("write", self.name, "create_multipart_upload", Key=self._key)
            self._upload_id = resp["UploadId"]
        number = len(self._parts) + 1
        resp = b._call("write", self.name, "upload_part", Key=self._key,
                       UploadId=self._upload_id, PartNumber=number, Body=self._buf)
        self._parts.append({"PartNumber": number, "ETag": resp["ETag"]})
        self._buf = bytearray()                  # the sent part is freed with the request

    def commit(self) -> None:
        self._need_open()
        b = self._backend
        try:
            if self._upload_id is None:
                b._call("commit", self.name, "put_object", Key=self._key, Body=self._buf)
            else:
                if self._buf:
                    self._send_part()
                b._call("commit", self.name, "complete_multipart_upload", Key=self._key,
                        UploadId=self._upload_id, MultipartUpload={"Parts": self._parts})
        except BackingError:
            self.abort()
            raise
        self._buf = bytearray()
        self._state = "committed"
        b._note_dirs(self.name)

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        self._buf = bytearray()
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None:
            try:
                self._backend._call("abort", self.name, "abort_multipart_upload", Key=self._key,
                                    UploadId=upload_id)
            except BackingError as e:
                # Gone already (gc), or the store cannot be reached: remove_incomplete
                # aborts it later.
                log.debug("%s: could not abort the upload: %s", self.name, e)

    def __del__(self) -> None:
        try:
            if getattr(self, "_state", None) == "open":
                self.abort()
        except Exception:                        # noqa: BLE001 - never from a finalizer
            pass

    def __repr__(self) -> str:
        return f"<S3BlobWriter {self._backend.url}: {self.name} ({self._state})>"
