"""Adversarial batches: constructions that put a known weakness of exact recovery under load,
and the client conditions that go with them.

The batches are plain tensors (the true inputs) for a caller to build a client around; they
are the review cases the project measures itself against (``benchmarks/bench_small_values.py``,
``tests/test_released.py``).
"""

from __future__ import annotations

import torch


def small_value_batch(
    eps: float, c: float, delta: float, seed: int, features: int = 60, batch_size: int = 8
) -> tuple[torch.Tensor, int, int]:
    """Sparse non-negative inputs (batch_size, features; float64, half their entries zero)
    where sample 0 holds ``eps`` of its largest at one of its zeros ``f`` (inside float32's zero
    band for ``eps`` < 1e-4) and sample 1 vanishes on sample 0's zeros except ``f`` (``c`` of
    its largest) and one more, ``g`` (``delta``); the inputs, ``f`` and ``g``. The mixture
    ``x_0 - (eps / c) x_1`` reads the same zero set as ``x_0`` (:mod:`spear.core.released`).
    Seeds torch's global generator with ``seed``, so that a model built right after it is
    reproducible too."""
    torch.manual_seed(seed)
    X = torch.rand(batch_size, features, dtype=torch.float64)
    X[torch.rand(batch_size, features) < 0.5] = 0.0
    zeros = (X[0] == 0).nonzero()[:, 0]
    f, g = int(zeros[0]), int(zeros[1])
    X[1, zeros] = 0.0
    X[1, f], X[1, g] = c * X[1].max(), delta * X[1].max()
    X[0, f] = eps * X[0].max()
    return X, f, g


def make_confident(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    index: int,
    loss_below: float = 1e-3,
    max_steps: int = 2000,
    lr: float = 0.5,
) -> int:
    """Train ``model`` in place (SGD on sample ``index`` alone) until its cross-entropy is below
    ``loss_below`` (p = 0.999 by default): a confident sample, whose column of dL/dZ is faint and
    leaves the batch not resolvable for its rounding. Returns the steps taken."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(max_steps):
        loss = torch.nn.functional.cross_entropy(model(inputs[[index]]), labels[[index]])
        if loss.item() < loss_below:
            return step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return max_steps


__all__ = ["make_confident", "small_value_batch"]
