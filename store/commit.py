"""A save's commit: its commit node, written with the rest of its manifest, and its registry
record, created in the commit transaction. Store.save and the DCP coordinator commit alike."""

from __future__ import annotations

import dataclasses
import datetime as _dt
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cas import faults
from cas.errors import CasError, CheckpointExistsError
from cas.objectstore import WriteSession

from . import pipeline, provenance, signing
from .registry import Checkpoint, add_change, remove_change
from .tree import Ref, commit_node

if TYPE_CHECKING:
    from .store import CheckpointStore


@dataclass(frozen=True)
class SaveRecord:
    """What a save records of itself, in its commit node and in the registry alike."""

    step: int
    created: float  # time.time() when the save began
    milestone: bool
    metrics: dict
    meta: dict
    logical_bytes: int  # tensor bytes it holds
    produced_by: dict = dataclasses.field(default_factory=dict)  # the registry's provenance only (a DCP save's sharding)

    def node(self, tree: Ref) -> bytes:
        return commit_node(step=self.step, created=self.created, milestone=self.milestone, metrics=self.metrics,
                           meta=self.meta, tree=tree, logical_bytes=self.logical_bytes)

    def checkpoint(self, commit_key: bytes, new_bytes: int) -> Checkpoint:
        return Checkpoint(step=self.step, id=commit_key.hex(),
                          created=_dt.datetime.fromtimestamp(self.created, _dt.timezone.utc),
                          milestone=self.milestone, metrics=self.metrics, meta=self.meta,
                          logical_bytes=self.logical_bytes, new_bytes=new_bytes)


def commit_save(store: "CheckpointStore", session: WriteSession, record: SaveRecord, tree: Ref, nodes: dict[bytes, bytes],
                pool: ThreadPoolExecutor, fault: str, *, replacing: bool | str = False) -> Checkpoint:
    """Write the manifest `nodes` and the commit node of `tree`, then commit the session with
    the checkpoint's record (one record log entry; with `replacing`, it also removes the
    checkpoint at that step, unless pinned; when `replacing` is a checkpoint id, only that one:
    another at the step is CheckpointExistsError). `fault` names the fault point once nodes are
    written."""
    commit = record.node(tree)
    commit_key = session.store.namer.key(commit)
    nodes[commit_key] = commit
    pipeline.write_blobs(session, nodes, pool)
    faults.point(fault)

    def finish(txn) -> Checkpoint:
        ck = dataclasses.replace(record.checkpoint(commit_key, session.new_bytes),
                                 provenance={**provenance.collect(), **record.produced_by})
        change = add_change(ck, session.packs_written())
        if store.signing_key is not None:
            change["signature"] = signing.sign(change, store.signing_key)

        def plan(txn) -> list[dict]:  # the checkpoint it replaces, as the registry stands at each try
            old = store.registry.get(txn, record.step) if replacing else None
            if old is None:
                return [change]
            if isinstance(replacing, str) and old.id != replacing:
                raise CheckpointExistsError(f"checkpoint {record.step} was saved again by another writer (it is "
                                            f"{old.id[:12]}, this save was to replace {replacing[:12]}); nothing "
                                            "of this save was committed")
            if old.pinned:
                raise CasError(f"checkpoint {record.step} is pinned (a legal hold); it cannot be replaced")
            return [remove_change(old), change]

        why = "replace" if replacing and store.registry.get(txn, record.step) is not None else "save"
        seq = store.registry.commit(txn, why, plan, check=session.check_nothing_lost)
        return dataclasses.replace(ck, seq=seq)

    return store.commit_session(session, finish)
