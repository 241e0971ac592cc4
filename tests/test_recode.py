"""Reverse deltas (the default, delta=True): every save is written whole and the chunks it replaced
are then recoded as deltas of the new ones, so the newest checkpoint always decodes without a chain.
Any series of states restores bit for bit at every step, also after gc removed any subset of
checkpoints and after a SIGKILL at every phase of the recoding; chains stay within max_chain; the
chain of every committed checkpoint verifies."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import assert_same, wait_for
from test_delta import FLOATS, chains, next_state
from test_gc import assert_exactly_reachable
from test_truth import drop_index_files
from workers import comeback, drifting, smooth, tensor

import cas
from cas import faults
from cas.gc import Retention
from cas.errors import CasError
from cas.store.recode import Pair, recode
from cas.store.tensors import TORCH_DTYPES

WORKERS = os.path.join(os.path.dirname(__file__), "workers.py")
RECODE_POINTS = ["recode.encoded", "recode.in_txn", "recode.committed", "recode.files_removed"]
RELINK_POINTS = ["recode.relink_encoded", "recode.relinked"]
PROMOTE_POINTS = ["recode.unlink_encoded", "recode.unlinked", "recode.promote_encoded", "recode.promoted"]


def records(store) -> dict:
    with store.index.read() as txn:
        return dict(store.index.iter_records(txn))


def chunk_records(store, step: int) -> list:
    recs = records(store)
    return [recs[k] for t in store.tensors(step) for k in t["chunks"]]


def w_chunks_of(store, step: int, path: str = "w") -> list:
    return next(t["chunks"] for t in store.tensors(step) if t["path"] == path)


def true_depth(store, key: bytes) -> int:
    return len(store.objects.chain(key)) - 1


def assert_chains(store, max_chain: int, newest_whole: bool = True) -> None:
    """The newest checkpoint is whole; every chunk's chain is within max_chain and its recorded
    depth is its chain's."""
    newest = store.latest()
    assert not newest_whole or all(r.base is None for r in chunk_records(store, newest.step))
    for ck in store.checkpoints():
        for t in store.tensors(ck.step):
            for key in t["chunks"]:
                depth = true_depth(store, key)
                assert depth <= max_chain
                assert store.objects.record(key).depth == depth


def test_the_newest_is_whole_and_older_checkpoints_are_deltas_of_newer_ones(tmp_path):
    with cas.open(tmp_path / "d", chunk_size=64 << 10, pack_max=4096, max_chain=3) as store, \
            cas.open(tmp_path / "p", chunk_size=64 << 10, pack_max=4096, delta=False) as plain:
        for step in range(9):
            store.save(drifting(step), step=step)
            plain.save(drifting(step), step=step)
            store.wait()
            assert all(r.base is None for r in chunk_records(store, step))  # the newest: whole
        w_chunks = [w_chunks_of(store, s) for s in range(9)]
        recs = records(store)
        # each older step a delta of the next while its chain stays within 3: steps 3 and 7 stay whole
        assert [recs[k].base for k in w_chunks[6]] == w_chunks[7]
        assert [recs[k].base for k in w_chunks[0]] == w_chunks[1]
        assert all(recs[k].base is None for k in w_chunks[3] + w_chunks[7])
        assert [true_depth(store, w_chunks[s][0]) for s in range(9)] == [3, 2, 1, 0, 3, 2, 1, 0, 0]
        assert_chains(store, 3)
        assert store.stats().stored_bytes < 0.8 * plain.stats().stored_bytes
        for step in range(9):
            assert torch.equal(store.load(step)["w"], drifting(step)["w"])
        assert store.verify().ok
        store.gc()
        assert_exactly_reachable(store)


# which of the versions v0, v1, ... (each a little away from the last) sits at x, y and z per save
MOVES = {
    "swap": [(0, 1, 2), (1, 0, 2), (0, 1, 2), (1, 0, 2)],  # two buffers trading places each save
    "rotate": [(0, 1, 2), (1, 2, 0), (2, 0, 1), (0, 1, 2)],
    "shift": [(0, 1, 2), (1, 2, 3), (2, 3, 4), (3, 4, 5)],  # a version moves on to the next slot
}


def versions(n: int, size: int = 40_000) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = [torch.randn(size, generator=g)]
    for _ in range(n - 1):
        out.append(out[-1] + 1e-3 * torch.randn(size, generator=g))
    return out


