"""Encryption at rest: a store's keys, and the backend wrapper that encrypts every blob.

Keys (restic's model): a store has one random 32-byte **master key**. Each user key (a
passphrase, or 32 raw bytes) wraps it in a blob `keys/<id>` of its own: a passphrase goes through
scrypt (its parameters and salt in that blob), a raw key is used as it is; the master key is
sealed with AES-256-GCM under the result, so the AEAD tag proves the key, and the config's
`check` (derived from the master key) proves the master key is this store's. Keys are added
and removed by writing or deleting one such blob: no data is rewritten.

Subkeys come from the master key through HKDF-SHA256: one for the blobs' AEAD, one for object
names (keyed blake3, cas.hashing.Namer), one for the LMDB cache's sealed records, one for the check.

Blobs (`EncryptedBackend`, the cas/backend.py contract around any backend): every blob but the
config, `keys/` and `leases/` (which hold no user data) is written as
    b"casenc1\\n" | salt (16 random bytes) | segment 0 | segment 1 | ...
each segment 64 KiB of plaintext (the last one shorter, possibly empty) sealed with AES-256-GCM
(16-byte tag) under the blob key blake3(key=aead subkey, b"cas blob key\\0" + salt), nonce =
segment number (11 bytes, big-endian) | 1 for the last segment else 0, associated data = the
blob's name: a blob moved to another name, a segment moved, reordered, dropped or cut off fails
its check. A ranged read decrypts only the segments it covers; sizes (stat, list_sizes, peek)
are the plaintext's, computed from the ciphertext's. cryptography's AEADs release the GIL, so
the save and load pools encrypt and decrypt in parallel.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import blake3
import msgpack

from . import faults
from .backend import Buffer, Staged
from .errors import (BlobAbsentError, CasError, CorruptionError, KeyRemovalRefusedError, KeyRequiredError,
                     WrongKeyError)
from .hashing import KEY_SIZE, Namer

SEGMENT = 64 << 10
TAG = 16
BLOB_MAGIC = b"casenc1\n"
SALT = 16
HEADER = len(BLOB_MAGIC) + SALT
KEYS_PREFIX = "keys/"
KEY_MAGIC = b"cas-key\n"
AEAD_NAME = "aes-256-gcm"
NAMING = "blake3-keyed"
# scrypt: 2^17 x 8 x 128 bytes = 128 MiB and about 0.4 s per key tried (restic-like strength).
# $CAS_SCRYPT_LOG_N lowers it for tests only (at least 10); a key blob records what it used.
SCRYPT_LOG_N, SCRYPT_R, SCRYPT_P = 17, 8, 1
SCRYPT_ENV = "CAS_SCRYPT_LOG_N"
_RANGE_FROM_ZERO = 256 << 10  # a ranged read this close to the start reads the header with it


def _aead(key: bytes):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # the crypto extra

    return AESGCM(key)


def _invalid_tag():
    from cryptography.exceptions import InvalidTag

    return InvalidTag


def _hkdf(master: bytes, info: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(master)


def user_key(key) -> tuple[str, bytes]:
    """("passphrase" | "raw", bytes) of a key= value: a str passphrase or 32 raw bytes."""
    if isinstance(key, str):
        if not key:
            raise CasError("an empty passphrase is not a key")
        return "passphrase", key.encode("utf-8")
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        if len(raw) != KEY_SIZE:
            raise CasError(f"a raw key is {KEY_SIZE} bytes, got {len(raw)} (give a passphrase as a str)")
        return "raw", raw
    raise CasError(f"key must be a passphrase (str) or {KEY_SIZE} raw bytes, got {type(key).__name__}")


def read_key_file(path: str) -> str | bytes:
    """The key a file holds: exactly 32 bytes that are not one line of text are a raw key;
    anything else is a passphrase (UTF-8, one trailing newline stripped)."""
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read(1 << 16)
    except OSError as exc:
        raise KeyRequiredError(f"cannot read the key file {path} ($CAS_KEY_FILE): {exc.strerror or exc}") from None
    if len(data) == KEY_SIZE:
        try:
            text = data.decode("utf-8")
            if text.isprintable():
                return text
        except UnicodeDecodeError:
            pass
        return data
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CasError(f"the key file {path} is neither {KEY_SIZE} raw bytes nor a UTF-8 passphrase") from None


@dataclass(frozen=True, repr=False)
class StoreKeys:
    """The subkeys of one open store's master key, and the user key that unlocked it (never
    in a repr: stores, locations and tracebacks get printed)."""

    master: bytes
    key_id: str  # the keys/ blob that opened the store
    user: tuple[str, bytes]  # ("passphrase" | "raw", bytes): to create copies (push) openable alike

    def __post_init__(self) -> None:
        object.__setattr__(self, "_blob", _hkdf(self.master, b"cas blobs v1"))
        object.__setattr__(self, "_index", _aead(_hkdf(self.master, b"cas index v1")))
        object.__setattr__(self, "namer", Namer(_hkdf(self.master, b"cas names v1")))
        object.__setattr__(self, "_aeads", {})  # salt -> its cipher (blob_aead)

    def __repr__(self) -> str:
        return f"StoreKeys(key_id={self.key_id!r})"

    @property
    def check(self) -> bytes:
        return check_of(self.master)

    def blob_aead(self, salt: bytes):
        """The cipher of a blob's salt; kept (a bounded few), since every entry read from one
        pack uses the same and deriving it costs more than opening a small object."""
        aeads = self._aeads
        aead = aeads.get(salt)
        if aead is None:
            if len(aeads) >= 256:
                aeads.clear()
            aead = aeads[salt] = _aead(blake3.blake3(b"cas blob key\0" + salt, key=self._blob).digest())
        return aead

    def seal(self, data: bytes, aad: bytes) -> bytes:
        """A small value sealed for the LMDB cache: 12-byte random nonce | ciphertext | tag."""
        nonce = os.urandom(12)
        return nonce + self._index.encrypt(nonce, data, b"cas-index-1\0" + aad)

    def unseal(self, data, aad: bytes, what: str) -> bytes:
        data = bytes(data)
        try:
            return self._index.decrypt(data[:12], data[12:], b"cas-index-1\0" + aad)
        except (_invalid_tag(), ValueError):
            raise CorruptionError(f"{what} fails its authentication check (damaged, or sealed by another key)") from None


def check_of(master: bytes) -> bytes:
    return _hkdf(master, b"cas key check v1")[:16]


# --- keys/ blobs ----------------------------------------------------------------------------
def _scrypt_log_n() -> int:
    text = os.environ.get(SCRYPT_ENV)
    if not text:
        return SCRYPT_LOG_N
    try:
        value = int(text)
    except ValueError:
        raise CasError(f"${SCRYPT_ENV} must be an integer from 10 to 22, got {text!r}") from None
    if not 10 <= value <= 22:
        raise CasError(f"${SCRYPT_ENV} must be an integer from 10 to 22, got {value}")
    return value


def _kek(kind: str, secret: bytes, body: dict) -> bytes:
    if body["kdf"] == "raw":
        return secret if kind == "raw" else b""
    if body["kdf"] != "scrypt":
        raise CasError(f"a key of this store uses the KDF {body['kdf']!r}, which this cas does not know")
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    return Scrypt(salt=bytes(body["salt"]), length=32, n=int(body["n"]), r=int(body["r"]),
                  p=int(body["p"])).derive(secret)


def _key_aad(store_id: str, key_id: str) -> bytes:
    return b"cas-key-1\0" + store_id.encode() + b"\0" + key_id.encode()


def key_blob(store_id: str, key_id: str, master: bytes, user: tuple[str, bytes]) -> bytes:
    """A keys/<key_id> blob wrapping `master` under the user key."""
    kind, secret = user
    if kind == "raw":
        body = {"format": 1, "kdf": "raw"}
        kek = secret
    else:
        log_n = _scrypt_log_n()
        body = {"format": 1, "kdf": "scrypt", "n": 1 << log_n, "r": SCRYPT_R, "p": SCRYPT_P, "salt": os.urandom(16)}
        kek = _kek(kind, secret, body)
    nonce = os.urandom(12)
    body.update(aead=AEAD_NAME, nonce=nonce, wrapped=_aead(kek).encrypt(nonce, master, _key_aad(store_id, key_id)),
                created=time.time())
    return KEY_MAGIC + msgpack.packb(body, use_bin_type=True)


def _parse_key(data) -> dict | None:
    data = bytes(data)
    if not data.startswith(KEY_MAGIC):
        return None
    try:
        body = msgpack.unpackb(data[len(KEY_MAGIC):], raw=False)
        return body if isinstance(body, dict) and body.get("format") == 1 and "wrapped" in body else None
    except (ValueError, TypeError, msgpack.UnpackException):
        return None


def key_ids(backend) -> list[str]:
    return [name[len(KEYS_PREFIX):] for name in backend.list(KEYS_PREFIX)]


def new_key_id() -> str:
    return secrets.token_hex(8)


def unlock(backend, store_id: str, encryption: dict, key, where: str) -> StoreKeys:
    """The StoreKeys the user key unlocks: KeyRequiredError without one, WrongKeyError when no
    keys/ blob of the store opens with it (a wrong key, or a removed one)."""
    if key is None:
        raise KeyRequiredError(f"the store at {where} is encrypted: give its key (cas.open(path, key=...); for "
                               "the CLI, a file named by $CAS_KEY_FILE)")
    user = user_key(key)
    kind, secret = user
    check = bytes(encryption["check"])
    ids = key_ids(backend)
    if not ids:
        raise WrongKeyError(f"the encrypted store at {where} has no keys left (keys/ is empty): it cannot be opened")
    tried_kdf: dict[tuple, bytes] = {}
    for key_id in ids:
        try:
            body = _parse_key(backend.get(KEYS_PREFIX + key_id))
        except CorruptionError:  # removed meanwhile, unreadable: another key may open it
            continue
        if body is None or (body.get("kdf") == "raw") != (kind == "raw"):
            continue
        try:
            params = (body["kdf"], bytes(body.get("salt", b"")), body.get("n"), body.get("r"), body.get("p"))
            kek = tried_kdf.get(params) or tried_kdf.setdefault(params, _kek(kind, secret, body))
            master = _aead(kek).decrypt(bytes(body["nonce"]), bytes(body["wrapped"]), _key_aad(store_id, key_id))
        except (_invalid_tag(), KeyError, TypeError, ValueError):
            continue
        if len(master) == KEY_SIZE and secrets.compare_digest(check_of(master), check):
            return StoreKeys(master, key_id, user)
    raise WrongKeyError(f"the key given does not open the encrypted store at {where}: it is wrong, or it was "
                        f"removed (cas key remove); the store has {len(ids)} key(s)")


def encryption_fields(master: bytes) -> dict:
    """What the config records of an encrypted store."""
    return {"version": 1, "aead": AEAD_NAME, "segment": SEGMENT, "naming": NAMING, "kdf": "scrypt",
            "check": check_of(master)}


def check_fields(encryption, where: str) -> dict:
    if not isinstance(encryption, dict) or encryption.get("version") != 1:
        raise CasError(f"the store at {where} is encrypted with a scheme this cas does not know "
                       f"({encryption!r}); upgrade cas to open it")
    if (encryption.get("aead"), encryption.get("segment"), encryption.get("naming")) != (AEAD_NAME, SEGMENT, NAMING) \
            or not isinstance(encryption.get("check"), bytes) or len(encryption["check"]) != 16:
        raise CasError(f"the store at {where} is encrypted with parameters this cas does not read: {encryption!r}")
    return encryption


def add_key(backend, store_id: str, keys: StoreKeys, new_key) -> str:
    """Write a keys/ blob wrapping the store's master key under `new_key` (create-only); its id."""
    user = user_key(new_key)
    for _ in range(8):
        key_id = new_key_id()
        data = key_blob(store_id, key_id, keys.master, user)
        faults.point("keys.adding")
        if backend.put_if_absent(KEYS_PREFIX + key_id, [data]):
            faults.point("keys.added")
            return key_id
    raise CasError("could not draw a free key id")  # eight 64-bit collisions: not chance


