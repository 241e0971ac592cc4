"""DCP into a store in a bucket, on a real S3 server (SeaweedFS, tests/s3server.py): ranks with
caches of their own write segments straight to the bucket and only the coordinator commits;
ranks with fresh caches load at other world sizes, bit for bit."""

from __future__ import annotations

import pytest
import torch

import cas
from cas.store import dcp as cdcp
from cas.store.location import locate
from s3server import s3_bucket, s3_prefix, s3_server, s3_url  # noqa: F401 - fixtures
from test_dcp import EXTRA, blank_target, flat, reference, require_ok, run_group, same_bits

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CHUNK = 64 << 10


def pack_bytes(url: str) -> int:
    return sum(size for _, size in locate(url).backend.list_sizes("packs/"))


def plain_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 256, generator=g), "h": torch.randn(40, 8, generator=g).half(),
            "i": torch.arange(10_000, dtype=torch.int64), "extra": {"seed": seed, "pair": (1, "x")}}


def zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"seed": 0, "pair": ()}
            for k, v in state.items()}


def assert_same_state(got: dict, want: dict) -> None:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(got[key], value), key
        else:
            assert got[key] == value, key


# --- one process, no process group --------------------------------------------------------
def test_a_single_process_round_trip_through_a_bucket(s3_url, tmp_path):
    state = plain_state(1)
    first = cdcp.save(state, s3_url, 1, chunk_size=CHUNK, no_dist=True, cache_dir=str(tmp_path / "a"))
    written = pack_bytes(s3_url)
    assert first.new_bytes > first.logical_bytes // 2 and written >= first.new_bytes

    state["extra"]["seed"] = 2  # the tensors unchanged: this process proposes its chunks, all stored
    second = cdcp.save(state, s3_url, 2, no_dist=True, cache_dir=str(tmp_path / "a"))
    assert second.new_bytes < 4096 and pack_bytes(s3_url) - written < 8192

    target = zeros_like(state)
    ck = cdcp.load(target, s3_url, 1, no_dist=True, cache_dir=str(tmp_path / "fresh"))  # another host
    assert ck.step == 1 and ck.id == first.id
    assert_same_state(target, dict(state, extra={"seed": 1, "pair": (1, "x")}))
    with cas.open(s3_url, cache_dir=str(tmp_path / "b")) as store:  # the store's own tools agree
        assert [c.step for c in store.checkpoints()] == [1, 2]
        assert store.verify().ok


def test_a_restarted_process_dedups_against_the_latest_checkpoint(s3_url, tmp_path):
    state = plain_state(3)
    cdcp.save(state, s3_url, 1, chunk_size=CHUNK, no_dist=True, cache_dir=str(tmp_path / "a"))
    written = pack_bytes(s3_url)
    cdcp.segments.forget(s3_url)  # as a restarted process: it proposes nothing, the coordinator seeds it
    again = cdcp.save(state, s3_url, 2, no_dist=True, cache_dir=str(tmp_path / "b"))
    assert again.new_bytes < 4096 and pack_bytes(s3_url) - written < 8192


def test_file_urls_name_the_local_folder(tmp_path):
    state = plain_state(4)
    cdcp.save(state, f"file://{tmp_path}/s", 1, chunk_size=CHUNK, no_dist=True)
    target = zeros_like(state)
    assert cdcp.load(target, tmp_path / "s", no_dist=True).step == 1
    assert_same_state(target, state)


def test_delta_saves_into_a_bucket_are_refused_clearly(s3_url):
    with pytest.raises(cas.CasError, match='delta="forward" saves into a bucket store'):
        cdcp.CasWriter(s3_url, step=1, delta="forward")


# --- ranks on "different hosts": each its own cache -------------------------------------------
@pytest.fixture(scope="module")
def bucket_save(tmp_path_factory, s3_server, s3_bucket):
    """2 ranks, FSDP2 + AdamW + extras, into a fresh bucket prefix: steps 1 and 2."""
    base = tmp_path_factory.mktemp("dcp_s3")
    url = f"s3://{s3_bucket}/dcp-{base.name}"
    env = {"AWS_ENDPOINT_URL": s3_server.endpoint, "AWS_ACCESS_KEY_ID": s3_server.access_key,
           "AWS_SECRET_ACCESS_KEY": s3_server.secret_key, "AWS_REGION": "us-east-1"}
    group = require_ok(run_group("s3_save", 2, url, base / "out", env=dict(env, DCP_CACHE_ROOT=str(base / "save"))))
    return group, env, base


def test_two_ranks_with_caches_of_their_own_save_and_step_2_writes_little(bucket_save):
    group, _, _ = bucket_save
    r0, r1 = group.ranks[0], group.ranks[1]
    assert r0["saved"] == r1["saved"]  # every rank learns the same commits
    first, second = r0["saved"]["1"], r0["saved"]["2"]
    assert first["new"] > first["logical"] // 2 and r0["bytes1"] >= first["new"]
    assert second["logical"] == first["logical"] and second["new"] < 8192
    assert r0["bytes2"] - r0["bytes1"] < 16384  # the nodes of step 2, no chunk again


@pytest.mark.parametrize("world", [1, 3])
def test_ranks_with_fresh_caches_load_the_two_rank_save_bit_for_bit(bucket_save, world):
    group, env, base = bucket_save
    if world == 1:  # in this process, with a fresh cache
        ref = reference(group, "ref1")
        state = blank_target(ref)
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            ck = cdcp.load(state, group.store, 1, no_dist=True, cache_dir=str(base / "load1"))
        assert ck.step == 1 and state["extra"] == EXTRA
        loaded = flat({"model": state["model"], "optim": {"state": state["optim"]["state"]}})
        assert set(loaded) == set(ref) and [k for k in ref if not same_bits(loaded[k], ref[k])] == []
        return
    loaded = require_ok(run_group("s3_load", world, group.store, group.out,
                                  env=dict(env, DCP_CACHE_ROOT=str(base / f"load{world}"))))
    r0 = loaded.ranks[0]
    assert r0["compared"] == 16 and r0["mismatches"] == []
    assert all(loaded.ranks[r]["loaded_step"] == 1 and loaded.ranks[r]["extra"] == repr(EXTRA) for r in range(world))


def test_a_reported_segment_that_is_missing_or_too_short_is_refused(s3_url, tmp_path):
    """The coordinator's one stat per pack: a pack a rank names must exist and hold its entries."""
    from cas.packs import PackEntry, PackFiles

    with cas.open(s3_url, cache_dir=str(tmp_path / "a"), chunk_size=CHUNK) as store:
        key = bytes(range(32))
        pack, placed = PackFiles(store.backend).write([(key, b"x" * 100, 100, None)])
        with store.objects.session("test") as session:
            with pytest.raises(cas.errors.MissingObjectError, match="pack a distributed writer reported"):
                session.adopt_packed(bytes(32), [PackEntry(key, placed[0][1], 100, 100, None)])
            with pytest.raises(cas.errors.CorruptionError, match="which holds"):
                session.adopt_packed(pack, [PackEntry(key, placed[0][1], 10_000, 100, None)])
            session.adopt_packed(pack, [PackEntry(key, placed[0][1], placed[0][2], 100, None)])
