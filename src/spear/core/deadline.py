"""A time budget as a promise: one clock every long-running stage consults.

The attack's loop checks the time budget before every step, but a single step (a proposer's
call, snapping a large batch of candidates, peeling them, a greedy sweep) can take seconds on
a wide layer. Each of those stages takes the attack's :class:`Deadline` and stops between its
chunks once it has passed, so that a run ends within a small fraction of its budget. Work cut
short is lost, never half-applied: a stage returns what it finished.

A few units cannot be cut into chunks: one LAPACK call (the SVD of a 1000 x 3072 gradient
takes 2 s on one thread) cannot be stopped once started. :func:`finish_by` runs such a unit on
a worker thread and waits for it only until the deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


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


class LateError(Exception):
    """Raised by :func:`finish_by` when its deadline passed before the work was done."""


#: the completion events of work that ended late and may still run (see :func:`finish_by`)
_still_running: list[threading.Event] = []
_registry = threading.Lock()


def finish_by(deadline: Deadline, work: Callable[[], T]) -> T:
    """``work()``, or :class:`LateError` as soon as ``deadline`` passes with it unfinished.

    For units that cannot be cut (one SVD, the attack's setup). Without a deadline the work runs
    here. With one it runs on a worker thread that takes the caller's torch thread count (the
    same bits as run here) and grad mode, and the caller waits for it until the deadline at
    most. Late work cannot be stopped: it runs to its end on that thread and its result is
    dropped, so ``work`` must not change shared state (return what it computed, and let the
    caller store it). Exceptions from ``work`` are raised here.

    Late work still running from an earlier call is waited for first, within this deadline: it
    would compete for the cores (review 46b: after three 1 s attacks cut in their setup, a 2.5 s
    attack that recovers its batch alone was cut in its own). The wait is on an event, not on
    the thread: Ctrl-C during ``Thread.join`` marked the running worker finished, Python's exit
    then did not wait for it, and the interpreter aborted inside its LAPACK call (review 46b;
    for the same reason the worker is not a daemon thread)."""
    if deadline.at is None:
        return work()
    with _registry:
        _still_running[:] = [done for done in _still_running if not done.is_set()]
        earlier = list(_still_running)
    for done in earlier:
        if not done.wait(_left(deadline)):
            raise LateError
    if deadline.passed():
        raise LateError
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    outcome: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        torch.set_num_threads(threads)  # a new thread's LAPACK would take the default count
        try:
            with torch.set_grad_enabled(grad):
                outcome["value"] = work()
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="spear-uncut-work").start()
    if not done.wait(_left(deadline)):
        with _registry:
            _still_running.append(done)
        raise LateError
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def _left(deadline: Deadline) -> float:
    return max(0.0, deadline.seconds_left() or 0.0)
