"""Samples whose zero sets, as float32's zero band reads them, hold a small value of their own.

The construction of an adversarial review (issue #10, 2026-12-07): a two-layer MLP
``Linear(60, 120) -> ReLU -> Linear(120, 10)`` (PyTorch init), b = 8 sparse non-negative
inputs (half their entries zero), cross-entropy over labels ``j mod 10``, one float32 gradient;
the first layer is attacked with ``sparsity="input"``. Sample 0 holds ``eps`` of its max at
one of its zeros f (inside the band), and sample 1 vanishes on sample 0's zeros except f
(``c`` of its max) and one more, g (``delta``): the mixture ``x_0 - (eps / c) x_1`` reads the
same zero set as x_0 (see :mod:`spear.core.released`).

Per batch: verified or not, and the distance of the worst returned (and certified) input to its
nearest true one over the batch's largest entry. A verified batch is *wrong* when that exceeds
1e-5 (float32 rounding of these inputs is ~1e-7). The README's run (about 30 s on 2 cores):
    python benchmarks/bench_small_values.py --out benchmarks/results/small_values.json
"""

from __future__ import annotations

import argparse
import time

import torch

import spear
from common import machine, write_json
from spear.experiments.stress import small_value_batch

#: (eps, c, delta): the small value of sample 0, and sample 1's values at f and g
SETTINGS = [
    (3e-5, 0.05, 0.003),
    (5e-5, 0.05, 0.003),
    (2e-5, 0.1, 0.005),
    (1e-5, 0.1, 0.005),
    (5e-5, 0.2, 0.01),
    (8e-5, 0.3, 0.02),
    (9e-5, 0.03, 0.002),
    (2e-5, 0.02, 0.0015),
]
WRONG = 1e-5


def client(eps: float, c: float, delta: float, seed: int):
    """The model, its float32 gradients and the true inputs (float64)."""
    X = small_value_batch(eps, c, delta, seed)[0].to(torch.float32)
    model = torch.nn.Sequential(torch.nn.Linear(60, 120), torch.nn.ReLU(), torch.nn.Linear(120, 10))
    loss = torch.nn.functional.cross_entropy(model(X), torch.arange(X.shape[0]) % 10)
    names = [name for name, _ in model.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))
    return model, grads, X.double()


def worst(found: torch.Tensor | None, truth: torch.Tensor) -> float | None:
    """The worst found input's distance to its nearest true one, over the largest true entry."""
    if found is None:
        return None
    return float(torch.cdist(found.double(), truth).amin(dim=1).max() / truth.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--max-proposals", type=int, default=20_000)
    parser.add_argument("--out", default="benchmarks/results/small_values.json")
    args = parser.parse_args()
    runs, tally = [], {"verified": 0, "verified_wrong": 0, "certified_wrong": 0, "unverified": 0}
    start = time.perf_counter()
    for eps, c, delta in SETTINGS:
        for seed in range(args.seeds):
            model, grads, X = client(eps, c, delta, seed)
            rec = spear.attack_layer(
                model, "0", grads, sparsity="input", seed=0, max_proposals=args.max_proposals
            )
            error, certified = worst(rec.inputs, X), worst(rec.certified_inputs, X)
            wrong = rec.verified and (error is None or error > WRONG)
            tally["verified" if rec.verified else "unverified"] += 1
            tally["verified_wrong"] += int(wrong)
            tally["certified_wrong"] += int(certified is not None and certified > 1e-3)
            runs.append(
                dict(
                    eps=eps,
                    c=c,
                    delta=delta,
                    seed=seed,
                    verified=rec.verified,
                    error=error,
                    certified_error=certified,
                    message=rec.message,
                )
            )
            print(
                f"eps {eps:.0e} c {c} delta {delta} seed {seed}: verified {rec.verified} "
                f"error {error} certified {certified}",
                flush=True,
            )
    payload = dict(
        machine=machine(),
        settings=vars(args),
        seconds=time.perf_counter() - start,
        tally=tally,
        wrong_above=WRONG,
        runs=runs,
    )
    write_json(args.out, payload)
    print(tally)


if __name__ == "__main__":
    main()