@pytest.mark.parametrize("pattern", sorted(MOVES))
def test_chunks_that_move_between_tensors_keep_the_newest_whole_and_never_loop(tmp_path, pattern):
    """Content that moves from one tensor to another between saves pairs an older chunk with a
    newer one at its position while the newest save holds the older chunk too, elsewhere. Two
    buffers that swapped places each became the other's delta (a loop: both checkpoints failed
    to load, even from an index rebuilt from disk), and a chunk that moved on became a delta in
    the newest checkpoint. Now an older chunk the newest holds stays as it is: every step
    restores bit for bit, verify passes, the newest is whole and each recorded depth is its
    chain's, also after gc and with the index rebuilt."""
    vs = versions(6)
    states = [{name: vs[v].clone() for name, v in zip("xyz", slots)} for slots in MOVES[pattern]]
    path = tmp_path / "s"
    with cas.open(path, chunk_size=64 << 10) as store:
        for step, state in enumerate(states):
            store.save(state, step=step)
            store.wait_recoding()
        assert (store._recoder.recoded > 0) == (pattern == "shift")  # only there do chunks leave the newest
        assert_chains(store, 8)
        for step, state in enumerate(states):
            assert_bits(store.load(step), state)
        assert store.verify().ok
        store.delete([1])
        store.gc()
    drop_index_files(path)
    with cas.open(path) as store:
        assert_chains(store, 8)
        for step, state in enumerate(states):
            if step != 1:
                assert_bits(store.load(step), state)


class _Position:
    tails = [None] * 4


def test_a_recode_commit_refuses_pairs_that_would_close_a_loop_or_stack_on_each_other(tmp_path):
    """The commit judges each recoded chunk against the records it indexes itself, not only
    the index: of two chunks each paired with the other only one becomes a delta; of a chain of
    pairs a -> b -> c in one commit, b's stands only if a's does not (a would sit deeper than
    its record says). Every chunk decodes, and every recorded depth is its chain's."""
    vs = versions(4)
    with cas.open(tmp_path / "s", chunk_size=1 << 20) as store:
        store.save({f"v{i}": t for i, t in enumerate(vs)}, step=0)
        keys = [store.tensors(0)[i]["chunks"][0] for i in range(4)]
        pairs = [Pair(keys[0], keys[1], 4, None, None, [], (_Position, 0)),
                 Pair(keys[1], keys[0], 4, None, None, [], (_Position, 1)),
                 Pair(keys[2], keys[3], 4, None, None, [], (_Position, 2)),
                 Pair(keys[3], keys[0], 4, None, None, [], (_Position, 3))]
        with ThreadPoolExecutor(2) as pool:
            count, _, _ = recode(store.objects, pairs, pool, "crossed pairs")
        recs = records(store)
        assert count == 2
        assert [recs[k].base is None for k in keys[:2]].count(True) == 1  # one of the crossing pair
        # one of the chain 2 -> 3 -> 0 (which one depends on the order the threads wrote them)
        assert (recs[keys[2]].base == keys[3]) != (recs[keys[3]].base == keys[0])
        for key in keys:
            assert recs[key].depth == true_depth(store, key) <= 1
        assert_bits(store.load(0), {f"v{i}": t for i, t in enumerate(vs)})
        assert store.verify().ok


