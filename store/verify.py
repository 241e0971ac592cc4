"""Verification: walk each checkpoint's Merkle tree and check every object it reaches.

Full: every object (manifest nodes, chunks, delta bases) is read, decoded and checked against
its hash. Quick: manifest nodes are still decoded (they are small and needed to walk the tree),
but chunks are only checked for presence and size, for a fast daily check. Each object is
checked once however many checkpoints share it; each problem names the object and every
checkpoint and tensor path that depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cas.errors import CorruptionError, MissingObjectError
from cas.index import WHERE_PACK
from cas.objectstore import MAX_CHAIN_DECODE


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
    quick: bool = False
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

    @property
    def whole_steps(self) -> list[int]:
        damaged = set(self.damaged_steps)
        return [s for s in self.checked_checkpoints if s not in damaged]


def check_present(objects, key: bytes, _depth: int = 0) -> int:
    """Presence and size of an object, and of its delta bases, from the index, without reading it."""
    rec = objects.record(key)
    if rec is None:
        raise MissingObjectError("object is not in the index", key=key.hex())
    if rec.where == WHERE_PACK:
        size = objects.packs.size(rec.pack)
        if size is None:
            raise MissingObjectError(f"pack {rec.pack.hex()} holding the object is missing", key=key.hex())
        if rec.offset + rec.stored_size > size:
            raise CorruptionError(f"pack {rec.pack.hex()} is shorter than the index says", key=key.hex())
    else:
        size = objects.files.has(key)
        if size is None:
            raise MissingObjectError("object file is missing", key=key.hex())
        if size != rec.stored_size:
            raise CorruptionError(f"object file has {size} bytes, the index says {rec.stored_size}", key=key.hex())
    if rec.base is not None and _depth < MAX_CHAIN_DECODE:
        try:
            check_present(objects, rec.base, _depth + 1)
        except CorruptionError as exc:
            raise CorruptionError(f"the delta base of this object is damaged: {exc}", key=key.hex()) from None
    return rec.raw_size


def verify_checkpoints(store, checkpoints, *, quick: bool = False, progress=None) -> VerifyReport:
    report = VerifyReport(quick=quick)
    verdict: dict[bytes, CorruptionError | None] = {}

    def check(key: bytes) -> CorruptionError | None:
        if key not in verdict:
            try:
                size = check_present(store.objects, key) if quick else store.objects.get(key).size
                report.checked_objects += 1
                report.checked_bytes += size
                verdict[key] = None
            except CorruptionError as exc:
                verdict[key] = exc
        return verdict[key]

    for i, ck in enumerate(checkpoints):
        if progress:
            progress("verify", i, len(checkpoints))
        report.checked_checkpoints.append(ck.step)
        try:
            for tensor in store.tensors(ck.step):
                for key in tensor["chunks"]:
                    err = check(key)
                    if err is not None:
                        report.problems.append(Problem(err.key, ck.step, tensor["path"], err.detail))
        except CorruptionError as exc:  # a manifest node is damaged: the rest of this tree is unreachable
            report.problems.append(Problem(exc.key, ck.step, exc.path, exc.detail + "; the checkpoint cannot be read"))
    return report
