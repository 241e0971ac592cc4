"""Delta chains: any chain of states (some steps repeating the last one's motion, which `linear`
deltas extrapolate) restores bit for bit, also after gc removed the checkpoints that held the
bases; chains stay bounded; verify checks every link; deltas are integer differences (`sub`) or
differences from a linear prediction, and XOR deltas written by earlier versions still decode."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gc import assert_exactly_reachable

import cas
from cas.codecs import STAGE_BYTEGROUP, STAGE_XOR, STAGE_ZSTD, CodecPolicy, _header, decode_into
from cas.hashing import hash_bytes
from cas.store.tensors import TORCH_DTYPES

FLOATS = ["float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2", "complex64"]
SPECIALS = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0]


def evolve(t: torch.Tensor, seed: int, scale: float, frac: float) -> torch.Tensor:
    """A training-like change: a fraction of the elements move by `scale`, plus a few specials."""
    g = torch.Generator().manual_seed(seed)
    wide = t.to(torch.complex128 if t.is_complex() else torch.float64)
    mask = torch.rand(t.shape, generator=g) < frac
    step = torch.randn(t.shape, generator=g, dtype=torch.float64) * scale
    out = torch.where(mask, wide + step, wide)
    if t.numel() > 4:
        flat = out.reshape(-1)
        for i, v in enumerate(SPECIALS[: t.numel() // 1000 + 1]):
            flat[(seed * 7919 + i * 104729) % t.numel()] = v
    return out.to(t.dtype)


def next_state(t: torch.Tensor, prev: torch.Tensor | None, seed: int, scale: float, frac: float,
               keeps_moving: bool) -> torch.Tensor:
    """One step of a generated chain: `evolve`, after repeating the last step's motion when
    `keeps_moving` (what `linear` deltas predict)."""
    if keeps_moving and prev is not None:
        wide = (lambda x: x.to(torch.complex128 if x.is_complex() else torch.float64))  # noqa: E731
        t = (2 * wide(t) - wide(prev)).to(t.dtype)
    return evolve(t, seed, scale, frac)


chains = st.lists(st.tuples(st.integers(0, 2**31), st.sampled_from([1e-6, 1e-3, 1.0]),
                            st.sampled_from([0.0, 0.01, 0.5, 1.0]), st.booleans()), min_size=2, max_size=7)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(FLOATS), chain=chains, rows=st.sampled_from([40, 300]),
       gc_keep=st.integers(1, 3), memory=st.sampled_from([None, 0]))
def test_any_chain_of_states_restores_bit_for_bit_also_after_gc(tmp_path_factory, dtype, chain, rows, gc_keep,
                                                                memory):
    """memory 0: no bytes of the last save are kept; every base is decoded from the store."""
    path = tmp_path_factory.mktemp("delta") / "s"
    torch.manual_seed(0)
    t = torch.randn(rows, 512).to(TORCH_DTYPES[dtype])
    history, prev = {}, None
    with cas.open(path, chunk_size=64 << 10, pack_max=4096, delta="forward", max_chain=3,
                  delta_memory=memory) as store:
        for step, spec in enumerate(chain):
            t, prev = next_state(t, prev, *spec), t
            store.save({"w": t, "n": step}, step=step)
            history[step] = t.clone()
        for step, expected in history.items():
            assert store.load(step)["w"].view(torch.uint8).equal(expected.view(torch.uint8))
        store.gc(keep_last=gc_keep)
        assert store.verify().ok
        for ck in store.checkpoints():
            assert store.load(ck.step)["w"].view(torch.uint8).equal(history[ck.step].view(torch.uint8))
        assert_exactly_reachable(store)
    with cas.open(path) as reopened:  # a fresh process has no base cache: decoding needs none
        last = max(history)
        assert reopened.load(last)["w"].view(torch.uint8).equal(history[last].view(torch.uint8))


def _records(store):
    with store.index.read() as txn:
        return dict(store.index.iter_records(txn))


def test_small_changes_are_stored_as_deltas_and_chains_are_bounded(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    with cas.open(tmp_path / "s", chunk_size=256 << 10, delta="forward", max_chain=3) as store:
        sizes = []
        for step in range(9):
            w = w + 1e-4 * torch.randn_like(w)
            sizes.append(store.save({"w": w}, step=step).new_bytes)
        records = _records(store)
        chunk = [[records[k] for k in t["chunks"]] for t in (store.tensors(step)[0] for step in range(9))]
        assert max(r.depth for c in chunk for r in c) == 3
        assert sizes[1] < 0.6 * sizes[0]  # a delta costs well under a full object
        # step 4: the chain is full, so its chunks are coded against the chain's root (step 0's)
        roots = store.tensors(0)[0]["chunks"]
        assert [r.base for r in chunk[4]] == roots and {r.depth for r in chunk[4]} == {1}
        assert sizes[4] < 0.9 * sizes[0]
        assert store.verify().ok and store.verify(quick=True).ok
        for step in (4, 8):
            store.load(step)


def test_deltas_are_not_used_where_they_lose(tmp_path):
    """Random data changed entirely: the sample says the delta is no smaller, so full objects."""
    with cas.open(tmp_path / "s", chunk_size=256 << 10, delta="forward") as store:
        store.save({"w": torch.randn(256, 1024)}, step=1)
        store.save({"w": torch.randn(256, 1024)}, step=2)
        assert all(r.base is None for r in _records(store).values())


def test_a_missing_base_is_reported_for_every_checkpoint_that_needs_it(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    with cas.open(tmp_path / "s", chunk_size=256 << 10, pack_max=4096, delta="forward") as store:
        store.save({"w": w}, step=1)
        store.save({"w": w + 1e-4}, step=2)
        base_key = store.tensors(1)[0]["chunks"][0]
        assert _records(store)[store.tensors(2)[0]["chunks"][0]].base == base_key
        os.unlink(store.objects.files.path(base_key))
        report = store.verify()
        assert report.damaged_steps == [1, 2]
        assert any("delta base" in p.message for p in report.problems if p.step == 2)
        assert store.verify(quick=True).damaged_steps == [1, 2]
        with pytest.raises(cas.CorruptionError, match="delta base"):
            store.load(2)


def test_async_saves_use_deltas_too(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    with cas.open(tmp_path / "s", chunk_size=256 << 10, delta="forward") as store:
        store.save_async({"w": w}, step=1).result()
        w.add_(1e-5)
        ck = store.save_async({"w": w}, step=2).result()
        assert ck.new_bytes < 0.6 * ck.logical_bytes
        assert torch.equal(store.load(2)["w"], w)


def test_integer_tensors_are_never_deltas(tmp_path):
    with cas.open(tmp_path / "s", chunk_size=256 << 10, delta="forward") as store:
        a = torch.arange(1 << 17, dtype=torch.int64)
        store.save({"a": a}, step=1)
        store.save({"a": a + 1}, step=2)
        assert all(r.base is None for r in _records(store).values())
        assert torch.equal(store.load(2)["a"], a + 1)


def test_deltas_are_integer_differences_and_smaller_than_xor_on_float_drift(tmp_path):
    """A weight drifting by a few units in the last place: the zigzag integer difference codes
    it smaller than XOR would (the reason `sub` replaced `xor`), and it is what the store writes."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g)
    w2 = w * (1 + 1e-3 * torch.randn(w.shape, generator=g))
    raw, base = w2.numpy().view(np.uint8).reshape(-1), w.numpy().view(np.uint8).reshape(-1)
    sub = CodecPolicy().encode(raw, 4, (hash_bytes(base), base))
    xor = CodecPolicy()._pack(np.bitwise_xor(raw, base), 4)
    assert sub.base is not None and sub.size < 0.95 * len(xor)
    with cas.open(tmp_path / "s", chunk_size=1 << 20, delta="forward") as store:
        store.save({"w": w}, step=1)
        store.save({"w": w2}, step=2)
        key = store.tensors(2)[0]["chunks"][0]
        assert store.objects.codec_of(key) == "sub4+bytegroup4+zstd"
        # object format 2 marks objects that need a reader that knows `sub`; the rest stay 1
        assert bytes(store.objects.fetch(key))[4] == 2
        assert bytes(store.objects.fetch(store.tensors(1)[0]["chunks"][0]))[4] == 1
        assert torch.equal(store.load(2)["w"], w2)


