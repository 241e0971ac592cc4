"""Saves never build on an object known to be damaged, and `cas repair` quarantines it.

A flipped payload byte keeps a file's size, so presence checks pass. Once verify or a failed
load has found it, the next save writes the object again (and its commit puts the fresh copy
in the damaged one's place), delta saves code nothing against it, and `cas repair` moves it to
quarantine/. Real stores, real files, real CLI processes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import lmdb
import pytest
import torch

import cas
from cas.index import WHERE_PACK
from helpers import assert_same

CAS = [sys.executable, "-m", "cas.cli"]


def _cas(*args, store):
    return subprocess.run(CAS + ["--store", str(store)] + [str(a) for a in args], capture_output=True,
                          text=True, timeout=120)


def _flip(path: str, offset: int | None = None) -> None:
    """Flip one byte of a file in place (the middle of its payload by default): its size stays."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        where = len(data) // 2 if offset is None else offset
        data[where] ^= 0x01
        f.seek(0)
        f.write(data)


def _chunk(store, step: int, path: str, i: int = 0) -> bytes:
    return next(t for t in store.tensors(step) if t["path"] == path)["chunks"][i]


def _damaged(store) -> dict[bytes, dict]:
    with store.index.read() as txn:
        return dict(store.index.iter_damaged(txn))


def _chain(store, key: bytes) -> list[bytes]:
    return store.objects.chain(key)


@pytest.fixture
def state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 1024, generator=g), "b": torch.randn(16, 1024, generator=g)}  # 4 + 1 files


@pytest.mark.parametrize("offset", [0, 4, 14], ids=["magic", "format", "stage"])
def test_a_save_does_not_reuse_a_file_whose_header_is_damaged(store, state, offset):
    store.save(state, step=1)
    key = _chunk(store, 1, "w", 3)
    _flip(store.objects.files.path(key), offset)  # found by no verify, no load: the reuse check reads it
    store.save(state, step=2)
    assert_same(store.load(2), state)
    assert_same(store.load(1), state)


def test_a_store_without_the_damaged_table_opens_read_only(tmp_path, state):
    path = tmp_path / "s"
    with cas.open(path) as store:
        store.save(state, step=1)
    env = lmdb.open(str(path / "index"), max_dbs=16)  # as a store written before the table existed
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"damaged", txn=txn), delete=True)
    env.close()
    with cas.open(path, readonly=True) as store:
        assert_same(store.load(1), state)
        assert store.verify().ok
