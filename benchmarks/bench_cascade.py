"""The deep-network frontier with the model cascade (`spear.attack_model`).

MNIST, 6-layer ReLU MLPs of width m (PyTorch's default init, untrained), one FedSGD step of a
batch mean. Each cell runs the cascade (default layer order: the middle first) under one time
budget and records, per seed: samples found, how many are exact (1e-6 of the image scale in
float64, 1e-4 in float32), whether the result is complete (the samples' weights 1/B count the
whole batch and explain every layer's gradient), seconds, and the attacks it ran.

    python benchmarks/bench_cascade.py                    # the README's cells, seeds 0-2
    python benchmarks/bench_cascade.py --cells 1000:256:float64 --seeds 5 --budget 240
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import machine, median, run_settings, write_json
from spear.experiments import ExperimentSettings
from spear.experiments.cascade import run_cascade_experiment

DEFAULT_CELLS = (
    "200:64:float64",
    "200:64:float32",
    "200:80:float64",
    "200:100:float64",
    "1000:256:float64",
    "1000:256:float32",
    "1000:320:float64",
)


def run_cell(width: int, b: int, dtype: str, seeds: int, budget: float) -> dict:
    runs = []
    for seed in range(seeds):
        settings = ExperimentSettings(
            dataset="mnist", batch_size=b, width=width, depth=6, seed=seed, dtype=dtype, time_budget=budget
        )
        began = time.perf_counter()
        record = run_cascade_experiment(settings)
        summary = record["cascade"]
        run = {
            "seed": seed,
            "found": summary["found"],
            "exact": record["exact_samples"],
            "complete": summary["complete"],
            "seconds": time.perf_counter() - began,
            "stop_reason": summary["stop_reason"],
            "steps": [
                {k: s[k] for k in ("layer", "added", "remaining", "seconds", "stop_reason")}
                for s in summary["steps"]
            ],
        }
        print(
            f"m={width} b={b} {dtype} seed {seed}: {run['exact']}/{b} exact, complete={run['complete']}, "
            f"{run['seconds']:.1f} s, {[(s['layer'], s['added']) for s in run['steps']]}",
            flush=True,
        )
        runs.append(run)
    whole = [r for r in runs if r["complete"] and r["exact"] == b]
    return {
        "width": width,
        "batch_size": b,
        "dtype": dtype,
        "complete": f"{len(whole)}/{len(runs)}",
        "exact_fraction_mean": sum(r["exact"] for r in runs) / (b * len(runs)),
        "median_seconds_complete": median([r["seconds"] for r in whole]),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cells", nargs="+", default=list(DEFAULT_CELLS), help="width:batch:dtype")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per cascade")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cascade.json")
    args = parser.parse_args()
    cells = []
    for cell in args.cells:
        width, b, dtype = cell.split(":")
        cells.append(run_cell(int(width), int(b), dtype, args.seeds, args.budget))
    write_json(args.out, {"machine": machine(), "settings": run_settings(args), "cells": cells})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
