"""How many columns of dL/dZ a cascade needs before samples follow (LT setting, ground truth).

The passive benchmark's MNIST b = 512 is not reached: the search finds few exact columns of
dL/dZ there, and no sample is certified before all b are found (README, "What is left"). This
probe asks the idealized question behind a column-first cascade: given the exact columns of a
set K of samples (chosen at random, from the ground truth), does each sample of K follow?

With the columns ``Z_K`` known, ``G^T p_j = x_j + X_U c`` for the dual ``p_j`` of column j
(``Z_K^T p_j = e_j``, ``p_j`` in the span of ``Z_K``), U the samples outside K. ``span(X_U)`` is
the row space of G projected off ``span(Z_K)``, so ``x_j`` is known up to that (b - |K|)-
dimensional span. The probe solves, with ``scipy.optimize.linprog`` (HiGHS), the least-L1
point of that affine set with ``0 <= x <= 1`` and the sample's own ReLU signs (``W x`` >= 0 on
its column's support, <= 0 elsewhere), and counts the samples it returns exactly (1e-6).
An attack would have only the server's columns; this is an upper bound on what such a cascade
could do, not an attack.

    python benchmarks/probe_known_columns.py                      # MNIST b = 512, seed 0
    python benchmarks/probe_known_columns.py --known 64 256 384 480 --samples 12
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import linprog

from common import machine, run_settings, write_json
from spear.data import load_dataset
from spear.fl import shallow_mlp, simulate_fedsgd

MATCH_ATOL = 1e-6


def per_sample_columns(
    model: torch.nn.Sequential, inputs: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """(m, b) each sample's dL/dZ of the first layer under the batch-mean cross-entropy."""
    first, head = model[0], model[2]
    pre = inputs @ first.weight.detach().T.double()
    probs = torch.softmax(torch.relu(pre) @ head.weight.detach().T.double(), dim=1)
    probs[torch.arange(len(labels)), labels] -= 1
    return ((pre > 0).double() * (probs @ head.weight.detach().double())).T / len(labels)


def lt_batch(name: str, b: int, seed: int):
    """The LT setting's network, one batch of ``name`` (raw inputs), the first layer's dL/dW in
    float64 and each sample's column of dL/dZ (checked: they rebuild dL/dW)."""
    dataset = load_dataset(name)
    model = shallow_mlp(dataset.features, seed=seed)
    view, truth = simulate_fedsgd(model, dataset, b, seed=seed, normalize=False)
    grad = view.gradients["0.weight"].double()
    columns = per_sample_columns(model, truth.inputs.double(), truth.labels)
    assert float((columns @ truth.inputs.double() - grad).abs().max()) <= 1e-12 * float(grad.abs().max())
    return model, truth, grad, columns


def solve_sample(
    offset: np.ndarray, span: np.ndarray, weight: np.ndarray, active: np.ndarray
) -> np.ndarray | None:
    """The least-L1 ``x = offset + span c`` with ``0 <= x <= 1`` and ReLU signs ``active``."""
    sign = np.where(active, -1.0, 1.0)  # active rows: -W x <= 0; inactive: W x <= 0
    a_ub = np.vstack([-span, span, sign[:, None] * (weight @ span)])
    b_ub = np.concatenate([offset, 1 - offset, -sign * (weight @ offset)])
    free = [(None, None)] * span.shape[1]
    res = linprog(span.sum(axis=0), A_ub=a_ub, b_ub=b_ub, bounds=free, method="highs")
    return offset + span @ res.x if res.status == 0 else None


def probe(grad: torch.Tensor, columns: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
          known: int, samples: int, rng: np.random.Generator) -> dict:  # fmt: skip
    """Samples of a random known set of ``known`` columns returned exactly by the program."""
    b = columns.shape[1]
    live = grad.norm(dim=0) > 1e-12 * grad.norm(dim=0).max()
    chosen = rng.choice(b, known, replace=False)
    zk = columns[:, chosen]
    basis, _ = torch.linalg.qr(zk)
    _, _, vh = torch.linalg.svd((grad - basis @ (basis.T @ grad))[:, live], full_matrices=False)
    span = vh[: b - known].T.numpy()
    duals = zk @ torch.linalg.solve(zk.T @ zk, torch.eye(known, dtype=zk.dtype))
    offsets = (grad.T @ duals).T[:, live].numpy()
    errors = []
    for t in range(min(samples, known)):
        j = int(chosen[t])
        x = solve_sample(offsets[t], span, weight[:, live].numpy(), (columns[:, j] != 0).numpy())
        errors.append(float("nan") if x is None else float(np.abs(x - inputs[j, live].numpy()).max()))
    return {
        "known": known,
        "tried": len(errors),
        "exact": sum(e <= MATCH_ATOL for e in errors),
        "errors": errors,
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--known", nargs="+", type=int, default=[64, 256, 384, 480])
    parser.add_argument("--samples", type=int, default=12, help="samples of K solved per setting")
    default_out = Path(__file__).parent / "results" / "probe_known_columns.json"
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args()
    model, truth, grad, columns = lt_batch(args.dataset, args.batch_size, args.seed)
    inputs = truth.inputs.double()
    rng = np.random.default_rng(args.seed)
    rows = []
    for known in args.known:
        start = time.perf_counter()
        row = probe(grad, columns, inputs, model[0].weight.detach().double(), known, args.samples, rng)
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(f"known {known:4d}: {row['exact']}/{row['tried']} exact  {row['seconds']:.1f} s", flush=True)
        payload = {"benchmark": "known columns -> samples (LT setting, ground truth)",
                   "settings": run_settings(args), "machine": machine(), "rows": rows}  # fmt: skip
        write_json(args.out, payload)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
