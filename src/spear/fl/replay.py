"""Certifying a FedAvg reconstruction by replaying the client's local training.

The server configured the local epochs E, the learning rate eta and the mini-batch size, so
once it holds the recovered inputs X it can redo the client's training and compare the update
it would send with the one received. A match of the *whole* update (every layer, after E
epochs of a nonlinear network) is the certificate (``verified_by == "replay"``); SPEAR's
one-step checks (the ReLU pattern, the model certificate) do not apply to FedAvg's columns,
which sum a sample's gradients over several steps.

What the server does not know is filled in from the data:

* **labels**: sample j's recovered column ``u_j`` points along its per-sample gradient at the
  layer; the label whose gradient at the step it was used in is most parallel to ``u_j``.
* **mini-batch order** (shuffled privately by the client): with one step per epoch (the local
  batch is the whole batch) there is none to find. With one epoch of several steps the steps
  are identified one after another: at ``W_t`` exactly the samples of step t have
  ``u_j = g_j(W_t) / |B_t|`` (App. F's per-step view), and the next weights follow from them.
  Several epochs of several steps mix a sample's steps in ``u_j``; that order is not searched
  and such updates are reported as not certified.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from spear import checks
from spear.core.consistency import Tolerances
from spear.core.deadline import NEVER, Deadline
from spear.core.result import Reconstruction
from spear.errors import InputError
from spear.fl.protocols.fedavg import FedAvg, local_sgd
from spear.inversion.base import check_takes_the_data

#: a step's samples fit their per-sample gradient at that step to this (relative; the recovered
#: columns are exact to the attack's precision) ...
STEP_MISFIT = 1e-3
#: ... and fit this many times better than any sample of a later step
STEP_GAP = 10.0


@dataclass(frozen=True)
class ReplayCertificate:
    """The outcome of :func:`certify_by_replay`.

    Attributes:
        ok: the replayed update equals the received one within ``rtol``.
        labels: (b,) the labels used (in the order of the recovered inputs), or None.
        steps: the mini-batches identified, as index lists into the recovered inputs, or None.
        residual: relative error of the replayed update (inf when no replay was possible).
        message: one line for the user.
    """

    ok: bool
    labels: torch.Tensor | None
    steps: list[list[int]] | None
    residual: float
    message: str


def first_linear(model: nn.Module) -> str:
    """The name of the model's first ``nn.Linear`` (in an MLP, the layer whose inputs are the data)."""
    name = next((name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)), None)
    if name is None:
        raise InputError(f"the model ({type(model).__name__}) has no nn.Linear: SPEAR attacks a Linear layer")
    return name


def replay_layer(model: nn.Module, layer: str | None = None) -> str:
    """The layer whose recovered inputs the replay feeds to the model: ``layer``, by default the
    model's first Linear. A clear error unless its inputs are the data (only pass-through modules
    below it): the replay redoes the client's training from them, and a CNN's feature layer or
    a Linear behind a training-mode Dropout sees features, not the model's input."""
    layer = layer or first_linear(model)
    check_takes_the_data(
        model,
        layer,
        "FedAvg's replay certificate redoes the client's local training on the recovered inputs, so "
        "they must be the model's input",
        "Attack FedAvg updates of a model whose first Linear takes the data (an MLP or a tabular "
        "model), or attack this layer's update with certify=False (nothing is then certified)",
    )
    return layer


def layer_gradients(model: nn.Module, layer: str, inputs: torch.Tensor, classes: int) -> torch.Tensor:
    """Per-sample ``dL/dZ`` of ``layer`` for every label: (k, classes, m)."""
    module = dict(model.named_modules())[layer]
    outputs: list[torch.Tensor] = []

    def keep(mod, args, out):
        out.retain_grad()
        outputs.append(out)

    columns = []
    hook = module.register_forward_hook(keep)
    try:
        for label in range(classes):
            outputs.clear()
            targets = torch.full((inputs.shape[0],), label, dtype=torch.long)
            loss = nn.functional.cross_entropy(model(inputs), targets, reduction="sum")
            (grad,) = torch.autograd.grad(loss, outputs[0])
            columns.append(grad.detach())
    finally:
        hook.remove()
    return torch.stack(columns, dim=1)


