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
called exact. A batch the model verifies is audited at the precision its data have
(:func:`audit_precision`): a dtype's tolerance is set by its faintest samples, and must not
hide a mixture among the precise ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from spear.core.certificate import (
    BatchReduction,
    SampleCertificates,
    SampleCertifier,
    aggregate_multiples,
    infer_batch,
    infer_reduction,
)
from spear.core.consistency import Determinacy, Tolerances, ambiguous_groups, rounding_map
from spear.core.deadline import NEVER, Deadline
from spear.core.filtering import rounding_error, zero_mask
from spear.core.greedy import Selection
from spear.core.verify import Verification

#: loss weights must fit k/B (or integers) to this many times a sample's misfit tolerance. A
#: weight off by delta scales the sample's column by 1 + delta and its input by about
#: 1 / (1 + delta) (their product is the sample's term of dL/dW), so a weight looser than the
#: tolerance lets a wrong input through: float32 MLP 4 x 400 trained 200 steps, b = 32, seed 0
#: was verified with a weight 1.0077 / B and that sample 1.4e-3 off (the others fit to 1e-4)
WEIGHT_PRECISION = 1
#: a column known to a relative precision p (its rounding error over its norm,
#: :func:`column_precision`) is certified to a misfit of this many times p, when that exceeds
#: the verification tolerance (measured: the two faint samples of Fashion-MNIST b = 256 in the
#: LT setting have columns right to 1e-8, where p is 1e-6) ...
PRECISION_SLACK = 10.0
#: ... but never looser than this: a column known only more coarsely is too faint to certify
#: (a misfit near 1 checks nothing, and loss weights of 1 and 2 samples must stay apart). In
#: float32 and half precisions the verification tolerance is already looser: no change there
LOOSEST_SAMPLE_RTOL = 1e-4


def explained_misfits(
    directions: torch.Tensor,
    sparse_factor: torch.Tensor,
    rounding: torch.Tensor | None,
    verify_rtol: float,
) -> torch.Tensor:
    """(k,) the misfit that the rounding of each column ``L q`` (directions k x b, output
    sparsity) explains: ``PRECISION_SLACK`` times its precision, at least ``verify_rtol``,
    uncapped. A column that fits its label within this but not within its tolerance
    (:func:`sample_tolerances`) is not certified, nor refuted (:func:`judge`)."""
    precision = PRECISION_SLACK * column_precision(directions, sparse_factor, rounding)
    return precision.clamp(min=verify_rtol)


def sample_tolerances(
    directions: torch.Tensor,
    sparse_factor: torch.Tensor,
    rounding: torch.Tensor | None,
    verify_rtol: float,
) -> torch.Tensor:
    """(k,) the misfit tolerance of the samples whose columns are ``L q`` for these directions
    (k x b, output sparsity): ``verify_rtol``, or ``PRECISION_SLACK`` times the column's
    precision where that is coarser (:func:`explained_misfits`), up to ``LOOSEST_SAMPLE_RTOL``."""
    return tolerances_of(explained_misfits(directions, sparse_factor, rounding, verify_rtol), verify_rtol)


def tolerances_of(explained: torch.Tensor, verify_rtol: float) -> torch.Tensor:
    """(k,) the misfit tolerances of :func:`sample_tolerances` from the misfits the columns'
    rounding explains (:func:`explained_misfits`): those, up to ``LOOSEST_SAMPLE_RTOL`` (or
    ``verify_rtol`` where that is looser)."""
    return explained.clamp_max(max(verify_rtol, LOOSEST_SAMPLE_RTOL))


#: a loss weight is read at its sample's misfit tolerance times this share of the loss's
#: sensitivity at its input (:func:`weight_tolerances`): the input error the weight may hide
#: is then half the tolerance along the sensitive direction, a margin for the weight's own
#: offset (its client's rounding of ``p - e_y``) and for errors along directions that move it
#: less. At the full sensitivity an adversarial review verified wrong batches: a trace of a
#: faint confident sample's column (float32 CNN head trained 200 steps, b = 16, seed 2;
#: sensitivity 8.3 to 11) moved its input 1.05e-3 to 1.25e-3 off, and its weight 7.3e-3 to
#: 9e-3, inside 8.3e-3 to 1e-2 (the honest weights were 0.8e-3 to 2e-3 off)
WEIGHT_SENSITIVITY_SHARE = 0.5
#: ... and at most this many times the misfit tolerance: weights of 1 and 2 samples stay far
#: apart at any tolerance up to float32's 1e-3
MOST_WEIGHT_SENSITIVITY = 10.0


