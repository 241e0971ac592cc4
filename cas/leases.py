"""Writers' lease files (leases/<lease id>): each write session takes one beside its lease in
the index, so gc on another host, or a process whose index is not this one's, sees a writer
alive (gc/writers.py) and by whom: pid, host, start time and purpose, readable in any store.
"""

from __future__ import annotations

import os
import socket
import time

import msgpack

from .backend import Backend

LEASE_PREFIX = "leases/"


def lease_name(lease: bytes) -> str:
    return f"{LEASE_PREFIX}{lease.hex()}"


def begin_lease(backend: Backend | None, lease: bytes, purpose: str):
    """Take a writer's lease file (None without a backend)."""
    if backend is None:
        return None
    info = msgpack.packb({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                          "purpose": purpose})
    return backend.lease(lease_name(lease), info)
