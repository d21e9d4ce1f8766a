"""The verdict on a selection of b directions: recomputed gradients, ReLU consistency both
ways, determinacy, and (with a model) one certificate per sample.

``verified`` is the product's promise, so it is granted at exactly two levels:

* **model**: every sample ``x_j`` with its column ``dL/dZ_j`` is certified on its own through
  the rest of the network (:mod:`spear.core.certificate`), which also gives its label;
* **layer**: without a model, the recomputed gradients match, the ReLU pattern matches both
  ways (sigma = 1 within the tolerances of :mod:`spear.core.consistency`) and every column is
  pinned by its zero set, so the batch is the only consistent one (for gradients in general
  position, and for samples whose columns of dL/dZ are linearly independent: the rank of
  dL/dW is the batch size). When a model certificate is in use, it alone verifies: a sample it
  cannot certify leaves the batch unverified even if the layer pins it.

A consistent batch that is not determined is reported with its ambiguous groups and never
called exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from spear.core.certificate import (
    WEIGHT_RTOL,
    BatchReduction,
    SampleCertificates,
    SampleCertifier,
    infer_reduction,
)
from spear.core.consistency import Determinacy, Tolerances, ambiguous_groups
from spear.core.filtering import zero_mask
from spear.core.greedy import Selection
from spear.core.verify import Verification

#: layer-pinned samples that must fail the model certificate, with none passing it, before the
#: certificate is judged not to apply to this model (another loss, dropout, batch norm, ...)
MODEL_CALIBRATION = 3


class ModelGate:
    """Runs an optional :class:`SampleCertifier` and notices when it cannot apply.

    A certificate that rejects samples the layers already pin down, and has never accepted one,
    assumes the wrong loss or model; it is then switched off (``note`` says why) rather than
    allowed to throw away correct samples.
    """

    def __init__(self, certifier: SampleCertifier | None) -> None:
        self.certifier = certifier
        self.passed = 0
        self.failed_pinned = 0
        self.seconds = 0.0
        self.note: str | None = None

    @property
    def active(self) -> bool:
        return self.certifier is not None and self.note is None

    def check(
        self, inputs: torch.Tensor, grad_outputs: torch.Tensor, pinned: torch.Tensor
    ) -> SampleCertificates | None:
        """Certificates of k samples (inputs (k, n), dL/dZ columns (k, m)); None when off."""
        if not self.active or inputs.shape[0] == 0:
            return None
        assert self.certifier is not None
        start = time.perf_counter()
        cert = self.certifier(inputs, grad_outputs)
        self.seconds += time.perf_counter() - start
        self.passed += int(cert.ok.sum())
        self.failed_pinned += int((~cert.ok & pinned.to(cert.ok.device)).sum())
        if self.passed == 0 and self.failed_pinned >= MODEL_CALIBRATION:
            self.note = (
                f"model certificate switched off: {self.failed_pinned} samples that this layer pins "
                "down fit no label's per-sample gradient through the rest of the model (another loss "
                "than cross-entropy, dropout or batch statistics in the model?)"
            )
            return None
        return cert


@dataclass
class Verdict:
    """Everything decided about one selection (see the module doc)."""

    inputs: torch.Tensor
    grad_outputs: torch.Tensor  # (m, b), full layer width
    check: Verification
    consistent: bool  # gradients reproduced and sigma = 1
    determinacy: Determinacy
    certificates: SampleCertificates | None
    reduction: BatchReduction
    verified_by: str | None  # "model", "layer" or None
    reject: list[int]  # positions of the selection the model shows to be wrong

    @property
    def verified(self) -> bool:
        return self.verified_by is not None

    @property
    def labels(self) -> torch.Tensor | None:
        if self.certificates is None:
            return None
        return torch.where(self.certificates.ok, self.certificates.labels, -1)


def judge(
    selection: Selection,
    sparse_factor: torch.Tensor,
    certified: torch.Tensor,
    assembled: tuple[torch.Tensor, torch.Tensor],
    check: Verification,
    tol: Tolerances,
    gate: ModelGate,
    known: SampleCertificates | None = None,
) -> Verdict:
    """The verdict on ``selection`` (whose columns ``certified`` were peeled and certified one
    by one), given its assembled inputs and full-width dL/dZ and their gradient check.
    ``known`` holds model certificates already issued for some columns (where ``ok``): only
    the others are checked again."""
    inputs, grad_outputs = assembled
    zero = zero_mask((sparse_factor @ selection.Qbar).T, tol.zero_rtol)
    determinacy = ambiguous_groups(sparse_factor, selection.Qbar.T, zero, certified)
    pinned = determinacy.pinned | certified
    consistent = check.verified and selection.perfect
    cert = _certify_rest(gate, inputs, grad_outputs.T, pinned, known) if consistent else None
    verified_by = None
    reduction = BatchReduction(None, None, None)
    reject: list[int] = []
    if cert is not None:
        if bool(cert.ok.all()):
            verified_by = "model"
            reduction = infer_reduction(cert.weights, max(WEIGHT_RTOL, 10 * tol.verify_rtol))
        reject = (~cert.ok & ~pinned).nonzero()[:, 0].tolist()
    if cert is None and not gate.active and consistent and determinacy.determined:
        verified_by = "layer"  # with a model, only the model's certificate verifies
    return Verdict(
        inputs, grad_outputs, check, consistent, determinacy, cert, reduction, verified_by, reject
    )


def _certify_rest(
    gate: ModelGate,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    pinned: torch.Tensor,
    known: SampleCertificates | None,
) -> SampleCertificates | None:
    """Model certificates of all columns, reusing the ``known`` ones."""
    if known is None or not bool(known.ok.any()):
        return gate.check(inputs, grad_outputs, pinned)
    todo = (~known.ok).nonzero()[:, 0]
    fresh = gate.check(inputs[todo], grad_outputs[todo], pinned[todo]) if todo.numel() else None
    if todo.numel() and fresh is None:
        return None
    merged = SampleCertificates(*(t.clone() for t in (known.ok, known.labels, known.weights, known.misfit)))
    if fresh is not None:
        for name in ("ok", "labels", "weights", "misfit"):
            getattr(merged, name)[todo] = getattr(fresh, name).to(getattr(merged, name))
    return merged


def verdict_message(verdict: Verdict, b: int, has_model: bool) -> str:
    """The one-line summary of a verdict on a complete selection."""
    residual = verdict.check.residual
    if verdict.verified_by == "model":
        text = (
            f"exact: all {b} inputs recovered, each certified through the model with its label "
            f"(gradient residual {residual:.1e})"
        )
        mult = verdict.reduction.multiplicities
        if mult is not None and bool((mult > 1).any()):
            repeated = (mult > 1).nonzero()[:, 0].tolist()
            text += f"; sample(s) {repeated} occur {mult[repeated].tolist()} times (exact duplicates)"
        if verdict.reduction.missing:
            text += (
                f"; the client's batch holds {verdict.reduction.batch_size} samples (mean loss): "
                f"{verdict.reduction.missing} left no trace in this layer (no active neuron) and "
                "cannot be recovered from it"
            )
        return text
    if verdict.verified_by == "layer":
        return (
            f"exact: all {b} inputs recovered and verified by this layer's gradient (residual "
            f"{residual:.1e}; every sample pinned by its zero set)"
        )
    if verdict.certificates is not None:
        unfit = (~verdict.certificates.ok).nonzero()[:, 0].tolist()
        return (
            f"consistent but not certified: the model singles out no label for sample(s) {unfit} "
            "(several labels fit: the rest of the network cannot tell them apart; or none: e.g. "
            "samples this layer cannot separate, or a duplicated input with different labels)"
        )
    reasons = "; ".join(verdict.determinacy.reasons)
    hint = "" if has_model else "; attack_layer with the model can certify samples one by one"
    return f"consistent but not determined: {reasons}{hint}"
