"""DCP's failures as CasErrors: DCP raises its CheckpointException (a BaseException) on every
rank when any rank fails, and a broken process group surfaces as a RuntimeError."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from torch.distributed.checkpoint.api import CheckpointException

from cas.errors import CasError, DistributedCheckpointError


def converted(exc: CheckpointException, what: str) -> CasError:
    """One CasError for a CheckpointException: the first rank's CasError itself when a rank
    raised one (its class says what went wrong), else a DistributedCheckpointError naming all."""
    failures = sorted(exc.failures.items())
    for rank, (err, _) in failures:
        if isinstance(err, CasError):
            err.add_note(f"{what}: raised on rank {rank}")
            return err
    detail = "; ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in failures)
    return DistributedCheckpointError(f"{what} failed ({detail})", {rank: err for rank, (err, _) in failures})


@contextmanager
def as_cas_errors(what: str, own_error: Callable[[], CasError | None] = lambda: None) -> Iterator[None]:
    """Run a dcp.save or dcp.load (`what` names it) so that any failure is a CasError, the same
    on every rank: `own_error()`, this rank's own account of it, when it has one."""
    try:
        yield
    except CheckpointException as exc:
        mine = own_error()
        if mine is not None:
            raise mine from None
        raise converted(exc, what) from None
    except CasError:
        raise
    except Exception as exc:  # a dead peer breaks the process group with a RuntimeError
        raise DistributedCheckpointError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
