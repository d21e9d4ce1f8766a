"""Vulnerability proxies against what attacks reach (issue #13; LAVP's evaluation, Hong et al.
AAAI 2024): Spearman's rho between each per-sample proxy and the per-sample PSNR, SSIM, LPIPS and
MSE of the optimization attack that minimises the proxy's loss (L2: DLG; cosine: Geiping et al.;
the gradient norm against both), each sample attacked on its own (b = 1 FedSGD gradient, the
authors' default iterations). Beyond LAVP: rho against the order in which SPEAR certifies the
samples when the whole batch is attacked at once.

Settings: MNIST, the 6 x 200 ReLU MLP of ``spear attack``, float64; untrained, and trained
``--train-steps`` SGD steps; ``--samples`` samples (one batch, seed 0).

Default (about 16 minutes on 2 cores, nothing else running):
    python benchmarks/bench_proxies.py
Full setting (more samples, tighter intervals; hours):
    python benchmarks/bench_proxies.py --samples 200
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import machine, run_settings, write_json
from spear.experiments import ExperimentSettings
from spear.experiments.report import json_safe
from spear.experiments.vulnerability import ATTACK_FOR_LOSS, ClientCase, proxy_correlations

OUT = Path(__file__).parent / "results" / "proxies.json"


def study(samples: int, steps: int, budget: float) -> dict:
    settings = ExperimentSettings(batch_size=samples, seed=0, pretrain_steps=steps, time_budget=budget)
    case = ClientCase.draw(settings)
    start = time.perf_counter()
    ranked = case.proxies()
    seconds = {"proxies": time.perf_counter() - start}
    scores = {}
    for method in ATTACK_FOR_LOSS.values():
        start = time.perf_counter()
        scores[method] = case.attack_each_sample(method)
        seconds[method] = time.perf_counter() - start
    start = time.perf_counter()
    order = case.spear_order({"time_budget": budget})
    seconds["spear"] = time.perf_counter() - start
    return {
        "train_steps": steps,
        "samples": samples,
        "proxies": ranked.values,
        "scores": scores,
        "spear_order": order,
        "correlations": proxy_correlations(ranked.values, scores, order),
        "seconds": seconds,
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--train-steps", type=int, nargs="+", default=[0, 200])
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    studies = []
    for steps in args.train_steps:
        studies.append(study(args.samples, steps, args.budget))
        for row in studies[-1]["correlations"]:
            if row["score"] in ("psnr", "certified_order"):
                print(steps, row["proxy"], row["attack"], row["score"], row["rho"], row["ci95"])
    payload = {"machine": machine(), "args": run_settings(args), "studies": studies}
    write_json(args.out, json_safe(payload))


if __name__ == "__main__":
    main()
