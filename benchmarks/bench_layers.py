"""Beyond the first layer (issue #12): every layer of the paper's MLP (its Table 4), CNN features
with feature inversion (its Table 6 setting, at MNIST scale), and UCI Adult rows (its Table 2).

Every run is one ``spear.experiments.run_experiment`` (the product end to end: simulated FedSGD
client, attack from the server's view, inversion back to the data, evaluation), one seed per run
(network, batch and attack), under a ``--budget`` seconds time budget.

Sections (``--sections``; each merges into the JSON, so one can be rerun alone):
  * ``layers``: 6-layer MLP, m = 400, b = 20 (Table 4): Linear l = 1..5 (modules 0, 2, 4, 6, 8,
    each followed by a ReLU) and l = 6 (module 10, the 10-way output layer, by input sparsity:
    its gradient has rank <= 10, so b = 8 there), at initialization and after
    ``--train-steps`` SGD steps. Per cell: verified layer inputs, data exact (through the lower
    layers' gradients), median seconds and proposals.
  * ``cnn``: ``--model cnn`` (small VGG, head 512) on MNIST, b = 16, untrained and trained 300
    steps: exact conv features, the images feature inversion gets from them, and the same
    inversion from the *true* features (the ceiling). Writes ``cnn_inversion.png``.
  * ``adult``: 6 x 200 MLP on UCI Adult, b in ``--adult-batches``: verified, exact rows, TabLeak's
    categorical / numeric accuracy (over the recovered batches), and how many batches have
    linearly independent rows (one-hot rows sharing few categories often do not, beyond ~30).

Default (about 15 minutes on 2 cores, nothing else running):
    python benchmarks/bench_layers.py
Full setting (the paper's 100 batches per cell; hours):
    python benchmarks/bench_layers.py --seeds 100 --budget 600
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import machine, median, run_settings, write_json
from spear.errors import SpearError
from spear.experiments import ExperimentSettings, run_experiment

OUT = Path(__file__).parent / "results" / "layers.json"
#: Table 4's layers: (module name, l, batch size)
MLP_LAYERS = [("0", 1, 20), ("2", 2, 20), ("4", 3, 20), ("6", 4, 20), ("8", 5, 20), ("10", 6, 8)]


def _run(settings: ExperimentSettings) -> dict:
    start = time.perf_counter()
    try:
        result = run_experiment(settings)
    except SpearError as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - start}
    record = result.record
    record["wall_seconds"] = time.perf_counter() - start
    record["_images"] = result.reconstruction_images, result.true_images
    return record


def _layer_cell(layer: str, level: int, b: int, steps: int, seeds: int, budget: float) -> dict:
    runs = []
    for seed in range(seeds):
        settings = ExperimentSettings(
            batch_size=b, width=400, layer=layer, pretrain_steps=steps, seed=seed, time_budget=budget
        )
        record = _run(settings)
        features = record.get("features") or {}
        runs.append(
            {
                "seed": seed,
                "verified": bool(record.get("verified")),
                "features_exact": features.get("exact_samples", record.get("exact_samples")) == b,
                "data_exact": record.get("metrics", {}).get("accuracy") == 1.0,
                "data_verified": (record.get("inversion") or record).get("verified"),
                "seconds": record["stats"]["seconds"] if "stats" in record else record["seconds"],
                "proposals": record.get("stats", {}).get("proposals"),
                "error": record.get("error"),
            }
        )
        print(f"layer {layer} (l={level}) steps {steps} seed {seed}: {runs[-1]}", flush=True)
    return {
        "layer": layer,
        "l": level,
        "batch_size": b,
        "train_steps": steps,
        "verified": sum(r["verified"] for r in runs) / seeds,
        "features_exact": sum(r["features_exact"] for r in runs) / seeds,
        "data_exact": sum(r["data_exact"] for r in runs) / seeds,
        "data_verified": sum(bool(r["data_verified"]) for r in runs) / seeds,
        "median_seconds": median([r["seconds"] for r in runs if r["seconds"] is not None]),
        "median_proposals": median([r["proposals"] for r in runs if r["proposals"] is not None]),
        "runs": runs,
    }


def layers_section(args) -> list[dict]:
    cells = []
    for steps in args.train_steps:
        for layer, level, b in MLP_LAYERS:
            cells.append(_layer_cell(layer, level, b, steps, args.seeds, args.budget))
    return cells


def _mean(records: list[dict], section: str, name: str) -> float | None:
    """The mean over the batches where the value exists (NaN: the batch was not recovered)."""
    values = [r[section][name] for r in records if r.get(section) and r[section].get(name) is not None]
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else None


def cnn_section(args) -> list[dict]:
    cells, grid = [], None
    for steps in (0, 300):
        records = []
        for seed in range(args.cnn_seeds):
            settings = ExperimentSettings(
                batch_size=16, model="cnn", pretrain_steps=steps, seed=seed, time_budget=args.budget
            )
            record = _run(settings)
            images = record.pop("_images", None)
            if steps and seed == 0 and images and images[0] is not None:
                grid = images
            records.append(record)
            print(
                f"cnn steps {steps} seed {seed}: verified {record.get('verified')} "
                f"metrics {record.get('metrics')} ceiling {record.get('ceiling')}",
                flush=True,
            )
        cells.append(
            {
                "train_steps": steps,
                "seeds": args.cnn_seeds,
                "features_verified": sum(bool(r.get("verified")) for r in records) / len(records),
                "features_exact": sum((r.get("features") or {}).get("exact_samples") == 16 for r in records)
                / len(records),
                "feature_cosine": _mean_nested(records, "feature_cosine"),
                "inverted": {k: _mean(records, "metrics", k) for k in ("psnr", "ssim", "lpips")},
                "ceiling": {k: _mean(records, "ceiling", k) for k in ("psnr", "ssim", "lpips")},
                "median_attack_seconds": median([r["stats"]["seconds"] for r in records if "stats" in r]),
                "median_wall_seconds": median([r["wall_seconds"] for r in records if "wall_seconds" in r]),
            }
        )
    if grid is not None:
        _save_grid(*grid)
    return cells


def _mean_nested(records: list[dict], name: str) -> float | None:
    values = [r["features"]["metrics"][name] for r in records if r.get("features")]
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else None


def _save_grid(reconstruction, truth) -> None:
    from spear.experiments import save_grid

    save_grid(OUT.parent / "cnn_inversion.png", reconstruction, truth, max_images=16)


def _independent(b: int, seed: int) -> bool:
    """Whether the client's rows are linearly independent (evaluation side: the true batch)."""
    import torch

    from spear.data import load_dataset
    from spear.data.base import sample_batch

    dataset = load_dataset("adult")
    rows, _ = sample_batch(dataset, b, seed)
    return int(torch.linalg.matrix_rank(dataset.normalize(rows))) == b


