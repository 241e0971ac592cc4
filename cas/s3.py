"""The S3 backend: blobs as objects under a key prefix in a bucket (cas.backend's contract).

Works against any S3-compatible server with conditional writes (AWS S3, SeaweedFS), through
boto3, which offers everything the contract needs: obstore, faster per request
(bench/bench_s3_client.py), makes every create-only write a single PUT, shows no response's
Date header, and retries inside, where a retried create-only PUT cannot be told apart. One
client serves every thread (boto3 clients are thread-safe); parallelism is the caller's.

- Create-only writes are `PUT If-None-Match: *` (412 -> False); a 200 is durable. One PUT
  carries any blob (S3 takes 5 GiB in one); a multipart upload completed with
  `If-None-Match: *` is used from `multipart_threshold` bytes only where enabled (see
  MULTIPART_THRESHOLD). Each write carries a random token in its metadata, so that a write
  retried after an ambiguous failure (a reset or timeout after the server stored it)
  recognises its own object behind the 412 and still returns True.
- An object store has no invisible names, so `stage` writes a local spool file (named like
  fsutil.tmp_name: host, pid, owner token) and `publish` uploads it create-only. `replace` is
  refused: nothing in a bucket is replaced in place.
- Retries: 5xx, 503 SlowDown, resets and timeouts are retried with exponential backoff and
  jitter, bounded in tries and total time (RetryPolicy); then one ObjectStoreError subclass
  says which failure it was (cas.errors). A missing bucket and refused credentials are never
  retried.

Leases and clocks. A lease is the object `name` (its bytes: the holder's info), written
create-only and rewritten every ttl/3 by a daemon thread with `If-Match` on its own last ETag
(a renewal that finds it gone or changed marks the lease lost and stops). Its ttl is in its
metadata, so every reader judges it by the holder's ttl. `lease_alive` judges by the server's
clock alone: the object's LastModified (the server's time of the last renewal) against the
Date header of the same HEAD response (the server's time now). No host's clock enters, so
skewed or jumping host clocks cannot make a live lease look dead or a dead one alive. Both are
whole seconds, so an age is known to within a second; a holder is judged dead once the age
exceeds ttl, i.e. after it missed about three renewals. What this cannot see: a holder paused
longer than ttl (a stopped VM) is judged dead while it lives, and learns so only at its next
renewal (`lost`); callers choose ttl well above their pauses.
"""

from __future__ import annotations

import collections
import os
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable, Iterable, Iterator

from .backend import Buffer, Capabilities, Staged
from .errors import (BlobAbsentError, BucketMissingError, CasError, CredentialsError, EndpointUnreachableError,
                     MissingObjectError, ObjectStoreError, ObjectStoreUnavailableError, ReplaceRefusedError)
from .fsutil import OWNER_PREFIX, host_tag, owner_alive, pid_alive, read_head, tmp_owner, unlink_quietly, write_tmp
from .pools import Pool
from .s3lease import S3Lease, judge, lease_metadata
from .s3wire import PartsReader, error_code, read_body

# Off: SeaweedFS 4.48 lets two racing create-only multipart completions both succeed (4 rounds in
# 10), while racing single PUTs of any size had one winner; one PUT takes up to 5 GiB, more than
# MAX_BLOB. Servers whose completion is atomic (AWS S3) may set a threshold (>= 5 MiB).
MULTIPART_THRESHOLD: int | None = None
PART_SIZE = 16 << 20
PART_WORKERS = 4
DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
LEASE_TTL = 60.0  # a writer's lease lasts this long unless renewed; $CAS_S3_LEASE_TTL sets another


def lease_seconds(given: float | None) -> float:
    """A lease ttl: `given`, else $CAS_S3_LEASE_TTL, else LEASE_TTL. A gc waits about this long
    for a save on another host that died (or was paused) before it ends its lease."""
    raw = given if given is not None else os.environ.get("CAS_S3_LEASE_TTL") or LEASE_TTL
    try:
        ttl = float(raw)
    except ValueError:
        raise CasError(f"CAS_S3_LEASE_TTL must be a number of seconds, not {raw!r}") from None
    if not 1.0 <= ttl <= 86400:
        raise CasError(f"a lease ttl of {ttl:g} s is outside 1 s .. 1 day")
    return ttl
