"""A store's keys (restic's model): one random 32-byte **master key**, wrapped by user keys.

Each user key (a passphrase, or 32 raw bytes) wraps the master key in a blob `keys/<id>` of its
own: a passphrase goes through scrypt (its parameters and salt in that blob), a raw key is used
as it is; the master key is sealed with AES-256-GCM under the result, so the AEAD tag proves the
key, and the config's `check` (derived from the master key) proves the master key is this
store's. Keys are added and removed by writing or deleting one such blob: no data is rewritten.

Subkeys come from the master key through HKDF-SHA256: one for the blobs' AEAD (cas/crypt.py),
one for object names (keyed blake3, cas.hashing.Namer), one for the LMDB cache's sealed records,
one for the check.
"""

from __future__ import annotations

import functools
import os
import secrets
import time
from dataclasses import dataclass

import blake3
import msgpack

from . import faults
from .errors import (CasError, CorruptionError, DuplicateKeyError, KeyFileError, KeyRemovalRefusedError,
                     KeyRequiredError, WrongKeyError)
from .bitrot import claims_a_digest, first_fix, proves_itself, undo_own_error, with_digest
from .hashing import KEY_SIZE, Namer

KEYS_PREFIX = "keys/"
# removing-keys/<id>: an empty blob created before keys/<id> is deleted (remove_key says why)
REMOVING_PREFIX = "removing-keys/"
KEY_MAGIC = b"cas-key\n"
MAX_KEY_BLOB = 4096  # a key blob is about 200 bytes; larger is no blob to mend
AEAD_NAME = "aes-256-gcm"
NAMING = "blake3-keyed"
# scrypt: 2^17 x 8 x 128 bytes = 128 MiB and about 0.4 s per key tried (restic-like strength).
# $CAS_SCRYPT_LOG_N lowers it for tests only (at least 10); a key blob records what it used.
SCRYPT_LOG_N, SCRYPT_R, SCRYPT_P = 17, 8, 1
SCRYPT_ENV = "CAS_SCRYPT_LOG_N"
# The sealing scheme a store's config names: 1 seals every blob bound to its whole name; 2 also
# lets a pack be streamed (sealed as it is written, bound to its folder: cas/crypt.py); 3 is 2 with
# segments of 1 MiB, not 64 KiB. New stores are made with 3; an older store is read and written
# with its own scheme (an older cas reads it). Why 1 MiB: each segment is one AES-GCM call, and
# each call gives up the GIL and must take it back; with 64 KiB segments a 16-core load spent
# twelve times the cipher's CPU time waiting for it (encrypted loads 2.4x plain ones).
ENCRYPTION_VERSION = 4  # segments split where pack entries meet (cas/slots.py); 3: one message each
ENCRYPTION_VERSIONS = (1, 2, 3, 4)
SEGMENT = 1 << 20  # plaintext bytes per sealed segment of a blob in a version-3 or -4 store (cas/crypt.py)
SEGMENT_V1 = 64 << 10  # and in a version-1 or -2 store


def segment_of(version: int) -> int:
    """The plaintext bytes per sealed segment of a store sealed with scheme `version`."""
    return SEGMENT if version >= 3 else SEGMENT_V1


def aead_cipher(key: bytes):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # the crypto extra

    return AESGCM(key)


class BlobCipher:
    """AES-256-GCM under one blob's key: the one-shot calls, and `seal_parts_into`, which
    seals plaintext lying in several buffers (a segment across the parts of a write: a chunk's
    header and its compressed byte planes) with no gather copy: GCM's incremental form
    gives the same bytes as the one-shot call, which opens them."""

    __slots__ = ("key", "encrypt_into", "decrypt_into")

    def __init__(self, key: bytes) -> None:
        aead = aead_cipher(key)
        self.key = key
        self.encrypt_into, self.decrypt_into = aead.encrypt_into, aead.decrypt_into

    def seal_parts_into(self, nonce: bytes, parts: list, aad: bytes, out) -> None:
        """`out` (the parts' total length + 16) gets their ciphertext and the tag."""
        if len(parts) == 1:
            self.encrypt_into(nonce, parts[0], aad, out)
            return
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        sealing = Cipher(algorithms.AES(self.key), modes.GCM(nonce)).encryptor()
        sealing.authenticate_additional_data(aad)
        done = 0
        for part in parts:  # (update_into asks for room for one block more than it is given)
            done += sealing.update_into(part, out[done:done + len(part) + 15])
        rest = sealing.finalize()
        out[done:done + len(rest)] = rest
        done += len(rest)
        out[done:done + 16] = sealing.tag