def assert_bits(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for name, t in expected.items():
        assert loaded[name].view(torch.uint8).numpy().tobytes() == t.view(torch.uint8).numpy().tobytes(), name


def test_older_chunks_extrapolate_backward_from_the_two_newer_ones(tmp_path):
    """Once a chunk's newer neighbour is itself recoded, the chunk is coded again as a `linear`
    delta of that neighbour, predicted from it and the chunk above it: the newest stays whole,
    the one below it `sub`, the rest `linear` down to the keyframe."""
    for steps in (range(6), range(6, 10)):  # a reopen in mid-chain: its chains are read back from the index
        with cas.open(tmp_path / "d", chunk_size=64 << 10, pack_max=4096, max_chain=3) as store:
            for step in steps:
                store.save(smooth(step), step=step)
                store.wait()
                assert_chains(store, 3)
    with cas.open(tmp_path / "d") as store:
        codecs = [store.objects.codec_of(w_chunks_of(store, s)[0]).split("+")[0] for s in range(10)]
        assert codecs == ["linear4", "linear4", "sub4", "bytegroup4", "linear4", "linear4", "sub4", "bytegroup4",
                          "sub4", "bytegroup4"]
        for step in range(10):
            assert torch.equal(store.load(step)["w"], smooth(step)["w"])
        assert store.verify().ok
        store.gc()
        assert_exactly_reachable(store)


def test_a_rebuilt_index_keeps_the_base_of_a_linear_delta_a_delta_when_a_whole_copy_lies_beside_it(tmp_path):
    """A `linear` delta extrapolates from its base's own base, so its base must stay a delta. When
    a second writer left a whole copy of that base in a pack of its own (a dead duplicate, until
    gc compacts it), an index rebuilt from disk would prefer the whole copy, and the older
    checkpoint would read as damaged: the rebuild reads the delta's header and keeps the base's
    delta copy."""
    path = tmp_path / "d"
    with cas.open(path, chunk_size=64 << 10, max_chain=3) as store:
        for step in range(4):
            store.save(smooth(step), step=step)
            store.wait()
        top = w_chunks_of(store, 0)[0]
        assert store.objects.codec_of(top).startswith("linear")
        base = store.objects.record(top).base
        raw = store.objects.get(base)
        whole = store.objects.codec.encode(raw, 4)
        assert whole.base is None
        store.objects.packs.write([(base, b"".join(bytes(p) for p in whole.parts), raw.size, None)])
    drop_index_files(path)
    with cas.open(path) as store:
        assert store.objects.record(base).base is not None
        for step in range(4):
            assert torch.equal(store.load(step)["w"], smooth(step)["w"])
        assert store.verify().ok


def test_keyframes_are_coded_again_whole_with_zstds_own_parameters_when_smaller(tmp_path):
    """An older chunk that stays whole (its chain is full) is read rarely: the recode codes it
    again with zstd's own level-1 parameters where those beat the fast float ones (here: blocks
    repeated far apart inside a chunk, which the float parameters' tiny hash table misses)."""
    block = torch.randn(4096, generator=torch.Generator().manual_seed(0))  # how much the float
    # parameters miss depends on the block (0.59-0.93 of their size over seeds 0-9): seeded, not the
    # global generator, whose state other tests on the same worker leave behind

    def state(step: int) -> dict:
        w = block.repeat(64).clone()  # 1 MiB: 16 chunks of 64 KiB, each 4 copies of one block
        w[::1000] += step  # every chunk changes at every step
        return {"w": w}

    for pack_max in (None, 4096):
        with cas.open(tmp_path / f"s{pack_max}", chunk_size=64 << 10, pack_max=pack_max, max_chain=1) as store:
            for step in range(3):
                store.save(state(step), step=step)
            store.wait()
            recs = records(store)
            newest, keyframe = (recs[w_chunks_of(store, s)[0]] for s in (2, 1))
            assert keyframe.base is None and newest.base is None
            assert keyframe.stored_size < 0.7 * newest.stored_size
            own = store.objects.codec.encode(store.objects.get(w_chunks_of(store, 1)[0]), 4, floats=False)
            assert keyframe.stored_size == own.size  # what zstd's own parameters give, exactly
            assert store.objects.codec_of(w_chunks_of(store, 1)[0]) == "bytegroup4+zstd"
            assert recs[w_chunks_of(store, 0)[0]].base == w_chunks_of(store, 1)[0]
            for step in range(3):
                assert torch.equal(store.load(step)["w"], state(step)["w"])
            assert store.verify().ok
            store.gc()
            assert_exactly_reachable(store)


def repack_as_read(store, key: bytes, rec, blob: bytes) -> None:
    """What gc's repacking does with an entry it read as `rec` (bytes `blob`): copy it, commit."""
    with store.objects.session("gc repack") as session:
        session.hold([key])
        session.write_encoded(key, blob, rec)
        session.commit(lambda txn: None)


def test_a_gc_move_read_before_a_recode_does_not_undo_it(tmp_path):
    """gc's repacking copies an entry as it was when read; if a recode made that object a delta
    meanwhile (and coded the chunk below it against that), the copy does not stand."""
    with cas.open(tmp_path / "d", chunk_size=64 << 10, pack_max=4096) as store:
        for step in range(2):
            store.save(smooth(step), step=step)
        store.wait()
        key = w_chunks_of(store, 1)[0]
        stale, blob = store.objects.record(key), bytes(store.objects.fetch(key))
        assert stale.base is None
        store.save(smooth(2), step=2)  # step 1 becomes a delta of step 2, step 0 extrapolates from both
        store.wait()
        assert store.objects.codec_of(w_chunks_of(store, 0)[0]).startswith("linear")
        repack_as_read(store, key, stale, blob)
        assert store.objects.record(key).base == w_chunks_of(store, 2)[0]
        for step in range(3):
            assert torch.equal(store.load(step)["w"], smooth(step)["w"])
        assert store.verify().ok


def test_content_that_comes_back_is_made_whole_in_the_newest(tmp_path):
    """A run resumed from an earlier step saves again what it saved before, whose chunks its
    recodes made deltas of the chunks that followed. The newest checkpoint must decode without
    a chain, so they are made whole again and spliced out of the chains through them (the
    deltas recorded against them are coded against their bases instead; a `linear` delta
    standing on one of those, which read its base, is coded again as `sub`): every step
    restores bit for bit, every chain stays within max_chain and every recorded depth is its
    chain's, also after a reopen, a deletion, gc and an index rebuilt from disk."""
    path = tmp_path / "d"
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        for step in range(7):
            store.save(comeback(step), step=step)
            store.wait()
            assert_chains(store, 8)  # step 6 (smooth(2) again) included: the newest is whole
        assert store._recoder.promoted == len(w_chunks_of(store, 6))  # every chunk of w; b is no delta
        # smooth(2) is spliced out of the chain 0 -> 1 -> 2 -> 3: step 1 is coded against step 3
        # instead, and step 0, a `linear` delta of step 1 (reading step 1's base), as `sub`
        recs = records(store)
        assert [recs[k].base for k in w_chunks_of(store, 1)] == w_chunks_of(store, 3)
        assert [recs[k].base for k in w_chunks_of(store, 0)] == w_chunks_of(store, 1)
        assert [store.objects.codec_of(w_chunks_of(store, s)[0]).split("+")[0] for s in (0, 1, 2)] == \
            ["sub4", "sub4", "bytegroup4"]
    with cas.open(path) as store:  # a reopen: the chains are read back from the index
        for step in (7, 8):
            store.save(comeback(step), step=step)
            store.wait()
            assert_chains(store, 8)
        for step in range(9):
            assert_bits(store.load(step), comeback(step))
        assert store.verify().ok
        store.delete([3])
        store.gc()
        assert_exactly_reachable(store)
    drop_index_files(path)
    with cas.open(path) as store:
        assert_chains(store, 8)
        for step in set(range(9)) - {3}:
            assert_bits(store.load(step), comeback(step))
        assert store.verify().ok


def test_a_gc_move_read_before_a_promotion_does_not_undo_it(tmp_path):
    """A promotion codes a `linear` delta again as `sub` on the same base (now whole): gc's copy
    of the `linear` entry, read before, names the same base, so the base check alone let it
    stand, and the older checkpoint could not decode. A move stands only while the index still
    places the copy it read."""
    with cas.open(tmp_path / "d", chunk_size=64 << 10, pack_max=4096) as store:
        for step in range(6):
            store.save(comeback(step), step=step)
            store.wait()
        key = w_chunks_of(store, 0)[0]
        stale, blob = store.objects.record(key), bytes(store.objects.fetch(key))
        assert store.objects.codec_of(key).startswith("linear")
        store.save(comeback(6), step=6)  # smooth(2) again: spliced out, step 0 `sub` on step 1
        store.wait()
        assert store.objects.codec_of(key).startswith("sub")
        repack_as_read(store, key, stale, blob)
        assert store.objects.codec_of(key).startswith("sub")
        for step in range(7):
            assert_bits(store.load(step), comeback(step))
        assert store.verify().ok


def test_a_copied_linear_delta_whose_base_the_destination_holds_whole_is_coded_again(tmp_path):
    """push copies objects as they are encoded; a `linear` delta reads its base's base, so where
    the destination holds that base otherwise (whole, saved there itself) it is coded again."""
    with cas.open(tmp_path / "src", chunk_size=64 << 10, pack_max=4096) as src, \
            cas.open(tmp_path / "dst", chunk_size=64 << 10, delta=False) as dst:
        for step in range(3):
            src.save(smooth(step), step=step)
        src.wait()
        assert src.objects.codec_of(w_chunks_of(src, 0)[0]).startswith("linear")
        dst.save(smooth(1), step=101)  # step 1's chunks, whole
        src.push(dst, steps=[0])
        assert torch.equal(dst.load(0)["w"], smooth(0)["w"])
        assert dst.verify().ok
        src.push(dst)
        for step in range(3):
            assert torch.equal(dst.load(step)["w"], smooth(step)["w"])
        assert dst.verify().ok


def test_a_reopened_store_recodes_the_latest_checkpoint_knowing_its_chain(tmp_path):
    path = tmp_path / "s"
    for steps in (range(0, 3), range(3, 5), range(5, 9)):
        with cas.open(path, chunk_size=64 << 10, max_chain=3) as store:
            for step in steps:
                store.save(drifting(step), step=step)
    with cas.open(path) as store:
        w = [w_chunks_of(store, s)[0] for s in range(9)]
        depths = [true_depth(store, k) for k in w]
        assert depths[-1] == 0 and max(depths) == 3
        assert sum(d > 0 for d in depths) >= 6  # the saves after each reopen recoded the latest too
        assert_chains(store, 3)
        for step in range(9):
            assert torch.equal(store.load(step)["w"], drifting(step)["w"])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(FLOATS), chain=chains, rows=st.sampled_from([40, 300]),
       removed=st.sets(st.integers(0, 6)), memory=st.sampled_from([None, 0]), max_chain=st.sampled_from([1, 2, 4]),
       back=st.dictionaries(st.integers(2, 6), st.integers(0, 4), max_size=2))
