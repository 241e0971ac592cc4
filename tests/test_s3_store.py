"""Stores in a bucket, on a real S3 server (SeaweedFS, tests/s3server.py): the whole API over
s3://, hosts (cache folders) sharing one store, races, and what a bucket may hold."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

import cas
from cas import faults
from helpers import assert_same, outcome_of, wait_for
from s3server import s3_bucket, s3_prefix, s3_server, s3_url  # noqa: F401 - fixtures

CHUNK = 64 << 10


def state(seed: int, n: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(64, 256, generator=g) for i in range(n)}, "step": seed,
            "note": f"state {seed}"}


def host(url: str, tmp_path, name: str, **options):
    """A store opened as host `name` would: its own cache folder."""
    return cas.open(url, cache_dir=str(tmp_path / f"cache-{name}"), chunk_size=CHUNK, **options)


def test_the_whole_api_over_a_bucket(s3_url, tmp_path):
    with host(s3_url, tmp_path, "a") as store:
        assert store.created and store.path == s3_url
        store.save(state(1), step=1, metrics={"loss": 1.0})
        store.save(state(2), step=2, milestone=True)
        assert_same(store.load(1), state(1))
        assert_same(store.load(), state(2))
        assert store.verify().ok
        assert [ck.step for ck in store.checkpoints()] == [1, 2] and store.latest().step == 2
        store.set_pinned(1)
        assert store.get(1).pinned
    with host(s3_url, tmp_path, "b") as fresh:  # a fresh host: an empty cache, everything seen
        assert not fresh.created
        assert [(ck.step, ck.pinned, ck.milestone) for ck in fresh.checkpoints()] == [(1, True, False), (2, False, True)]
        assert_same(fresh.load(2), state(2))


def test_two_hosts_saving_at_once_then_a_fresh_host_loads_all_and_dedups(s3_url, tmp_path):
    with host(s3_url, tmp_path, "a"):
        pass  # created once; the two writers open it
    errors: list = []

    def writer(name: str, steps) -> None:
        try:
            with host(s3_url, tmp_path, name) as store:
                for step in steps:
                    store.save(state(step), step=step)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n, s)) for n, s in (("a", (1, 3, 5)), ("b", (2, 4, 6)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with host(s3_url, tmp_path, "c") as fresh:
        assert [ck.step for ck in fresh.checkpoints()] == [1, 2, 3, 4, 5, 6]
        for step in range(1, 7):
            assert_same(fresh.load(step), state(step))
        again = fresh.save(state(3), step=7)  # the same tensors as step 3, written by host a
        assert again.new_bytes < 4096, again.new_bytes
        assert fresh.verify().ok


def test_the_same_step_from_three_hosts_one_wins(s3_url, tmp_path):
    with host(s3_url, tmp_path, "x"):
        pass
    barrier = threading.Barrier(3)
    outcome: dict = {}

    def writer(name: str, seed: int) -> None:
        with host(s3_url, tmp_path, name) as store:
            barrier.wait()
            try:
                outcome[name] = store.save(state(seed), step=10).id
            except cas.CheckpointExistsError as exc:
                outcome[name] = exc

    threads = [threading.Thread(target=writer, args=(n, i)) for i, n in enumerate("abc", 20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = {n: v for n, v in outcome.items() if isinstance(v, str)}
    assert len(won) == 1 and len(outcome) == 3, outcome
    winner = next(iter(won))
    with host(s3_url, tmp_path, "d") as fresh:
        assert [ck.id for ck in fresh.checkpoints()] == list(won.values())
        assert_same(fresh.load(10), state(20 + "abc".index(winner)))


def test_bad_urls_and_schemes_are_refused(tmp_path, monkeypatch):
    with pytest.raises(cas.CasError, match="unknown scheme gs://"):
        cas.open("gs://bucket/x")
    with pytest.raises(cas.CasError, match="not an S3 URL"):
        cas.open("s3:/bucket/x")
    store = cas.open(f"file://{tmp_path / 'local'}")
    assert store.path == str(tmp_path / "local") and store.created
    store.close()


def test_an_unchanged_resave_costs_at_most_ten_requests(s3_url, tmp_path):
    with host(s3_url, tmp_path, "a") as store:
        store.save(state(1, n=8), step=1)
        store.backend.requests.clear()
        store.save(state(1, n=8), step=2)
        sent = dict(store.backend.requests)
    assert sum(sent.values()) <= 10, sent



def small_tensors(seed: int, n: int = 48) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"layers": {f"l{i}": {"weight": torch.randn(8, 16, generator=g), "bias": torch.randn(8, generator=g)}
                       for i in range(n)}, "step": seed}


def test_a_fresh_host_reads_a_checkpoints_small_objects_a_window_at_a_time(s3_url, tmp_path):
    """96 small tensors: their chunks and nodes (243 objects) lie side by side in one pack, and
    the load reads them one after another. Each was a GET of its own (243; at a cloud bucket's
    latency, seconds); now a small read fetches the 256 KiB around it and its neighbours come
    from memory."""
    with host(s3_url, tmp_path, "a") as store:
        store.save(small_tensors(1), step=1)
    with host(s3_url, tmp_path, "b") as fresh:
        fresh.backend.requests.clear()
        assert_same(fresh.load(1), small_tensors(1))
        sent = dict(fresh.backend.requests)
    assert sent.get("GET", 0) <= 2, sent


def model_like(seed: int, layers: int = 6) -> dict:
    """A model's state as a save meets it: each layer's weight (1.2 MiB, a chunk of its own) with
    its bias and norm beside it (small), and counters."""
    g = torch.Generator().manual_seed(seed)
    return {"layers": {f"l{i}": {"weight": torch.randn(300_000 + 1000 * i, generator=g),
                                 "bias": torch.randn(512, generator=g), "norm": torch.randn(512, generator=g)}
                       for i in range(layers)}, "step": torch.tensor(seed), "epoch": seed}


@pytest.mark.parametrize("key", [None, "a passphrase"], ids=["plain", "encrypted"])
def test_a_fresh_hosts_load_fetches_a_models_small_tensors_together(s3_url, tmp_path, key):
    """A pack written whole (a bucket's) laid its entries out as the save's threads finished
    them, so each layer's small tensors lay between two weights: a fresh host's load fetched a
    window per layer (an encrypted store, a 1 MiB segment per layer, which the weights' own
    reads fetched again). The small entries now go after the large ones, together, and the
    windows a load's threads ask for at once are fetched once: a GET per weight, and one or two
    for everything else."""
    with cas.open(s3_url, key=key, cache_dir=str(tmp_path / "a")) as store:
        store.save(model_like(1), step=1)
    with cas.open(s3_url, key=key, cache_dir=str(tmp_path / "b")) as fresh:  # another host
        fresh.backend.requests.clear()
        assert_same(fresh.load(1), model_like(1))
        sent = dict(fresh.backend.requests)
    assert sent.get("GET", 0) <= 6 + 2, sent  # it was 16-17 of them; 7 now


def test_a_verify_reads_the_bucket_as_it_is_now_not_the_windows_a_load_read(s3_url, tmp_path):
    """A load fetched the windows holding the small objects; the pack is damaged in the bucket
    afterwards: a verify of the same open store finds it (no window fetched before it answers),
    reading the pack once for its 243 objects (its own windows; it made 392 GETs before), and a
    new host's load refuses it."""
    with host(s3_url, tmp_path, "a") as store:
        store.save(small_tensors(2), step=1)
        backend = store.backend
    with host(s3_url, tmp_path, "b") as reader:
        assert_same(reader.load(1), small_tensors(2))
        assert reader.verify().ok
        name = max(backend.list("packs/"), key=backend.stat)
        data = bytearray(backend.get(name))
        entry = reader.objects.packs.listed(bytes.fromhex(name.rpartition("/")[2]), len(data))[100]
        data[entry.offset + entry.length // 2] ^= 0xFF  # inside an object the load read
        backend.delete(name)
        assert backend.put_if_absent(name, [bytes(data)])
        reader.backend.requests.clear()
        report = reader.verify()
        assert not report.ok and report.problems, report
        assert reader.backend.requests["GET"] <= 3, dict(reader.backend.requests)  # (its own windows: 243 objects)
    with host(s3_url, tmp_path, "c") as fresh:
        with pytest.raises(cas.CorruptionError):
            fresh.load(1)


def test_a_quick_verify_and_the_codec_census_ask_for_each_pack_once(s3_url, tmp_path):
    """`verify --quick` asked for its pack's size (a HEAD) and read its 64-byte header (a GET)
    once per chunk, and `cas du` (its per-codec census) read each object's header with a GET
    of its own: 100 HEADs and 99 GETs, and 243 GETs, for 96 small tensors. Pack sizes are now
    asked once per verify, and the heads of small objects come with their windows. A header damaged in the
    bucket after that is still found by the next quick verify of the same open store."""
    with host(s3_url, tmp_path, "a") as store:
        store.save(small_tensors(3), step=1)
        backend = store.backend
    with host(s3_url, tmp_path, "b") as reader:
        reader.backend.requests.clear()
        assert reader.verify(quick=True).ok
        quick = dict(reader.backend.requests)
        reader.backend.requests.clear()
        assert sum(u["objects"] for u in reader.codec_usage().values()) == 243
        census = dict(reader.backend.requests)
        assert quick.get("HEAD", 0) <= 6 and quick.get("GET", 0) <= 4, quick
        assert census.get("GET", 0) <= 2, census
        name = max(backend.list("packs/"), key=backend.stat)
        data = bytearray(backend.get(name))
        entries = reader.objects.packs.listed(bytes.fromhex(name.rpartition("/")[2]), len(data))
        chunk = next(e for e in entries if e.raw_size == 8 * 16 * 4)  # a weight's chunk
        data[chunk.offset + 10] ^= 0xFF  # in its codec header
        backend.delete(name)
        assert backend.put_if_absent(name, [bytes(data)])
        report = reader.verify(quick=True)
        assert not report.ok and report.problems[0].key == chunk.key.hex(), report


def test_an_open_host_sees_what_other_hosts_commit_later(s3_url, tmp_path):
    """A host's cache was brought up to date only at open and by its own saves and gc: a host
    polling an open store for new checkpoints saw none, `load()` returned the old latest and
    `load(step)` of a committed step raised CheckpointNotFoundError (found by a black-box
    audit). Reads of the registry now fold what others committed first, one HEAD when nothing."""
    with host(s3_url, tmp_path, "a") as a, host(s3_url, tmp_path, "b") as b:
        a.save(state(1), step=1)
        assert [ck.step for ck in b.checkpoints()] == [1]
        a.save(state(2), step=2)
        assert b.latest().step == 2 and b.exists(2) and b.previous(2).step == 1
        assert_same(b.load(), state(2))
        a.save(state(3), step=3)
        assert_same(b.load(3), state(3))
        a.delete(1)
        a.wait()  # a's background recodes (each a log entry) are done: nothing new from here on
        assert [ck.step for ck in b.checkpoints()] == [2, 3]
        b.backend.requests.clear()
        b.checkpoints()
        assert dict(b.backend.requests) == {"HEAD": 1}, dict(b.backend.requests)  # nothing new: one HEAD


def test_a_checkpoint_removed_while_it_is_read_is_not_found_not_damaged(s3_url, tmp_path):
    """Retention or gc on another host removing a checkpoint between a reader's resolve and its
    reads made the load fail with MissingObjectError, as if the store were damaged. It is now
    CheckpointNotFoundError, saying the checkpoint was removed while it was being read."""
    gate = tmp_path / "gate"
    with host(s3_url, tmp_path, "a") as a:
        a.save(state(1), step=1)
        a.save(state(2), step=2)
    with host(s3_url, tmp_path, "a") as a, host(s3_url, tmp_path, "b") as b:
        faults.configure(f"load.resolved=pause:{gate}@1")
        outcome: list = []
        loader = threading.Thread(target=lambda: outcome.append(outcome_of(b.load, 1)))
        try:
            loader.start()
            wait_for(f"{gate}.reached")
            a.delete(1)
            a.gc()  # (the sweep that delete queued has deleted step 1's packs by the time it returns)
            assert any(e.gc and e.gc["phase"] == "delete" and e.gc["packs"] for e in a.log())
        finally:
            gate.touch()
            faults.configure("")
            loader.join(timeout=120)
        assert isinstance(outcome[0], cas.CheckpointNotFoundError), outcome
        assert "removed while it was being read" in str(outcome[0])
        assert_same(b.load(2), state(2))



def test_a_host_whose_cache_misplaces_an_object_rebuilds_it_from_the_bucket(s3_url, tmp_path):
    """Bytes of a host's cache file overwritten (a black-box audit: 3 of 8 random overwrites)
    left records naming places that hold nothing: loads of intact checkpoints failed with
    MissingObjectError on every reopen, while a host with a fresh cache read them. A record
    that still misplaces an object after catching up with the log now has the host rebuild its
    cache from the bucket (once per open) before the object is called missing."""
    from cas.index import WHERE_FILE
    with host(s3_url, tmp_path, "a") as a:
        for step in (1, 2):
            a.save(state(step), step=step)
        keys = [k for t in a.tensors(2) for k in t["chunks"]]
        with a.index.write() as txn:  # what overwritten bytes did: records pointing nowhere
            for key in keys:
                a.index.put_record(txn, key, dataclasses.replace(a.objects.record(key), where=WHERE_FILE))
    with host(s3_url, tmp_path, "a") as a:
        assert_same(a.load(2), state(2))
        assert "not where this host's cache placed it" in a.cache_report.reason
        assert_same(a.load(1), state(1))
        assert a.verify().ok




def test_a_missing_bucket_bad_credentials_or_no_server_is_one_clear_error(s3_server, monkeypatch, tmp_path):
    from s3server import free_ports, point_env_at

    point_env_at(s3_server, monkeypatch)
    with pytest.raises(cas.CasError, match="bucket 'no-such-bucket' does not exist"):
        cas.open("s3://no-such-bucket/x", cache_dir=str(tmp_path))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(cas.CasError, match="refused the credentials"):
        cas.open("s3://no-such-bucket/x", cache_dir=str(tmp_path))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    with pytest.raises(cas.CasError, match="could not be reached"):
        cas.open("s3://bucket/x", cache_dir=str(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing made on this host either


def test_the_cli_on_a_bucket_store(s3_url, tmp_path):
    import json
    import os
    import subprocess
    import sys

    with host(s3_url, tmp_path, "a") as store:
        store.save(state(1), step=1)
        store.save(state(2), step=2)
    env = dict(os.environ, CAS_CACHE_DIR=str(tmp_path / "cli-cache"))

    def cas_cli(*args):
        return subprocess.run([sys.executable, "-m", "cas.cli", "--store", s3_url, *args], capture_output=True,
                              text=True, env=env, timeout=120)

    out = cas_cli("ls", "--json")
    assert out.returncode == 0, out.stderr
    assert [row["step"] for row in json.loads(out.stdout)] == [1, 2]
    for args in (("verify",), ("show", "2"), ("du",)):
        result = cas_cli(*args)
        assert result.returncode == 0, (args, result.stderr)
    missing = subprocess.run([sys.executable, "-m", "cas.cli", "--store", "s3://no-such-bucket/x", "ls"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_cas_repair_takes_a_bucket_url_and_reads_a_damaged_log_entry_as_written(s3_url, tmp_path):
    """`cas repair` looked for a local folder named like the URL (`<cwd>/s3:/bucket/x`), so a
    bucket store could be verified but never repaired (audit of stop 33). It now rebuilds this
    host's cache of the store; a log entry one byte from its digest is read as written and
    named (cas never rewrites a bucket's blobs in place)."""
    import os
    import subprocess
    import sys

    from cas.store.records import entry_name

    with host(s3_url, tmp_path, "a") as store:
        store.save(state(1), step=1)
        store.save(state(2), step=2)
        backend = store.backend
    damaged = bytearray(backend.get(entry_name(1)))
    damaged[40] ^= 0x08
    backend.delete(entry_name(1))
    assert backend.put_if_absent(entry_name(1), [bytes(damaged)])
    env = dict(os.environ, CAS_CACHE_DIR=str(tmp_path / "cli-cache"))
    result = subprocess.run([sys.executable, "-m", "cas.cli", "--store", s3_url, "repair"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "not quarantined" in result.stdout and "record log entry 1 has one damaged" in result.stdout, result.stdout
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [ck.step for ck in fresh.checkpoints()] == [1, 2]
        assert_same(fresh.load(1), state(1))
        assert [p.message for p in fresh.verify().problems] == [
            "record log entry log/0000000000000001 is damaged (one bit or byte); it is read as written, which the "
            "digest the store holds of it proves; cas does not rewrite a bucket's blobs"]


def test_a_save_through_slowdowns_and_resets_commits_and_loads(s3_server, s3_bucket, s3_prefix, monkeypatch, tmp_path):
    from s3server import point_env_at
    from tcpfault import FaultProxy

    point_env_at(s3_server, monkeypatch)
    proxy = FaultProxy(s3_server.ports["s3"])
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        url = f"s3://{s3_bucket}/{s3_prefix}"
        with host(url, tmp_path, "a") as store:
            store.save(state(1), step=1)
            proxy.inject("slowdown", 3)
            proxy.inject("reset", 3)
            store.save(state(2), step=2)  # every failed request retried: committed whole
            proxy.inject("reset", 2)
            assert_same(store.load(2), state(2))
        assert proxy.seen["slowdown"] == 3 and proxy.seen["reset"] == 5
        with host(url, tmp_path, "b") as fresh:
            assert [ck.step for ck in fresh.checkpoints()] == [1, 2] and fresh.verify().ok
    finally:
        proxy.close()


def test_hostile_bucket_contents_are_named_and_never_loaded(s3_url, tmp_path):
    """A log entry that is garbage, one naming a commit that is not there, a segment whose bytes
    do not match the keys it lists: each a CorruptionError naming it, on a fresh host."""
    from cas.store.records import encode_entry, entry_name
    from cas.store.registry import add_change

    with host(s3_url, tmp_path, "a") as store:
        ck = store.save(state(1), step=1)
        backend = store.backend
        packs = backend.list("packs/")
    # (1) a segment damaged in the bucket: loads and verify name the object, never return it
    name = max(packs, key=backend.stat)
    original = bytes(backend.get(name))
    data = bytearray(original)
    data[200] ^= 0xFF
    backend.delete(name)
    assert backend.put_if_absent(name, [bytes(data)])
    with host(s3_url, tmp_path, "b") as fresh:
        with pytest.raises(cas.CorruptionError):
            fresh.load(1)
        assert not fresh.verify().ok
    backend.delete(name)
    assert backend.put_if_absent(name, [original])  # put back (by hand: cas never replaces in a bucket)
    # (2) a garbage log entry after the last one: the open fails, naming the entry
    assert backend.put_if_absent(entry_name(2), [b"cas-log\n" + b"\xc1garbage"])
    with pytest.raises(cas.CorruptionError, match=entry_name(2)):
        host(s3_url, tmp_path, "c")
    backend.delete(entry_name(2))
    # (3) an entry naming a commit node that is not in the bucket: refused at load, by name
    with host(s3_url, tmp_path, "d") as store, store.index.read() as txn:
        seq, digest = store.registry.head(txn)
    forged = dataclasses.replace(ck, step=2, id="ab" * 32)
    assert backend.put_if_absent(entry_name(seq + 1), [encode_entry(seq + 1, digest, "save", [add_change(forged)])])
    with host(s3_url, tmp_path, "e") as store:
        with pytest.raises(cas.CorruptionError, match="ab" * 8):
            store.load(2)
        assert_same(store.load(1), state(1))


@pytest.mark.parametrize("damage", ["an entry's offset in the footer", "the trailer's footer length"])
def test_a_segment_whose_footer_or_trailer_is_damaged_is_read_from_its_entries(s3_url, tmp_path, damage):
    """A fresh host's cache is built from the segments' footers: one damaged offset placed an
    entry where it is not, and a damaged trailer hid the whole segment, so an intact checkpoint
    did not load on any new host. A footer whose entries do not lie end to end, or that does
    not parse, now has the segment's entries walked."""
    import struct

    import msgpack

    with host(s3_url, tmp_path, "a") as store:
        store.save(state(1), step=1)
        backend = store.backend
        name = max(backend.list("packs/"), key=backend.stat)
    data = bytearray(backend.get(name))
    length = struct.unpack("<I", data[-12:-8])[0]
    if damage == "the trailer's footer length":
        data[-12] ^= 0x01
    else:
        rows = msgpack.unpackb(bytes(data[-12 - length:-12]))
        rows[len(rows) // 2][1] += 2
        footer = msgpack.packb(rows, use_bin_type=True)
        assert len(footer) == length
        data[-12 - length:-12] = footer
    backend.delete(name)
    assert backend.put_if_absent(name, [bytes(data)])
    with host(s3_url, tmp_path, "b") as fresh:
        assert_same(fresh.load(1), state(1))
        assert fresh.verify().ok


SAVER = """
import sys, torch, cas
g = torch.Generator().manual_seed(2)
state = {"model": {f"w{i}": torch.randn(64, 256, generator=g) for i in range(3)}, "step": 2, "note": "state 2"}
with cas.open(sys.argv[1], cache_dir=sys.argv[2], chunk_size=64 << 10) as store:
    store.save(state, step=2)
"""
# a kill after the log entry exists leaves a committed checkpoint; before it, none
KILL_PHASES = [("save.hashed", False), ("session.pack_written", False), ("commit.synced", False),
               ("registry.logged", True), ("commit.in_txn", True)]


@pytest.mark.parametrize("phase,committed", KILL_PHASES)
def test_a_saver_killed_at_each_phase_leaves_every_committed_checkpoint(s3_url, tmp_path, monkeypatch, phase,
                                                                        committed):
    import os
    import signal
    import subprocess
    import sys

    monkeypatch.setenv("CAS_S3_LEASE_TTL", "2")  # gc waits out the killed saver's lease

    with host(s3_url, tmp_path, "a") as store:
        store.save(state(1), step=1)
    env = dict(os.environ, CAS_FAULTS=f"{phase}=kill")
    proc = subprocess.run([sys.executable, "-c", SAVER, s3_url, str(tmp_path / "cache-killed")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with host(s3_url, tmp_path, "fresh") as fresh:
        assert [ck.step for ck in fresh.checkpoints()] == ([1, 2] if committed else [1])
        assert fresh.verify().ok
        assert_same(fresh.load(1), state(1))
        if committed:
            assert_same(fresh.load(2), state(2))
        else:
            fresh.save(state(2), step=2)  # the step is free again
            assert_same(fresh.load(2), state(2))
        report = fresh.gc()  # the killed save's leftovers go
        assert report.deferred is None and fresh.gc(dry_run=True).freed_bytes <= 0, report.to_json()
        assert fresh.verify().ok
        assert_same(fresh.load(2), state(2))


def test_the_server_killed_and_restarted_in_the_middle_of_a_save(tmp_path, monkeypatch):
    from s3server import ACCESS_KEY, SECRET_KEY, SeaweedServer, point_env_at

    server = SeaweedServer(str(tmp_path / "weed"), access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    server.start()
    monkeypatch.setenv("CAS_S3_LEASE_TTL", "2")  # a lease the dead server never saw end expires soon
    try:
        point_env_at(server, monkeypatch)
        url = f"s3://{server.make_bucket()}/run"
        big = {f"w{i}": torch.randn(1024, 1024) for i in range(24)}  # 96 MiB: several segments
        with host(url, tmp_path, "a") as store:
            store.save(state(1), step=1)
            done: list = []
            saver = threading.Thread(target=lambda: done.append(_outcome(lambda: store.save(big, step=2))))
            saver.start()
            time.sleep(0.5)
            server.kill()  # SIGKILL, mid-save
            time.sleep(1.0)
            server.restart()
            saver.join(timeout=180)
            assert done, "the save never returned"
        with host(url, tmp_path, "fresh") as fresh:
            steps = [ck.step for ck in fresh.checkpoints()]
            assert steps in ([1], [1, 2]) and fresh.verify().ok, (steps, done)
            if isinstance(done[0], BaseException):
                assert isinstance(done[0], cas.CasError) and steps == [1], done[0]
            else:
                assert steps == [1, 2]
                loaded = fresh.load(2)  # once: a load per tensor read the 96 MiB 24 times
                assert all(torch.equal(loaded[k], v) for k, v in big.items())
            assert_same(fresh.load(1), state(1))
            report = fresh.gc()  # what the interrupted save left goes
            assert report.deferred is None and fresh.gc(dry_run=True).freed_bytes <= 0, report.to_json()
            assert fresh.verify().ok
    finally:
        server.stop()


def _outcome(fn):
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        return exc
