"""Unchanged bytes cost nothing: across steps, across tensors, within a checkpoint."""

from __future__ import annotations

import torch

import cas


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(256, 256, generator=g) for i in range(8)}  # 8 x 256 KiB


def test_saving_the_same_state_again_adds_under_one_percent(store):
    state = _state()
    first = store.save(state, step=1)
    second = store.save(state, step=2)
    assert first.new_bytes > 0.5 * first.logical_bytes
    assert second.new_bytes < 0.01 * second.logical_bytes
    assert second.logical_bytes == first.logical_bytes


def test_changing_one_tensor_adds_about_that_tensors_bytes(store):
    state = _state()
    store.save(state, step=1)
    changed = dict(state, layer3=torch.randn(256, 256, generator=torch.Generator().manual_seed(99)))
    ck = store.save(changed, step=2)
    one = 256 * 256 * 4
    assert 0.8 * one < ck.new_bytes < 1.1 * one  # float32 noise barely compresses; nodes are small


def test_identical_tensors_in_one_checkpoint_are_stored_once(store):
    t = torch.randn(512, 512)
    ck = store.save({"a": t, "b": t.clone(), "c": {"d": t.clone()}}, step=1)
    assert ck.logical_bytes == 3 * t.numel() * 4
    assert ck.new_bytes < 1.1 * t.numel() * 4


def test_repeated_chunks_within_a_tensor_are_stored_once(store):
    ck = store.save({"zeros": torch.zeros(4 << 20, dtype=torch.uint8)}, step=1)
    assert ck.new_bytes < 10_000  # 64 identical 64 KiB chunks, one stored, compressed


def test_stats_count_objects_and_bytes(store):
    store.save(_state(), step=1)
    store.save(_state(), step=2)
    s = store.stats()
    assert s.num_checkpoints == 2
    assert s.logical_bytes == 2 * 8 * 256 * 256 * 4
    assert s.stored_bytes < 0.6 * s.logical_bytes
    assert s.num_objects > 8


def test_compression_off_stores_raw_bytes(tmp_path):
    with cas.open(tmp_path / "raw", compress=False, chunk_size=64 << 10) as s:
        ck = s.save({"z": torch.zeros(1 << 16)}, step=1)
        assert s.objects.codec_of(s.tensors(1)[0]["chunks"][0]) == "raw"
        assert ck.new_bytes >= 64 << 10  # one raw zero chunk (identical chunks dedup)
