"""The Cocktail Party Attack (Kariyappa, Guo, Nguyen, Hoffmann & Lee, ICML 2023).

The weight gradient of a fully connected layer, ``dL/dW = dZ^T X`` (m x n), is a linear mixture
of the b inputs: every row mixes them with the weights of one neuron. Inputs are independent and
non-Gaussian, so independent component analysis separates them, at any b < min(m, n) and with no
sparsity assumption (the reviewer's point: it runs where plain SPEAR's sampler stops). As in the
paper: centre and whiten the b-dimensional row space of the gradient, then learn an unmixing
matrix U (unit rows) that maximises non-Gaussianity (negentropy with ``log cosh``, a = 1) with
decorrelated rows, and optionally total variation of the unmixed images.

The authors' release (``facebookresearch/cocktail_party_attack``) optimizes a penalized form
(decorrelation ``exp(T |U U^T|) - 1``, T = 5, weight 1) with Adam, lr 1e-3, 25,000 steps from the
identity. Here the unmixing is found by FastICA (scikit-learn, symmetric, log cosh): on
synthetic Laplace mixtures Adam on the penalized objective stalled at 0.5-0.8 cosine to the true
sources, FastICA reached 0.9998 in milliseconds. ``iterations > 0`` refines its result with the
release's objective (with ``tv`` for images). Each source's **sign and scale** come from the
bias gradient (``dL/db = dZ^T 1``; SPEAR's Theorem 3.6), where the release min-max normalizes
each image and picks its sign against the ground truth (an oracle a server does not have).
For a hidden layer (a CNN's features) the separated features go through feature inversion
(:func:`spear.inversion.invert_features`), the paper's second stage.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from sklearn.decomposition import FastICA
from sklearn.exceptions import ConvergenceWarning

from spear.baselines.base import Attack, AttackOutput, AttackTarget
from spear.core.linalg import lstsq
from spear.errors import InputError
from spear.fl import feature_layer
from spear.inversion import InversionSettings, invert_features, layers_below
from spear.inversion.base import acting_layers_below, check_no_random_masks
from spear.inversion.optimization import total_variation


@dataclass(frozen=True)
class CPAConfig:
    #: FastICA (scikit-learn, symmetric, log cosh) iterations and tolerance
    ica_iterations: int = 2000
    ica_tol: float = 1e-8
    #: Adam refinement of CPA's objective (negentropy, decorrelation, TV) from the FastICA result;
    #: 0 (default) keeps FastICA's unmixing, which that objective's optimum shares when tv = 0
    iterations: int = 0
    lr: float = 1e-3
    decorrelation: float = 1.0
    temperature: float = 5.0
    tv: float = 0.0
    logcosh_a: float = 1.0
    #: Adam steps of the feature inversion (CNN features back to images)
    inversion_steps: int = 1000

    def __post_init__(self) -> None:
        if (
            min(self.iterations, self.ica_iterations - 1, self.inversion_steps) < 0
            or self.lr <= 0
            or min(self.decorrelation, self.tv) < 0
        ):
            raise InputError(
                f"invalid CPA settings {self}: ica_iterations >= 1, iterations >= 0, lr > 0, weights >= 0"
            )


@dataclass
class WhitenedMixture:
    """The gradient's row space, centred and whitened: ``whitened = K (basis - mean)``, b x n."""

    basis: torch.Tensor  # b x n, orthonormal rows spanning the inputs
    mean: torch.Tensor  # b x 1
    whitening: torch.Tensor  # K, b x b
    whitened: torch.Tensor  # b x n, identity covariance over the n coordinates

    @classmethod
    def of(cls, gradient: torch.Tensor, batch_size: int) -> WhitenedMixture:
        if batch_size >= min(gradient.shape):
            raise InputError(
                f"b = {batch_size} but the layer gradient is {tuple(gradient.shape)}: ICA needs b < min(m, n)"
            )
        _, _, Vh = torch.linalg.svd(gradient, full_matrices=False)
        basis = Vh[:batch_size]
        mean = basis.mean(1, keepdim=True)
        centred = basis - mean
        cov = centred @ centred.T / (centred.shape[1] - 1)
        eigenvalues, vectors = torch.linalg.eigh(cov)
        whitening = (
            vectors @ torch.diag(eigenvalues.clamp(min=torch.finfo(cov.dtype).tiny).rsqrt()) @ vectors.T
        )
        return cls(basis, mean, whitening, whitening @ centred)


