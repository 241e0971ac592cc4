"""Changes to the registry: deleting checkpoints (by hand or by retention) and setting their
flags (milestone, pin, mirrored), each one record log entry. A mixin of CheckpointStore
(store/store.py), which sets the attributes it uses."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from cas.errors import CasError

from .registry import Checkpoint, remove_change, set_change


class RegistryChanges:
    def delete(self, steps) -> list[Checkpoint]:
        """Delete checkpoints (a step, or several in one transaction) from the registry; pinned
        ones are refused. Their objects stay until gc finds them unreferenced."""
        steps = _steps_of(steps)
        self._check_writable("delete checkpoints")

        def named(txn) -> list[Checkpoint]:
            gone = [self.registry.require(txn, step) for step in dict.fromkeys(steps)]
            pinned = [ck.step for ck in gone if ck.pinned]
            if pinned:
                raise CasError(f"checkpoint(s) {pinned} are pinned (a legal hold); unpin them first")
            return gone
        return self._remove("delete", named)

    def delete_chosen(self, choose: Callable[[list[Checkpoint]], list[int]]) -> list[Checkpoint]:
        """Remove the checkpoints that `choose` picks from the registry as it reads inside this
        one write transaction (gc's retention: a decision on an earlier read removed a checkpoint
        made a milestone since, and failed on one another gc had removed). Pinned ones stay."""
        self._check_writable("remove checkpoints")

        def chosen(txn) -> list[Checkpoint]:
            cks = self.registry.all(txn)
            picked = set(choose(cks))
            return [ck for ck in cks if ck.step in picked and not ck.pinned]
        return self._remove("retention", chosen)

    def _remove(self, why: str, pick: Callable[[object], list[Checkpoint]]) -> list[Checkpoint]:
        """Remove the checkpoints `pick(txn)` names in one log entry, picked again on the
        registry as it stands at each try to append (Registry.commit), after catching up with
        other hosts' commits (committed on its own: a refusal keeps what it caught up)."""
        self._see_other_commits()
        gone: list[Checkpoint] = []

        def plan(txn) -> list[dict]:
            gone[:] = pick(txn)
            return [remove_change(ck) for ck in gone]
        with self.index.write() as txn:
            if self.registry.commit(txn, why, plan):
                self.index.bump_generation(txn)
        return gone

    def set_milestone(self, step: int, flag: bool = True) -> Checkpoint:
        return self._update(step, "milestone" if flag else "unmilestone", milestone=bool(flag))

    def set_pinned(self, step: int, flag: bool = True) -> Checkpoint:
        """A pinned checkpoint cannot be deleted, by hand or by any retention rule."""
        return self._update(step, "pin" if flag else "unpin", pinned=bool(flag))

    def set_mirrored(self, ck: Checkpoint) -> Checkpoint | None:
        """Record that checkpoint `ck` is in this store's mirror (one record log entry, so the
        store, not a process's memory, says what is mirrored). None when that checkpoint is gone
        or its step was saved again meanwhile: nothing is recorded."""
        self._check_writable(f"record checkpoint {ck.step} as mirrored")
        with self.index.write() as txn:
            current = self.registry.get(txn, ck.step)
            if current is None or current.id != ck.id:
                return None
            if not current.mirrored:
                self.registry.commit(txn, "mirrored", [set_change(current, mirrored=True)])
        return dataclasses.replace(current, mirrored=True)

    def _update(self, step: int, why: str, **flags: bool) -> Checkpoint:
        """Change a checkpoint's flags: one record log entry, so the change outlives the cache."""
        self._check_writable(f"change checkpoint {step}")
        self._see_other_commits()
        with self.index.write() as txn:
            ck = self.registry.require(txn, step)
            self.registry.commit(txn, why, [set_change(ck, **flags)])
        return dataclasses.replace(ck, **flags)


def _steps_of(steps) -> list:
    """delete()'s steps: one int or an iterable of them (a str, a float or None is neither, and
    a str's characters are no steps)."""
    if type(steps) is int:
        return [steps]
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
        raise TypeError(f"steps must be a step (an int) or a list of steps, got {type(steps).__name__} {steps!r}")
    return list(steps)