def test_any_series_restores_bit_for_bit_after_gc_removed_any_subset(tmp_path_factory, dtype, chain, rows,
                                                                     removed, memory, max_chain, back):
    """memory 0: no bytes kept in memory; every recode reads both chunks back from the store.
    back: steps that save an earlier step's tensor again (content that comes back)."""
    path = tmp_path_factory.mktemp("recode") / "s"
    torch.manual_seed(0)
    t = torch.randn(rows, 512).to(TORCH_DTYPES[dtype])
    history, prev = {}, None
    with cas.open(path, chunk_size=64 << 10, pack_max=4096, max_chain=max_chain, delta_memory=memory) as store:
        for step, spec in enumerate(chain):
            t, prev = (history[back[step]].clone() if back.get(step, step) < step else next_state(t, prev, *spec)), t
            store.save({"w": t, "n": step}, step=step)
            history[step] = t.clone()
        store.wait()
        assert_chains(store, max_chain)
        for step, expected in history.items():
            assert store.load(step)["w"].view(torch.uint8).equal(expected.view(torch.uint8))
        gone = sorted(removed & set(history))
        store.delete(gone)
        store.gc()
        assert store.verify().ok
        for ck in store.checkpoints():
            assert store.load(ck.step)["w"].view(torch.uint8).equal(history[ck.step].view(torch.uint8))
        assert_exactly_reachable(store)


