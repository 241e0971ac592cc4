"""Where a store lives, and where its cache lives: a folder on this host, or a key prefix in
an S3 bucket (`s3://bucket/prefix`) with its LMDB cache in a folder of this host.

A store is named by a path, `file://PATH` or `s3://BUCKET/PREFIX`; any other `scheme:/...` is
refused rather than taken as a folder name (`./s3:/bucket/...` once "saved" silently).

In a bucket the config is a blob like any other, created create-only (two hosts creating one
store at once: one config wins, both open it), and every object goes into packs of about
`SEGMENT_BYTES` (segments): one PUT per segment instead of one per chunk, read back by ranged
GETs. The cache of a bucket store lives in `cache_dir` (the option), else `$CAS_CACHE_DIR`,
else `~/.cache/cas`, one folder per store; two processes with different cache folders behave
as two hosts, and a host with none rebuilds it from the bucket.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

from cas import faults
from cas.backend import MAX_BLOB, Backend
from cas import crypt
from cas.errors import BlobAbsentError, CasError, CorruptionError, NotAStoreError, NotEncryptedError
from cas.hashing import hash_bytes
from cas.localfs import LocalBackend
from cas.packs import PACK_TARGET

from . import layout as L

CACHE_ENV = "CAS_CACHE_DIR"
SEGMENT_BYTES = 32 << 20  # bench/bench_s3.py: requests and throughput by segment size
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")


def default_cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "cas")


def parse_target(target) -> tuple[str, str]:
    """("local", absolute path) or ("s3", url) for what names a store."""
    text = os.fspath(target)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    match = _SCHEME.match(text)
    if match is None:
        return "local", os.path.abspath(text)
    scheme = match.group(1).lower()
    if scheme == "file":
        path = text[len("file:"):]
        if path.startswith("//"):  # file:///abs/path, or file://host/path for this host
            path = path[2:]
            if not path.startswith("/"):
                host, _, rest = path.partition("/")
                if host not in ("", "localhost"):
                    raise CasError(f"{text!r} names a file on host {host!r}; a file:// store must be on this host")
                path = "/" + rest
        return "local", os.path.abspath(path or ".")
    if scheme == "s3":
        if not text.lower().startswith("s3://"):
            raise CasError(f"{text!r} is not an S3 URL: write s3://BUCKET/PREFIX")
        return "s3", "s3://" + text[len("s3://"):]
    raise CasError(f"{text!r}: unknown scheme {scheme}://; a store is a path, file://PATH or s3://BUCKET/PREFIX")


@dataclass
class Location:
    """A store's place: its backend, its config blob, and the folder of its LMDB cache."""

    kind: str  # "local" or "s3"
    name: str  # the absolute path or the URL (store.path, messages)
    backend: Backend
    cache_dir: str | None = None  # bucket stores: where their caches live
    keys: crypt.StoreKeys | None = None  # an encrypted store's, once unlocked (or made by create)

    @property
    def local(self) -> bool:
        return self.kind == "local"

    @property
    def layout(self) -> L.Layout:
        return L.Layout(self.name)

    def read_config(self) -> L.Config:
        """The config, or the NotAStoreError that says precisely why there is none."""
        if self.local:
            return L.read_config(self.layout)
        try:
            data = self.backend.get(L.CONFIG_NAME)
        except BlobAbsentError:
            raise NotAStoreError(f"{self.name} is not a cas store (it has no {L.CONFIG_NAME} object); open an "
                                 "empty prefix to create one") from None
        return L.parse_config(bytes(data), self.name, self.backend.where(L.CONFIG_NAME))

    def has_config(self) -> bool:
        if self.local:
            return os.path.exists(self.layout.config)
        return self.backend.stat(L.CONFIG_NAME) is not None

    def can_create(self) -> bool:
        """Whether a store may be made here: a missing or empty folder (see layout.can_create),
        or a prefix that holds nothing but key blobs (a creation cut short after its first key
        blob, before its config: the blobs wrap a master key no config names, and stay
        unopenable); a bucket prefix with other data is not ours."""
        if self.local:
            return L.can_create(self.name)
        return all(name.startswith(crypt.KEYS_PREFIX) for name in self.backend.list(""))

    def create(self, chunk_size: int, key=None, *, master: bytes | None = None) -> bool:
        """Make the store (encrypted under `key` when given, with a new random master key, or
        `master`: a copy that names objects as its source does); False when another process
        made it first (it is opened then). Its first key blob is written before the config: a
        config names a store that can be opened."""
        L.check_chunk_size(chunk_size)
        store_id, blob, encryption = None, None, None
        if key is not None:
            user = crypt.user_key(key)
            master = master or os.urandom(32)
            store_id, key_id = secrets.token_hex(8), crypt.new_key_id()
            blob = (crypt.KEYS_PREFIX + key_id, crypt.key_blob(store_id, key_id, master, user))
            encryption = crypt.encryption_fields(master)
            keys = crypt.StoreKeys(master, key_id, user)
        if self.local:
            made = _create_folder(self.layout, chunk_size, store_id, blob, encryption)
        else:
            if blob is not None:
                self.backend.put_if_absent(*blob[:1], [blob[1]])
            made = self.backend.put_if_absent(L.CONFIG_NAME, [L.config_bytes(chunk_size=chunk_size, store_id=store_id,
                                                                              encryption=encryption)])
            if not made and blob is not None:  # another host's config won: this key blob wraps nothing of it
                self.backend.delete(blob[0])
        if made and key is not None:
            self.keys = keys
        return made

    def unlock(self, config: L.Config, key) -> None:
        """For an encrypted store, unlock its keys with `key` and wrap the backend so every blob
        is sealed and opened (cas/crypt.py); a key for a plain store is refused."""
        if not config.encrypted:
            if key is not None:
                raise NotEncryptedError(f"the store at {self.name} is not encrypted; open it without key= (a store is "
                                        "encrypted when it is created with a key)")
            left = crypt.key_ids(self.backend)
            if left:  # its config was rewritten as plain: saves would go to disk unencrypted
                raise CorruptionError(
                    f"the config of the store at {self.name} says it is not encrypted, but its keys/ holds "
                    f"{len(left)} key blob(s) ({', '.join(left)}): an encrypted store's config was replaced, and "
                    "saving into it would write plaintext; nothing was changed. (If keys/ is only what an "
                    "encrypted creation cut short left in a store then made plain, remove keys/.)",
                    key=L.CONFIG_NAME)
            return
        if self.keys is None or crypt.check_of(self.keys.master) != config.encryption["check"]:
            if key is None:  # no key= given: the one in the file $CAS_KEY_FILE names, if set
                key = crypt.key_from_env()
            self.keys = crypt.unlock(self.backend, config.store_id, config.encryption, key, self.name)
        self.backend = crypt.wrap(self.backend, self.keys, config.encryption["version"])

    def writable(self) -> bool:
        """Whether this process may change the store (a bucket: found out at the first write)."""
        if not self.local:
            return True
        layout = self.layout
        return os.access(layout.root, os.W_OK) and (not os.path.exists(layout.index)
                                                    or os.access(layout.index, os.W_OK))

    def packing(self, pack_max: int | None) -> tuple[int | None, int]:
        """(pack_max, pack_target) for writers here: a folder's as configured; in a bucket every
        object goes into segments of SEGMENT_BYTES (one PUT per segment, never a name two writers
        could race to fill with two encodings of one object)."""
        return (pack_max, PACK_TARGET) if self.local else (MAX_BLOB, SEGMENT_BYTES)

    def index_dir(self, config: L.Config) -> str:
        """The LMDB cache's folder: in the store's folder, or per bucket store in the cache dir."""
        if self.local:
            return self.layout.index
        tag = hash_bytes(self.name.encode()).hex()[:12]
        return os.path.join(os.fspath(self.cache_dir or default_cache_dir()), f"{config.store_id}-{tag}", "index")