def test_xor_deltas_of_earlier_versions_still_decode():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4096, generator=g).numpy().view(np.uint8).reshape(-1)
    raw = (torch.from_numpy(base.copy()).view(torch.float32) + 1e-4).numpy().view(np.uint8).reshape(-1)
    payload = CodecPolicy()._pack(np.bitwise_xor(raw, base), 4)
    stages = ((STAGE_XOR, 0), (STAGE_BYTEGROUP, 4), (STAGE_ZSTD, 1))
    blob = _header(raw.size, stages, hash_bytes(base)) + payload
    out = decode_into(blob, hash_bytes(raw), None, base)
    assert np.array_equal(out, raw)


def test_repair_rebuilds_delta_records_and_gc_still_keeps_bases(tmp_path):
    """Deltas in files and in packs: after the index is rebuilt from disk, every chain is known
    again (base and depth), so loads work and gc keeps the bases of kept checkpoints."""
    from cas.store.repair import repair
    torch.manual_seed(0)
    big, small = torch.randn(256, 1024), torch.randn(64, 1024)
    path = tmp_path / "s"
    with cas.open(path, chunk_size=256 << 10, pack_max=64 << 10, delta="forward", max_chain=3) as store:
        for step in range(4):
            big, small = big + 1e-5 * torch.randn_like(big), small + 1e-7
            store.save({"big": big, "small": small}, step=step)
        before = {k: (r.base, r.depth) for k, r in _records(store).items() if r.base}
        assert any(r.where == 2 and r.base for r in _records(store).values())  # a delta in a pack
        assert max(d for _, d in before.values()) == 3
    os.rename(path / "index", tmp_path / "old-index")
    report = repair(str(path))
    assert report.checkpoints == [0, 1, 2, 3] and all(s.startswith("index:") for s in report.skipped)
    with cas.open(path) as store:
        assert {k: (r.base, r.depth) for k, r in _records(store).items() if r.base} == before
        store.gc(keep_last=1)
        assert store.verify().ok
        loaded = store.load(3)
        assert torch.equal(loaded["big"], big) and torch.equal(loaded["small"], small)


