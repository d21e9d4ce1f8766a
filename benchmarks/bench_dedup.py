"""The candidate pool's duplicate check on one large step (``CandidatePool.add``).

A float32 step can snap tens of thousands of directions, nearly all distinct (photos32,
6 x 500 MLP trained 200 steps, first layer, b = 64, seed 5: one step brought 34,790 new ones
to a pool of 207, and checking them ran 2.6 s past a 30.5 s budget). Each direction is
compared with the pool and with the new ones kept before it; this script times that check on
random unit directions of the same shape, a fifth of them copies (either sign, nudged within
the duplicate threshold), and records how many were kept.

Default (under a minute on 2 cores):
    python benchmarks/bench_dedup.py
"""

from __future__ import annotations

import argparse
import time

import torch

from common import machine, median, run_settings, write_json
from spear.core.filtering import DUPLICATE_COS, CandidatePool


def directions(n: int, b: int, seed: int) -> torch.Tensor:
    """n unit directions of dimension b: distinct ones, and a fifth copies of earlier ones."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.functional.normalize(torch.randn(n, b, dtype=torch.float64, generator=g), dim=1)
    copy = torch.rand(n, generator=g) < 0.2
    source = (torch.rand(n, generator=g) * torch.arange(n)).long()  # an earlier direction
    sign = torch.where(torch.rand(n, 1, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    nudged = base[source] * sign + 1e-7 * torch.randn(n, b, dtype=torch.float64, generator=g)
    out = torch.where(copy.unsqueeze(1), nudged, base)
    return torch.nn.functional.normalize(out, dim=1)


def one(n: int, b: int, pool_size: int, seed: int) -> dict:
    new = directions(n + pool_size, b, seed)
    pool = CandidatePool(batch_size=b, rows=1, duplicate_cos=DUPLICATE_COS)
    pool.directions = new[:pool_size]
    start = time.perf_counter()
    kept, _ = pool._first_new(new[pool_size:])
    return {"seed": seed, "seconds": time.perf_counter() - start, "kept": int(kept.numel())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 12000, 35000])
    parser.add_argument("--b", type=int, default=64)
    parser.add_argument("--pool", type=int, default=207)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/dedup.json")
    args = parser.parse_args()
    cells = []
    for n in args.sizes:
        runs = [one(n, args.b, args.pool, seed) for seed in range(args.seeds)]
        seconds = median([r["seconds"] for r in runs])
        cells.append({"n": n, "b": args.b, "pool": args.pool, "median_seconds": seconds, "runs": runs})
        print(f"n = {n:6d}  b = {args.b}  median {seconds:.3f} s  kept {runs[0]['kept']}", flush=True)
    payload = {"benchmark": "pool duplicate check", "settings": run_settings(args), "machine": machine()}
    payload["cells"] = cells
    print("wrote", write_json(args.out, payload))


if __name__ == "__main__":
    main()