@pytest.mark.parametrize("point", RECODE_POINTS)
def test_a_kill_at_every_phase_of_a_recode_loses_nothing(tmp_path, point):
    path = tmp_path / "s"
    env = dict(os.environ, CAS_FAULTS=f"{point}=kill")  # the first recode: step 0 against step 1
    done = subprocess.run([sys.executable, WORKERS, "recode_series", str(path), "4"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        assert [ck.step for ck in store.checkpoints()] == [0, 1]
        for step in (0, 1):
            assert torch.equal(store.load(step)["w"], drifting(step)["w"])
        assert store.verify().ok
        store.gc()  # what the kill left (a pack no record names, a superseded file) goes
        assert_exactly_reachable(store)
        for step in (2, 3):  # and the series goes on, recoding as before
            store.save(drifting(step), step=step)
        store.wait()
        assert_chains(store, store.max_chain)
        for step in range(4):
            assert torch.equal(store.load(step)["w"], drifting(step)["w"])
        assert store.verify().ok
        store.gc()
        assert_exactly_reachable(store)


def test_one_gc_takes_the_file_a_killed_recode_superseded_when_it_sweeps_that_object(tmp_path):
    """A recode killed after its commit leaves whole copies whose records place them in its pack
    now. When the checkpoint that needed them is removed, the sweep dropped their records and
    left the files (an object in a pack loses only its record), which only the next gc took as
    orphans: one gc left a store that was not exactly the reachable objects (the 600 s soak of
    stop 39 and 40)."""
    from cas.index import WHERE_PACK

    path = tmp_path / "s"
    env = dict(os.environ, CAS_FAULTS="recode.committed=kill")  # the first recode: step 0 against step 1
    done = subprocess.run([sys.executable, WORKERS, "recode_series", str(path), "4"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        with store.index.read() as txn:
            superseded = [k for k in store.objects.files.iterate()
                          if store.index.record(txn, k) is not None and store.index.record(txn, k).where == WHERE_PACK]
        assert superseded  # what the kill left
        store.delete([0])
        store.gc()
        assert_exactly_reachable(store)
        assert torch.equal(store.load(1)["w"], drifting(1)["w"])


@pytest.mark.parametrize("lose_index", [False, True])
@pytest.mark.parametrize("point", PROMOTE_POINTS)
def test_a_kill_at_every_phase_of_a_promotion_loses_nothing(tmp_path, point, lose_index):
    """A kill while the chunks that came back in step 6 are made whole again (before or after
    its commit, the superseded copies still on disk), even with the index then rebuilt from
    disk (both copies of two levels lie there), loses nothing, and the series goes on whole."""
    killed_series_goes_on(tmp_path / "s", f"{point}=kill", "comeback", 9, 7, lose_index)


def killed_series_goes_on(path, fault: str, series: str, total: int, committed: int, lose_index: bool) -> None:
    """Run workers.py's `series` for `total` steps, killed at `fault`; then (the index lost or not)
    its first `committed` steps are there, load bit for bit and verify, gc leaves exactly what
    they need, and the series goes on to `total` steps with its chains within max_chain."""
    state = {"smooth": smooth, "comeback": comeback}[series]
    env = dict(os.environ, CAS_FAULTS=fault)
    done = subprocess.run([sys.executable, WORKERS, "recode_series", str(path), str(total), series], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    if lose_index:
        drop_index_files(path)
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        assert [ck.step for ck in store.checkpoints()] == list(range(committed))
        for step in range(committed):
            assert_bits(store.load(step), state(step))
        assert store.verify().ok
        store.gc()
        assert_exactly_reachable(store)
        for step in range(committed, total):
            store.save(state(step), step=step)
            store.wait()
        assert_chains(store, store.max_chain)
        for step in range(total):
            assert_bits(store.load(step), state(step))
        assert store.verify().ok
        store.gc()
        assert_exactly_reachable(store)


@pytest.mark.parametrize("lose_index", [False, True])
@pytest.mark.parametrize("point", RECODE_POINTS + RELINK_POINTS)
def test_a_kill_at_every_phase_of_a_recode_that_relinks_loses_nothing(tmp_path, point, lose_index):
    """The second recode (step 1 against step 2) is followed by a relink of step 0 (extrapolating
    from steps 1 and 2) once step 1's whole copy is gone; a kill anywhere in either, even with
    the index then rebuilt from what is on disk, loses nothing."""
    at = "" if point in RELINK_POINTS else "@2"
    killed_series_goes_on(tmp_path / "s", f"{point}=kill{at}", "smooth", 5, 3, lose_index)
    with cas.open(tmp_path / "s") as store:
        assert store.objects.codec_of(w_chunks_of(store, 2)[0]).startswith("linear")


def test_loads_of_an_old_checkpoint_while_it_is_recoded_never_fail(tmp_path):
    """A reader that looked a chunk's file up just before a recode moved it into a pack looks
    again (ObjectStore.fetch)."""
    with cas.open(tmp_path / "s", chunk_size=64 << 10) as store:
        store.save(drifting(0), step=0)
        stop, errors = threading.Event(), []

        def reader() -> None:
            while not stop.is_set():
                try:
                    assert torch.equal(store.load(0)["w"], drifting(0)["w"])
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    return
        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for step in range(1, 6):
                store.save(drifting(step), step=step)
                store.wait()
        finally:
            stop.set()
            thread.join()
        assert not errors, errors[0]
        assert store.objects.record(w_chunks_of(store, 0)[0]).base is not None


def test_deleting_the_newest_keeps_its_chunks_as_the_bases_of_the_one_before(tmp_path):
    with cas.open(tmp_path / "s", chunk_size=64 << 10) as store:
        for step in range(3):
            store.save(drifting(step), step=step)
        store.wait()
        store.delete([2])
        report = store.gc()
        assert report.live_objects > 0
        assert store.verify().ok
        assert torch.equal(store.load(1)["w"], drifting(1)["w"])
        assert_exactly_reachable(store)


def test_the_delta_option_is_checked():
    with pytest.raises(CasError, match='delta must be True'):
        cas.store.options.StoreOptions(delta="backward")
    with pytest.raises(CasError, match='delta must be True'):
        cas.store.options.StoreOptions(delta=1)
    assert cas.store.options.StoreOptions().delta is True
    options = cas.store.options.StoreOptions
    assert options().chain_limit() == 8 and options(delta="forward").chain_limit() == 4  # the newest is deepest there
    assert options(delta="forward", max_chain=6).chain_limit() == 6
    assert options.of(options(), delta="forward").chain_limit() == 4
    with pytest.raises(CasError, match="max_chain must be"):
        options(max_chain=65)


def test_dcp_saves_are_written_whole_and_the_coordinator_recodes_the_one_before(tmp_path):
    """DCP's own save flow (dcp.save through CasWriter, no process group): each save's chunks are
    whole; after its commit the coordinator recodes the previous checkpoint against it."""
    import cas.store.dcp as cdcp

    with cas.open(tmp_path / "s", chunk_size=64 << 10) as store:
        for step in range(4):
            cdcp.save(drifting(step), store, step, no_dist=True)
            store.wait()
            assert all(r.base is None for r in chunk_records(store, step))
        assert all(store.objects.record(k).base is not None for k in w_chunks_of(store, 2, "tensors.w.0"))
        assert_chains(store, store.max_chain)
        assert store.verify().ok
    for step in range(4):
        target = {k: torch.zeros_like(v) for k, v in drifting(step).items()}
        cdcp.load(target, tmp_path / "s", step, no_dist=True)
        assert torch.equal(target["w"], drifting(step)["w"])


def test_dcp_saves_of_content_that_comes_back_are_made_whole_and_others_scan_nothing(tmp_path, monkeypatch):
    """The coordinator's commit knows which chunks were stored before the save (the ranks'
    chunks its session adopted as held) and passes them to the recode, as Store.save does: the
    content that came back is made whole in the newest, and a save with none reads no reverse
    map of the index's deltas (a full scan of its records, at every DCP save before)."""
    import cas.store.dcp as cdcp
    from cas.index import Index

    scans = []
    whole_scan = Index.delta_children
    monkeypatch.setattr(Index, "delta_children", lambda self, txn: scans.append(1) or whole_scan(self, txn))
    with cas.open(tmp_path / "s", chunk_size=64 << 10, pack_max=4096) as store:
        for step in range(8):
            cdcp.save(comeback(step), store, step, no_dist=True)
            store.wait()
            assert_chains(store, store.max_chain)
            assert bool(scans) == (step >= 6)  # steps 6 and 7 save smooth(2) and smooth(3) again
            scans.clear()
        assert store._recoder.promoted == 2 * len(w_chunks_of(store, 6, "tensors.w.0"))
        assert store.verify().ok
    for step in range(8):
        target = {k: torch.zeros_like(v) for k, v in comeback(step).items()}
        cdcp.load(target, tmp_path / "s", step, no_dist=True)
        assert_bits(target, comeback(step))


def test_an_encrypted_store_recodes_too(tmp_path):
    key = bytes(range(32))
    with cas.open(tmp_path / "s", key=key, chunk_size=64 << 10) as store:
        for step in range(3):
            store.save(drifting(step), step=step)
        store.wait()
        assert all(store.objects.record(k).base is not None for k in w_chunks_of(store, 0))
        assert store.verify().ok
    with cas.open(tmp_path / "s", key=key) as store:
        for step in range(3):
            assert torch.equal(store.load(step)["w"], drifting(step)["w"])



def test_a_pack_a_save_held_while_its_recode_compacted_is_compacted_by_the_next_recode(tmp_path):
    """A recode's compaction leaves alone a pack whose entries a save in progress holds; the next
    recode compacts it, so its space still comes back without a gc."""
    def state(step: int) -> dict:
        return {**drifting(step), "c": tensor(7)}  # "c" never changes: every save holds its chunk

    recode_gate, save_gate = str(tmp_path / "recode"), str(tmp_path / "save")
    faults.configure(f"recode.encoded=pause:{recode_gate}@1,save.chunks_written=pause:{save_gate}@3")
    try:
        with cas.open(tmp_path / "d", chunk_size=64 << 10) as store:
            store.save(state(0), step=0)
            store.save(state(1), step=1)
            wait_for(recode_gate + ".reached")  # step 0's recode has encoded, not committed
            third = threading.Thread(target=store.save, args=(state(2),), kwargs={"step": 2})
            third.start()
            wait_for(save_gate + ".reached")  # step 2's save holds its chunks, "c"'s among them
            c_key = next(t["chunks"][0] for t in store.tensors(1) if t["path"] == "c")
            first_pack = records(store)[c_key].pack
            open(recode_gate, "w").close()
            store.wait_recoding()  # its compaction had to leave step 0's pack, dead entries and all
            assert store.objects.packs.size(first_pack) is not None
            open(save_gate, "w").close()
            third.join()
            store.wait()
            assert store.objects.packs.size(first_pack) is None  # rewritten without its dead entries
            assert records(store)[c_key].pack != first_pack
            for step in range(3):
                assert torch.equal(store.load(step)["w"], state(step)["w"])
            assert store.verify().ok
    finally:
        faults.configure("")


def test_chunks_a_recode_held_while_retention_removed_their_checkpoint_are_swept_when_it_ends(tmp_path):
    """Retention after a save removes a checkpoint whose chunks the recode then running holds;
    the sweep it had to skip runs once that recode has ended, without another save."""
    gate = str(tmp_path / "recode")
    faults.configure(f"recode.encoded=pause:{gate}@1")
    try:
        with cas.open(tmp_path / "d", chunk_size=64 << 10, retention=Retention(keep_last=2)) as store:
            store.save(drifting(0), step=0)
            store.save(drifting(1), step=1)
            wait_for(gate + ".reached")  # step 0's recode holds step 0's chunks
            store.save(drifting(2), step=2)  # its retention removes step 0 and must leave them
            assert [ck.step for ck in store.checkpoints()] == [1, 2]
            open(gate, "w").close()
            store.wait()
            assert_exactly_reachable(store)
            for step in (1, 2):
                assert torch.equal(store.load(step)["w"], drifting(step)["w"])
    finally:
        faults.configure("")


def test_the_space_of_the_full_copies_a_recode_supersedes_comes_back_without_a_gc(tmp_path):
    """Chunks stream into packs; once a checkpoint's chunks are recoded, the pack holding their
    full copies is mostly dead and is compacted right after the recode."""
    def on_disk(path) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path / "packs") for f in fs)

    with cas.open(tmp_path / "d", chunk_size=64 << 10) as store, \
            cas.open(tmp_path / "p", chunk_size=64 << 10, delta=False) as plain:
        for step in range(6):
            store.save(drifting(step), step=step)
            plain.save(drifting(step), step=step)
        store.wait()
        assert on_disk(tmp_path / "d") < 0.85 * on_disk(tmp_path / "p")
        assert on_disk(tmp_path / "d") < 1.1 * store.stats().stored_bytes
        for step in range(6):
            assert torch.equal(store.load(step)["w"], drifting(step)["w"])
        assert store.verify().ok


def test_packs_a_recode_left_mostly_live_are_rewritten_until_dead_bytes_are_at_most_5_percent(tmp_path):
    """A recode leaves the pack of the save before partly dead; its own compaction takes only
    packs under half live, so a store with deltas held more on disk than its live bytes until a
    gc. After each recode the store's packs are now rewritten most dead first, down to
    MAX_UNUSED of the live bytes, with no gc called."""
    from cas.gc.bucket import MAX_UNUSED
    from cas.packs import PACK_TARGET
    from helpers import adamw_series

    states = adamw_series(5, width=1536)  # 29 MB a save: one pack past PACK_TARGET, compacted only under half live
    with cas.open(tmp_path / "s") as store:
        on_disk = lambda: sum(store.objects.packs.sizes().values())  # noqa: E731
        for step, state in enumerate(states):
            store.save(state, step=step)
            store.wait()
            assert on_disk() <= (1 + MAX_UNUSED) * store.stats().stored_bytes + 64 * store.stats().num_objects, step
        assert store.get(0).logical_bytes > PACK_TARGET
        assert store._recoder.recoded > 0
        report = store.gc()
        assert report.packs_rewritten == 0  # nothing left to it
        for step, state in enumerate(states):
            assert_same(store.load(step), state)
        assert store.verify().ok
        assert_exactly_reachable(store)


GC_RACE_SAVER = """
import sys, cas
sys.path.insert(0, sys.argv[2])
from workers import drifting
with cas.open(sys.argv[1], chunk_size=64 << 10, pack_max=4096) as store:
    store.save(drifting(0), step=0)
    store.wait()
    store.pin(0)
    store.save(drifting(1), step=1)  # its recode (step 0 against step 1) pauses before it holds anything
    store.wait()
"""


def test_a_recode_committed_between_a_gcs_mark_and_its_sweep_keeps_its_new_base(tmp_path):
    """gc marks; step 1 is gone, so its chunks are not marked; a recode then codes the pinned
    step 0 as deltas of them and commits; gc's sweep sees the index moved and marks the new
    roots, which were none: the new base edges must be followed too, or step 0 loses its bases."""
    from helpers import outcome_of

    path, a_gate, b_gate = tmp_path / "s", tmp_path / "a", tmp_path / "b"
    env = dict(os.environ, CAS_FAULTS=f"recode.started=pause:{a_gate}")
    saver = subprocess.Popen([sys.executable, "-c", GC_RACE_SAVER, str(path), os.path.dirname(__file__)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(f"{a_gate}.reached", 120)
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        store.delete(1)  # its chunks are garbage now, unless step 0 becomes their delta
        faults.configure(f"gc.marked=pause:{b_gate}")
        try:
            result: list = []
            sweeper = threading.Thread(target=lambda: result.append(outcome_of(store.gc)))
            sweeper.start()
            wait_for(f"{b_gate}.reached", 120)
            a_gate.touch()  # the recode holds, codes step 0 against step 1's chunks and commits
            _, err = saver.communicate(timeout=120)
            b_gate.touch()
            sweeper.join(120)
        finally:
            faults.configure("")
        assert saver.returncode == 0, err[-2000:]
        assert not isinstance(result[0], Exception), result
        assert any(store.objects.record(k).base is not None for k in w_chunks_of(store, 0))  # the recode stood
        assert torch.equal(store.load(0)["w"], drifting(0)["w"])
        assert store.verify().ok


def test_a_store_with_retention_keeps_its_dead_bytes_within_5_percent_without_a_gc(tmp_path):
    """Retention after each save sweeps on the save's path, and the rewrites for space follow on
    the recode thread: once the background work is done, the disk holds at most MAX_UNUSED more
    than the live bytes, with no `cas gc` run."""
    from cas.gc.bucket import MAX_UNUSED
    from helpers import adamw_series

    states = adamw_series(5, width=1536)
    with cas.open(tmp_path / "s", retention=Retention(keep_last=10)) as store:  # (removes nothing here)
        for step, state in enumerate(states):
            store.save(state, step=step)
        store.wait()
        on_disk = sum(store.objects.packs.sizes().values())
        assert on_disk <= (1 + MAX_UNUSED) * store.stats().stored_bytes + 64 * store.stats().num_objects
        for step, state in enumerate(states):
            assert_same(store.load(step), state)
        assert store.verify().ok
