"""Samples whose zero sets, as float32's zero band reads them, hold a small value of their own.

The construction of an adversarial review (issue #10, 2026-12-07): a two-layer MLP
``Linear(60, 120) -> ReLU -> Linear(120, 10)`` (PyTorch init), b = 8 sparse non-negative
inputs (half their entries zero), cross-entropy over labels ``j mod 10``, one float32 gradient;
the first layer is attacked with ``sparsity="input"``. Sample 0 holds ``eps`` of its max at
one of its zeros f (inside the band), and sample 1 vanishes on sample 0's zeros except f
(``c`` of its max) and one more, g (``delta``): the mixture ``x_0 - (eps / c) x_1`` reads the
same zero set as x_0 (see :mod:`spear.core.released`).

Per batch: verified or not, the distance of the worst returned (and certified) input to its
nearest true one over the batch's largest entry, and whether any returned input of a verified
batch (any certified input) is *off*: farther from the truth than its stated precision
allows (30 times ``input_precision``, at least 1e-5 of its norm; see ``off``). The README's
run (about a minute on 2 cores):
    python benchmarks/bench_small_values.py --out benchmarks/results/small_values_epyc_released.json
"""

from __future__ import annotations

import argparse
import time

import torch

import spear
from common import machine, write_json
from spear.core.verdict import AUDIT_SLACK
from spear.experiments.stress import make_confident, small_value_batch

#: (eps, c, delta): the small value of sample 0, and sample 1's values at f and g. The batches
#: of the first review; then (second review) delta = 0, where the mixture vanishes on every
#: zero of x_0 (nothing to release: the batch must stay unverified, and no certified sample
#: may be the mixture), and batches with one confident sample (``CONFIDENT``)
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
ZERO_DELTA = [(3e-5, 0.05, 0.0), (5e-5, 0.1, 0.0)]
#: settings run with sample 7 made confident first (SGD on it alone to a loss below 1e-3)
CONFIDENT = [(3e-5, 0.05, 0.003), (5e-5, 0.1, 0.005)]
#: an input is *off* when it is farther from its nearest true input (relative to that input's
#: norm) than its stated precision allows: ``AUDIT_SLACK`` times ``input_precision`` (or
#: ``certified_precision``), at least ``FLOOR`` (rounding of these inputs); a sample without a
#: stated precision is held to float32's tolerance, ``UNSTATED``
FLOOR = 1e-5
UNSTATED = 1e-3


def client(eps: float, c: float, delta: float, seed: int, confident: bool = False):
    """The model, its float32 gradients and the true inputs (float64)."""
    X = small_value_batch(eps, c, delta, seed)[0].to(torch.float32)
    model = torch.nn.Sequential(torch.nn.Linear(60, 120), torch.nn.ReLU(), torch.nn.Linear(120, 10))
    labels = torch.arange(X.shape[0]) % 10
    if confident:
        make_confident(model, X, labels, 7)
    loss = torch.nn.functional.cross_entropy(model(X), labels)
    names = [name for name, _ in model.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))
    return model, grads, X.double()


def worst(found: torch.Tensor | None, truth: torch.Tensor) -> float | None:
    """The worst found input's distance to its nearest true one, over the largest true entry."""
    if found is None:
        return None
    return float(torch.cdist(found.double(), truth).amin(dim=1).max() / truth.abs().max())


def off(found: torch.Tensor | None, precision: torch.Tensor | None, truth: torch.Tensor) -> int:
    """How many found inputs lie farther from their nearest true one than their stated
    precision allows (module constants)."""
    if found is None:
        return 0
    D = torch.cdist(found.double(), truth)
    nearest = D.argmin(dim=1)
    error = D.amin(dim=1) / truth[nearest].norm(dim=1)
    stated = torch.full_like(error, UNSTATED) if precision is None else precision.double().cpu()
    allowed = torch.where(torch.isfinite(stated), (AUDIT_SLACK * stated).clamp_min(FLOOR), UNSTATED)
    return int((error > allowed).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--max-proposals", type=int, default=20_000)
    parser.add_argument("--out", default="benchmarks/results/small_values.json")
    args = parser.parse_args()
    groups = {
        "small_value": (SETTINGS, False),
        "zero_delta": (ZERO_DELTA, False),
        "confident": (CONFIDENT, True),
    }
    runs, tallies = [], {}
    start = time.perf_counter()
    for group, (settings, confident) in groups.items():
        tally = tallies[group] = {"verified": 0, "verified_wrong": 0, "certified_wrong": 0, "unverified": 0}
        for eps, c, delta in settings:
            for seed in range(args.seeds):
                runs.append(run(group, eps, c, delta, seed, confident, args.max_proposals, tally))
    payload = dict(
        machine=machine(),
        settings=vars(args),
        seconds=time.perf_counter() - start,
        tally=tallies,
        off_above=dict(audit_slack=AUDIT_SLACK, floor=FLOOR, unstated=UNSTATED),
        runs=runs,
    )
    write_json(args.out, payload)
    print(tallies)


def run(
    group: str, eps: float, c: float, delta: float, seed: int, confident: bool, proposals: int, tally: dict
):
    """One attack, counted into ``tally``; its record."""
    model, grads, X = client(eps, c, delta, seed, confident)
    rec = spear.attack_layer(model, "0", grads, sparsity="input", seed=0, max_proposals=proposals)
    error, certified = worst(rec.inputs, X), worst(rec.certified_inputs, X)
    tally["verified" if rec.verified else "unverified"] += 1
    tally["verified_wrong"] += int(rec.verified and off(rec.inputs, rec.input_precision, X) > 0)
    tally["certified_wrong"] += int(off(rec.certified_inputs, rec.certified_precision, X) > 0)
    print(
        f"{group} eps {eps:.0e} c {c} delta {delta} seed {seed}: verified {rec.verified} "
        f"error {error} certified {certified}",
        flush=True,
    )
    return dict(
        group=group,
        eps=eps,
        c=c,
        delta=delta,
        seed=seed,
        verified=rec.verified,
        error=error,
        certified_error=certified,
        message=rec.message,
    )


if __name__ == "__main__":
    main()
