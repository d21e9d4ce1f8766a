"""Can dL/dW's pixel columns be split into the samples' columns of dL/dZ? (LT setting, MNIST b = 512)

The passive benchmark's MNIST b = 512 is not reached: the known-head pattern search finds ~56
exact columns of dL/dZ and runs out of guesses (README, "What is left"). An idealized cascade
(measured with the ground truth) said that splitting pixel columns mixing at most 4 unfound
samples, with every found sample explained away from every column, would reach all 512. This
probe runs such a splitter **from the server's view** (dL/dW and the known head W2 only; the
ground truth only scores what it finds) and measures how far it gets and what stops it.

Pixel column p of dL/dW is ``sum_j x_jp dL/dZ_j`` over the samples whose pixel p is nonzero,
and row i of it is ``B_i . a_T`` (``B = W2^T``; ``a_T`` the sum of ``x_jp g_j`` over the set T of
those samples active at neuron i). One round:
1. **single columns**: a column whose nonzero rows fit one ``a`` exactly is one sample's;
2. **head vectors**: between two columns, a run of equal ratios marks rows where one shared
   contributor alone is active; those rows give its ``a`` (exact fit), so ``h = B a``;
3. **certain rows**: in every column, the run of ``column / h`` gives a candidate's share;
   where a row equals a unique subset sum of its candidates' shares, each candidate is known
   active or inactive there (a zero row: all inactive);
4. **patterns**: a candidate with b + 10 certain rows has its column ``U c`` solved on them
   (``U c = h`` where active, 0 where not), kept when every row is 0 or ``h_i``; the head then
   pins it (``spear.core.proposers.masked_subspace.pin_columns``, the library's check);
5. **explain away** the found columns: the library's run-based ``explain_away``, then, per
   column, the found samples whose active rows avoid the column's zero rows (at most 14) are
   fitted exactly on the rows where no unfound sample is active (random minimal sets).

    python benchmarks/probe_column_split.py                 # MNIST b = 512, seeds 0-2
    python benchmarks/probe_column_split.py --seeds 1 --batch-size 256
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from common import machine, run_settings, write_json
from probe_known_columns import per_sample_columns
from spear.core.proposers.masked_subspace import RATIO_RTOL, _most_repeated, explain_away, pin_columns
from spear.data import load_dataset
from spear.fl import shallow_mlp, simulate_fedsgd

#: entries within this of a column's largest are zero (float64 gradients)
ZERO_RTOL = 1e-9
#: ratios equal within this are one run (float64 rounding ~1e-15 of the entries)
RUN_RTOL = 1e-9
#: pair runs are looked for among this many columns with the most zeros (fewest contributors)
PAIR_COLUMNS = 200
#: subset sums are enumerated for columns with at most this many candidates
MAX_CANDIDATES = 12
#: found samples fitted per column in step 5, at most, and random minimal sets tried
MAX_FOUND_FIT = 14
FIT_TRIALS = 3000
#: step 2b: columns (most zeros first) fitted one by one, random row sets per column, and the
#: exact rows a fit needs
FIT_COLUMNS = 40
FIT_TRIALS_HEAD = 5000
MIN_INLIERS = 30


class ColumnSplitter:
    """The cascade of the module doc on one server view (``grad``: dL/dW, ``head``: W2)."""

    def __init__(self, grad: torch.Tensor, head: torch.Tensor, b: int, seed: int) -> None:
        self.b = b
        self.B = head.T.contiguous()  # (m, k)
        self.columns = grad[:, grad.abs().amax(dim=0) > 0].T.contiguous()  # (n_live, m)
        self.U = torch.linalg.svd(grad, full_matrices=False)[0][:, :b]
        self.found = grad.new_zeros(0, grad.shape[0])  # unit columns of dL/dZ
        self.heads = grad.new_zeros(0, grad.shape[0])  # candidate head vectors h (unit)
        self.generator = torch.Generator().manual_seed(seed)

    def fits_one(self, column: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """``a`` with ``B a = column`` on ``rows`` exactly, or None."""
        a = torch.linalg.lstsq(self.B[rows], column[rows, None]).solution[:, 0]
        exact = (self.B[rows] @ a - column[rows]).abs().max() <= RUN_RTOL * column[rows].abs().max()
        return a if bool(exact) else None

    def residual(self) -> torch.Tensor:
        """The columns with the found samples explained away (step 5); zero columns dropped."""
        if not self.found.shape[0]:
            return self.columns
        rest = explain_away(self.columns, self.found, rtol=RATIO_RTOL, zero_rtol=ZERO_RTOL)
        rest = torch.stack([self._fit_found(c) for c in rest])
        rest = torch.where(rest.abs() <= ZERO_RTOL * self.columns.abs().amax(1, keepdim=True), 0.0, rest)
        return rest[rest.abs().amax(dim=1) > 0]

    def _fit_found(self, column: torch.Tensor) -> torch.Tensor:
        scale = float(column.abs().max())
        if scale == 0:
            return column
        zero = column.abs() <= ZERO_RTOL * scale
        active = self.found.abs() > ZERO_RTOL * self.found.abs().amax(1, keepdim=True)
        members = (~(active & zero).any(dim=1)).nonzero()[:, 0]
        if not 0 < members.numel() <= MAX_FOUND_FIT:
            return column
        A = self.found[members].T
        rows = ((A != 0).any(dim=1) & ~zero).nonzero()[:, 0]
        k = members.numel()
        if rows.numel() < k + 5:
            return column
        picks = rows[torch.rand(FIT_TRIALS, rows.numel(), generator=self.generator).argsort(1)[:, :k]]
        x, info = torch.linalg.solve_ex(A[picks], column[picks])
        x = x[info == 0]
        inliers = (A[rows] @ x.T - column[rows, None]).abs() <= RUN_RTOL * scale
        best = int(inliers.sum(0).argmax()) if x.shape[0] else 0
        if not x.shape[0] or int(inliers[:, best].sum()) < max(3 * k, 20):
            return column
        fit = rows[inliers[:, best]]
        return column - A @ torch.linalg.lstsq(A[fit], column[fit, None]).solution[:, 0]

    def singles(self, columns: torch.Tensor) -> torch.Tensor:
        """Patterns of the columns that are one sample's (step 1)."""
        nonzero = columns.abs() > ZERO_RTOL * columns.abs().amax(1, keepdim=True)
        keep = [i for i in range(columns.shape[0]) if self.fits_one(columns[i], nonzero[i]) is not None]
        return nonzero[keep]

    def add_heads(self, columns: torch.Tensor) -> None:
        """Head vectors from runs of equal ratios between pairs of columns (step 2)."""
        nonzero = columns.abs() > ZERO_RTOL * columns.abs().amax(1, keepdim=True)
        order = (~nonzero).sum(1).argsort(descending=True)[:PAIR_COLUMNS]
        part, mask = columns[order], nonzero[order]
        for i in range(part.shape[0]):
            both = mask[i][None, :] & mask
            ratio = torch.where(both, part[i][None, :] / torch.where(mask, part, 1.0), torch.nan)
            value = _most_repeated(ratio.sort(dim=1).values, RUN_RTOL)
            for k in value.nonzero()[:, 0].tolist():
                run = both[k] & ((ratio[k] - value[k]).abs() <= RUN_RTOL * value[k].abs())
                a = None if k == i else self.fits_one(part[i], run)
                if a is not None:
                    self._keep_head(self.B @ a)

    def add_fitted_heads(self, columns: torch.Tensor) -> None:
        """Head vectors from one column each: random sets of k - 1 rows fitted by one ``a`` in the
        sum-zero subspace (softmax minus one-hot sums to 0) that fits MIN_INLIERS rows exactly
        (step 2b; one class of a column mixing u samples holds ~1/(2^u - 1) of its rows)."""
        k = self.B.shape[1]
        sum_zero = torch.linalg.svd(torch.ones(1, k, dtype=self.B.dtype), full_matrices=True).Vh[1:].T
        BN = self.B @ sum_zero  # (m, k - 1)
        nonzero = columns.abs() > ZERO_RTOL * columns.abs().amax(1, keepdim=True)
        order = (~nonzero).sum(1).argsort(descending=True)[:FIT_COLUMNS]
        for q in order.tolist():
            c, rows = columns[q], nonzero[q].nonzero()[:, 0]
            if rows.numel() < 3 * k:
                continue
            noise = torch.rand(FIT_TRIALS_HEAD, rows.numel(), generator=self.generator)
            picks = rows[noise.argsort(1)[:, : k - 1]]
            y, info = torch.linalg.solve_ex(BN[picks], c[picks])
            y = y[info == 0]
            inliers = ((BN[rows] @ y.T - c[rows, None]).abs() <= RUN_RTOL * c.abs().max()).sum(0)
            for t in (inliers >= MIN_INLIERS).nonzero()[:, 0].tolist():
                self._keep_head(BN @ y[t])

    def _keep_head(self, h: torch.Tensor) -> None:
        h = h / h.norm()
        if not self.heads.shape[0] or float((self.heads @ h).abs().max()) < 1 - RUN_RTOL:
            self.heads = torch.cat([self.heads, h[None]])

    def shares(self, columns: torch.Tensor) -> torch.Tensor:
        """(n, heads) each head's share of each column: its run of column / h, or 0 (step 3)."""
        H = self.heads
        live = H.abs() > 1e-12 * H.abs().amax(1, keepdim=True)
        nonzero = columns.abs() > ZERO_RTOL * columns.abs().amax(1, keepdim=True)
        out = columns.new_zeros(columns.shape[0], H.shape[0])
        for start in range(0, columns.shape[0], 16):
            c, z = columns[start : start + 16], nonzero[start : start + 16]
            both = z[:, None, :] & live[None]
            ratio = torch.where(both, c[:, None, :] / torch.where(live, H, 1.0)[None], torch.nan)
            value = _most_repeated(ratio.reshape(-1, ratio.shape[2]).sort(dim=1).values, RUN_RTOL)
            out[start : start + 16] = value.reshape(c.shape[0], -1)
        return out

    def certain_rows(self, columns: torch.Tensor, shares: torch.Tensor):
        """(heads, m) rows each head is certainly active / inactive on, and conflicts (step 3)."""
        shape = (self.heads.shape[0], columns.shape[1])
        active, inactive, conflict = (torch.zeros(shape, dtype=torch.bool) for _ in range(3))
        for q in range(columns.shape[0]):
            members = shares[q].nonzero()[:, 0]
            if not 0 < members.numel() <= MAX_CANDIDATES:
                continue
            combos = list(itertools.product([0, 1], repeat=members.numel()))
            subsets = torch.tensor(combos, dtype=columns.dtype)
            sums = subsets @ (shares[q, members, None] * self.heads[members])
            match = (sums - columns[q]).abs() <= RUN_RTOL * columns[q].abs().max()
            unique = match.sum(0) == 1
            label = subsets[match.to(torch.int8).argmax(0)].bool()  # (m, members)
            for t, h in enumerate(members.tolist()):
                on, off = unique & label[:, t], unique & ~label[:, t]
                conflict[h] |= (on & inactive[h]) | (off & active[h])
                active[h] |= on
                inactive[h] |= off
        return active, inactive, conflict

    def pattern(self, h: torch.Tensor, active: torch.Tensor, inactive: torch.Tensor) -> torch.Tensor | None:
        """The pattern of the column ``U c`` equal to ``h`` on ``active``, 0 on ``inactive`` (step 4)."""
        rows = active | inactive
        if int(rows.sum()) < self.b + 10:
            return None
        target = torch.where(active, h, 0.0)[rows, None]
        column = self.U @ torch.linalg.lstsq(self.U[rows], target).solution[:, 0]
        tol = 1e-7 * h.abs().max()
        on, off = (column - h).abs() <= tol, column.abs() <= tol
        return on if bool((on | off).all()) else None

    def round(self) -> tuple[int, dict]:
        """One round; returns the columns it found and counts of its steps."""
        columns = self.residual()
        patterns = [self.singles(columns)]
        self.add_heads(columns)
        self.add_fitted_heads(columns)
        shares = self.shares(columns)
        active, inactive, conflict = self.certain_rows(columns, shares)
        for t in range(self.heads.shape[0]):
            on = None if conflict[t].any() else self.pattern(self.heads[t], active[t], inactive[t])
            if on is not None:
                patterns.append(on[None])
        pinned, ok = pin_columns(self.U, self.B, torch.cat(patterns), ZERO_RTOL)
        before = self.found.shape[0]
        for column in pinned[ok]:
            column = column / column.abs().max()
            unit = self.found / self.found.norm(dim=1, keepdim=True)
            if not self.found.shape[0] or float((unit @ column).abs().max() / column.norm()) < 1 - 1e-9:
                self.found = torch.cat([self.found, column[None]])
        counts = {"columns": columns.shape[0], "singles": patterns[0].shape[0], "heads": self.heads.shape[0]}
        return self.found.shape[0] - before, counts


