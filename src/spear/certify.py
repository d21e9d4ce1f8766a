"""The model-level certificate: each recovered sample checked on its own through the rest of
the network, and its label recovered.

For a sample ``x_j`` of the attacked layer ``Z = W X + b`` and its recovered column
``dL/dZ_j``, run ``z_j = W x_j + b`` forward through the rest of the model (the *tail*) and back,
once per class ``y``: the per-sample loss gradient ``g_y = d loss(tail(z), y) / dz`` at ``z_j``.
The sample is certified when, for exactly one label,

    || dL/dZ_j - s g_y || <= rtol || dL/dZ_j ||   with a fitted weight s > 0,

i.e. the recovered column is what that labelled sample contributes to the client's gradient
(``s = 1/B`` for a batch mean over B samples, ``1`` for a sum, k times that for a sample present
k times: :func:`spear.core.certificate.infer_reduction`). Samples are certified independently
of each other, and mixtures of samples fail (softmax and the deeper ReLUs are nonlinear, so a
combination of samples' gradients is not the gradient of the combined sample). It applies to
any layer, first or later, whose tail is known: for ``nn.Sequential`` models (nested ones too)
spear-fl finds it itself (:func:`model_tail`).

Assumptions (when they fail, nothing verifies through the model and the result's notes say
why, see :class:`spear.core.verdict.ModelGate`): a per-sample classification loss (cross-entropy by
default, or any ``loss(logits, labels) -> per-sample losses``), and a tail without batch
coupling (no batch-norm statistics, no dropout: it runs in eval mode).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from spear.core.certificate import SampleCertificates
from spear.core.consistency import Z_RTOL_FRACTION
from spear.errors import InputError
from spear.inversion.base import PASS_THROUGH

#: how many numbers one batched gradient step may hold (samples x classes x width)
CHUNK_ELEMENTS = 2**24
#: two labels' gradients with |cos| above this are parallel: the fit cannot tell them apart
#: by direction (two classes), only by sign and scale
PARALLEL_COS = 1.0 - 1e-4
#: a sample no label fits is refitted with the gates of at most this many units of the tail's
#: deeper ReLUs flipped (those nearest zero within the band; 2**this - 1 refits) ...
TAIL_FLIPS = 3
#: ... where its best label's misfit is at most this: a bound on the work, since most
#: mixtures of samples miss by more (those that do not fail the refits as they fail the fit)
TAIL_FLIP_MISFIT = 0.5
#: activations after which dL/dZ has no zeros
DENSE_ACTIVATIONS = (
    nn.Tanh,
    nn.Sigmoid,
    nn.GELU,
    nn.SiLU,
    nn.ELU,
    nn.LeakyReLU,
    nn.Softplus,
    nn.Mish,
    nn.Hardtanh,
    nn.Linear,
)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels, reduction="none")


def model_tail(model: nn.Module, layer: str) -> nn.Sequential | None:
    """The modules after ``layer`` as one module from its output Z to the model's output, for
    (nested) ``nn.Sequential`` models; None when the model is built otherwise (a custom
    ``forward``), where the tail cannot be read off."""
    container: nn.Module = model
    rests: list[list[nn.Module]] = []
    for name in layer.split(".") if layer else []:
        if not isinstance(container, nn.Sequential):
            return None
        children = list(container.named_children())
        names = [n for n, _ in children]
        if name not in names:
            return None
        index = names.index(name)
        rests.append([m for _, m in children[index + 1 :]])
        container = children[index][1]
    tail: list[nn.Module] = []
    for rest in reversed(rests):
        tail.extend(rest)
    return nn.Sequential(*tail)


def activation_after(tail: nn.Sequential) -> nn.Module | None:
    """The first module of ``tail`` that changes the layer's output (None if there is none),
    looking into nested ``nn.Sequential`` containers."""
    for module in tail:
        if isinstance(module, nn.Sequential):
            inner = activation_after(module)
            if inner is not None:
                return inner
            continue
        if isinstance(module, PASS_THROUGH):
            continue
        return module
    return None


def check_sparsity_side(tail: nn.Sequential | None, layer: str, mode: str) -> None:
    """A clear error when the model shows that the attacked side cannot be ReLU-sparse."""
    if tail is None or mode != "output":
        return
    following = activation_after(tail)
    if isinstance(following, nn.Hardtanh) and following.min_val == 0:  # ReLU6 and its kin
        from spear.errors import NoSparsityError

        raise NoSparsityError(
            f"layer {layer!r} is followed by {type(following).__name__} (a ReLU clipped at "
            f"{following.max_val:g}): attack_layer and its model certificate support ReLU only. Its "
            "zeros are a ReLU's where no pre-activation reaches the clip, so "
            "spear.reconstruct(W, b, dW, db) can attack the layer alone (layer-level verification; "
            "a batch with clipped entries does not verify)"
        )
    if isinstance(following, DENSE_ACTIVATIONS):
        from spear.errors import NoSparsityError

        raise NoSparsityError(
            f"layer {layer!r} is followed by {type(following).__name__}, not a ReLU: its output "
            "gradient dL/dZ has no zeros, and SPEAR needs a ReLU after the layer (sparsity='output') "
            "or before it (sparsity='input')"
        )


class ModelCertifier:
    """Certifies samples of one layer through the rest of the model (see the module doc).

    It takes per-sample misfit tolerances (``accepts_sample_rtol``): the attack loosens them
    for samples whose columns the data know less precisely (faint gradients).

    Args:
        tail: the modules after the layer (its output Z -> the logits the loss sees).
        weight, bias: the layer's W (m x n) and b (m,).
        rtol: relative misfit up to which a sample is certified (the verification tolerance of
            the gradient's dtype is the right scale).
        saturation: a sample whose gradient changes by at most this (relative) per relative
            change of its pre-activations is *saturated* (see ``SampleCertificates``); about
            1e3 eps of the gradient's dtype: below, two such samples' columns coincide within
            its precision.
        loss: "cross_entropy" or a callable ``loss(logits, labels) -> per-sample losses``;
            every label ``0..C-1`` (C = the tail's output width) is tried.
        source_dtype: the dtype the client computed its gradient in, for :meth:`rounding` (the
            precision of each sample's column as the client computed it); None: not modelled.
        z_rtol: where a ReLU follows the layer, a pre-activation within this of the sample's
            largest positive one has no sign the data can tell (the client's rounding may have
            put it on the other side: :mod:`spear.core.consistency`). Its entry must fit one of
            the two gates: the open gate's gradient (at the same fitted weight) or zero; it
            takes no part in fitting the weight. Default: the verification's band,
            ``Z_RTOL_FRACTION * rtol``. A float32 first layer of width 4000 had a sample with
            one pre-activation at -3e-8 of its largest where the client's was positive: its
            column's entry there, 0.45 of the largest, failed the fit at 0.45.
        half_precision: the columns were computed in float16 or bfloat16 (a client under
            autocast): the saturation threshold (1e3 eps, about 1 there) then reads on nearly
            every sample, and the verdict counts saturation only where another sample of the
            batch can hide in a column (:func:`spear.core.verdict.saturation_ambiguous`).
    """

    accepts_sample_rtol = True

    def __init__(
        self,
        tail: nn.Module,
        weight: torch.Tensor,
        bias: torch.Tensor,
        rtol: float,
        loss: str | LossFn = "cross_entropy",
        saturation: float = 0.0,
        source_dtype: torch.dtype | None = None,
        z_rtol: float | None = None,
        half_precision: bool = False,
    ) -> None:
        self.half_precision = half_precision
        self.source_eps = None if source_dtype is None else torch.finfo(source_dtype).eps
        self.models_rounding = isinstance(loss, str) and source_dtype is not None
        if isinstance(loss, str):
            if loss != "cross_entropy":
                raise InputError(f"unknown loss {loss!r}; use 'cross_entropy' or pass a callable")
            loss = _cross_entropy
        self.loss: LossFn = loss
        self.weight = weight.detach().to(torch.float64)
        self.bias = bias.detach().to(torch.float64)
        self.tail = copy.deepcopy(tail).to(device=self.weight.device, dtype=torch.float64).eval()
        for p in self.tail.parameters():
            p.requires_grad_(False)
        self.rtol = rtol
        self.saturation = saturation
        relu_gated = isinstance(tail, nn.Sequential) and isinstance(activation_after(tail), nn.ReLU)
        band = Z_RTOL_FRACTION * rtol if z_rtol is None else z_rtol
        self.z_rtol = band if relu_gated else 0.0
        #: whether the layer's own ReLU follows it: only then has it a pattern
        self.relu_gated = relu_gated
        own = activation_after(self.tail) if relu_gated else None
        for module in self.tail.modules():
            if isinstance(module, nn.ReLU):
                module.inplace = False  # the gate flips read each ReLU's input
        #: the ReLUs after the layer's own, whose units near zero may flip (:meth:`_refit_flipped`)
        self.tail_relus = [m for m in self.tail.modules() if isinstance(m, nn.ReLU) and m is not own]
        self.tail_band = band
        with torch.no_grad():
            out = self.tail(self.bias[None])
        if out.ndim != 2:
            raise InputError(
                f"the model after this layer outputs shape {tuple(out.shape)}, not (batch, classes)"
            )
        self.classes = int(out.shape[1])

    def _loss_gradient(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``d loss(tail(z_j), y_j) / dz`` for pre-activations (k, m) and their labels (k,)."""
        z = z.detach().requires_grad_(True)
        with torch.enable_grad():
            logits = self.tail(z)
            try:
                losses = self.loss(logits, labels.to(z.device))
            except TypeError as exc:  # the user's loss does not take (logits, labels)
                raise InputError(f"loss(logits, labels) could not be called: {exc}") from exc
            if isinstance(losses, torch.Tensor) and losses.numel() == labels.numel():
                losses = losses.reshape(labels.shape)  # (k, 1) as (k,)
            if not isinstance(losses, torch.Tensor) or losses.shape != labels.shape:
                shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
                raise InputError(
                    "loss(logits, labels) must return one loss per row of logits, shape "
                    f"({labels.shape[0]},) here; got {shape} (pass reduction='none' to torch's losses)"
                )
            (grad,) = torch.autograd.grad(losses.sum(), z)
        return grad

    def per_label_gradients(self, z: torch.Tensor) -> torch.Tensor:
        """``d loss(tail(z_j), y) / dz`` for k pre-activations (k, m) and every label: (k, C, m)."""
        k, m = z.shape
        C = self.classes
        labels = torch.arange(C, device=z.device).repeat(k)
        return self._loss_gradient(z.repeat_interleave(C, dim=0), labels).view(k, C, m)

    def gradients(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(k, m) what the model predicts for the columns of k labelled samples (inputs (k, n)):
        each one's ``d loss(tail(z_j), y_j) / dz`` at unit loss weight."""
        return self._loss_gradient(self._preactivations(inputs), labels)

    def per_label_columns(self, inputs: torch.Tensor) -> torch.Tensor:
        """(k, C, m) the columns the model predicts for k samples (inputs (k, n)) under each of
        the C labels, at unit loss weight."""
        return self.per_label_gradients(self._preactivations(inputs))

    def _preactivations(self, inputs: torch.Tensor) -> torch.Tensor:
        """The attacked layer's outputs ``W x + bias`` for inputs (k, n), in float64."""
        return inputs.detach().to(self.weight) @ self.weight.T + self.bias

    def scale_invariant(self, inputs: torch.Tensor) -> torch.Tensor:
        """(k,) whether each input's scaled copies ``t x``, ``t`` in [1/2, 2], keep its activation
        pattern: no pre-activation outside the sign-less band (``z_rtol``) changes sign between
        ``t = 1`` and either end (``t W x + b`` is linear in t). A zero-bias layer's patterns
        always do: a sample and its copy ``3 x`` then share every gate, and where the loss is
        saturated their columns are parallel and merge into one that fits the model as one
        sample (:func:`spear.core.verdict.saturation_ambiguous`). With biases, some neuron
        crosses zero in that range for nearly every input, and the merged column misfits it.
        Without a ReLU after the layer there is no pattern: every input's copies keep it."""
        if not self.relu_gated:
            return torch.ones(inputs.shape[0], dtype=torch.bool, device=self.weight.device)
        a = inputs.detach().to(self.weight) @ self.weight.T
        z = a + self.bias
        band = self.z_rtol * z.clamp_min(0).amax(dim=1, keepdim=True)
        signed = z.abs() > band
        sign = torch.sign(z)
        flips = (torch.sign(0.5 * a + self.bias) != sign) | (torch.sign(2 * a + self.bias) != sign)
        return ~(signed & flips).any(dim=1)

    def _sensitivity(self, z: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """``|H u| |z| / |g|`` per sample: the relative change of the per-sample gradient g per
        relative change of the pre-activations z along ``u = z / |z|`` (H: the loss's Hessian
        in z; zero where the softmax is saturated)."""
        zz = z.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = self.loss(self.tail(zz), label).sum()
            (g,) = torch.autograd.grad(loss, zz, create_graph=True)
            u = (zz / zz.norm(dim=1, keepdim=True).clamp_min(1e-300)).detach()
            (hu,) = torch.autograd.grad((g * u).sum(), zz, allow_unused=True)
        if hu is None:
            hu = torch.zeros_like(zz)
        tiny = torch.finfo(z.dtype).tiny
        return (hu.norm(dim=1) * zz.norm(dim=1) / g.detach().norm(dim=1).clamp_min(tiny)).detach()

    def weight_sensitivity(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(k,) how many times a relative change of each labelled sample's pre-activations
        (along themselves) moves its predicted column, and so its fitted loss weight: the
        loss's sensitivity at its input (``|H u| |z| / |g|``, large for a confident sample,
        whose ``p - e_y`` moves with its logit margin)."""
        return self._sensitivity(self._preactivations(inputs), labels.to(self.weight.device).clamp_min(0))

    def rounding(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """(k,) the relative rounding error of each labelled sample's column of dL/dZ as the
        client computed it, for cross-entropy in ``source_dtype``: ``eps (1 + 1 / |p - e_y|)``
        (p: the softmax). The gradient in the logits, ``p - e_y``, is a difference of terms of
        size up to 1, each rounded to about eps, so a well-classified sample (``|p - e_y|``
        small) carries a relative error of eps over its size; the 1 stands for the tail's
        backward pass (measured on float32 clients: at most 2.4 times this for MLPs trained 200
        steps, 3.3 for an untrained 6-layer one). None where not modelled (a custom loss, or no
        ``source_dtype``)."""
        if not self.models_rounding or self.source_eps is None:
            return None
        x = inputs.detach().to(self.weight)
        with torch.no_grad():
            logits = self.tail(x @ self.weight.T + self.bias)
        p = torch.softmax(logits, dim=1)
        onehot = nn.functional.one_hot(labels.to(x.device).clamp_min(0), p.shape[1]).to(p)
        distance = (p - onehot).norm(dim=1).clamp_min(torch.finfo(p.dtype).tiny)
        return self.source_eps * (1.0 + 1.0 / distance)

    @staticmethod
    def _discriminative(g: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """Whether the best label's gradient (p, m) points away from every other label's: two
        classes, or a rest of the network of rank one, make them all parallel."""
        unit = g / g.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(g.dtype).tiny)
        best = unit.gather(1, label[:, None, None].expand(-1, 1, unit.shape[-1]))  # (p, 1, m)
        cos = (unit * best).sum(dim=-1).abs()
        cos.scatter_(1, label[:, None], 0.0)
        if g.shape[1] == 1:
            return torch.zeros_like(label, dtype=torch.bool)
        return cos.amax(dim=1) <= PARALLEL_COS

    def _fit(self, z: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every label's gradient g_y (p, C, m) at pre-activations z (p, m), and the fitted weight
        s and the relative misfit ``|d - s g_y| / |d|`` (each (p, C)) of columns d (p, m). Sign-less
        pre-activations (``z_rtol``) are evaluated with their gate open (a negative one at the
        smallest positive value: a ReLU output of ~0, as on either side of the client's rounding) and left
        out of the weight's fit; each of their entries then misses by the nearer of the two gates."""
        tiny = torch.finfo(z.dtype).tiny
        dp = d.unsqueeze(1)
        signless = torch.zeros_like(z, dtype=torch.bool)
        if self.z_rtol > 0:
            signless = (z.abs() <= self.z_rtol * z.clamp_min(0).amax(dim=1, keepdim=True)) & (z != 0)
        # the open gate at the value the client may have had (~0 where the recovered one is
        # negative): the band's width is no change of the forward pass
        g = self.per_label_gradients(torch.where(signless, z.clamp_min(tiny), z))  # (p, C, m)
        signed = (~signless).to(z)[:, None, :]
        weight = (g * dp * signed).sum(dim=-1) / (g * g * signed).sum(dim=-1).clamp_min(tiny)
        miss = dp - weight.unsqueeze(-1) * g
        miss = torch.where(signless[:, None, :], torch.minimum(miss.abs(), dp.abs()), miss)
        return g, weight, miss.norm(dim=-1) / dp.norm(dim=-1).clamp_min(1e-300)

    def __call__(
        self, inputs: torch.Tensor, grad_outputs: torch.Tensor, rtol: torch.Tensor | None = None
    ) -> SampleCertificates:
        """Certificates of k samples (inputs (k, n), their dL/dZ columns (k, m)); ``rtol`` (k,):
        a looser misfit tolerance for the samples whose columns are known less precisely."""
        x = inputs.detach().to(self.weight)
        d = grad_outputs.detach().to(self.weight)
        k, m = d.shape
        out = SampleCertificates.none(k, device=x.device)
        tolerance = torch.full((k,), self.rtol, dtype=torch.float64, device=x.device)
        if rtol is not None:
            tolerance = torch.maximum(tolerance, rtol.to(tolerance))
        chunk = max(1, CHUNK_ELEMENTS // (self.classes * m))
        for part in torch.arange(k, device=x.device).split(chunk):
            self._certify(out, part, x[part] @ self.weight.T + self.bias, d[part], tolerance[part])
        self._refit_flipped(out, x, d, tolerance)
        return out

    def _certify(
        self, out: SampleCertificates, part: torch.Tensor, z: torch.Tensor, d: torch.Tensor, tol: torch.Tensor
    ) -> None:
        """Fill ``out`` at positions ``part`` with the certificates of the samples whose
        pre-activations are z (p, m) and columns d (p, m), at misfit tolerances tol (p,)."""
        g, weight, misfit = self._fit(z, d)
        misfit = torch.where(weight > 0, misfit, torch.inf)
        best, label = misfit.min(dim=1)
        if self.classes > 1:
            runner_up = misfit.topk(2, dim=1, largest=False).values[:, 1]
        else:
            runner_up = torch.full_like(best, torch.inf)
        ok = (best <= tol) & (runner_up > tol)
        out.ok[part] = ok
        saturated = self._sensitivity(z, label) <= self.saturation
        out.saturated[part] = ok & saturated
        out.discriminative[part] = ok & self._discriminative(g, label)
        out.strong[part] = out.discriminative[part] & ~saturated
        out.labels[part] = torch.where(ok, label, -1)
        out.weights[part] = torch.where(ok, weight.gather(1, label[:, None])[:, 0], torch.nan)
        out.misfit[part] = best

    def _refit_flipped(
        self, out: SampleCertificates, x: torch.Tensor, d: torch.Tensor, tolerance: torch.Tensor
    ) -> None:
        """Refit the samples that no label fits (best misfit above their tolerance, and at most
        ``TAIL_FLIP_MISFIT``) with the gates of the tail's deeper ReLUs that the client's
        rounding may have flipped: units whose pre-activation lies within ``tail_band`` of
        that layer's largest (the band of the layer's own ReLU, ``z_rtol``), the ``TAIL_FLIPS``
        nearest zero, in every combination. A flip leaves the forward pass as it is (the unit's
        output is about 0 either way) and adds or removes that unit's whole path in the
        backward pass, so the column moves by a vector the model fixes.

        A sample counts only when exactly one label fits over all the variants (a flip must not
        single out one of several labels that fit another variant), and never as *strong*:
        each flip adds a direction to what the fit may match, and a network built for it (a
        deeper unit whose incoming weights are a mixture's residual, sitting just below zero at
        the mixture: an adversarial review built one) makes a mixture of two samples fit. Such
        a sample then needs the layer's own pin, as a sign-only fit does. Fashion-MNIST 6 x 500,
        float32, layer 2 (input mode), b = 64, seed 2: one sample had a pre-activation of layer
        6 at 9.5e-9 of its largest, which the client's float32 forward put on the other side,
        and its column, recovered to 2.7e-6 of the client's, missed the float64 tail's gradient
        by 8%."""
        retry = (~out.ok & (out.misfit > tolerance) & (out.misfit <= TAIL_FLIP_MISFIT)).nonzero()[:, 0]
        if not self.tail_relus or self.tail_band <= 0 or not retry.numel():
            return
        z = x[retry] @ self.weight.T + self.bias
        for row, (position, gates) in enumerate(zip(retry.tolist(), self._near_zero_gates(z), strict=True)):
            sample, column, tol = z[row : row + 1], d[position : position + 1], tolerance[[position]]
            fitting: set[int] = set()  # labels within the tolerance in some variant
            chosen = None  # the first variant where one label alone fits
            for flips in (c for r in range(1, len(gates) + 1) for c in itertools.combinations(gates, r)):
                with self._flipped(flips):
                    _, weight, misfit = self._fit(sample, column)
                fits = (torch.where(weight > 0, misfit, torch.inf)[0] <= tol).nonzero()[:, 0].tolist()
                fitting.update(fits)
                chosen = flips if chosen is None and len(fits) == 1 else chosen
            if chosen is None or len(fitting) != 1:
                continue  # the plain fit's certificate stands
            refit = SampleCertificates.none(1, device=x.device)
            with self._flipped(chosen):
                self._certify(refit, torch.zeros(1, dtype=torch.long, device=x.device), sample, column, tol)
            if not bool(refit.ok[0]):
                continue
            for field in ("ok", "labels", "weights", "misfit", "saturated"):
                getattr(out, field)[position] = getattr(refit, field)[0]
            out.strong[position] = out.discriminative[position] = False

    def _near_zero_gates(self, z: torch.Tensor) -> list[list[tuple[int, int, bool]]]:
        """For pre-activations z (p, m) of the layer, each sample's units of the deeper ReLUs
        within ``tail_band`` of their layer's largest |pre-activation|, nearest zero first (at
        most ``TAIL_FLIPS``): (ReLU index, unit, whether the float64 gate is open). An exact
        zero keeps its closed gate, as at the layer's own ReLU; ReLU modules called more than
        once per pass (shared) are left alone."""
        seen: list[tuple[int, torch.Tensor]] = []
        hooks = [
            relu.register_forward_hook(lambda mod, inp, out, i=i: seen.append((i, inp[0].detach())))
            for i, relu in enumerate(self.tail_relus)
        ]
        try:
            with torch.no_grad():
                self.tail(z)
        finally:
            for hook in hooks:
                hook.remove()
        calls = [i for i, _ in seen]
        near: list[list[tuple[float, int, int, bool]]] = [[] for _ in range(z.shape[0])]
        for i, pre in seen:
            if calls.count(i) > 1:
                continue
            flat = pre.reshape(pre.shape[0], -1)
            relative = flat.abs() / flat.abs().amax(dim=1, keepdim=True).clamp_min(
                torch.finfo(flat.dtype).tiny
            )
            for row, unit in ((relative <= self.tail_band) & (flat != 0)).nonzero().tolist():
                near[row].append((float(relative[row, unit]), i, unit, bool(flat[row, unit] > 0)))
        return [[(i, unit, open_) for _, i, unit, open_ in sorted(units)[:TAIL_FLIPS]] for units in near]

    @contextlib.contextmanager
    def _flipped(self, flips: tuple[tuple[int, int, bool], ...]) -> Iterator[None]:
        """Within the block, the tail's backward pass with the gates of these units (ReLU index,
        unit, whether the gate is open) flipped, its forward pass unchanged: a closed unit's
        output gains ``x - x.detach()`` (value 0, gradient 1), an open one's loses it."""
        signs: dict[int, dict[int, float]] = {}
        for i, unit, open_ in flips:
            signs.setdefault(i, {})[unit] = -1.0 if open_ else 1.0

        def hook(units: dict[int, float]):
            def flip(module: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
                pre = inp[0]
                sign = torch.zeros(pre[0].numel(), dtype=pre.dtype, device=pre.device)
                for unit, value in units.items():
                    sign[unit] = value
                return out + sign.view(pre.shape[1:]) * (pre - pre.detach())

            return flip

        hooks = [self.tail_relus[i].register_forward_hook(hook(units)) for i, units in signs.items()]
        try:
            yield
        finally:
            for handle in hooks:
                handle.remove()


SampleWeights = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class WeightedCertifier:
    """The model certificate for updates whose protocol weights each sample on its own, such as
    DP-SGD's per-sample clipping (:class:`spear.fl.protocols.ClippedWeights`).

    A certified sample's fitted loss weight is ``f_j / B`` instead of ``1 / B``; the server knows
    the rule behind ``f_j`` (the clipping norm it configured), so it recomputes ``f_j`` from the
    recovered sample and label and divides it out before the reduction check
    (:func:`spear.core.certificate.infer_reduction`), which then sees ``1 / B`` again. A wrong
    sample or label gives a wrong ``f_j`` and fails that check. The samples must be the model's
    inputs (the attacked layer is its first).
    """

    def __init__(self, inner: ModelCertifier, model: nn.Module, sample_weights: SampleWeights) -> None:
        self.inner = inner
        self.model = copy.deepcopy(model).eval()
        self.sample_weights = sample_weights

    @property
    def accepts_sample_rtol(self) -> bool:
        return bool(getattr(self.inner, "accepts_sample_rtol", False))

    def rounding(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """The inner certificate's rounding model (:meth:`ModelCertifier.rounding`)."""
        return self.inner.rounding(inputs, labels)

    def weight_sensitivity(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The inner certificate's (:meth:`ModelCertifier.weight_sensitivity`): a sample's
        weight scales its column, not how it moves."""
        return self.inner.weight_sensitivity(inputs, labels)

    @property
    def half_precision(self) -> bool:
        return self.inner.half_precision

    def scale_invariant(self, inputs: torch.Tensor) -> torch.Tensor:
        """The inner certificate's (:meth:`ModelCertifier.scale_invariant`): the layer's."""
        return self.inner.scale_invariant(inputs)

    def gradients(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The inner certificate's predicted columns at unit loss weight
        (:meth:`ModelCertifier.gradients`): a sample's weight scales its column, not its shape."""
        return self.inner.gradients(inputs, labels)

    def per_label_columns(self, inputs: torch.Tensor) -> torch.Tensor:
        """The inner certificate's columns under every label (:meth:`ModelCertifier.per_label_columns`)."""
        return self.inner.per_label_columns(inputs)

    def __call__(
        self, inputs: torch.Tensor, grad_outputs: torch.Tensor, rtol: torch.Tensor | None = None
    ) -> SampleCertificates:
        if rtol is not None and self.accepts_sample_rtol:
            cert = self.inner(inputs, grad_outputs, rtol=rtol)
        else:
            cert = self.inner(inputs, grad_outputs)
        ok = cert.ok.nonzero()[:, 0]
        if ok.numel() == 0:
            return cert
        param = next(self.model.parameters())  # the model's device and dtype, not the attack's
        factors = self.sample_weights(self.model, inputs[ok].to(param), cert.labels[ok].to(param.device))
        weights = cert.weights.clone()
        weights[ok] = weights[ok] / factors.to(weights)
        return dataclasses.replace(cert, weights=weights)
