"""SPEAR beside the baselines on identical batches (issue #13): paper Table 1's quantities (PSNR,
SSIM, LPIPS, exact batches, seconds) per method, and one image grid with a row per method.

Every cell runs ``spear.experiments.compare.run_comparison`` (one simulated FedSGD client on
MNIST, the 6 x 200 ReLU MLP of ``spear attack``, float64; every method gets the same server view)
for seeds 0..``--seeds``-1. The baselines run with their authors' defaults (Geiping et al. 4000
signed-Adam steps, DLG 300 L-BFGS steps, CPA by FastICA) and recover labels from the output
layer; SPEAR and SPEAR+prior get a ``--budget`` seconds time budget.

Default (about 20 minutes on 2 cores, nothing else running):
    python benchmarks/bench_compare.py
The issue's smallest check alone:
    python benchmarks/bench_compare.py --batch-sizes 4 --seeds 1
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from common import machine, run_settings, write_json
from spear.experiments import ExperimentSettings
from spear.experiments.compare import run_comparison
from spear.experiments.report import json_safe, save_comparison_grid

OUT = Path(__file__).parent / "results" / "compare.json"
#: per batch size, the methods run: SPEAR + prior where SPEAR alone is at its edge (m/b ~ 3)
METHODS = {
    4: ["spear", "geiping", "dlg", "cpa"],
    16: ["spear", "geiping", "dlg", "cpa"],
    64: ["spear", "spear+prior", "geiping", "dlg", "cpa"],
}


def _mean(values):
    finite = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(finite) if finite else None


def summarize(records: list[dict]) -> dict:
    out = {"runs": len(records)}
    for name in ("psnr", "ssim", "lpips", "label_accuracy"):
        out[name] = _mean([r["metrics"].get(name) for r in records])
    out["exact_batches"] = sum(r["metrics"]["accuracy"] == 1.0 for r in records)
    out["exact_samples"] = sum(r["exact_samples"] for r in records)
    out["verified"] = sum(bool(r["verified"]) for r in records)
    out["median_seconds"] = statistics.median(r["seconds"] for r in records)
    return out


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cells, raw = [], []
    for b in args.batch_sizes:
        methods = METHODS.get(b, METHODS[16])
        per_method: dict[str, list[dict]] = {m: [] for m in methods}
        for seed in range(args.seeds):
            settings = ExperimentSettings(batch_size=b, seed=seed, time_budget=args.budget)
            result = run_comparison(settings, methods)
            for record in result.records:
                per_method[record["method"]].append(record)
                raw.append({k: v for k, v in record.items() if k != "per_sample"})
                print(b, seed, record["method"], f"{record['seconds']:.1f}s", record["metrics"].get("psnr"))
            if seed == 0 and result.truth is not None:
                save_comparison_grid(args.out.with_name(f"compare_b{b}.png"), result.images, result.truth, 8)
        for method, records in per_method.items():
            cells.append({"batch_size": b, "method": method, **summarize(records)})
    payload = {"machine": machine(), "args": run_settings(args), "cells": cells, "runs": raw}
    write_json(args.out, json_safe(payload))
    for c in cells:
        print(c)


if __name__ == "__main__":
    main()
