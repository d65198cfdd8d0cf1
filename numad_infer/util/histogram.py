"""A Prometheus-style histogram: cumulative-ready bucket counts, their sum and count.
Pure: the front door's request log fills them, the status carries them, the metrics
endpoint exposes them as `_bucket{le=...}`, `_sum`, `_count`."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds. A first token on a CPU takes from tens of milliseconds (a short prompt on a warm
# instance) to minutes (a long prompt queued behind others); a whole answer, longer still.
TIME_TO_FIRST_TOKEN_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REQUEST_DURATION_BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class Histogram:
    bounds: tuple[float, ...]  # upper bounds, ascending; +Inf is implied
    counts: tuple[int, ...]  # per bucket, not cumulative; one more than bounds (the +Inf bucket)
    sum: float = 0.0
    count: int = 0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(bounds, (0,) * (len(bounds) + 1))

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count of observations <= le), +Inf last: Prometheus's buckets."""
        out, total = [], 0
        for bound, count in zip((*map(_le, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


@dataclass
class Recorder:
    """A histogram being filled (one thread writes; readers take `snapshot()`)."""
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le = "less or equal").
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> Histogram:
        return Histogram(self.bounds, tuple(self.counts), self.sum, self.count)