def adult_section(args) -> list[dict]:
    cells = []
    for b in args.adult_batches:
        independent = [_independent(b, seed) for seed in range(args.seeds)]
        records = [
            _run(ExperimentSettings(dataset="adult", batch_size=b, seed=seed, time_budget=args.budget))
            for seed in range(args.seeds)
        ]
        for r in records:
            r.pop("_images", None)
        ok = [r for r in records if "metrics" in r]
        cells.append(
            {
                "batch_size": b,
                "seeds": args.seeds,
                "verified": sum(bool(r.get("verified")) for r in ok) / args.seeds,
                "exact_batches": sum(r["metrics"]["accuracy"] == 1.0 for r in ok) / args.seeds,
                "exact_rows": sum(r["exact_samples"] for r in ok) / (b * args.seeds),
                "independent_rows": sum(independent) / args.seeds,
                "exact_where_independent": sum(
                    r.get("metrics", {}).get("accuracy") == 1.0
                    for r, ind in zip(records, independent, strict=True)
                    if ind
                )
                / max(1, sum(independent)),
                "categorical_accuracy": _mean(ok, "metrics", "categorical_accuracy"),
                "numeric_accuracy": _mean(ok, "metrics", "numeric_accuracy"),
                "median_seconds": median([r["stats"]["seconds"] for r in ok]),
                "errors": [r["error"] for r in records if "error" in r],
            }
        )
        print(f"adult b={b}: {cells[-1]}", flush=True)
    return cells


SECTIONS = {"layers": layers_section, "cnn": cnn_section, "adult": adult_section}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--cnn-seeds", type=int, default=3)
    parser.add_argument("--train-steps", type=int, nargs="+", default=[0, 1000])
    parser.add_argument("--adult-batches", type=int, nargs="+", default=[16, 32, 40])
    parser.add_argument("--budget", type=float, default=60.0, help="time budget per attack (seconds)")
    args = parser.parse_args()
    payload = json.loads(OUT.read_text()) if OUT.exists() else {}
    for name in args.sections:
        payload[name] = SECTIONS[name](args)
        payload[f"{name}_settings"] = {k: v for k, v in run_settings(args).items() if k != "sections"}
    payload["machine"] = machine()
    write_json(OUT, payload)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
