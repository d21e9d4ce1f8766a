"""Helpers shared by the benchmark scripts: machine description and JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

import torch

from spear.metrics import match_samples


def machine(device: str = "cpu") -> dict:
    """The machine a benchmark ran on; with ``device="cuda"``, its GPU too."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **(
            {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
            if torch.device(device).type == "cuda"
            else {}
        ),
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_settings(args) -> dict:
    """A script's arguments as its JSON records them: paths relative to the repository (an
    absolute path names the machine it ran on, not the setting)."""
    root = Path(__file__).resolve().parent.parent
    out = {}
    for key, value in vars(args).items():
        if isinstance(value, (str, Path)) and Path(value).is_absolute():
            path = Path(value).resolve()
            value = str(path.relative_to(root)) if path.is_relative_to(root) else str(value)
        out[key] = value
    return out


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def exact_match(rec, truth: torch.Tensor, atol: float = 1e-6) -> bool:
    """Verified, and every sample within ``atol`` of the truth after Hungarian matching."""
    if rec.inputs is None or not rec.verified:
        return False
    est, ref = match_samples(rec.inputs, truth)
    return bool((rec.inputs[est] - truth[ref]).abs().max() < atol)


def relative_error(rec, truth: torch.Tensor) -> float | None:
    """The largest entry of the matched reconstruction's error over the truth's largest entry;
    None where the result holds no batch of the truth's shape (a sample left out, nothing)."""
    if rec.inputs is None or rec.inputs.shape != truth.shape:
        return None
    est, ref = match_samples(rec.inputs.double(), truth.double())
    scale = truth.abs().amax().clamp_min(1e-300)
    return float((rec.inputs.double()[est] - truth.double()[ref]).abs().amax() / scale)


def attack_batch(dataset, width: int, batch_size: int, depth: int, seed: int, **options):
    """One FedSGD client (fully connected ReLU net, first layer attacked): (reconstruction, exact)."""
    import spear
    from spear.fl import fully_connected, simulate_fedsgd

    model = fully_connected(dataset.features, width, depth, dataset.classes, seed=seed)
    view, truth = simulate_fedsgd(model, dataset, batch_size, seed=seed)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=seed, **options)
    return rec, exact_match(rec, truth.inputs)


def certified_count(rec, inputs: torch.Tensor, labels: torch.Tensor, atol: float) -> int:
    """Samples recovered to ``atol`` *and* certified by the result (the whole batch verified, or
    the sample certified on its own in ``rec.certified_inputs``), with the right label where one
    was recovered: the LT paper's "recovered exactly and certified"."""
    if rec.verified and rec.inputs is not None:
        found, found_labels = rec.inputs, rec.labels
    elif rec.certified_inputs is not None:
        found, found_labels = rec.certified_inputs, rec.certified_labels
    else:
        return 0
    found = found.to(inputs.dtype)
    est, ref = match_samples(found, inputs)
    close = (found[est] - inputs[ref]).abs().amax(dim=1) < atol
    if found_labels is not None:
        close &= (found_labels[est] < 0) | (found_labels[est] == labels[ref])
    return int(close.sum())


def column_strengths(
    model: torch.nn.Module, layer: str, inputs: torch.Tensor, labels: torch.Tensor
) -> list[float]:
    """Ground truth, for evaluation only: each sample's column of dL/dZ at ``layer`` (the
    linear layer's output; cross-entropy under its own label, float64, from
    :func:`spear.fl.replay.layer_gradients`), its norm over the largest one's.

    A float32 update holds a sample only as precisely as its column stands above the others'
    rounding: near 1e-4 of the largest and below (well-classified samples of a trained
    network), the data, not the attack, sets the limit."""
    import copy

    from spear.fl.replay import layer_gradients

    net = copy.deepcopy(model).to(torch.float64).eval()
    x = inputs.to(torch.float64)
    with torch.no_grad():
        classes = int(net(x[:1]).shape[1])
    with torch.enable_grad():
        per_label = layer_gradients(net, layer, x, classes)  # (b, classes, m)
    norms = per_label[torch.arange(x.shape[0]), labels.long()].norm(dim=1)
    return (norms / norms.max()).tolist()