def unmix(
    mixture: WhitenedMixture, config: CPAConfig, shape: tuple[int, ...] | None, seed: int
) -> torch.Tensor:
    """The unmixing matrix U (b x b, unit rows): the sources are ``U whitened``. FastICA finds
    the non-Gaussian directions; ``config.iterations`` Adam steps then refine CPA's objective."""
    whitened = mixture.whitened
    b = whitened.shape[0]
    ica = FastICA(
        whiten=False,
        fun="logcosh",
        fun_args={"alpha": config.logcosh_a},
        max_iter=config.ica_iterations,
        tol=config.ica_tol,
        random_state=seed,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # the iterate is used either way
        ica.fit(whitened.T.cpu().numpy())
    start = torch.from_numpy(ica.components_).to(whitened)
    if config.iterations == 0:
        return start / start.norm(dim=1, keepdim=True)
    U = start.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([U], lr=config.lr)
    off_diagonal = ~torch.eye(b, dtype=torch.bool)
    gaussian = _gaussian_logcosh(config.logcosh_a)
    for _ in range(config.iterations):
        optimizer.zero_grad()
        unit = U / U.norm(dim=1, keepdim=True)
        sources = unit @ whitened
        loss = -_negentropy(sources, config.logcosh_a, gaussian).mean()
        if b > 1 and config.decorrelation > 0:
            gram = (unit @ unit.T).abs()[off_diagonal]
            loss = loss + config.decorrelation * torch.expm1(config.temperature * gram).mean()
        if config.tv > 0 and shape is not None:
            loss = loss + config.tv * total_variation(sources.reshape(b, *shape)).mean()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return U / U.norm(dim=1, keepdim=True)


def _negentropy(sources: torch.Tensor, a: float, gaussian: float) -> torch.Tensor:
    """Hyvarinen's approximation ``(E G(s) - E G(nu))^2``, ``G = log cosh(a s) / a``, per source
    (standardized over the n coordinates)."""
    standard = (sources - sources.mean(1, keepdim=True)) / sources.std(1, keepdim=True).clamp(min=1e-12)
    expected = (torch.log(torch.cosh(a * standard)) / a).mean(1)
    return (expected - gaussian) ** 2


def _gaussian_logcosh(a: float) -> float:
    """``E log cosh(a nu) / a`` for standard normal nu (quadrature on a fine grid)."""
    grid = torch.linspace(-12, 12, 20_001, dtype=torch.float64)
    density = torch.exp(-(grid**2) / 2) / (2 * torch.pi) ** 0.5
    values = torch.log(torch.cosh(a * grid)) / a
    return float((values * density).sum() * (grid[1] - grid[0]))


def scaled_sources(
    gradient: torch.Tensor, bias_gradient: torch.Tensor, directions: torch.Tensor
) -> torch.Tensor:
    """The inputs ``c_j s_j`` behind separated sources ``s_j`` (rows of ``directions``), with the
    scales from the bias gradient: ``dL/dW = A S`` and ``dL/db = A C^-1 1`` give
    ``(dL/dW S^+) d = dL/db`` with ``d = 1 / c`` (SPEAR's Theorem 3.6, in CPA's terms)."""
    mixing = lstsq(directions.T, gradient.T).T  # A C = dL/dW S^+, m x b
    d = lstsq(mixing, bias_gradient[:, None])[:, 0]
    scale = 1 / torch.where(d.abs() > 0, d, torch.full_like(d, torch.finfo(d.dtype).tiny))
    return scale[:, None] * directions


class CocktailPartyAttack(Attack):
    """ICA on a fully connected layer's gradient (Kariyappa et al. 2023)."""

    name = "cpa"

    def __init__(self, config: CPAConfig | None = None, layer: str | None = None, **overrides) -> None:
        self.config = CPAConfig(**overrides) if config is None else config
        self.layer = layer

    def run(self, target: AttackTarget) -> AttackOutput:
        model = target.model
        layer = self.layer or feature_layer(model)
        module = dict(model.named_modules())[layer]
        gradient = target.gradients[f"{layer}.weight"].detach().to(torch.float64).cpu()
        if module.bias is None:
            raise InputError(f"layer {layer!r} has no bias: CPA's scales here come from its bias gradient")
        bias_gradient = target.gradients[f"{layer}.bias"].detach().to(torch.float64).cpu()
        mixture = WhitenedMixture.of(gradient, target.batch_size)
        below = layers_below(model, layer)  # the forward net; pass-through modules hide nothing
        hidden = bool(acting_layers_below(model, layer))
        shape = target.domain.shape if target.domain.image and not hidden else None
        U = unmix(mixture, self.config, shape, target.seed)
        directions = U @ mixture.whitening @ mixture.basis  # the unmixing applied before centring
        inputs = scaled_sources(gradient, bias_gradient, directions)
        notes = ["an estimate by ICA, never verified; sign and scale from the bias gradient"]
        details = {"layer": layer}
        if hidden:
            check_no_random_masks(model, layer, "CPA's separated features cannot be inverted to the data")
            features = inputs.to(target.dtype)
            below_net = torch.nn.Sequential(*(m for _, m in below))
            images = invert_features(
                below_net,
                features,
                target.domain.shape,
                target.domain.to_inputs,
                InversionSettings(steps=self.config.inversion_steps, seed=target.seed),
            )
            inputs = target.domain.to_inputs(images).to(torch.float64)
            notes.append("images by feature inversion from the separated features")
        return AttackOutput(self.name, inputs, None, notes=notes, details=details)
