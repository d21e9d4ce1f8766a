"""Does a sample's exact head vector give its ReLU pattern by one linear program? (LT setting, b = 512)

In the passive benchmark's network a sample's column of dL/dZ is ``g_j = D_j h_j`` with
``h_j = W2^T delta_j`` (``delta_j``: softmax minus one-hot, over b) and ``D_j`` its 0/1 ReLU
pattern, and every ``g_j`` lies in the gradient's column space S (dimension b). Given ``h_j``
exactly, the pattern ``a_j`` is a 0/1 vector of the subspace ``T_j = {t : h_j * t in S}``: a
vertex of the box polytope ``T_j`` cut by ``[0, 1]^m`` at which *every* coordinate is tight. For a
random subspace of T's dimension, a 0/1 point is the polytope's only point once some 100 of its
coordinates are known (the count of Donoho and Tanner's simple-vector result: at most a few
percent fail with 100 known, well under 1e-3 with 150), so one linear program would return it.

This probe measures that from the ground truth (MNIST, b = 512, m = 1000, the benchmark's
network), for samples drawn at random: the program ``{t in [0, 1]^m, h_j * t in S}`` with K of
the pattern's coordinates fixed to their true values (and one active coordinate at 1 for the
scale), under a random objective; a sample counts when the returned ``t`` is its pattern to 1e-6.
It also measures what makes the polytope larger than a random one's: samples with the same
prediction and label have nearly parallel head vectors, so another sample's pattern ``a_k`` is
nearly in ``T_j`` (``h_j * a_k`` is close to ``g_k``, which is in S), and the segment from ``a_j``
towards ``a_k`` leaves every tight coordinate tight in the right direction. Printed: the median
largest cosine between one sample's ``delta`` and another's, and the relative distance of
``h_j * a_k`` from S for k the most parallel sample and for a random one.

    python benchmarks/probe_pattern_lp.py                  # seed 0, K = 0, 50, 100, 150
    python benchmarks/probe_pattern_lp.py --known 0 300 --samples 4
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

MATCH_ATOL = 1e-6


def head_deltas(model: torch.nn.Sequential, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(b, k) each sample's softmax minus one-hot (the batch mean's 1/b left out)."""
    pre = inputs @ model[0].weight.detach().T.double()
    probs = torch.softmax(torch.relu(pre) @ model[2].weight.detach().T.double(), dim=1)
    probs[torch.arange(len(labels)), labels] -= 1
    return probs


def softmax_of(deltas: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The softmax back from ``deltas`` (softmax minus one-hot)."""
    probs = deltas.clone()
    probs[torch.arange(len(labels)), labels] += 1
    return probs


def pattern_by_lp(h: np.ndarray, off_space: np.ndarray, pattern: np.ndarray, known: np.ndarray,
                  rng: np.random.Generator) -> np.ndarray | None:  # fmt: skip
    """The box program's point: ``t in [0, 1]^m`` with ``off_space^T (h * t) = 0``, ``t`` fixed to
    ``pattern`` on ``known`` and to 1 on the first active row; a random objective."""
    m = h.size
    bounds = [(0.0, 1.0)] * m
    for i in known:
        bounds[i] = (float(pattern[i]),) * 2
    bounds[int(np.flatnonzero(pattern)[0])] = (1.0, 1.0)
    a_eq = off_space.T * h[None, :]
    res = linprog(rng.standard_normal(m), A_eq=a_eq, b_eq=np.zeros(a_eq.shape[0]), bounds=bounds,
                  method="highs")  # fmt: skip
    return res.x if res.status == 0 else None


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--known", nargs="+", type=int, default=[0, 50, 100, 150])
    parser.add_argument("--samples", type=int, default=8, help="samples solved per K")
    default_out = Path(__file__).parent / "results" / "probe_pattern_lp.json"
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args()
    b = args.batch_size
    model, truth, grad, columns = lt_batch(args.dataset, b, args.seed)
    inputs = truth.inputs.double()
    head = model[2].weight.detach().double().T.numpy()  # (m, k)
    basis = torch.linalg.svd(grad, full_matrices=True)[0]
    space, off_space = basis[:, :b].numpy(), basis[:, b:].numpy()
    deltas = head_deltas(model, inputs, truth.labels)
    unit = torch.nn.functional.normalize(deltas, dim=1)
    cosine = (unit @ unit.T).fill_diagonal_(-2.0)
    patterns = (columns != 0).T.numpy()  # (b, m)
    heads = deltas.numpy() @ head.T  # (b, m): h_j up to the 1/b

    def off(j: int, k: int) -> float:
        y = heads[j] * patterns[k]
        return float(np.linalg.norm(y - space @ (space.T @ y)) / np.linalg.norm(y))

    predicted = softmax_of(deltas, truth.labels).argmax(1)
    rng = np.random.default_rng(args.seed)
    drawn = rng.choice(b, 64, replace=False)
    nearest = [off(int(j), int(cosine[j].argmax())) for j in drawn]
    random_k = [off(int(j), int(k)) for j, k in zip(drawn, rng.choice(b, 64), strict=True)]
    geometry = {
        "correctly_classified": float((predicted == truth.labels).double().mean()),
        "largest_cosine_quantiles": np.quantile(cosine.max(1).values.numpy(), [0.1, 0.5, 0.9]).tolist(),
        "off_space_nearest_median": float(np.median(nearest)),
        "off_space_random_median": float(np.median(random_k)),
    }
    print(geometry, flush=True)
    rows = []
    for known in args.known:
        start, errors, fractional = time.perf_counter(), [], []
        for j in rng.choice(b, args.samples, replace=False):
            known_rows = rng.choice(grad.shape[0], known, replace=False)
            t = pattern_by_lp(heads[j], off_space, patterns[j].astype(float), known_rows, rng)
            errors.append(float("nan") if t is None else float(np.abs(t - patterns[j]).max()))
            fractional.append(-1 if t is None else int((np.minimum(t, 1 - t) > MATCH_ATOL).sum()))
        exact = sum(e <= MATCH_ATOL for e in errors)
        row = {"known": known, "tried": len(errors), "exact": exact, "errors": errors,
               "fractional_entries": fractional, "seconds": time.perf_counter() - start}  # fmt: skip
        rows.append(row)
        print(f"known {known:4d}: {row['exact']}/{row['tried']} exact, fractional {fractional}", flush=True)
    name = "exact head vector -> pattern by one linear program (LT setting, ground truth)"
    payload = {"benchmark": name, "settings": run_settings(args), "machine": machine(),
               "geometry": geometry, "rows": rows}  # fmt: skip
    write_json(args.out, payload)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
