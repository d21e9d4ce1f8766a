"""The evaluation side of an experiment: ground truth meets the attack's result.

Three levels, each scored with the metrics of its modality after order-invariant matching:
the attacked layer's inputs when they are hidden (features: cosine similarity, relative error),
the data (images: PSNR/SSIM/MSE/LPIPS; tabular rows: TabLeak's accuracies and the decoded
records), and, where the way back is feature inversion by optimization, the same inversion run
from the *true* features (whether or not the attack recovered them): the ceiling any
feature-level attack can reach through that inversion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spear.core.result import Reconstruction
from spear.data import Dataset
from spear.fl import ClientBatch, layer_inputs
from spear.inversion import GradientInverter, Inversion, InversionSettings, invert_features, layers_below
from spear.inversion.base import acting_layers_below
from spear.metrics import batch_exact, evaluate_batch, match_samples, metrics_for

NAN = float("nan")


@dataclass
class Evaluation:
    record: dict[str, Any]  # JSON-ready entries of the experiment's record
    matched: torch.Tensor | None  # the recovered data (images) in the truth's order


def evaluate(
    dataset: Dataset,
    model: torch.nn.Module,
    layer: str,
    rec: Reconstruction,
    inversion: Inversion | None,
    secret: ClientBatch,
    atol: float,
    seed: int = 0,
    certified_data: Inversion | None = None,
) -> Evaluation:
    """Score ``rec`` (and the data taken back from it) against the client's batch. ``atol``: a
    value counts as exact within this (image scale, or relative for features).
    ``certified_data``: a hidden layer's certified samples taken back to the data one by one
    (:class:`~spear.inversion.RowSpaceInverter`), counted when the batch is not recovered."""
    record: dict[str, Any] = {}
    data_inputs, truth_features = rec.inputs, None
    if acting_layers_below(model, layer):
        truth_features = layer_inputs(model, layer, secret.inputs).to(torch.float64)
        record["features"] = _score_features(rec, truth_features, atol)
        data_inputs = None if inversion is None else inversion.inputs
        record["inversion"] = None if inversion is None else inversion.as_dict()
        if not GradientInverter().applies(model, layer) and dataset.modality == "image":
            record["ceiling"] = _ceiling(dataset, model, layer, truth_features, secret, seed)
    complete = data_inputs is not None and data_inputs.shape[0] == secret.inputs.shape[0]
    if not complete:
        missing = _not_recovered(dataset, rec, secret, atol, truth_features)
        if truth_features is not None:  # the certified samples are features; their data:
            record["features"]["exact_samples"] = missing["exact_samples"]
            missing["exact_samples"] = _exact_data(dataset, certified_data, secret, atol)
            record["certified_data"] = None if certified_data is None else certified_data.as_dict()
        record.update(missing)
        return Evaluation(record, None)
    scored = _score_data(dataset, data_inputs, secret, atol)
    record.update(scored.record)
    labels = label_accuracy(data_inputs, rec.labels, secret.inputs, secret.labels)
    record["metrics"]["label_accuracy"] = labels
    return Evaluation(record, scored.matched)


def evaluate_inputs(
    dataset: Dataset,
    inputs: torch.Tensor | None,
    labels: torch.Tensor | None,
    secret: ClientBatch,
    atol: float,
    reconstruction: Reconstruction | None = None,
) -> Evaluation:
    """Score any attack's model inputs (b, n) (SPEAR's or a baseline's) against the client's data
    with the metrics of its modality; ``inputs`` None (no batch): NaN metrics, and the samples
    ``reconstruction`` certified one by one, if any, counted when exact."""
    if inputs is None or inputs.shape[0] != secret.inputs.shape[0]:
        certified = None if reconstruction is None else reconstruction.certified_inputs
        if certified is not None and certified.shape[1] == secret.inputs.shape[1]:  # data, not features
            return Evaluation(_not_recovered(dataset, reconstruction, secret, atol, None), None)
        return Evaluation(_not_recovered(dataset, None, secret, atol, None), None)
    scored = _score_data(dataset, inputs, secret, atol)
    scored.record["metrics"]["label_accuracy"] = label_accuracy(inputs, labels, secret.inputs, secret.labels)
    return scored


def _score_features(rec: Reconstruction, truth: torch.Tensor, atol: float) -> dict[str, Any]:
    """Feature metrics of the recovered layer inputs; a sample is exact when every feature is
    within ``atol`` times the batch's largest true feature (at least 1) of the truth."""
    if rec.inputs is None or rec.inputs.shape != truth.shape:
        return {"metrics": {"feature_cosine": NAN, "feature_error": NAN, "accuracy": 0.0}, "exact_samples": 0}
    scale = float(truth.abs().amax().clamp(min=1.0))
    estimate = rec.inputs.to(torch.float64) / scale
    return evaluate_batch(estimate, truth / scale, metrics_for("features"), exact_atol=atol).as_dict()


