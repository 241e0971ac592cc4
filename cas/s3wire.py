"""Wire details of cas.s3: parts sent as one seekable stream without joining them, response
bodies read into a caller's buffer, and an S3 error's code and status."""

from __future__ import annotations

import bisect
import io

from .backend import MAX_BLOB, Buffer
from .errors import MissingObjectError


class PartsReader(io.RawIOBase):
    """The concatenation of bytes-like parts as a seekable read-only file: a PUT body (botocore
    seeks it to size it, hash it and resend it) with no copy of the parts made."""

    def __init__(self, parts) -> None:
        super().__init__()
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._starts, at = [], 0
        for p in self._parts:
            self._starts.append(at)
            at += p.nbytes
        self.size, self._pos = at, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b) -> int:
        out, filled = memoryview(b).cast("B"), 0
        i = bisect.bisect_right(self._starts, self._pos) - 1
        while filled < out.nbytes and 0 <= i < len(self._parts) and self._pos < self.size:
            part = self._parts[i][self._pos - self._starts[i]:]
            n = min(part.nbytes, out.nbytes - filled)
            out[filled:filled + n] = part[:n]
            filled += n
            self._pos += n
            i += 1
        return filled


def read_body(resp: dict, name: str, buffer: Buffer | None):
    """A GET response's body: new bytes, or read into `buffer` (a memoryview of the bytes).
    A body shorter than its Content-Length raises botocore's IncompleteReadError (retried)."""
    from botocore.exceptions import IncompleteReadError

    size, body = int(resp["ContentLength"]), resp["Body"]
    if size > MAX_BLOB:
        body.close()
        raise MissingObjectError(f"{name} is {size} bytes, more than the {MAX_BLOB} a blob can be")
    if buffer is None:
        data = body.read()
        if len(data) != size:
            raise IncompleteReadError(actual_bytes=len(data), expected_bytes=size)
        return data
    view, filled = buffer(max(size, 1))[:size], 0
    while filled < size:
        n = body.readinto(view[filled:])
        if not n:
            raise IncompleteReadError(actual_bytes=filled, expected_bytes=size)
        filled += n
    return view


def error_code(exc: Exception) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore ClientError."""
    response = getattr(exc, "response", {}) or {}
    return (str(response.get("Error", {}).get("Code", "")),
            int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0))
