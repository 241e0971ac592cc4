"""cas.s3.S3Backend against a real SeaweedFS server (tests/s3server.py): the backend contract,
leases by the server's clock, retries through a fault-injecting proxy, and named errors."""

import os
import signal
import subprocess
import threading
import time

import pytest

from cas.backend import Staged
from cas.errors import (BlobAbsentError, BucketMissingError, CasError, CredentialsError, EndpointUnreachableError,
                        MissingObjectError, ObjectStoreError, ObjectStoreUnavailableError, ReplaceRefusedError)
from cas.fsutil import host_tag
from cas.s3 import RetryPolicy, S3Backend, parse_url
from s3server import ACCESS_KEY, SECRET_KEY, SeaweedServer, s3_bucket, s3_prefix, s3_server  # noqa: F401 - fixtures
from tcpfault import FaultProxy

FAST = RetryPolicy(tries=6, first=0.05, cap=1.0, total=20.0)


def make_backend(endpoint, bucket, tmp_path, prefix="runs/exp1", **options):
    options = {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "spool_dir": str(tmp_path / "spool"),
               "lease_ttl": 2.0, "retry": FAST, **options}
    return S3Backend(bucket, prefix, endpoint_url=endpoint, **options)


@pytest.fixture
def backend(s3_server, s3_bucket, s3_prefix, tmp_path):
    return make_backend(s3_server.endpoint, s3_bucket, tmp_path, f"{s3_prefix}/runs/exp1")


@pytest.fixture
def own_server(tmp_path):
    """A server of this test's own, which the test may kill, restart and stop."""
    server = SeaweedServer(str(tmp_path / "weed"), access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_create_only_race_has_one_winner(backend):
    writers, rounds = 16, 3
    for r in range(rounds):
        barrier, results = threading.Barrier(writers), [None] * writers

        def write(i, name=f"log/{r:04d}"):
            barrier.wait()
            results[i] = backend.put_if_absent(name, [f"writer {i} ".encode(), b"x" * 100])

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results.count(True) == 1 and results.count(False) == writers - 1
        winner = results.index(True)
        assert backend.get(f"log/{r:04d}") == f"writer {winner} ".encode() + b"x" * 100


def test_ranged_get_into_buffer_and_absent(backend):
    data = bytes(range(256)) * 40
    assert backend.put_if_absent("objects/ab/ab01", [data[:1000], memoryview(data[1000:])])
    assert backend.put_if_absent("objects/ab/ab01", [b"other"]) is False
    assert backend.get("objects/ab/ab01") == data
    assert backend.stat("objects/ab/ab01") == len(data)
    buf = bytearray(8192)
    view = backend.get("objects/ab/ab01", 300, 700, buffer=lambda n: memoryview(buf))
    assert bytes(view) == data[300:1000] and view.obj is buf
    assert backend.get("objects/ab/ab01", len(data) - 5) == data[-5:]
    assert backend.get("objects/ab/ab01", len(data) + 10) == b""
    assert backend.get("objects/ab/ab01", 5, 0) == b""
    with pytest.raises(BlobAbsentError):
        backend.get("objects/ab/none")
    with pytest.raises(BlobAbsentError):
        backend.get("objects/ab/none", 5, 0)
    assert backend.stat("objects/ab/none") is None
    with pytest.raises(CasError):
        backend.get("../escape")


def test_small_reads_share_windows_fetched_once_and_a_verify_reads_past_them(backend):
    """readahead.Windows over a real bucket: reads inside one window cost one GET between them,
    one that straddles two windows fetches both at once, a read past the blob's end or larger
    than SMALL answers None (the caller reads it directly), and under reading_from_disk (a
    verify, which must see the bucket's bytes as they are now) only windows fetched inside it
    answer, and none of those after it."""
    from cas.readahead import SMALL, WINDOW, Windows, reading_from_disk

    data = os.urandom(2 * WINDOW + 5000)
    assert backend.put_if_absent("packs/ab/ab01", [data])
    windows = Windows(backend, keep=2)
    backend.requests.clear()
    for start, length in ((100, 113), (300, 2000), (WINDOW - 200, 150)):  # all in window 0
        assert bytes(windows.read("packs/ab/ab01", start, length)) == data[start:start + length]
    assert dict(backend.requests) == {"GET": 1}
    assert bytes(windows.read("packs/ab/ab01", 2 * WINDOW - 10, 40)) == data[2 * WINDOW - 10:2 * WINDOW + 30]
    assert dict(backend.requests) == {"GET": 2}  # windows 1 and 2 in one read
    assert bytes(windows.read("packs/ab/ab01", 2 * WINDOW + 4000, 1000)) == data[-1000:]  # the short last one
    assert windows.read("packs/ab/ab01", 2 * WINDOW + 4000, 1001) is None  # past the end
    assert windows.read("packs/ab/ab01", 0, SMALL + 1) is None
    assert dict(backend.requests) == {"GET": 2}
    assert bytes(windows.read("packs/ab/ab01", 10, 10)) == data[10:20]  # window 0 was evicted (keep=2)
    assert dict(backend.requests) == {"GET": 3}
    with reading_from_disk():  # a verify: no window fetched before answers, those it fetches do
        assert bytes(windows.read("packs/ab/ab01", 10, 10)) == data[10:20]
        assert bytes(windows.read("packs/ab/ab01", 30, 10)) == data[30:40]
        assert dict(backend.requests) == {"GET": 4}
    assert bytes(windows.read("packs/ab/ab01", 10, 10)) == data[10:20]  # nor after it
    assert dict(backend.requests) == {"GET": 5}
    with pytest.raises(BlobAbsentError):
        windows.read("packs/ab/none", 0, 10)


def test_threads_asking_for_a_window_being_fetched_wait_for_that_fetch(backend):
    """A load's threads read neighbouring small objects at once: each missed the window the
    other was fetching and fetched it again (a fresh host's load of a small model fetched three
    windows twice). Now one GET serves them all; a fetch that fails leaves each waiting thread to
    try, and fail, on its own rather than wait for ever."""
    from concurrent.futures import ThreadPoolExecutor

    from cas.readahead import WINDOW, Windows

    data = os.urandom(WINDOW + 1000)
    assert backend.put_if_absent("packs/ab/ab02", [data])
    windows, real_get = Windows(backend), backend.get
    started = threading.Barrier(8)

    def slow_get(*args, **kwargs):  # every thread is inside read() before the first fetch answers
        time.sleep(0.2)
        return real_get(*args, **kwargs)
    backend.get = slow_get

    def read(i: int):
        started.wait()
        return bytes(windows.read("packs/ab/ab02", 1000 * i, 500))

    backend.requests.clear()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(read, range(8)))
    assert got == [data[1000 * i:1000 * i + 500] for i in range(8)]
    assert dict(backend.requests) == {"GET": 1}

    def read_absent(i: int):
        started.wait()
        try:
            windows.read("packs/ab/none2", 1000 * i, 500)
        except BlobAbsentError:
            return "absent"
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(read_absent, range(8), timeout=60)) == ["absent"] * 8


