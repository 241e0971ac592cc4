"""How a Store reads checkpoints back: readers, load, restore into live objects, and the
fallback to the newest checkpoint that reads whole. A mixin of CheckpointStore (store/store.py),
which resolves steps, keeps the cache and owns the pools these use.
"""

from __future__ import annotations

import warnings
from typing import Callable

from cas import faults
from cas.errors import CheckpointNotFoundError, CorruptionError

from .lazytorch import torch
from .reader import CheckpointReader
from .registry import Checkpoint
from .restore import RestoredState, first_sound, restore as restore_targets
from .tree import walk_value
from .verify import record_damage, verify_checkpoints


class Loading:
    """CheckpointStore's reads (see the module docstring)."""

    def reader(self, step: int | None = None) -> CheckpointReader:
        """A reader of checkpoint `step` (the latest when None), resolved now: it reads that
        checkpoint even if the step is replaced meanwhile."""
        self._check_open()
        return CheckpointReader(self.objects, self.resolve(step), pool=self._read_pool, window=4 * self._workers,
                                record_damage=lambda keys, by: record_damage(self, keys, by))

    def load(self, step: int | None = None, *, keys=None, device: str | torch.device | None = None,
             fallback: bool = False):
        """Load a checkpoint's state (the latest when `step` is None); with `keys`, only those
        top-level entries are read. Every byte is checked against its hash.

        fallback=True: when that checkpoint is damaged (CorruptionError), load the newest one
        committed before it that reads whole instead, with a RuntimeWarning naming the steps
        skipped and why; a dict state comes back as a RestoredState, whose `checkpoint` and
        `skipped` say the same. No damaged byte is ever returned."""
        target = None if device is None else _target_device(device)

        def read(ck: Checkpoint):
            return self.reader(ck.step).materialize(keys)

        if fallback:
            state, ck, skipped = self._fallback(step, read)
            state = RestoredState(state, ck, skipped) if isinstance(state, dict) else state
        else:
            reader = self.reader(step)
            faults.point("load.resolved")
            state = self._unless_removed(reader.checkpoint, lambda: reader.materialize(keys))
        if target is not None:
            moved = walk_value(state, lambda t, _: t.to(target), match=torch.Tensor)
            state = RestoredState(moved, state.checkpoint, state.skipped) if isinstance(state, RestoredState) else moved
        return state

    def restore(self, targets: dict, *, step: int | None = None, fallback: bool = False) -> RestoredState:
        """Restore stateful objects in place (model, optimizer, scheduler, scaler, sampler,
        cas.RNGState, ...) from a checkpoint (the latest when `step` is None).

        Returns the checkpoint's top-level entries (a RestoredState: a dict, with `checkpoint`
        saying which one), with each stateful target in place of its state dict. Tensors are
        decoded straight into the targets' own tensors where dtype and shape match, so no second
        full copy of a model is held; memory two entries share (tied weights) is decoded into
        once, the other entry through load_state_dict. Only verified bytes are written into a
        target. Modules are checked against the checkpoint first and restored last, after every
        other target accepted its state: a module that does not fit (StateMismatchError) or
        another target that refuses its state leaves the modules as they were. A damaged object
        (CorruptionError) stops the restore with the targets partly restored, each chunk either
        as it was or as the checkpoint holds it.

        fallback=True (a resume that must go on): restore the newest checkpoint, from `step` (the
        latest) back in commit order, that verifies whole. Each is verified before any byte of
        it reaches a target, so a damaged one leaves the targets untouched (the one restored is
        read twice: verified, then decoded). A RuntimeWarning and the result's `skipped` name the
        steps passed over and why; when none verifies, CorruptionError names them all."""
        if not fallback:
            reader = self.reader(step)
            restored = self._unless_removed(reader.checkpoint, lambda: restore_targets(reader, targets))
            return _restored(restored, reader.checkpoint, [])

        def verified_restore(ck: Checkpoint):
            report = verify_checkpoints(self, [ck])
            if not report.ok:
                more = f" (and {len(report.problems) - 1} more problems)" if len(report.problems) > 1 else ""
                raise CorruptionError(f"{report.problems[0]}{more}")
            return restore_targets(self.reader(ck.step), targets)

        return _restored(*self._fallback(step, verified_restore))

    def _unless_removed(self, ck: Checkpoint, read: Callable[[], object]):
        """`read()` of checkpoint `ck`; when it fails for a missing or damaged object and `ck`
        is no longer committed (retention or a gc of another process or host removed it, or a
        save replaced it, while it was being read), CheckpointNotFoundError says so instead."""
        try:
            return read()
        except CorruptionError as exc:
            self._see_other_commits()
            with self.index.read() as txn:
                now = self.registry.get(txn, ck.step)
            if now is None or now.id != ck.id:
                raise CheckpointNotFoundError(
                    f"checkpoint step {ck.step} of {self.path} was {'removed' if now is None else 'replaced'} "
                    f"while it was being read ({exc})") from exc
            raise

    def _fallback(self, step: int | None, attempt: Callable[[Checkpoint], object]):
        """first_sound over checkpoint `step` (the latest) and those committed before it, newest
        first; warns when it skipped any."""
        first = self.resolve(step)
        older = sorted((ck for ck in self.checkpoints() if (ck.seq, ck.step) < (first.seq, first.step)),
                       key=lambda ck: (ck.seq, ck.step), reverse=True)
        value, ck, skipped = first_sound([first, *older], attempt, self.path)
        if skipped:
            warnings.warn(f"cas: using checkpoint step {ck.step} of {self.path}, the newest that reads whole; "
                          f"skipped {len(skipped)} damaged (newest first): "
                          + "; ".join(f"step {s.step}: {s.reason}" for s in skipped), RuntimeWarning, stacklevel=3)
        return value, ck, skipped


def _restored(entries, checkpoint: Checkpoint, skipped: list) -> RestoredState:
    """restore()'s result; a state whose top is not a dict (restored with no targets) as it is."""
    return RestoredState(entries, checkpoint, skipped) if isinstance(entries, dict) else entries


def _target_device(device) -> torch.device:
    """load()'s `device`, checked before any byte is read: a typo, or a device this torch has no
    backend or GPU for, is refused naming it (not torch's own error after the whole read)."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a str, an int or a torch.device, got {type(device).__name__} {device!r}")
    try:
        target = torch.device(device)
        torch.empty(0, device=target)  # "cuda" on a CPU-only torch, "cuda:7" on a host with one GPU
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise ValueError(f"cannot load onto device {device!r}: {exc}") from None
    return target