def test_a_base_shared_by_several_chunks_is_decoded_once_per_load(tmp_path, monkeypatch):
    """Two tensors equal at step 1 (one object) change differently at step 2: both chunks are
    deltas of that one base, which the load reads and decodes once."""
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    with cas.open(tmp_path / "s", chunk_size=1 << 20, delta="forward") as store:
        store.save({"a": w, "b": w.clone()}, step=1)
        a2, b2 = w + 1e-4, w - 1e-4
        store.save({"a": a2, "b": b2}, step=2)
        base = store.tensors(1)[0]["chunks"][0]
        assert {_records(store)[t["chunks"][0]].base for t in store.tensors(2)} == {base}
        fetched = []
        real_fetch = store.objects.fetch
        monkeypatch.setattr(store.objects, "fetch", lambda key: fetched.append(key) or real_fetch(key))
        loaded = store.load(2)
        assert torch.equal(loaded["a"], a2) and torch.equal(loaded["b"], b2)
        assert fetched.count(base) == 1


def test_the_delta_decision_samples_the_whole_chunk_not_its_start(tmp_path):
    """The first 64 KiB changed wholly (an embedding's frequent tokens, say), the rest a little:
    a sample of the start alone would refuse the delta that saves most of the chunk."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g)
    w2 = w + 1e-4 * torch.randn(w.shape, generator=g)
    w2[:16] = torch.randn(16, 1024, generator=g)  # 16 rows = the first 64 KiB
    with cas.open(tmp_path / "s", chunk_size=1 << 20, delta="forward") as store:
        store.save({"w": w}, step=1)
        ck = store.save({"w": w2}, step=2)
        assert _records(store)[store.tensors(2)[0]["chunks"][0]].base is not None
        assert ck.new_bytes < 0.7 * store.get(1).new_bytes
        assert torch.equal(store.load(2)["w"], w2)


def test_gc_keeps_the_chain_below_an_object_a_writer_holds(tmp_path):
    """A saving process held a delta as the base of its next chunk (a hold) while every
    checkpoint that reached it was deleted: gc must keep the held delta's own bases, or the
    save about to commit would reference a broken chain."""
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    with cas.open(tmp_path / "s", chunk_size=1 << 20, delta="forward", max_chain=4) as store:
        for step in range(3):
            w = w + 1e-4 * torch.randn_like(w)
            store.save({"w": w}, step=step)
        top = store.tensors(2)[0]["chunks"][0]
        chain = store.objects.chain(top)
        assert len(chain) == 3
        with store.objects.session("a save coding against step 2") as session:
            session.hold([top])
            for step in range(3):
                store.delete(step)
            store.gc()
            assert all(store.objects.record(k) is not None for k in chain)
            assert np.array_equal(store.objects.get(top), w.numpy().view(np.uint8).reshape(-1))
        store.gc()
        assert not any(store.objects.record(k) for k in chain)


def test_a_cycle_of_bases_in_a_damaged_index_is_refused(tmp_path):
    from dataclasses import replace
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    with cas.open(tmp_path / "s", chunk_size=1 << 20, delta="forward") as store:
        store.save({"w": w}, step=1)
        store.save({"w": w + 1e-4}, step=2)
        top = store.tensors(2)[0]["chunks"][0]
        base = store.objects.record(top).base
        with store.index.write() as txn:  # the base now claims to be a delta of its own delta
            store.index.put_record(txn, base, replace(store.objects.record(base), base=top, depth=2))
        with pytest.raises(cas.CorruptionError, match="cycle"):
            store.load(2)


def test_float8_chunks_are_deltas_too(tmp_path):
    """One-byte floats are not byte-grouped, but their differences are as small as bf16's."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 4096, generator=g)
    with cas.open(tmp_path / "s", chunk_size=1 << 20, delta="forward") as store:
        first = store.save({"w": w.to(torch.float8_e4m3fn)}, step=1)
        drifted = (w * 1.01).to(torch.float8_e4m3fn)
        second = store.save({"w": drifted}, step=2)
        assert _records(store)[store.tensors(2)[0]["chunks"][0]].base is not None
        assert second.new_bytes < 0.6 * first.new_bytes
        assert store.load(2)["w"].view(torch.uint8).equal(drifted.view(torch.uint8))


