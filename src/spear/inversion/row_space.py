"""Exact inversion of certified samples one at a time, through each lower layer's row space.

:class:`~spear.inversion.exact.GradientInverter` needs the whole recovered batch (every
sample's output gradient, to form ``D`` of rank b). An attack that stops short of the batch
still certifies samples one by one (``Reconstruction.certified_inputs``), and each of those
traces down on its own: the inputs of a linear layer lie in the row space of its weight
gradient, and on the units a sample activates its outputs are linear in them
(:func:`spear.core.backtrack.invert_relu_linear`). So every certified hidden sample becomes a
certified model input, with no other sample known.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import torch
from torch import nn

from spear.core.backtrack import GradientSVD, RowSpace, invert_relu_linear
from spear.core.consistency import Tolerances
from spear.core.deadline import NEVER, Deadline, LateError, finish_by
from spear.core.result import Reconstruction
from spear.errors import InputError
from spear.inversion.base import Inversion, Inverter, acting_layers_below, layers_below


class RowSpaceInverter(Inverter):
    """Per-sample exact inversion through ``Linear -> ReLU`` layers (see the module doc).

    It inverts the reconstruction's verified batch, else its certified samples. The result's
    ``exact`` flags each sample: at every layer the data determined its inputs to ``rtol``
    (their estimated error, :func:`spear.core.backtrack.invert_relu_linear`), the solution
    reproduced the sample's outputs to ``rtol``, and a solved ReLU output was nonnegative
    (``rtol`` default: the verification tolerance of the gradients' dtype, 1e-8 in float64,
    1e-3 in float32).
    ``verified`` is True when every sample is exact (the inputs it starts from are proven: a
    verified batch or certified samples).
    """

    name = "row space"

    def __init__(
        self,
        rtol: float | None = None,
        source_dtype: torch.dtype | None = None,
        *,
        svds: MutableMapping[str, GradientSVD] | None = None,
        deadline: Deadline = NEVER,
    ) -> None:
        self.rtol = rtol
        #: the precision the client computed in, where the gradients' containers overstate it
        #: (float16 values in float64 tensors: a review's cascade inverted none of 16 verified
        #: hidden inputs at float64's tolerances); None: read off the containers
        self.source_dtype = source_dtype
        #: the lower layers' gradient SVDs by layer name, filled as they are computed: a caller
        #: that inverts several times from the same gradients passes one dict
        self.svds: MutableMapping[str, GradientSVD] = {} if svds is None else svds
        #: no SVD and no chunk of samples (each traced through every layer) is started once
        #: this has passed, and the wait for an SVD ends at it: the rest are left not exact,
        #: and a note says so
        self.deadline = deadline

    def _linears_below(self, model: nn.Module, layer: str) -> list[tuple[str, nn.Linear]]:
        return [(n, m) for n, m in layers_below(model, layer) if isinstance(m, nn.Linear)]

    def _svd(self, name: str, gradients: Mapping[str, torch.Tensor]) -> GradientSVD:
        """The layer's gradient SVD, cached; :class:`LateError` when the deadline passes during it
        (it cannot be cut: the late one is dropped, not cached)."""
        if name not in self.svds:
            grad = torch.as_tensor(gradients[_key(name)]).detach()
            self.svds[name] = finish_by(self.deadline, lambda: GradientSVD.of(grad))
        return self.svds[name]

    def applies(self, model: nn.Module, layer: str) -> bool:
        """Pairs of ``Linear -> ReLU`` below ``layer`` (pass-through modules aside), nothing else."""
        below = [m for _, m in acting_layers_below(model, layer)]
        pairs = zip(below[0::2], below[1::2], strict=False)
        return len(below) % 2 == 0 and all(
            isinstance(a, nn.Linear) and isinstance(r, nn.ReLU) for a, r in pairs
        )

    def __call__(
        self,
        model: nn.Module,
        layer: str,
        gradients: Mapping[str, torch.Tensor],
        reconstruction: Reconstruction,
    ) -> Inversion:
        attacked = dict(model.named_modules()).get(layer)
        if not isinstance(attacked, nn.Linear):
            raise InputError(f"module {layer!r} is a {type(attacked).__name__}, not the attacked nn.Linear")
        if not self.applies(model, layer):
            raise InputError(
                f"the row-space inversion needs Linear -> ReLU pairs below {layer!r} and nothing else; "
                "use spear.inversion.invert_to_inputs for this model"
            )
        hidden = _proven_inputs(reconstruction)
        width = attacked.in_features
        if hidden.ndim != 2 or hidden.shape[1] != width:
            raise InputError(
                f"the recovered inputs are {tuple(hidden.shape)}; layer {layer!r} takes (k, {width})"
            )
        linears = self._linears_below(model, layer)
        if not linears:  # the first layer: its inputs are the data
            every = torch.ones(hidden.shape[0], dtype=torch.bool)
            return Inversion(hidden.to(torch.float64), "identity", True, 0.0, exact=every)
        missing = [n for n, _ in linears if _key(n) not in gradients]
        if missing:
            raise InputError(f"the update lacks the weight gradients of layers {missing}: they are needed")
        dtype = self.source_dtype or _source_dtype(torch.as_tensor(gradients[_key(n)]) for n, _ in linears)
        tol = Tolerances.for_dtype(dtype, verify_rtol=self.rtol)
        k = hidden.shape[0]
        spaces = []
        for name, linear in reversed(linears):  # top first
            try:  # none is started late, and the wait for one ends at the deadline
                svd = self._svd(name, gradients)  # its rank read at the containers' precision
            except LateError:
                break
            space = svd.row_space(svd.dtype, reconstruction.batch_size)
            # W V^T once per layer, not once per chunk of samples
            spaces.append((linear, space, linear.weight.detach().to(torch.float64) @ space.basis.T))
        if len(spaces) < len(linears):
            spaces = []
        inputs = torch.full((k, linears[0][1].in_features), torch.nan, dtype=torch.float64)
        exact = torch.zeros(k, dtype=torch.bool)
        worst = torch.full((k,), torch.inf, dtype=torch.float64)
        traced = 0
        while spaces and traced < k and not self.deadline.passed():
            part = slice(traced, traced + CHUNK)
            inputs[part], exact[part], worst[part] = _trace(hidden[part], spaces, dtype, tol)
            traced = min(k, traced + CHUNK)
        notes = []
        if traced < k:
            notes.append(f"{k - traced} sample(s) not traced to the data: the time budget ran out first")
        if not bool(exact[:traced].all()):
            notes.append(f"{int((~exact[:traced]).sum())} sample(s) not determined or not consistent")
        residual = float(worst[exact].max()) if bool(exact.any()) else float("inf")
        return Inversion(inputs, self.name, bool(exact.all()), residual, notes, exact=exact)


#: samples traced together through every layer between two looks at the deadline
CHUNK = 16


def _trace(
    hidden: torch.Tensor,
    spaces: list[tuple[nn.Linear, RowSpace, torch.Tensor]],
    dtype: torch.dtype,
    tol: Tolerances,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples (k, width) of the attacked layer traced down through ``spaces`` (each lower
    linear layer, top first, with its gradient's row space and ``W V^T``): their inputs, whether
    each is exact, and each one's worst misfit (:func:`spear.core.backtrack.invert_relu_linear`)."""
    inputs = hidden.to(torch.float64)
    exact = torch.ones(inputs.shape[0], dtype=torch.bool)
    worst = torch.zeros(inputs.shape[0], dtype=torch.float64)
    precision: torch.Tensor | float = torch.finfo(dtype).eps  # the recovered inputs'
    for depth, (linear, space, projected) in enumerate(spaces):
        bias = linear.bias.detach() if linear.bias is not None else torch.zeros(linear.out_features)
        weight = linear.weight.detach()
        step = invert_relu_linear(
            inputs, weight, bias, space, precision, tol.verify_rtol, tol.zero_rtol, projected
        )
        inputs, exact, worst = step.inputs, exact & step.exact, torch.maximum(worst, step.misfit)
        precision = step.precision
        if depth < len(spaces) - 1:  # a ReLU's output: negative entries fit no input below
            floor = -tol.verify_rtol * inputs.abs().amax(dim=1)
            exact &= (inputs >= floor[:, None]).all(dim=1)
    return inputs, exact, worst


def _proven_inputs(reconstruction: Reconstruction) -> torch.Tensor:
    """The verified batch, else the certified samples, else a clear error."""
    if reconstruction.verified and reconstruction.inputs is not None:
        return reconstruction.inputs.detach().cpu()
    if reconstruction.certified_inputs is not None and reconstruction.certified_inputs.shape[0]:
        return reconstruction.certified_inputs.detach().cpu()
    raise InputError(
        "the reconstruction has no verified batch and no certified sample: only proven inputs are "
        "inverted one by one (raise the attack's budget)"
    )


def _key(name: str) -> str:
    return f"{name}.weight" if name else "weight"


def _source_dtype(tensors) -> torch.dtype:
    """The least precise floating dtype among the gradients."""
    return max((t.dtype for t in tensors), key=lambda d: torch.finfo(d).eps)