def invalid_tag():
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


KEY_FILE_ENV = "CAS_KEY_FILE"


def key_from_env() -> str | bytes | None:
    """The key in the file $CAS_KEY_FILE names (None when unset): what an encrypted store is
    opened with when no key= is given (the library, the CLI, DCP ranks, trainer hooks alike)."""
    path = os.environ.get(KEY_FILE_ENV)
    return read_key_file(path) if path else None


class KeyText(str):
    """A key file's exactly 32 printable bytes: a passphrase where one is created from it, and
    also those 32 bytes as a raw key, so a store made with cas.open(key=b"<the same 32 bytes>")
    opens from the file too (each key blob says which kind it wraps: unlock)."""


KEY_FILE_LIMIT = 64 << 10  # bytes: a key file longer than this is refused, never cut short


def read_key_file(path: str) -> str | bytes:
    """The key a file holds. Its text (one trailing newline, LF or CRLF, aside) when that is
    printable UTF-8: a passphrase, or either kind when exactly 32 bytes (KeyText). Otherwise 32
    bytes are a raw key, and anything else a UTF-8 passphrase. The text is tried first, so a
    31-character passphrase written with `echo` is not taken for 32 raw bytes."""
    data = _read_key_bytes(path)
    text = _strip_newline(data)
    if not text:
        raise KeyFileError(f"the key file {path} is empty: it holds no key")
    if _printable(text):
        return KeyText(text.decode("utf-8")) if len(text) == KEY_SIZE else text.decode("utf-8")
    if len(data) == KEY_SIZE:
        return data
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError:
        raise CasError(f"the key file {path} is neither {KEY_SIZE} raw bytes nor a UTF-8 passphrase") from None


def _read_key_bytes(path: str) -> bytes:
    """The whole file, or KeyFileError: a key silently cut short would open a store made
    with its prefix, and never the one made with the whole of it."""
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read(KEY_FILE_LIMIT + 1)
    except OSError as exc:
        raise KeyRequiredError(f"cannot read the key file {path}: {exc.strerror or exc}") from None
    if len(data) > KEY_FILE_LIMIT:
        raise KeyFileError(f"the key file {path} is over {KEY_FILE_LIMIT} bytes (64 KiB), the most a key file "
                           "may hold (a key is never cut short): use a shorter passphrase or a 32-byte raw key")
    return data


def _strip_newline(data: bytes) -> bytes:
    if data.endswith(b"\r\n"):
        return data[:-2]
    return data[:-1] if data.endswith(b"\n") else data


def _printable(data: bytes) -> bool:
    try:
        return data.decode("utf-8").isprintable()
    except UnicodeDecodeError:
        return False


