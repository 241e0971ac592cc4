"""The public store: the checkpoint store (cas.store) plus retention and gc (cas.gc).

The layers stay apart: cas.store knows checkpoints but not retention, cas.gc knows both; this
module composes them into what `cas.open` returns.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Iterator

from .errors import CasError
from .gc import GcReport, Marker, Retention, collect
from .gc.collect import compact_packs
from .progress import ProgressCallback
from .store import Checkpoint, compare, interop
from .store import CheckpointStore
from .store.mirror import CLOSE_TIMEOUT, Mirror, MirrorStatus
from .store.opening import open_or_create, open_other
from .store.transfer import TransferReport, chosen, copy_checkpoints

# how long a bucket's sweep after a save waits for saves in progress before it leaves its packs
# doomed for the next one (a sweep waits for every writer lease: a deleted pack a save reused is lost)
BUCKET_SWEEP_WAIT = 2.0


class Store(CheckpointStore):
    """A checkpoint store with retention: `cas.open(path, retention=Retention(keep_last=5))`
    applies the policy after every save, like orbax's max_to_keep. With `mirror=` (a path or
    URL), every committed checkpoint is also pushed there in the background (store/mirror.py);
    close() waits up to `mirror_timeout` seconds for pending pushes."""

    def __init__(self, path: str | os.PathLike, *, retention: Retention | None = None,
                 mirror: str | os.PathLike | None = None, mirror_timeout: float = CLOSE_TIMEOUT,
                 **options) -> None:
        _refuse_empty_policy(path, retention)  # before the store is opened, or created
        super().__init__(path, **options)
        self.retention = retention
        self._retention_paused = 0
        self._compact_later: set[bytes] = set()  # packs a recode's compaction had to leave (after_recode)
        # the work that gives space back after a recode or retention is queued (_reclaim)
        self._reclaim_queued = False
        self._reclaim_lock = threading.Lock()
        self.mirror: Mirror | None = None
        if mirror is not None:
            try:
                self.mirror = Mirror(self, mirror, close_timeout=mirror_timeout)
            except BaseException:
                super().close()
                raise

    # --- push, pull, mirror -----------------------------------------------------------------
    def push(self, dest: "str | os.PathLike | CheckpointStore", steps=None, *,
             progress: ProgressCallback | None = None) -> TransferReport:
        """Copy checkpoints `steps` (all when None) to another store, a path or URL (created
        there when missing) or an open store, with only the objects it lacks; ids preserved."""
        self._check_open()
        chosen(self, steps)  # a missing step is refused before the destination is made
        with _opened(dest, self.chunk_size, self) as target:
            return copy_checkpoints(self, target, steps, progress=progress, why="push")

    def pull(self, src: "str | os.PathLike | CheckpointStore", steps=None, *,
             progress: ProgressCallback | None = None) -> TransferReport:
        """Copy checkpoints `steps` (all when None) of another store into this one, with only the
        objects this one lacks; then retention and the mirror run once, as after a save."""
        self._check_writable("pull checkpoints")
        with _opened(src, None, self) as source, self._retention_held():
            report = copy_checkpoints(source, self, steps, progress=progress, why="pull")
        if report.copied:
            self.after_commit(report.copied[-1])
        return report

    def mirror_status(self) -> MirrorStatus | None:
        """What the mirror holds back: pending steps, the last error (None without a mirror)."""
        self._check_open()
        return self.mirror.status() if self.mirror is not None else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until every in-flight save is done (raising a failure nobody has looked at),
        then until the mirror holds every checkpoint, retrying now, for at most `timeout`
        seconds (None: until it does; see mirror_status())."""
        super().wait()
        if self.mirror is not None:
            self.mirror.wait(timeout)

    def close(self) -> None:
        """Wait for in-flight saves, then for pending pushes to the mirror (while they succeed,
        within mirror_timeout: what is left stays here, unmirrored, with a warning, and is pushed
        at the next open with mirror=), then release everything."""
        if self.mirror is not None and not self._closed and os.getpid() == self._pid:
            self._background.wait()  # their commits notify the mirror (and their retention keeps it in mind)
            mirror, self.mirror = self.mirror, None
            left = mirror.close()
            if left:
                warnings.warn(f"cas: {len(left)} checkpoint(s) of {self.path} are not yet in the mirror "
                              f"{mirror.destination} (steps {left}): they stay here, unmirrored, and are pushed "
                              "at the next open with mirror=", RuntimeWarning, stacklevel=2)
        super().close()

    def gc(self, retention: Retention | None = None, *, dry_run: bool = False,
           progress: ProgressCallback | None = None, **rules) -> GcReport:
        """Remove the checkpoints no rule keeps, then sweep every unreferenced object.

        Rules come as a Retention or as its keywords (keep_last=5, keep_milestones=True, ...);
        with neither, nothing is removed and only garbage is swept."""
        if not dry_run:
            self._check_writable("collect garbage")
        self._check_open()
        if retention is not None and rules:
            raise TypeError("pass a Retention or rule keywords, not both")
        if rules:
            retention = Retention(**rules)
        self.wait_recoding()  # what this process re-encodes is swept with the rest, not left behind
        return collect(self, retention, dry_run=dry_run, progress=progress)

    def delete(self, steps) -> list[Checkpoint]:
        """Remove checkpoints; in a bucket their space then comes back as after retention, in
        the sweep on the recode thread (`cas rm` waits for it as it closes the store)."""
        removed = super().delete(steps)
        if removed and not self.location.local:
            self._queue_reclaim()
        return removed

    def pin(self, step: int) -> Checkpoint:
        return self.set_pinned(step, True)

    def unpin(self, step: int) -> Checkpoint:
        return self.set_pinned(step, False)

    def export(self, step: int, path: str | os.PathLike, *, keys=None, relative: bool = False,
               progress: ProgressCallback | None = None, format: str | None = None) -> interop.ExportReport:
        """Write checkpoint `step`'s tensors to one safetensors file for serving or evaluation.
        A weights-only export, NOT a training checkpoint (see cas.store.interop.export).
        format="torch" (the default for .pt/.pth/.bin/.ckpt): its whole state dict, torch.save'd."""
        self._check_open()
        return interop.export(self, step, path, keys=keys, relative=relative, progress=progress, format=format)

    def import_file(self, path: str | os.PathLike, *, step: int | None = None) -> Checkpoint:
        """Save a .safetensors or torch.save file (read with torch.load(weights_only=True) only)
        as checkpoint `step`, by default the last number in the file's name."""
        self._check_open()
        return interop.import_file(self, path, step=step)

    def import_dcp(self, folder: str | os.PathLike, *, step: int | None = None) -> Checkpoint:
        """Save a DCP folder (FileSystemWriter's .metadata and *.distcp) as one DCP checkpoint
        `step`, by default the last number in the folder's name; nothing arbitrary is unpickled."""
        self._check_open()
        return interop.import_dcp(self, folder, step=step)

    def import_folder(self, folder: str | os.PathLike, *,
                      progress: ProgressCallback | None = None) -> interop.FolderImport:
        """Import a folder of checkpoint files, one per step, each step from the file's name.
        All or nothing: retention waits until every file is in (run after each file, it removed
        the store's older checkpoints and then the import's own, which a refused file then
        could not take back), and runs once at the end."""
        self._check_open()
        with self._retention_held():
            result = interop.import_folder(self, folder, progress=progress)
        if result.checkpoints:
            self.after_commit(result.checkpoints[-1][1])
        return result

    @contextlib.contextmanager
    def _retention_held(self) -> Iterator[None]:
        """No retention after the saves inside this block (of any thread of this store; a
        later save's retention catches up)."""
        self._retention_paused += 1
        try:
            yield
        finally:
            self._retention_paused -= 1

    def diff(self, a: int, b: int, *, progress: ProgressCallback | None = None) -> compare.DiffReport:
        """Per tensor path, what changed from checkpoint `a` to `b`, and the stored bytes they share."""
        self._check_open()
        return compare.diff(self, a, b, Marker, progress=progress)

    def exclusive_bytes(self, checkpoints: list[Checkpoint] | None = None, *,
                        progress: ProgressCallback | None = None) -> dict[int, int]:
        """Per step, the stored bytes only that checkpoint references: what deleting it would free."""
        self._check_open()
        return compare.exclusive_bytes(self, Marker, checkpoints, progress=progress)

    def after_recode(self, packs: set[bytes]) -> None:
        """Give back the space of the full copies a recode superseded: the packs it left dead
        entries in are compacted as gc would (gc's rules: a large pack once under half live),
        and, after the recode's job, the store's packs to gc's 5% rule (_reclaim). In a bucket
        the sweep after the save takes them (_reclaim)."""
        if self.readonly:
            return
        if packs:  # (on the recode thread: what is queued runs after this recode's job)
            self._queue_reclaim()
        if not self.location.local:
            return
        # a pack a save in progress held entries of is left for the next recode to try again
        packs = set(packs) | self._compact_later
        self._compact_later = set()
        if not packs:
            return
        try:
            self._compact_later = compact_packs(self, GcReport(), only=packs)
        except Exception as exc:  # noqa: BLE001 - nothing is lost: the next gc compacts them
            warnings.warn(f"cas: compacting the packs a recode left dead entries in failed ({type(exc).__name__}: "
                          f"{exc}); the next gc does it", RuntimeWarning, stacklevel=2)

    def _in_background(self, what: str, work) -> GcReport | None:
        """Run gc `work()` on the recode thread, unless retention is held or the store closing;
        a failure only warns: nothing is lost, and the next save's (or `cas gc`) does it."""
        if self._retention_paused or self._closed:
            return None
        try:
            return work()
        except Exception as exc:  # noqa: BLE001 - OSError, LMDB's errors, ours
            warnings.warn(f"cas: {what} failed ({type(exc).__name__}: {exc}); the next save's gc (or `cas gc`) "
                          "does it", RuntimeWarning, stacklevel=2)
            return None

    def _sweep_after_recodes(self) -> None:
        """The retention gc of a save had to leave garbage (objects, or packs to compact) that
        a writer held, most likely the recode then running (it holds the chunks of the checkpoint
        it recodes, which that gc may have just removed, and compacts packs): sweep once more
        after the recodes queued now, not at the next save."""
        self._in_background("the sweep after a recode", lambda: collect(self, self.retention, sweep_objects=True))

    def _queue_reclaim(self) -> None:
        """Queue _reclaim after the recodes queued now, once: a queued one does it for all."""
        with self._reclaim_lock:
            if self._reclaim_queued:
                return
            self._reclaim_queued = True
        self.after_recodes(self._reclaim)

    def _reclaim(self) -> None:
        """After a recode superseded copies, or retention removed checkpoints, give the space
        back with no `cas gc`, on the recode thread. A folder: rewrite its packs, most dead
        first, until dead bytes are at most gc's MAX_UNUSED of the live ones (a recode's own
        compaction rewrites only packs under half live). A bucket: one gc epoch (its sweep), so
        it holds what a store without deltas would or less. That waits a moment for saves in
        progress (other hosts'); past that its packs stay doomed and the sweep after a later
        save, or `cas gc`, ends the epoch. It first waits for this store's saves in flight
        (save_async back to back): their leases would hold it past its wait, and the recode
        thread has nothing to do before their commits anyway."""
        with self._reclaim_lock:
            self._reclaim_queued = False
        if self.location.local:
            self._in_background("rewriting packs for space after a save", lambda: compact_packs(self, GcReport()))
        else:
            self._background.wait()
            self._in_background("the sweep of the bucket after a save",
                                lambda: collect(self, None, wait=BUCKET_SWEEP_WAIT))

    def after_commit(self, ck: Checkpoint) -> None:
        """Retention after every committed save. A gc that fails here (damage it refuses to sweep
        past, another process removing checkpoints throughout, a full disk, a keep_best metric
        no checkpoint has logged yet) must not make the committed save look failed: it warns,
        and the next save's gc tries again."""
        if self.mirror is not None:
            self.mirror.notify()
        bucket = not self.location.local
        if self.retention is not None and not self._retention_paused:
            try:
                # on the save's path only what is cheap; the rewrites for space (gc's 5% rule) go to
                # the recode thread, at low priority, after the recodes queued now, and so does a
                # bucket's sweep (it waits for other hosts' saves)
                report = collect(self, self.retention, sweep_objects=not bucket, space_budget=False)
                if not bucket and (report.objects_held or report.packs_held):
                    self.after_recodes(self._sweep_after_recodes)
                elif report.removed or not bucket:
                    self._queue_reclaim()
            except Exception as exc:  # noqa: BLE001 - OSError, LMDB's errors, ours: the step is committed whatever
                warnings.warn(f"cas: step {ck.step} is committed, but the retention gc after it failed "
                              f"({type(exc).__name__}: {exc}); the next save's gc tries again",
                              RuntimeWarning, stacklevel=2)


@contextlib.contextmanager
def _opened(store: "str | os.PathLike | CheckpointStore", chunk_size: int | None,
            like: CheckpointStore) -> Iterator[CheckpointStore]:
    """An open store as it is, or the store at a path or URL, closed afterwards (created with
    `chunk_size` when given and missing: a push's destination)."""
    if isinstance(store, CheckpointStore):
        yield store
        return
    opened = open_or_create(store, chunk_size=chunk_size, like=like) if chunk_size \
        else open_other(store, like, create=False, readonly=True)
    try:
        yield opened
    finally:
        opened.close()


def _refuse_empty_policy(path: str | os.PathLike, retention: Retention | None) -> None:
    """A retention with no rule removes nothing after a save: asking for one can only be a
    mistake (a forgotten keyword), so it is refused rather than silently inert."""
    if retention is not None and not retention.has_rules:
        raise CasError(f"retention=Retention() for {os.fspath(path)} has no rule, so it would never remove "
                       "anything; give a rule (e.g. Retention(keep_last=5, keep_milestones=True)) or leave "
                       "retention out")
