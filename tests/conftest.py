import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import cas  # noqa: E402


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def store(store_path):
    with cas.open(store_path, chunk_size=64 << 10, pack_max=16 << 10) as s:
        yield s