def test_bounded_delta_memory_codes_the_same_deltas_from_bases_read_back(tmp_path):
    """delta_memory caps the bytes of the last save kept in host memory; beyond it the bases are
    decoded from the store: the same deltas, the same bytes, more decoding at save time."""
    torch.manual_seed(0)
    start = [torch.randn(256, 1024) for _ in range(3)]
    stored, reads = {}, {}
    for memory in (None, 1 << 20, 0):
        w = [t.clone() for t in start]
        with cas.open(tmp_path / f"s{memory}", chunk_size=256 << 10, delta="forward", max_chain=2,
                      delta_memory=memory) as store:
            calls = []
            get = store.objects.get
            store.objects.get = lambda key, *a, **k: (calls.append(key), get(key, *a, **k))[1]
            sizes = []
            for step in range(6):
                w = [t + 1e-4 * torch.randn_like(t) for t in w]
                sizes.append(store.save({"a": w[0], "b": w[1], "c": w[2]}, step=step).new_bytes)
                assert all(store.load(step)[k].equal(t) for k, t in zip("abc", w))
            stored[memory], reads[memory] = sum(sizes), len(calls)
            kept = sum(b.data.size + (0 if b.below is None else b.below.size)
                       for b in store._bases.values() if b.data is not None)
            assert kept <= (memory if memory is not None else 2 * (3 << 20))
            if memory == 0:
                assert all(b.data is None for b in store._bases.values())  # not one byte of the last save kept
            assert any(r.base is not None and r.depth == 2 for r in _records(store).values())
            assert store.verify().ok
    assert abs(stored[0] - stored[None]) < 0.01 * stored[None]
    assert abs(stored[1 << 20] - stored[None]) < 0.01 * stored[None]
    assert reads[None] < reads[1 << 20] < reads[0]  # loads read the same; saves read back what was not kept


