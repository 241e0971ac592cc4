"""Writers in progress, as a sweep must judge them: which leases are provably over (their
holds end), and what stops a sweep batch (a barrier lease: a distributed save whose ranks reuse
objects without holding them one by one; a live writer whose holds are in another index)."""

from __future__ import annotations

import socket

from cas.fsutil import pid_alive
from cas.objectstore import LEASE_PREFIX, lease_name


BARRIER_PREFIX = "barrier:"


def why_wait(store, txn) -> str | None:
    """Why no object may be deleted now, if something forbids it: a live barrier lease (a
    distributed save whose ranks reuse objects without recording holds), or a live writer this
    cache does not know (its holds are in another cache: an index deleted or replaced under a
    running process), whose objects it cannot account for; or this process's index is no longer
    the one at the path (deleted or replaced while it ran), so its records are not the store's."""
    if store.index.orphaned():
        return ("the index was deleted or replaced while this process had it open; nothing is deleted on its "
                "records (the next gc opens the index again)")
    barrier = barrier_in_progress(store.index, txn)
    if barrier:
        return f"a writer that cannot hold objects one by one is in progress ({barrier}); the sweep waits for it"
    unknown = unknown_writer(store, txn)
    if unknown:
        return (f"a live writer ({unknown}) holds objects in another index than this one (was the index deleted "
                "or replaced while it ran?); the sweep waits until it ends")
    return None


def unknown_writer(store, txn) -> str | None:
    """A live lease file whose lease this cache does not hold, if any. This store's own sessions
    are never one: between their file and their index lease they hold nothing (a race that made
    the retention sweep after a save give up while that save's recode began)."""
    backend = store.objects.backend
    if backend is None:
        return None
    known = {lease_name(lid) for lid in store.index.leases(txn)} | set(store.objects.own_lease_files)
    for name in backend.list(LEASE_PREFIX):
        if name not in known and backend.lease_alive(name):
            return name
    return None


def barrier_in_progress(index, txn) -> str | None:
    """A live lease whose purpose starts with "barrier:" (a distributed save, whose ranks reuse
    objects without recording holds) stops every sweep batch until it ends. Checked inside each
    batch's write transaction, so a barrier taken before ranks look at files is always seen."""
    for info in index.leases(txn).values():
        if str(info.get("purpose", "")).startswith(BARRIER_PREFIX):
            return info["purpose"][len(BARRIER_PREFIX):]
    return None


def lease_dead(store, lease: bytes, info: dict, host: str) -> bool:
    """Whether a writer's lease is provably over. A lease with a lease file is over when the
    file's lock can be taken (the kernel dropped it with its holder, however it died, in any
    PID namespace) or the file is gone; one without (written by an older cas) when it is this
    host's and its process id is gone, as that cas judged it."""
    backend = store.objects.backend
    if info.get("file") and backend is not None:
        return not backend.lease_alive(lease_name(lease))
    return info.get("host") == host and isinstance(info.get("pid"), int) and not pid_alive(info["pid"])


def reap_dead_leases(store) -> int:
    """End the leases of writers that are provably gone (a crashed save): never on a guess, so
    a live writer in another PID namespace keeps its holds. Leases that cannot be judged stay:
    their holds only delay reclaiming, never lose data."""
    host = socket.gethostname()
    with store.index.read() as txn:
        leases = store.index.leases(txn)
    dead = [lid for lid, info in leases.items() if lease_dead(store, lid, info, host)]
    if dead:
        with store.index.write() as txn:
            for lid in dead:
                store.index.end_lease(txn, lid)
        for lid in dead:
            if store.objects.backend is not None:
                store.objects.backend.delete(lease_name(lid))
    return len(dead)


def clean_tmp(store) -> int:
    """Remove temporary files whose writer is provably gone (the backend judges: for a local
    store, by each writer's owner-file lock; cas.localfs.LocalBackend.clean_tmp)."""
    return store.backend.clean_tmp()
