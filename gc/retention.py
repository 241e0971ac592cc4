"""Retention: which checkpoints to keep, declared once as a small policy object.

A checkpoint is kept when any rule keeps it (union). Pins always win, and the newest
checkpoint is always kept. A policy with no rule removes nothing (it is not "keep nothing"), and
a keep_best whose metric no checkpoint scores is refused: either would otherwise remove every
checkpoint but the newest, milestones and bests included. The names mirror the CLI flags
(`--keep-last 5` is keep_last=5) and orbax's CheckpointManager options.
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from typing import Iterable

from cas.errors import CasError, RetentionRefusedError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str | _dt.timedelta) -> _dt.timedelta:
    """'90s', '30m', '12h', '2d', '1w' (or a timedelta) -> timedelta."""
    if isinstance(text, _dt.timedelta):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", str(text))
    if not m:
        raise CasError(f"not a duration: {text!r} (use a number and a unit: s, m, h, d or w, e.g. 2d)")
    try:
        return _dt.timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
    except OverflowError:
        raise CasError(f"duration too long: {text!r} (at most {_dt.timedelta.max.days} days)") from None


def parse_best(text: str | tuple) -> tuple[str, str, int]:
    """'val_loss:min:2' (or a tuple) -> ("val_loss", "min", 2)."""
    parts = tuple(text.rsplit(":", 2)) if isinstance(text, str) else tuple(text)
    if len(parts) != 3:
        raise CasError(f"keep_best needs metric, min|max and a count, e.g. val_loss:min:2; got {text!r}")
    metric, mode, count = parts
    try:
        count = int(count)
    except (TypeError, ValueError):
        raise CasError(f"keep_best count must be an integer, got {count!r}") from None
    if mode not in ("min", "max") or count < 1 or not metric:
        raise CasError(f"keep_best needs a metric name, min or max, and a count >= 1; got {text!r}")
    return str(metric), mode, count




@dataclass(frozen=True)
class Retention:
    keep_last: int | None = None
    keep_milestones: bool = False
    keep_every: int | None = None
    keep_best: tuple | str | None = None  # (metric, "min"|"max", N)
    keep_within: _dt.timedelta | str | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < (0 if name == "keep_last" else 1)):
                raise CasError(f"{name} must be a {'non-negative' if name == 'keep_last' else 'positive'} "
                               f"integer, got {value!r}")
        if self.keep_best is not None:
            object.__setattr__(self, "keep_best", parse_best(self.keep_best))
        if self.keep_within is not None:
            object.__setattr__(self, "keep_within", parse_duration(self.keep_within))

    @property
    def has_rules(self) -> bool:
        return (self.keep_last is not None or self.keep_milestones or self.keep_every is not None
                or self.keep_best is not None or self.keep_within is not None)

    def decide(self, checkpoints: Iterable, now: _dt.datetime | None = None) -> dict[int, list[str]]:
        """Step -> the rules that keep it, for every checkpoint; an empty list means remove.
        "Last" and "newest" follow commit order (the record log), not steps: after a rollback
        (step 200 restored, 210 saved after 400), the new line's checkpoints are the last ones,
        so retention never removes the checkpoint a save just committed. Raises
        RetentionRefusedError when keep_best's metric scores no checkpoint."""
        cks = sorted(checkpoints, key=lambda c: (c.seq, c.step))
        if not self.has_rules:
            return {ck.step: ["no rule"] for ck in cks}
        now = now or _dt.datetime.now(_dt.timezone.utc)
        reasons: dict[int, list[str]] = {ck.step: [] for ck in cks}
        if self.keep_last:
            for ck in cks[-self.keep_last:]:
                reasons[ck.step].append(f"last {self.keep_last}")
        if self.keep_best is not None:
            metric, mode, count = self.keep_best
            scored = _scored(cks, metric)
            scored.sort(key=lambda c: (c.metrics[metric] if mode == "min" else -c.metrics[metric], -c.step))
            for ck in scored[:count]:
                reasons[ck.step].append(f"best {count} {metric} ({mode})")
        for ck in cks:
            why = reasons[ck.step]
            if self.keep_milestones and ck.milestone:
                why.append("milestone")
            if self.keep_every and ck.step % self.keep_every == 0:
                why.append(f"every {self.keep_every}")
            if self.keep_within is not None and now - ck.created <= self.keep_within:
                why.append(f"within {self.keep_within}")
            if ck.pinned:
                why.append("pinned")
        if cks and not reasons[cks[-1].step]:
            reasons[cks[-1].step].append("newest")
        return reasons


UNMIRRORED = "not mirrored yet"


def keep_unmirrored(checkpoints: Iterable, decisions: dict[int, list[str]]) -> list[int]:
    """Keep every checkpoint no rule keeps that is not yet in the store's mirror (a store opened
    with mirror=): retention never removes the only copy. Returns the steps so held."""
    held = [ck.step for ck in checkpoints if not decisions[ck.step] and not ck.mirrored]
    for step in held:
        decisions[step].append(UNMIRRORED)
    return held


def _is_score(value) -> bool:
    """A number keep_best can rank: NaN (a diverged evaluation) is not one."""
    return isinstance(value, (int, float)) and value == value


def _scored(cks: list, metric: str) -> list:
    """The checkpoints with a score for `metric`. None of them (a misspelt name, or no evaluation
    logged yet) is refused: ranking nothing would keep no best and remove them all."""
    scored = [ck for ck in cks if _is_score(ck.metrics.get(metric))]
    if cks and not scored:
        present = sorted({name for ck in cks for name in ck.metrics})
        raise RetentionRefusedError(
            f"keep_best names the metric {metric!r}, which no checkpoint has a score for (metrics the "
            f"checkpoints carry: {', '.join(present) or 'none'}); nothing was removed: fix the metric's name, "
            "or wait until a checkpoint logs it")
    return scored
