"""Durable file writes: temporary name, write, fsync, atomic rename, fsync of the directory.

A reader never sees a partial file under a final name. Object files are written once and
never modified; the only other writes are the store's config at creation.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import re
import secrets
import socket
import stat
import threading
from typing import Callable

from .errors import UnsupportedFilesystemError

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "arm64": 276}.get(platform.machine())
# errnos saying "this filesystem or kernel cannot do that", as opposed to a failure of this call
UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM})


def host_tag() -> str:
    """This host's name as it goes into temporary file names (letters, digits and dashes): gc
    removes a dead writer's temporary files only on the host where it ran, since a process id
    says nothing about a process on another host sharing the filesystem."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def new_file_mode() -> int:
    """The mode a file created for the user gets by default: 0o666 less the process umask. A
    writer that creates its file privately first (safetensors writes 0o600) gives it this mode
    before the file takes its name. The umask is read from /proc (Linux) where it can be: setting
    it to read it back would race other threads creating files."""
    try:
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def tmp_name(directory: str, stem: str, *, owned: bool = False) -> str:
    """A temporary path no other writer (process or thread, on any host) will pick:
    `.<stem>.<host>.<pid>.<thread>.<owner token><random>.tmp`. With `owned` (a store's tmp
    folder, which gc cleans), the owner token names this process's owner file in `directory`
    (owner_file), whose lock says whether it still runs; else it is random."""
    token = _owner_token(directory) if owned else secrets.token_hex(4)
    return os.path.join(directory, f".{stem}.{host_tag()}.{os.getpid()}.{threading.get_ident()}."
                                   f"{token}{secrets.token_hex(4)}.tmp")


def tmp_owner(name: str) -> tuple[str | None, int, str | None] | None:
    """(host, pid, owner token) of a temporary file's writer from its name (host None in names
    written before hosts were recorded, token None in names written before owner files); None
    for a name that is not one of ours."""
    parts = name.split(".")
    if not name.endswith(".tmp") or len(parts) < 6 or not parts[-4].isdigit():
        return None
    token = parts[-2][:8] if len(parts[-2]) == 16 else None
    return (parts[-5] if len(parts) >= 7 else None), int(parts[-4]), token


OWNER_PREFIX = ".owner."
_owners: dict[tuple[int, str], str] = {}  # (pid, real tmp folder) -> this process's owner token
_owners_lock = threading.Lock()


def owner_file(directory: str, host: str, pid: int, token: str) -> str:
    return os.path.join(directory, f"{OWNER_PREFIX}{host}.{pid}.{token}")


def _owner_token(directory: str) -> str:
    """This process's owner token for temporary files in `directory`, making its owner file
    on first use: created and flock'd under a temporary name, then linked into place, so it is
    never seen unlocked while this process lives. The descriptor stays open (and the lock held)
    until the process ends, however it ends; a forked child makes its own."""
    key = (os.getpid(), os.path.realpath(directory))
    with _owners_lock:
        token = _owners.get(key)
        if token is not None:
            return token
        token = secrets.token_hex(4)
        final = owner_file(directory, host_tag(), os.getpid(), token)
        staging = f"{final}.new"
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            name_new(staging, final)
        except BaseException:
            os.close(fd)
            raise
        finally:
            unlink_quietly(staging)
        _owners[key] = token  # fd deliberately kept open: the lock lives as long as the process
        return token


def lock_held(path: str) -> bool | None:
    """Whether some live process holds the exclusive flock on the file at `path`: True while it
    does, False once the lock can be taken (the kernel drops it with its holder, however the
    holder dies, in whatever PID namespace it ran), None when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock if we took it
    return False


def owner_alive(directory: str, host: str, pid: int, token: str) -> bool | None:
    """Whether the process that owns temporary files under `token` still runs (lock_held on its
    owner file; None when there is none: it cannot be judged, so its files are left alone)."""
    try:
        return lock_held(owner_file(directory, host, pid, token))
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_parts(fd: int, parts) -> int:
    """Write every bytes-like part fully (os.write may write less than asked)."""
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]
            total += n
    return total


def write_tmp(path: str, parts, *, tmp_dir: str | None = None, fsync: bool = True) -> str:
    """Write `parts` to a fresh temporary file meant to become `path`; returns its name."""
    tmp = tmp_name(tmp_dir or os.path.dirname(path), os.path.basename(path), owned=tmp_dir is not None)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_parts(fd, parts)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(tmp)
        raise
    os.close(fd)
    return tmp


def open_tmp(path: str, *, tmp_dir: str) -> tuple[str, int]:
    """A fresh temporary file meant to become `path`, open for writing: (its name, the fd)."""
    tmp = tmp_name(tmp_dir, os.path.basename(path), owned=True)
    return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


WRITE_BATCH = 1 << 20  # bytes per pwritev (bench/profile.md, "Saves: bounded writes and one-buffer chunks")


def pwrite_parts(fd: int, parts: list, offset: int) -> int:
    """Write every bytes-like part at `offset` onward, in pwritev calls of up to WRITE_BATCH
    bytes (short writes resumed): threads write their own ranges of one file at once, with no
    copies. The cap is for the threads beside: a write holds the file's inode lock while the
    kernel copies it, and one 4 MiB call made every other writer spin on that lock."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    total, i = 0, 0
    while i < len(views):
        batch, room, j = [], WRITE_BATCH, i
        while j < len(views) and room and len(batch) < 512:
            batch.append(views[j][:room])
            room -= batch[-1].nbytes
            j += 1
        n = os.pwritev(fd, batch, offset + total)
        if not n:  # (the caller sees a short write)
            break
        total += n
        while n:  # drop what was written, keep the rest of a part cut short (by the cap or the kernel)
            if n >= views[i].nbytes:
                n -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return total


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a range to disk now, without waiting (Linux's
    sync_file_range; nothing elsewhere): the fsync at the end then finds most of a large file
    on its way, instead of all of it dirty. Not durability: the fsync still gives that."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # ctypes lets go of the GIL


