"""torch, imported on its first use rather than with cas.store.

Importing torch costs 1-2 s of CPU, most of what a CLI command such as `cas ls` took, and none of
listing, verifying, collecting or copying checkpoints needs it: those read chunk bytes and
msgpack records. The store's modules therefore name torch through this stand-in, which imports
the real module the first time an attribute is asked for (saving or loading tensors, which a
caller that has tensors has imported already). Type checkers see the real module.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any


class LazyModule:
    """A module imported when one of its attributes is first asked for. Attributes are looked
    up on the module every time (nothing is cached here), so a patched attribute is seen."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")