def test_list_pages_beyond_1000_and_delete_many(backend):
    from concurrent.futures import ThreadPoolExecutor

    names = [f"packs/{i % 7}/p{i:05d}" for i in range(1020)]
    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(lambda n: backend.put_if_absent(n, [n.encode()]), names))
    backend.put_if_absent("log/0001", [b"r"])
    assert backend.list("packs/") == sorted(names)
    assert backend.list("packs/3/") == sorted(n for n in names if n.startswith("packs/3/"))
    assert backend.list("") == sorted(names + ["log/0001"])
    assert backend.delete_many(names[:1010] + ["packs/absent"]) == 1011
    assert backend.list("packs/") == sorted(names[1010:])
    assert backend.delete("log/0001") is True and backend.delete("log/0001") is False
    assert backend.list("log/") == []


def test_stage_publish_discard_and_staged_tokens(backend):
    staged = backend.stage("log/0007", [b"record ", b"seven"])
    assert backend.stat("log/0007") is None  # nothing visible before publish
    assert backend.peek(staged, 6) == (12, b"record")
    again = backend.staged("log/0007", staged.token)  # as another process of this host names it
    assert again == staged
    assert backend.publish(again) is True
    assert backend.get("log/0007") == b"record seven"
    with pytest.raises(MissingObjectError):
        backend.peek(staged, 1)  # the spool file went with the upload
    late = backend.stage("log/0007", [b"late"])
    assert backend.publish(late) is False
    assert backend.peek(late, 4) == (4, b"late")  # left for the caller
    backend.discard(late)
    with pytest.raises(MissingObjectError):
        backend.peek(late, 1)
    elsewhere = staged.token.replace(f".{host_tag()}.", ".other-host.")
    for bad in (elsewhere, "../../etc/passwd", ".log.x.tmp", staged.token + "x"):
        with pytest.raises(CasError):
            backend.staged("log/0007", bad)
    with pytest.raises(CasError):
        backend.staged("log/0008", staged.token)


def test_clean_tmp_removes_only_dead_writers_spool(backend):
    live = backend.stage("objects/cd/cd01", [b"live"])
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    dead = f".cd02.{host_tag()}.{dead_pid.pid}.1.0123abcd.tmp"
    with open(os.path.join(backend.spool_dir, dead), "wb") as f:
        f.write(b"dead")
    foreign = f".cd03.other-host.{dead_pid.pid}.1.0123abcd.tmp"
    with open(os.path.join(backend.spool_dir, foreign), "wb") as f:
        f.write(b"not ours to judge")
    assert backend.clean_tmp() == 1
    left = set(os.listdir(backend.spool_dir))
    assert live.token in left and foreign in left and dead not in left