def score(found: torch.Tensor, truth: torch.Tensor) -> tuple[int, int, set[int]]:
    """(right, wrong, the samples found): found unit columns that are / are not a true column
    (m, b) to 1e-6."""
    unit = truth / truth.abs().amax(0, keepdim=True)
    samples: set[int] = set()
    for column in found:
        error = torch.minimum((unit - column[:, None]).abs().amax(0), (unit + column[:, None]).abs().amax(0))
        if float(error.min()) <= 1e-6:
            samples.add(int(error.argmin()))
    right = len(samples)
    return right, found.shape[0] - right, samples


def left_in_columns(splitter: ColumnSplitter, truth: torch.Tensor, right: set[int]) -> dict:
    """Per residual column, how many unfound and found samples it still mixes (ground truth)."""
    rest = splitter.residual()
    coefficients = torch.linalg.lstsq(truth, rest.T).solution  # (b, n)
    inside = coefficients.abs() > 1e-9 * coefficients.abs().amax(0, keepdim=True)
    found = torch.tensor([j in right for j in range(truth.shape[1])])
    unfound_count, found_count = (inside & ~found[:, None]).sum(0), (inside & found[:, None]).sum(0)
    few = unfound_count <= 4
    return {
        "columns": rest.shape[0],
        "with_at_most_4_unfound": int(few.sum()),
        "of_those_still_holding_found": int((few & (found_count > 0)).sum()),
    }


