"""Verification: walk each checkpoint's Merkle tree and decode every object against its hash."""

from __future__ import annotations

from dataclasses import dataclass, field

from cas.errors import CorruptionError


@dataclass
class Problem:
    key: str | None
    step: int | None
    path: str | None
    message: str

    def __str__(self) -> str:
        return str(CorruptionError(self.message, key=self.key, step=self.step, path=self.path))


@dataclass
class VerifyReport:
    checked_checkpoints: list[int] = field(default_factory=list)
    checked_objects: int = 0
    checked_bytes: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged_steps(self) -> list[int]:
        return sorted({p.step for p in self.problems if p.step is not None})


def verify_checkpoints(store, checkpoints) -> VerifyReport:
    """Decode every object reachable from each checkpoint once; report each failure with the
    checkpoint and tensor path that depend on it."""
    report = VerifyReport()
    verdict: dict[bytes, CorruptionError | None] = {}

    def check(key: bytes, step: int, path: str | None) -> bool:
        if key not in verdict:
            try:
                raw = store.objects.get(key)
                report.checked_objects += 1
                report.checked_bytes += raw.size
                verdict[key] = None
            except CorruptionError as exc:
                verdict[key] = exc
        err = verdict[key]
        if err is not None:
            report.problems.append(Problem(err.key, step, path, err.detail))
        return err is None

    for ck in checkpoints:
        report.checked_checkpoints.append(ck.step)
        try:
            for tensor in store.tensors(ck.step):
                for key in tensor["chunks"]:
                    check(key, ck.step, tensor["path"])
        except CorruptionError as exc:  # a manifest node is damaged: the tree cannot be walked
            report.problems.append(Problem(exc.key, ck.step, exc.path, exc.detail))
    return report