FIRST_CONTACT_TRIES = 3  # tries before a server that never answered is called unreachable
_TOKEN_META = "cas-put"  # metadata key of a write's random token
_TMP_TAIL = re.compile(r"\.[A-Za-z0-9-]+\.[0-9]+\.[0-9]+\.[0-9a-f]+\.tmp")  # as in fsutil.tmp_name
_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                               "InvalidToken", "ExpiredToken", "AuthorizationHeaderMalformed"})
_RETRY_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                          "ThrottlingException", "RequestTimeTooSkewed", "OperationAborted"})


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: try `tries` times at most, for `total` seconds at most."""

    tries: int = 8
    first: float = 0.1
    cap: float = 8.0
    total: float = 60.0

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt `attempt` (1-based): half fixed, half random."""
        step = min(self.cap, self.first * (2 ** (attempt - 1)))
        return step / 2 + random.uniform(0, step / 2)


def parse_url(url: str) -> tuple[str, str]:
    """('bucket', 'key/prefix') of `s3://bucket/key/prefix` (the prefix without end slashes)."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise CasError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{1,254}", bucket):
        raise CasError(f"{url!r} names no bucket (s3://BUCKET/PREFIX)")
    return bucket, prefix.strip("/")


def check_name(name: str) -> None:
    """Refuse names the local backend refuses too, so a name works on every backend or none."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if not name or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        raise CasError(f"not a blob name: {name!r}")