def test_delta_memory_must_be_a_byte_count(tmp_path):
    for bad in (-1, 1.5, "1G"):
        with pytest.raises(cas.CasError, match="delta_memory"):
            cas.open(tmp_path / "s", delta="forward", delta_memory=bad)


def test_the_first_delta_save_after_reopening_codes_against_the_latest_checkpoint(tmp_path):
    """A resumed run (a fresh process, nothing in memory) does not start its chains over: its
    first save reads the latest checkpoint's chunks back as bases."""
    torch.manual_seed(0)
    w = {"w": torch.randn(256, 1024), "m": torch.randn(128, 1024).to(torch.bfloat16), "i": torch.arange(50000)}
    with cas.open(tmp_path / "s", chunk_size=256 << 10, delta="forward") as store:
        first = store.save(w, step=1)
        before = {k for t in store.tensors(1) for k in t["chunks"]}
    w = {"w": w["w"] + 1e-4 * torch.randn_like(w["w"]), "m": (w["m"].float() + 1e-3).to(torch.bfloat16), "i": w["i"]}
    with cas.open(tmp_path / "s", chunk_size=256 << 10, delta="forward") as store:
        second = store.save(w, step=2)
        records = _records(store)
        coded = {t["path"]: [records[k].base in before for k in t["chunks"]] for t in store.tensors(2)}
        assert all(coded["w"]) and all(coded["m"]) and not any(coded["i"])
        assert second.new_bytes < 0.7 * first.new_bytes
        loaded = store.load(2)
        assert all(loaded[k].view(torch.uint8).equal(v.view(torch.uint8)) for k, v in w.items())
        assert store.verify().ok


def _trajectory(steps: int, seed: int = 0, shape=(256, 1024)) -> list[torch.Tensor]:
    """Weights moving like training with momentum: each step mostly repeats the last one's
    motion (a drift of ~1e-3 of the weights' scale), plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    velocity = 1e-3 * torch.randn(shape, generator=g)
    out = []
    for _ in range(steps):
        velocity = 0.95 * velocity + 5e-5 * torch.randn(shape, generator=g)
        w = w + velocity
        out.append(w.clone())
    return out


@pytest.mark.parametrize("memory", [None, 0])
def test_steady_motion_is_coded_as_linear_deltas_smaller_than_plain_ones(tmp_path, memory):
    """From the third save on, a chunk whose base is itself a delta is predicted by extrapolating
    the base's own motion (`linear`): smaller than the plain difference, restored bit for bit,
    whether the base's base was kept in memory (None) or read back (0)."""
    states = _trajectory(6)
    with cas.open(tmp_path / "s", chunk_size=256 << 10, delta="forward", max_chain=4, delta_memory=memory) as store:
        sizes = [store.save({"w": w, "h": w.to(torch.bfloat16)}, step=step).new_bytes
                 for step, w in enumerate(states)]
        codecs = {step: {store.objects.codec_of(k) for t in store.tensors(step) for k in t["chunks"]}
                  for step in range(6)}
        assert codecs[1] == {"sub4+bytegroup4+zstd", "sub2+bytegroup2+zstd"}
        for step in (2, 3):
            assert codecs[step] == {"linear4+bytegroup4+zstd", "linear2+bytegroup2+zstd"}
            assert sizes[step] < 0.9 * sizes[1]
        assert all(bytes(store.objects.fetch(k))[4] == 3 for k in store.tensors(2)[0]["chunks"])  # format 3
        for step, w in enumerate(states):
            loaded = store.load(step)
            assert loaded["w"].equal(w) and loaded["h"].view(torch.uint8).equal(w.to(torch.bfloat16).view(torch.uint8))
        usage = store.codec_usage()
        assert usage["linear4+bytegroup4+zstd"]["max_depth"] == 4
        store.gc(keep_last=1)  # the newest checkpoint's linear chain keeps every base it reads
        assert store.verify().ok and store.load(5)["w"].equal(states[5])


