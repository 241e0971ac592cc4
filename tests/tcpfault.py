"""A loopback TCP proxy that injects faults into the next N HTTP requests passing through it.

Each accepted connection carries one request: the proxy reads its head, rewrites it to
`Connection: close` (so the client opens a new connection, and the proxy sees, every next
request), then either forwards it to the target or applies the next queued fault:
  reset      close the client's connection with an RST (SO_LINGER 0), nothing forwarded
  slowdown   answer `HTTP/1.1 503 SlowDown` itself, nothing forwarded
  delay      hold the request `delay` seconds, then forward it (a client timeout fires first)
Threads are daemons; `close()` stops accepting. Counts of what it did are in `seen`.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time

SLOWDOWN = (b"HTTP/1.1 503 SlowDown\r\nContent-Type: application/xml\r\nContent-Length: {n}\r\n"
            b"Connection: close\r\n\r\n")
SLOWDOWN_BODY = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
                 b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    def __init__(self, target_port: int, *, delay: float = 2.0) -> None:
        self.target = ("127.0.0.1", target_port)
        self.delay = delay
        self._faults: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self.seen = collections.Counter()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._open = True
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, fault: str, count: int = 1) -> None:
        """Apply `fault` ('reset', 'slowdown', 'delay') to the next `count` requests."""
        if fault not in ("reset", "slowdown", "delay"):
            raise ValueError(fault)
        with self._lock:
            self._faults.extend([fault] * count)

    def pending(self) -> int:
        with self._lock:
            return len(self._faults)

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
            head, rest = _read_head(client)
            if head is None:
                return
            with self._lock:
                fault = self._faults.popleft() if self._faults else "forward"
                self.seen[fault] += 1
            if fault == "reset":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            if fault == "slowdown":
                if b"100-continue" not in head.lower():
                    _drain(client, rest, _content_length(head))
                client.sendall(SLOWDOWN.replace(b"{n}", str(len(SLOWDOWN_BODY)).encode()) + SLOWDOWN_BODY)
                return
            if fault == "delay":
                time.sleep(self.delay)
            self._forward(client, _close_after(head) + rest)
        except OSError:
            pass
        finally:
            client.close()

    def _forward(self, client: socket.socket, first: bytes) -> None:
        server = socket.create_connection(self.target, timeout=30)
        try:
            server.sendall(first)
            back = threading.Thread(target=_pump, args=(server, client), daemon=True)
            back.start()
            _pump(client, server)
            back.join(30)
        finally:
            server.close()


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
        if len(data) > 1 << 20:
            return None, b""
    head, _, rest = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip() or 0)
    return 0


def _drain(sock: socket.socket, rest: bytes, length: int) -> None:
    left = length - len(rest)
    while left > 0:
        chunk = sock.recv(min(left, 65536))
        if not chunk:
            return
        left -= len(chunk)


def _close_after(head: bytes) -> bytes:
    lines = [ln for ln in head.rstrip(b"\r\n").split(b"\r\n") if not ln.lower().startswith(b"connection:")]
    return b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n"


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            chunk = src.recv(1 << 16)
            if not chunk:
                break
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
