"""One experiment: a simulated client on real data, the attack from the server's view, metrics.

Ground truth stays in the evaluation step (:mod:`spear.experiments.evaluation`): the attack and
the inversion receive only the ServerView.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import time
from dataclasses import dataclass
from typing import Any

import torch

import spear
from spear.api import budget_threads
from spear.core.deadline import Deadline
from spear.data import Dataset, load_dataset
from spear.errors import InputError
from spear.experiments.evaluation import evaluate
from spear.fl import (
    Protocol,
    attackable_layers,
    build_model,
    feature_layer,
    make_protocol,
    pretrain,
    simulate_round,
)
from spear.fl.protocols.fedsgd import AUTOCAST
from spear.fl.replay import replay_layer
from spear.inversion import Inversion, InversionSettings, RowSpaceInverter, invert_to_inputs
from spear.inversion.base import acting_layers_below


@dataclass(frozen=True)
class ExperimentSettings:
    """Everything that defines one attacked batch. ``seed`` draws the network, the batch and the
    attack's randomness."""

    dataset: str = "mnist"
    batch_size: int = 12
    #: hidden width (the MLP's layers, the CNN's head); None: the model's default
    width: int | None = None
    depth: int = 6
    seed: int = 0
    init: str = "default"
    #: SGD steps of training before the round (paper Fig. 7); None: the model's default
    pretrain_steps: int | None = None
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
    #: the client model (:data:`spear.fl.MODELS`): "mlp" or "cnn"
    model: str = "mlp"
    #: the attacked Linear layer's module name; None: the model's first Linear (for the CNN the
    #: layer whose inputs are the conv features)
    layer: str | None = None
    #: the client's mixed precision (:data:`spear.fl.protocols.fedsgd.AUTOCAST`): "float16" or
    #: "bfloat16", a FedSGD client
    #: of a float32 model under ``torch.autocast``; None: it computes in ``dtype``
    autocast: str | None = None

    def __post_init__(self) -> None:
        if self.autocast is not None:
            if self.autocast not in AUTOCAST:
                raise InputError(f"unknown autocast {self.autocast!r}; choose one of {', '.join(AUTOCAST)}")
            if self.protocol != "fedsgd" or self.dtype != "float32":
                raise InputError(
                    "autocast applies to FedSGD clients of a float32 model (autocast leaves float64 "
                    f"alone); got protocol {self.protocol!r}, dtype {self.dtype!r}"
                )
        if self.model not in MODEL_DEFAULTS:
            raise InputError(f"unknown model {self.model!r}; choose one of {', '.join(MODEL_DEFAULTS)}")
        width, steps = MODEL_DEFAULTS[self.model]
        if self.width is None:
            object.__setattr__(self, "width", width)
        if self.pretrain_steps is None:
            object.__setattr__(self, "pretrain_steps", steps)

    def make_protocol(self) -> Protocol:
        """The protocol these settings describe."""
        if self.protocol == "fedavg":
            options = {"epochs": self.local_epochs, "batch_size": self.local_batch_size, "lr": self.local_lr}
        elif self.protocol == "dpsgd":
            options = {"noise_multiplier": self.dp_noise_multiplier, "max_grad_norm": self.dp_max_grad_norm}
        else:
            options = {} if self.autocast is None else {"autocast": AUTOCAST[self.autocast]}
        return make_protocol(self.protocol, **options)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[self.dtype]

    @property
    def arithmetic_dtype(self) -> torch.dtype:
        """The precision the client computed in: the autocast dtype, else ``dtype`` (what
        exactness is measured against)."""
        return self.torch_dtype if self.autocast is None else AUTOCAST[self.autocast]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def key(self) -> str:
        """Identifies the configuration regardless of seed (batches of one evaluation share it);
        settings added later count only when set (earlier sweeps' keys stay)."""
        later = {"autocast"}
        fields = {k: v for k, v in self.as_dict().items() if k != "seed" and not (k in later and v is None)}
        return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


#: per model: the default head/hidden width and training steps. The CNN's head is 512 wide as in
#: CIFAR-sized VGGs, and it is trained briefly: features of untrained random convolutions do not
#: determine the image (inversion from the *true* features reaches ~9 dB PSNR on MNIST)
MODEL_DEFAULTS = {"mlp": (200, 0), "cnn": (512, 300)}
#: the client precisions the experiments simulate
DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: a sample counts as exact when every pixel is within this (image scale [0, 1]) of the truth:
#: float64 clients to 1e-6; float32 clients' own rounding limits recovery to ~1e-5 relative,
#: so 1e-4 (still 40x finer than an 8-bit image's grid)
EXACT_ATOL = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-1}


@dataclass
class ExperimentResult:
    settings: ExperimentSettings
    record: dict[str, Any]  # JSON-ready: settings, metrics, stats, versions, per-sample values
    reconstruction_images: torch.Tensor | None  # (b, C, H, W), matched to the truth's order
    true_images: torch.Tensor


def versions() -> dict[str, str]:
    out = {"spear-fl": spear.__version__, "torch": torch.__version__, "python": platform.python_version()}
    return out