def test_linear_deltas_are_the_same_with_bases_in_memory_or_read_back(tmp_path):
    states = _trajectory(5, seed=3)
    stored = {}
    for memory in (None, 0):
        with cas.open(tmp_path / f"s{memory}", chunk_size=256 << 10, delta="forward", delta_memory=memory) as store:
            stored[memory] = [store.save({"w": w}, step=step).new_bytes for step, w in enumerate(states)]
    assert stored[None] == stored[0]


def test_a_failed_save_leaves_the_next_linear_delta_correct(tmp_path):
    """A save that fails at its commit had started replacing the in-memory bases (and the bytes
    linear deltas extrapolate from): they are dropped, and the next save reads its bases back
    from the latest committed checkpoint, coding correct linear deltas against it."""
    from cas import faults
    states = _trajectory(5, seed=4)
    with cas.open(tmp_path / "s", chunk_size=256 << 10, delta="forward") as store:
        for step in range(3):
            store.save({"w": states[step]}, step=step)
        faults.configure("commit.synced=raise")  # before its record log entry: nothing is committed
        try:
            with pytest.raises(faults.InjectedFault):
                store.save({"w": states[3]}, step=3)
        finally:
            faults.configure("")
        store.save({"w": states[4]}, step=4)
        assert {store.objects.codec_of(k) for k in store.tensors(4)[0]["chunks"]} == {"linear4+bytegroup4+zstd"}
        records = _records(store)
        assert [records[k].base for k in store.tensors(4)[0]["chunks"]] == store.tensors(2)[0]["chunks"]
        assert store.load(4)["w"].equal(states[4])
        assert store.verify().ok


def test_a_linear_delta_over_a_base_shared_by_chunks_decodes_from_its_chain(tmp_path):
    """Two tensors equal for two saves (shared objects) then parting: both chunks extrapolate
    from the one shared base. A load decodes that base once for both, but the linear level
    above also needs the base's base, which it then decodes from the bottom of the chain."""
    states = _trajectory(3, seed=5)
    with cas.open(tmp_path / "s", chunk_size=1 << 20, delta="forward") as store:
        store.save({"a": states[0], "b": states[0].clone()}, step=0)
        store.save({"a": states[1], "b": states[1].clone()}, step=1)
        a2, b2 = states[2], states[2] + 1e-7 * torch.sign(states[2])
        store.save({"a": a2, "b": b2}, step=2)
        assert {store.objects.codec_of(t["chunks"][0]) for t in store.tensors(2)} == {"linear4+bytegroup4+zstd"}
        loaded = store.load(2)
        assert loaded["a"].equal(a2) and loaded["b"].equal(b2)


def test_a_linear_delta_needs_its_base_to_be_a_delta():
    """A hostile or damaged header naming a full object as the base of a `linear` delta is
    refused by name, never decoded against a made-up prediction."""
    from cas.codecs import STAGE_LINEAR, parse_header
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, generator=g)
    below, base, raw = ((w + k * 1e-4 * w.sign()).numpy().view(np.uint8).reshape(-1) for k in range(3))
    enc = CodecPolicy().encode(raw, 4, (hash_bytes(base), base), below=below)
    blob = b"".join(bytes(p) for p in enc.parts)
    assert parse_header(blob).stages[0][0] == STAGE_LINEAR
    with pytest.raises(cas.CorruptionError, match="own base is not available"):
        decode_into(blob, hash_bytes(raw), None, base)
    assert np.array_equal(decode_into(blob, hash_bytes(raw), None, base, below=below), raw)
    bad_shift = bytearray(blob)
    bad_shift[14 + 2 + 32] = 9  # magic 4, format 1, stages 1, size 8; stage 2; key 32; then the shift
    with pytest.raises(cas.CorruptionError, match="shift"):
        decode_into(bytes(bad_shift), hash_bytes(raw), None, base, below=below)
    old_format = bytearray(blob)
    old_format[4] = 2
    with pytest.raises(cas.CorruptionError, match="format 3 introduced"):
        decode_into(bytes(old_format), hash_bytes(raw), None, base, below=below)