def _classes(model: nn.Module, inputs: torch.Tensor) -> int:
    with torch.no_grad():
        return int(model(inputs[:1]).shape[1])


def best_labels(columns: torch.Tensor, per_label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The label whose gradient is most parallel to each column, and that gradient: columns
    (k, m), per_label (k, classes, m)."""
    cos = nn.functional.cosine_similarity(per_label, columns[:, None, :], dim=-1)
    labels = cos.argmax(dim=1)
    return labels, per_label[torch.arange(labels.numel()), labels]


def _misfit(columns: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    return (columns - predicted).norm(dim=1) / columns.norm(dim=1).clamp_min(torch.finfo(columns.dtype).tiny)


def replay_update(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, steps: list[list[int]], lr: float
) -> dict[str, torch.Tensor]:
    """The update ``(W_before - W_after) / lr`` a client with this data and order would send."""
    local = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in local.named_parameters()}
    local_sgd(local, inputs, labels, [torch.tensor(s, dtype=torch.long) for s in steps], lr)
    return {name: (before[name] - p.detach()) / lr for name, p in local.named_parameters()}


def update_residual(received: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor]) -> float:
    """Relative error of a replayed update over all parameters (one Frobenius norm)."""
    diff = sum(float((received[k].double() - replayed[k].double()).pow(2).sum()) for k in replayed)
    norm = sum(float(received[k].double().pow(2).sum()) for k in replayed)
    return (diff / norm) ** 0.5 if norm > 0 else float("inf")


@checks.outside_inference_mode
def certify_by_replay(
    model: nn.Module,
    update: dict[str, torch.Tensor],
    protocol: FedAvg,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    layer: str | None = None,
    rtol: float = 1e-6,
    deadline: Deadline = NEVER,
) -> ReplayCertificate:
    """Certify recovered inputs (b, n) with their columns (m, b) of the attacked first layer
    by replaying ``protocol``'s local training on ``model`` (see the module doc); ``layer``
    defaults to the model's first Linear. Past ``deadline`` (checked between replayed passes)
    the batch is left uncertified, and the message says so."""
    try:
        return _certify_by_replay(model, update, protocol, inputs, grad_outputs, layer, rtol, deadline)
    except _ReplayLateError:
        return ReplayCertificate(
            False,
            None,
            None,
            float("inf"),
            "replay: the time budget ran out before the replay finished; the batch is unchecked by it",
        )


class _ReplayLateError(Exception):
    """The replay's deadline passed between two of its passes."""


def _on_time(deadline: Deadline) -> None:
    if deadline.passed():
        raise _ReplayLateError


def _certify_by_replay(
    model: nn.Module,
    update: dict[str, torch.Tensor],
    protocol: FedAvg,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    layer: str | None,
    rtol: float,
    deadline: Deadline,
) -> ReplayCertificate:
    """:func:`certify_by_replay` with its deadline checked (:class:`_ReplayLateError`)."""
    layer = replay_layer(model, layer)
    check_update(model, update)
    b = inputs.shape[0]
    param = next(model.parameters())  # the replay runs on the model, whatever the attack's device
    x, u = inputs.to(param), grad_outputs.T.to(param)
    size = min(protocol.batch_size or b, b)
    per_epoch = -(-b // size)
    if per_epoch == 1:
        steps = [list(range(b))] * protocol.epochs
        labels, _ = best_labels(u, layer_gradients(model, layer, x, _classes(model, x)))
        labels = refine_labels(model, layer, x, u, labels, steps, protocol.lr, deadline)
    elif protocol.epochs == 1:
        found = _identify_steps(model, layer, x, u, size, protocol.lr, deadline)
        if found is None:
            return ReplayCertificate(
                False,
                None,
                None,
                float("inf"),
                "replay: the samples of some local step could not be identified (no set of the "
                "step's size fits its per-sample gradients)",
            )
        labels, steps = found
    else:
        return ReplayCertificate(
            False,
            None,
            None,
            float("inf"),
            f"replay: {protocol.epochs} epochs of {per_epoch} steps each mix every sample's steps in "
            "its column; the client's private mini-batch order is not searched, so the batch is not "
            "certified (it is exact when every sample is; see the metrics)",
        )
    if rtol > REPLAY_RTOL_CAP:
        return ReplayCertificate(
            False,
            labels,
            steps,
            float("inf"),
            f"replay: the update keeps only {rtol:.0e} of relative precision ((W_before - W_after) / lr "
            f"cancels at this learning rate and dtype), too little to certify a batch",
        )
    _on_time(deadline)
    replayed = replay_update(model, x, labels, steps, protocol.lr)
    residual = update_residual(update, replayed)
    _on_time(deadline)
    misfit = column_misfits(model, layer, x, u, labels, steps, protocol.lr)
    worst = int(misfit.argmax())
    ok = residual <= rtol and float(misfit[worst]) <= rtol
    verdict = "equals" if ok else "does not equal"
    message = (
        f"replay: the local training on the recovered batch ({protocol.epochs} epoch(s), "
        f"{len(steps)} step(s), lr {protocol.lr}) {verdict} the received update "
        f"(relative error {residual:.1e}; worst sample's column {float(misfit[worst]):.1e}; "
        f"tolerance {rtol:.0e})"
    )
    return ReplayCertificate(ok, labels, steps, residual, message)


def column_misfits(
    model: nn.Module,
    layer: str,
    x: torch.Tensor,
    u: torch.Tensor,
    labels: torch.Tensor,
    steps: list[list[int]],
    lr: float,
) -> torch.Tensor:
    """Each sample's own check: its recovered column ``u_j`` against its per-sample gradients
    summed along the replayed training (``sum over its steps of g_j(W_t; y_j) / |B_t|``),
    relative. The whole update's residual averages over the batch, so one wrong sample among
    many could hide in it; this cannot."""
    per_label = summed_gradients(model, layer, x, labels, steps, lr)
    predicted = per_label[torch.arange(x.shape[0]), labels]
    return _misfit(u, predicted)


def summed_gradients(
    model: nn.Module, layer: str, x: torch.Tensor, labels: torch.Tensor, steps: list[list[int]], lr: float
) -> torch.Tensor:
    """Along the training replayed with ``labels``: for every sample and label, the sum over the
    sample's steps of its per-sample gradient at ``layer`` over the step's size, (b, classes, m)."""
    local = copy.deepcopy(model)
    classes = _classes(local, x)
    total: torch.Tensor | None = None
    for step in steps:
        index = torch.tensor(step, dtype=torch.long)
        grads = layer_gradients(local, layer, x[index], classes) / len(step)
        if total is None:
            total = torch.zeros(x.shape[0], *grads.shape[1:], dtype=grads.dtype)
        total[index] += grads
        local_sgd(local, x, labels, [index], lr)
    assert total is not None
    return total


#: rounds of label refinement along the replayed trajectory
REFINE_ROUNDS = 4


def refine_labels(
    model: nn.Module,
    layer: str,
    x: torch.Tensor,
    u: torch.Tensor,
    labels: torch.Tensor,
    steps: list[list[int]],
    lr: float,
    deadline: Deadline = NEVER,
) -> torch.Tensor:
    """Labels that fit the columns along the whole local training: sample j's column is
    ``sum over its steps t of g_j(W_t; y_j) / |B_t|``. Replay with the current labels, recompute
    that sum for every label, keep the most parallel; repeat until the labels settle (a label
    guessed from the first step alone can be wrong after many epochs)."""
    for _ in range(REFINE_ROUNDS):
        _on_time(deadline)
        total = summed_gradients(model, layer, x, labels, steps, lr)
        refined, _ = best_labels(u, total)
        if bool((refined == labels).all()):
            break
        labels = refined
    return labels


def _identify_steps(
    model: nn.Module, layer: str, x: torch.Tensor, u: torch.Tensor, size: int, lr: float, deadline: Deadline
) -> tuple[torch.Tensor, list[list[int]]] | None:
    """One epoch: find each step's samples in turn (module doc); None when a step does not fit."""
    b = x.shape[0]
    local = copy.deepcopy(model)
    classes = _classes(local, x)
    labels = torch.full((b,), -1, dtype=torch.long)
    remaining = list(range(b))
    steps: list[list[int]] = []
    while remaining:
        _on_time(deadline)
        count = min(size, len(remaining))
        rest = torch.tensor(remaining)
        guess, predicted = best_labels(u[rest], layer_gradients(local, layer, x[rest], classes))
        misfit = _misfit(u[rest], predicted / count)
        order = misfit.argsort()
        fits = torch.zeros_like(misfit, dtype=torch.bool)
        fits[order[:count]] = True
        worst_in = float(misfit[order[count - 1]])
        best_out = float(misfit[order[count]]) if count < rest.numel() else float("inf")
        if worst_in > STEP_MISFIT or best_out < STEP_GAP * worst_in:
            return None  # the step's samples do not stand out: the order is not determined
        chosen = rest[fits]
        labels[chosen] = guess[fits]
        steps.append(chosen.tolist())
        local_sgd(local, x, labels, [chosen], lr)
        remaining = [i for i in remaining if i not in set(chosen.tolist())]
    return labels, steps


#: the update's rounding floor is multiplied by this for the replay's tolerance
ROUNDING_SLACK = 10.0
#: a replay tolerance above this (an update that kept too few digits) certifies nothing
REPLAY_RTOL_CAP = 1e-2


def check_update(model: nn.Module, update: dict[str, torch.Tensor]) -> None:
    """Raise :class:`InputError` unless ``update`` holds a tensor of the right shape for every
    parameter of ``model`` (the replay compares all of them)."""
    if not isinstance(update, Mapping):
        raise InputError(
            f"the update must be a dict parameter name -> tensor (model.named_parameters() names), "
            f"got {type(update).__name__}"
        )
    params = dict(model.named_parameters())
    missing = [name for name in params if name not in update]
    if missing:
        raise InputError(
            f"the update lacks {missing} (has {sorted(update)}); the replay needs one tensor per "
            "parameter of the model, named as in model.named_parameters()"
        )
    for name, p in params.items():
        value = update[name]
        if not isinstance(value, torch.Tensor) or value.shape != p.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(f"the update's {name!r} is {got}, the model's parameter is {tuple(p.shape)}")
        if not value.is_floating_point():
            raise InputError(f"the update's {name!r} holds {value.dtype}; it must be floating point")


def replay_tolerance(model: nn.Module, update: dict[str, torch.Tensor], protocol: FedAvg) -> float:
    """Relative tolerance of a replayed update: the dtype's verification tolerance, or the
    rounding floor of ``(W_before - W_after) / lr`` if that is larger. The subtraction cancels:
    each entry keeps about ``eps |W| / (lr |update|)`` of relative precision (float32 weights
    of 0.05 and steps of 1e-4 leave 3 digits), for the client and the replay alike."""
    check_update(model, update)
    names = [name for name, _ in model.named_parameters()]  # the replay compares these only
    dtype = update[names[0]].dtype  # not a buffer's
    eps = torch.finfo(dtype).eps
    weights = sum(float(p.detach().double().pow(2).sum()) for p in model.parameters()) ** 0.5
    size = sum(float(update[name].double().pow(2).sum()) for name in names) ** 0.5
    floor = eps * weights / (protocol.lr * size) if size > 0 else float("inf")
    return max(Tolerances.for_dtype(dtype).verify_rtol, ROUNDING_SLACK * floor)


class ReplayCheck:
    """A ``stop_when`` check for the attack: does the replay certify this batch? It keeps the
    certificate of the batch it accepted, so the verdict after the attack
    (:func:`apply_replay`) does not replay that batch again (review 47: a second replay, after
    an attack its first one had stopped, ran 6.6 s past a 1 s attack on a loaded machine). The
    certificate is handed on only for what it proved: the same batch (dtype and bits), protocol
    settings, model weights and update as when it accepted (review 47b: a changed ``lr``, an
    update scaled in place or weights moved in place had kept a certificate no longer true)."""

    def __init__(
        self, model: nn.Module, update: dict[str, torch.Tensor], protocol: FedAvg, layer: str | None = None
    ) -> None:
        self.model, self.update, self.protocol = model, update, protocol
        self.layer = replay_layer(model, layer)
        self.rtol = replay_tolerance(model, update, protocol)
        self.accepted: _Accepted | None = None

    def __call__(self, inputs: torch.Tensor, grad_outputs: torch.Tensor) -> bool:
        args = (self.model, self.update, self.protocol, inputs, grad_outputs, self.layer, self.rtol)
        cert = certify_by_replay(*args)
        if cert.ok:
            self.accepted = _Accepted.of(self.model, self.update, self.protocol, inputs, grad_outputs, cert)
        return cert.ok

    def certificate_for(
        self,
        model: nn.Module,
        update: dict[str, torch.Tensor],
        protocol: FedAvg,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor,
    ) -> ReplayCertificate | None:
        """The certificate this check gave exactly this batch of this update, or None."""
        if self.accepted is None or not self.accepted.holds_for(
            model, update, protocol, inputs, grad_outputs
        ):
            return None
        return self.accepted.certificate


def _same(saved: torch.Tensor, now: torch.Tensor) -> bool:
    return saved.dtype == now.dtype and saved.shape == now.shape and torch.equal(saved, now.detach().cpu())


@dataclass(frozen=True)
class _Accepted:
    """What a replay certificate was given for: copies of the batch, the update, the weights
    and the protocol's settings when it accepted."""

    inputs: torch.Tensor
    grad_outputs: torch.Tensor
    update: dict[str, torch.Tensor]
    weights: tuple[torch.Tensor, ...]
    settings: dict
    certificate: ReplayCertificate

    @classmethod
    def of(
        cls,
        model: nn.Module,
        update: Mapping[str, torch.Tensor],
        protocol: FedAvg,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor,
        certificate: ReplayCertificate,
    ) -> _Accepted:
        def copy_of(t: torch.Tensor) -> torch.Tensor:
            return t.detach().cpu().clone()

        return cls(
            copy_of(inputs),
            copy_of(grad_outputs),
            {name: copy_of(value) for name, value in update.items()},
            tuple(copy_of(p) for p in model.parameters()),
            protocol.settings(),
            certificate,
        )

    def holds_for(
        self,
        model: nn.Module,
        update: Mapping[str, torch.Tensor],
        protocol: FedAvg,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor,
    ) -> bool:
        weights = list(model.parameters())
        return (
            protocol.settings() == self.settings
            and _same(self.inputs, inputs)
            and _same(self.grad_outputs, grad_outputs)
            and set(update) == set(self.update)
            and all(_same(self.update[name], value) for name, value in update.items())
            and len(weights) == len(self.weights)
            and all(_same(saved, p) for saved, p in zip(self.weights, weights, strict=True))
        )


def replay_accepts(
    model: nn.Module, update: dict[str, torch.Tensor], protocol: FedAvg, layer: str | None = None
) -> ReplayCheck:
    """A ``stop_when`` check for the attack (:class:`ReplayCheck`)."""
    return ReplayCheck(model, update, protocol, layer)


@checks.outside_inference_mode
def apply_replay(
    model: nn.Module,
    update: dict[str, torch.Tensor],
    protocol: FedAvg,
    rec: Reconstruction,
    layer: str | None = None,
    deadline: Deadline = NEVER,
    check: ReplayCheck | None = None,
) -> Reconstruction:
    """``rec`` (an attack on ``model``'s first layer ``layer``) with the replay's verdict: verified
    by "replay" and labelled when the replayed update matches, otherwise not verified, with the
    reason. Without a recovered batch, ``rec`` is returned unchanged. The certificate ``check``
    (the attack's ``stop_when``) gave this very batch is taken as it is; otherwise the replay
    runs until ``deadline``."""
    if rec.inputs is None or rec.grad_outputs is None:
        return rec
    cert = (
        None
        if check is None or check.layer != replay_layer(model, layer)  # certified for its own layer
        else check.certificate_for(model, update, protocol, rec.inputs, rec.grad_outputs)
    )
    if cert is None:
        rtol = replay_tolerance(model, update, protocol)
        cert = certify_by_replay(model, update, protocol, rec.inputs, rec.grad_outputs, layer, rtol, deadline)
    notes = (*rec.notes, f"attack before the replay: {rec.message}")
    if cert.ok:
        message = f"exact: all {rec.batch_size} inputs recovered, certified by the replay; {cert.message}"
        return dataclasses.replace(
            rec, verified=True, verified_by="replay", labels=cert.labels, message=message, notes=notes
        )
    message = f"not certified: {cert.message}"
    return dataclasses.replace(rec, verified=False, verified_by=None, message=message, notes=notes)
