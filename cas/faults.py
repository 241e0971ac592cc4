"""Named fault-injection points, for tests that break the store on purpose.

Inert unless the environment variable CAS_FAULTS is set (tests only), as a comma-separated list
of `point=action`:
  kill         SIGKILL this process at that point (a crash: no cleanup, no atexit)
  raise        raise InjectedFault there
  enospc       raise OSError(ENOSPC) there, as a full disk would
  pause:PATH   create PATH + ".reached", then wait until PATH exists (lets a test interleave
               two processes deterministically)
An action may be suffixed with `@N` to fire only on the N-th time the point is reached.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

from .errors import CasError

_rules: dict[str, str] = {}
_counts: dict[str, int] = {}
_lock = threading.Lock()


def configure(spec: str) -> None:
    """Replace the active rules (the CAS_FAULTS syntax); "" turns every point off."""
    with _lock:
        _rules.clear()
        _rules.update(item.split("=", 1) for item in spec.split(",") if "=" in item)
        _counts.clear()


class InjectedFault(CasError):
    """Raised by a `raise` fault point."""


def point(name: str) -> None:
    """Mark a named point of a save, commit or gc phase."""
    if not _rules:
        return
    action = _rules.get(name)
    if action is None:
        return
    with _lock:
        _counts[name] = n = _counts.get(name, 0) + 1
    if "@" in action:
        action, _, nth = action.rpartition("@")
        if n != int(nth):
            return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise InjectedFault(f"fault injected at {name}")
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (injected at {name})")
    elif action.startswith("pause:"):
        path = action[len("pause:"):]
        open(path + ".reached", "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)


configure(os.environ.get("CAS_FAULTS", ""))