def test_a_swept_base_whose_bytes_return_later_in_the_same_save_is_written(tmp_path):
    """The in-memory bases name chunks that gc swept (their checkpoint was deleted): the save
    holds them as delta candidates, finds them gone, and must still write that content when a
    later batch of the same save holds it (it once counted as stored: a committed checkpoint
    referenced a missing object)."""
    torch.manual_seed(0)
    x = torch.randn(64 << 10)  # 4 chunks of 64 KiB
    with cas.open(tmp_path / "s", chunk_size=64 << 10, delta="forward", window_bytes=128 << 10) as store:
        store.save({"a": x}, step=1)
        store.delete(1)
        store.gc()
        state = {"a": x + 1e-4 * torch.randn_like(x), "b": x.clone()}  # b: the swept bases' bytes
        store.save(state, step=2)
        assert store.verify().ok
        loaded = store.load(2)
        assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_max_chain_is_bounded_by_the_depth_restore_follows(tmp_path):
    """Restore refuses chains deeper than 64 as cycles, so a deeper bound is refused up front
    (it used to commit checkpoints no restore could read)."""
    with pytest.raises(cas.CasError, match="max_chain must be an int from 0 to 64"):
        cas.open(tmp_path / "refused", delta="forward", max_chain=65)
    w, states = torch.randn(16 << 10), []
    with cas.open(tmp_path / "s", chunk_size=64 << 10, delta="forward", max_chain=64) as store:
        for step in range(67):
            w = w + 1e-5 * torch.randn_like(w)
            states.append(w.clone())
            store.save({"w": w}, step=step)
        assert max(u["max_depth"] for u in store.codec_usage().values()) == 64
        for step in (63, 64, 65, 66):
            assert torch.equal(store.load(step)["w"], states[step])


class _TiedEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 256)  # 256 KiB: 4 chunks of 64 KiB
        self.head = torch.nn.Linear(256, 256, bias=False)
        self.head.weight = self.emb.weight


def test_restore_into_tied_weights_decodes_their_memory_once(tmp_path):
    """Two state-dict entries of one tensor (tied weights): two decodes into the same memory
    would race (a chain decode keeps intermediate levels in its output) and fail the hash check
    about every other restore; the shared memory is decoded into once."""
    torch.manual_seed(0)
    model = _TiedEmbedding()
    motion = 1e-3 * torch.randn_like(model.emb.weight)
    with cas.open(tmp_path / "s", chunk_size=64 << 10, delta="forward", workers=2) as store:
        for step in range(5):
            with torch.no_grad():
                model.emb.weight.add_(motion + 1e-5 * torch.randn_like(motion))
            store.save({"model": model}, step=step)
        for _ in range(40):
            target = _TiedEmbedding()
            store.restore({"model": target})
            assert torch.equal(target.emb.weight, model.emb.weight) and target.head.weight is target.emb.weight


def test_a_rollback_over_a_lost_base_file_codes_no_cycle_of_bases(tmp_path):
    """Step 2's chunks are deltas of step 1's, whose file is then lost; saving step 1's state
    again must not code its chunk against step 2's (a cycle of bases): it is written whole."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(128, 256, generator=g)
    w2 = w1 + 1e-4 * torch.randn(128, 256, generator=g)
    with cas.open(tmp_path / "s", chunk_size=64 << 10, pack_max=4096, delta="forward") as store:
        store.save({"w": w1}, step=1)
        store.save({"w": w2}, step=2)
        os.unlink(store.objects.files.path(store.tensors(1)[0]["chunks"][0]))
        store.save({"w": w1.clone()}, step=3)
        assert torch.equal(store.load(3)["w"], w1) and torch.equal(store.load(2)["w"], w2)
