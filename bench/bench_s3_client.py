"""boto3 vs obstore on a real SeaweedFS server (started here, on loopback): which client
cas.s3 should use, and whether multipart uploads pay.

    .venv/bin/python bench/bench_s3_client.py [--endpoint URL --bucket B] [--big 6] [--small 32]

Per client: create-only PUT and GET throughput of 4 MiB and 64 MiB objects with 8 threads, the
median of a small conditional (create-only) PUT, of a refused one, and of a 64 KiB ranged GET;
then cas.s3.S3Backend itself, single PUT vs multipart, on 64 MiB objects. Server and client
share the machine's cores, so PUT figures are mostly the server's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

THREADS = 8


class Boto:
    name = "boto3"

    def __init__(self, endpoint, bucket, key, secret):
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key,
                              aws_secret_access_key=secret,
                              config=Config(max_pool_connections=32, request_checksum_calculation="when_required",
                                            response_checksum_validation="when_required"))

    def put_new(self, path, data) -> bool:
        try:
            self.c.put_object(Bucket=self.bucket, Key=path, Body=data, IfNoneMatch="*")
            return True
        except self.c.exceptions.ClientError:
            return False

    def get(self, path):
        return self.c.get_object(Bucket=self.bucket, Key=path)["Body"].read()

    def get_range(self, path, start, length):
        return self.c.get_object(Bucket=self.bucket, Key=path, Range=f"bytes={start}-{start + length - 1}")["Body"].read()


class Obstore:
    name = "obstore"

    def __init__(self, endpoint, bucket, key, secret):
        import obstore
        from obstore.store import S3Store

        self.ob = obstore
        self.s = S3Store(bucket, endpoint=endpoint, access_key_id=key, secret_access_key=secret, region="us-east-1",
                         client_options={"allow_http": True, "pool_max_idle_per_host": "32"})

    def put_new(self, path, data) -> bool:
        from obstore.exceptions import AlreadyExistsError

        try:
            self.ob.put(self.s, path, data, mode="create")  # create mode: always one PUT
            return True
        except AlreadyExistsError:
            return False

    def get(self, path):
        return self.ob.get(self.s, path).bytes()

    def get_range(self, path, start, length):
        return self.ob.get_range(self.s, path, start=start, length=length)


def throughput(fn, items, nbytes) -> float:
    began = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(fn, items))
    return nbytes / (time.perf_counter() - began) / 1e6


def p50_ms(fn, n: int) -> float:
    times = []
    for i in range(n):
        began = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def bench_client(client, tag: str, small: int, big: int) -> dict:
    out, data4, data64 = {}, os.urandom(4 << 20), os.urandom(64 << 20)
    for label, data, count in (("4MiB", data4, small), ("64MiB", data64, big)):
        paths = [f"{tag}/{client.name}/{label}/{i}" for i in range(count)]
        assert client.put_new(paths[0], data)
        out[f"PUT {label} MB/s"] = throughput(lambda p: client.put_new(p, data), paths[1:], (count - 1) * len(data))
        out[f"GET {label} MB/s"] = throughput(client.get, paths, count * len(data))
    base = f"{tag}/{client.name}/4MiB/0"
    out["conditional PUT p50 ms"] = p50_ms(lambda i: client.put_new(f"{tag}/{client.name}/tiny/{i}", b"x" * 100), 200)
    out["refused PUT p50 ms"] = p50_ms(lambda i: client.put_new(base, b"x" * 100), 100)
    out["ranged GET 64KiB p50 ms"] = p50_ms(lambda i: client.get_range(base, (i * 65536) % (4 << 20), 65536), 200)
    return out


def bench_backend(endpoint, bucket, key, secret, tag: str, big: int) -> dict:
    from cas.s3 import S3Backend

    out, data = {}, os.urandom(64 << 20)
    for label, threshold in (("single PUT", None), ("multipart 16 MiB parts", 64 << 20)):
        backend = S3Backend(bucket, f"{tag}/backend/{threshold}", endpoint_url=endpoint, access_key=key,
                            secret_key=secret, multipart_threshold=threshold, spool_dir=tempfile.mkdtemp())
        out[f"backend {label} 64MiB MB/s"] = throughput(
            lambda i: backend.put_if_absent(f"packs/{i}", [data]), range(big), big * len(data))
    buffers = [bytearray((64 << 20) + 1) for _ in range(THREADS)]
    out["backend GET into buffer 64MiB MB/s"] = throughput(
        lambda i: backend.get(f"packs/{i}", buffer=lambda n: memoryview(buffers[i % THREADS])), range(big),
        big * len(data))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--small", type=int, default=32, help="4 MiB objects per client")
    ap.add_argument("--big", type=int, default=6, help="64 MiB objects per client")
    args = ap.parse_args()
    server = None
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID", "bench"), os.environ.get("AWS_SECRET_ACCESS_KEY", "bench-secret")
    if args.endpoint is None:
        from s3server import SeaweedServer

        server = SeaweedServer(tempfile.mkdtemp(prefix="cas-bench-weed-"), access_key=key, secret_key=secret)
        server.start()
        server.make_bucket(args.bucket)
        args.endpoint = server.endpoint
    tag = f"run{int(time.time())}"
    try:
        rows = {c.name: bench_client(c, tag, args.small, args.big)
                for c in (Boto(args.endpoint, args.bucket, key, secret), Obstore(args.endpoint, args.bucket, key, secret))}
        extra = bench_backend(args.endpoint, args.bucket, key, secret, tag, args.big)
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.data_dir, ignore_errors=True)
    print(f"| measure | {' | '.join(rows)} |\n|---|{'---|' * len(rows)}")
    for measure in next(iter(rows.values())):
        print(f"| {measure} | {' | '.join(f'{r[measure]:.1f}' for r in rows.values())} |")
    for measure, value in extra.items():
        print(f"| {measure} | {value:.1f} |")


if __name__ == "__main__":
    main()
