"""Leases in a bucket (cas.s3): an object its holder rewrites every ttl/3, judged alive by the
server's clock alone (cas.s3's docstring says why that is the clock to trust)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from email.utils import parsedate_to_datetime

from .errors import ObjectStoreError
from .s3wire import error_code

TTL_META = "cas-lease-ttl"  # user metadata holding the holder's ttl in seconds


class S3Lease:
    """A held lease: a daemon thread rewrites its object every ttl/3, compare-and-swap
    (If-Match) on its own last ETag. `lost` is set when a renewal found the object gone or
    changed (a reaper judged it dead): the holder should stop relying on it."""

    def __init__(self, backend, name: str, key: str, body: bytes, etag: str) -> None:
        self.name, self._backend, self._key, self._body, self._etag = name, backend, key, body, etag
        self.lost = threading.Event()
        self._renewed = time.monotonic()  # (taken or) last renewed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._renew_loop, name=f"cas-lease-{name}", daemon=True)
        self._thread.start()

    def _renew(self, retry) -> bool:
        """Rewrite the lease object if it is still ours (If-Match on our last ETag); False, and
        `lost` set, when another host reaped or took it over."""
        from botocore.exceptions import ClientError

        backend = self._backend
        try:
            self._etag = backend.call(f"renew lease {self.name}", lambda: backend.client.put_object(
                Bucket=backend.bucket, Key=self._key, Body=self._body, IfMatch=self._etag,
                Metadata=lease_metadata(backend.lease_ttl)), retry)["ETag"]
        except ClientError as exc:
            if error_code(exc)[1] in (404, 412):
                self.lost.set()
                return False
            raise
        self._renewed = time.monotonic()
        return True

    def _renew_loop(self) -> None:
        from botocore.exceptions import ClientError

        backend = self._backend
        period = backend.lease_ttl / 3
        retry = replace(backend.retry, total=min(backend.retry.total, period))
        while not self._stop.wait(period):
            try:
                if not self._renew(retry):
                    return
            except (ClientError, ObjectStoreError):
                continue  # not renewed this time; the next period tries again

    def release(self) -> None:
        """Stop renewing and delete the lease object if it is still ours (idempotent). Renewed
        first, compare-and-swap, unless renewed within half a ttl: a holder paused past its ttl,
        whose lease another host took over meanwhile, must not delete the new holder's (an audit
        of stop 36 deleted a successor's gc lock so); once renewed, no one can judge it dead for
        a ttl, far longer than the DELETE."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
        self._thread.join()
        from botocore.exceptions import ClientError

        backend = self._backend
        try:  # renewed within half a ttl (the common case): no one can judge it dead yet
            ours = not self.lost.is_set() and (time.monotonic() - self._renewed < backend.lease_ttl / 2
                                               or self._renew(backend.retry))
        except (ClientError, ObjectStoreError):
            return  # unknown: left to expire in a ttl rather than risk deleting another holder's
        if ours:
            backend.call(f"DELETE lease {self.name}", lambda: backend.client.delete_object(
                Bucket=backend.bucket, Key=self._key))


def lease_metadata(ttl: float) -> dict:
    return {TTL_META: f"{ttl:g}"}


def judge(head: dict, default_ttl: float) -> bool:
    """Whether a lease object's HEAD shows it renewed within its ttl: its LastModified against
    the Date header of the same response, both the server's clock."""
    now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
    try:
        ttl = float(head.get("Metadata", {}).get(TTL_META, default_ttl))
    except ValueError:
        ttl = default_ttl
    return (now - head["LastModified"]).total_seconds() <= ttl
