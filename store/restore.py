"""Restoring stateful objects (modules, optimizers, schedulers, ...) in place from a checkpoint.

Tensors are decoded straight into the targets' own tensors where dtype and shape match, so no
second full copy of a model is held. A failed restore must leave the model as it was: modules
are checked against the checkpoint before any byte is decoded, and restored last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cas.errors import CheckpointNotFoundError, CorruptionError, StateMismatchError

from . import tensors
from .lazytorch import torch
from .reader import CheckpointReader
from .registry import Checkpoint
from .training import is_stateful
from .tree import path_join, walk_value


@dataclass(frozen=True)
class Skipped:
    """A checkpoint that a fallback passed over: its step, id, and the damage found in it."""

    step: int
    id: str
    reason: str


class RestoredState(dict):
    """The top-level entries that `restore` (or `load(fallback=True)`) returns, with `checkpoint`,
    the checkpoint they came from, and `skipped`, the newer ones a fallback passed over as
    damaged, newest first (empty when none was)."""

    def __init__(self, entries: dict, checkpoint: Checkpoint, skipped: list[Skipped] | None = None) -> None:
        super().__init__(entries)
        self.checkpoint = checkpoint
        self.skipped = list(skipped or [])


def first_sound(candidates: list[Checkpoint], attempt: Callable[[Checkpoint], object],
                where: str) -> tuple[object, Checkpoint, list[Skipped]]:
    """attempt(ck) for each candidate in turn until one raises no CorruptionError: (its result,
    that checkpoint, the ones skipped with why). Any other error stops the search (a target that
    does not fit is not damage). None sound: a CorruptionError naming every one."""
    skipped: list[Skipped] = []
    for ck in candidates:
        try:
            return attempt(ck), ck, skipped
        except CorruptionError as exc:
            skipped.append(Skipped(ck.step, ck.id, str(exc)))
    raise CorruptionError(f"no checkpoint of {where} can be read whole; every one is damaged: "
                          + "; ".join(f"step {s.step}: {s.reason}" for s in skipped))


def restore(reader: CheckpointReader, targets: dict) -> dict:
    """Restore `targets` (top-level entry -> stateful object) from the reader's checkpoint; see
    Store.restore. Returns the checkpoint's top-level entries, each stateful target in place of
    its state dict."""
    if not isinstance(targets, dict):
        raise TypeError("restore takes a dict of targets, like the state that was saved")
    top = reader.top()
    missing = [k for k in targets if not isinstance(top, dict) or k not in top]
    if missing:
        have = list(top) if isinstance(top, dict) else []
        raise CheckpointNotFoundError(f"checkpoint step {reader.step} has no entries {missing} to restore "
                                      f"into (it has {have})")
    own_of: dict = {}  # target key -> {tensor path: its tensor}, for the targets decoded into
    modules: dict = {}  # module targets' keys -> their tensors (checked against the checkpoint)
    for key, target in targets.items():
        if not is_stateful(target):
            _refuse_nested_targets(target, str(key))
            continue
        own: dict[str, torch.Tensor] = {}
        walk_value(target.state_dict(), lambda t, p: own.setdefault(p, t), path=str(key), match=torch.Tensor)
        lazy = any(torch.nn.parameter.is_lazy(t) for t in own.values())  # load_state_dict gives a lazy module its shapes
        if isinstance(target, torch.nn.Module):
            modules[key] = {} if lazy else own
        if not lazy:
            own_of[key] = own
    if modules:
        check_modules_fit(reader, {k: own for k, own in modules.items() if own})
    check_optimizers_fit(reader, {k: t for k, t in targets.items() if isinstance(t, torch.optim.Optimizer)})
    into = split_targets(own_of)
    if not isinstance(top, dict):  # no targets (a dict of targets names top-level entries)
        return reader.materialize()
    # Everything but the modules first: an optimizer or scheduler that refuses its state
    # (another number of parameter groups, say) then leaves the model untouched.
    first = [k for k in top if k not in modules]
    loaded = reader.materialize(first, into) if first else {}
    load_targets(targets, loaded, reader.step)
    if modules:
        loaded.update(reader.materialize(list(modules), into))
        load_targets(targets, loaded, reader.step)
    return {k: loaded[k] for k in top}


def _refuse_nested_targets(value, path: str) -> None:
    """A stateful object below a target's top level is restored by nothing: refused, naming it
    (restore returned without error and left it as it was; audit of stop 38)."""
    if is_stateful(value):
        raise TypeError(f"restore target {path!r} is a {type(value).__name__} below the top level of the targets, "
                        "which restore does not reach; restore it yourself from the loaded state "
                        f"(obj.load_state_dict(store.load(step)[...])), or save it as a top-level entry")
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_nested_targets(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _refuse_nested_targets(v, f"{path}.{i}")


def load_targets(targets: dict, loaded: dict, step: int) -> None:
    """Hand each stateful target its loaded state (once), and put the target in its place.
    A target that refuses its state is named in a StateMismatchError."""
    for key, target in targets.items():
        if is_stateful(target) and key in loaded and loaded[key] is not target:
            try:
                target.load_state_dict(loaded[key])
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise StateMismatchError(f"restore target {key!r} refused the state of checkpoint step {step}: "
                                         f"{exc}") from exc
            loaded[key] = target


def check_modules_fit(reader: CheckpointReader, modules: dict) -> None:
    """Refuse, before any byte is decoded into them, module targets whose tensors
    load_state_dict would refuse (a missing or unexpected name, another shape): a failed
    restore must leave the model as it was."""
    for key, own in modules.items():
        theirs = {path: leaf.node for path, leaf in reader.tensor_leaves([key]).items()}
        missing = sorted(set(own) - set(theirs))
        unexpected = sorted(set(theirs) - set(own))
        shapes = sorted(p for p in set(own) & set(theirs)  # a module's extra state may change its shape
                        if list(own[p].shape) != theirs[p]["shape"] and "_extra_state" not in p.split("."))
        if missing or unexpected or shapes:
            what = "; ".join(f"{label}: {', '.join(paths[:5])}{' ...' if len(paths) > 5 else ''}"
                             for label, paths in (("not in the checkpoint", missing),
                                                  ("not in the module", unexpected),
                                                  ("of another shape", shapes)) if paths)
            raise StateMismatchError(f"{key!r} does not fit checkpoint step {reader.step} ({what}); nothing was "
                                     "restored")


def check_optimizers_fit(reader: CheckpointReader, optimizers: dict) -> None:
    """Refuse, before any byte is decoded into them, optimizer targets whose parameter groups
    differ from the checkpoint's in number or size, as Optimizer.load_state_dict would: the
    optimizer's state tensors are decoded into in place, so a refusal after the decode left
    them overwritten with a state the optimizer never took (audit of stop 38)."""
    for key, optimizer in optimizers.items():
        prefix = f"{path_join('', key)}.param_groups."
        sizes: dict[int, int] = {}
        for leaf in reader.leaves([key]):
            group, _, rest = leaf.path[len(prefix):].partition(".") if leaf.path.startswith(prefix) else ("", "", "")
            if group.isdigit():
                sizes.setdefault(int(group), 0)
                if rest.startswith("params.") and not leaf.is_tensor:
                    sizes[int(group)] += 1
        theirs = [sizes.get(i, 0) for i in range(max(sizes) + 1)] if sizes else None
        mine = [len(group["params"]) for group in optimizer.param_groups]
        if theirs is None:
            why = "it holds no param_groups: not an optimizer's state"
        elif len(theirs) != len(mine):
            why = f"loaded state dict has a different number of parameter groups ({len(theirs)}, the optimizer {len(mine)})"
        elif theirs != mine:
            why = f"parameters per group {theirs}, the optimizer's {mine}"
        else:
            continue
        raise StateMismatchError(f"restore target {key!r} does not fit checkpoint step {reader.step}: {why}; "
                                 "nothing was restored")


def split_targets(own_of: dict) -> dict:
    """Per target key, the tensors to decode into, minus each one whose memory an earlier one
    (of any target) shares: two decodes must never write the same bytes at once."""
    flat = {(key, path): t for key, own in own_of.items() for path, t in own.items()}
    kept = tensors.without_shared_memory(flat)
    out: dict = {}
    for (key, path), t in kept.items():
        out.setdefault(key, {})[path] = t
    return out
