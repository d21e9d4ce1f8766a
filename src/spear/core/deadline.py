"""A time budget as a promise: one clock every long-running stage consults.

The attack's loop checks the time budget before every step, but a single step (a proposer's
call, snapping a large batch of candidates, peeling them, a greedy sweep) can take seconds on
a wide layer. Each of those stages takes the attack's :class:`Deadline` and stops between its
chunks once it has passed, so that a run ends within a small fraction of its budget. Work cut
short is lost, never half-applied: a stage returns what it finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    """A point in ``time.perf_counter()`` time, or none (``at=None``: never passes)."""

    at: float | None = None

    @classmethod
    def after(cls, seconds: float | None, start: float | None = None) -> Deadline:
        """The deadline ``seconds`` after ``start`` (default: now); none for ``seconds=None``."""
        if seconds is None:
            return cls(None)
        return cls((time.perf_counter() if start is None else start) + seconds)

    def passed(self) -> bool:
        return self.at is not None and time.perf_counter() >= self.at

    def seconds_left(self) -> float | None:
        """Seconds until the deadline (negative once passed); None when there is none."""
        return None if self.at is None else self.at - time.perf_counter()


#: a deadline that never passes
NEVER = Deadline(None)