def test_replace_refused_and_capabilities(backend):
    staged = backend.stage("log/0001", [b"x"])
    with pytest.raises(ReplaceRefusedError, match="never replaces") as info:
        backend.replace(staged)
    assert info.value.reason == "replace"
    caps = backend.capabilities
    assert (caps.locks, caps.local_path, caps.batched_sync) == (False, None, False)
    assert backend.free_bytes() is None
    backend.sync()
    assert backend.where("log/0001") == f"s3://{backend.bucket}/{backend.prefix}/log/0001"


def test_move_never_over(backend):
    backend.put_if_absent("objects/ef/ef01", [b"damaged"])
    backend.put_if_absent("quarantine/ef02", [b"taken"])
    assert backend.move("objects/ef/ef01", "quarantine/ef01") is True
    assert backend.stat("objects/ef/ef01") is None and backend.get("quarantine/ef01") == b"damaged"
    backend.put_if_absent("objects/ef/ef02", [b"second"])
    assert backend.move("objects/ef/ef02", "quarantine/ef02") is False
    assert backend.get("quarantine/ef02") == b"taken" and backend.get("objects/ef/ef02") == b"second"
    with pytest.raises(BlobAbsentError):
        backend.move("objects/ef/none", "quarantine/none")


def test_large_bodies_race_with_one_winner(backend):
    """One PUT carries any blob (multipart is off by default: SeaweedFS lets racing create-only
    completions both win); two writers of 11 MiB racing: one winner, its bytes stored."""
    for r in range(2):
        bodies, barrier, results = [os.urandom(11 << 20) for _ in range(2)], threading.Barrier(2), [None, None]

        def write(i):
            barrier.wait()
            results[i] = backend.put_if_absent(f"packs/big{r}", [bodies[i][:3 << 20], bodies[i][3 << 20:]])

        threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == [False, True]
        assert backend.get(f"packs/big{r}") == bodies[results.index(True)]


def test_multipart_create_only(s3_server, s3_bucket, s3_prefix, tmp_path):
    backend = make_backend(s3_server.endpoint, s3_bucket, tmp_path, s3_prefix, multipart_threshold=5 << 20,
                           part_size=5 << 20)
    bodies = [os.urandom(11 << 20), os.urandom(11 << 20)]
    assert backend.put_if_absent("packs/big", [bodies[0][:3 << 20], bodies[0][3 << 20:]]) is True
    assert backend.put_if_absent("packs/big", [bodies[1]]) is False
    assert backend.get("packs/big") == bodies[0]
    staged = backend.stage("packs/big2", [bodies[1]])
    assert backend.publish(staged) is True
    assert backend.get("packs/big2", 7 << 20, 10) == bodies[1][7 << 20:(7 << 20) + 10]
    late = backend.stage("packs/big2", [bodies[0]])
    assert backend.publish(late) is False and backend.peek(late, 1)[0] == 11 << 20
    assert s3_server.client().list_multipart_uploads(Bucket=s3_bucket, Prefix=s3_prefix).get("Uploads", []) == []


def test_lease_alive_renewed_and_released(backend):
    lease = backend.lease("leases/aa01", b"holder info")
    assert backend.get("leases/aa01") == b"holder info"
    with pytest.raises(CasError):
        backend.lease("leases/aa01", b"second holder")
    assert backend.lease_alive("leases/aa01") is True
    time.sleep(3.5)  # past the 2 s ttl: alive only because it was renewed
    assert backend.lease_alive("leases/aa01") is True and not lease.lost.is_set()
    lease.release()
    lease.release()
    assert backend.lease_alive("leases/aa01") is None


def test_lease_of_killed_holder_expires_by_server_clock(backend, s3_server, tmp_path):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder: takes the lease, says so, then waits to be killed
        try:
            os.close(read_end)
            make_backend(s3_server.endpoint, backend.bucket, tmp_path, backend.prefix).lease("leases/bb01", b"doomed")
            os.write(write_end, b"1")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"1"
        assert backend.lease_alive("leases/bb01") is True
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)
    for _ in range(40):  # its last renewal ages past the ttl: judged dead within a few seconds
        if backend.lease_alive("leases/bb01") is False:
            break
        time.sleep(0.25)
    assert backend.lease_alive("leases/bb01") is False


def test_lease_lost_when_reaped(backend, s3_server):
    lease = backend.lease("leases/cc01", b"x")
    s3_server.client().delete_object(Bucket=backend.bucket, Key=f"{backend.prefix}/leases/cc01")
    assert lease.lost.wait(10)
    lease.release()


