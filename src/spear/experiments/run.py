"""One experiment: a simulated client on real data, the attack from the server's view, metrics.

Ground truth stays in this module's evaluation step: the attack receives only the ServerView.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
from dataclasses import dataclass
from typing import Any

import torch

import spear
from spear.data import load_dataset
from spear.errors import InputError
from spear.fl import Protocol, fully_connected, make_protocol, pretrain, simulate_round
from spear.metrics import batch_exact, evaluate_batch, match_samples


@dataclass(frozen=True)
class ExperimentSettings:
    """Everything that defines one attacked batch. ``seed`` draws the network, the batch and the
    attack's randomness."""

    dataset: str = "mnist"
    batch_size: int = 12
    width: int = 200
    depth: int = 6
    seed: int = 0
    init: str = "default"
    pretrain_steps: int = 0
    single_label: bool = False
    max_proposals: int | None = None
    time_budget: float | None = None
    p_fr: float = 1e-5
    device: str = "cpu"
    proposer: str = "auto"
    #: the client's precision; "float32" is what deployments send
    dtype: str = "float64"
    #: what the client sends (spear.fl.protocols): "fedsgd", "fedavg" or "dpsgd"
    protocol: str = "fedsgd"
    local_epochs: int = 1
    local_batch_size: int | None = None
    local_lr: float = 0.1
    dp_noise_multiplier: float = 0.0
    dp_max_grad_norm: float = 1.0
    #: secure aggregation: the server sees the sum of this many clients' updates
    clients: int = 1

    def make_protocol(self) -> Protocol:
        """The protocol these settings describe."""
        if self.protocol == "fedavg":
            options = {"epochs": self.local_epochs, "batch_size": self.local_batch_size, "lr": self.local_lr}
        elif self.protocol == "dpsgd":
            options = {"noise_multiplier": self.dp_noise_multiplier, "max_grad_norm": self.dp_max_grad_norm}
        else:
            options = {}
        return make_protocol(self.protocol, **options)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[self.dtype]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def key(self) -> str:
        """Identifies the configuration regardless of seed (batches of one evaluation share it)."""
        fields = {k: v for k, v in self.as_dict().items() if k != "seed"}
        return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


#: the client precisions the experiments simulate
DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: a sample counts as exact when every pixel is within this (image scale [0, 1]) of the truth:
#: float64 clients to 1e-6; float32 clients' own rounding limits recovery to ~1e-5 relative,
#: so 1e-4 (still 40x finer than an 8-bit image's grid)
EXACT_ATOL = {torch.float64: 1e-6, torch.float32: 1e-4}


@dataclass
class ExperimentResult:
    settings: ExperimentSettings
    record: dict[str, Any]  # JSON-ready: settings, metrics, stats, versions, per-sample values
    reconstruction_images: torch.Tensor | None  # (b, C, H, W), matched to the truth's order
    true_images: torch.Tensor


def versions() -> dict[str, str]:
    out = {"spear-fl": spear.__version__, "torch": torch.__version__, "python": platform.python_version()}
    return out


def _exact_certified(dataset, certified: torch.Tensor | None, truth: torch.Tensor, atol: float) -> int:
    """How many individually certified samples equal a true one (every pixel within ``atol``)."""
    if certified is None:
        return 0
    estimate = dataset.denormalize(certified.cpu().to(truth.dtype)).clamp(0, 1).reshape(-1, *truth.shape[1:])
    est, ref = match_samples(estimate, truth)
    return int(batch_exact(estimate[est], truth[ref], atol).sum())


def label_accuracy(
    estimate: torch.Tensor, labels: torch.Tensor | None, truth: torch.Tensor, true_labels: torch.Tensor
) -> float:
    """Fraction of samples whose recovered label is the true one, after matching the inputs
    (NaN when the attack recovered no labels)."""
    if labels is None or estimate.shape[0] != truth.shape[0]:
        return float("nan")
    est, ref = match_samples(estimate, truth)
    return float((labels.cpu()[est] == true_labels.cpu()[ref]).double().mean())


def run_experiment(settings: ExperimentSettings, progress=None) -> ExperimentResult:
    """Simulate one FL round (the settings' protocol, precision and number of clients), attack
    the first layer from the server's view, evaluate against the clients' batches."""
    dataset = load_dataset(settings.dataset)
    protocol = settings.make_protocol()
    dtype = settings.torch_dtype
    model = fully_connected(
        dataset.features,
        settings.width,
        settings.depth,
        dataset.classes,
        init=settings.init,
        seed=settings.seed,
        dtype=dtype,
    )
    if settings.pretrain_steps:
        pretrain(model, dataset, settings.pretrain_steps, seed=settings.seed)
    view, secret = simulate_round(
        model,
        dataset,
        settings.batch_size,
        protocol,
        settings.seed,
        clients=settings.clients,
        single_label=settings.single_label,
    )
    # --- the attacker's side: the server's view only ---
    rec = spear.attack_layer(
        view.model,
        "0",
        view.gradients,
        seed=settings.seed,
        max_proposals=settings.max_proposals,
        time_budget=settings.time_budget,
        p_fr=settings.p_fr,
        device=settings.device,
        progress=progress,
        proposer=settings.proposer,
        clients=settings.clients,
        **protocol.attack_options(view.model, view.gradients),
    )
    rec = protocol.certify(view.model, view.gradients, rec)
    # --- evaluation: ground truth meets the result ---
    truth = secret.images
    if rec.inputs is not None and rec.inputs.shape[0] == truth.shape[0]:
        estimate = dataset.denormalize(rec.inputs.cpu().to(truth.dtype)).clamp(0, 1)
        evaluation = evaluate_batch(estimate, truth, exact_atol=EXACT_ATOL[dtype])
        metrics = evaluation.as_dict()
        metrics["metrics"]["label_accuracy"] = label_accuracy(estimate, rec.labels, truth, secret.labels)
        matched = evaluation.matched_estimates
    else:
        nan = float("nan")
        metrics = {
            "metrics": {
                "psnr": nan,
                "ssim": nan,
                "mse": nan,
                "lpips": nan,
                "accuracy": 0.0,
                "label_accuracy": nan,
            },
            # the batch was not recovered, but samples peeled one by one may have been
            "exact_samples": _exact_certified(dataset, rec.certified_inputs, truth, EXACT_ATOL[dtype]),
            "batch_size": truth.shape[0],
            "per_sample": {},
        }
        matched = None
    record = {
        "settings": settings.as_dict(),
        "settings_key": settings.key(),
        "protocol": view.metadata,
        "dataset_note": dataset.note,
        **metrics,
        "verified": rec.verified,
        "verified_by": rec.verified_by,
        "labels": None if rec.labels is None else rec.labels.tolist(),
        "multiplicities": None if rec.multiplicities is None else rec.multiplicities.tolist(),
        "reduction": rec.reduction,
        "missing_samples": rec.missing_samples,
        "ambiguous": [list(g) for g in rec.ambiguous],
        "notes": list(rec.notes),
        "residual": rec.residual,
        "sigma": rec.sigma,
        "recovered_batch_size": rec.batch_size,
        "consistent_directions": rec.consistent_directions,
        "message": rec.message,
        "stats": rec.stats.as_dict(),
        "versions": versions(),
    }
    return ExperimentResult(settings, record, matched, truth)
