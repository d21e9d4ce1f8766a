"""The README's results table: paper Table 1 format for several data sets and batch sizes.

Runs ``spear evaluate`` (the library's resumable sweep) for each (data set, b) with the default
network (6-layer ReLU, width 200, PyTorch init) and writes JSON plus a Markdown table.

Default (a few minutes on 2 cores): 5 batches per cell.
    python benchmarks/results_table.py
Paper setting: --batches 100
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from common import machine, run_settings, write_json
from spear.experiments import ExperimentSettings, run_batches, summarize


def fmt(stat: dict, digits: int = 4) -> str:
    if stat["mean"] is None:
        return "n/a"
    mean = stat["mean"]
    text = f"{mean:.{digits}g}" if abs(mean) < 1e-2 else f"{mean:.{digits}f}".rstrip("0").rstrip(".")
    return text if stat.get("ci95") is None else f"{text} ± {stat['ci95']:.2g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--datasets", nargs="+", default=["mnist", "fashion-mnist", "digits", "photos32", "photos64"]
    )
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--time-budget", type=float, default=120.0)
    ap.add_argument("--runs", default="runs/results_table")
    ap.add_argument("--out", default="benchmarks/results/results_table.json")
    args = ap.parse_args()
    rows, lines = (
        [],
        [
            "| data set | b | PSNR | SSIM | MSE | LPIPS | exact batches | median s |",
            "|---|---|---|---|---|---|---|---|",
        ],
    )
    for name in args.datasets:
        for b in args.batch_sizes:
            settings = dataclasses.replace(
                ExperimentSettings(), dataset=name, batch_size=b, time_budget=args.time_budget
            )
            records = run_batches(settings, args.batches, Path(args.runs) / f"{name}-b{b}.jsonl")
            summary = summarize(records)
            secs = sorted(r["stats"]["seconds"] for r in records)
            acc = summary["accuracy"]
            rows.append({"dataset": name, "batch_size": b, "summary": summary})
            cells = [
                name,
                str(b),
                fmt(summary["psnr"]),
                fmt(summary["ssim"], 6),
                fmt(summary["mse"], 3),
                fmt(summary["lpips"], 3),
                f"{round(acc['mean'] * acc['n'])}/{acc['n']}",
                f"{secs[len(secs) // 2]:.1f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    write_json(
        args.out,
        {
            "benchmark": "results_table",
            "machine": machine(),
            "args": run_settings(args),
            "results": rows,
            "markdown": "\n".join(lines),
        },
    )


if __name__ == "__main__":
    main()
