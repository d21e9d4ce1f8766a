"""Exceptions raised by spear-fl.

Every error the library raises on purpose derives from :class:`SpearError`, so callers can catch
one type. Each message names what is wrong and what to do about it.
"""

from __future__ import annotations


class SpearError(Exception):
    """Base class of every error raised by spear-fl."""


class InputError(SpearError, ValueError):
    """An argument has the wrong shape, type, dtype or value (NaN/Inf, all zeros, ...)."""


class RankError(SpearError):
    """The weight gradient's rank does not allow an exact reconstruction.

    SPEAR needs the batch size ``b`` to be smaller than both the layer's output width ``m`` and
    its input width ``n`` (Theorem 3.1: ``rank(dL/dW) = b <= min(m, n)``). A full-rank gradient
    means the batch is at least as large as the layer, so the batch size cannot be read off.
    """


class NoSparsityError(SpearError):
    """No ReLU-sparse direction was found although theory says one should have been.

    Raised when the proposal budget was large enough (several times Lemma 5.1's expected wait
    for one sparse direction) and no proposal passed the sparsity filter. The layer's output
    gradient is then not ReLU-sparse: the layer is not followed by a ReLU, or the gradient was
    perturbed (noise, compression) so that its zeros are gone.
    """


class TheoryError(SpearError, ValueError):
    """Parameters outside the domain of a theoretical bound (Section 5.2, Appendix A)."""


class SpearWarning(UserWarning):
    """Base class of every warning spear-fl issues."""


class OversubscribedWarning(SpearWarning):
    """The machine runs more threads than it has cores, so attacks with a time budget run on
    one thread (:func:`spear.api.budget_threads`).

    torch's OpenMP threads spin while they wait for each other; when other processes take
    their cores, one linear-algebra call can take 10-100x its idle time (measured: a 4000 x 784
    SVD, 0.4 s idle, 25 s beside two other 2-thread processes on 2 cores), and a deadline can
    only be checked between such calls, so the budget would overrun. On one thread nothing
    spins. ``OMP_WAIT_POLICY=PASSIVE`` (set before torch is imported) keeps the user's threads
    and avoids it too.
    """