def weight_tolerances(
    sample_rtol: torch.Tensor,
    data_precision: torch.Tensor | None = None,
    sensitivity: torch.Tensor | None = None,
) -> torch.Tensor:
    """(b,) the relative precision at which each sample's loss weight is read: its misfit
    tolerance ``sample_rtol``, or what the audit accepts of the data's rounding
    (``AUDIT_SLACK`` times ``data_precision`` (b,), :func:`data_precision`) where that is
    coarser, up to ``LOOSEST_SAMPLE_RTOL``; or the misfit tolerance times
    ``WEIGHT_SENSITIVITY_SHARE`` of the loss's ``sensitivity`` (b,) at the sample's input (the
    certifier's ``weight_sensitivity``), up to ``MOST_WEIGHT_SENSITIVITY`` times, where that is
    coarser still.

    A weight is read off the sample's column against the model's prediction at its input, so it
    carries the rounding of both, and an input's error moves the prediction's size by more than
    its own where the softmax is nearly saturated. A float64 CNN head trained 1000 steps (MNIST,
    b = 64) sent samples whose weights came out 9 to 16 times their data precision off 1/b
    (1.8e-8 and 1.5e-7), where their columns' misfit tolerance was 1.4e-8 and 6.1e-8. The
    true batch of a float32 CNN head trained 200 steps (MNIST, m = 500, b = 16, seed 2) held
    three faint confident samples whose weights came out 0.8e-3 to 2e-3 off 1/B, over float32's
    tolerance of 1e-3: their sensitivities were 9.8 to 11 (the other samples' 0.1 to 8), so
    each weight was off by 1.8e-4 of a relative change of the pre-activations, an input well
    within the tolerance. A wrong input moves its weight by about its sensitivity times its
    error, so reading weights at half the sensitivity times the tolerance keeps the inputs to
    the tolerance (a float32 MLP's sample 1.4e-3 off came with a weight 7.7e-3 off). The client's
    own rounding of a confident sample (``eps / |p - e_y|``, the certifier's ``rounding``) is
    not added: a weight that only it could explain would be accepted beyond the precision the
    result states for the input (an adversarial review's concern), so such a batch stays
    unverified."""
    rtol = sample_rtol
    if data_precision is not None:
        explained = data_precision.detach().to(sample_rtol).nan_to_num(0.0, posinf=0.0)
        rtol = torch.maximum(rtol, (AUDIT_SLACK * explained).clamp_max(LOOSEST_SAMPLE_RTOL))
    if sensitivity is not None:
        share = WEIGHT_SENSITIVITY_SHARE * sensitivity.detach().to(sample_rtol).nan_to_num(0.0)
        moved = share.clamp(1.0, MOST_WEIGHT_SENSITIVITY)
        rtol = torch.maximum(rtol, moved * sample_rtol)
    return rtol