class S3Backend:
    """Blobs under `prefix` in `bucket`. Endpoint, region and credentials come from the
    environment as boto3 reads them (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY), unless given here."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None, region: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None, spool_dir: str | None = None,
                 lease_ttl: float | None = None, retry: RetryPolicy = RetryPolicy(),
                 multipart_threshold: int | None = MULTIPART_THRESHOLD, part_size: int = PART_SIZE,
                 connect_timeout: float = 5.0, read_timeout: float = 60.0, max_connections: int = 32) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self._root = f"{self.prefix}/" if self.prefix else ""
        self.capabilities = Capabilities(locks=False, local_path=None, batched_sync=False)
        self.spool_dir = spool_dir or os.path.join(
            os.environ.get("CAS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cas"), "spool")
        self.lease_ttl, self.retry = lease_seconds(lease_ttl), retry
        self.multipart_threshold = None if multipart_threshold is None else max(multipart_threshold, 5 << 20)
        self.part_size = max(part_size, 5 << 20)  # S3's least part
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        config = Config(retries={"total_max_attempts": 1}, connect_timeout=connect_timeout,
                        read_timeout=read_timeout, max_pool_connections=max_connections,
                        request_checksum_calculation="when_required",  # blake3 is the store's end-to-end check
                        response_checksum_validation="when_required")
        session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                                        region_name=region)
        self.client = session.client("s3", endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
                                      config=config)
        self.endpoint = self.client.meta.endpoint_url
        self._bucket_seen = False
        self._ever_answered = False  # whether any request got an answer from the server
        self.requests: collections.Counter = collections.Counter()  # requests sent, by verb (GET, PUT, ...)
        self._count_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options) -> "S3Backend":
        bucket, prefix = parse_url(url)
        return cls(bucket, prefix, **options)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, name: str) -> str:
        check_name(name)
        return self._root + name

    def where(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    # --- requests and their failures --------------------------------------------------------
    def call(self, what: str, fn: Callable, retry: RetryPolicy | None = None):
        """fn() with retries on transient failures; ClientErrors that are answers (404, 412)
        are the caller's; a missing bucket, refused credentials, or failures through every retry
        raise ObjectStoreError subclasses naming which."""
        from botocore.exceptions import (ClientError, ConnectTimeoutError, EndpointConnectionError,
                                         HTTPClientError, IncompleteReadError, NoCredentialsError)

        policy, began, attempt, reachable = retry or self.retry, time.monotonic(), 0, False
        verb = what.split(" ", 1)[0]
        while True:
            attempt += 1
            with self._count_lock:
                self.requests[verb] += 1  # every request sent, retries included (bench/bench_s3.py)
            try:
                answer = fn()
                self._ever_answered = True
                return answer
            except ClientError as exc:
                self._ever_answered = True
                code, status = error_code(exc)
                if code == "NoSuchBucket":
                    raise self._no_bucket() from None
                if status == 403 or code in _CREDENTIAL_CODES:
                    raise CredentialsError(f"{self.url}: the server at {self.endpoint} refused the credentials "
                                           f"({code or status}) for {what}: check AWS_ACCESS_KEY_ID and "
                                           "AWS_SECRET_ACCESS_KEY") from None
                if not ((status >= 500 and status != 501) or status == 429 or code in _RETRY_CODES):
                    raise
                last, reachable = f"{status} {code}".strip(), True
            except NoCredentialsError:
                raise CredentialsError(f"{self.url}: no credentials found (set AWS_ACCESS_KEY_ID and "
                                       "AWS_SECRET_ACCESS_KEY)") from None
            except (EndpointConnectionError, ConnectTimeoutError) as exc:
                last = str(exc)
            except (HTTPClientError, IncompleteReadError) as exc:
                last, reachable = str(exc), True
            pause = policy.delay(attempt)
            spent = time.monotonic() - began
            # a server never reached yet (a wrong endpoint, nothing listening) is said at once,
            # after a few tries; one that answered before gets the whole policy (a restart)
            tries = policy.tries if reachable or self._ever_answered else min(policy.tries, FIRST_CONTACT_TRIES)
            if attempt >= tries or spent + pause > policy.total:
                kind = ObjectStoreUnavailableError if reachable else EndpointUnreachableError
                verb = "kept failing" if reachable else "could not be reached"
                raise kind(f"{self.url}: the server at {self.endpoint} {verb} for {what} ({last}) "
                           f"through {attempt} tries in {spent:.1f} s") from None
            time.sleep(pause)

    def _no_bucket(self) -> BucketMissingError:
        return BucketMissingError(f"{self.url}: the bucket {self.bucket!r} does not exist at {self.endpoint} "
                                  "(NoSuchBucket): create it, or fix the URL")

    def _head(self, key: str, what: str) -> dict | None:
        """HEAD of `key`, None when absent (a HEAD's 404 has no body, so the first one asks
        whether the bucket exists, to tell a missing bucket from a missing key)."""
        from botocore.exceptions import ClientError

        try:
            return self.call(what, lambda: self.client.head_object(Bucket=self.bucket, Key=key))
        except ClientError as exc:
            if error_code(exc)[1] != 404:
                raise self._unexpected(what, exc) from None
        if not self._bucket_seen:
            try:
                self.call("HEAD bucket", lambda: self.client.head_bucket(Bucket=self.bucket))
            except ClientError as exc:
                if error_code(exc)[1] == 404:
                    raise self._no_bucket() from None
                raise self._unexpected("HEAD bucket", exc) from None
            self._bucket_seen = True
        return None

    def _unexpected(self, what: str, exc: Exception) -> ObjectStoreError:
        code, status = error_code(exc)
        return ObjectStoreError(f"{self.url}: the server at {self.endpoint} answered {status} {code} to {what}")

    # --- reads ------------------------------------------------------------------------------
    def get(self, name: str, start: int = 0, length: int | None = None, *, buffer: Buffer | None = None):
        from botocore.exceptions import ClientError

        key = self.key(name)
        if length is not None and length <= 0:
            if self.stat(name) is None:
                raise BlobAbsentError(f"{name} is missing from {self.url}")
            return buffer(1)[:0] if buffer is not None else b""
        ranged = {"Range": f"bytes={start}-{start + length - 1}" if length is not None else f"bytes={start}-"}

        def fetch():
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=key, **(ranged if start or length else {}))
            except ClientError as exc:
                if error_code(exc)[0] == "InvalidRange":  # 416: `start` at or past the end
                    return None
                raise
            return read_body(resp, name, buffer)

        try:
            data = self.call(f"GET {name}", fetch)
        except ClientError as exc:
            if error_code(exc)[1] == 404:
                raise BlobAbsentError(f"{name} is missing from {self.url}") from None
            raise MissingObjectError(f"{self.where(name)} cannot be read: {exc}") from None
        if data is None:
            return buffer(1)[:0] if buffer is not None else b""
        return data

    def stat(self, name: str) -> int | None:
        head = self._head(self.key(name), f"HEAD {name}")
        return None if head is None else int(head["ContentLength"])

    def free_bytes(self) -> None:
        return None

    def list(self, prefix: str) -> list[str]:
        """Names under `prefix` (a plain string prefix of names), every page of ListObjectsV2."""
        return [name for name, _ in self.list_sizes(prefix)]

    def list_sizes(self, prefix: str) -> list[tuple[str, int]]:
        """(name, size) under `prefix`, sorted: a listing says each size, so no HEAD is needed."""
        names, token = [], None
        while True:
            args = {"Bucket": self.bucket, "Prefix": self._root + prefix}
            if token:
                args["ContinuationToken"] = token
            page = self.call(f"LIST {prefix}", lambda: self.client.list_objects_v2(**args))
            for entry in page.get("Contents", ()):
                name = entry["Key"][len(self._root):]
                if all(p not in ("", ".", "..") and not p.startswith(".") for p in name.split("/")):
                    names.append((name, int(entry["Size"])))
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return sorted(names)

    # --- writes -----------------------------------------------------------------------------
    def put_if_absent(self, name: str, parts: Iterable) -> bool:
        reader = PartsReader(parts)
        return self._create(self.key(name), reader.size, lambda: reader)

    def _create(self, key: str, size: int, open_body: Callable[[], IO[bytes]]) -> bool:
        """Create `key` from the body open_body() gives (from its start, each try), never over an
        existing object: one PUT, or a multipart upload at `multipart_threshold` bytes or more."""
        meta = {_TOKEN_META: secrets.token_hex(8)}
        if self.multipart_threshold is not None and size >= self.multipart_threshold:
            body = open_body()
            body.seek(0)
            return self._create_multipart(key, iter(lambda: body.read(self.part_size), b""), meta)
        tries = [0]

        def put():
            tries[0] += 1
            body = open_body()
            body.seek(0)
            return self.client.put_object(Bucket=self.bucket, Key=key, Body=body, ContentLength=size,
                                          IfNoneMatch="*", Metadata=meta)

        return self._created(key, f"PUT {key}", put, tries, meta[_TOKEN_META])

    def _created(self, key: str, what: str, fn: Callable, tries: list, token: str) -> bool:
        """Run a create-only request: True when it created `key`; False on 412, unless an earlier
        try of it may have created the object, and the object is that write's (its token)."""
        from botocore.exceptions import ClientError

        try:
            self.call(what, fn)
            return True
        except ClientError as exc:
            code, status = error_code(exc)
            if status == 412 or code == "PreconditionFailed" or (code == "NoSuchUpload" and tries[0] > 1):
                if tries[0] > 1:
                    head = self._head(key, f"HEAD {key}")
                    return head is not None and head.get("Metadata", {}).get(_TOKEN_META) == token
                return False
            raise self._unexpected(what, exc) from None

    def _create_multipart(self, key: str, pieces: Iterator[bytes], meta: dict) -> bool:
        """Upload the pieces as parts (PART_WORKERS at once, as many in memory), then complete
        create-only; any failure aborts the upload."""
        if self._head(key, f"HEAD {key}") is not None:
            return False  # do not upload a large body only to have its completion refused
        upload = self.call(f"CREATE-MULTIPART {key}", lambda: self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key, Metadata=meta))["UploadId"]
        done = False
        try:
            etags = self._upload_parts(key, upload, pieces)
            tries = [0]

            def complete():
                tries[0] += 1
                return self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload, IfNoneMatch="*",
                    MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]})

            created = self._created(key, f"COMPLETE-MULTIPART {key}", complete, tries, meta[_TOKEN_META])
            done = created
            return created
        finally:
            if not done:
                self._abort(key, upload)

    def _upload_parts(self, key: str, upload: str, pieces: Iterator[bytes]) -> list[str]:
        def part(number: int, data: bytes) -> str:
            return self.call(f"UPLOAD-PART {key} #{number}", lambda: self.client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=number, Body=data))["ETag"]

        with Pool(PART_WORKERS) as pool:
            pending, etags = [], []
            for number, data in enumerate(pieces, 1):
                pending.append(pool.submit(part, number, data))
                if len(pending) >= PART_WORKERS:
                    etags.append(pending.pop(0).result())
            return etags + [f.result() for f in pending]

    def _abort(self, key: str, upload: str) -> None:
        try:
            self.call(f"ABORT-MULTIPART {key}", lambda: self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload), RetryPolicy(tries=2, total=5.0))
        except Exception:  # noqa: BLE001 - best effort: an unfinished upload is invisible garbage
            pass

    def stage(self, name: str, parts: Iterable, *, fsync: bool = False) -> Staged:
        check_name(name)
        os.makedirs(self.spool_dir, exist_ok=True)
        spooled = write_tmp(os.path.join(self.spool_dir, name.rpartition("/")[2]), parts, tmp_dir=self.spool_dir,
                            fsync=fsync)
        return Staged(name, os.path.basename(spooled))

    def publish(self, staged: Staged, *, fsync: bool = False) -> bool:
        """Upload the spool file create-only (fsync does nothing: a 200 is durable); the spool
        file goes once the object is there, and stays when the name was taken."""
        path = self._spooled(staged)
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise MissingObjectError(f"the staged file for {staged.name} cannot be read: {exc}") from None

        with open(path, "rb") as body:
            if not self._create(self.key(staged.name), size, lambda: body):
                return False
        unlink_quietly(path)
        return True

    def replace(self, staged: Staged) -> None:
        raise ReplaceRefusedError(f"{self.where(staged.name)}: an object store never replaces a blob in place")

    def discard(self, staged: Staged) -> None:
        unlink_quietly(self._spooled(staged))

    def staged(self, name: str, token: str) -> Staged:
        """A Staged named by another process: a spool file name stage() gives for `name`, on
        this host (another host's spool is out of reach)."""
        stem = "." + name.rpartition("/")[2]
        if not (isinstance(token, str) and token.startswith(stem) and _TMP_TAIL.fullmatch(token, len(stem))):
            raise CasError(f"{token!r} is not a spool file staged for {name}")
        host = (tmp_owner(token) or (None,))[0]
        if host != host_tag():
            raise CasError(f"{token!r} was staged on host {host}, not this one ({host_tag()}): staged bytes of an "
                           "object store live in the stager's local spool")
        return Staged(name, token)

    def peek(self, staged: Staged, nbytes: int) -> tuple[int, bytes]:
        path = self._spooled(staged)
        try:
            return os.path.getsize(path), read_head(path, nbytes)
        except OSError as exc:
            raise MissingObjectError(f"the staged file for {staged.name} cannot be read: {exc}") from None

    def _spooled(self, staged: Staged) -> str:
        token = staged.token
        if not isinstance(token, str) or "/" in token or not token.startswith("."):
            raise CasError(f"{token!r} is not a spool file name")
        return os.path.join(self.spool_dir, token)

    def sync(self) -> None:
        """Nothing to do: every write and delete was durable when it returned."""

    def delete(self, name: str) -> bool:
        key = self.key(name)
        if self._head(key, f"HEAD {name}") is None:
            return False
        self.call(f"DELETE {name}", lambda: self.client.delete_object(Bucket=self.bucket, Key=key))
        return True

    def delete_many(self, names: Iterable[str]) -> int:
        """Remove many blobs, DELETE_BATCH per request (absent ones are fine); returns how many
        names were sent. ObjectStoreError naming the first key the server would not delete."""
        keys = [self.key(n) for n in names]
        for at in range(0, len(keys), DELETE_BATCH):
            batch = {"Objects": [{"Key": k} for k in keys[at:at + DELETE_BATCH]], "Quiet": True}
            answer = self.call(f"DELETE {len(batch['Objects'])} objects", lambda: self.client.delete_objects(
                Bucket=self.bucket, Delete=batch))
            errors = answer.get("Errors") or []
            if errors:
                first = errors[0]
                raise ObjectStoreError(f"{self.url}: {len(errors)} objects were not deleted, first "
                                       f"{first.get('Key')} ({first.get('Code')}: {first.get('Message')})")
        return len(keys)

    def move(self, name: str, new_name: str) -> bool:
        """Copy create-only (CopyObject If-None-Match: *), then delete the source: False, and
        nothing changed, when `new_name` is taken; BlobAbsentError when `name` is absent."""
        src, dest = self.key(name), self.key(new_name)
        head = self._head(src, f"HEAD {name}")
        if head is None:
            raise BlobAbsentError(f"{name} is missing from {self.url}")
        token, tries = secrets.token_hex(8), [0]

        def copy():
            tries[0] += 1
            return self.client.copy_object(
                Bucket=self.bucket, Key=dest, CopySource={"Bucket": self.bucket, "Key": src},
                CopySourceIfMatch=head["ETag"], IfNoneMatch="*", MetadataDirective="REPLACE",
                Metadata={_TOKEN_META: token})

        if not self._created(dest, f"COPY {name} -> {new_name}", copy, tries, token):
            return False
        self.call(f"DELETE {name}", lambda: self.client.delete_object(Bucket=self.bucket, Key=src))
        return True

    # --- leases and spool files -------------------------------------------------------------
    def lease(self, name: str, info: bytes) -> "S3Lease":
        """Take lease `name`: create it holding `info`, and renew it every ttl/3 until release."""
        from botocore.exceptions import ClientError

        key, body = self.key(name), bytes(info)
        try:
            etag = self.call(f"PUT lease {name}", lambda: self.client.put_object(
                Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*", Metadata=lease_metadata(self.lease_ttl)))["ETag"]
        except ClientError as exc:
            if error_code(exc)[1] == 412:
                raise CasError(f"lease {name} exists already in {self.url}") from None
            raise self._unexpected(f"PUT lease {name}", exc) from None
        return S3Lease(self, name, key, body, etag)

    def take_over_lease(self, name: str, info: bytes) -> "S3Lease | None":
        """Take lease `name` from a holder that stopped renewing it past its ttl, in one
        compare-and-swap on the ETag judged dead (If-Match): of two hosts taking it over at
        once one wins, and the old holder's next renewal fails and sets its `lost`. None when
        the lease lives, is absent, or another host took it first. (Judging it dead, deleting
        it and creating it anew let a second host, between the first's judgement and delete,
        delete the lease the first had just taken: two gc epochs at once.)"""
        from botocore.exceptions import ClientError

        key, body = self.key(name), bytes(info)
        head = self._head(key, f"HEAD lease {name}")
        if head is None or judge(head, self.lease_ttl):
            return None
        try:
            etag = self.call(f"PUT lease {name} over its dead holder's", lambda: self.client.put_object(
                Bucket=self.bucket, Key=key, Body=body, IfMatch=head["ETag"],
                Metadata=lease_metadata(self.lease_ttl)))["ETag"]
        except ClientError as exc:
            if error_code(exc)[1] in (404, 412):
                return None
            raise self._unexpected(f"PUT lease {name}", exc) from None
        return S3Lease(self, name, key, body, etag)

    def lease_alive(self, name: str) -> bool | None:
        """None when absent; else whether its last renewal is within its ttl, by the server's
        clock: LastModified against the same response's Date header (module docstring)."""
        head = self._head(self.key(name), f"HEAD lease {name}")
        return None if head is None else judge(head, self.lease_ttl)

    def clean_tmp(self) -> int:
        """Remove spool files of this host's writers that are provably gone (their owner file's
        lock can be taken; pid gone for names without an owner), then their owner files."""
        try:
            names = os.listdir(self.spool_dir)
        except FileNotFoundError:
            return 0
        host, removed = host_tag(), 0
        for name in names:
            owner = tmp_owner(name)
            if owner is None or owner[0] != host:
                continue
            _, pid, token = owner
            if (not pid_alive(pid)) if token is None else owner_alive(self.spool_dir, host, pid, token) is False:
                unlink_quietly(os.path.join(self.spool_dir, name))
                removed += 1
        for name in names:
            parts = name[len(OWNER_PREFIX):].split(".") if name.startswith(OWNER_PREFIX) else []
            if len(parts) == 3 and parts[0] == host and parts[1].isdigit() and owner_alive(
                    self.spool_dir, host, int(parts[1]), parts[2]) is False:
                unlink_quietly(os.path.join(self.spool_dir, name))
        return removed
