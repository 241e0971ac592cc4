"""One rank of a multi-process DCP test: `python tests/dcp_worker.py SCENARIO STORE OUT`.

The launcher (tests/test_dcp.py) sets RANK, WORLD_SIZE and DCP_PG_FILE (a gloo FileStore, so
no port can collide) and reads back OUT/rank<N>.json. Each scenario batches several checks,
because starting a process group costs seconds on this machine. Every rank runs the same code;
models come from seeds, and reference tensors (gathered full tensors) go to OUT/ref<step>.pt.
"""

from __future__ import annotations

import datetime
import gc
import io
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import cas
from cas import faults
from cas.store import dcp as cdcp
from cas.store.dcp import bases as dcp_bases

warnings.filterwarnings("ignore")
CHUNK = 64 << 10
EXTRA = {"epoch": 3, "name": "run-a", "pair": (1, 2.5, "x"), "table": {1: "one", 2: "two"}, "ids": [4, 5]}
EXTRA_BLANK = {"epoch": 0, "name": "", "pair": (), "table": {1: "", 2: ""}, "ids": []}


# --- process group and model --------------------------------------------------------------
def init() -> tuple[int, int]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{os.environ['DCP_PG_FILE']}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
    return rank, world


def sharded_model(world: int, seed: int):
    """An MLP sharded with FSDP2 over all ranks, with AdamW."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(8, 256, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def dcp_state(model, opt, extra: dict) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": extra}


def flat_tensors(value, prefix: str = "") -> dict:
    """{dotted path: tensor} of a nested state (the layout tests compare by)."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    out = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.update(flat_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def full_tensors(model, opt) -> dict:
    """Every tensor of model and optimizer gathered whole (a collective; full on rank 0)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in flat_tensors({"model": msd, "optim": osd}).items()}


def write_reference(model, opt, rank: int, out: str, name: str) -> None:
    full = full_tensors(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(out, f"{name}.pt"))


def mismatches(full: dict, ref: dict) -> list[str]:
    bad = [k for k in ref if k not in full]
    for k, v in full.items():
        r = ref.get(k)
        if r is None or r.dtype != v.dtype or r.shape != v.shape or \
                not torch.equal(r.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)):
            bad.append(k)
    return bad


class Report(dict):
    """A rank's results, rewritten to OUT/rank<N>.json after every entry: a rank that is killed
    later still reports what it did before."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        with open(self.path + ".tmp", "w") as f:
            json.dump(self, f)
        os.replace(self.path + ".tmp", self.path)


def saved(result: cdcp.SavedCheckpoint) -> dict:
    return {"step": result.step, "id": result.id, "logical": result.logical_bytes, "new": result.new_bytes}


def error_of(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "cas": isinstance(exc, cas.CasError), "message": str(exc)[:2000]}


def leases(path: str) -> list[str]:
    with cas.open(path, readonly=True) as store, store.index.read() as txn:
        return [info["purpose"] for info in store.index.leases(txn).values()]


# --- scenarios ------------------------------------------------------------------------------
def scenario_save(store: str, out: str, rank: int, world: int, res: Report) -> None:
    """Save an FSDP2 model with AdamW and extras twice (the second unchanged), then with the
    thread and the process async executors, writing gathered references of each state."""
    model, opt = sharded_model(world, seed=0)
    train(model, opt, 2, seed=1)
    write_reference(model, opt, rank, out, "ref1")
    res["saved"] = {"1": saved(cdcp.save(dcp_state(model, opt, EXTRA), store, 1, chunk_size=CHUNK))}
    res["saved"] = dict(res["saved"], **{"2": saved(cdcp.save(dcp_state(model, opt, EXTRA), store, 2, meta={"dcp": "the user's own"}))})

    train(model, opt, 1, seed=2)
    write_reference(model, opt, rank, out, "ref3")
    group = dist.new_group(backend="gloo")  # the background thread's collectives need their own group
    future = dcp.async_save(dcp_state(model, opt, EXTRA), storage_writer=cdcp.CasWriter(store, step=3),
                            process_group=group)
    train(model, opt, 1, seed=3)  # changes the parameters while the save runs: it saved a snapshot
    res["saved"] = dict(res["saved"], **{"3": saved(cdcp.SavedCheckpoint.from_storage_data(
        future.result().storage_data))})

    write_reference(model, opt, rank, out, "ref4")
    t0 = time.perf_counter()
    future = dcp.async_save(dcp_state(model, opt, EXTRA), storage_writer=cdcp.CasWriter(store, step=4),
                            async_checkpointer_type=dcp.state_dict_saver.AsyncCheckpointerType.PROCESS)
    res["saved"] = dict(res["saved"], **{"4": saved(cdcp.SavedCheckpoint.from_storage_data(
        future.result().storage_data))})
    res["process_executor_seconds"] = time.perf_counter() - t0


