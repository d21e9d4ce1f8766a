"""Does an input-side cascade percolate at MNIST b = 512 (LT setting, ground truth)?

The columns of dL/dZ of a found set K give the span of the other samples' inputs without
their own inputs: ``span(X_U)`` is the row space of dL/dW projected off ``span(Z_K)``
(``probe_known_columns.py``). A sample j of U is then pinned by its zero pixels alone (the
transposed Theorem 3.3) when the other samples of U, restricted to the pixels where ``x_j`` is
zero, have rank ``|U| - 1``: ``x_j`` is the only vector of the span (up to scale) vanishing
there. Its ReLU pattern ``W x_j > 0`` then pins its column by the head (``pin_columns``), which
joins K, and the span shrinks. This probe runs that cascade with the true zero sets from a
random K (the **idealized** part: it reads which samples *could* follow, not how to find them),
and then tries two server-side searches for such a pinned input on the span of a random K:

* ``lp``: the vertices of the cone ``span(X_U) & x >= 0`` (random objective, sum x = 1) by
  ``scipy.optimize.linprog``; a pinned input is one of them;
* ``projection``: alternating projection (the smallest entries as zeros, then the span's vector
  least on them) started from the true input plus noise: the basin such a search needs.

    python benchmarks/probe_input_cascade.py                  # seed 0, K of 0 and 56 (~3 min)
    python benchmarks/probe_input_cascade.py --seeds 0 1 2 --starts 0 20 40 56 100
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import linprog

from common import machine, run_settings, write_json
from probe_known_columns import lt_batch

#: a singular value below this share of the largest counts as zero (float64 ground truth)
RANK_RTOL = 1e-10
#: a recovered input within this of a true one (cosine distance) is that sample
MATCH_COSINE = 1e-9


def deficits(inputs: torch.Tensor, unfound: list[int]) -> dict[int, int]:
    """For each unfound sample: how many dimensions short of pinning its zero pixels leave it
    (0: pinned), from the other unfound samples restricted to those pixels."""
    block, r = inputs[unfound], len(unfound)
    out = {}
    for index, j in enumerate(unfound):
        zeros = block[index] == 0
        others = torch.cat([block[:index], block[index + 1 :]])[:, zeros]
        if r == 1:
            out[j] = 0
            continue
        values = torch.linalg.svdvals(others)
        out[j] = (r - 1) - int((values > RANK_RTOL * values[0]).sum())
    return out


def idealized_cascade(inputs: torch.Tensor, start: int, rng: np.random.Generator) -> dict:
    """Rounds of the cascade from a random found set of ``start`` samples: each round takes
    every sample its zero pixels pin in the span of the unfound ones."""
    b = inputs.shape[0]
    unfound = sorted(rng.permutation(b)[start:].tolist())
    rounds = []
    while unfound:
        pinned = [j for j, short in deficits(inputs, unfound).items() if short == 0]
        rounds.append({"unfound": len(unfound), "pinned": len(pinned)})
        print(f"  K = {start}: {len(unfound)} unfound, {len(pinned)} pinned", flush=True)
        if not pinned:
            break
        unfound = [j for j in unfound if j not in set(pinned)]
    return {"start": start, "rounds": rounds, "found": b - len(unfound)}


def unfound_span(
    grad: torch.Tensor, columns: torch.Tensor, known: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """An orthonormal basis (r, live pixels) of span(X_U) from dL/dW and the known columns, and
    the live pixels (the server's view)."""
    if known.size:
        basis, _ = torch.linalg.qr(columns[:, known])
        grad = grad - basis @ (basis.T @ grad)
    live = grad.norm(dim=0) > 1e-12 * grad.norm(dim=0).max()
    r = columns.shape[1] - known.size
    return torch.linalg.svd(grad[:, live], full_matrices=False).Vh[:r], live


def matches(x: torch.Tensor, truth: torch.Tensor) -> bool:
    cosine = (truth / truth.norm(dim=1, keepdim=True)) @ (x / x.norm())
    return float(1 - cosine.max()) < MATCH_COSINE


def lp_vertices(span: torch.Tensor, truth: torch.Tensor, tries: int, rng: np.random.Generator) -> dict:
    """Vertices of {x in span, x >= 0, sum x = 1} for random nonnegative objectives."""
    a = span.T.numpy()
    hits, cosines = 0, []
    for _ in range(tries):
        weights = rng.random(a.shape[0])
        res = linprog(a.T @ weights, A_ub=-a, b_ub=np.zeros(a.shape[0]), A_eq=a.sum(0)[None, :],
                      b_eq=[1.0], bounds=[(None, None)] * a.shape[1], method="highs")  # fmt: skip
        if res.status != 0:
            continue
        x = torch.from_numpy(a @ res.x)
        hits += matches(x, truth)
        cosines.append(float(((truth / truth.norm(dim=1, keepdim=True)) @ (x / x.norm())).max()))
    return {"tries": tries, "samples": hits, "median_cosine": float(np.median(cosines)) if cosines else None}


def projection(span: torch.Tensor, start: torch.Tensor, zeros: int, iterations: int = 60) -> torch.Tensor:
    """Alternating projection: the ``zeros`` smallest entries as the zero set, then the span's
    unit vector least on them."""
    x = start
    for _ in range(iterations):
        block = span[:, x.abs().argsort()[:zeros]]
        new = span.T @ torch.linalg.eigh(block @ block.T).eigenvectors[:, 0]
        new = new if new.sum() >= 0 else -new
        if torch.allclose(new, x, atol=1e-13):
            break
        x = new
    return x


def pinning_gaps(span: torch.Tensor, truth: torch.Tensor, pinned: list[int], count: int) -> list[float]:
    """How firmly the zero pixels pin each of ``count`` pinned samples: the second smallest
    singular value of the span's basis on them (the smallest is 0; the basis' are 1)."""
    return [float(torch.linalg.svdvals(span[:, truth[j] == 0])[-2]) for j in pinned[:count]]


def projection_basin(span: torch.Tensor, truth: torch.Tensor, pinned: list[int], noises: list[float],
                     tries: int, rng: np.random.Generator) -> list[dict]:  # fmt: skip
    """From pinned samples' true inputs plus noise of each relative size: how many end there."""
    r = span.shape[0]
    rows = []
    for noise in noises:
        hits = 0
        picks = rng.choice(pinned, min(tries, len(pinned)), replace=False)
        for j in picks:
            x = truth[j] / truth[j].norm()
            e = span.T @ (span @ torch.from_numpy(rng.standard_normal(x.numel())))
            start = x + noise * e / e.norm()
            hits += matches(projection(span, start, r - 1 + 60), truth[j][None])
        rows.append({"noise": noise, "tries": len(picks), "samples": hits})
        print(f"  projection from noise {noise}: {hits}/{len(picks)}", flush=True)
    return rows


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--starts", nargs="*", type=int, default=[0, 56])
    parser.add_argument("--search-start", type=int, default=200, help="|K| for the two searches")
    parser.add_argument("--lp-tries", type=int, default=10)
    parser.add_argument("--noises", nargs="+", type=float, default=[0.0, 0.15, 0.3])
    default_out = Path(__file__).parent / "results" / "probe_input_cascade.json"
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args()
    torch.set_num_threads(1)  # many small SVDs: two threads contend and run ~10x slower
    rows = []
    for seed in args.seeds:
        _, truth, grad, columns = lt_batch(args.dataset, args.batch_size, seed)
        inputs = truth.inputs.double().reshape(args.batch_size, -1)
        rng = np.random.default_rng(seed)
        started = time.perf_counter()
        row: dict = {"seed": seed, "cascades": [idealized_cascade(inputs, s, rng) for s in args.starts]}
        known = rng.permutation(args.batch_size)[: args.search_start]
        span, live = unfound_span(grad, columns, known)
        unfound = sorted(set(range(args.batch_size)) - set(known.tolist()))
        pinned = [j for j, short in deficits(inputs, unfound).items() if short == 0]
        truth_live = inputs[:, live]
        row["search"] = {
            "known": int(known.size),
            "pinned": len(pinned),
            "lp": lp_vertices(span, truth_live[unfound], args.lp_tries, rng),
            "projection": projection_basin(span, truth_live, pinned, args.noises, 12, rng),
            "pinning_gaps": pinning_gaps(span, truth_live, pinned, 25),
        }
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        print(f"seed {seed}: {row}", flush=True)
        payload = {"benchmark": "input-side cascade (LT setting, ground truth)",
                   "settings": run_settings(args), "machine": machine(), "rows": rows}  # fmt: skip
        write_json(args.out, payload)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