def probe(dataset, b: int, seed: int, rounds: int) -> dict:
    model = shallow_mlp(dataset.features, seed=seed)
    view, truth = simulate_fedsgd(model, dataset, b, seed=seed, normalize=False)
    grad = view.gradients["0.weight"].double()
    splitter = ColumnSplitter(grad, view.model[2].weight.detach().double(), b, seed)
    start, history = time.perf_counter(), []
    for _ in range(rounds):
        new, counts = splitter.round()
        history.append({**counts, "new": new, "found": splitter.found.shape[0]})
        print(f"  seed {seed}: {history[-1]}  {time.perf_counter() - start:.0f} s", flush=True)
        if not new:
            break
    columns = per_sample_columns(model, truth.inputs.double(), truth.labels)
    right, wrong, ids = score(splitter.found, columns)
    return {
        "seed": seed,
        "found": splitter.found.shape[0],
        "right": right,
        "wrong": wrong,
        "seconds": time.perf_counter() - start,
        "rounds": history,
        "left": left_in_columns(splitter, columns, ids),
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    default_out = Path(__file__).parent / "results" / "probe_column_split.json"
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args()
    dataset = load_dataset(args.dataset)
    rows = []
    for seed in range(args.seeds):
        rows.append(probe(dataset, args.batch_size, seed, args.rounds))
        print(f"seed {seed}: {rows[-1]['right']} right, {rows[-1]['wrong']} wrong, left {rows[-1]['left']}")
        payload = {"benchmark": "pixel-column splitter (LT setting, server's view; ground truth scores)",
                   "settings": run_settings(args), "machine": machine(), "rows": rows}  # fmt: skip
        write_json(args.out, payload)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
