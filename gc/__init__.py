"""cas.gc: retention policies and mark-and-sweep garbage collection over the store's graph."""

from .collect import GcReport, Marker, collect, sweep
from .retention import Retention, parse_best, parse_duration

__all__ = ["GcReport", "Marker", "Retention", "collect", "parse_best", "parse_duration", "sweep"]