@dataclass(frozen=True, repr=False)
class StoreKeys:
    """The subkeys of one open store's master key, and the user key that unlocked it (never
    in a repr: stores, locations and tracebacks get printed)."""

    master: bytes
    key_id: str  # the keys/ blob that opened the store
    user: tuple[str, bytes]  # ("passphrase" | "raw", bytes): to create copies (push) openable alike
    mended: bool = False  # that blob was read as written: one bit or byte of it is damaged (verify says so)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_blob", _hkdf(self.master, b"cas blobs v1"))
        object.__setattr__(self, "_index", aead_cipher(_hkdf(self.master, b"cas index v1")))
        object.__setattr__(self, "namer", Namer(_hkdf(self.master, b"cas names v1")))
        object.__setattr__(self, "registry_mac", Namer(_hkdf(self.master, b"cas registry v1")).key)  # bytes -> 32
        object.__setattr__(self, "_aeads", {})  # salt -> its cipher (blob_aead)
        object.__setattr__(self, "_check", check_of(self.master))

    def __repr__(self) -> str:
        return f"StoreKeys(key_id={self.key_id!r})"

    @property
    def check(self) -> bytes:
        return self._check

    def blob_aead(self, salt: bytes):
        """The cipher of a blob's salt; kept (a bounded few), since every entry read from one
        pack uses the same and deriving it costs more than opening a small object."""
        aeads = self._aeads
        aead = aeads.get(salt)
        if aead is None:
            if len(aeads) >= 256:
                aeads.clear()
            aead = aeads[salt] = BlobCipher(blake3.blake3(b"cas blob key\0" + salt, key=self._blob).digest())
        return aead

    def seal(self, data: bytes, aad: bytes) -> bytes:
        """A small value sealed for the LMDB cache: 12-byte random nonce | ciphertext | tag."""
        nonce = os.urandom(12)
        return nonce + self._index.encrypt(nonce, data, b"cas-index-1\0" + aad)

    def unseal(self, data, aad: bytes, what: str) -> bytes:
        data = bytes(data)
        try:
            return self._index.decrypt(data[:12], data[12:], b"cas-index-1\0" + aad)
        except (invalid_tag(), ValueError):
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


# the most a key blob's scrypt may ask for: $CAS_SCRYPT_LOG_N's largest n at SCRYPT_R (4 GiB),
# and a few lanes; a blob asking more (planted, or damaged) is skipped, not run for minutes
SCRYPT_MAX_MEMORY = 128 * SCRYPT_R << 22
SCRYPT_MAX_P = 16


def _unusable_kdf(body: dict) -> str | None:
    """Why this cas will not run a key blob's KDF (None: it will): an unknown KDF (a newer cas's
    blob) or scrypt parameters out of bounds. unlock skips such a blob and tries the others."""
    kdf = body.get("kdf")
    if kdf == "raw":
        return None
    if kdf != "scrypt":
        return f"for the KDF {kdf!r}, which this cas does not know"
    n, r, p = body.get("n"), body.get("r"), body.get("p")
    if not all(isinstance(v, int) and v > 0 for v in (n, r, p)) or n & (n - 1) or n < 2:
        return f"for scrypt parameters that are not valid (n={n!r}, r={r!r}, p={p!r})"
    if 128 * r * n > SCRYPT_MAX_MEMORY or p > SCRYPT_MAX_P:
        return f"for scrypt parameters beyond this cas's bounds (n={n}, r={r}, p={p})"
    return None


def _kek(kind: str, secret: bytes, body: dict) -> bytes:
    if body["kdf"] == "raw":
        return secret if kind == "raw" else b""
    why = _unusable_kdf(body)
    if why is not None:
        raise CasError(f"a key blob of this store is {why}")
    return _scrypt(secret, bytes(body["salt"]), int(body["n"]), int(body["r"]), int(body["p"]))


