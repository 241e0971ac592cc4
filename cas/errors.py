"""Every error `cas` raises on purpose derives from `CasError`.

Messages name the thing that is wrong (the store path, the step, the object key, the tensor
path) and, where there is one, what to do instead.
"""

from __future__ import annotations


class CasError(Exception):
    """Base of every error we raise on purpose."""


class NotAStoreError(CasError):
    """The path exists but holds no store (and is not an empty folder we may create one in)."""


class FormatVersionError(CasError):
    """The store, or one of its records, was written by a format version we do not read."""


class ReadOnlyStoreError(CasError):
    """A write was asked of a store opened read-only."""


class CheckpointNotFoundError(CasError, KeyError):
    """No committed checkpoint has that step."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CheckpointExistsError(CasError, RuntimeError):
    """A checkpoint with that step is already committed and the save did not ask to replace it
    (a RuntimeError too, as DCP's FileSystemWriter(overwrite=False) raises)."""


class StateMismatchError(CasError, ValueError):
    """A restore target does not fit the checkpoint (tensor names or shapes differ, as
    load_state_dict would refuse): nothing was restored."""


class UnresumableStateError(CasError):
    """A value of the state cannot be saved so that a resume continues exactly where the run is
    (a sampler whose position runs ahead of the training loop); nothing was saved."""


class StoreWriteError(CasError):
    """Writing to the store failed (a full disk, say); nothing of that save was committed."""


class IndexReplacedError(StoreWriteError):
    """The index files were deleted or replaced while this process had them open: a change
    made in them would reach no other process, so nothing of it was committed; the store's
    next operation opens the index at the path again."""


class UnsupportedFilesystemError(StoreWriteError):
    """The store's filesystem cannot publish a file without possibly replacing another writer's
    (neither renameat2 RENAME_NOREPLACE nor hard links): writes are refused rather than raced."""


class RetentionRefusedError(CasError):
    """A policy that cannot be applied safely to these checkpoints; nothing was removed."""


class StoreClosedError(CasError):
    """The store was used after close()."""


class DistributedCheckpointError(CasError):
    """A DCP save or load failed on some rank (or its process group broke). `failures` maps each
    failing rank to its exception, when DCP reported them."""

    def __init__(self, message: str, failures: dict | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


class CorruptionError(CasError):
    """Stored bytes are missing or do not match their hash. Never returned as data.

    Carries the object key (hex) and, when known, the checkpoint step and tensor path that
    depend on it, so a report can say what is lost.
    """

    def __init__(self, message: str, *, key: str | None = None, step: int | None = None,
                 path: str | None = None) -> None:
        self.detail = message
        self.key = key
        self.step = step
        self.path = path
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.step is not None:
            where.append(f"checkpoint step {self.step}")
        if self.path:
            where.append(f"tensor {self.path!r}")
        if self.key:
            where.append(f"object {self.key}")
        return f"{self.detail} ({', '.join(where)})" if where else self.detail

    def located(self, *, step: int | None = None, path: str | None = None) -> "CorruptionError":
        """Return the same error with the checkpoint and tensor it was found under filled in."""
        err = type(self)(self.detail, key=self.key,
                         step=self.step if self.step is not None else step,
                         path=self.path or path)
        return err


class IndexDamagedError(CorruptionError):
    """The LMDB index, a cache of the store, is damaged (LMDB found a bad page, or a record does
    not parse); `cas repair` rebuilds it from the store's objects and record log."""


class MissingObjectError(CorruptionError):
    """An object that a checkpoint references is not in the store."""


class BlobAbsentError(MissingObjectError):
    """A backend has no blob under the name asked for (as opposed to one it cannot read)."""


class ObjectStoreError(CasError):
    """An object store (an S3 bucket) refused or could not serve a request. `reason` says which
    failure it is, for callers that act on it (the CLI's one-line message, retries upstream):
    'bucket', 'credentials', 'unreachable', 'unavailable' or 'replace'."""

    reason = "unavailable"


class BucketMissingError(ObjectStoreError):
    """The bucket does not exist (NoSuchBucket): create it, or fix the URL."""

    reason = "bucket"


class CredentialsError(ObjectStoreError):
    """The server refused the credentials (403: InvalidAccessKeyId, SignatureDoesNotMatch,
    AccessDenied) or there were none to send."""

    reason = "credentials"


class EndpointUnreachableError(ObjectStoreError):
    """No connection could be made to the endpoint (refused, no such host, timed out), however
    often it was retried."""

    reason = "unreachable"


class ObjectStoreUnavailableError(ObjectStoreError):
    """The server kept failing (5xx, 503 SlowDown, connections reset) through every retry."""

    reason = "unavailable"


class ReplaceRefusedError(ObjectStoreError):
    """An object store never replaces a blob in place: the store layer must not ask it to."""

    reason = "replace"


class StoreKeyError(CasError):
    """Base of the key errors of an encrypted store (cas/crypt.py)."""


class KeyRequiredError(StoreKeyError):
    """An encrypted store was opened without a key (key=, or $CAS_KEY_FILE for the CLI)."""


class WrongKeyError(StoreKeyError):
    """No key of an encrypted store matches the one given (a wrong key, or one removed)."""


class NotEncryptedError(StoreKeyError):
    """A key was given for a store that is not encrypted (nothing would protect its data)."""


class KeyRemovalRefusedError(StoreKeyError):
    """`cas key remove` of the last key, or of the key the store was opened with."""


class KeyFileError(StoreKeyError):
    """A key file ($CAS_KEY_FILE, --new-key-file) that cannot be taken as a key: too long to be
    read whole (a key cut short would be another key)."""


class DuplicateKeyError(StoreKeyError):
    """`cas key add` of a key that already opens the store: a second id for it would survive
    `cas key remove` of the first, and the key would not be revoked."""
