"""Thread pools that still run work while the interpreter exits.

When a script ends, concurrent.futures stops taking work in every pool before it joins their
threads, so the work already queued runs while any new `submit` raises RuntimeError. A
save_async in flight as a script ended without wait() or close() was queued: it ran, but its
hashing, encoding and writing, submitted to other pools, could not start, and the checkpoint
was lost with no word. Work a Pool cannot queue then runs in the submitting thread instead, so
that save finishes and commits as Python waits for its thread. A pool shut down by its owner
still refuses work.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class Pool(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose `submit` runs the work in the caller once the interpreter is
    exiting (and only then: after its own shutdown() it refuses, as any pool does)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.closed = False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.closed = True
        super().shutdown(wait=wait, cancel_futures=cancel_futures)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        try:
            return super().submit(fn, *args, **kwargs)
        except RuntimeError:
            if self.closed:
                raise
        future: Future = Future()  # the interpreter is exiting: run it here
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the caller sees it through the future, as from a worker
            future.set_exception(exc)
        return future