@functools.lru_cache(maxsize=16)
def _scrypt(secret: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    """scrypt, once per process for the same passphrase and blob: DCP opens the store at every
    save and load on every rank, and a reader or writer checks its key when it is made (a
    wrong key said there, not inside DCP's CheckpointException). The derived key stays in
    memory as long as the store's master key does while it is open."""
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(secret)


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
    wrapped = aead_cipher(kek).encrypt(nonce, master, _key_aad(store_id, key_id))
    body.update(aead=AEAD_NAME, nonce=nonce, wrapped=wrapped, created=time.time(),
                master_mac=_master_mac(master, key_id, wrapped))
    return with_digest(KEY_MAGIC, body)  # one damaged byte of it is undone, not a store lost


def _master_mac(master: bytes, key_id: str, wrapped: bytes) -> bytes:
    """Proof, to any holder of the master key, that keys/<key_id> wraps that master key (its
    own user key is needed to unwrap it): remove_key counts only such blobs as keys that stay.
    A blob left by a killed creation wraps another master key and opens nothing here."""
    return blake3.blake3(key_id.encode() + b"\0" + bytes(wrapped), key=_hkdf(master, b"cas key blob v1")).digest()


def _wraps_master(backend, master: bytes, key_id: str) -> bool:
    """Whether keys/<key_id> is a key of the store whose master key this is: its master_mac
    proves it; a blob from before master_mac (stop 36) cannot be told and counts; a blob that is
    gone, unreadable or not a key blob does not."""
    try:
        body, _ = _parse_key(backend.get(KEYS_PREFIX + key_id))
    except CorruptionError:
        return False
    if body is None:
        return False
    if "master_mac" not in body:
        return True
    try:
        return secrets.compare_digest(bytes(body["master_mac"]), _master_mac(master, key_id, bytes(body["wrapped"])))
    except (TypeError, ValueError):
        return False


def _parse_key(data) -> tuple[dict | None, bool]:
    """(the key blob's fields or None when it is not one, whether it was read as written: a blob
    that ends with its digest (since stop 33) and is one bit or byte from it is mended, since
    with one key per store, one damaged byte of its blob locked the store for good)."""
    data = bytes(data)
    body = _key_fields(data)
    if body is not None or len(data) > MAX_KEY_BLOB:
        return body, False
    written = undo_own_error(data, KEY_MAGIC)
    return (_key_fields(written), True) if written is not None else (None, False)


def _key_fields(data: bytes) -> dict | None:
    if not data.startswith(KEY_MAGIC):
        return None
    try:
        body = msgpack.unpackb(data[len(KEY_MAGIC):], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if claims_a_digest(body) and not proves_itself(data):
        return None
    return body if isinstance(body, dict) and body.get("format") == 1 and "wrapped" in body else None


def key_ids(backend) -> list[str]:
    return [name[len(KEYS_PREFIX):] for name in backend.list(KEYS_PREFIX)]


def stray_key_ids(backend, master: bytes) -> list[str]:
    """The keys/ blobs that open nothing of the store whose master key this is (a creation cut
    short left them: _wraps_master), which `cas key remove` deletes."""
    return [k for k in key_ids(backend) if not _wraps_master(backend, master, k)]


def removal_marks(backend) -> list[str]:
    """The ids of the keys a removal has marked as going (remove_key)."""
    return [name[len(REMOVING_PREFIX):] for name in backend.list(REMOVING_PREFIX)]


def new_key_id() -> str:
    return secrets.token_hex(8)


class MasterKey:
    """An open store's master key, offered to another store made with the same one: a copy
    that push or pull made names objects as its source does, whatever user keys either holds by
    now (`cas key add/remove` on one of them left the other's keys/ without the key that opens
    the first). It opens a store whose config's check it matches, and nothing else; it is never
    written. (Whoever holds it can read that store anyway: its master key decrypts it.)"""

    __slots__ = ("keys",)

    def __init__(self, keys: StoreKeys) -> None:
        self.keys = keys

    def __repr__(self) -> str:
        return "MasterKey(...)"


def unlock(backend, store_id: str, encryption: dict, key, where: str) -> StoreKeys:
    """The StoreKeys the user key unlocks: KeyRequiredError without one, WrongKeyError when no
    keys/ blob of the store opens with it (a wrong key, or a removed one). A MasterKey opens
    the store when the config's check is its."""
    if isinstance(key, MasterKey):
        if secrets.compare_digest(key.keys.check, bytes(encryption["check"])):
            return StoreKeys(key.keys.master, "", key.keys.user)
        raise WrongKeyError(f"the encrypted store at {where} was made with another master key")
    if key is None:
        raise KeyRequiredError(f"the store at {where} is encrypted: give its key (cas.open(path, key=...), "
                               "or a file named by $CAS_KEY_FILE)")
    as_given = user_key(key)
    check = bytes(encryption["check"])
    ids = key_ids(backend)
    if not ids:
        raise WrongKeyError(f"the encrypted store at {where} has no keys left (keys/ is empty): it cannot be opened")
    tried_kdf: dict[tuple, bytes] = {}
    refused = []  # (key id, fields, KEK, user) of blobs whose wrapped key failed its tag
    unusable = []  # (key id, why) of blobs whose KDF this cas will not run
    for key_id in ids:
        try:
            body, mended = _parse_key(backend.get(KEYS_PREFIX + key_id))
        except CorruptionError:  # removed meanwhile, unreadable: another key may open it
            body = None
        if body is None:
            unusable.append((key_id, "a blob that cannot be read as a key blob (damaged)"))
            continue
        wants_raw = body.get("kdf") == "raw"
        user = ("raw", key.encode("utf-8")) if wants_raw and isinstance(key, KeyText) else as_given
        kind, secret = user
        if wants_raw != (kind == "raw"):
            continue
        why = _unusable_kdf(body)
        if why is not None:
            unusable.append((key_id, why))
            continue
        try:
            params = (body["kdf"], bytes(body.get("salt", b"")), body.get("n"), body.get("r"), body.get("p"))
            kek = tried_kdf.get(params) or tried_kdf.setdefault(params, _kek(kind, secret, body))
            master = aead_cipher(kek).decrypt(bytes(body["nonce"]), bytes(body["wrapped"]), _key_aad(store_id, key_id))
        except invalid_tag():
            if not claims_a_digest(body):  # a blob from before the digest: its tag may still prove a fix
                refused.append((key_id, body, kek, user))
            continue
        except (KeyError, TypeError, ValueError):
            continue
        if len(master) == KEY_SIZE and secrets.compare_digest(check_of(master), check):
            return StoreKeys(master, key_id, user, mended)
    for key_id, body, kek, user in refused:
        master = _mended_wrapping(body, kek, _key_aad(store_id, key_id), check)
        if master is not None:
            return StoreKeys(master, key_id, user, True)
    skipped = "".join(f"; key {key_id} was not tried: it is {why}" for key_id, why in unusable)
    raise WrongKeyError(f"the key given does not open the encrypted store at {where}: it is wrong, or it was "
                        f"removed (cas key remove); the store has {len(ids)} key(s){skipped}")


def _mended_wrapping(body: dict, kek: bytes, aad: bytes, check: bytes) -> bytes | None:
    """The master key a key blob written before the digest wraps, where one bit or byte of its
    nonce or wrapped key is damaged: the change whose AES-GCM tag verifies under the key given,
    to a master key whose check is the config's, is the blob as written (a wrong key finds
    none, in about 15,000 tries of a few µs). One damaged byte there had locked a one-key store."""
    nonce, wrapped = bytes(body.get("nonce", b"")), bytes(body.get("wrapped", b""))
    aead, boundary = aead_cipher(kek), len(nonce)

    def opens(candidate) -> bool:
        try:
            master = aead.decrypt(bytes(candidate[:boundary]), bytes(candidate[boundary:]), aad)
        except (invalid_tag(), ValueError):
            return False
        return len(master) == KEY_SIZE and secrets.compare_digest(check_of(master), check)

    fixed = first_fix(nonce + wrapped, opens)
    return None if fixed is None else aead.decrypt(fixed[:boundary], fixed[boundary:], aad)


def encryption_fields(master: bytes) -> dict:
    """What the config records of an encrypted store."""
    return {"version": ENCRYPTION_VERSION, "aead": AEAD_NAME, "segment": segment_of(ENCRYPTION_VERSION),
            "naming": NAMING, "kdf": "scrypt",
            "check": check_of(master)}


def check_fields(encryption, where: str) -> dict:
    if not isinstance(encryption, dict) or encryption.get("version") not in ENCRYPTION_VERSIONS:
        raise CasError(f"the store at {where} is encrypted with a scheme this cas does not know "
                       f"({encryption!r}); upgrade cas to open it")
    expected = (AEAD_NAME, segment_of(encryption["version"]), NAMING)
    if (encryption.get("aead"), encryption.get("segment"), encryption.get("naming")) != expected \
            or not isinstance(encryption.get("check"), bytes) or len(encryption["check"]) != 16:
        raise CasError(f"the store at {where} is encrypted with parameters this cas does not read: {encryption!r}")
    return encryption


def add_key(backend, store_id: str, keys: StoreKeys, new_key, where: str = "") -> str:
    """Write a keys/ blob wrapping the store's master key under `new_key` (create-only); its id.
    DuplicateKeyError when `new_key` already opens the store: a second id for it would outlive
    `cas key remove` of the first, and the user would believe the key revoked."""
    user = user_key(new_key)
    existing = key_opening(backend, store_id, keys, new_key)
    if existing is not None:
        raise DuplicateKeyError(f"this key already opens the store{' at ' + where if where else ''} as key "
                                f"{existing}; no second key was added (`cas key remove {existing}` revokes it)")
    key_id = key_id_of(keys.master, user)
    data = key_blob(store_id, key_id, keys.master, user)
    # A removal of this key killed before it dropped its mark left the mark (the id comes from
    # the key): deleted while the key is absent, before its blob is written, so no removal of
    # the re-added key (which marks it anew) can lose its mark here.
    if key_id in removal_marks(backend) and backend.stat(KEYS_PREFIX + key_id) is None:
        backend.delete(REMOVING_PREFIX + key_id)
        backend.sync()
    faults.point("keys.adding")
    if not backend.put_if_absent(KEYS_PREFIX + key_id, [data]):  # the same key, added meanwhile
        raise DuplicateKeyError(f"this key was just added to the store{' at ' + where if where else ''} as key "
                                f"{key_id} by another process; no second key was added")
    faults.point("keys.added")
    return key_id


def key_id_of(master: bytes, user: tuple[str, bytes]) -> str:
    """An added key's id: the same user key always gets the same id in one store, so two
    processes adding it at once race for one create-only name (random ids gave it two, and
    removing one left it working: an audit of stop 36); the id reveals nothing without the
    master key."""
    kind, secret = user
    return blake3.blake3(kind.encode() + b"\0" + secret, key=_hkdf(master, b"cas key id v1")).hexdigest()[:16]


def key_opening(backend, store_id: str, keys: StoreKeys, key) -> str | None:
    """The id of the keys/ blob that `key` unlocks to this store's master key, or None (tried
    as at open: unlock)."""
    try:
        return unlock(backend, store_id, {"check": keys.check}, key, "").key_id
    except WrongKeyError:
        return None


def remove_key(backend, keys: StoreKeys, key_id: str, where: str) -> None:
    """Delete keys/<key_id>; never the last key, nor the one the store was opened with.

    Two hosts each removing the other's key would each see two keys, each delete one, and
    leave none. So a removal first marks its key as going (removing-keys/<id>, create-only,
    empty), then lists keys and marks, and deletes only while a key that is not going, and that
    wraps this store's master key (`_wraps_master`: not a killed creation's leftover), remains;
    else it drops its mark and is refused. Of removals that race, the one that lists last sees
    every other's mark, so a key always survives. A mark left by a removal that was killed
    counts its key as going until `remove_key` of that key runs again and finishes it."""
    ids = key_ids(backend)
    if key_id not in ids and key_id in removal_marks(backend):  # a removal killed after its delete: finish it
        backend.delete(REMOVING_PREFIX + key_id)
        backend.sync()
        return
    if key_id not in ids:
        raise CasError(f"the store at {where} has no key {key_id!r}; its keys: {', '.join(ids)}")
    if key_id == keys.key_id:
        raise KeyRemovalRefusedError(f"key {key_id} is the one this store was opened with; open it with another "
                                     "key to remove this one")
    if len(ids) <= 1:
        raise KeyRemovalRefusedError(f"key {key_id} is the last key of the store at {where}; removing it would "
                                     "make the store unreadable")
    mark = REMOVING_PREFIX + key_id
    marked = backend.put_if_absent(mark, [b""])  # (False: an earlier removal of it was stopped; finish it)
    faults.point("keys.removing")
    going = set(removal_marks(backend))
    staying = [k for k in key_ids(backend) if k not in going and _wraps_master(backend, keys.master, k)]
    if not staying:
        if marked:
            backend.delete(mark)
            backend.sync()
        raise KeyRemovalRefusedError(f"key {key_id} cannot be removed from the store at {where}: every other key "
                                     f"is being removed too ({', '.join(sorted(going - {key_id}))}); removing it "
                                     "could leave the store with no key. A removal that was stopped is finished "
                                     "by running it again")
    backend.delete(KEYS_PREFIX + key_id)
    backend.sync()
    faults.point("keys.removed")
    for gone in going.difference(key_ids(backend)):  # its own mark, and those of removals killed after their delete
        backend.delete(REMOVING_PREFIX + gone)
    backend.sync()