def locate(target, *, cache_dir: str | None = None) -> Location:
    """The Location `target` (a path, file://PATH or s3://BUCKET/PREFIX) names."""
    kind, name = parse_target(target)
    if kind == "local":
        return Location(kind, name, LocalBackend(name))
    from cas.s3 import S3Backend  # boto3 only for stores in a bucket (the `s3` extra)

    backend = S3Backend.from_url(name)
    return Location(kind, backend.url, backend, cache_dir)


def check_key(target, key) -> None:
    """Raise now what opening the store at `target` with `key` (None: $CAS_KEY_FILE's) would
    raise for the key: KeyRequiredError, WrongKeyError, NotEncryptedError, a damaged config's
    CorruptionError. Nothing there yet: nothing to say (a save creates the store). For DCP's
    reader and writer, whose errors inside dcp.save and dcp.load reach the caller as DCP's
    CheckpointException (a BaseException), not as the CasError that names the problem."""
    location = locate(target)
    if location.has_config():
        config = location.read_config()
        if config.encrypted or key is not None:  # (a plain store's other checks are left to its open)
            location.unlock(config, key)


def _create_folder(layout: L.Layout, chunk_size: int, store_id: str | None = None, blob: tuple | None = None,
                   encryption: dict | None = None) -> bool:
    with L.creation_lock(layout.root):
        if os.path.exists(layout.config):
            return False  # another process created it while this one waited
        if not L.can_create(layout.root):  # someone put something else here meanwhile
            L.read_config(layout)
        for folder in L.LAYOUT_FOLDERS:
            os.makedirs(os.path.join(layout.root, folder), exist_ok=True)
        if blob is not None:
            os.makedirs(os.path.join(layout.root, L.KEYS_FOLDER), exist_ok=True)
            LocalBackend(layout.root).put_if_absent(*blob[:1], [blob[1]])
        faults.point("store.creating")
        L.write_config(layout, chunk_size=chunk_size, store_id=store_id,  # the cache is built at the first open
                       encryption=encryption)
        return True