def _score_data(dataset: Dataset, inputs: torch.Tensor, secret: ClientBatch, atol: float) -> Evaluation:
    if dataset.modality == "tabular":
        metrics = _data_metrics(dataset)
        result = evaluate_batch(inputs.to(torch.float64), secret.inputs.to(torch.float64), metrics, atol)
        record = result.as_dict()
        recovered = dataset.schema.decode(dataset.denormalize(result.matched_estimates))
        true = dataset.schema.decode(secret.images)
        record["decoded"] = [{"recovered": r, "true": t} for r, t in zip(recovered, true, strict=True)]
        return Evaluation(record, None)
    estimate = dataset.denormalize(inputs.cpu().to(torch.float64)).clamp(0, 1)
    result = evaluate_batch(estimate, secret.images, exact_atol=atol)
    return Evaluation(result.as_dict(), result.matched_estimates)


def _ceiling(dataset, model, layer, truth_features, secret, seed) -> dict[str, Any]:
    """The feature inversion run from the true features: what the attack's images could reach."""
    below = torch.nn.Sequential(*(m for _, m in layers_below(model, layer)))
    settings = InversionSettings(seed=seed)
    images = invert_features(below, truth_features, dataset.image_shape, dataset.normalize, settings)
    return evaluate_batch(images, secret.images).as_dict()["metrics"]


def _not_recovered(dataset, rec, secret, atol, truth_features) -> dict[str, Any]:
    """The record of a batch not recovered: NaN metrics, and how many samples peeled one by one
    are exact anyway (the data for the first layer, the features of a hidden one)."""
    metrics = {m.name: NAN for m in _data_metrics(dataset)} | {"accuracy": 0.0, "label_accuracy": NAN}
    exact = 0
    if rec is not None and rec.certified_inputs is not None:
        certified = rec.certified_inputs.to(torch.float64)
        if truth_features is not None:
            scale = float(truth_features.abs().amax().clamp(min=1.0))
            truth, estimate = truth_features / scale, certified / scale
        elif dataset.modality == "image":
            truth, estimate = secret.images, dataset.denormalize(certified).clamp(0, 1)
        else:
            truth, estimate = secret.inputs.to(torch.float64), certified
        est, ref = match_samples(estimate, truth)
        exact = int(batch_exact(estimate[est], truth[ref], atol).sum())
    batch = secret.inputs.shape[0]
    return {"metrics": metrics, "exact_samples": exact, "batch_size": batch, "per_sample": {}}


def _exact_data(dataset: Dataset, inversion: Inversion | None, secret: ClientBatch, atol: float) -> int:
    """How many of an inversion's proven samples (``exact``) match the client's data to ``atol``."""
    if inversion is None or inversion.exact is None or not bool(inversion.exact.any()):
        return 0
    proven = inversion.inputs[inversion.exact].to(torch.float64)
    if dataset.modality == "image":
        truth, estimate = secret.images, dataset.denormalize(proven).clamp(0, 1)
    else:
        truth, estimate = secret.inputs.to(torch.float64), proven
    est, ref = match_samples(estimate, truth)
    return int(batch_exact(estimate[est], truth[ref], atol).sum())


def _data_metrics(dataset: Dataset):
    if dataset.modality == "tabular":
        return metrics_for("tabular", schema=dataset.schema)
    return metrics_for("image")


def label_accuracy(
    estimate: torch.Tensor, labels: torch.Tensor | None, truth: torch.Tensor, true_labels: torch.Tensor
) -> float:
    """Fraction of samples whose recovered label is the true one, after matching the inputs; an
    unknown label (-1) is not a recovered one. NaN when the attack recovered no labels (None, or
    every one unknown: review 46 read 0.0 for an autocast run whose labels were all unknown)."""
    if labels is None or estimate.shape[0] != truth.shape[0] or not bool((labels >= 0).any()):
        return NAN
    est, ref = match_samples(estimate.to(torch.float64), truth.to(torch.float64))
    return float((labels.cpu()[est] == true_labels.cpu()[ref]).double().mean())
