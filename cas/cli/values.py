"""A checkpoint's non-tensor state from the command line: `cas show STEP --values` lists every
value (step, scheduler, scaler, sampler position, RNG states, the user's own) with its dotted key,
and `cas cat STEP KEY` prints one value, a tensor's summary, or everything under a key.

Rows come from walking the manifest (nodes only; a tensor's bytes are read only when `cat`
names it). A list or tuple of plain values (a scheduler's `base_lrs`, Python's RNG state) is one
row, and an empty container is a row of its own, so that no value of the state goes unlisted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cas.errors import CheckpointNotFoundError, CorruptionError
from cas.store.tree import path_join
from cas.store.values import Ref

from .base import EXIT_OK, command, emit_json, human, parse_step, print_checkpoint

TEXT_WIDTH = 100  # `show --values` shortens a longer value; `cat` prints it whole


@dataclass(frozen=True)
class Row:
    """One leaf of a checkpoint's state: a plain value, or a tensor (its manifest node)."""

    key: str
    value: object = None
    tensor: dict | None = None


def rows(reader) -> list[Row]:
    """Every leaf of the checkpoint's state in state order, with its dotted key."""
    out: list[Row] = []
    _walk(reader, reader.top(), "", out)
    return out


def _walk(reader, value, key: str, out: list[Row]) -> None:
    if isinstance(value, Ref):
        node = reader.node(value, path=key)
        if node["k"] == "tensor":
            out.append(Row(key, tensor=node))
        elif node["k"] == "value":
            _walk(reader, node["v"], key, out)
        else:  # as the reader's own walk says it: damage, not a KeyError
            raise CorruptionError("a commit node appears inside a state tree", key=value.key.hex(),
                                  step=reader.step, path=key)
    elif isinstance(value, dict) and value:
        for k, v in value.items():
            _walk(reader, v, path_join(key, k), out)
    elif isinstance(value, (list, tuple)) and value and not all(_plain(v) for v in value):
        for i, v in enumerate(value):
            _walk(reader, v, path_join(key, i), out)
    else:
        out.append(Row(key, value))


def _plain(value) -> bool:
    return not isinstance(value, (dict, list, tuple, Ref))


def type_name(value) -> str:
    if isinstance(value, np.generic):
        return f"numpy.{value.dtype.name}"
    return "None" if value is None else type(value).__name__


def to_json(value):
    """A plain value as JSON: bytes as hex, numpy scalars as numbers, tuples as lists, complex
    numbers as [real, imaginary]; emit_json writes NaN and infinities as strings."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, complex):
        return [value.real, value.imag]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def text(value) -> str:
    """A plain value as one line, as Python writes it (bytes as hex, a numpy scalar as its number)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, np.generic):
        return str(value.item())
    return repr(value)


def shortened(line: str, width: int = TEXT_WIDTH) -> str:
    return line if len(line) <= width else line[:width - 5] + " ..."


def tensor_summary(node: dict) -> dict:
    """What a tensor is, from its manifest node alone (no bytes read)."""
    return {"type": "tensor" if node["lib"] == "torch" else "ndarray", "dtype": node["dtype"],
            "shape": list(node["shape"]), "bytes": node["nbytes"], "chunks": len(node["chunks"])}


def tensor_stats(t) -> dict:
    """min, max, mean and the first values of a decoded tensor or array (every chunk verified);
    none for a dtype torch cannot compute with (float4, bits), whose summary stands alone."""
    import torch

    if not isinstance(t, torch.Tensor):
        a = np.asarray(t)
        t = torch.from_numpy(np.ascontiguousarray(a.astype(a.dtype.newbyteorder("="))))
    flat = t.detach().reshape(-1)
    try:
        out: dict = {"first": to_json(flat[:8].tolist())}
        if flat.numel() and not flat.is_complex():
            exact = not flat.is_floating_point() and flat.dtype != torch.uint64  # ints stay exact
            wide = flat.to(torch.int64) if exact else flat.to(torch.float64)
            out.update(min=wide.min().item(), max=wide.max().item(), mean=wide.to(torch.float64).mean().item())
    except (RuntimeError, TypeError):
        return {}
    return out