def scenario_reshard(store: str, out: str, rank: int, world: int, res: Report) -> None:
    """Load step 1 into an FSDP2 model of another world size, compare it with the gathered
    reference, then save it from this layout (it should dedup against the 2-rank save)."""
    model, opt = sharded_model(world, seed=123)
    state = dcp_state(model, opt, dict(EXTRA_BLANK, table={1: "", 2: ""}))
    loaded = cdcp.load(state, store, 1)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    res["loaded_step"] = loaded.step
    res["extra"] = repr(state["extra"])
    res["local_rows"] = int(model[0].weight.to_local().shape[0])
    full = full_tensors(model, opt)
    ref = torch.load(os.path.join(out, "ref1.pt"), weights_only=True) if rank == 0 else None
    if rank == 0:
        res["mismatches"] = mismatches(full, ref)
        res["compared"] = len(full)
    res["saved"] = saved(cdcp.save(dcp_state(model, opt, EXTRA), store, 10))

    # One tensor loaded as column blocks: every rank reads a block from both stored row shards.
    mesh = init_device_mesh("cpu", (world,))
    columns = distribute_tensor(torch.zeros(1024, 256), mesh, [Shard(1)])
    cdcp.load({"model": {"0": {"weight": columns}}}, store, 1)
    res["column_block"] = list(columns.to_local().shape)
    whole = columns.full_tensor()
    if rank == 0:
        res["columns_match"] = torch.equal(whole.view(torch.uint8), ref["model.0.weight"].view(torch.uint8))


def small_state(world: int, seed: int) -> dict:
    """A DTensor sharded along dim 0, a replicated tensor and a value: quick to save."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    big = distribute_tensor(torch.randn(512, 256, generator=g), mesh, [Shard(0)])
    return {"w": big, "r": torch.randn(33, generator=g), "extra": {"seed": seed}}


def scenario_failures(store: str, out: str, rank: int, world: int, res: Report) -> None:
    """A committed save, then a rank that raises (through our wrapper, then through dcp.save
    directly), then a rank that is SIGKILLed: nothing of the failures may be committed."""
    res["saved"] = saved(cdcp.save(small_state(world, 1), store, 1, chunk_size=CHUNK))
    dist.barrier()

    faults.configure("dcp.write_data=raise" if rank == 1 else "")
    try:
        cdcp.save(small_state(world, 2), store, 2)
        res["wrapped"] = None
    except BaseException as exc:  # noqa: BLE001 - the test checks its class
        res["wrapped"] = error_of(exc)
    dist.barrier()
    if rank == 0:
        res["leases_after_wrapped"] = leases(store)

    writer = cdcp.CasWriter(store, step=3)
    try:
        dcp.save(small_state(world, 3), storage_writer=writer)
        res["direct"] = None
    except CheckpointException as exc:
        res["direct"] = {"type": type(exc).__name__, "is_exception": isinstance(exc, Exception)}
    if rank == 0:
        # The writer still holds its barrier lease: only dropping (or aborting) it ends it.
        res["leases_before_drop"] = _peek_leases(writer)
        del writer
        gc.collect()
        res["leases_after_drop"] = leases(store)
    dist.barrier()

    faults.configure("dcp.write_data=kill" if rank == 1 else "")
    try:
        cdcp.save(small_state(world, 4), store, 4)
        res["killed"] = None
    except BaseException as exc:  # noqa: BLE001
        res["killed"] = error_of(exc)


def _peek_leases(writer: cdcp.CasWriter) -> list[str]:
    """The leases as the writer's own open store sees them (a second LMDB environment on the same
    path in one process is to be avoided)."""
    store = writer._pending.store
    with store.index.read() as txn:
        return [info["purpose"] for info in store.index.leases(txn).values()]


def scenario_solo(store: str, out: str, rank: int, world: int, res: Report) -> None:
    """One process, no process group: save step STEP with the fault spec in CAS_FAULTS."""
    step = int(os.environ["DCP_STEP"])
    res["saved"] = saved(cdcp.save(small_state_plain(step), store, step, chunk_size=CHUNK))


def small_state_plain(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g), "extra": {"seed": seed}}


def scenario_delta(store: str, out: str, rank: int, world: int, res: Report) -> None:
    """Delta saves of an FSDP2 model and AdamW (small lr, one step between saves), steps 1-5 at
    max_chain 2, with a gathered reference of each state; before step 5 every rank forgets its
    bases, as a restarted job would."""
    model, _ = sharded_model(world, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    results = {}
    for step in range(1, 6):
        train(model, opt, 1, seed=10 + step)
        write_reference(model, opt, rank, out, f"delta{step}")
        if step == 5:  # as if every rank had restarted: no bases in memory
            dcp_bases.replace(os.path.abspath(store), None)
        results[str(step)] = saved(cdcp.save(dcp_state(model, opt, EXTRA), store, step, chunk_size=CHUNK,
                                             delta="forward", max_chain=2))
    res["saved"] = results


def bucket_bytes(url: str) -> int:
    """Bytes of every pack (segment) in a bucket store."""
    from cas.store.location import locate

    return sum(size for _, size in locate(url).backend.list_sizes("packs/"))


def rank_cache(rank: int) -> str:
    """This rank's own cache folder (as on a host of its own)."""
    return os.path.join(os.environ["DCP_CACHE_ROOT"], f"rank{rank}")


