"""What produced a checkpoint, recorded with every save (Store and DCP) in its record (the log's
`add` change): the software, the host and process, the job's world and devices, the code's git
commit and the command line. `meta=` stays the user's own; this is ours, and a signature
(store/signing.py) covers it.

Collected once per process where it cannot change (versions, host, the git commit the process
started from), and per save where it can (world size, devices). Never raises: a value that
cannot be read is None.
"""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
import sys

GIT_TIMEOUT = 2.0  # seconds; a hung git (a network filesystem) must not stall a save


@functools.lru_cache(maxsize=1)
def _static() -> dict:
    import numpy
    import torch

    from cas import __version__ as cas_version

    return {"cas": cas_version, "torch": torch.__version__, "python": platform.python_version(),
            "numpy": numpy.__version__, "host": socket.gethostname(), "pid": os.getpid(),
            "git": _git(os.getcwd()), "argv": [str(a) for a in sys.argv]}


def _git(folder: str) -> dict:
    """{"commit", "dirty"} of the git work tree holding `folder`; both None outside one (or
    without git), so `provenance["git"]["commit"]` reads the same way everywhere."""
    def run(*args: str) -> str | None:
        try:
            # --no-optional-locks: `status` must not refresh and rewrite the user's index (a git
            # killed at the timeout would leave .git/index.lock, and their next git command fails)
            done = subprocess.run(["git", "--no-optional-locks", "-C", folder, *args], capture_output=True, text=True,
                                  timeout=GIT_TIMEOUT)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    commit = run("rev-parse", "HEAD")
    if not commit:
        return {"commit": None, "dirty": None}
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _devices() -> list[str]:
    import torch

    try:
        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken driver is no reason to fail a save
        pass
    return ["cpu"]


def _world_size() -> int:
    import torch.distributed as dist

    try:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except Exception:  # noqa: BLE001
        return 1


def collect() -> dict:
    """The provenance of a save made now, by this process."""
    out = dict(_static())
    out["pid"] = os.getpid()  # a forked worker saves as itself
    out["world_size"] = _world_size()
    out["devices"] = _devices()
    return out
