import os
import random
import sys
import zlib

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import cas  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded(request):
    """Seed torch's, numpy's and Python's global generators from the test's own name before it
    runs: a test's random tensors must not depend on which tests ran before it on the same
    xdist worker (a size bound that held for one draw failed for another). Different tests
    still draw different data; hypothesis keeps its own seeding."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def store(store_path):
    with cas.open(store_path, chunk_size=64 << 10, pack_max=16 << 10) as s:
        yield s