def remove_key(backend, keys: StoreKeys, key_id: str, where: str) -> None:
    """Delete keys/<key_id>; never the last key, nor the one the store was opened with."""
    ids = key_ids(backend)
    if key_id not in ids:
        raise CasError(f"the store at {where} has no key {key_id!r}; its keys: {', '.join(ids)}")
    if key_id == keys.key_id:
        raise KeyRemovalRefusedError(f"key {key_id} is the one this store was opened with; open it with another "
                                     "key to remove this one")
    if len(ids) <= 1:
        raise KeyRemovalRefusedError(f"key {key_id} is the last key of the store at {where}; removing it would "
                                     "make the store unreadable")
    faults.point("keys.removing")
    backend.delete(KEYS_PREFIX + key_id)
    backend.sync()
    faults.point("keys.removed")


# --- the encrypted backend -------------------------------------------------------------------
def plain_blob(name: str) -> bool:
    """Blobs kept readable without the master key: they hold no user data (the config, the
    wrapped keys, writers' leases: pid, host, start time, purpose)."""
    return name == "config" or name.startswith((KEYS_PREFIX, "leases/"))


def sealed_size(plain: int) -> int:
    return HEADER + plain + TAG * max(1, -(-plain // SEGMENT))


def plain_size(sealed: int) -> int:
    body = sealed - HEADER
    if body < TAG:
        return 0
    return body - TAG * max(1, -(-body // (SEGMENT + TAG)))


def _nonce(i: int, last: bool) -> bytes:
    return i.to_bytes(11, "big") + (b"\x01" if last else b"\x00")


def _aad(name: str) -> bytes:
    return b"cas-blob-1\0" + name.encode("utf-8")


def _key_of(name: str) -> str | None:
    """The object key a blob name carries (objects/ab/<hex>), for errors."""
    tail = name.rpartition("/")[2]
    return tail if name.startswith("objects/") and len(tail) == 64 else None


class EncryptedBackend:
    """A backend whose blobs are sealed (module docstring); everything else is the inner one's."""

    def __init__(self, inner, keys: StoreKeys) -> None:
        self.inner = inner
        self.keys = keys
        self.namer = keys.namer
        self.capabilities = inner.capabilities
        self._salts: dict[str, bytes] = {}  # blob name -> salt, for ranged reads (bounded)

    # No streamed packs: their entries would reach the inner backend's file unsealed (packs are
    # gathered in memory and sealed whole instead; cas/packs.py PackFiles.stream).
    stream = None

    def __getattr__(self, attr):  # path(), root, url, ...: the inner backend's
        return getattr(self.inner, attr)

    # --- sealing ---------------------------------------------------------------------------
    def seal(self, name: str, parts: Iterable, into: bytearray | None = None) -> memoryview:
        """The sealed bytes of a blob, in `into` (a buffer of the pool, given back by the caller
        once the inner write consumed them) or a new one."""
        views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        total = sum(len(v) for v in views)
        nseg = max(1, -(-total // SEGMENT))
        size = HEADER + total + TAG * nseg
        out = memoryview(into if into is not None and len(into) >= size else bytearray(size))[:size]
        salt = os.urandom(SALT)
        out[:len(BLOB_MAGIC)] = BLOB_MAGIC
        out[len(BLOB_MAGIC):HEADER] = salt
        aead, aad, dest = self.keys.blob_aead(salt), _aad(name), out
        vi, voff = 0, 0
        for i in range(nseg):
            n = min(SEGMENT, total - i * SEGMENT)
            if n == 0:
                piece = b""
            elif len(views[vi]) - voff >= n:
                piece = views[vi][voff:voff + n]
                voff += n
            else:  # a segment across parts: gathered
                gathered, filled = bytearray(n), 0
                while filled < n:
                    take = min(n - filled, len(views[vi]) - voff)
                    gathered[filled:filled + take] = views[vi][voff:voff + take]
                    filled, voff = filled + take, voff + take
                    if voff == len(views[vi]):
                        vi, voff = vi + 1, 0
                piece = gathered
            if vi < len(views) and voff == len(views[vi]):
                vi, voff = vi + 1, 0
            at = HEADER + i * (SEGMENT + TAG)
            aead.encrypt_into(_nonce(i, i == nseg - 1), piece, aad, dest[at:at + n + TAG])
        return out

    def _damaged(self, name: str, why: str) -> CorruptionError:
        return CorruptionError(f"{name} fails its authentication check ({why}: damaged or tampered ciphertext)",
                               key=_key_of(name))

    def _salt(self, name: str, head) -> bytes:
        if len(head) < HEADER or bytes(head[:len(BLOB_MAGIC)]) != BLOB_MAGIC:
            raise self._damaged(name, "no encrypted blob header")
        salt = bytes(head[len(BLOB_MAGIC):HEADER])
        if len(self._salts) > 4096:
            self._salts.clear()
        self._salts[name] = salt
        return salt

    def _open_segments(self, name: str, salt: bytes, body, first: int, out, *, whole: bool,
                       skip: int = 0) -> int:
        """Decrypt the segments in `body` (segment `first` onwards) and place their plain bytes
        from `skip` on into `out`, as far as it reaches; the plain length of `body` is returned.
        Segments inside the range decrypt straight into `out`; the edge ones go through a
        scratch buffer. With `whole`, body runs to the blob's end, whose last segment must say
        it is the last."""
        aead, aad, invalid = self.keys.blob_aead(salt), _aad(name), _invalid_tag()
        body, end = memoryview(body), skip + len(out)
        pos, plain, i, scratch = 0, 0, first, None
        while pos < len(body) or (whole and pos == 0):
            ct = body[pos:pos + SEGMENT + TAG]
            if len(ct) < TAG:
                raise self._damaged(name, f"segment {i} is cut short")
            n = len(ct) - TAG
            short = n < SEGMENT or (whole and pos + len(ct) == len(body))
            inside = skip <= plain and plain + n <= end
            if inside:
                dest = out[plain - skip:plain - skip + n]
            else:
                scratch = scratch if scratch is not None else memoryview(bytearray(SEGMENT))
                dest = scratch[:n]
            try:
                aead.decrypt_into(_nonce(i, short), ct, aad, dest)
            except invalid:
                if short or not self._try_last(aead, aad, ct, i, dest):
                    raise self._damaged(name, f"segment {i}") from None
                if whole or pos + len(ct) < len(body):
                    raise self._damaged(name, f"segment {i} is marked last but more follows") from None
            if not inside:
                lo, hi = max(skip, plain), min(end, plain + n)
                if lo < hi:
                    out[lo - skip:hi - skip] = dest[lo - plain:hi - plain]
            pos, plain, i = pos + len(ct), plain + n, i + 1
        return plain

    @staticmethod
    def _try_last(aead, aad, ct, i, out) -> bool:
        try:
            aead.decrypt_into(_nonce(i, True), ct, aad, out)
            return True
        except _invalid_tag():
            return False

    def _sealed_write(self, write, name: str, parts: Iterable):
        parts = list(parts)
        buf = _POOL.take(sealed_size(sum(memoryview(p).nbytes for p in parts)))
        try:
            return write(name, [self.seal(name, parts, buf)])
        finally:
            _POOL.give(buf)

    # --- reads -----------------------------------------------------------------------------
    def get(self, name: str, start: int = 0, length: int | None = None, *, buffer: Buffer | None = None):
        if plain_blob(name):
            return self.inner.get(name, start, length, buffer=buffer)
        if start == 0 and length is None:
            held: list[bytearray] = []

            def pooled(nbytes: int) -> memoryview:
                held.append(_POOL.take(nbytes))
                return memoryview(held[-1])
            try:
                sealed = self.inner.get(name, 0, None, buffer=pooled)
                salt = self._salt(name, sealed)
                size = plain_size(len(sealed))
                out = buffer(max(size, 1))[:size] if buffer is not None else bytearray(size)
                self._open_segments(name, salt, memoryview(sealed)[HEADER:], 0, memoryview(out), whole=True)
            finally:
                for one in held:
                    _POOL.give(one)
            return out if buffer is not None else bytes(out)
        if length is None:
            size = self.stat(name)
            if size is None:
                raise BlobAbsentError(f"{name} is missing from {self.inner.where(name)}")
            length = max(size - start, 0)
        return self._ranged(name, start, length, buffer)

    def _ranged(self, name: str, start: int, length: int, buffer: Buffer | None = None):
        """Plain bytes [start, start + length) of a blob: its covering segments decrypted
        straight into the caller's `buffer` when one is given (only the edge segments copied)."""
        if length <= 0:
            self.inner.get(name, 0, 0)  # absent or unreadable: said so
            return b"" if buffer is None else buffer(1)[:0]
        first, last = start // SEGMENT, (start + length - 1) // SEGMENT
        cstart = HEADER + first * (SEGMENT + TAG)
        clen = (last - first + 1) * (SEGMENT + TAG)
        for attempt in range(2):
            salt = self._salts.get(name) if attempt == 0 else None
            held: list[bytearray] = []

            def pooled(nbytes: int) -> memoryview:  # pooled buffers: no fresh pages per read
                held.append(_POOL.take(nbytes))
                return memoryview(held[-1])
            try:
                if salt is None and cstart <= _RANGE_FROM_ZERO:
                    sealed = self.inner.get(name, 0, cstart + clen, buffer=pooled)
                    salt, body = self._salt(name, sealed), sealed[cstart:]
                else:
                    if salt is None:
                        salt = self._salt(name, self.inner.get(name, 0, HEADER))
                    body = self.inner.get(name, cstart, clen, buffer=pooled)
                skip = start - first * SEGMENT
                into = (memoryview(bytearray(length)) if buffer is None
                        else buffer(max(length, 1))[:length])
                try:
                    n = self._open_segments(name, salt, body, first, into, whole=False, skip=skip)
                except CorruptionError:
                    if attempt == 0 and name in self._salts:  # the blob was replaced (a healed pack): read afresh
                        self._salts.pop(name, None)
                        continue
                    raise
                into = into[:max(0, min(length, n - skip))]
                return bytes(into) if buffer is None else into
            finally:
                for one in held:
                    _POOL.give(one)
        raise AssertionError("unreachable")

    def stat(self, name: str) -> int | None:
        size = self.inner.stat(name)
        return size if size is None or plain_blob(name) else plain_size(size)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def list_sizes(self, prefix: str) -> list[tuple[str, int]]:
        return [(n, s if plain_blob(n) else plain_size(s)) for n, s in self.inner.list_sizes(prefix)]

    def peek(self, staged: Staged, nbytes: int) -> tuple[int, bytes]:
        if plain_blob(staged.name):
            return self.inner.peek(staged, nbytes)
        segs = max(1, -(-nbytes // SEGMENT))
        size, head = self.inner.peek(staged, HEADER + segs * (SEGMENT + TAG))
        salt = self._salt(staged.name, head)
        body = memoryview(head)[HEADER:]
        out = bytearray(len(body))
        n = self._open_segments(staged.name, salt, body, 0, memoryview(out), whole=len(head) == size)
        return plain_size(size), bytes(out[:min(n, nbytes)])

    # --- writes ----------------------------------------------------------------------------
    def put_if_absent(self, name: str, parts: Iterable) -> bool:
        if plain_blob(name):
            return self.inner.put_if_absent(name, parts)
        return self._sealed_write(self.inner.put_if_absent, name, parts)

    def stage(self, name: str, parts: Iterable, *, fsync: bool = False) -> Staged:
        if plain_blob(name):
            return self.inner.stage(name, parts, fsync=fsync)
        return self._sealed_write(lambda n, p: self.inner.stage(n, p, fsync=fsync), name, parts)

    def publish(self, staged: Staged, *, fsync: bool = False) -> bool:
        self._salts.pop(staged.name, None)
        return self.inner.publish(staged, fsync=fsync)

    def replace(self, staged: Staged) -> None:
        self._salts.pop(staged.name, None)
        self.inner.replace(staged)

    def discard(self, staged: Staged) -> None:
        self.inner.discard(staged)

    def staged(self, name: str, token: str) -> Staged:
        return self.inner.staged(name, token)

    def sync(self) -> None:
        self.inner.sync()

    def delete(self, name: str) -> bool:
        self._salts.pop(name, None)
        return self.inner.delete(name)

    def move(self, name: str, new_name: str) -> bool:
        """Moved as sealed (quarantine: its bytes may be damaged): it stays sealed under its old
        name's associated data, so `cas` never reads it back; docs/format.md says how to by hand."""
        self._salts.pop(name, None)
        return self.inner.move(name, new_name)

    def free_bytes(self):
        return self.inner.free_bytes()

    def where(self, name: str) -> str:
        return self.inner.where(name)

    def clean_tmp(self) -> int:
        return self.inner.clean_tmp()

    def lease(self, name: str, info: bytes):
        return self.inner.lease(name, info)

    def lease_alive(self, name: str):
        return self.inner.lease_alive(name)


class _BufferPool:
    """Sealing and opening buffers shared by every thread and store of the process (bytes only,
    no keys): a new store's fresh thread pool reuses them instead of first-touching new memory,
    which on this VM costs more than the cipher (about 1 GB/s)."""

    def __init__(self, keep: int = 16) -> None:
        self._free: list[bytearray] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            fits = [b for b in self._free if len(b) >= nbytes]
            if fits:
                best = min(fits, key=len)
                self._free.remove(best)
                return best
        return bytearray(max(nbytes, 1 << 20))

    def give(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)
            while len(self._free) > self._keep or sum(map(len, self._free)) > _POOL_BYTES:
                self._free.remove(min(self._free, key=len))


_POOL_BYTES = 192 << 20  # at most this much kept between uses
_POOL = _BufferPool()


def wrap(backend, keys: StoreKeys | None):
    """The backend as a store with `keys` sees it (as it is for a plain store)."""
    if keys is None or isinstance(backend, EncryptedBackend):
        return backend
    return EncryptedBackend(backend, keys)


def namer_of(backend) -> Namer:
    from .hashing import PLAIN

    return getattr(backend, "namer", None) or PLAIN
