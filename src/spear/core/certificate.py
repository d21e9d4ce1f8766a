"""Per-sample certificates from outside the layer: the interface the attack calls.

A layer's gradient alone cannot separate samples that share their ReLU pattern (see
:mod:`spear.core.consistency`). The rest of the model can: a recovered sample ``x_j`` with its
column ``dL/dZ_j`` is genuine only if some label ``y`` gives, through the rest of the network,
a per-sample loss gradient at this layer equal to ``dL/dZ_j`` up to the loss weight of one
sample (1/B for a batch mean). The attack core only sees the interface below; the model-level
implementation lives in :mod:`spear.certify` (it needs the torch model, the core does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

#: loss weights within this (relative) of k/B or of an integer k count as such
WEIGHT_RTOL = 1e-6


@dataclass(frozen=True)
class SampleCertificates:
    """The certificate of k samples.

    Attributes:
        ok: (k,) bool, the sample's column is its per-sample gradient for some label.
        labels: (k,) long, that label (-1 where none fits).
        weights: (k,) the fitted loss weight ``s`` with ``dL/dZ_j = s * grad_z loss(x_j, y)``
            (1/B for a mean over B samples, 1 for a sum; k times that for a sample present k
            times), NaN where none fits.
        misfit: (k,) relative misfit ``|dL/dZ_j - s g| / |dL/dZ_j|`` of the best label.
        strong: (k,) bool, ok and *discriminative*: the other labels' gradients point elsewhere,
            so the fit checks a direction, not only a sign and a scale. With two classes (or a
            rank-one rest of the network) every label's gradient is parallel: mixtures of
            samples that share their activation pattern then fit too, and such a certificate
            cannot stand in for the layer's own (a pinned zero set).
        saturated: (k,) bool, the per-sample gradient hardly changes with the input inside its
            activation region (a saturated softmax): other samples sharing the pattern and label
            have the same column, so one column may stand for several samples. Never strong.
        discriminative: (k,) bool, ok and discriminative, saturated or not (``strong`` is
            ``discriminative & ~saturated``): a saturated sample that shares its pattern with
            no other sample of its label is judged by it (``spear.core.verdict``).
    """

    #: the per-sample fields, in the constructor's order
    FIELDS: ClassVar[tuple[str, ...]] = (
        "ok",
        "labels",
        "weights",
        "misfit",
        "strong",
        "saturated",
        "discriminative",
    )

    ok: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    misfit: torch.Tensor
    strong: torch.Tensor = None  # type: ignore[assignment]  # default: ok
    saturated: torch.Tensor = None  # type: ignore[assignment]  # default: none
    discriminative: torch.Tensor = None  # type: ignore[assignment]  # default: strong

    def __post_init__(self) -> None:
        if self.strong is None:
            object.__setattr__(self, "strong", self.ok.clone())
        if self.saturated is None:
            object.__setattr__(self, "saturated", torch.zeros_like(self.ok))
        if self.discriminative is None:
            object.__setattr__(self, "discriminative", self.strong.clone())

    @classmethod
    def none(cls, k: int, device: torch.device | str = "cpu") -> SampleCertificates:
        """k samples without a certificate."""
        return cls(
            torch.zeros(k, dtype=torch.bool, device=device),
            torch.full((k,), -1, dtype=torch.long, device=device),
            torch.full((k,), math.nan, dtype=torch.float64, device=device),
            torch.full((k,), math.inf, dtype=torch.float64, device=device),
            torch.zeros(k, dtype=torch.bool, device=device),
            torch.zeros(k, dtype=torch.bool, device=device),
            torch.zeros(k, dtype=torch.bool, device=device),
        )


class SampleCertifier(Protocol):
    """Checks recovered samples one by one.

    Called with the samples (k, n) of the attacked layer and their columns of dL/dZ (k, m), in
    the layer's full output width. A certifier whose ``accepts_sample_rtol`` is True is also
    called with ``rtol=`` (k,): per sample, a misfit tolerance looser than its own where the
    data know a column less precisely (the column of a sample whose gradient is faint,
    :func:`spear.core.verdict.sample_tolerances`); it keeps its own where that is larger.

    Optionally, ``rounding(inputs, labels) -> (k,) or None``: the relative rounding error of
    each labelled sample's column as the client computed it. Given, a batch the certifier
    verifies is audited at the data's precision (:func:`spear.core.verdict.audit_precision`).

    Optionally, ``gradients(inputs, labels) -> (k, m)``: the columns the model predicts for k
    labelled samples at unit loss weight. Given, an active entry whose gradient falls below the
    data's zero floor (a *silent* entry, :func:`spear.core.consistency.contradictions`) does not
    hold sigma below 1 when the batch has no other contradiction, reproduces the gradient, and
    the certifier certifies the entry's column and predicts it below the zero band too
    (:func:`spear.core.verdict.model_explains_silent`).

    Optionally, ``per_label_columns(inputs) -> (k, C, m)``: the columns the model predicts for k
    samples under each of its C labels, at unit loss weight. Given, the singleton cascade takes
    a sample whose inactive neurons leave its column a kernel of a few dimensions (a
    near-duplicate's zero set inside its twin's) by the one label whose column lies in that
    kernel (:class:`spear.core.input_peeling.InputSidePeeler`).
    """

    def __call__(self, inputs: torch.Tensor, grad_outputs: torch.Tensor) -> SampleCertificates: ...


@dataclass(frozen=True)
class BatchReduction:
    """How the client's loss combined its samples, read off the fitted weights.

    Attributes:
        reduction: "mean" (weights k_j / B), "sum" (integer weights k_j), or None when the
            weights fit neither (then the other fields are None).
        multiplicities: (b,) how many times each recovered sample occurs in the batch: an exact
            duplicate makes one column (the batch's rank drops by one) with k times the weight.
        batch_size: the client's batch size B, counting duplicates and (for a mean) samples that
            left no trace in this layer; None for a sum.
        missing: B minus the samples recovered (with multiplicity): samples for which every
            neuron of the layer is inactive contribute nothing to its gradient, but a mean's 1/B
            still counts them. None for a sum.
    """

    reduction: str | None
    multiplicities: torch.Tensor | None
    batch_size: int | None
    missing: int | None = None
    #: secure aggregation: each sample's client batch size (read off its weight 1/B_k), None
    #: for a single client
    client_sizes: torch.Tensor | None = None


#: a batch size read off a mean is accepted within this distance of an integer
BATCH_SIZE_ATOL = 0.25


def infer_reduction(weights: torch.Tensor, rtol: float | torch.Tensor = WEIGHT_RTOL) -> BatchReduction:
    """Mean or sum reduction, multiplicities and the client's batch size from the loss weights of
    the b recovered samples (see :class:`BatchReduction`); ``rtol`` is the weights' precision,
    one for all or one per sample (b,): a faint sample's weight is known less precisely.

    Multiplicities are the weights' ratios to the smallest; they must be integers adding up to
    at most twice the samples (so that loose weights cannot match integers by chance)."""
    none = BatchReduction(None, None, None)
    w = weights.detach().double().cpu()
    if w.numel() == 0 or not bool(torch.isfinite(w).all()) or bool((w <= 0).any()):
        return none
    rtol = torch.as_tensor(rtol, dtype=torch.float64).cpu().expand_as(w)
    smallest = int(w.argmin())
    ratio = w / w[smallest]
    k = ratio.round()
    ratio_rtol = rtol + rtol[smallest]
    if not bool(((ratio - k).abs() <= ratio_rtol * ratio).all()) or float(k.sum()) > 2 * w.numel():
        return none
    recovered = int(k.sum())
    size = recovered / float(w.sum())  # a mean has w_j = k_j / B, so B = sum k / sum w
    whole = round(size)
    if (
        abs(size - whole) <= BATCH_SIZE_ATOL
        and whole >= recovered
        and bool(((w * whole - k).abs() <= rtol * k).all())
    ):
        return BatchReduction("mean", k.long(), whole, whole - recovered)
    if bool(((w - w.round()).abs() <= rtol * w).all()) and bool((w.round() >= 1).all()):
        return BatchReduction("sum", w.round().long(), None, None)
    return none


def aggregate_multiples(weights: torch.Tensor, rtol: float | torch.Tensor = WEIGHT_RTOL) -> list[int]:
    """Samples whose weight is an integer multiple (>= 2) of another sample's: under secure
    aggregation a weight ``k/B`` is a sample present k times in a client of B, or one sample of a
    client of ``B/k``; the update cannot tell which, so such batches are not verified. ``rtol``:
    the weights' precision, one for all or one per sample (b,); a ratio of two weights is known
    to the sum of theirs."""
    w = weights.detach().double().cpu()
    if w.numel() == 0 or not bool(torch.isfinite(w).all()) or bool((w <= 0).any()):
        return []
    rtol = torch.as_tensor(rtol, dtype=torch.float64).cpu().expand_as(w)
    ratio = w[:, None] / w[None, :]
    whole = ratio.round()
    multiple = (whole >= 2) & ((ratio - whole).abs() <= (rtol[:, None] + rtol[None, :]) * ratio)
    return multiple.any(dim=1).nonzero()[:, 0].tolist()


def infer_batch(
    weights: torch.Tensor, clients: int, rtol: float | torch.Tensor = WEIGHT_RTOL
) -> BatchReduction:
    """The reduction the weights read as: one client's loss (:func:`infer_reduction`), or the
    sum of ``clients`` clients' mean losses under secure aggregation (:func:`infer_aggregate`)."""
    return infer_aggregate(weights, clients, rtol) if clients > 1 else infer_reduction(weights, rtol)


def infer_aggregate(
    weights: torch.Tensor, clients: int, rtol: float | torch.Tensor = WEIGHT_RTOL
) -> BatchReduction:
    """The reduction of a sum of ``clients`` clients' mean losses (secure aggregation): sample j
    of a client with B_k samples has weight ``1 / B_k``.

    Each weight must be the inverse of an integer; the samples with weight ``1/B`` need at least
    ``ceil(n_B / B)`` clients, and all of them together at most ``clients``. ``missing`` counts
    the samples those clients hold beyond the recovered ones (they left no trace in the layer);
    it is None when fewer clients than ``clients`` are seen (a client's whole batch may be
    invisible). Exact duplicates inside one client (weight ``2/B``) read as a client of ``B/2``
    samples; :func:`aggregate_multiples` finds such weights, which the verdict refuses. ``rtol``:
    the weights' precision, one for all or one per sample (b,). A weight whose precision leaves
    two client sizes possible (``1/B`` and ``1/(B + 1)`` within it: a confident sample's weight
    read to 1e-2 in a client of 50 or more) pins none, and the reduction is not determined.
    """
    none = BatchReduction(None, None, None)
    w = weights.detach().double().cpu()
    if w.numel() == 0 or not bool(torch.isfinite(w).all()) or bool((w <= 0).any()):
        return none
    rtol = torch.as_tensor(rtol, dtype=torch.float64).cpu().expand_as(w)
    sizes = 1.0 / w
    whole = sizes.round()
    if not bool(((sizes - whole).abs() <= rtol * sizes).all()) or bool((whole < 1).any()):
        return none
    possible = torch.floor(sizes * (1 + rtol)) - torch.ceil(sizes * (1 - rtol)) + 1
    if bool((possible > 1).any()):
        return none
    needed, held = 0, 0
    for size in whole.unique().tolist():
        count = int((whole == size).sum())
        groups = -(-count // int(size))
        needed += groups
        held += groups * int(size)
    if needed > clients:
        return none
    missing = held - w.numel() if needed == clients else None
    ones = torch.ones(w.numel(), dtype=torch.long)
    return BatchReduction("mean", ones, None, missing, whole.long())