def row_json(row: Row) -> dict:
    if row.tensor is not None:
        return {"key": row.key, **tensor_summary(row.tensor)}
    return {"key": row.key, "type": type_name(row.value), "value": to_json(row.value)}


def row_text(row: Row) -> tuple[str, str]:
    """(type, value) columns of a row."""
    if row.tensor is not None:
        s = tensor_summary(row.tensor)
        return s["type"], f"{s['dtype']} {tuple(s['shape'])} {human(s['bytes'])}"
    return type_name(row.value), text(row.value)


def print_rows(found: list[Row], *, width: int | None = TEXT_WIDTH) -> None:
    keys = max((len(r.key) for r in found), default=3)
    print(f"{'key':{keys}}  {'type':14}  value")
    for row in found:
        kind, value = row_text(row)
        print(f"{row.key:{keys}}  {kind:14}  {shortened(value, width) if width else value}")


def show_values(store, ck, args) -> int:
    """`cas show STEP --values`: every non-tensor value with its dotted key."""
    found = [r for r in rows(store.reader(ck.step)) if r.tensor is None]
    if args.json:
        emit_json({"checkpoint": ck.to_json(), "values": [row_json(r) for r in found]})
        return EXIT_OK
    print_checkpoint(ck)
    print(f"\n{len(found)} non-tensor values (`cas cat {ck.step} KEY` prints one whole; `cas show {ck.step}` lists "
          "the tensors)\n")
    print_rows(found)
    return EXIT_OK


def lookup(found: list[Row], key: str) -> tuple[Row | None, list[Row]]:
    """The row `key` names, or the rows under it (`key.`...), or an item of a row that holds a
    list or tuple (`base_lrs.0`)."""
    for row in found:
        if row.key == key:
            return row, []
    under = [r for r in found if r.key.startswith(key + ".") or not key]
    if under:
        return None, under
    for row in found:
        if row.tensor is None and isinstance(row.value, (list, tuple)) and key.startswith(row.key + "."):
            value = row.value
            try:
                for part in key[len(row.key) + 1:].split("."):
                    value = value[int(part)]
            except (ValueError, IndexError, TypeError):
                break
            return Row(key, value), []
    return None, []


def _add_cat(p) -> None:
    p.add_argument("step", type=parse_step)
    p.add_argument("key", help="a dotted key as `cas show STEP --values` lists it (scheduler.last_epoch, "
                               "loader.position), a tensor's path, or a prefix (scheduler)")
    p.add_argument("--json", action="store_true")


@command("cat", "print one value of a checkpoint (or a tensor's summary, or everything under a key)", _add_cat,
         read_only=True)
def cmd_cat(store, args) -> int:
    reader = store.reader(args.step)
    found = rows(reader)
    row, under = lookup(found, args.key)
    if row is None and not under:
        raise CheckpointNotFoundError(
            f"checkpoint step {reader.step} has no key {args.key!r}; its top-level entries are "
            f"{reader.entries()} (`cas show {reader.step} --values` lists every value)")
    if row is None:
        if args.json:
            emit_json({"step": reader.step, "key": args.key, "values": [row_json(r) for r in under]})
        else:
            print_rows(under, width=None)
        return EXIT_OK
    if row.tensor is not None:
        summary = dict(row_json(row), **tensor_stats(reader.read_tensor(row.key)))
        if args.json:
            emit_json(dict(summary, step=reader.step))
        else:
            print(" ".join(f"{k}={v}" for k, v in summary.items() if k != "key"))
        return EXIT_OK
    if args.json:
        emit_json(dict(row_json(row), step=reader.step))
    else:
        print(text(row.value) if not isinstance(row.value, str) else row.value)
    return EXIT_OK

