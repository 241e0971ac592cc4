"""Reverse deltas in a bucket store (SeaweedFS, tests/s3server.py): a save writes its changed
chunks whole, a background recode then codes the chunks they replaced as deltas of the new ones
into new segments and names them in the record log, so every host (caught up or rebuilt) reads
the older checkpoints through the same deltas, and gc takes back the superseded whole copies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import cas
from cas.gc import Marker
from cas.gc.bucket import MAX_UNUSED
from helpers import adamw_series, assert_same, tiny_model, train_tiny
from s3server import s3_bucket, s3_prefix, s3_server, s3_url  # noqa: F401 - fixtures
from workers import comeback, drifting

CHUNK = 64 << 10
STEPS = 6


def host(url: str, tmp_path, name: str, **options):
    """A store opened as host `name` would: its own cache folder."""
    return cas.open(url, cache_dir=str(tmp_path / f"cache-{name}"), chunk_size=CHUNK, **options)


def records(store) -> dict:
    store.ensure_cache()
    with store.index.read() as txn:
        return dict(store.index.iter_records(txn))


def placements(store) -> dict:
    """Where this host reads each object the checkpoints need: (its base, pack, offset). Only
    those: the sweep after each save leaves a dead object in a pack it keeps (gc's allowance),
    and a host that folded the delete may know a copy of it another host does not."""
    recs = records(store)
    marker = Marker(store)
    marker.mark([ck.key for ck in store.checkpoints()])
    return {k: (r.base, r.pack, r.offset) for k, r in recs.items() if k in marker.live}


def chunk_bases(store, step: int) -> list:
    """The delta base of each chunk of `step`'s tensors, as this host's cache records them."""
    recs = records(store)
    return [recs[k].base for t in store.tensors(step) for k in t["chunks"]]


def head(store) -> int:
    """The log entry this host's cache has folded last."""
    with store.index.read() as txn:
        return store.registry.head(txn)[0]


def bucket_bytes(store) -> int:
    return sum(store.objects.packs.sizes().values())


def save_series(store, steps: int = STEPS) -> None:
    for step in range(steps):
        store.save(drifting(step), step=step)
        store.wait()


@pytest.mark.parametrize("key", [None, b"k" * 32])
def test_older_checkpoints_in_a_bucket_become_deltas_every_host_reads_the_same_way(s3_url, tmp_path, key):
    options = {"key": key} if key else {}
    with host(s3_url, tmp_path, "a", **options) as store:
        save_series(store)
        assert all(b is None for b in chunk_bases(store, STEPS - 1))  # the newest: whole
        recoded = [step for step in range(STEPS - 1) if any(b is not None for b in chunk_bases(store, step))]
        assert recoded == list(range(STEPS - 1)), recoded
        mine = placements(store)
        for step in range(STEPS):
            assert_same(store.load(step), drifting(step))
    with host(s3_url, tmp_path, "b", **options) as fresh:  # a new host: its cache built from the bucket
        theirs = placements(fresh)
        assert theirs == mine
        for step in range(STEPS):
            assert_same(fresh.load(step), drifting(step))
        assert fresh.verify().ok


def test_content_that_comes_back_is_made_whole_in_the_newest_on_every_host(s3_url, tmp_path):
    """A run resumed from step 2 saves again what it saved before: those chunks are deltas by
    then; the promotion makes them whole in the newest, and every host reads them so."""
    with host(s3_url, tmp_path, "a") as store, host(s3_url, tmp_path, "open") as watching:
        for step in range(9):
            store.save(comeback(step), step=step)
            store.wait()
            assert all(b is None for b in chunk_bases(store, step)), step  # the newest: whole
            assert chunk_bases(watching, step) == chunk_bases(store, step)  # caught up entry by entry
        assert any(b is not None for b in chunk_bases(store, 5))
        mine = placements(store)
        assert placements(watching) == mine
    with host(s3_url, tmp_path, "fresh") as fresh:  # its cache rebuilt from the bucket
        assert placements(fresh) == mine
        for step in range(9):
            assert_same(fresh.load(step), comeback(step))
        assert fresh.verify().ok


def test_an_open_host_catches_up_with_another_hosts_recodes(s3_url, tmp_path):
    with host(s3_url, tmp_path, "a") as a, host(s3_url, tmp_path, "b") as b:
        a.save(drifting(0), step=0)
        assert [ck.step for ck in b.checkpoints()] == [0]  # b has folded step 0, whole
        a.save(drifting(1), step=1)
        a.wait()
        assert any(base is not None for base in chunk_bases(a, 0))
        assert chunk_bases(b, 0) == chunk_bases(a, 0)  # folded from the log: the same deltas
        assert_same(b.load(0), drifting(0))


def test_the_sweep_after_each_save_takes_back_the_whole_copies_the_recodes_superseded(s3_url, tmp_path):
    """No `cas gc`: after each save's recode, its sweep deletes the whole copies the recode
    superseded, so the bucket never holds more than a store without deltas."""
    states = adamw_series(STEPS)
    with host(s3_url + "/plain", tmp_path, "p", delta=False) as plain, host(s3_url + "/delta", tmp_path, "d") as store, \
            cas.open(tmp_path / "local", chunk_size=CHUNK) as local:
        for step, st in enumerate(states):
            for s in (plain, store, local):
                s.save(st, step=step)
                s.wait()
            assert bucket_bytes(store) <= bucket_bytes(plain), (step, bucket_bytes(store), bucket_bytes(plain))
        # what is left: the same deltas as a local store's (which compacts as it recodes), give or
        # take gc's allowance of dead bytes (MAX_UNUSED), and less than the store without deltas
        assert bucket_bytes(store) <= (1 + MAX_UNUSED) * bucket_bytes(local)
        assert bucket_bytes(store) < bucket_bytes(plain), (bucket_bytes(store), bucket_bytes(plain))
        assert store.gc().reclaimed_bytes <= MAX_UNUSED * bucket_bytes(local)  # it had little left to do
        for step, st in enumerate(states):
            assert_same(store.load(step), st)
    with host(s3_url + "/delta", tmp_path, "other") as other:  # another host, after the gc
        for step, st in enumerate(states):
            assert_same(other.load(step), st)
        assert other.verify().ok
        other.gc()  # its own view of the copies agrees: nothing more to take, nothing lost
        for step, st in enumerate(states):
            assert_same(other.load(step), st)


@pytest.mark.parametrize("delta", [True, False])
def test_retention_in_a_bucket_gives_the_space_back_with_no_gc(s3_url, tmp_path, delta):
    """keep_last=2 on a bucket store: the sweep after each save deletes what only the removed
    checkpoints needed, so the bucket holds what a store of the last two alone holds."""
    states = adamw_series(STEPS)
    keep = cas.Retention(keep_last=2)
    with host(s3_url + "/kept", tmp_path, "k", retention=keep, delta=delta) as store, \
            host(s3_url + "/last2", tmp_path, "l", delta=delta) as last2:
        for step, st in enumerate(states):
            store.save(st, step=step)
            store.wait()
        for step in range(STEPS - 2, STEPS):
            last2.save(states[step], step=step)
            last2.wait()
        assert [ck.step for ck in store.checkpoints()] == [STEPS - 2, STEPS - 1]
        assert bucket_bytes(store) <= (1 + MAX_UNUSED) * bucket_bytes(last2), (bucket_bytes(store), bucket_bytes(last2))
    with host(s3_url + "/kept", tmp_path, "fresh") as fresh:
        for step in range(STEPS - 2, STEPS):
            assert_same(fresh.load(step), states[step])
        assert fresh.verify().ok


def test_a_delete_in_a_bucket_gives_the_space_back_with_no_gc(s3_url, tmp_path):
    states = adamw_series(3)
    with host(s3_url + "/all", tmp_path, "a", delta=False) as store, \
            host(s3_url + "/one", tmp_path, "o", delta=False) as one:
        for step, st in enumerate(states):
            store.save(st, step=step)
        one.save(states[2], step=2)
        store.delete([0, 1])
        store.wait()
        assert bucket_bytes(store) <= (1 + MAX_UNUSED) * bucket_bytes(one), (bucket_bytes(store), bucket_bytes(one))
        assert_same(store.load(2), states[2])


def test_trained_model_resumes_exactly_from_a_bucket_with_deltas(s3_url, tmp_path):
    model = tiny_model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with host(s3_url, tmp_path, "a") as store:
        for step in range(4):
            train_tiny(model, opt, 3, seed=step)
            store.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=step)
        expected = train_tiny(model, opt, 3, seed=99)
        store.wait()
    model2 = tiny_model(2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    with host(s3_url, tmp_path, "b") as fresh:
        state = fresh.load(3)
        model2.load_state_dict(state["model"])
        opt2.load_state_dict(state["optim"])
        assert train_tiny(model2, opt2, 3, seed=99) == expected
        assert fresh.verify().ok


RECODER = """
import sys, cas
sys.path.insert(0, sys.argv[3])
import workers
series = getattr(workers, sys.argv[4])
with cas.open(sys.argv[1], cache_dir=sys.argv[2], chunk_size=64 << 10) as store:
    for step in range(int(sys.argv[5])):
        store.save(series(step), step=step)
        store.wait()
"""


def run_killed(s3_url, tmp_path, fault: str, series: str, steps: int) -> None:
    """Run RECODER as a host of its own, killed at `fault` (point=kill[@N])."""
    env = dict(os.environ, CAS_FAULTS=fault)
    proc = subprocess.run([sys.executable, "-c", RECODER, s3_url, str(tmp_path / "cache-killed"),
                           os.path.dirname(__file__), series, str(steps)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


# registry.logged@3: after the recode's log entry exists (entries 1 and 2: the saves of steps 0 and 1)
@pytest.mark.parametrize("point", ["recode.encoded", "recode.in_txn", "registry.logged@3", "recode.committed"])
def test_a_host_killed_at_every_phase_of_a_bucket_recode_loses_nothing(s3_url, tmp_path, monkeypatch, point):
    monkeypatch.setenv("CAS_S3_LEASE_TTL", "2")  # gc waits out the killed host's lease
    name, _, nth = point.partition("@")
    run_killed(s3_url, tmp_path, f"{name}=kill" + (f"@{nth}" if nth else ""), "drifting", 4)  # the first recode
    logged = point in ("registry.logged@3", "recode.committed")  # the recode's entry is in the log
    seen = []
    for name in ("killed", "fresh"):  # the killed host's own cache, and a new host's
        with host(s3_url, tmp_path, name) as store:
            assert [ck.step for ck in store.checkpoints()] == [0, 1]
            for step in (0, 1):
                assert_same(store.load(step), drifting(step))
            assert store.verify().ok
            seen.append(chunk_bases(store, 0))
    assert seen[0] == seen[1]  # both hosts read step 0 alike: through its deltas once the entry is logged
    assert any(b is not None for b in seen[0]) == logged
    with host(s3_url, tmp_path, "fresh") as store:
        report = store.gc()
        assert report.deferred is None, report.to_json()
        for step in (2, 3):  # the series goes on, recoding as before
            store.save(drifting(step), step=step)
            store.wait()
        assert any(b is not None for b in chunk_bases(store, 2))
        store.gc()
    with host(s3_url, tmp_path, "killed") as store:
        for step in range(4):
            assert_same(store.load(step), drifting(step))
        assert store.verify().ok


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_saves_into_a_bucket_are_recoded_by_the_coordinator(s3_url, tmp_path):
    from cas.store import dcp as cdcp

    for step in (0, 1, 2):
        cdcp.save(drifting(step), s3_url, step, chunk_size=CHUNK, no_dist=True, cache_dir=str(tmp_path / "rank0"))
    with host(s3_url, tmp_path, "fresh") as store:
        assert all(b is None for b in chunk_bases(store, 2))
        assert any(b is not None for b in chunk_bases(store, 0)) and any(b is not None for b in chunk_bases(store, 1))
        assert store.verify().ok
    for step in (0, 1, 2):  # DCP's own load flow, on a host with a fresh cache
        target = {k: torch.zeros_like(v) for k, v in drifting(step).items()}
        cdcp.load(target, s3_url, step, no_dist=True, cache_dir=str(tmp_path / f"reader{step}"))
        assert_same(target, drifting(step))
    with host(s3_url, tmp_path, "gc") as store:  # each save's sweep ran as the store it opened closed
        before = bucket_bytes(store)
        assert store.gc().reclaimed_bytes <= MAX_UNUSED * before


@pytest.mark.parametrize("due", ["recode", "gc intent", "gc delete"])
def test_recode_and_gc_entries_keep_snapshots_coming_and_a_fresh_host_starts_from_one(s3_url, tmp_path,
                                                                                       monkeypatch, due):
    """Each save appends its commit, its recode's entry and its sweep's two gc entries: a
    snapshot is taken whichever of them lands on a snapshot's sequence number."""
    from cas.store import snapshots

    every = 8  # (so that each kind of entry soon lands on a multiple)
    monkeypatch.setattr(snapshots, "SNAPSHOT_EVERY", every)

    def small(step: int) -> dict:  # one chunk that drifts: each save an entry, each recode another
        g = torch.Generator().manual_seed(step)
        return {"w": torch.linspace(0, 1, 16384) + 1e-4 * torch.randn(16384, generator=g)}

    with host(s3_url, tmp_path, "a") as store:
        landed = []
        for step in range(40):
            store.save(small(step), step=step)
            store.wait()
            landed = [e.seq for e in store.log() if e.why == due and e.seq % every == 0]
            if landed:
                assert landed[0] in snapshots.snapshot_seqs(store.backend), f"no snapshot at a {due} entry"
                break
        assert landed, " ".join(f"{e.seq}:{e.why}" for e in store.log())
        mine = placements(store)
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert fresh.cache_report.snapshot is not None
        assert placements(fresh) == mine
        for s in range(step + 1):
            assert torch.equal(fresh.load(s)["w"], small(s)["w"])


def test_a_recoded_copy_is_adopted_only_where_its_chain_reaches_a_full_object():
    """The fold's rule on its own: a recode's copy replaces the chosen one where its base's chain
    ends in a full object without passing through it; one that would close a loop is left."""
    from cas.index import WHERE_PACK, ObjectRecord
    from cas.store.copies import adopt_recodes
    from cas.store.records import Entry

    a, b, c, old, new = (bytes([n]) * 32 for n in range(5))
    whole_a, whole_c = ObjectRecord(WHERE_PACK, 10, 10, old, 0), ObjectRecord(WHERE_PACK, 10, 10, old, 20)
    b_on_a = ObjectRecord(WHERE_PACK, 5, 10, old, 10, base=a)
    a_on_b, c_on_a = ObjectRecord(WHERE_PACK, 5, 10, new, 0, base=b), ObjectRecord(WHERE_PACK, 5, 10, new, 5, base=a)
    records = {a: whole_a, b: b_on_a, c: whole_c}
    copies = {a: [whole_a, a_on_b], b: [b_on_a], c: [whole_c, c_on_a]}
    entry = Entry(seq=3, digest=b"", prev=None, why="recode", time=0.0, host="h", pid=1, user="u", changes=(),
                  recoded=(new,))
    adopt_recodes(records, copies, [entry])
    assert records[a] == whole_a  # a delta of b, which is a delta of a: a loop, not adopted
    assert records[c] == c_on_a  # a delta of the full a: adopted


@pytest.mark.parametrize("point", ["recode.promote_encoded", "recode.promoted"])
def test_a_host_killed_while_it_makes_content_that_came_back_whole_loses_nothing(s3_url, tmp_path, monkeypatch, point):
    """Killed in the promotion after step 6 (which saved step 2's content again: deltas by then),
    before or after its commit: every host loads steps 0-6, and the series goes on whole."""
    monkeypatch.setenv("CAS_S3_LEASE_TTL", "2")
    run_killed(s3_url, tmp_path, f"{point}=kill", "comeback", 9)
    for name in ("killed", "fresh"):
        with host(s3_url, tmp_path, name) as store:
            assert [ck.step for ck in store.checkpoints()] == list(range(7))
            for step in range(7):
                assert_same(store.load(step), comeback(step))
            assert store.verify().ok
    with host(s3_url, tmp_path, "killed") as store:
        assert store.gc().deferred is None
        for step in (7, 8):
            store.save(comeback(step), step=step)
            store.wait()
            assert all(b is None for b in chunk_bases(store, step))
        for step in range(9):
            assert_same(store.load(step), comeback(step))
    with host(s3_url, tmp_path, "fresh") as store:
        for step in range(9):
            assert_same(store.load(step), comeback(step))
        assert store.verify().ok


def test_a_folded_pack_whose_delta_is_listed_before_its_base_indexes_both(tmp_path):
    """A gc rewrite copies a chain's objects in any order: a host folding its pack met a delta
    whose base was not indexed yet and wrote a record with depth 0, which the index refuses
    ("an index record is damaged"): that host could not open the store (black-box audit)."""
    from cas.index import Index
    from cas.packs import PackEntry
    from cas.store.cache import _index_pack
    from cas.store.registry import TABLES

    index = Index(str(tmp_path / "index"), create=True, extra_tables=TABLES)
    pack, delta, base = b"p" * 32, b"d" * 32, b"b" * 32
    with index.write() as txn:
        _index_pack(index, txn, pack, [PackEntry(delta, 8, 10, 100, base), PackEntry(base, 54, 50, 100, None)])
    with index.read() as txn:
        assert index.record(txn, delta).base == base and index.record(txn, delta).depth >= 1
        assert index.record(txn, base).base is None


def audit_state(step: int) -> dict:
    """Host h's state i (step h*1000 + i): a drifting weight whose content comes back from i = 6
    on (a resumed run), a drifting tensor shared by the hosts, and a small changing one."""
    def tensor(seed: int, rows: int = 64) -> torch.Tensor:
        return torch.randn(rows, 1024, generator=torch.Generator().manual_seed(seed))
    owner, i = divmod(step, 1000)
    j = i if i < 6 else i - 4
    w = tensor(11 + owner)
    for k in range(j):
        w = w + 1e-4 * tensor(100 + k + 37 * owner)
    return {"w": w, "shared": tensor(7) + j * 1e-3 * tensor(8), "b": tensor(50 + step, rows=2)}


def test_a_host_that_fell_behind_catches_up_over_gc_rewrites_of_delta_chains(s3_url, tmp_path):
    """Host a saves once and closes; host b saves 12 steps (recodes, promotions, milestones)
    while host g runs gc after each; a then reopens and folds all of it. A rewrite pack listing
    a delta before its base made a's cache write a record it then refused, on every open and in
    `cas repair` (black-box audit: every run at 10-12 steps)."""
    with host(s3_url, tmp_path, "a") as a:
        a.save(audit_state(1000), step=1000)
        a.wait()
    with host(s3_url, tmp_path, "b") as b, host(s3_url, tmp_path, "g") as g:
        for i in range(12):
            b.save(audit_state(2000 + i), step=2000 + i, milestone=i % 5 == 3)
            b.wait()
            g.gc(keep_last=2, keep_milestones=True)
        expected = [ck.step for ck in b.checkpoints()]
    for name in ("a", "b", "fresh"):
        with host(s3_url, tmp_path, name) as store:
            assert [ck.step for ck in store.checkpoints()] == expected
            for step in expected:
                assert_same(store.load(step), audit_state(step))
            assert store.verify().ok


def test_a_sweep_waits_for_the_saves_of_its_own_store_then_runs(s3_url, tmp_path):
    """save_async back to back: the sweep after a recode would find this store's next save in
    flight, wait on its lease past its 2 s and leave its epoch pending (an intent entry, its
    packs doomed); it waits for that save instead (the recode thread has nothing to do before
    its commit), then sweeps, and by wait() the bucket holds no whole copy a recode superseded."""
    import time

    from cas import faults

    gate = str(tmp_path / "gate")
    with host(s3_url, tmp_path, "a") as store:
        faults.configure(f"save.chunks_written=pause:{gate}@3")  # step 2's save stays in flight
        try:
            store.save_async(drifting(0), step=0)
            store.save_async(drifting(1), step=1)
            store.save_async(drifting(2), step=2)
            deadline = time.monotonic() + 60
            while not os.path.exists(gate + ".reached") or all(b is None for b in chunk_bases(store, 0)):
                assert time.monotonic() < deadline, "step 2's save never paused, or step 0 was never recoded"
                time.sleep(0.02)
            time.sleep(3)  # longer than the sweep would wait for a lease
            assert not [e.seq for e in store.log() if e.gc], [(e.seq, e.why) for e in store.log()]
        finally:
            open(gate, "w").close()
            faults.configure("")
        store.wait()
        epochs = [e.why for e in store.log() if e.gc]
        assert epochs and epochs == ["gc intent", "gc delete"] * (len(epochs) // 2), epochs  # none left pending
        for step in range(3):
            assert_same(store.load(step), drifting(step))
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert fresh.verify().ok
        assert fresh.gc().reclaimed_bytes == 0  # nothing left over