def scenario_s3_save(store: str, out: str, rank: int, world: int, res: Report) -> None:
    """Into a bucket store, each rank with its own cache: step 1, then step 2 with the model
    unchanged and one value changed; rank 0 reports the bucket's pack bytes after each."""
    model, opt = sharded_model(world, seed=0)
    train(model, opt, 2, seed=1)
    write_reference(model, opt, rank, out, "ref1")
    cache = rank_cache(rank)
    results = {"1": saved(cdcp.save(dcp_state(model, opt, EXTRA), store, 1, chunk_size=CHUNK, cache_dir=cache))}
    dist.barrier()
    if rank == 0:
        res["bytes1"] = bucket_bytes(store)
    results["2"] = saved(cdcp.save(dcp_state(model, opt, dict(EXTRA, epoch=4)), store, 2, cache_dir=cache))
    dist.barrier()
    if rank == 0:
        res["bytes2"] = bucket_bytes(store)
    res["saved"] = results


def scenario_s3_load(store: str, out: str, rank: int, world: int, res: Report) -> None:
    """Load step 1 of a bucket store into an FSDP2 model of this world size, each rank with a
    fresh cache of its own, and compare it with the gathered reference on rank 0."""
    model, opt = sharded_model(world, seed=123)
    state = dcp_state(model, opt, dict(EXTRA_BLANK, table={1: "", 2: ""}))
    loaded = cdcp.load(state, store, 1, cache_dir=rank_cache(rank))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    res["loaded_step"] = loaded.step
    res["extra"] = repr(state["extra"])
    full = full_tensors(model, opt)
    if rank == 0:
        res["mismatches"] = mismatches(full, torch.load(os.path.join(out, "ref1.pt"), weights_only=True))
        res["compared"] = len(full)


ECO_LOSSES = [0.5, 0.25, 0.125]
ECO_RAW = b"\x00\xffcas"


def scenario_ecosystem(store: str, out: str, rank: int, world: int, res: Report) -> None:
    """An FSDP2 model with AdamW and, as DCP's end-to-end tests keep them, the training losses
    torch.save'd into an io.BytesIO (with plain bytes beside them), saved by DCP's own
    FileSystemWriter into OUT/dcp-7 and through CasWriter as step 7 of the store; the gathered
    reference goes to OUT/ref_eco.pt (tests/test_dcp_ecosystem.py)."""
    model, opt = sharded_model(world, seed=5)
    train(model, opt, 1, seed=6)
    write_reference(model, opt, rank, out, "ref_eco")
    losses = io.BytesIO()
    torch.save(ECO_LOSSES, losses)
    extra = {"losses": losses, "raw": ECO_RAW, "epoch": 2}
    dcp.save(dcp_state(model, opt, extra), storage_writer=FileSystemWriter(os.path.join(out, "dcp-7")))
    res["saved"] = saved(cdcp.save(dcp_state(model, opt, extra), store, 7, chunk_size=CHUNK))


SCENARIOS = {"ecosystem": scenario_ecosystem, "s3_save": scenario_s3_save, "s3_load": scenario_s3_load, "save": scenario_save, "reshard": scenario_reshard, "failures": scenario_failures,
             "solo": scenario_solo, "delta": scenario_delta}


def main() -> None:
    scenario, store, out = sys.argv[1:4]
    rank, world = init()
    SCENARIOS[scenario](store, out, rank, world, Report(os.path.join(out, f"rank{rank}.json")))
    if world > 1 and scenario != "failures":  # a group with a killed rank cannot be torn down cleanly
        dist.destroy_process_group()
    # Skip the interpreter's teardown: with torch 2.13's gloo, some exits aborted there (SIGABRT,
    # "terminate called without an active exception") after everything was done and reported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
