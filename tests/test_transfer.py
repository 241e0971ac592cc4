"""push, pull and mirror between two local stores: only missing objects travel, as encoded
bytes checked on the way; ids, flags and bytes arrive as they were; a mirror that fails holds
retention back and catches up when it comes back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import cas
from helpers import assert_same, outcome_of, wait_for

OPTS = dict(chunk_size=64 << 10, pack_max=16 << 10)


def state(seed: int, drift: float = 0.0, base: dict | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    if base is None:
        return {"w": torch.randn(64, 1024, generator=g), "frozen": torch.randn(32, 1024, generator=g),
                "b": torch.randn(10, generator=g), "step_info": {"lr": 0.1, "name": "run"}}
    return {"w": base["w"] + drift * torch.randn(64, 1024, generator=g), "frozen": base["frozen"],
            "b": base["b"] + drift, "step_info": dict(base["step_info"])}


@pytest.fixture
def src(tmp_path):
    with cas.open(tmp_path / "src", **OPTS) as s:
        s.save(state(1), step=1, metrics={"loss": 2.0}, meta={"who": "me"})
        s.save(state(2), step=2, milestone=True)
        s.save(state(3), step=3)
        s.pin(3)
        s.wait()  # the background recode done: its re-encodes change stored sizes
        yield s


def same_checkpoints(a, b, steps) -> None:
    for step in steps:
        x, y = a.get(step), b.get(step)
        assert (x.id, x.step, x.created, x.milestone, x.pinned, x.metrics, x.meta, x.logical_bytes) == \
               (y.id, y.step, y.created, y.milestone, y.pinned, y.metrics, y.meta, y.logical_bytes)
        assert_same(a.load(step), b.load(step))


def test_push_all_keeps_ids_flags_and_bytes(src, tmp_path):
    report = src.push(tmp_path / "dst")
    assert [ck.step for ck in report.copied] == [1, 2, 3] and report.already_there == []
    with cas.open(tmp_path / "dst") as dst:
        assert dst.chunk_size == src.chunk_size  # created with the source's chunk size
        same_checkpoints(src, dst, [1, 2, 3])
        assert dst.verify().ok
        assert report.objects_copied == dst.stats().num_objects == src.stats().num_objects
        assert report.bytes_copied == dst.stats().stored_bytes == src.stats().stored_bytes  # encoded as they were
        assert [r.why for r in dst.records.entries()] == ["push", "push", "push"]


def test_push_some_steps_then_the_rest(src, tmp_path):
    first = src.push(tmp_path / "dst", [3, 1])
    assert [ck.step for ck in first.copied] == [1, 3]  # commit order, not argument order
    with cas.open(tmp_path / "dst") as dst:
        assert [ck.step for ck in dst.checkpoints()] == [1, 3]
        rest = src.push(dst)  # an open store as the destination
        assert [ck.step for ck in rest.copied] == [2] and [ck.step for ck in rest.already_there] == [1, 3]
        same_checkpoints(src, dst, [1, 2, 3])
    with pytest.raises(cas.CheckpointNotFoundError):
        src.push(tmp_path / "dst", [99])


def test_pull_into_a_fresh_store(src, tmp_path):
    with cas.open(tmp_path / "fresh", **OPTS) as dst:
        report = dst.pull(src.path, [2, 3])
        assert [ck.step for ck in report.copied] == [2, 3]
        same_checkpoints(src, dst, [2, 3])
        assert not dst.exists(1)
        assert [r.why for r in dst.records.entries()] == ["pull", "pull"]


def test_only_missing_objects_travel(src, tmp_path):
    dst_path = tmp_path / "dst"
    src.push(dst_path)
    again = src.push(dst_path)
    assert again.copied == [] and again.objects_copied == 0 and again.bytes_copied == 0
    assert [ck.step for ck in again.already_there] == [1, 2, 3]
    before = src.stats().num_objects
    src.save(state(0, 0.01, state(3)), step=4)  # "frozen" and "step_info" unchanged
    new = src.stats().num_objects - before
    assert new > 0
    report = src.push(dst_path)
    assert [ck.step for ck in report.copied] == [4]
    assert report.objects_copied == new  # the new chunks and nodes, nothing else
    assert report.objects_skipped > 0  # the frozen tensor's chunks were there
    with cas.open(dst_path) as dst:
        assert dst.stats().num_objects == src.stats().num_objects
        same_checkpoints(src, dst, [4])


def test_delta_chains_travel_with_their_bases(tmp_path):
    with cas.open(tmp_path / "src", delta="forward", **OPTS) as src:
        s = state(1)
        for step in range(1, 5):
            s = state(step, 1e-4, s)
            src.save(s, step=step)
        deltas = src.codec_usage()
        assert any(u["max_depth"] >= 2 for u in deltas.values())
        src.push(tmp_path / "dst", [4])  # the deepest checkpoint alone: its chains down to their roots
        with cas.open(tmp_path / "dst") as dst:
            assert_same(src.load(4), dst.load(4))
            assert dst.verify().ok
            depth = {k: dst.objects.record(k).depth for t in dst.tensors(4) for k in t["chunks"]}
            assert max(depth.values()) >= 2
            assert all(depth[k] == src.objects.record(k).depth for k in depth)
            assert dst.stats().num_objects < src.stats().num_objects  # only what step 4 reaches


def _damage(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)


def test_a_damaged_source_object_is_refused_by_name(src, tmp_path):
    key = next(t for t in src.tensors(2) if t["path"] == "w")["chunks"][1]
    _damage(src.objects.files.path(key))
    with pytest.raises(cas.CorruptionError) as info:
        src.push(tmp_path / "dst", [1, 2])
    assert key.hex() in str(info.value) and info.value.step == 2
    with cas.open(tmp_path / "dst") as dst:
        assert [ck.step for ck in dst.checkpoints()] == [1]  # step 2: nothing of it committed
        assert dst.objects.record(key) is None


def test_a_damaged_delta_base_is_named(tmp_path):
    with cas.open(tmp_path / "src", delta="forward", **OPTS) as src:
        s = state(1)
        for step in (1, 2):
            s = state(step, 1e-4, s)
            src.save(s, step=step)
        top = next(k for t in src.tensors(2) for k in t["chunks"] if src.objects.record(k).base is not None)
        base = src.objects.record(top).base
        _damage(src.objects.files.path(base))
        with pytest.raises(cas.CorruptionError) as info:
            src.push(tmp_path / "dst", [2])
        assert base.hex() in str(info.value)
        with cas.open(tmp_path / "dst") as dst:
            assert dst.checkpoints() == []


def test_a_step_holding_another_checkpoint_is_refused(src, tmp_path):
    with cas.open(tmp_path / "dst", **OPTS) as dst:
        other = dst.save(state(9), step=2)
        with pytest.raises(cas.CheckpointExistsError) as info:
            src.push(dst)
        message = str(info.value)
        assert "step 2" in message and other.id in message and src.get(2).id in message
        assert [ck.step for ck in dst.checkpoints()] == [2] and dst.get(2).id == other.id  # nothing copied


# --- mirror --------------------------------------------------------------------------------
def test_mirror_pushes_every_save(tmp_path):
    mirror = tmp_path / "mirror"
    with cas.open(tmp_path / "local", mirror=mirror, **OPTS) as store:
        s = state(1)
        for step in range(1, 4):
            s = state(step, 0.01, s)
            store.save(s, step=step)
        store.save_async(state(7), step=7)
        store.wait()
        assert store.mirror_status().pending == [] and store.mirror_status().last_error is None
        assert all(ck.mirrored for ck in store.checkpoints())
        with cas.open(mirror) as m:
            same_checkpoints(store, m, [1, 2, 3, 7])
            assert not any(ck.mirrored for ck in m.checkpoints())  # the mirror has no mirror
    shutil.rmtree(tmp_path / "local" / "index")  # the flags are the record log's, not the cache's
    with cas.open(tmp_path / "local") as store:
        assert all(ck.mirrored for ck in store.checkpoints())


def test_retention_keeps_what_a_failing_mirror_lacks_until_it_catches_up(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.write_text("not a store: every push fails")
    with pytest.warns(RuntimeWarning, match="pushing to the mirror"):
        with cas.open(tmp_path / "local", mirror=mirror, retention=cas.Retention(keep_last=1), **OPTS) as store:
            for step in (1, 2, 3):
                store.save(state(step), step=step)
            assert [ck.step for ck in store.checkpoints()] == [1, 2, 3]  # none mirrored: none removed
            report = store.gc(keep_last=1)
            assert report.removed == [] and report.held_for_mirror == [1, 2]
            assert "not mirrored yet" in dict((ck.step, r) for ck, r in report.kept)[1]
            assert json.loads(json.dumps(report.to_json()))["held_for_mirror"] == [1, 2]
            assert store.mirror_status().pending == [1, 2, 3]
            mirror.unlink()  # the mirror comes back
            store.wait()
            assert store.mirror_status().pending == [] and store.mirror_status().failures == 0
            with cas.open(mirror) as m:
                assert [ck.step for ck in m.checkpoints()] == [1, 2, 3]
            store.save(state(4), step=4)  # its retention may now remove the mirrored ones
            store.wait()
            assert [ck.step for ck in store.checkpoints()] == [4]
            with cas.open(mirror) as m:
                assert [ck.step for ck in m.checkpoints()] == [1, 2, 3, 4]


def test_close_with_a_failing_mirror_keeps_the_local_copy_and_reopen_requeues(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.write_text("down")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        store = cas.open(tmp_path / "local", mirror=mirror, **OPTS)
        store.save(state(1), step=1)
        store.save(state(2), step=2)
        store.close()  # gives up at the first failed push since close began
    messages = [str(w.message) for w in seen]
    assert any("pushing to the mirror" in m for m in messages)
    assert any("not yet in the mirror" in m and "[1, 2]" in m for m in messages)
    with cas.open(tmp_path / "local") as store:  # no mirror: nothing pushed, nothing lost
        assert [(ck.step, ck.mirrored) for ck in store.checkpoints()] == [(1, False), (2, False)]
        assert store.mirror_status() is None
    mirror.unlink()
    with cas.open(tmp_path / "local", mirror=mirror) as store:  # queued again from the record log
        store.wait()
        assert all(ck.mirrored for ck in store.checkpoints())
        with cas.open(mirror) as m:
            same_checkpoints(store, m, [1, 2])


def test_mirror_is_refused_on_itself_and_read_only(tmp_path):
    with cas.open(tmp_path / "local", **OPTS) as store:
        store.save(state(1), step=1)
    with pytest.raises(cas.CasError, match="is the store itself"):
        cas.open(tmp_path / "local", mirror=tmp_path / "local")
    with pytest.raises(cas.CasError, match="read-only"):
        cas.open(tmp_path / "local", mirror=tmp_path / "m", readonly=True)


# --- CLI -------------------------------------------------------------------------------------
def cli(*args, store):
    env = {k: v for k, v in os.environ.items() if k != "CAS_STORE"}
    return subprocess.run([sys.executable, "-m", "cas.cli", "--store", str(store), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_cli_push_pull_round_trip(src, tmp_path):
    src.close()
    out = cli("push", tmp_path / "dst", 1, 3, store=src.path)
    assert out.returncode == 0, out.stderr
    assert "pushed 2 checkpoints" in out.stdout
    out = cli("push", tmp_path / "dst", "--json", store=src.path)
    data = json.loads(out.stdout)
    assert [c["step"] for c in data["copied"]] == [2] and [c["step"] for c in data["already_there"]] == [1, 3]
    out = cli("pull", tmp_path / "dst", "--json", store=tmp_path / "back")
    assert out.returncode == 0, out.stderr
    assert [c["step"] for c in json.loads(out.stdout)["copied"]] == [1, 3, 2]  # dst's commit order
    with cas.open(src.path) as a, cas.open(tmp_path / "back") as b:
        same_checkpoints(a, b, [1, 2, 3])
    (tmp_path / "file").write_text("x")
    bad = cli("push", tmp_path / "file", store=src.path)
    assert bad.returncode == 2 and bad.stderr.startswith("cas: error:") and "Traceback" not in bad.stderr
    assert cli("pull", tmp_path / "dst", 99, store=tmp_path / "back").returncode == 2


def test_cli_ls_shows_the_mirrored_column(tmp_path):
    with cas.open(tmp_path / "local", mirror=tmp_path / "m", **OPTS) as store:
        store.save(state(1), step=1)
        store.wait()
    plain = cli("ls", store=tmp_path / "local")
    assert plain.returncode == 0 and "mirrored" in plain.stdout and "yes" in plain.stdout
    assert json.loads(cli("ls", "--json", store=tmp_path / "local").stdout)[0]["mirrored"] is True
    assert "mirrored" not in cli("ls", store=tmp_path / "m").stdout


def paused_pull(tmp_path, src_path, meanwhile):
    """(the destination store, the pull's report or exception) of a pull of `src_path` into
    tmp_path/dst paused once its first chains are planned, while `meanwhile(source store)` runs."""
    import threading

    from cas import faults

    gate = tmp_path / "gate"
    faults.configure(f"transfer.chains_planned=pause:{gate}@1")
    results: list = []
    dst = cas.open(tmp_path / "dst", **OPTS)
    puller = threading.Thread(target=lambda: results.append(outcome_of(dst.pull, src_path)))
    try:
        puller.start()
        wait_for(f"{gate}.reached")
        with cas.open(src_path, **OPTS) as s:
            meanwhile(s)
    finally:
        gate.touch()
        faults.configure("")
        puller.join(timeout=120)
    return dst, results[0]


def test_a_pull_beside_a_save_that_recodes_what_it_copies(tmp_path):
    """A pull planned its chains (step 1's chunks whole), then the source's writer saved step 2
    and its recode made step 1's chunks deltas of step 2's, in new packs, and removed the old
    ones: the pull read the new encodings along the old chains and failed with a false
    CorruptionError (the pull audit of stop 29). It now copies such objects by their content."""
    src_path = tmp_path / "src"
    first = state(1)
    with cas.open(src_path, **OPTS) as s:
        s.save(first, step=1)

    def meanwhile(s) -> None:
        s.save(state(2, drift=1e-3, base=first), step=2)
        s.wait()
        w_chunks = next(t["chunks"] for t in s.tensors(1) if t["path"] == "w")
        assert all(s.objects.record(k).base is not None for k in w_chunks)  # deltas of step 2's now

    dst, result = paused_pull(tmp_path, src_path, meanwhile)
    with dst:
        assert not isinstance(result, Exception), result
        assert_same(dst.load(1), first)
        assert dst.verify().ok


def test_a_pull_whose_source_removes_a_checkpoint_meanwhile_copies_the_others(tmp_path):
    """A push or pull from a bucket beside a gc on another host failed with `object file is
    missing` (a CorruptionError, read as damage, though the source verified clean) and gave up
    the whole copy, the newest checkpoint included (audit of stop 33). A checkpoint the source
    no longer holds is now skipped and reported; the rest are copied."""
    src_path = tmp_path / "src"
    with cas.open(src_path, delta=False, **OPTS) as s:
        for step in (1, 2, 3):
            s.save(state(10 * step), step=step)

    def meanwhile(s) -> None:  # step 1, being copied, removed and its objects swept
        s.delete(1)
        assert s.gc().objects_swept > 0

    dst, report = paused_pull(tmp_path, src_path, meanwhile)
    with dst:
        assert not isinstance(report, Exception), report
        assert [ck.step for ck in report.removed_meanwhile] == [1]
        assert [ck.step for ck in report.copied] == [2, 3]
        assert_same(dst.load(3), state(30))
        assert dst.verify().ok


def test_a_refused_push_makes_no_destination_and_pull_makes_a_new_store_as_push_does(tmp_path):
    """`cas push DEST 99` (no step 99) exited 2 but made an empty store at DEST. `cas pull` into
    a new store made it with default options: a 4 MiB chunk size whatever the source's (saves
    resumed from it did not dedup against what it copied), and encrypted under $CAS_KEY_FILE
    with its own master key, so the pull was refused (audit of stop 38)."""
    source = tmp_path / "src"
    with cas.open(source, chunk_size=1 << 20) as store:
        store.save({"w": torch.arange(300_000.0)}, step=1)
    refused = cli("push", tmp_path / "dest", 99, store=source)
    assert refused.returncode == 2 and "no checkpoint with step 99" in refused.stderr
    assert not os.path.exists(tmp_path / "dest")
    key_file = tmp_path / "key"
    key_file.write_text("a passphrase")
    env = {**os.environ, "CAS_KEY_FILE": str(key_file)}
    env.pop("CAS_STORE", None)
    pulled = subprocess.run([sys.executable, "-m", "cas.cli", "--store", str(tmp_path / "new"), "pull", str(source)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert pulled.returncode == 0, pulled.stderr
    with cas.open(tmp_path / "new") as new:
        assert new.chunk_size == 1 << 20 and not new.encrypted and [ck.step for ck in new.checkpoints()] == [1]
        new.save({"w": torch.arange(300_000.0)}, step=2)
        assert new.get(2).new_bytes < 4096  # the copied chunks are the ones a resumed save makes
