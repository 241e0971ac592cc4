"""torch.distributed.checkpoint (DCP) backed by the store: multi-rank saves with dedup, and
loads at any world size (DCP reshards).

    import torch.distributed.checkpoint as dcp
    from cas.store.dcp import CasWriter, CasReader
    dcp.save(state, storage_writer=CasWriter(path, step=step))        # on every rank
    dcp.load(state, storage_reader=CasReader(path, step=step))        # any world size
    cas.store.dcp.save(state, path, step) / cas.store.dcp.load(state, path)   # same, CasError on failure

Protocol (DCP calls; "coordinator" is DCP's rank 0):
  1. set_up_storage_writer, coordinator only: open the store (create it if missing), refuse an
     existing step unless overwrite=True (then the commit replaces it), and open a WriteSession whose purpose starts with "barrier:". That lease
     makes every gc sweep batch wait until it ends, and it exists before any rank looks at a
     file: ranks look only in write_data, which DCP runs after the coordinator's set-up.
  2. write_data, every rank, for its own items only: cut each tensor shard into chunks on the
     tensor's global byte grid (a dim-0 shard at row r starts r*row_bytes into the tensor, so
     its `skew` is that modulo the chunk size and chunks fully inside a shard coincide at any
     world size), hash each chunk, skip it when a full object file of it exists, or a delta
     file the coordinator confirmed stored (a file under its final name is complete: it is
     fsynced before it gets that name, and the barrier keeps gc away), else encode it and give
     it its name as a file, never over an existing one (which may be indexed: other
     checkpoints decode through it); for an existing file it cannot reuse, the rank writes a
     temporary replacement, reported with its results; then files.sync(). Ranks never open
     LMDB, so the design holds on a shared
     filesystem where LMDB cannot be shared. Non-tensor values are encoded
     from the planner's ORIGINAL objects as msgpack with type tags (store/values.pack), an
     io.BytesIO as its bytes and position; only an object neither can hold is kept as the
     planner's pickled bytes, tagged as such.
     WriteResults carry chunk keys and encoded values back to the coordinator.
  3. finish, coordinator only, called by DCP only when every rank succeeded: adopt every
     reported chunk file into the session (indexed at commit; a key the index holds keeps its
     record and file, and a replacement takes an existing file's place only when the index
     does not hold that key), write the manifest nodes (a
     commit node, value nodes, one tensor node per shard: the store's own node kinds, so gc,
     verify, `cas show`, Store.tensors and Store.load work unchanged), then session.commit:
     one LMDB transaction indexes the objects and adds the checkpoint record. metadata's
     storage_data becomes a tiny summary, because DCP broadcasts it to every rank.
  If any rank fails, DCP never calls finish: nothing is committed and earlier checkpoints are
  untouched. DCP has no failure hook, so the barrier lease ends when the writer is aborted:
  by cas.store.dcp.save (which also turns DCP's CheckpointException, a BaseException, into a
  CasError), by abort() (do call it when a direct dcp.save or an async_save future fails), by
  the writer's next save, or by a finalizer when the writer is dropped. A coordinator that
  dies leaves a lease that gc's reap_dead_leases ends (same host); a dead rank leaves only
  unindexed chunk files, which gc sweeps.

Writers and readers take a path or an open Store (py-lmdb refuses to open one store's index
twice in a process, so a process that already has the store open lends it). They pickle
without their open handles, for DCP's process-based async executor.

Loading (CasReader): every rank opens the store read-only, reads the manifest and rebuilds
DCP's Metadata from plain msgpack values (read_metadata); read_data decodes only the chunks
that hold the rows it needs, verifying each chunk's hash, and copies the requested block into
the planner's tensors. Loading thus needs the index readable on every rank (one host, or a
store copied to each node); a store in a bucket is read from the bucket by every rank, each
with its own cache (cache_dir=). Values go back into the planner's state dict directly (int
dict keys of the target kept); planner.load_bytes, which unpickles, runs only for values saved
as pickle and only with CasReader(..., allow_pickle=True). Nothing is pickled into the store
(DCP's collectives do pickle plans and results between ranks, in memory, as always).

Stores in a bucket (`s3://bucket/prefix`; `file://PATH` names a folder): ranks write their new
chunks into segments PUT straight to the bucket instead of object files, dedup by the chunks the
coordinator confirms stored in the planning round trip, and report where each new chunk lives;
the coordinator indexes them at its commit (segments.py). Deltas are refused there for now.

Files: writer.py (CasWriter: the coordinator's set-up, planning and commit; save), rank.py (a
rank's chunks and values), manifest.py (the coordinator's manifest), reader.py (CasReader;
load), bases.py (each rank's delta bases, kept by store/bases.py as Store.save keeps its own),
failures.py (DCP's failures as CasErrors), segments.py (ranks saving into a bucket store),
folder.py (a DCP folder, FileSystemWriter's, read for `cas import` without unpickling anything
arbitrary). state_dict(store, step) puts a DCP checkpoint together as one state dict (`cas
export --format torch`).
"""

from __future__ import annotations

from cas.errors import DistributedCheckpointError

from . import bases, segments
from .manifest import DCP_FORMAT, DCP_VERSION, SavedCheckpoint, build_manifest, sharding_summary
from .rank import HEADER_BYTES, WRITE_WINDOW_BYTES, global_skew, write_rank_items
from .reader import (READ_WINDOW_BYTES, CasReader, assign_value, bytesio_value, load, metadata_from_plain,
                     planner_mappings, read_manifest, set_path, state_dict)
from .writer import BARRIER_PURPOSE, CasWriter, save

__all__ = ["BARRIER_PURPOSE", "DCP_FORMAT", "DCP_VERSION", "HEADER_BYTES", "READ_WINDOW_BYTES", "WRITE_WINDOW_BYTES",
           "CasReader", "CasWriter", "DistributedCheckpointError", "SavedCheckpoint", "assign_value", "bases",
           "build_manifest", "bytesio_value", "global_skew", "load", "metadata_from_plain", "planner_mappings",
           "read_manifest", "save", "segments", "set_path", "sharding_summary", "state_dict", "write_rank_items"]