def weight_sensitivity(gate: ModelGate, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """(b,) the loss's sensitivity at each certified sample's input (the certifier's optional
    ``weight_sensitivity``), for :func:`weight_tolerances`; None where it has none."""
    sensitivity = getattr(gate.certifier, "weight_sensitivity", None)
    if sensitivity is None:
        return None
    return sensitivity(inputs, labels).detach().to(torch.float64).cpu()


#: work (per-label passes through the rest of the network: labels x its parameters) of one group
#: of samples the model certificate checks between two looks at the deadline (a 62-sample
#: certificate through the m = 4000 MLP's tail ran 22 s past a 60 s budget): six samples at a
#: time there, about 0.5 s a group on 2 cores; 107 for m = 1000, 429 for m = 500. A group is
#: memory-bound on the tail's weights, so smaller ones cost time: one sample at a time (2**28)
#: doubled an m = 4000 attack (float64, b = 32: 15.5 s, 7.5 s in groups of six)
GATE_GROUP_WORK = 2**32
#: layer-pinned samples that must fail the model certificate, with none passing it, before the
#: result notes that it may not apply to this client (another loss, dropout, batch norm, ...)
MODEL_CALIBRATION = 3


def _group_size(certifier: object) -> int | None:
    """How many samples the certifier checks between two looks at the deadline
    (``GATE_GROUP_WORK``), or None (all at once) where the work per sample is not known."""
    tail, classes = getattr(certifier, "tail", None), getattr(certifier, "classes", None)
    if not isinstance(tail, torch.nn.Module) or not isinstance(classes, int) or classes < 1:
        return None
    params = sum(p.numel() for p in tail.parameters())
    return max(1, GATE_GROUP_WORK // (classes * max(1, params)))


class ModelGate:
    """Runs an optional :class:`SampleCertifier` and keeps count.

    With a model, only its certificate verifies. When it rejects samples that the layers pin
    down and has never accepted one, its assumptions may not fit this client (another loss,
    dropout or batch statistics in the model); it stays on (a wrong batch also fails it), but
    ``note`` says so, and candidates are not thrown away on its word until it has accepted a
    sample (``trusted``).
    """

    def __init__(self, certifier: SampleCertifier | None) -> None:
        self.certifier = certifier
        #: whether the certifier takes per-sample tolerances (an opt-in: ``accepts_sample_rtol``)
        self.takes_rtol = bool(getattr(certifier, "accepts_sample_rtol", False))
        self.passed = 0
        self.failed_pinned = 0
        self.seconds = 0.0
        self.group = _group_size(certifier)

    def _certify(
        self, inputs: torch.Tensor, grad_outputs: torch.Tensor, rtol: torch.Tensor | None
    ) -> SampleCertificates:
        assert self.certifier is not None
        if rtol is not None and self.takes_rtol:
            return self.certifier(inputs, grad_outputs, rtol=rtol)
        return self.certifier(inputs, grad_outputs)

    @property
    def active(self) -> bool:
        return self.certifier is not None

    @property
    def trusted(self) -> bool:
        """Whether the certificate has accepted a sample yet (it fits this client)."""
        return self.passed > 0

    @property
    def note(self) -> str | None:
        if self.passed or self.failed_pinned < MODEL_CALIBRATION:
            return None
        return (
            f"the model's certificate fits none of the {self.failed_pinned} samples this layer pins "
            "down: if the client's loss is not per-sample cross-entropy, or the model has dropout or "
            "batch statistics in training mode, pass loss= or certify=False (layer-level verification); "
            "if the update is a model delta (W_before - W_after = lr x gradient) or a negated one, "
            "divide it by the learning rate with the gradient's sign first"
        )

    def check(
        self,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor,
        pinned: torch.Tensor,
        rtol: torch.Tensor | None = None,
        deadline: Deadline = NEVER,
    ) -> SampleCertificates | None:
        """Certificates of k samples (inputs (k, n), dL/dZ columns (k, m)); None without a model.
        ``rtol`` (k,): per-sample misfit tolerances for columns known less precisely (see
        :class:`~spear.core.certificate.SampleCertifier`). With a ``deadline`` the samples are
        checked in groups of ``GATE_GROUP_WORK``, and those not reached when it passes get no
        certificate."""
        if not self.active or inputs.shape[0] == 0:
            return None
        start = time.perf_counter()
        k = inputs.shape[0]
        reached = torch.ones(k, dtype=torch.bool, device=pinned.device)
        if deadline is NEVER or self.group is None or self.group >= k:
            cert = self._certify(inputs, grad_outputs, rtol)
        else:
            cert = SampleCertificates.none(k, device=inputs.device)
            for part in torch.arange(k, device=inputs.device).split(self.group):
                if deadline.passed():
                    reached[part.to(reached.device)[0] :] = False  # unchecked: no evidence either way
                    break
                part_rtol = None if rtol is None else rtol[part.to(rtol.device)]
                some = self._certify(inputs[part], grad_outputs[part], part_rtol)
                for name in SampleCertificates.FIELDS:
                    mine = getattr(cert, name)
                    mine[part] = getattr(some, name).to(device=mine.device, dtype=mine.dtype)
        self.seconds += time.perf_counter() - start
        self.passed += int(cert.ok.sum())
        self.failed_pinned += int((~cert.ok & (pinned & reached).to(cert.ok.device)).sum())
        return cert


@dataclass
class Verdict:
    """Everything decided about one selection (see the module doc)."""

    inputs: torch.Tensor
    grad_outputs: torch.Tensor  # (m, b), full layer width
    check: Verification
    consistent: bool  # gradients reproduced and sigma = 1 (or its shortfall explained: Selection.explained)
    determinacy: Determinacy
    certificates: SampleCertificates | None
    reduction: BatchReduction
    verified_by: str | None  # "model", "layer" or None
    reject: list[int]  # positions of the selection the model shows to be wrong
    problems: list[str] = field(default_factory=list)  # why it is not verified
    notes: list[str] = field(default_factory=list)  # remarks on a verified result
    #: (b,) columns of a consistent batch that the model certifies on their own, beyond those
    #: peeled: a discriminative fit, not saturated, one sample's loss weight. They count as
    #: certified samples when the batch as a whole is not verified (e.g. two sign-only ones)
    individual: torch.Tensor | None = None
    #: the reduction the samples with tight loss weights fit where the whole batch's fits none
    #: (:func:`reduction_of_tight`): what :attr:`individual` reads one sample's weight off
    partial_reduction: BatchReduction | None = None
    #: the precision audit refused the batch (:func:`audit_precision`) ...
    audit_refused: bool = False
    #: ... naming these samples: off by their own misfit, label or loss weight (empty where only
    #: the weights jointly fit no reduction at the data's precision)
    audit_named: list[int] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return self.verified_by is not None

    @property
    def labels(self) -> torch.Tensor | None:
        """Every label when the model verified the batch; otherwise those of discriminative
        certificates only (a sign-only fit assumes the loss, see the notes)."""
        if self.certificates is None:
            return None
        cert = self.certificates
        trusted = cert.ok if self.verified_by == "model" else cert.ok & cert.strong
        return torch.where(trusted, cert.labels, -1)


def judge(
    selection: Selection,
    sparse_factor: torch.Tensor,
    certified: torch.Tensor,
    assembled: tuple[torch.Tensor, torch.Tensor],
    check: Verification,
    tol: Tolerances,
    gate: ModelGate,
    resolvable: bool,
    known: SampleCertificates | None = None,
    pinned: torch.Tensor | None = None,
    clients: int = 1,
    sample_rtol: torch.Tensor | None = None,
    precision: torch.Tensor | None = None,
    trusted: torch.Tensor | None = None,
    data_precision: torch.Tensor | None = None,
    explained: torch.Tensor | None = None,
    output_side: bool = True,
) -> Verdict:
    """The verdict on ``selection`` (whose columns ``certified`` were peeled and certified one
    by one), given its assembled inputs and full-width dL/dZ and their gradient check.
    ``known`` holds model certificates already issued for some columns (where ``ok``): only
    the others are checked again; ``pinned`` the columns' pins when the pool knows them.
    ``resolvable``: the batch's zero sets can be trusted (:func:`spear.core.consistency.
    resolvable`); otherwise nothing is pinned, unless ``trusted`` says so column by column.
    ``clients`` > 1: the gradient sums that many clients' mean losses (secure aggregation).
    ``sample_rtol`` (b,): each column's misfit tolerance, looser than ``verify_rtol`` for
    columns known less precisely (:func:`sample_tolerances`); its loss weight is read at that
    precision or coarser. ``precision`` (b,): each sample's rounding in the data
    (:func:`data_precision`), for the audit of a model-verified batch (:func:`audit_precision`).
    ``trusted`` (b,): per column, whether its zero set can be trusted where the batch is not
    resolvable as a whole (its faint samples' rounding): the column passes that test on its own
    and its zero set as read covers its rounding (:meth:`spear.core.reconstruct.AttackSetup.
    trusted_columns`); None: ``resolvable`` for every column. ``data_precision`` (b,): every
    sample's rounding in the data, for its loss weight's precision (:func:`weight_tolerances`).
    ``explained`` (b,): the misfit each column's rounding explains (:func:`explained_misfits`);
    a column whose best label fits within it but over its tolerance is not rejected: the batch
    stays unverified, and the column stays in the pool. ``output_side``: the layer's own ReLU
    follows it and the selection's zero sets are its patterns (output mode), which lets a
    saturated sample without a twin count (:func:`saturation_ambiguous`); in input mode every
    saturated sample is ambiguous."""
    inputs, grad_outputs = assembled
    zero = zero_mask((sparse_factor @ selection.Qbar).T, tol.zero_rtol)
    determinacy = ambiguous_groups(sparse_factor, selection.Qbar.T, zero, certified, pinned, tol.zero_rtol)
    pinned = (determinacy.pinned | certified) & (
        resolvable if trusted is None else trusted.to(certified.device)
    )
    consistent = check.verified and selection.perfect
    if sample_rtol is None:
        sample_rtol = torch.full((selection.Qbar.shape[1],), tol.verify_rtol, dtype=torch.float64)
    cert = _certify_rest(gate, inputs, grad_outputs.T, pinned, known, sample_rtol) if consistent else None
    verdict = Verdict(
        inputs, grad_outputs, check, consistent, determinacy, cert, BatchReduction(None, None, None), None, []
    )
    if cert is not None:
        sensitivity = weight_sensitivity(gate, inputs, cert.labels)
        weight_rtol = weight_tolerances(sample_rtol, data_precision, sensitivity)
        spared = unrefuted(cert, sample_rtol, explained)
        weight_precision = WEIGHT_PRECISION * weight_rtol
        invariant = getattr(gate.certifier, "scale_invariant", None)
        relaxed = output_side and bool(getattr(gate.certifier, "half_precision", False))
        ambiguous = (
            saturation_ambiguous(cert, determinacy.groups, None if invariant is None else invariant(inputs))
            if relaxed
            else cert.saturated
        )
        _judge_by_model(verdict, cert, pinned, weight_precision, gate.trusted, clients, spared, ambiguous)
        faint = (sample_rtol > tol.verify_rtol).nonzero()[:, 0].tolist()
        if faint:
            verdict.notes.append(
                f"sample(s) {faint} have faint gradients: the data give their columns of dL/dZ only to "
                f"about {float(sample_rtol.max()) / PRECISION_SLACK:.0e} of their size (the rounding "
                "of the gradient at its weakest singular values), so they are checked and assembled "
                "to that precision, not to the verification tolerance"
            )
        if selection.explained:
            verdict.notes.append(
                f"sigma is 1 - {1.0 - selection.sigma:.1e}: {selection.explained} active entr"
                f"{'y' if selection.explained == 1 else 'ies'} of dL/dZ below the data's zero floor "
                "(gradients that cancel by chance), each of which the model predicts below the zero band too"
            )
        if selection.within_rounding:
            verdict.notes.append(
                f"sigma is 1 - {1.0 - selection.sigma:.1e}: {selection.within_rounding} entr"
                f"{'y' if selection.within_rounding == 1 else 'ies'} of dL/dZ where the neuron is inactive "
                "read above the zero band, each within its faint column's rounding (the model certifies "
                "those columns)"
            )
        refused = verdict.verified_by == "model" and precision is not None
        refused = refused and audit_precision(verdict, gate, precision, sample_rtol, clients)
        # a refused batch may hold a mixture whose partner the audit cannot name: none counts
        reduction = verdict.partial_reduction or verdict.reduction
        individual = individually_certified(cert, reduction, certified, ambiguous)
        verdict.individual = None if refused else individual
    elif not gate.active and consistent:
        if not resolvable:
            verdict.problems.append(UNRESOLVABLE)
        elif not determinacy.determined:
            verdict.problems += list(determinacy.reasons)
        elif faint := faint_samples(inputs, grad_outputs, tol):
            verdict.problems.append(
                f"sample(s) {faint} carry less than {FAINT_SHARE * tol.zero_rtol / tol.verify_rtol:.0e} of "
                "the gradient's largest sample term: a trace of another sample's direction inside the "
                "zero band would move them by more than the tolerance unseen (the model can certify "
                "them: attack_layer)"
            )
        else:
            verdict.verified_by = "layer"  # with a model, only the model's certificate verifies
    return verdict


#: a sample whose term ||dL/dZ_j|| ||x_j|| is below this times zero_rtol / verify_rtol of the
#: largest (1e-2 with the default tolerances of every dtype) is too faint for the layer alone to
#: verify it. Another sample's direction can carry a trace of its column below the zero band
#: (``c zero_rtol`` of that column's max, which sigma cannot see); the batch then assembles it
#: off by about ``c zero_rtol / share``. Measured in float32 (MNIST, 4 x 400 trained 200 steps,
#: b = 32): a trace of 1.1e-5 put a sample of share ~2e-3 5.8e-3 off while every check of the
#: layer held. The worst case (c = 1) would need share >= 0.1; this takes c = 0.1.
FAINT_SHARE = 0.1


def reduction_of_tight(weights: torch.Tensor, precision: torch.Tensor) -> BatchReduction | None:
    """The reduction that the samples with the tightest weight precision fit (``precision``
    (b,), :func:`infer_reduction`'s), with multiplicity 0 for the others; None without both
    kinds, or when the tight samples fit none either. Where the whole batch fits none, a faint
    sample's weight may be off by more than its first-order precision estimate (MNIST b = 23,
    untrained shallow MLP: 2.5e-4 where 1e-4 was estimated, on one CPU and not another): that
    must not cost every other sample its certificate. The batch stays unverified; the loose
    samples are certified by none of this."""
    precision = precision.detach().double().cpu().expand_as(weights)
    loose = precision > precision.min()
    if not bool(loose.any()) or int((~loose).sum()) < 2:
        return None
    fit = infer_reduction(weights[~loose.to(weights.device)], precision[~loose])
    if fit.reduction is None or fit.multiplicities is None:
        return None
    multiplicities = torch.zeros(weights.numel(), dtype=torch.long)
    multiplicities[~loose] = fit.multiplicities
    return replace(fit, multiplicities=multiplicities, missing=None)


def individually_certified(
    cert: SampleCertificates,
    reduction: BatchReduction,
    certified: torch.Tensor,
    ambiguous: torch.Tensor | None = None,
) -> torch.Tensor:
    """Columns the model certifies one by one as in the singleton cascade: a discriminative fit,
    not saturated where another sample could hide in it (``ambiguous``,
    :func:`saturation_ambiguous`; None: every saturated one), with one sample's loss weight
    (multiplicity 1 of the batch's reduction; none when no reduction fits), not peeled already
    (``certified``)."""
    single = torch.zeros_like(cert.ok)
    if reduction.multiplicities is not None:
        single = reduction.multiplicities.to(cert.ok.device) == 1
    ambiguous = cert.saturated if ambiguous is None else ambiguous.to(cert.ok.device)
    discriminative = cert.strong | (cert.saturated & cert.discriminative)
    return cert.ok & discriminative & ~ambiguous & single & ~certified.to(cert.ok.device)


def faint_samples(inputs: torch.Tensor, grad_outputs: torch.Tensor, tol: Tolerances) -> list[int]:
    """Columns whose share of the gradient is too small for the layer alone to verify them."""
    term = grad_outputs.norm(dim=0) * inputs.norm(dim=1)
    share = term / term.max().clamp_min(torch.finfo(term.dtype).tiny)
    return (share < FAINT_SHARE * tol.zero_rtol / tol.verify_rtol).nonzero()[:, 0].tolist()


#: why an ill-conditioned batch is not verified at the layer level
UNRESOLVABLE = (
    "the batch's smallest singular value lies too close to the rounding noise for its zero sets to "
    "be trusted (nearly dependent samples, e.g. near-duplicates)"
)


def column_precision(
    directions: torch.Tensor, sparse_factor: torch.Tensor, rounding: torch.Tensor | None
) -> torch.Tensor:
    """(k,) how precisely the column ``L q`` of each direction (k x b) is known, relative to its
    size: the norm of its rounding error (:func:`spear.core.consistency.rounding_map`) over its
    norm (0 without a map). About ``noise / s_b`` for a faint sample's column, far below any
    tolerance for the others."""
    q = directions
    error = rounding_error(q, rounding)
    if error is None:
        return q.new_zeros(q.shape[0])
    return error.to(q) / (q @ sparse_factor.T).norm(dim=1).clamp_min(torch.finfo(q.dtype).tiny)


#: the audit accepts a sample's misfit (and its loss weight's) up to this many times the
#: rounding that the data and the client's arithmetic explain (:func:`data_precision`,
#: ``rounding`` of the certifier). Measured on float32 clients (MLPs 4 x 400 trained 200 steps,
#: b = 32, seeds 0-2, first and hidden layer; untrained 6 x 1000, b = 64): correct samples at
#: most 4 times it, with median 0.1-0.2; 6.2 once, on a 6 x 500 trained 200 steps (b = 64)
AUDIT_SLACK = 30.0
#: ... and never below the float64 verification tolerance (the audit changes nothing in float64)
TIGHTEST_SAMPLE_RTOL = 1e-8


def data_precision(singular_values: torch.Tensor, directions: torch.Tensor, eps: float) -> torch.Tensor:
    """(b,) how precisely the data give each sample of the batch whose directions are the
    columns of ``directions`` (b x b): the relative rounding of its column ``L q_j`` plus that
    of its input (row j of ``Q^-1 R``), from the rounding map of the split
    (:func:`spear.core.consistency.rounding_map`: ``noise / sqrt(s_i)`` per unit of each
    coordinate, where ``L = U S^1/2`` and ``R = S^1/2 V^T`` carry ``sqrt(s_i)``)."""
    b = directions.shape[0]
    S = singular_values.detach().to(torch.float64).cpu()
    tiny = torch.finfo(torch.float64).tiny
    error = torch.diagonal(rounding_map(S, b, eps))  # noise / sqrt(s_i)
    root = S[:b].clamp_min(tiny).sqrt()
    Q = directions.detach().to(torch.float64).cpu()
    column = (error[:, None] * Q).norm(dim=0) / (root[:, None] * Q).norm(dim=0).clamp_min(tiny)
    dual, info = torch.linalg.inv_ex(Q)
    if int(info):  # singular: nothing is known beyond the tolerance
        return torch.full((b,), torch.inf, dtype=torch.float64)
    row = (dual * error[None]).norm(dim=1) / (dual * root[None]).norm(dim=1).clamp_min(tiny)
    return (column + row).nan_to_num(torch.inf)


def audit_precision(
    verdict: Verdict, gate: ModelGate, precision: torch.Tensor, sample_rtol: torch.Tensor, clients: int = 1
) -> bool:
    """Re-check a batch the model verified at the precision its data have; True when it is
    refused (``verdict`` then carries the problem and is no longer verified).

    The verification tolerance of a dtype is its loosest case (float32: 1e-3, for samples whose
    gradient is faint). Where a sample's column and input are known far more precisely, a
    wrong batch could hide in the slack: a trace ``c`` of another sample's column added to
    column j, with ``c`` times x_j taken off input k, leaves dL/dW unchanged, and at c = 3e-3
    passed every check of a float32 MLP (review of issue #10). Here each audited sample's
    misfit and loss weight, certified afresh on the batch as assembled, must fit to
    ``AUDIT_SLACK`` times what rounding explains: ``precision`` (the data's,
    :func:`data_precision`; inf for a column not solved on its clearly zero rows,
    :mod:`spear.core.polish`, which is not audited) plus the client's own (the certifier's
    ``rounding``). Without a rounding model (a custom loss, or a tolerance the user set) there
    is no audit."""
    rounding = getattr(gate.certifier, "rounding", None)
    cert = verdict.certificates
    if rounding is None or cert is None:
        return False
    client = rounding(verdict.inputs, cert.labels)
    if client is None:
        return False
    explained = precision.to(torch.float64).cpu() + client.to(torch.float64).cpu()
    loose = sample_rtol.to(explained)
    tight = torch.minimum(loose, (AUDIT_SLACK * explained).clamp_min(TIGHTEST_SAMPLE_RTOL))
    audited = (tight < loose).nonzero()[:, 0]
    if not audited.numel():
        return False
    refusal = _audit_problem(verdict, gate, audited, tight, explained, sample_rtol, clients)
    if refusal is None:
        return False
    problem, verdict.audit_named = refusal
    verdict.audit_refused = True
    verdict.problems.append(problem)
    verdict.verified_by = None
    verdict.notes.clear()
    return True


def _audit_problem(
    verdict: Verdict,
    gate: ModelGate,
    audited: torch.Tensor,
    tight: torch.Tensor,
    explained: torch.Tensor,
    sample_rtol: torch.Tensor,
    clients: int,
) -> tuple[str, list[int]] | None:
    """Why the ``audited`` samples fail their ``tight`` tolerances (b,), and which fail on their
    own (misfit, label or loss weight; none where only the weights jointly fail); or None."""
    cert = verdict.certificates
    assert cert is not None and gate.certifier is not None
    inputs, columns = verdict.inputs[audited], verdict.grad_outputs.T[audited]
    if gate.takes_rtol:
        fresh = gate.certifier(inputs, columns, rtol=sample_rtol[audited])
    else:
        fresh = gate.certifier(inputs, columns)
    relabelled = (fresh.labels.cpu() != cert.labels[audited].cpu()).to(tight.device)
    misfit = fresh.misfit.to(tight)
    over = ~(misfit <= tight[audited])  # NaN proves nothing
    weights = cert.weights.to(tight).clone()
    weights[audited] = fresh.weights.to(tight)
    off = _weights_off(verdict.reduction, weights, WEIGHT_PRECISION * tight)[audited.to(tight.device)]
    # every sample off on its own, whichever check the message leads with: a mixture's label can
    # fail where its partner's misfit does (a second review: naming the label's alone left the
    # mixture among the certified samples)
    named = audited[(relabelled | over | off.to(over.device)).to(audited.device)].tolist()
    if bool(relabelled.any()):
        first = audited[relabelled.to(audited.device)].tolist()
        return f"sample(s) {first} fit another label when certified afresh on the batch as assembled", named
    if bool(over.any()):
        worst = int(torch.where(over, (misfit / tight[audited]).nan_to_num(torch.inf), -1.0).argmax())
        return (
            f"sample(s) {named} fit the model only to a misfit of up to "
            f"{float(misfit[worst]):.1e}, more than {AUDIT_SLACK:g} times what the rounding of the "
            f"data and of the client's arithmetic explains ({float(explained[audited[worst]]):.1e}): "
            "a trace of another sample's column may be mixed in, which the dtype's tolerance cannot "
            "see (or the client computed in less than its gradient's entries show, e.g. TF32 "
            "matmuls; then attack with precision_audit=False)"
        ), named
    precision = WEIGHT_PRECISION * tight
    fit = infer_batch(weights, clients, precision)
    if fit.reduction is None:
        return (
            f"the loss weights of sample(s) {named or audited.tolist()} fit one sample's only at the "
            "dtype's tolerance, not to the precision the data give them: an input may be scaled by "
            "that much"
        ), named
    return None


def _weights_off(reduction: BatchReduction, weights: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """(b,) the samples whose loss weight is off the one the batch's reduction (fitted at the
    dtype's tolerance: a mean's ``k / B``, a sum's ``k``) gives it by more than ``precision``
    (b,); none where the reduction does not say (an aggregate of several clients, or none)."""
    k = reduction.multiplicities
    if reduction.reduction not in ("mean", "sum") or k is None or reduction.client_sizes is not None:
        return torch.zeros(weights.shape[0], dtype=torch.bool, device=precision.device)
    expected = k.to(weights) / (reduction.batch_size if reduction.reduction == "mean" else 1)
    return ((weights - expected).abs() > precision.to(weights) * expected).to(precision.device)


def model_explains_silent(
    gate: ModelGate,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    silent: torch.Tensor,
    zero_rtol: float,
    rtol: torch.Tensor | None = None,
) -> bool:
    """Whether the model accounts for every silent entry (``silent`` (b, m): an active neuron
    whose dL/dZ the data put below their zero floor, :func:`spear.core.consistency.
    contradictions`) of an assembled batch (inputs (b, n), full-width dL/dZ (m, b)). It does
    when it certifies each column holding one (its label), and its own column for that label is
    within ``zero_rtol`` of its largest there: the model predicts a value the data cannot tell
    from zero (entries below ``zero_rtol`` contradict nothing either way). The certificate is
    the stronger check: its misfit (at most ``verify_rtol`` of the column) bounds every entry.
    A mixture's silent entries (rows where its mixed input is active while its column vanishes
    by the mixing) get a generic gradient from the model and fail; the batch still has to pass
    the whole model-level verdict afterwards. Needs the certifier's optional
    ``gradients`` (:class:`~spear.core.certificate.SampleCertifier`)."""
    gradients = getattr(gate.certifier, "gradients", None)
    columns = silent.any(dim=1).nonzero()[:, 0]
    if gradients is None or columns.numel() == 0:
        return False
    unpinned = torch.zeros(columns.numel(), dtype=torch.bool, device=silent.device)
    own = None if rtol is None else rtol.to(columns.device)[columns]
    cert = gate.check(inputs[columns], grad_outputs[:, columns].T, unpinned, own)
    if cert is None or not bool(cert.ok.all()):
        return False
    predicted = gradients(inputs[columns], cert.labels).abs().to(torch.float64)
    below = predicted <= zero_rtol * predicted.amax(dim=1, keepdim=True)
    return bool((below.to(silent.device) | ~silent[columns]).all())


#: a column that misses its best label by more than this is refuted whatever its rounding: a
#: column known more coarsely carries nothing the certificate can check, and one kept in the
#: pool would hold the greedy selection where a mixture's (most miss by far more) would not
MOST_EXPLAINED_MISFIT = 1e-2


def unrefuted(
    cert: SampleCertificates, sample_rtol: torch.Tensor, explained: torch.Tensor | None
) -> torch.Tensor | None:
    """(b,) the columns that no label fits within their tolerance ``sample_rtol`` but whose best
    fits within the misfit their rounding ``explained`` (:func:`explained_misfits`), or None.

    Such a column is not certified, nor refuted: a float32 CNN head trained 200 steps (MNIST,
    m = 500, b = 32, seed 2) sent a sample whose column is 2.6e-5 of the largest, known to
    1.4e-4 of its size; its true column missed the model's prediction by 1.2e-3, over float32's
    1e-3, and the certificate rejected it for good, so the batch was never whole. Certifying it
    at 10 times its precision instead let wrong inputs through (an adversarial review: a trace
    of the faint column in a strong one put its input 2.8e-3 off, verified)."""
    if explained is None:
        return None
    misfit = cert.misfit.to(sample_rtol)
    bound = explained.to(sample_rtol).clamp_max(MOST_EXPLAINED_MISFIT)
    return ~cert.ok.cpu() & (misfit > sample_rtol) & (misfit <= bound)


#: what a half-precision batch verified with saturated samples cannot rule out
MERGED_TWINS_NOTE = (
    "the losses of saturated samples (float16 / bfloat16: nearly all) hardly move with their "
    "inputs: had every sample a twin of its label and activation pattern, each pair would merge "
    "into one column at their midpoint, all with one weight, and read as a batch of half the "
    "size; compare client_batch_size with the batch size the client reported"
)


def saturation_ambiguous(
    cert: SampleCertificates,
    groups: tuple[tuple[int, ...], ...],
    scale_invariant: torch.Tensor | None = None,
) -> torch.Tensor:
    """(b,) the saturated samples (``cert.saturated``) whose column may stand for a mixture or
    a merge of several samples the model's fit cannot tell apart: those whose ambiguous group
    (``groups``: :class:`spear.core.consistency.Determinacy`, columns sharing (nearly) one
    activation pattern) holds another sample of their label (*twins*), and those whose scaled
    copies keep their pattern (``scale_invariant`` (b,), the certifier's
    :meth:`spear.certify.ModelCertifier.scale_invariant`; None: every one).

    A saturated sample's gradient hardly moves with its input inside its activation region.
    So a mixture with a twin has a column of the pair's direction, which fits the model; and
    copies ``t x`` of one input under one label (a zero-bias layer keeps the pattern) have
    parallel columns that merge into one column, fitting one sample. A mixture with a sample
    of another pattern has a column nonzero where the mixed input is inactive, or the
    reverse, at entries of the other sample's size, which the layer's pattern check refutes;
    with a sample of another label, a column no single label's gradient fits; and copies whose
    pattern changes with their scale (a bias crossing zero) leave a merged column that misfits
    where it changed. float16 and bfloat16 gradients make nearly every sample read as
    saturated (1e3 eps is about 1): this is what lets their batches verify (:func:`judge` uses
    it for half-precision columns only). What no twin shows: near-duplicate twins merged into
    one column, every sample alike (a review's float64 batch verified at half its size); in
    half precision the result notes it (``MERGED_TWINS_NOTE``), in float32 and float64 every
    saturated sample stays ambiguous."""
    twinned = torch.zeros_like(cert.ok)
    labels = cert.labels.tolist()
    for group in groups:
        for j in group:
            twinned[j] = any(labels[k] == labels[j] >= 0 for k in group if k != j)
    radial = torch.ones_like(cert.ok) if scale_invariant is None else scale_invariant.to(cert.ok.device)
    return cert.saturated & (twinned | radial)


def _judge_by_model(
    verdict: Verdict,
    cert: SampleCertificates,
    pinned: torch.Tensor,
    precision: torch.Tensor,
    gate_trusted: bool,
    clients: int = 1,
    spared: torch.Tensor | None = None,
    ambiguous: torch.Tensor | None = None,
) -> None:
    """Model level: every sample certified, by a discriminative fit or a pinned zero set, none
    saturated ambiguously (:func:`saturation_ambiguous`), with one sample's weight each,
    fitting a mean or a sum. ``precision`` (b,): each loss weight's relative precision;
    ``spared`` (b,): columns not certified but not refuted (:func:`unrefuted`), which are not
    rejected; ``ambiguous`` (b,): :func:`saturation_ambiguous` (None: every saturated sample)."""
    spared = torch.zeros_like(cert.ok) if spared is None else spared.to(cert.ok.device)
    verdict.reject = (~cert.ok & ~pinned & ~spared).nonzero()[:, 0].tolist() if gate_trusted else []
    if bool(spared.any()):
        verdict.problems.append(
            f"sample(s) {spared.nonzero()[:, 0].tolist()} fit their best label only to a misfit "
            "above their tolerance, within what the rounding of their faint columns explains: "
            "the gradient is too faint there to certify them (kept, not refuted)"
        )
    unfit = (~cert.ok & ~spared).nonzero()[:, 0].tolist()
    if unfit:
        verdict.problems.append(
            f"the model singles out no label for sample(s) {unfit} (several labels fit: the rest of "
            "the network cannot tell them apart; or none: e.g. samples this layer cannot separate, "
            "or a duplicated input with different labels)"
        )
    if unfit or bool(spared.any()):
        return
    ambiguous = cert.saturated if ambiguous is None else ambiguous.to(cert.ok.device)
    saturated = ambiguous.nonzero()[:, 0].tolist()
    if saturated:
        verdict.problems.append(
            f"the loss of sample(s) {saturated} is saturated at the gradient's precision (their "
            "gradient changes with the input, inside its activation region, by less than 1e3 eps of "
            "the gradient's dtype): samples sharing such a pattern and label (a twin, scaled copies "
            "under a layer whose biases change no sign, near-duplicates) have one gradient at that "
            "precision, so a column may stand for a mixture or a merge of them"
        )
    # a saturated sample that no other can hide in is judged by its fit as an unsaturated one is
    strong = cert.strong | (cert.saturated & ~ambiguous & cert.discriminative)
    weak = (~strong & ~pinned & ~ambiguous).nonzero()[:, 0].tolist()
    if weak:
        verdict.problems.append(
            f"the model confirms sample(s) {weak} by a fit that mixtures of samples can pass too (a "
            "sign only: every label's gradient is parallel, as with two classes; or a fit with a "
            "deeper ReLU gate flipped at the client's rounding), and this layer does not pin them"
        )
    multiples = aggregate_multiples(cert.weights, precision) if clients > 1 else []
    if multiples:
        verdict.problems.append(
            f"sample(s) {multiples} carry an integer multiple of another sample's loss weight: under "
            f"secure aggregation each is a sample repeated in its client or a sample of a smaller "
            "client, and the update cannot tell which (how many samples there are is not determined)"
        )
        reduction = BatchReduction(None, None, None)
    else:
        reduction = infer_batch(cert.weights, clients, precision)
    verdict.reduction = reduction
    unfit = reduction.reduction is None and clients == 1
    partial = reduction_of_tight(cert.weights, precision) if unfit else None
    if partial is not None:
        verdict.partial_reduction = partial
        off = (partial.multiplicities == 0).nonzero()[:, 0].tolist()  # type: ignore[union-attr]
        verdict.problems.append(
            f"the loss weights of the samples known to the verification tolerance fit a "
            f"{partial.reduction}, those of faint sample(s) {off} do not at their estimated precision: "
            "their inputs are known less precisely than the first-order estimate says (or one is a "
            "mixture); the others are certified one by one"
        )
    elif reduction.reduction is None and not multiples:
        expected = (
            f"1/B_k of each sample's own client, over {clients} clients"
            if clients > 1
            else "a mean (k/B per sample) nor a sum (integers)"
        )
        verdict.problems.append(
            f"the fitted loss weights fit neither {expected}: a mixture of samples, or a loss the "
            "certificate does not model (class weights, a scaled update)"
        )
    elif reduction.multiplicities is not None and bool((reduction.multiplicities > 1).any()):
        shared = (reduction.multiplicities > 1).nonzero()[:, 0].tolist()
        verdict.problems.append(
            f"sample(s) {shared} carry {reduction.multiplicities[shared].tolist()} times one sample's "
            "loss weight: each stands for several samples whose gradients coincide (exact duplicates, "
            "samples differing in the layer's null space or in a saturated region, near-duplicates "
            "within the precision) or for a class-weighted loss; only their mean is determined"
        )
    if not verdict.problems:
        verdict.verified_by = "model"
        if bool(cert.saturated.any()):
            verdict.notes.append(MERGED_TWINS_NOTE)
        if reduction.client_sizes is not None:
            verdict.notes.append(aggregate_note(reduction.client_sizes, clients))
        if not bool(strong.all()):
            signs = (~strong).nonzero()[:, 0].tolist()
            verdict.notes.append(
                f"the labels of sample(s) {signs} rest on the sign of their gradient, whose direction "
                "is the same for every label (two classes, a saturated softmax, or a rank-one layer "
                "above): they assume the loss is plain cross-entropy"
            )


def aggregate_note(client_sizes: torch.Tensor, clients: int) -> str:
    """What secure aggregation leaves of the samples' provenance, and how many clients' worth of
    samples the update holds (each client's B_k samples carry 1/B_k each: one client's worth)
    where that differs from the ``clients`` told (review 46: one client of 4 attacked as two
    was noted "clients of 4 samples each" beside its 4 samples)."""
    sizes = sorted({int(v) for v in client_sizes.tolist()})
    shown = float((1.0 / client_sizes.to(torch.float64)).sum())
    count = (
        ""
        if round(shown) == clients
        else f"; these {client_sizes.numel()} samples make {shown:g} client(s)' worth at those weights, "
        f"not the {clients} told: the other client(s) sent no samples, or the count told is not the update's"
    )
    if len(sizes) == 1:
        return (
            f"secure aggregation over {clients} clients: every sample carries 1/{sizes[0]}, as from "
            f"clients of {sizes[0]} samples each (a client repeating each of its samples equally "
            f"often gives the same update); which client each sample came from is not determined{count}"
        )
    groups = {size: (client_sizes == size).nonzero()[:, 0].tolist() for size in sizes}
    listed = "; ".join(f"samples {idx} from client(s) of {size}" for size, idx in groups.items())
    return (
        f"secure aggregation over {clients} clients, told apart by their batch sizes as far as the "
        f"update shows: {listed} (a client repeating each of its samples equally often gives the "
        f"update of a smaller client){count}"
    )


def _certify_rest(
    gate: ModelGate,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    pinned: torch.Tensor,
    known: SampleCertificates | None,
    rtol: torch.Tensor | None = None,
) -> SampleCertificates | None:
    """Model certificates of all columns, reusing the ``known`` ones; ``rtol`` (b,): each
    column's misfit tolerance."""
    if known is None or not bool(known.ok.any()):
        return gate.check(inputs, grad_outputs, pinned, rtol)
    todo = (~known.ok).nonzero()[:, 0]
    part = None if rtol is None else rtol[todo]
    fresh = gate.check(inputs[todo], grad_outputs[todo], pinned[todo], part) if todo.numel() else None
    if todo.numel() and fresh is None:
        return None
    merged = SampleCertificates(*(getattr(known, name).clone() for name in SampleCertificates.FIELDS))
    if fresh is not None:
        for name in SampleCertificates.FIELDS:
            getattr(merged, name)[todo] = getattr(fresh, name).to(getattr(merged, name))
    return merged


def verdict_message(verdict: Verdict, b: int) -> str:
    """The one-line summary of a verdict on a complete, consistent selection."""
    residual = verdict.check.residual
    if verdict.verified_by == "model":
        text = (
            f"exact: all {b} inputs recovered, each certified through the model with its label "
            f"(gradient residual {residual:.1e})"
        )
        if verdict.reduction.missing:
            text += (
                f"; the loss weights say 1/{verdict.reduction.batch_size} per sample: either "
                f"{verdict.reduction.missing} sample(s) left no trace in this layer (no active neuron, "
                "or a gradient below the others' rounding on neurons they activate too; they cannot be "
                "recovered from it), or the update was scaled (learning rate, clipping)"
            )
        return text
    if verdict.verified_by == "layer":
        return (
            f"exact: all {b} inputs recovered and verified by this layer's gradient (residual "
            f"{residual:.1e}; every sample pinned by its zero set)"
        )
    return "consistent but not certified: " + "; ".join(verdict.problems)