def test_server_killed_and_restarted_mid_operation(own_server, tmp_path):
    bucket = own_server.make_bucket()
    patient = RetryPolicy(tries=30, first=0.1, cap=1.0, total=40.0)
    backend = make_backend(own_server.endpoint, bucket, tmp_path, retry=patient, connect_timeout=1.0)
    names = [f"objects/{i:02x}/obj{i}" for i in range(30)]
    results, started = [], threading.Event()

    def save():
        for i, name in enumerate(names):
            results.append(backend.put_if_absent(name, [name.encode() * 100]))
            if i == 5:
                started.set()

    writer = threading.Thread(target=save)
    writer.start()
    assert started.wait(30)
    own_server.kill()
    assert len(results) < len(names)  # killed mid-save
    time.sleep(0.5)
    own_server.start()
    writer.join(60)
    assert results == [True] * len(names)
    assert all(backend.get(n) == n.encode() * 100 for n in names)
    own_server.stop()
    quick = make_backend(own_server.endpoint, bucket, tmp_path, retry=RetryPolicy(tries=3, first=0.05, total=2.0))
    with pytest.raises(EndpointUnreachableError, match="could not be reached.*3 tries") as info:
        quick.get(names[0])
    assert isinstance(info.value, ObjectStoreError) and info.value.reason == "unreachable"


def test_slowdown_resets_and_timeouts_are_retried(s3_server, s3_bucket, s3_prefix, tmp_path):
    proxy = FaultProxy(s3_server.ports["s3"], delay=1.5)
    try:
        backend = make_backend(proxy.endpoint, s3_bucket, tmp_path, s3_prefix, read_timeout=0.5)
        proxy.inject("slowdown", 2)
        proxy.inject("reset", 2)
        assert backend.put_if_absent("log/0001", [b"through faults"]) is True
        proxy.inject("reset", 1)
        proxy.inject("slowdown", 1)
        assert backend.get("log/0001") == b"through faults"
        assert proxy.seen["slowdown"] == 3 and proxy.seen["reset"] == 3
        proxy.inject("delay", 1)  # the delayed PUT lands after the client gave up: its retry sees its own object
        assert backend.put_if_absent("log/0002", [b"late but mine"]) is True
        assert backend.get("log/0002") == b"late but mine" and proxy.seen["delay"] == 1
        assert backend.put_if_absent("log/0002", [b"not mine"]) is False
        proxy.inject("slowdown", FAST.tries)
        with pytest.raises(ObjectStoreUnavailableError, match="kept failing.*503 SlowDown") as info:
            backend.get("log/0001")
        assert info.value.reason == "unavailable"
        assert proxy.pending() == 0
    finally:
        proxy.close()


def test_wrong_credentials_and_missing_bucket(s3_server, s3_bucket, s3_prefix, tmp_path):
    for creds in ({"secret_key": "wrong-secret"}, {"access_key": "no-such-key"}):
        bad = make_backend(s3_server.endpoint, s3_bucket, tmp_path, s3_prefix, **creds)
        for op in (lambda: bad.stat("log/1"), lambda: bad.get("log/1"), lambda: bad.put_if_absent("log/1", [b"x"])):
            with pytest.raises(CredentialsError, match="refused the credentials") as info:
                op()
            assert info.value.reason == "credentials"
    missing = make_backend(s3_server.endpoint, "no-such-bucket", tmp_path)
    for op in (lambda: missing.stat("log/1"), lambda: missing.get("log/1"), lambda: missing.list("log/"),
               lambda: missing.put_if_absent("log/1", [b"x"])):
        with pytest.raises(BucketMissingError, match="'no-such-bucket' does not exist") as info:
            op()
        assert info.value.reason == "bucket"


def test_url_and_environment(s3_server, s3_bucket, s3_prefix, tmp_path, monkeypatch):
    assert parse_url("s3://bucket/runs/exp1/") == ("bucket", "runs/exp1")
    assert parse_url("s3://bucket") == ("bucket", "")
    for bad in ("file:///x", "s3://", "s3:///prefix", "bucket/prefix"):
        with pytest.raises(CasError):
            parse_url(bad)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    backend = S3Backend.from_url(f"s3://{s3_bucket}/{s3_prefix}/a/", spool_dir=str(tmp_path / "spool"))
    assert backend.url == f"s3://{s3_bucket}/{s3_prefix}/a" and backend.endpoint == s3_server.endpoint
    assert backend.put_if_absent("log/1", [b"env"]) is True
    assert s3_server.client().get_object(Bucket=s3_bucket, Key=f"{s3_prefix}/a/log/1")["Body"].read() == b"env"
    monkeypatch.setenv("CAS_CACHE_DIR", str(tmp_path / "cache"))
    assert S3Backend.from_url(f"s3://{s3_bucket}").spool_dir == str(tmp_path / "cache" / "spool")
    assert isinstance(backend.stage("log/2", [b"s"]), Staged)
