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
