"""Progress: the callback type library calls take, and the CLI's bars.

Library calls (export, import, diff, gc, verify) take any `progress(phase, done, total)`
callable, a ProgressCallback (total 0: unknown). ProgressBar is the one the CLI passes: one
tqdm bar per phase on stderr, only when stderr is a terminal and the output is not JSON (tqdm
is imported only when a bar is drawn)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

ProgressCallback = Callable[[str, int, int], None]  # (phase, done, total or 0)


class ProgressBar:
    """A ProgressCallback drawing one tqdm bar per phase (nothing when not enabled)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar = None
        self._phase: str | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if phase != self._phase:
            self.close()
            from tqdm import tqdm

            self._bar = tqdm(desc=phase, total=total or None, file=sys.stderr, leave=False, dynamic_ncols=True)
            self._phase = phase
        if done < self._bar.n or (total or None) != self._bar.total:  # a new pass of the same phase
            self._bar.reset(total=total or None)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar, self._phase = None, None


@contextmanager
def progress_for(args) -> Iterator[ProgressBar]:
    progress = ProgressBar(sys.stderr.isatty() and not getattr(args, "json", False))
    try:
        yield progress
    finally:
        progress.close()
