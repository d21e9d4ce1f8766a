"""The model-level certificate's cost next to the attack's.

Setting: MNIST (n = 784), fully connected ReLU network of depth 6 and width m, PyTorch default
init, FedSGD (mean cross-entropy), float64, first layer attacked with ``auto`` and peeling. Each
(m, b) cell runs the same seeds twice, with the certificate (``attack_layer``'s default: every
sample is checked through the rest of the network and its label recovered) and without it
(``certify=False``: layer-level verification). Reported per cell: median attack seconds both
ways, the median time spent inside the certificate (``stats.certificate_seconds``: every call,
peeled samples and final selections), exact batches, and label accuracy.

Default (a few minutes on 2 cores):
    python benchmarks/bench_certificate.py
"""

from __future__ import annotations

import argparse

import spear
from common import exact_match, machine, median, write_json
from spear.data import load_dataset
from spear.fl import fully_connected, simulate_fedsgd
from spear.metrics import match_samples

GRID = [(200, 20), (500, 50), (1000, 100), (2000, 200)]


def one(dataset, width: int, b: int, seed: int, certify: bool) -> dict:
    model = fully_connected(dataset.features, width, 6, dataset.classes, seed=seed)
    view, truth = simulate_fedsgd(model, dataset, b, seed=seed)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=seed, certify=certify)
    labels = None
    if rec.labels is not None and rec.inputs is not None and rec.inputs.shape[0] == b:
        est, ref = match_samples(rec.inputs, truth.inputs)
        labels = float((rec.labels[est] == truth.labels[ref]).double().mean())
    return {
        "seed": seed,
        "exact": exact_match(rec, truth.inputs),
        "verified_by": rec.verified_by,
        "seconds": rec.stats.seconds,
        "certificate_seconds": rec.stats.certificate_seconds,
        "label_accuracy": labels,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/certificate.json")
    args = parser.parse_args()
    dataset = load_dataset("mnist")
    cells = []
    for width, b in GRID:
        runs = {
            name: [one(dataset, width, b, seed, certify) for seed in range(args.seeds)]
            for name, certify in (("model", True), ("layer", False))
        }
        cell = {
            "width": width,
            "batch_size": b,
            "exact_with_certificate": sum(r["exact"] for r in runs["model"]),
            "exact_without": sum(r["exact"] for r in runs["layer"]),
            "verified_by_model": sum(r["verified_by"] == "model" for r in runs["model"]),
            "median_seconds_with_certificate": median([r["seconds"] for r in runs["model"]]),
            "median_seconds_without": median([r["seconds"] for r in runs["layer"]]),
            "median_certificate_seconds": median([r["certificate_seconds"] for r in runs["model"]]),
            "label_accuracy": [r["label_accuracy"] for r in runs["model"]],
            "runs": runs,
        }
        cells.append(cell)
        print(
            f"m={width} b={b}: exact {cell['exact_with_certificate']}/{args.seeds} (model-verified "
            f"{cell['verified_by_model']}), attack {cell['median_seconds_with_certificate']:.2f} s with the "
            f"certificate ({cell['median_certificate_seconds']:.3f} s in it), "
            f"{cell['median_seconds_without']:.2f} s without",
            flush=True,
        )
    write_json(args.out, {"machine": machine(), "seeds": args.seeds, "depth": 6, "cells": cells})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