def publish(tmp: str, path: str, *, fsync: bool = False) -> None:
    """Rename a written temporary file into place (fsyncing it first when asked): readers see
    all of it under `path` or nothing."""
    try:
        if fsync:
            fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise


def _libc_renameat2():
    """libc's renameat2 (glibc 2.28+), else the raw syscall where its number is known, else
    None."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        return fn
    if _SYS_RENAMEAT2 is None:
        return None
    libc.syscall.restype = ctypes.c_long
    return lambda *args: libc.syscall(ctypes.c_long(_SYS_RENAMEAT2), *args)


_renameat2 = _libc_renameat2()


def rename_noreplace(src: str, dst: str) -> None:
    """Rename `src` to `dst` in one step that never replaces an existing `dst`
    (renameat2 with RENAME_NOREPLACE). FileExistsError when `dst` exists; an OSError whose
    errno is in UNSUPPORTED when the kernel or the filesystem cannot do it (FUSE exFAT, NFS)."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available on this platform", dst)
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), dst)  # FileExistsError for EEXIST


def name_new(tmp: str, path: str) -> bool:
    """Give `tmp`'s file the name `path` in one step that never replaces a file: False (and
    `tmp` left as it is) when `path` exists. renameat2(RENAME_NOREPLACE), else a hard link
    (where the kernel or filesystem lacks the first: NFS, some FUSE); a check then a rename
    would be two steps, and another writer's committed file could be replaced in between
    (issue 21, item 6), so a filesystem with neither (FUSE exFAT) is refused. Object files,
    record log entries, leases and owner files all take their names this way."""
    try:
        rename_noreplace(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in UNSUPPORTED:
            raise
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in UNSUPPORTED:
            raise
        raise UnsupportedFilesystemError(
            f"the filesystem holding {os.path.dirname(path)} can neither rename without replacing "
            f"(renameat2 RENAME_NOREPLACE) nor make hard links ({exc.strerror}), so two writers could "
            "replace each other's committed files; keep the store on a filesystem with either (ext4, xfs, "
            "btrfs, tmpfs, NFS)") from None
    unlink_quietly(tmp)
    return True


def atomic_write(path: str, parts, *, tmp_dir: str | None = None) -> None:
    """Write `parts` to `path` durably, so that `path` holds either nothing or all of them."""
    publish(write_tmp(path, parts, tmp_dir=tmp_dir), path)


def read_head(path: str, nbytes: int) -> bytes:
    """The first `nbytes` of a file (an object's header)."""
    with open(open_regular(path), "rb", buffering=0) as f:
        return f.read(nbytes)


def fsync_file(path: str) -> None:
    """Make a written file's bytes durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename or unlink in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at `path`. Not through a symlink (it must
    not lead out of the store), and not a FIFO or device put in a file's place: opened
    non-blocking (reading one would wait for a writer forever) and refused (an OSError)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


def read_file(path: str, limit: int, buffer: Callable[[int], memoryview] | None = None):
    """Read a whole file, refusing one larger than `limit` (a hostile or damaged file must not
    make us allocate without bound). With `buffer(n)` giving a reusable writable buffer of at
    least n bytes, read into it and return a memoryview of the bytes read (hot paths avoid a
    fresh allocation per file); else return new bytes."""
    fd = open_regular(path)
    with open(fd, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ValueError(f"{path} is {size} bytes, more than the {limit} allowed")
        if buffer is None:
            data = f.read(size + 1)
        else:
            view = buffer(size + 1)[:size + 1]
            filled = 0
            while filled <= size:
                n = f.readinto(view[filled:])
                if not n:
                    break
                filled += n
            data = view[:filled]
    if len(data) > limit:
        raise ValueError(f"{path} grew past {limit} bytes while being read")
    return data


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
