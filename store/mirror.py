"""The mirror: every committed checkpoint of a store pushed to a second store in the background.

What is mirrored is the store's truth, not this process's memory: a push that committed in the
mirror is followed by a `set mirrored` entry in the local record log. The queue is therefore
the registry itself: every checkpoint not yet mirrored, in commit order, so a crash before a
push (or a store opened with mirror= for the first time) is pushed at the next open. One thread
pushes, one checkpoint at a time; a failed push is retried with capped exponential backoff and
reported (a warning once per failure, and `status()`), never raised into a save. The local copy
is never touched: local retention keeps every checkpoint not yet mirrored (cas.gc).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cas.errors import CasError, CheckpointExistsError, CheckpointNotFoundError

from .opening import open_or_create
from .registry import Checkpoint
from .transfer import copy_checkpoints

if TYPE_CHECKING:
    from .store import CheckpointStore

FIRST_RETRY = 0.5  # seconds before the first retry of a failed push; doubled each time ...
MAX_RETRY = 30.0  # ... up to this
CLOSE_TIMEOUT = 60.0  # how long close() waits for pending pushes by default


@dataclass(frozen=True)
class MirrorStatus:
    destination: str
    pending: list[int]  # steps committed here and not yet mirrored, in commit order
    last_error: str | None  # the last failed push, until one succeeds
    failures: int  # failed pushes since the last success
    refused: list[int]  # steps the mirror holds as another checkpoint: never retried
    pushed: int  # checkpoints this open store pushed

    def to_json(self) -> dict:
        return dict(vars(self))


class Mirror:
    """The background pusher of one open store to `destination` (a path or URL)."""

    def __init__(self, store: "CheckpointStore", destination: str | os.PathLike, *,
                 close_timeout: float = CLOSE_TIMEOUT, first_retry: float = FIRST_RETRY,
                 max_retry: float = MAX_RETRY) -> None:
        self.store = store
        self.destination = os.fspath(destination)
        if store.readonly:
            raise CasError(f"the store at {store.path} is open read-only: it cannot record what its mirror holds; "
                           "open it writable to use mirror=")
        if "://" not in self.destination and os.path.abspath(self.destination) == os.path.abspath(store.path):
            raise CasError(f"mirror={self.destination!r} is the store itself; give another store's path or URL")
        self.close_timeout, self.first_retry, self.max_retry = close_timeout, first_retry, max_retry
        self._cond = threading.Condition()
        self._wake = True  # push what is pending from the start (a crash before a push, say)
        self._busy = False
        self._stopping = False
        self._dest: "CheckpointStore | None" = None  # opened by the thread, when it first pushes
        self._refused: set[tuple[int, str]] = set()
        self._last_error: str | None = None
        self._failures = 0
        self._attempts = 0  # push rounds finished, failed or not
        self._pushed = 0
        self._thread = threading.Thread(target=self._run, name="cas-mirror", daemon=True)
        self._thread.start()

    # --- what callers use ------------------------------------------------------------------
    def notify(self) -> None:
        """A checkpoint was committed: push it now (after what is pending before it)."""
        with self._cond:
            self._wake = True
            self._cond.notify_all()

    def pending(self) -> list[Checkpoint]:
        """The checkpoints not yet mirrored, in commit order (the registry says)."""
        with self._cond:
            refused = set(self._refused)
        cks = [ck for ck in self.store.checkpoints() if not ck.mirrored and (ck.step, ck.id) not in refused]
        return sorted(cks, key=lambda ck: (ck.seq, ck.step))

    def status(self) -> MirrorStatus:
        with self._cond:
            refused = sorted(step for step, _ in self._refused)
            return MirrorStatus(self.destination, [ck.step for ck in self.pending()], self._last_error,
                                self._failures, refused, self._pushed)

    def wait(self, timeout: float | None = None) -> bool:
        """Retry now, and block until nothing is pending (True) or `timeout` seconds passed
        (False). Without a timeout it waits for a mirror that is down to come back."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._wait_until(deadline, give_up_on_failure=False)

    def close(self, timeout: float | None = None) -> list[int]:
        """Push what is pending while pushes succeed, for at most `timeout` seconds (the
        close_timeout given at open by default), then stop; returns the steps left unpushed
        (they stay here, unmirrored, and are pushed at the next open with mirror=)."""
        bound = self.close_timeout if timeout is None else timeout
        try:
            self._wait_until(time.monotonic() + bound, give_up_on_failure=True)
        finally:
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            self._thread.join(max(bound, 1.0))
        try:
            return [ck.step for ck in self.pending()]
        except CasError:
            return []

    # --- the thread ------------------------------------------------------------------------
    def _wait_until(self, deadline: float | None, *, give_up_on_failure: bool) -> bool:
        with self._cond:
            self._wake = True
            self._cond.notify_all()
            failures, attempts = self._failures, self._attempts
            while True:
                if not self._busy and not self._wake and self._attempts > attempts and not self.pending():
                    return True
                if give_up_on_failure and self._failures > failures:
                    return False
                if not self._thread.is_alive():
                    return not self.pending()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)

    def _run(self) -> None:
        retry_at: float | None = None
        delay = self.first_retry
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._wake or
                               (retry_at is not None and time.monotonic() >= retry_at)):
                        self._cond.wait(None if retry_at is None else max(retry_at - time.monotonic(), 0))
                    if self._stopping:
                        return
                    self._wake, self._busy = False, True
                try:
                    self._push_pending()
                except Exception as exc:  # noqa: BLE001 - any failure is retried, never raised into a save
                    retry_at, delay = time.monotonic() + delay, min(delay * 2, self.max_retry)
                    self._failed(exc)
                else:
                    retry_at, delay = None, self.first_retry
                    with self._cond:
                        self._failures, self._last_error = 0, None
                finally:
                    with self._cond:
                        self._busy = False
                        self._attempts += 1
                        self._cond.notify_all()
        finally:
            self._close_dest()

    def _push_pending(self) -> None:
        """Push every pending checkpoint in commit order, recording each as mirrored once its
        push committed in the mirror."""
        while not self._stopping:
            pending = self.pending()
            if not pending:
                return
            ck = pending[0]
            try:
                report = copy_checkpoints(self.store, self._open_dest(), [ck.step], why="mirror")
            except CheckpointNotFoundError:
                continue  # removed meanwhile: nothing to push
            except CheckpointExistsError as exc:
                with self._cond:
                    self._refused.add((ck.step, ck.id))
                warnings.warn(f"cas: checkpoint {ck.step} is not pushed to the mirror {self.destination}: {exc}; "
                              "it stays here, unmirrored", RuntimeWarning, stacklevel=2)
                continue
            for pushed in report.copied + report.already_there:
                if self.store.set_mirrored(pushed) is not None:
                    with self._cond:
                        self._pushed += 1

    def _open_dest(self) -> "CheckpointStore":
        if self._dest is None:
            self._dest = open_or_create(self.destination, chunk_size=self.store.chunk_size, like=self.store)
        return self._dest

    def _failed(self, exc: Exception) -> None:
        """Report a failed push: a warning when pushes start failing or fail otherwise than
        before, and the status. The mirror store is opened again at the next try."""
        message = f"{type(exc).__name__}: {exc}"
        self._close_dest()
        if message != self._last_error and not self._stopping:  # warned before it is counted
            warnings.warn(f"cas: pushing to the mirror {self.destination} failed ({message}); the checkpoints stay "
                          "here and the push is retried", RuntimeWarning, stacklevel=2)
        with self._cond:
            self._failures += 1
            self._last_error = message

    def _close_dest(self) -> None:
        dest, self._dest = self._dest, None
        if dest is not None:
            try:
                dest.close()
            except Exception:  # noqa: BLE001 - a broken mirror's close; it is reopened at the next try
                pass
