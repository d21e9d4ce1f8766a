"""Shared helpers: build a fully connected ReLU client, compute its FedSGD gradient, match rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from spear.core.proposers import DirectionProposer, ProposalBatch


@dataclass
class Client:
    model: torch.nn.Sequential
    inputs: torch.Tensor  # (b, n) the private batch (ground truth, evaluation only)
    labels: torch.Tensor
    grads: dict[str, torch.Tensor]
    grad_z: torch.Tensor  # (m, b) true dL/dZ of the first layer

    @property
    def first(self) -> torch.nn.Linear:
        return self.model[0]

    def layer_args(self, index: int = 0):
        layer = self.model[index]
        name = str(index)
        return layer.weight, layer.bias, self.grads[f"{name}.weight"], self.grads[f"{name}.bias"]


def make_client(
    b: int,
    n: int = 784,
    width: int = 200,
    depth: int = 3,
    seed: int = 0,
    classes: int = 10,
    dtype: torch.dtype = torch.float64,
    activation: type[torch.nn.Module] = torch.nn.ReLU,
    normalized_images: bool = True,
) -> Client:
    """A depth-layer fully connected net at PyTorch default init and one batch's gradient.

    Inputs are image-like (values in [0, 1] with spatial smoothness, then normalized per feature
    like a real pipeline) unless ``normalized_images`` is False (standard normal).
    """
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    sizes = [n] + [width] * (depth - 1)
    for i in range(depth - 1):
        layers += [torch.nn.Linear(sizes[i], sizes[i + 1]), activation()]
    layers.append(torch.nn.Linear(sizes[-1], classes))
    model = torch.nn.Sequential(*layers).to(dtype)
    if normalized_images:
        raw = torch.rand(b, n, generator=g, dtype=dtype)
        smooth = (raw + raw.roll(1, dims=1) + raw.roll(-1, dims=1)) / 3
        inputs = (smooth - 0.5) / 0.29
    else:
        inputs = torch.randn(b, n, generator=g, dtype=dtype)
    labels = torch.randint(0, classes, (b,), generator=g)
    captured: dict[str, torch.Tensor] = {}

    def keep(_mod, _inp, out):
        out.retain_grad()
        captured["z"] = out

    handle = model[0].register_forward_hook(keep)
    loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    loss.backward()
    handle.remove()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return Client(model, inputs, labels, grads, captured["z"].grad.detach().T.clone())


def match_rows(estimate: torch.Tensor, truth: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Hungarian matching of estimated rows to true rows (order-invariant comparison)."""
    cost = torch.cdist(estimate.double(), truth.double()).cpu().numpy()
    return linear_sum_assignment(cost)


def assert_exact(estimate: torch.Tensor, truth: torch.Tensor, rtol: float = 1e-6) -> None:
    assert estimate.shape == truth.shape
    r, c = match_rows(estimate, truth)
    err = (estimate[r] - truth[c]).abs().max() / truth.abs().max()
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


class TrueColumns(DirectionProposer):
    """An oracle proposer (tests only): the true directions of the chosen columns of dL/dZ,
    once, in the coordinates of whatever factor the attack searches (its live rows), then
    nothing. Counts its calls."""

    name = "oracle"

    def __init__(self, grad_z: torch.Tensor, columns) -> None:
        self.grad_z = grad_z  # (m, b) the true dL/dZ, full width
        self.columns = list(columns)
        self.calls = 0

    def propose(self, ctx, max_proposals):
        self.calls += 1
        live = self.grad_z.abs().sum(dim=1) > 0
        b = ctx.batch_size
        directions = ctx.L.new_empty(0, b)
        if self.calls == 1 and b == self.grad_z.shape[1] and int(live.sum()) == ctx.L.shape[0]:
            q = torch.linalg.lstsq(ctx.L, self.grad_z[live][:, self.columns].to(ctx.L.dtype)).solution
            directions = (q / q.norm(dim=0)).T.contiguous()
        return ProposalBatch(directions, n_drawn=max(1, directions.shape[0]))


@pytest.fixture
def client_factory():
    return make_client


def _singletons_only(monkeypatch, sparse: bool) -> None:
    """Leave the singleton cascade its self-pinning candidates (``sparse``) or none, never the
    dense-input ones (:func:`spear.core.singletons.singleton_candidates`)."""
    import spear.core.reconstruct as reconstruct

    candidates = reconstruct.singleton_candidates

    def kept(problem, peeled, zero_rtol, dense=False):
        found = candidates(problem, peeled, zero_rtol, dense)
        return found if sparse and not dense else found[:0]

    monkeypatch.setattr(reconstruct, "singleton_candidates", kept)


def without_dense_singletons(monkeypatch) -> None:
    """Leave the singleton cascade its self-pinning candidates only (no dense-input route)."""
    _singletons_only(monkeypatch, sparse=True)


def without_singletons(monkeypatch) -> None:
    """Switch the singleton cascade off (:mod:`spear.core.singletons`): it finds columns from
    neurons active for one sample, whatever their zero count."""
    _singletons_only(monkeypatch, sparse=False)


def load_fashion_mnist():
    """Fashion-MNIST, or a skip where its Debian package is not installed (``.ci/run`` installs
    it where it can)."""
    from spear.data import load_dataset
    from spear.errors import InputError

    try:
        return load_dataset("fashion-mnist")
    except InputError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def mnist():
    """The built-in MNIST subset (test modules may define their own fixture of this name)."""
    from spear.data import load_dataset

    return load_dataset("mnist")


def deep_mlp_round(mnist, width: int, b: int, seed: int, dtype=torch.float64):
    """One FedSGD round of a 6-layer MLP of ``width`` on ``b`` MNIST samples: (view, truth)."""
    from spear.fl import fully_connected, simulate_fedsgd

    model = fully_connected(784, width, 6, seed=seed, dtype=dtype)
    return simulate_fedsgd(model, mnist, b, seed=seed)
