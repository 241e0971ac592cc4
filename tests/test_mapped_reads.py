"""Large reads of a local store map the file instead of copying it (cas/localfs.py MAP_FROM): the
bytes are the same as a pread's at any offset, damage under a mapped read is still named, and a
cut pack is still reported, never read past."""

from __future__ import annotations

import os

import pytest
import torch

import cas
from cas.errors import CorruptionError
from cas.localfs import MAP_FROM, LocalBackend


def test_a_mapped_range_holds_the_bytes_a_pread_reads(tmp_path):
    (tmp_path / "tmp").mkdir()
    backend = LocalBackend(str(tmp_path))
    data = os.urandom(3 * MAP_FROM + 4097)
    assert backend.put_if_absent("log/x", [data])
    scratch = bytearray(1)  # too small for any of these reads: a mapped one never asks for it
    for start, length in [(0, MAP_FROM), (1, MAP_FROM), (4095, 2 * MAP_FROM + 3), (MAP_FROM + 7, None),
                          (len(data) - MAP_FROM, MAP_FROM + 100)]:
        got = backend.get("log/x", start, length, buffer=lambda n: memoryview(scratch) if n <= 1 else memoryview(bytearray(n)))
        end = len(data) if length is None else start + length
        assert bytes(got) == data[start:end]
        assert got.readonly  # a view of the page cache: decoders read it, nobody writes it


def big_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(3 << 20, generator=g), "b": torch.randn(1234567, generator=g).to(torch.bfloat16),
            "i": torch.randint(0, 1000, (2 << 20,), generator=g)}


@pytest.mark.parametrize("key", [None, "a passphrase"])
def test_large_chunks_load_bit_for_bit_through_mapped_reads(tmp_path, key, monkeypatch):
    monkeypatch.setenv("CAS_SCRYPT_LOG_N", "10")
    state = big_state()
    with cas.open(tmp_path / "s", key=key, delta=False) as store:  # default 4 MiB chunks
        store.save(state, step=1)
    with cas.open(tmp_path / "s", key=key) as store:
        got = store.load(1)
        for name, t in state.items():
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8))
        assert store.verify().ok


def _only_pack(path) -> str:
    packs = [os.path.join(d, f) for d, _, fs in os.walk(path / "packs") for f in fs]
    assert len(packs) == 1
    return packs[0]


def test_damage_under_a_mapped_read_is_named_and_a_cut_pack_is_reported(tmp_path):
    state = big_state()
    with cas.open(tmp_path / "s", delta=False) as store:
        store.save(state, step=1)
    pack = _only_pack(tmp_path / "s")
    size = os.path.getsize(pack)
    with open(pack, "r+b") as f:  # a byte in the middle of some chunk
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    with cas.open(tmp_path / "s") as store, pytest.raises(CorruptionError) as err:
        store.load(1)
    assert err.value.key  # the damaged object, by name
    with open(pack, "r+b") as f:
        f.truncate(size // 3)
    with cas.open(tmp_path / "s") as store, pytest.raises(CorruptionError, match="truncated|holds"):
        store.load(1)
