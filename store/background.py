"""Saves that run in the background (Store.save_async): one thread writes them in call order,
at most `max_inflight` at once, each from a host-memory snapshot taken at the call.

A failure is the caller's through the save's future; one that nobody looked at is raised by
the store's next call (save, wait or close) instead of being lost, and one that no call could
see any more (the script ended with the save in flight) is printed to stderr as Python exits.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import sys
import weakref
from typing import Callable

from cas import faults
from cas.pools import Pool

from .registry import Checkpoint
from .staging import StagingArena


class SaveFuture(concurrent.futures.Future):
    """The result of save_async: result() gives the Checkpoint or raises the save's error."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step
        self._observed = False

    def result(self, timeout=None):
        try:
            return super().result(timeout)
        finally:  # seen only once it was done: a result(timeout=...) that timed out saw nothing
            self._observed = self._observed or self.done()

    def exception(self, timeout=None):
        try:
            return super().exception(timeout)
        finally:
            self._observed = self._observed or self.done()

    def cancel(self) -> bool:
        """A save cannot be called off: it commits, or fails, as if never asked (a cancelled
        future said so while the save committed anyway, and broke the next save)."""
        return False

    def unobserved_exception(self) -> BaseException | None:
        if self._observed or not self.done():
            return None
        return super().exception()


class BackgroundSaves:
    """The store's background save thread, its futures and its reused snapshot buffers."""

    def __init__(self, where: str = "") -> None:
        self._executor = Pool(max_workers=1, thread_name_prefix="cas-async")
        self._inflight: list[SaveFuture] = []
        self.steps: set[int] = set()  # steps of saves not finished yet
        self._arenas: list[StagingArena] = []
        self.where = where  # the store, for the report at exit
        _LIVE.add(self)

    def make_room(self, max_inflight: int) -> None:
        """Wait until fewer than `max_inflight` saves are in flight; raise unobserved failures."""
        self.raise_unobserved()
        while len(self._inflight) >= max_inflight:
            concurrent.futures.wait(self._inflight, return_when=concurrent.futures.FIRST_COMPLETED)
            self.raise_unobserved()

    def submit(self, step: int, leaves: list, write: Callable[[], Checkpoint]) -> SaveFuture:
        """Snapshot the tensors of `leaves` into host memory, then run `write` in the background."""
        arena = self._arenas.pop() if self._arenas else StagingArena()
        arena.stage(leaves)
        faults.point("save.staged")
        future = SaveFuture(step)
        self._inflight.append(future)
        self.steps.add(step)

        def run() -> None:
            result, failure = None, None
            try:
                faults.point("save.background_started")
                result = write()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                failure = exc
            finally:  # before the future completes: its waiter may save this step again at once
                for leaf in leaves:
                    leaf.staged = None
                self._arenas.append(arena)
                self.steps.discard(step)
            if failure is None:
                future.set_result(result)
            else:
                future.set_exception(failure)

        self._executor.submit(run)
        return future

    def wait(self) -> None:
        """Block until every save in flight is done."""
        concurrent.futures.wait(list(self._inflight))

    def raise_unobserved(self) -> None:
        """Raise the failures of finished saves that nobody looked at: the first, with the
        others named in its notes (each is raised once)."""
        failures = []
        for future in [f for f in self._inflight if f.done()]:
            self._inflight.remove(future)
            if future.unobserved_exception() is not None:
                failures.append(future.exception())
        if failures:
            first = failures[0]
            for other in failures[1:]:
                first.add_note(f"another background save failed too: {type(other).__name__}: {other}")
            raise first

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
        self._arenas.clear()

    def report_unobserved(self) -> None:
        """Print the failures nobody looked at (at exit: no call of the store can raise them)."""
        for future in list(self._inflight):
            failure = future.unobserved_exception()
            if failure is not None:
                print(f"cas: the background save of step {future.step}{' into ' + self.where if self.where else ''} "
                      f"failed after the script's last call to the store, and that checkpoint was not saved: "
                      f"{type(failure).__name__}: {failure}", file=sys.stderr, flush=True)


_LIVE: "weakref.WeakSet[BackgroundSaves]" = weakref.WeakSet()


@atexit.register
def _report_at_exit() -> None:
    """atexit handlers run after Python joined the pools' threads, so every save of a script
    that ended with saves in flight is done by now; a failure among them was reported nowhere
    (exit code 0, no word)."""
    for saves in list(_LIVE):
        saves.report_unobserved()