def prepare_model(settings: ExperimentSettings, dataset: Dataset) -> tuple[torch.nn.Module, str, str]:
    """The client's model (built, checked, trained), the attacked layer and its sparsity mode."""
    model = build_model(
        settings.model,
        dataset.input_shape,
        dataset.classes,
        width=settings.width,
        depth=settings.depth,
        init=settings.init,
        seed=settings.seed,
        dtype=settings.torch_dtype,
    )
    layer = settings.layer if settings.layer is not None else feature_layer(model)
    layers = attackable_layers(model)
    if layer not in layers:
        raise InputError(
            f"layer {layer!r} cannot be attacked: choose a Linear layer with a ReLU on either side "
            f"of this {settings.model} ({', '.join(layers)})"
        )
    module = dict(model.named_modules())[layer]
    total = settings.batch_size * settings.clients
    limit = min(module.in_features, module.out_features)
    if total >= limit:
        raise InputError(
            f"b = {total} samples but layer {layer!r} is {module.in_features} -> {module.out_features}: "
            f"its gradient has rank <= {limit}, and SPEAR needs b < {limit}"
        )
    if layer != feature_layer(model) and settings.protocol != "fedsgd":
        raise InputError(
            f"--layer {layer} (a hidden layer) is supported for --protocol fedsgd; {settings.protocol} "
            "certifies through the first layer"
        )
    if settings.protocol == "fedavg":
        replay_layer(model, layer)  # the replay certificate needs the data at this layer
    if settings.protocol == "dpsgd" and acting_layers_below(model, layer):
        # before the Opacus client runs (review 46: the attack refused later, naming sample_weights)
        raise InputError(
            f"--protocol dpsgd is attacked through the layer that takes the data (each sample's clipping "
            f"factor is read off its input); this {settings.model}'s layer {layer!r} sees features: use "
            "the MLP, or --protocol fedsgd"
        )
    if settings.pretrain_steps:
        pretrain(model, dataset, settings.pretrain_steps, seed=settings.seed)
    return model, layer, layers[layer]


def _certified_data(view, layer: str, rec: spear.Reconstruction) -> Inversion | None:
    """A hidden layer's certified samples taken to the data one by one, where the batch is not
    verified and only Linear -> ReLU pairs lie below (:class:`RowSpaceInverter`)."""
    certified = rec.certified_inputs
    if rec.verified or certified is None or not certified.shape[0]:
        return None
    if not acting_layers_below(view.model, layer):  # the first layer: its inputs are the data
        return None
    inverter = RowSpaceInverter()
    if not inverter.applies(view.model, layer):
        return None
    try:
        return inverter(view.model, layer, view.gradients, rec)
    except InputError:  # an update without the lower layers' gradients: nothing to invert with
        return None


def run_experiment(settings: ExperimentSettings, progress=None) -> ExperimentResult:
    """Simulate one FL round (the settings' model, protocol, precision and clients), attack the
    settings' layer from the server's view, take hidden inputs back to the data (exactly through
    the gradients, or by feature inversion) and evaluate against the clients' batches."""
    dataset = load_dataset(settings.dataset)
    protocol = settings.make_protocol()
    model, layer, sparsity = prepare_model(settings, dataset)
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
    started = time.perf_counter()  # the time budget covers the attack and the protocol's certificate
    rec = spear.attack_layer(
        view.model,
        layer,
        view.gradients,
        seed=settings.seed,
        max_proposals=settings.max_proposals,
        time_budget=settings.time_budget,
        p_fr=settings.p_fr,
        device=settings.device,
        progress=progress,
        proposer=settings.proposer,
        clients=settings.clients,
        sparsity=sparsity,
        **protocol.attack_options(view.model, view.gradients),
    ).to("cpu")  # where the model and the evaluation are, whatever device the attack ran on
    with budget_threads(settings.time_budget):
        deadline = Deadline.after(settings.time_budget, started)
        rec = protocol.certify(view.model, view.gradients, rec, clients=settings.clients, deadline=deadline)
    inversion = None
    if acting_layers_below(view.model, layer) and rec.inputs is not None and rec.grad_outputs is not None:
        inversion = invert_to_inputs(
            view.model,
            layer,
            view.gradients,
            rec,
            image_shape=getattr(dataset, "image_shape", None),
            to_inputs=dataset.normalize,
            settings=InversionSettings(seed=settings.seed),
        )
    certified_data = _certified_data(view, layer, rec)
    # --- evaluation: ground truth meets the result ---
    evaluation = evaluate(
        dataset,
        model,
        layer,
        rec,
        inversion,
        secret,
        EXACT_ATOL[settings.arithmetic_dtype],
        settings.seed,
        certified_data=certified_data,
    )
    record = {
        "settings": settings.as_dict(),
        "settings_key": settings.key(),
        "protocol": view.metadata,
        "dataset_note": dataset.note,
        "layer": layer,
        "sparsity": sparsity,
        **evaluation.record,
        "verified": rec.verified,
        "verified_by": rec.verified_by,
        # the client's data proven: the first layer's inputs are the data; a hidden layer's
        # data is proven only by an exact inversion that verified
        "data_verified": rec.verified if inversion is None else inversion.verified,
        "labels": None if rec.labels is None else rec.labels.tolist(),
        "multiplicities": None if rec.multiplicities is None else rec.multiplicities.tolist(),
        "reduction": rec.reduction,
        "missing_samples": rec.missing_samples,
        "ambiguous": [list(g) for g in rec.ambiguous],
        "notes": list(rec.notes) + ([] if inversion is None else inversion.notes),
        "residual": rec.residual,
        "sigma": rec.sigma,
        "input_precision": rec.summary()["input_precision"],
        "certified_precision": rec.summary()["certified_precision"],
        "recovered_batch_size": rec.batch_size,
        "consistent_directions": rec.consistent_directions,
        "message": rec.message,
        "stats": rec.stats.as_dict(),
        "versions": versions(),
    }
    images = evaluation.matched if dataset.modality == "image" else None
    truth = secret.images if dataset.modality == "image" else None
    return ExperimentResult(settings, record, images, truth)
