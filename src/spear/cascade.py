"""The model-level cascade: each certified sample, from any layer, is taken out of every layer.

A FedSGD update is a sum of per-sample gradients, ``dL/dtheta = sum_j w_j d loss(x_j, y_j) /
dtheta`` (``w_j = 1/B`` for a batch mean). A sample that an attack on some layer certifies
(:mod:`spear.certify`: its label and loss weight come with it) and that inverts exactly to the
data (:class:`spear.inversion.RowSpaceInverter`, or the first layer itself) has a known
per-sample gradient at *every* layer. Subtracting it leaves the gradient of the other samples,
every layer's rank one lower: the LT-code paper's peeling (Shariati & Meybodi 2026, see
``anchors.md``) with the whole model as the certificate, so any certified sample, not only a
neuron's singleton, starts it. Attacks on the residual then face b' < b samples, where SPEAR's
sampling (Lemma 5.2 of the SPEAR paper) needs b' - 1 zeros of a column instead of b - 1, and
different layers find different samples (a 6 x 1000 MLP at b = 256: layers 8 and 0 certify 26
and 24 samples, 3 of them shared).

A sample enters the result only when it is certified at its layer *and* exact in the data, so
each one is proven on its own. A wrong subtraction could only hide samples from later attacks;
it cannot make them certify a wrong one (each is certified against the model on its own). The
result is ``complete`` when the samples found are the whole batch: their certified loss
weights ``1/B`` give the client's batch size B, B distinct samples of that weight were found,
and they explain the gradient of every parameter (:class:`_Count`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from spear import checks
from spear.api import (
    _as_tensor,
    _resolve_device,
    attack_layer,
    budget_threads,
    build_options,
    check_seconds,
    half_precision,
    named_gradients,
    source_precision,
    warn_if_oversubscribed,
)
from spear.certify import LossFn, _cross_entropy
from spear.core.backtrack import GradientSVD
from spear.core.certificate import BatchReduction, aggregate_multiples, infer_batch
from spear.core.consistency import Tolerances
from spear.core.deadline import Deadline
from spear.core.result import Reconstruction
from spear.errors import InputError, SpearError
from spear.inversion.base import acting_layers_below
from spear.inversion.row_space import RowSpaceInverter

#: the update counts as explained when every parameter's residual is within this of its
#: gradient: the verification tolerance in float64; in float32 above the 2.8e-3 that one ReLU
#: flipped at zero leaves (see :class:`_Count`), far below one sample's share of a batch
EXPLAINED_RTOL = {torch.float64: 1e-8, torch.float32: 1e-2}


@dataclass(frozen=True)
class CascadeStep:
    """One attack of the cascade: the layer, the samples it added, its own record."""

    layer: str
    added: int  # samples certified at the layer and exact in the data, now subtracted
    certified: int  # samples the layer's attack certified (hidden inputs for a later layer)
    remaining: int | None  # the residual's batch size b' as the attack read it (its rank)
    seconds: float
    stop_reason: str
    message: str


@dataclass(frozen=True)
class CascadeResult:
    """What :func:`attack_model` proved.

    Attributes:
        inputs: (k, n_0) the model inputs found, each certified at its layer and exact in the
            data (in the order found); ``labels`` (k,) and ``weights`` (k,) their labels and
            loss weights (``1/B`` for a batch mean; ``k/B`` for a sample present k times).
        layers: (k,) the layer whose attack certified each sample.
        complete: the samples found are the whole batch: B distinct samples, B read off their
            certified weights (a batch mean), explaining the update (see :class:`_Count`).
            Samples whose loss gradient is zero leave no trace, count as ``missing``, and keep
            it False. A column of k >= 2 samples' weight is subtracted but not in ``inputs``.
        residual: the largest relative norm, over the gradients of every parameter, of the
            gradient the found samples leave unexplained (float32 samples can flip a ReLU
            that sits at zero, see :class:`_Count`).
        batch_size: the client's batch size B read off the weights (a mean), or None; under
            secure aggregation (``clients=K``, weights ``1/B_k`` of each sample's own client)
            the K clients' samples together.
        missing: B minus the samples found (with multiplicity), or None.
        steps: one :class:`CascadeStep` per attack, in order.
        stop_reason: "complete", "explained" (nothing left in the gradients, but samples
            missing), "exhausted" (a pass without budgets added nothing), "time budget",
            "rounds" or "interrupted".
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    layers: tuple[str, ...]
    complete: bool
    residual: float
    batch_size: int | None
    missing: int | None
    steps: tuple[CascadeStep, ...]
    seconds: float
    stop_reason: str

    @property
    def verified(self) -> bool:
        """Every sample is proven on its own; with ``complete``, the batch is too."""
        return self.complete

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (no tensors)."""
        return {
            "found": int(self.inputs.shape[0]),
            "complete": self.complete,
            "residual": self.residual,
            "batch_size": self.batch_size,
            "missing": self.missing,
            "labels": [int(v) for v in self.labels.tolist()],
            "layers": list(self.layers),
            "seconds": self.seconds,
            "stop_reason": self.stop_reason,
            "steps": [step.__dict__ for step in self.steps],
        }


@dataclass
class _Found:
    """The samples found so far (float64, on the CPU)."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    labels: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)

    def add(self, inputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, layer: str) -> None:
        self.inputs.append(inputs)
        self.labels.append(labels)
        self.weights.append(weights)
        self.layers.extend([layer] * int(inputs.shape[0]))

    def stacked(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.inputs:
            empty = torch.empty(0, dtype=torch.float64)
            return empty.view(0, width), torch.empty(0, dtype=torch.long), empty
        return torch.cat(self.inputs), torch.cat(self.labels), torch.cat(self.weights)


def cascade_layers(model: nn.Module) -> list[str]:
    """The layers the cascade can use: each ``nn.Linear`` with a bias followed by a ReLU whose
    certified samples reach the data exactly (the first layer, or Linear -> ReLU pairs below), in the
    default order: the hidden layers from the middle outwards, then the first layer.

    The order is measured, not derived: on 6-layer MLPs (MNIST, widths 200 and 1000) the
    middle layers (nonnegative, sparse inputs, neurons less alike than the deepest ones)
    recovered whole batches that the first and the last failed (README, "The model cascade")."""
    from spear.fl.models import attackable_layers

    inverter = RowSpaceInverter()
    modules = dict(model.named_modules())
    usable = [
        name
        for name, sparsity in attackable_layers(model).items()
        if sparsity == "output"
        and modules[name].bias is not None  # attack_layer needs dL/db (Theorem 3.6)
        and (not is_hidden(model, name) or inverter.applies(model, name))
    ]
    hidden = [name for name in usable if is_hidden(model, name)]
    middle = (len(hidden) - 1) / 2
    ranked = sorted(range(len(hidden)), key=lambda i: (abs(i - middle), i))
    return [hidden[i] for i in ranked] + [name for name in usable if name not in hidden]


def is_hidden(model: nn.Module, layer: str) -> bool:
    """Whether a module other than a pass-through one (Flatten, Identity, an eval-mode Dropout)
    runs below ``layer``: its inputs are then features, not the data."""
    return bool(acting_layers_below(model, layer))


def per_sample_gradients(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    loss: LossFn = _cross_entropy,
    autocast: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """``sum_j w_j d loss(model(x_j), y_j) / dtheta`` for every parameter, in float64: the part
    of the client's update that the samples (k, n_0) with labels (k,) and weights (k,) make.

    ``autocast`` (float16 or bfloat16): in the client's mixed-precision arithmetic instead, the
    model in its own dtype under ``torch.autocast``, as an AMP client computes its update. Its
    ReLUs then switch where the client's did: a unit whose pre-activation is within the half
    dtype's rounding of zero is off in float64 and on at the client (or the reverse). Autocast
    leaves a float64 model in float64 (as it would the client's)."""
    from spear.fl.protocols.fedsgd import AUTOCAST  # the simulated clients' own set

    if autocast is not None and autocast not in AUTOCAST.values():
        raise InputError(f"autocast must be torch.float16, torch.bfloat16 or None, got {autocast!r}")
    net = copy.deepcopy(model).eval()
    for param in net.parameters():  # frozen ones too: their gradient is part of the sum asked for
        param.requires_grad_(True)
    dtype = next((p.dtype for p in net.parameters()), torch.float64) if autocast else torch.float64
    net = net.to(dtype)
    params = dict(net.named_parameters())
    device = next((p.device for p in params.values()), inputs.device)
    x = inputs.to(device=device, dtype=dtype)
    precision = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with torch.enable_grad():
        with precision:
            per_sample = loss(net(x), labels.to(device).long())
        total = (per_sample.to(dtype) * weights.to(device=device, dtype=dtype)).sum()
        grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
    return {
        name: torch.zeros_like(p) if g is None else g.detach()
        for (name, p), g in zip(params.items(), grads, strict=True)
    }


#: keywords of :func:`spear.attack_layer` and :func:`spear.reconstruct` that are not
#: :class:`~spear.core.result.AttackOptions` (those are checked up front)
_LAYER_ONLY_OPTIONS = {
    "certify",
    "sample_weights",
    "precision_audit",
    "certifier",
    "next_grad_weight",
    "next_weight",
}


@checks.outside_inference_mode
def attack_model(
    model: nn.Module,
    gradients: Mapping[str, Any] | Sequence[Any],
    layers: Sequence[str] | None = None,
    *,
    time_budget: float | None = None,
    attack_budget: float | None = None,
    max_rounds: int = 4,
    loss: str | LossFn = "cross_entropy",
    progress: Callable[[CascadeStep], None] | None = None,
    **options: Any,
) -> CascadeResult:
    """Attack every layer of ``layers`` in turn, subtracting each certified sample from every
    layer before the next attack (see the module doc).

    Args:
        model: the global model (a (nested) ``nn.Sequential`` of Linear and ReLU layers up to
            the attacked ones; any classifier head after them).
        gradients: parameter name -> gradient, or a list in ``model.parameters()`` order (numpy
            arrays or tensors), as :func:`spear.attack_layer` takes them.
        layers: the layers to attack, in the order of each pass; default
            :func:`cascade_layers` (the middle first, the first layer last).
        time_budget: seconds for the whole cascade: checked before each attack, and each
            attack gets at most what is left (kept as well as :func:`spear.attack_layer`
            keeps its own budget).
        attack_budget: seconds for each attack in the first pass, doubled at every pass
            (default: ``time_budget`` over twice the number of layers; none without one).
            ``max_proposals`` in ``options`` doubles with it.
        max_rounds: passes over ``layers`` at most. Without budgets a pass that adds nothing
            ends it (the next would repeat it).
        loss: the client's per-sample loss ("cross_entropy" or ``loss(logits, labels)``).
        progress: called with each :class:`CascadeStep` as it finishes.
        **options: for each :func:`spear.attack_layer` (``seed``, ``max_proposals``, ...).

    Returns:
        A :class:`CascadeResult`; ``complete`` when the samples found are the whole batch.
    """
    if isinstance(loss, str) and loss != "cross_entropy":
        raise InputError(f"unknown loss {loss!r}; use 'cross_entropy' or pass a callable")
    if not isinstance(loss, str) and not callable(loss):
        raise InputError(f"loss must be 'cross_entropy' or a callable loss(logits, labels), got {loss!r:.60}")
    if progress is not None and not callable(progress):
        raise InputError("progress must be a callable receiving each CascadeStep, or None")
    check_seconds("time_budget", time_budget)
    if options.get("row_noise") is not None:  # review 46c: it was silently overwritten
        raise InputError(
            "row_noise is set by attack_model for each attack on a residual (the noise that "
            "subtracting samples leaves); pass it to attack_layer, not here"
        )
    # once, here: each attack's errors become steps of the result, so a misspelled or invalid
    # option would otherwise end every step, not this call
    build_options({k: v for k, v in options.items() if k not in _LAYER_ONLY_OPTIONS})
    if "device" in options:
        _resolve_device(options["device"])
    check_seconds("attack_budget", attack_budget)
    warn_if_oversubscribed(time_budget if time_budget is not None else attack_budget)
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise InputError(f"max_rounds must be an integer >= 1, got {max_rounds!r}")
    if isinstance(layers, str):
        raise InputError(
            f"layers must be a list of module names, e.g. [{layers!r}], not the string {layers!r}"
        )
    usable = cascade_layers(model)
    if not usable:
        raise InputError(
            f"{type(model).__name__} has no layer the cascade can attack: it needs an nn.Sequential "
            "(nested ones too) of Linear layers with a bias, each followed by a ReLU, from the data up "
            "(a CNN's convolutions, other activations, bias=False or a custom forward() stop it); "
            "attack one layer with spear.attack_layer instead"
        )
    order = list(usable if layers is None else layers)
    unusable = [name for name in order if name not in usable]
    if unusable or not order:
        raise InputError(
            f"layers {unusable or order} cannot be used by the cascade: it needs Linear layers with a "
            f"bias, followed by a ReLU, whose samples reach the data exactly ({usable})"
        )
    gradients = named_gradients(model, gradients)
    missing = [name for name, _ in model.named_parameters() if name not in gradients]
    if missing:
        raise InputError(
            f"the update lacks the gradients of {missing[:6]}: the cascade subtracts samples from "
            "every parameter, so it needs them all (model.named_parameters() names)"
        )
    gradients = _checked_tensors(model, gradients)
    if attack_budget is None and time_budget is not None:
        attack_budget = time_budget / (2 * len(order))
    plan = _Plan(order, time_budget, attack_budget, max_rounds, loss, progress, options)
    with budget_threads(time_budget if time_budget is not None else attack_budget):
        return _Cascade(model, gradients, plan).run()


def _checked_tensors(model: nn.Module, gradients: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The gradients of the model's parameters as tensors (:func:`spear.api._as_tensor`: numpy
    of any byte order, clear errors for sparse, meta or non-float values), each of its
    parameter's shape and finite; other keys (optimizer state, buffers) are left out.
    Checked up front: the cascade subtracts from every parameter, and a bad one would end every
    attack of every round in its own error (a list in the wrong order), or crash deep in torch
    (a transposed weight, a bias of the wrong length)."""
    shapes = dict(model.named_parameters())
    tensors = {}
    for name, grad in gradients.items():
        if name not in shapes:  # not the model's (optimizer state, buffers): not the update's
            continue
        tensor = _as_tensor(f"the gradient of {name!r}", grad)
        if tuple(tensor.shape) != tuple(shapes[name].shape):
            raise InputError(
                f"the gradient of {name!r} has shape {tuple(tensor.shape)} but the parameter has shape "
                f"{tuple(shapes[name].shape)}; pass each parameter's own gradient (a list goes in "
                "model.parameters() order)"
            )
        if not checks.all_finite(tensor):
            raise InputError(
                f"the gradient of {name!r} contains NaN or Inf; pass the finite tensors the server received"
            )
        tensors[name] = tensor
    return tensors


@dataclass(frozen=True)
class _Plan:
    """What :func:`attack_model` was asked to do."""

    order: list[str]
    time_budget: float | None
    attack_budget: float | None
    max_rounds: int
    loss: str | LossFn
    progress: Callable[[CascadeStep], None] | None
    options: dict[str, Any]

    @property
    def loss_fn(self) -> LossFn:
        return _cross_entropy if isinstance(self.loss, str) else self.loss


class _Cascade:
    """The state of one :func:`attack_model` run: the gradient left and the samples found."""

    def __init__(self, model: nn.Module, gradients: Mapping[str, torch.Tensor], plan: _Plan) -> None:
        self.model = model
        self.plan = plan
        self.original = {k: v.detach() for k, v in gradients.items()}
        #: each parameter's update norm, for :meth:`_largest_relative` (read every step)
        self._sent = {k: float(v.to(torch.float64).norm()) for k, v in self.original.items()}
        self._row_norms: dict[str, torch.Tensor] = {}  # each attacked layer's, for :meth:`_row_noise`
        self.residual = dict(self.original)
        self._left: float | None = None  # :meth:`_unexplained` of this residual, until it changes
        #: seconds to keep for the cascade's own closing reads of the update (:meth:`_reserve`)
        self._closing = 0.0
        self.found = _Found()
        self.steps: list[CascadeStep] = []
        self.start = time.perf_counter()
        # read off the update as the client sent it: the residuals' entries no longer show it
        dtype = plan.options.get("client_dtype") or source_precision(*self.original.values())
        self.client_dtype = dtype
        self.tol = Tolerances.for_dtype(dtype)
        self.explained_rtol = EXPLAINED_RTOL.get(dtype, self.tol.verify_rtol)
        self._client_left: tuple[int, float] | None = None  # (found samples, what they leave)
        self._svds: dict[str, GradientSVD] = {}  # the residual's, until it changes (:meth:`_inverter`)
        #: the largest batch an attack read off the update as sent (before any subtraction):
        #: dL/dW's rank, at most the number of samples (Theorem 3.1), see :class:`_Count`
        self.rank_seen = 0
        first = next(m for m in model.modules() if isinstance(m, nn.Linear))
        self.width = first.in_features

    def left(self) -> float | None:
        if self.plan.time_budget is None:
            return None
        return self.plan.time_budget - (time.perf_counter() - self.start)

    def run(self) -> CascadeResult:
        reason = "rounds"
        try:
            reason = self._passes()
        except KeyboardInterrupt:
            reason = "interrupted"
        return self._result(reason)

    def _passes(self) -> str:
        for round_ in range(self.plan.max_rounds):
            before = len(self.found.layers)
            for layer in self.plan.order:
                began = time.perf_counter()
                if self._count().complete:
                    return "complete"
                if self._unexplained() <= self.tol.verify_rtol:
                    return "explained"
                self._reserve(time.perf_counter() - began)
                left = self.left()
                if left is not None:
                    left -= self._closing
                if left is not None and left <= 0:
                    return "time budget"
                self._attack(layer, left, 2**round_)
            unbounded = self.plan.attack_budget is None and self.plan.options.get("max_proposals") is None
            if len(self.found.layers) == before and unbounded:
                return "exhausted"  # the next pass would run the same attacks again
        return "explained" if self._unexplained() <= self.tol.verify_rtol else "rounds"

    def _reserve(self, checking: float) -> None:
        """Keep time for the closing reads of a time-budgeted run: after its last attack the
        cascade reads the residual (:meth:`_unexplained`) and counts the batch (:meth:`_count`)
        once more, and builds the result, each about as long as the check before an attack just
        took (``checking`` seconds; at m = 4000, ~15 ms each: a 1 s budget ran 1.04-1.06 s when
        the last attack was given all the time left). The longest such check is kept, twice."""
        self._closing = max(self._closing, 2 * checking)

    def _attack(self, layer: str, left: float | None, scale: int) -> None:
        """One attack on the residual; each pass doubles the per-attack budgets (``scale``)."""
        options = {**self.plan.options, "client_dtype": self.client_dtype}
        options["row_noise"] = self._row_noise(layer)
        per_attack = None if self.plan.attack_budget is None else self.plan.attack_budget * scale
        budget = [t for t in (left, per_attack) if t is not None]
        if budget:
            options["time_budget"] = min(budget)
        if options.get("max_proposals") is not None:
            options["max_proposals"] = int(options["max_proposals"]) * scale
        began = time.perf_counter()
        try:
            rec = attack_layer(self.model, layer, self.residual, loss=self.plan.loss, **options)
        except (SpearError, RuntimeError) as exc:
            # e.g. the residual's rank cannot be read, or an SVD did not converge: nothing from
            # this layer, and the samples proven so far stay
            message = f"{type(exc).__name__}: {exc}"
            self._record(CascadeStep(layer, 0, 0, None, time.perf_counter() - began, "error", message))
            return
        if not self.found.inputs and rec.batch_size is not None:  # the update as sent
            self.rank_seen = max(self.rank_seen, rec.batch_size)
        added, notes = self._subtract(layer, rec)
        certified = 0 if rec.certified_inputs is None else int(rec.certified_inputs.shape[0])
        if rec.verified and rec.inputs is not None:
            certified = int(rec.inputs.shape[0])
        seconds = time.perf_counter() - began
        message = "; ".join([rec.message, *notes])
        step = CascadeStep(layer, added, certified, rec.batch_size, seconds, rec.stats.stop_reason, message)
        self._record(step)
        if rec.stats.stop_reason == "interrupted":  # Ctrl-C inside the attack, which kept its samples
            raise KeyboardInterrupt

    def _row_noise(self, layer: str) -> torch.Tensor | None:
        """What subtracting the found samples may leave in each row of ``layer``'s weight
        gradient without a sample in it: the verification tolerance of the client's precision,
        of the update's row (attack option ``row_noise``). Their gradients, recomputed from inputs
        known to that precision, leave the update's rounding in every row: float32 MNIST
        6 x 1000, b = 256, one sample left, up to 6.4e-6 of the update's row on ~490 rows it does
        not activate, which its attacks read as the mark of a missing sample and left it
        unverified (the frontier's seed 0 stopped at 255 of 256). Whether the batch is whole is
        read off the residual itself (:meth:`_count`), not off these attacks."""
        if not self.found.inputs:
            return None
        key = f"{layer}.weight" if layer else "weight"
        if key not in self._row_norms:  # of the update as sent: read once per layer
            self._row_norms[key] = self.original[key].to(torch.float64).norm(dim=1)
        return self.tol.verify_rtol * self._row_norms[key]

    def _record(self, step: CascadeStep) -> None:
        self.steps.append(step)
        if self.plan.progress is not None:
            self.plan.progress(step)

    def _inverter(self) -> RowSpaceInverter:
        """The row-space inversion at the client's precision as the cascade read it, with the
        lower layers' gradient SVDs shared until the next subtraction changes the gradients, and
        the cascade's deadline."""
        deadline = Deadline.after(self.plan.time_budget, self.start)
        return RowSpaceInverter(source_dtype=self.client_dtype, svds=self._svds, deadline=deadline)

    def _subtract(self, layer: str, rec: Reconstruction) -> tuple[int, list[str]]:
        """Take the attack's proven samples to the data; subtract the exact ones everywhere.
        Returns how many were subtracted and what the inversion noted."""
        samples = _proven_samples(rec)
        if samples is None:
            return 0, []
        hidden, labels, weights = samples
        notes: list[str] = []
        if is_hidden(self.model, layer):
            try:
                inversion = self._inverter()(self.model, layer, self.residual, rec)
            except InputError:
                return 0, []
            data, exact, notes = inversion.inputs, inversion.exact, list(inversion.notes)
        else:
            data, exact = hidden.to(torch.float64), torch.ones(hidden.shape[0], dtype=torch.bool)
        keep = exact.cpu() & (labels.cpu() >= 0) & torch.isfinite(weights.cpu()) & (weights.cpu() > 0)
        if not bool(keep.any()):
            return 0, notes
        data, labels, weights = data.cpu()[keep], labels.cpu()[keep], weights.cpu().to(torch.float64)[keep]
        taken = per_sample_gradients(self.model, data, labels, weights, self.plan.loss_fn)
        self._left = None  # the residual changes below (read again even if Ctrl-C comes mid-way)
        self.found.add(data, labels, weights, layer)  # proven: reported even if Ctrl-C comes next
        for name, grad in taken.items():
            if name in self.residual:
                current = self.residual[name]
                self.residual[name] = (current.to(torch.float64) - grad.to(current.device)).to(current.dtype)
        self._svds.clear()  # the gradients changed
        return int(data.shape[0]), notes

    def _unexplained(self) -> float:
        """The largest relative norm left in the gradients of the parameters by the found
        samples, in float64 (:meth:`_largest_relative`); for a half-precision client the less
        of that and what they leave in the client's own arithmetic
        (:meth:`_left_in_client_arithmetic`). Read once per residual."""
        if self._left is None:
            left = self._largest_relative(self.residual)
            if half_precision(self.client_dtype) and self.found.inputs:
                left = min(left, self._left_in_client_arithmetic())
            self._left = left
        return self._left

    def _largest_relative(self, residual: Mapping[str, torch.Tensor]) -> float:
        """The largest ``|residual| / |update|`` over every parameter of the model, biases and
        the layers the cascade does not attack included: a sample whose first-layer ReLUs are
        all off leaves nothing in the attacked weights but its share of every later bias and of
        the head (a review's update scaled by 8/7 with such a sample among 8 read as a complete
        batch of 7 while the attacked weights alone were checked). A parameter the client sent
        as exactly zero is one it did not train (frozen) and is left out. inf where a residual is not
        finite (a recomputation that overflowed explains nothing: ``max`` would skip its NaN,
        and a review's float32 client read as float16, half of it found, came out explained
        and complete)."""
        worst = 0.0
        for key, total in self._sent.items():
            if total == 0:  # not trained by the client (frozen, sent as zeros): nothing to explain
                continue
            left = float(residual[key].to(torch.float64).norm())
            if not math.isfinite(left):
                return math.inf
            worst = max(worst, left / total)
        return worst

    def _left_in_client_arithmetic(self) -> float:
        """The update less the found samples' gradients computed as a mixed-precision client
        computes them (``torch.autocast`` in the client's dtype). In float64 a float16
        client's whole, exactly found batch left 31 to 33 eps of its update (3-layer MLP,
        b = 16: ReLUs within float16's rounding of zero switched the other way, whole rows
        apart), above float16's verification tolerance of 10 eps, so the cascade never called
        such a batch complete and attacked the residual to its last round; computed as the
        client computed, it leaves 0.3 eps (bfloat16: 2.5 to 6.7 eps, about what float64
        leaves). Cached per number of found samples."""
        count = sum(int(x.shape[0]) for x in self.found.inputs)
        if self._client_left is None or self._client_left[0] != count:
            inputs, labels, weights = self.found.stacked(self.width)
            taken = per_sample_gradients(
                self.model, inputs, labels, weights, self.plan.loss_fn, autocast=self.client_dtype
            )
            left = {
                name: (sent := self.original[name].to(torch.float64)) - grad.to(sent.device, torch.float64)
                for name, grad in taken.items()
                if name in self.original
            }
            self._client_left = (count, self._largest_relative(left))
        return self._client_left[1]

    def _count(self) -> _Count:
        """What the found samples' loss weights say about the batch (see :class:`_Count`)."""
        inputs, _, weights = self.found.stacked(self.width)
        explained = self._unexplained() <= self.explained_rtol
        if not weights.numel():
            return _Count(None, None, torch.empty(0, dtype=torch.long), True, explained)
        clients = int(self.plan.options.get("clients") or 1)
        if clients > 1 and aggregate_multiples(weights, self.tol.verify_rtol):
            # a sample repeated in its client, or one of a smaller client: not determined
            reduction = BatchReduction(None, None, None)
        else:  # as attack_layer's verdict reads them
            reduction = infer_batch(weights, clients, self.tol.verify_rtol)
        gaps = torch.cdist(inputs, inputs, compute_mode="donot_use_mm_for_euclid_dist")
        gaps.fill_diagonal_(torch.inf)
        distinct = bool((gaps > self.tol.verify_rtol * inputs.norm(dim=1, keepdim=True)).all())
        batch_size, missing = reduction.batch_size, reduction.missing
        if clients > 1 and missing is not None:  # the K clients' samples together
            batch_size = int(weights.numel()) + missing
        if missing is not None and batch_size is not None and self.rank_seen > batch_size:
            missing += self.rank_seen - batch_size  # a layer saw more samples than the weights count
        return _Count(batch_size, missing, reduction.multiplicities, distinct, explained)

    def _result(self, reason: str) -> CascadeResult:
        inputs, labels, weights = self.found.stacked(self.width)
        count = self._count()
        layers = list(self.found.layers)
        if count.multiplicities is not None:  # a weight k/B, k >= 2, may be k samples' mean
            one = count.multiplicities == 1
            inputs, labels, weights = inputs[one], labels[one], weights[one]
            layers = [name for name, keep in zip(layers, one.tolist(), strict=True) if keep]
        return CascadeResult(
            inputs=inputs,
            labels=labels,
            weights=weights,
            layers=tuple(layers),
            complete=count.complete,
            residual=self._unexplained(),
            batch_size=count.batch_size,
            missing=count.missing,
            steps=tuple(self.steps),
            seconds=time.perf_counter() - self.start,
            stop_reason="complete" if count.complete else reason,
        )


@dataclass(frozen=True)
class _Count:
    """The batch as the found samples' weights count it, and whether the update agrees.

    Each found sample is certified with its loss weight ``k_j / B`` (a batch mean), so B is
    read off the weights, and the batch is whole when B distinct samples of weight ``1/B`` were
    found (``missing == 0``, every ``k_j == 1``) *and* they explain the update (``explained``:
    every parameter's gradient minus theirs within ``EXPLAINED_RTOL`` of it). The weights
    alone do not prove it: an update scaled by c (a learning rate, a sum loss) reads as a batch
    of B/c, and a column of weight 2/B can be two samples' mean (samples differing in a layer's
    null space). The residual alone does not either: a faint sample left unfound leaves
    little, and a float32 sample found to 1e-6 can flip a ReLU whose pre-activation is within
    that of zero, so that its recomputed gradient differs by a whole unit's row (measured:
    2.8e-3 of the update at MNIST 6 x 1000, b = 256, float32, seed 2, every sample exact).
    A third reading: the rank of a layer's gradient on the update as sent is at most the
    number of samples (Theorem 3.1), so where an attack read more than the weights count,
    ``missing`` is at least the difference (review 46c: an update scaled by 8/7 with a faint
    sample, 1e-9 of it in float64, read as a complete batch of 7 although both attacks had
    read b = 8)."""

    batch_size: int | None
    missing: int | None
    multiplicities: torch.Tensor | None  # k_j per found sample; None when the weights fit no mean or sum
    distinct: bool
    explained: bool

    @property
    def single(self) -> bool:
        """Every found sample carries one sample's weight."""
        return self.multiplicities is not None and bool((self.multiplicities == 1).all())

    @property
    def complete(self) -> bool:
        return self.missing == 0 and self.distinct and self.single and self.explained


def _proven_samples(rec: Reconstruction) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The attack's proven samples with labels and loss weights: the verified batch, else the
    certified samples (the order :class:`RowSpaceInverter` inverts them in); None without.
    A verified batch's weights are ``k_j / B`` for one client's mean, ``k_j`` for a sum, and
    ``1 / B_k`` of each sample's own client under secure aggregation (``client_sizes``: with a
    weight of 1, a review's two clients of 4 samples were subtracted four times over and the
    cascade never read them as complete)."""
    if rec.verified and rec.inputs is not None:
        if rec.labels is None or rec.multiplicities is None or rec.reduction is None:
            return None
        counts = rec.multiplicities.to(torch.float64)
        if rec.client_sizes is not None:
            return rec.inputs, rec.labels, counts / rec.client_sizes.to(counts)
        if rec.reduction == "sum":
            return rec.inputs, rec.labels, counts
        if rec.reduction != "mean" or not rec.client_batch_size:
            return None
        return rec.inputs, rec.labels, counts / rec.client_batch_size
    if rec.certified_inputs is None or rec.certified_labels is None or rec.certified_weights is None:
        return None
    return rec.certified_inputs, rec.certified_labels, rec.certified_weights
