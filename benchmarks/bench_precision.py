"""How honest ``Reconstruction.input_precision`` is: estimated against actual per-sample errors.

For each case (a setting of the realism matrix: architecture, attacked layer and sparsity mode,
the gradient's dtype, training steps, b, seed) one FedSGD client on MNIST is attacked with
``spear.attack_layer``; for a verified batch, each recovered sample's relative error (to its
true input's norm, after order-invariant matching) is divided by its estimated precision. The
estimate should sit above the error (ratio <= 1 means it did not promise too much) without
being a blanket ceiling (a ratio far below 1 everywhere says nothing).

Default (17 cases, about 3 minutes on 2 cores, nothing else running):
    python benchmarks/bench_precision.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import spear
from bench_realism import SETTINGS, build
from common import machine, run_settings, write_json
from spear.data import load_dataset
from spear.fl import feature_layer, layer_inputs, pretrain, simulate_fedsgd
from spear.metrics import relative_errors

#: (setting, dtype bits, training steps, b, seed)
CASES = [
    ("mlp", 32, 200, 32, 0),
    ("mlp", 32, 200, 32, 1),
    ("mlp", 32, 200, 32, 2),
    ("mlp", 32, 0, 64, 0),
    ("mlp", 32, 0, 64, 1),
    ("cnn", 32, 0, 32, 0),
    ("cnn", 32, 0, 64, 1),
    ("hidden", 32, 200, 32, 0),
    ("mlp", 32, 200, 64, 0),
    ("mlp", 64, 0, 32, 0),
    ("mlp", 64, 200, 32, 1),
    ("cnn", 64, 200, 32, 0),
    ("hidden", 64, 200, 16, 0),
    ("hidden-input", 64, 0, 16, 0),
    ("hidden-input", 32, 0, 16, 1),
    ("hidden-input", 32, 200, 16, 0),
    ("cnn", 32, 200, 16, 1),
]


def one(dataset, setting: str, bits: int, steps: int, b: int, seed: int, budget: float) -> dict:
    dtype = torch.float64 if bits == 64 else torch.float32
    arch, layer, sparsity = SETTINGS[setting]
    model = build(arch, dataset, 500, seed, dtype)
    if steps:
        pretrain(model, dataset, steps, seed=seed)
    layer = layer or feature_layer(model)
    view, truth = simulate_fedsgd(model, dataset, b, seed=seed)
    inputs = layer_inputs(view.model, layer, truth.inputs).double()
    rec = spear.attack_layer(
        view.model, layer, view.gradients, seed=seed, time_budget=budget, sparsity=sparsity
    )
    row = {"setting": setting, "dtype": f"float{bits}", "train_steps": steps, "b": b, "seed": seed}
    row["verified"] = rec.verified
    if rec.input_precision is None:
        return row
    precision = rec.input_precision.double()
    ratio = relative_errors(rec.inputs, inputs) / precision
    row.update(
        precision_median=float(precision.median()),
        precision_max=float(precision.max()),
        ratio_median=float(ratio.median()),
        ratio_max=float(ratio.max()),
    )
    return row


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per attack")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "precision.json"))
    args = parser.parse_args()
    dataset = load_dataset("mnist")
    rows = []
    for case in CASES:
        rows.append(one(dataset, *case, args.budget))
        r = rows[-1]
        print(
            f"{r['setting']:12s} {r['dtype']} train={r['train_steps']:3d} b={r['b']:2d} seed={r['seed']} "
            f"verified={r['verified']} ratio max {r.get('ratio_max', float('nan')):.2f}",
            flush=True,
        )
    measured = [r for r in rows if "ratio_max" in r]
    summary = {
        "verified": len(measured),
        "cases": len(rows),
        "worst_ratio": max((r["ratio_max"] for r in measured), default=None),
    }
    print(summary)
    payload = {"benchmark": "precision", "settings": run_settings(args), "machine": machine()}
    write_json(args.out, {**payload, "summary": summary, "cases": rows})


if __name__ == "__main__":
    main()
