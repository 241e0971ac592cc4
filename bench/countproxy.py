"""A loopback HTTP proxy that counts the requests passing through it, by verb, with keep-alive.

bench/bench_s3.py puts one of these in front of the S3 server so that every client (cas's boto3,
s3fs's aiobotocore, s3torchconnector's CRT) is counted the same way, at the wire. Unlike
tests/tcpfault.py it keeps connections open (a forced `Connection: close` would cost each client
a connect per request and skew the timings): each connection's client-to-server stream is parsed
as a sequence of requests (head, then a body of Content-Length bytes or chunked), and the
server's answers are pumped back unparsed. Counts: `requests` by verb, `sent` and `received`
bytes; `reset()` zeroes them and returns what they were.
"""

from __future__ import annotations

import collections
import socket
import threading

BUF = 1 << 20


class CountingProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self._lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()
        self.sent = self.received = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(256)
        self.port = self._sock.getsockname()[1]
        self._open = True
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> dict:
        """The counts so far ({"requests": {verb: n}, "sent": bytes, "received": bytes}), zeroed."""
        with self._lock:
            out = {"requests": dict(self.requests), "sent": self.sent, "received": self.received}
            self.requests.clear()
            self.sent = self.received = 0
        return out

    def close(self) -> None:
        self._open = False
        self._sock.close()

    def _accept(self) -> None:
        while self._open:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.target, timeout=120)
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=self._pump_back, args=(server, client), daemon=True)
        back.start()
        try:
            _Requests(client, server, self).run()
        except OSError:
            pass
        finally:
            try:
                server.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            back.join(120)
            server.close()
            client.close()

    def _pump_back(self, server: socket.socket, client: socket.socket) -> None:
        try:
            while True:
                chunk = server.recv(BUF)
                if not chunk:
                    break
                client.sendall(chunk)
                with self._lock:
                    self.received += len(chunk)
        except OSError:
            pass
        finally:
            try:
                client.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def count(self, verb: str, nbytes: int) -> None:
        with self._lock:
            if verb:
                self.requests[verb] += 1
            self.sent += nbytes


class _Requests:
    """The client's stream, request by request: counted, forwarded as it arrives."""

    def __init__(self, client: socket.socket, server: socket.socket, proxy: CountingProxy) -> None:
        self.client, self.server, self.proxy = client, server, proxy
        self.buf = b""

    def fill(self) -> bool:
        chunk = self.client.recv(BUF)
        if not chunk:
            return False
        self.buf += chunk
        return True

    def forward(self, data: bytes, verb: str = "") -> None:
        self.server.sendall(data)
        self.proxy.count(verb, len(data))

    def run(self) -> None:
        while True:
            while b"\r\n\r\n" not in self.buf:
                if not self.fill():
                    return
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            verb = head.split(b" ", 1)[0].decode("ascii", "replace")
            self.forward(head + b"\r\n\r\n", verb)
            fields = _fields(head)
            if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
                self.chunked()
            else:
                self.body(int(fields.get(b"content-length", b"0") or 0))

    def body(self, left: int) -> None:
        while left > 0:
            if not self.buf and not self.fill():
                raise OSError("client closed inside a body")
            part, self.buf = self.buf[:left], self.buf[left:]
            self.forward(part)
            left -= len(part)

    def chunked(self) -> None:
        while True:
            while b"\r\n" not in self.buf:
                if not self.fill():
                    raise OSError("client closed inside a chunked body")
            line, _, self.buf = self.buf.partition(b"\r\n")
            self.forward(line + b"\r\n")
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                self.trailers()
                return
            self.body(size + 2)  # the chunk and its CRLF

    def trailers(self) -> None:
        while True:
            while b"\r\n" not in self.buf:
                if not self.fill():
                    raise OSError("client closed inside trailers")
            line, _, self.buf = self.buf.partition(b"\r\n")
            self.forward(line + b"\r\n")
            if not line:
                return


def _fields(head: bytes) -> dict[bytes, bytes]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        out[name.strip().lower()] = value.strip()
    return out
