"""Peeling: each found direction gives its sample exactly, and the rest is a smaller SPEAR problem.

SPEAR needs all b directions before Theorem 3.6 and ``X^T = Q^-1 R`` give any input: one column
of Q says nothing about one row of Q^-1. The next linear layer removes that limit. Its weight
gradient is ``dL/dW' = (dL/dZ') A^T`` with ``A = ReLU(Z)``, so its row space is spanned by the
activation vectors ``a_j`` of the attacked layer (when its rank is b). For a found direction
``q_j`` with exact zero set ``S_j`` (the neurons sample j leaves inactive):

1. ``a_j`` vanishes on ``S_j`` and lies in the row space P of dL/dW': it spans the kernel of
   ``P[S_j]`` (Theorem 3.3's argument, applied to A instead of dL/dZ). That kernel must be
   one-dimensional and *robust* (no essential row, as in :func:`spear.core.filtering.
   kernel_of_rows`): a mixture of samples that share most of their pattern vanishes on the
   common rows plus coincidental ones, and each coincidental row is essential.
2. On the active rows ``a_j = z_j = W x_j + bias``, and ``x_j = R^T r_j`` lies in the row space
   of dL/dW = L R. So ``W_A R^T r_j - s a_A = -bias_A`` in the unknowns (r_j, s): about m/2
   equations for b + 1 unknowns. One more pins the scale even when the bias is zero: with
   ``c = L^+ dL/db = sum_k u_k`` (Theorem 3.6) and step 3's ``u_k . r_j = delta_jk``, every
   sample has ``r_j . c = 1``. A true direction makes this system consistent to rounding
   error, and its solution has ``z_j <= 0`` on S_j and ``z_j >= 0`` elsewhere; a mixture of
   columns or any other wrong direction does not. Each sample is thereby certified on its own.
3. ``L R = sum_j (L u_j)(R^T r_j)^T`` gives ``sum_j u_j r_j^T = I``, so ``u_j . r_k = delta_jk``:
   ``u_j = q_j / (q_j . r_j)`` and ``dL/dZ_j = L u_j``, the scale of Theorem 3.6 without the
   other columns.
4. The remaining directions satisfy ``q . r_j = 0`` for every peeled j. With B an orthonormal
   basis of that complement, ``dL/dW - sum_peeled dZ_j x_j^T = (L B)(B^T (I - U_F r_F^T) R)``
   and ``dL/db - sum_peeled dZ_j`` are the gradients of the unrecovered samples alone: a SPEAR
   problem with batch size b - f (:func:`residual_problem`), on which random sampling becomes
   feasible again once few samples are left (Lemma 5.2 at b - f).
5. When the next layer's weight W' is known too, the next layer's output gradient of a peeled
   sample follows as well: ``dL/dZ'_j`` lies in the column space of dL/dW' and
   ``(W'^T dL/dZ'_j)_i = (dL/dZ_j)_i`` on the rows where sample j is active (about m/2
   equations for b unknowns). Subtracting ``dL/dZ'_j a_j^T`` from dL/dW' leaves the next
   layer's gradient of the unrecovered samples, whose exact zeros are intersections over fewer
   samples: the next-layer proposer finds more directions in the residual problem.

Only server-side quantities are used: W, bias, dL/dW, dL/db and the next layer's dL/dW'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from spear.core.deadline import NEVER, Deadline
from spear.core.filtering import kernel_chunk, kernel_of_rows
from spear.core.linalg import lstsq, masked_kernels, unit_rows
from spear.core.lowrank import leading_svd, numerical_rank
from spear.core.proposers.base import orthogonal_complement
from spear.core.scale import LayerProblem

#: how many numbers one batched kernel step may hold (directions x rows x b)
PEEL_CHUNK_ELEMENTS = 2**24
#: the retry of a failed direction takes as zero only entries below this times ``zero_rtol``
#: (relative to the column's largest): 1e-11 for float64 gradients, 1e-6 for float32 ones
BAND_FRACTION = 1e-2
#: at most this many directions per batched step, so that a deadline is checked often
PEEL_CHUNK_DIRECTIONS = 32
#: active rows needed beyond the b + 1 unknowns for the system of step 2 to certify anything
SPARE_EQUATIONS = 8
#: entries of the residual next-layer gradient below this times its row's original maximum are
#: rounding errors of exact zeros (step 5). The same for float32 gradients: scaled with their
#: zero_rtol (1e-6) it also erased small true entries of trained networks and broke the zero
#: sets the next-layer proposer works on (MNIST, 6 x 500, 200 steps, b = 64: 64 -> 24 certified)
NEXT_ZERO_RTOL = 1e-11


def peel_chunks(indices: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """``indices`` in chunks of at most ``PEEL_CHUNK_DIRECTIONS``, each bounded in memory and in
    work like snapping's kernel steps (:func:`spear.core.filtering.kernel_chunk`: every direction
    costs an SVD or least-squares solve of a ``rows x cols`` system), so that the deadline is
    checked often: at m = 1000, b = 320 a chunk of 32 directions took seconds idle and, on an
    oversubscribed machine, tens of seconds past a time budget. Sizes follow from the shapes
    alone, so every run takes the same steps."""
    if indices.numel() == 0:
        return ()
    size = min(PEEL_CHUNK_DIRECTIONS, kernel_chunk(max(1, rows), max(1, cols), PEEL_CHUNK_ELEMENTS))
    return indices.split(size)


@dataclass
class PeeledSamples:
    """Individually recovered samples (step 1-3 above), in the order they were peeled.

    Attributes:
        directions: (f, b) unit directions q_j (columns of Q up to scale).
        coefficients: (f, b) r_j with x_j = R^T r_j.
        inputs: (f, n) the samples x_j.
        duals: (f, b) u_j = q_j / (q_j . r_j), so that dL/dZ_j = L u_j.
        next_grad_outputs: (f, k) the next layer's dL/dZ'_j (step 5), or None when the next
            layer's weight is unknown; a row of zeros where it was not determined.
        labels: (f,) labels found by a model-level certificate, -1 where none was run.
        weights: (f,) loss weights found with them (1/B for a batch mean), NaN where none.
        strong: (f,) whether that certificate was discriminative and one sample's (see
            :class:`spear.core.certificate.SampleCertificates`).
    """

    directions: torch.Tensor
    coefficients: torch.Tensor
    inputs: torch.Tensor
    duals: torch.Tensor
    next_grad_outputs: torch.Tensor | None = None
    labels: torch.Tensor = None  # type: ignore[assignment]  # filled in __post_init__
    weights: torch.Tensor = None  # type: ignore[assignment]
    strong: torch.Tensor = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        f, device = self.directions.shape[0], self.directions.device
        if self.labels is None:
            self.labels = torch.full((f,), -1, dtype=torch.long, device=device)
        if self.weights is None:
            self.weights = torch.full((f,), float("nan"), dtype=self.directions.dtype, device=device)
        if self.strong is None:
            self.strong = torch.zeros(f, dtype=torch.bool, device=device)

    @classmethod
    def empty(
        cls, b: int, n: int, dtype: torch.dtype, device: torch.device | str, next_width: int | None = None
    ) -> PeeledSamples:
        def zeros(k: int) -> torch.Tensor:
            return torch.empty(0, k, dtype=dtype, device=device)

        return cls(zeros(b), zeros(b), zeros(n), zeros(b), None if next_width is None else zeros(next_width))

    def __len__(self) -> int:
        return int(self.directions.shape[0])

    def extend(self, other: PeeledSamples) -> None:
        self.directions = torch.cat([self.directions, other.directions])
        self.coefficients = torch.cat([self.coefficients, other.coefficients])
        self.inputs = torch.cat([self.inputs, other.inputs])
        self.duals = torch.cat([self.duals, other.duals])
        self.labels = torch.cat([self.labels, other.labels])
        self.weights = torch.cat([self.weights, other.weights])
        self.strong = torch.cat([self.strong, other.strong])
        if self.next_grad_outputs is not None and other.next_grad_outputs is not None:
            self.next_grad_outputs = torch.cat([self.next_grad_outputs, other.next_grad_outputs])
        elif len(other):
            # samples without step 5 (the singleton cascade's): the list keeps none, so the
            # residual next-layer gradient keeps every sample's terms (its zeros stay exact)
            # instead of pairing step-5 rows with the wrong samples
            self.next_grad_outputs = None

    def select(self, keep: torch.Tensor) -> PeeledSamples:
        nxt = None if self.next_grad_outputs is None else self.next_grad_outputs[keep]
        return PeeledSamples(
            self.directions[keep],
            self.coefficients[keep],
            self.inputs[keep],
            self.duals[keep],
            nxt,
            self.labels[keep],
            self.weights[keep],
            self.strong[keep],
        )


@dataclass
class PeelChecks:
    """A peeler's per-direction results, filled chunk by chunk: consistent (k,), robust (k,),
    the coefficients r (k, b) and refuted (k,); directions never checked (past a deadline, or
    too few rows for the checks) stay False."""

    consistent: torch.Tensor
    robust: torch.Tensor
    coefficients: torch.Tensor
    refuted: torch.Tensor
    #: (k,) the checks ran to their end (a deadline cut none of them, the retry included)
    checked: torch.Tensor

    @classmethod
    def empty(cls, k: int, b: int, like: torch.Tensor) -> PeelChecks:
        flags = torch.zeros(k, dtype=torch.bool, device=like.device)
        r = torch.zeros(k, b, dtype=like.dtype, device=like.device)
        return cls(flags, flags.clone(), r, flags.clone(), flags.clone())

    def record(
        self,
        index: torch.Tensor,
        ok: torch.Tensor,
        firm: torch.Tensor,
        r: torch.Tensor,
        refuted: torch.Tensor,
    ) -> None:
        self.consistent[index], self.robust[index], self.coefficients[index] = ok, firm, r
        self.refuted[index] = refuted
        self.checked[index] = True


class FailedDirections:
    """The directions whose peeling checks failed, by zero mask and retry rows, so that a
    repeat is not checked again.

    Step 1 depends on the zero mask alone, step 2 on the mask and the direction up to sign
    and scale, and the retry on the clearly zero rows (``SamplePeeler.retry_rows``), all on
    the layer, which is fixed for a peeler. So a direction that failed them fails them again.
    The search meets the same columns step after step (the next-layer proposer cycles through
    its zero sets, and the residual problems hand back what the root problem found): at
    m = 500, b = 64 (MNIST, float32, trained 1000 steps) 8,501 of 10,747 peeled directions were
    repeats, 13 of the 17 s spent peeling. A repeat must have the same mask, the same retry
    rows (two directions 1e-5 apart can differ there: the retry takes rows below 1e-6 of a
    float32 column's largest entry) and a parallel direction (the same zero set can hold
    several directions where patterns coincide). Checks a deadline cut short, the retry's
    included, are not recorded.
    """

    #: largest ``1 - |cos|`` between a direction and its recorded failure that counts as a repeat
    PARALLEL_TOL = 1e-9

    def __init__(self) -> None:
        self._seen: dict[bytes, tuple[torch.Tensor, bool]] = {}

    def __len__(self) -> int:
        return len(self._seen)

    @staticmethod
    def _keys(masks: torch.Tensor, rows: torch.Tensor) -> list[bytes]:
        both = torch.cat([masks, rows], dim=1).detach().cpu().numpy().astype(bool)
        return [row.tobytes() for row in np.packbits(both, axis=1)]

    def lookup(
        self, directions: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(k,) which directions (k, b), with zero masks and retry rows (k, m), repeat a
        recorded failure, and which of those were refuted."""
        k = directions.shape[0]
        known = torch.zeros(k, dtype=torch.bool, device=directions.device)
        refuted = torch.zeros_like(known)
        if not self._seen or not k:
            return known, refuted
        unit = _unit_rows(directions)
        for i, key in enumerate(self._keys(masks, rows)):
            entry = self._seen.get(key)
            if entry is not None and 1.0 - abs(float(entry[0] @ unit[i])) <= self.PARALLEL_TOL:
                known[i], refuted[i] = True, entry[1]
        return known, refuted

    def add(
        self, directions: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor, refuted: torch.Tensor
    ) -> None:
        """Record failed directions (k, b) with their masks and retry rows (k, m) and refuted
        flags (k,)."""
        if not directions.shape[0]:
            return
        unit = _unit_rows(directions)
        for i, key in enumerate(self._keys(masks, rows)):
            self._seen[key] = (unit[i].clone(), bool(refuted[i]))


def _unit_rows(directions: torch.Tensor) -> torch.Tensor:
    return unit_rows(directions.detach().to(torch.float64).cpu())


@dataclass
class PeelOutcome:
    """What peeling made of k directions.

    Attributes:
        consistent: (k,) bool, steps 1-3 hold (the sample reproduces its activation, ReLU pattern
            and scale).
        robust: (k,) bool, consistent and its activation's zero set has no essential row: the
            two layers alone certify the sample.
        samples: the samples of the consistent directions, in order.
        refuted: (k,) bool, directions that are no sample's: their activation's zero set pins
            one direction at most and the checks fail (a sample whose pattern another shares
            leaves two, and is merely not certified here), or None when the peeler does not
            tell.
        snapped: (f,) bool over ``samples``: replaced by the kernel of their own zeros
            (:meth:`spear.core.input_peeling.InputSidePeeler._snapped`), or None when none was.
        as_read: the same directions completed as read (consistent for the same ones), for a
            caller to fall back on where a snapped sample is not certified; None with ``snapped``.
    """

    consistent: torch.Tensor
    robust: torch.Tensor
    samples: PeeledSamples
    refuted: torch.Tensor | None = None
    snapped: torch.Tensor | None = None
    as_read: PeelOutcome | None = None


class SamplePeeler:
    """Recovers single samples from single directions of one layer (steps 1-3 and 5 of the
    module doc).

    Args:
        problem: the attacked layer, in output-sparsity mode, with ``next_grad_weight`` (and
            optionally ``next_weight`` for step 5).
        rtol: relative residual of step 2's system (and ReLU-pattern slack) up to which a sample
            is certified; the verification tolerance of the gradient's dtype is the right scale.
        rank_rtol: relative singular value below which the next layer's gradient has no rank;
            None: the rule of the batch size's own estimate for a gradient computed in
            ``source_dtype`` (:func:`spear.core.lowrank.numerical_rank`; in float32 the last
            10-fold drop: the smallest sample's singular value can lie below numpy's rule).
        zero_rtol: the threshold the zero masks were made with; given, a direction that fails
            is tried once more on its clearly zero rows (``_retry_without_band``).
    """

    #: robust samples are certified by the two layers alone
    needs_model = False

    def __init__(
        self,
        problem: LayerProblem,
        rtol: float,
        rank_rtol: float | None = None,
        source_dtype: torch.dtype = torch.float64,
        zero_rtol: float | None = None,
    ) -> None:
        if problem.next_grad_weight is None:
            raise ValueError("peeling needs the next layer's weight gradient")
        self.problem = problem
        self.rtol = rtol
        self.zero_rtol = zero_rtol
        self.WRt = problem.R_Wt.T  # (m, b): W R^T
        G = problem.next_grad_weight.to(problem.L.dtype)
        U, S, Vh = leading_svd(G, problem.batch_size)  # rank(dL/dW') <= b
        rank = 0
        if S.numel() and float(S[0]) > 0:
            rank = numerical_rank(S, (G.shape[0], G.shape[1]), source_dtype, rank_rtol)
        #: (m, rank) orthonormal basis of the row space of dL/dW': the span of the a_j
        self.P = Vh[:rank].T.contiguous()
        #: step 5: dL/dZ'_j = U2 w_j, and W'^T U2 maps w_j to the attacked layer's rows
        self.U2 = U[:, :rank]
        self.back = None if problem.next_weight is None else problem.next_weight.to(G.dtype).T @ self.U2
        #: step 2's scale equation c . r = 1, weighted like an average row of W R^T
        self.c = problem.pinv_grad_bias
        #: directions whose checks failed, not checked again when the search meets them again
        self.failed = FailedDirections()
        rows = max(1, self.WRt.shape[0])
        self.scale_weight = float(self.WRt.norm() / (rows**0.5 * self.c.norm().clamp_min(1e-300)))

    @property
    def usable(self) -> bool:
        """Whether the next layer's gradient can certify samples at all (rank b)."""
        return self.P.shape[1] == self.problem.batch_size

    def _certify(
        self, directions: torch.Tensor, masks: torch.Tensor, kernel_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1-2 for k directions (k, b) with zero masks (k, m): whether each is consistent,
        whether its activation kernel is also robust, its coefficients r (k, b), and whether it
        is refuted (see :class:`PeelOutcome`).

        ``kernel_rows`` (default ``masks``), a subset of each mask, are the rows taken as the
        sample's inactive neurons (step 1 and the ReLU check); the rows outside ``masks`` are
        its active ones (step 2). Rows in the mask but not in ``kernel_rows`` are in neither."""
        L, P = self.problem.L, self.P
        k, b = directions.shape[0], L.shape[1]
        zero = (masks if kernel_rows is None else kernel_rows).to(L.dtype)
        active = 1.0 - masks.to(L.dtype)
        # step 1: the kernel of P[S] (rows outside S zeroed: the right singular vectors stay);
        # a kernel of two or more dimensions fails it whatever step 2 says, so step 2 runs
        # only where step 1 holds
        solved = masked_kernels(P, zero, degenerate_below=self.rtol)
        S = solved.singular_values
        ok = torch.zeros(k, dtype=torch.bool, device=L.device)
        r = L.new_zeros(k, b)
        run = solved.one_dimensional(self.rtol).nonzero()[:, 0]
        if run.numel():
            ok[run], r[run] = self._step2(directions[run], solved.kernel[run], zero[run], active[run])
        refuted = ~ok & ~solved.degenerate & (S[:, -2] > self.rtol * S[:, 0])
        return ok, ok & solved.robust, r, refuted

    def _step2(
        self, directions: torch.Tensor, kernel: torch.Tensor, zero: torch.Tensor, active: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2 for directions (k, b) whose activation kernel (k, r) step 1 pinned, with their
        inactive (``zero``) and active rows (k, m, as 0/1): whether the sample reproduces its
        activation, scale and ReLU pattern, and its coefficients r (k, b)."""
        L, bias, P = self.problem.L, self.problem.bias, self.P
        k, b = directions.shape[0], L.shape[1]
        a = kernel @ P.T  # (k, m): the activation vector's direction
        # [W R^T, -a] (r, s) = -bias on the active rows (inactive rows zeroed out), and the
        # scale row c . r = 1, weighted like an average row of W R^T
        system = torch.cat([self.WRt.expand(k, -1, -1), -a.unsqueeze(-1)], dim=2) * active.unsqueeze(-1)
        scale_row = torch.cat([self.c, self.c.new_zeros(1)]) * self.scale_weight
        system = torch.cat([system, scale_row.expand(k, 1, -1)], dim=1)
        rhs = torch.cat([-bias.unsqueeze(0) * active, self.c.new_full((k, 1), self.scale_weight)], dim=1)
        solution = lstsq(system, rhs.unsqueeze(-1))[:, :, 0]
        r, s = solution[:, :b], solution[:, b]
        z = r @ self.WRt.T + bias  # (k, m) pre-activations of the recovered samples
        activation = s.unsqueeze(-1) * a
        size = (activation * active).norm(dim=1).clamp_min(torch.finfo(L.dtype).tiny)
        residual = ((z - activation) * active).norm(dim=1) / size
        scale_error = (r @ self.c - 1.0).abs() / (r.norm(dim=1) * self.c.norm()).clamp_min(1.0)
        # the ReLU pattern: z <= 0 where the column vanishes, z >= 0 where it does not
        slack = self.rtol * z.abs().amax(dim=1)
        relu_ok = ((z * zero).amax(dim=1) <= slack) & ((z * active).amin(dim=1) >= -slack)
        dot = (directions * r).sum(dim=1)
        ok = (residual <= self.rtol) & (scale_error <= self.rtol) & relu_ok
        ok &= torch.isfinite(residual) & (dot.abs() > self.rtol * r.norm(dim=1))  # u_j must exist
        return ok, r

    def retry_rows(self, directions: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """(k, m) the rows of each mask that :meth:`_retry_without_band` takes as inactive: at
        most ``BAND_FRACTION * zero_rtol`` of the column's largest entry (the masks themselves
        when there is no retry)."""
        if self.zero_rtol is None:
            return masks
        values = (directions.to(self.problem.L.dtype) @ self.problem.L.T).abs()
        return masks & (values <= BAND_FRACTION * self.zero_rtol * values.amax(dim=1, keepdim=True))

    def _retry_without_band(
        self,
        directions: torch.Tensor,
        masks: torch.Tensor,
        clear: torch.Tensor,
        eligible: torch.Tensor,
        checks: PeelChecks,
        deadline: Deadline,
    ) -> None:
        """Step 1 again for the directions that failed, on their clearly zero rows only
        (``clear``, :meth:`retry_rows` of every direction).

        A column's zero mask (entries up to ``zero_rtol`` of its largest) can hold active
        neurons whose gradient is merely small: trained networks and float32 gradients have
        entries of 1e-5 of a column's maximum that are not zero. Such a row breaks the
        activation's kernel. The retry takes as inactive only the rows at most
        ``BAND_FRACTION * zero_rtol`` of the maximum and leaves the band between out of both
        steps; every check still applies to the rows that remain.

        The direction is replaced by the kernel of L on those rows, in ``directions`` (in
        place): one snapped on a zero set that held active rows carries a trace of another
        sample's column. It would still peel to its own right sample, but the batch assembled
        from it would get that other sample wrong."""
        if self.zero_rtol is None:
            return
        L = self.problem.L
        b, m = L.shape[1], L.shape[0]
        failed = eligible[~checks.consistent[eligible]]
        if not failed.numel():
            return
        q = directions[failed].to(L.dtype)
        tight = clear[failed]
        # without band rows the retry would solve and check the same rows again
        retry = (tight.sum(dim=1) >= b) & (tight != masks[failed]).any(dim=1)
        # refuted only once the retry has failed too (not when the deadline cut it off)
        first = checks.refuted.clone()
        checks.refuted[failed[retry]] = False
        checks.checked[failed[retry]] = False  # until the retry has run
        for part in peel_chunks(retry.nonzero()[:, 0], 2 * m, b + 1):  # two kernel solves a direction
            if deadline.passed():
                break
            rows = failed[part]
            kernel, one_dim, _ = kernel_of_rows(L, tight[part])
            kernel = kernel * torch.sign((kernel * q[part]).sum(dim=1, keepdim=True))
            ok, firm, r, _ = self._certify(kernel, masks[rows], tight[part])
            ok &= one_dim
            checks.record(rows, ok, firm & ok, r, first[rows] & ~ok)
            directions[rows[ok]] = kernel[ok].to(directions.dtype)

    def peel(self, directions: torch.Tensor, masks: torch.Tensor, deadline: Deadline = NEVER) -> PeelOutcome:
        """Check and recover the samples of k exact directions (k, b) with zero masks (k, m);
        past ``deadline`` the remaining directions are left unchecked (not consistent).

        A direction is *consistent* when steps 1-3 hold for it, and *robust* when, moreover,
        its activation's zero set pins the activation (no essential row): robust samples are
        certified by the two layers alone; consistent ones need another certificate (the
        model's, :mod:`spear.certify`) before they count."""
        L, R = self.problem.L, self.problem.R
        k, b = directions.shape
        m = L.shape[0]
        checks = PeelChecks.empty(k, b, L)
        if k and self.usable:
            zeros = masks.sum(dim=1)
            # enough equations in step 2, and enough zero rows for a one-dimensional kernel
            eligible = (m - zeros >= b + 1 + SPARE_EQUATIONS) & (zeros >= b)
            rows = self.retry_rows(directions, masks)
            known, refuted = self.failed.lookup(directions, masks, rows)
            checks.refuted |= known & refuted
            eligible = (eligible & ~known).nonzero()[:, 0]
            for part in peel_chunks(eligible, m, b + 1):
                if deadline.passed():
                    break
                checks.record(part, *self._certify(directions[part].to(L.dtype), masks[part]))
            original = directions
            directions = directions.clone()  # the retry may replace some by exact kernels
            self._retry_without_band(directions, masks, rows, eligible, checks, deadline)
            failed = eligible[checks.checked[eligible] & ~checks.consistent[eligible]]
            self.failed.add(original[failed], masks[failed], rows[failed], checks.refuted[failed])
        consistent = checks.consistent
        q, r = directions[consistent].to(L.dtype), checks.coefficients[consistent]
        duals = q / (q * r).sum(dim=1, keepdim=True)
        nxt = None if self.back is None else self._next_grad_outputs(duals, ~masks[consistent])
        samples = PeeledSamples(
            directions=q, coefficients=r, inputs=r @ R, duals=duals, next_grad_outputs=nxt
        )
        return PeelOutcome(consistent, checks.robust, samples, checks.refuted)

    def _next_grad_outputs(self, duals: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Step 5: dL/dZ'_j (f, k) of certified samples from ``(W'^T U2 w)_A = (dL/dZ_j)_A`` on
        their active rows A; a zero row where that system is not consistent (e.g. another
        module stands between the two layers)."""
        assert self.back is not None
        L = self.problem.L
        f, m, r = duals.shape[0], L.shape[0], self.back.shape[1]
        out = torch.zeros(f, self.U2.shape[0], dtype=L.dtype, device=L.device)
        if f == 0 or r == 0:
            return out
        for part in peel_chunks(torch.arange(f, device=L.device), m, r):
            act = active[part].to(L.dtype)
            grad = (duals[part] @ L.T) * act  # dL/dZ_j on the active rows, (p, m)
            system = self.back.unsqueeze(0) * act.unsqueeze(-1)
            w = lstsq(system, grad.unsqueeze(-1))[:, :, 0]  # (p, r)
            misfit = (system @ w.unsqueeze(-1))[:, :, 0] - grad
            ok = misfit.norm(dim=1) <= self.rtol * grad.norm(dim=1)
            out[part] = torch.where(ok.unsqueeze(-1), w @ self.U2.T, torch.zeros_like(out[part]))
        return out


#: :func:`mutually_consistent` allows two samples' ``u_j . r_k`` this many times the rounding
#: their data explain, beyond ``rtol``. Measured on float32 CNN heads trained 200 steps (MNIST
#: and Fashion-MNIST, b = 64, seeds 0-2; 1,300 pairs of exact samples): at most 21 times
#: (the map is a first-order estimate), where duplicates of a sample read about 1
CLASH_SLACK = 30.0
#: the relative rounding of each sample's column ``L u_j`` and of its input ``r_j R``, (f + n,)
#: each, for the samples :func:`mutually_consistent` compares (peeled, then new)
Precisions = tuple[torch.Tensor, torch.Tensor]


def _clashes(
    peeled: PeeledSamples, new: PeeledSamples, rtol: float, precision: Precisions | None = None
) -> torch.Tensor:
    """(f + n, f + n) whether two samples (the peeled ones, then ``new``) break step 3's
    ``u_j . r_k = 0`` beyond ``rtol`` either way (``|u_j . r_k| / (|u_j| |r_k|)``, a rounding
    error for two distinct true samples; a duplicate of a sample gives about 1), plus
    ``CLASH_SLACK`` times the rounding of u_j's column and r_k's input where ``precision``
    gives it."""
    tiny = torch.finfo(new.duals.dtype).tiny
    u_all = torch.cat([peeled.duals, new.duals])
    u_all = u_all / u_all.norm(dim=1, keepdim=True).clamp_min(tiny)
    r_all = torch.cat([peeled.coefficients, new.coefficients])
    r_all = r_all / r_all.norm(dim=1, keepdim=True).clamp_min(tiny)
    tolerance = torch.full((u_all.shape[0], u_all.shape[0]), rtol, dtype=u_all.dtype, device=u_all.device)
    if precision is not None:
        column, row = (p.to(tolerance) for p in precision)
        tolerance = tolerance + CLASH_SLACK * (column[:, None] + row[None, :])
    clash = ~((u_all @ r_all.T).abs() <= tolerance)  # NaN clashes
    return clash | clash.T


def mutually_consistent(
    peeled: PeeledSamples, new: PeeledSamples, rtol: float, precision: Precisions | None = None
) -> torch.Tensor:
    """Which of ``new`` keep ``u_j . r_k = 0`` for j != k (step 3) with every sample in
    ``peeled`` and with the ones of ``new`` accepted before them, to ``rtol`` plus what the
    rounding of their data explains (``precision``, see :data:`CLASH_SLACK`). True samples
    always do, so a violation means one of the two certificates is wrong; the later one is
    kept out (the earlier one already shaped the residual problem, and for it to be wrong both
    layers, or the model, must have been fooled)."""
    f = len(peeled)
    clash = _clashes(peeled, new, rtol, precision)
    keep = torch.zeros(len(new), dtype=torch.bool, device=new.directions.device)
    accepted = list(range(f))
    for i in range(len(new)):
        if not accepted or not bool(clash[f + i, accepted].any()):
            keep[i] = True
            accepted.append(f + i)
    return keep


def certified_in_order(
    peeled: PeeledSamples,
    new: PeeledSamples,
    candidate: torch.Tensor,
    certify: Callable[[torch.Tensor], torch.Tensor],
    rtol: float,
) -> torch.Tensor:
    """``candidate & certified`` among ``new``, then :func:`mutually_consistent` of those, with
    a certificate asked for (``certify(indices) -> ok``) only where its answer can matter.

    A float32 step snaps many directions of one sample (256 samples peeled from 22 distinct
    ones: a wide first layer, m = 4000, b = 64, where each model certificate through the tail
    costs 0.07 s). A sample that clashes with one already kept is out whatever its
    certificate says, and one that clashes with an earlier undecided one waits for it: the
    first ask holds every sample that clashes with no earlier one (one per distinct sample),
    and a later ask only the copies of samples whose certificate failed. Decisions are taken
    in order, so where each certificate depends only on its own sample, the samples kept are
    the eager rule's. The model certificate's weight quorum (``_Attack._single``) depends on
    the samples asked together: the first ask gives it one copy of each distinct sample, where
    certifying every copy let one sample's copies outvote the others (a copy asked later,
    after its sample failed, still votes again)."""
    f, device = len(peeled), candidate.device
    clash = _clashes(peeled, new, rtol).to(device)
    pending = candidate & ~clash[f:, :f].any(dim=1)  # a clash with a peeled sample: out
    clash = clash[f:, f:]
    known, ok = torch.zeros_like(pending), torch.zeros_like(pending)
    keep = torch.zeros_like(pending)
    order = pending.nonzero()[:, 0].tolist()
    at = 0
    while True:
        at = _decide_in_order(order, at, pending, known, ok, keep, clash)
        if at == len(order):
            return keep
        ask = _worth_asking(
            torch.tensor(order[at:], dtype=torch.long, device=device), pending, known, ok, keep, clash
        )
        ok[ask] = certify(ask).to(device=device, dtype=torch.bool)
        known[ask] = True


def _decide_in_order(
    order: list[int],
    at: int,
    pending: torch.Tensor,
    known: torch.Tensor,
    ok: torch.Tensor,
    keep: torch.Tensor,
    clash: torch.Tensor,
) -> int:
    """:func:`certified_in_order`'s decisions from position ``at`` of ``order`` up to the
    first sample whose certificate is not known yet; returns that position."""
    while at < len(order):
        i = order[at]
        if pending[i] and bool((clash[i] & keep).any()):
            pending[i] = False
        if pending[i]:
            if not bool(known[i]):
                return at
            keep[i], pending[i] = ok[i], False
        at += 1
    return at


def _worth_asking(
    rest: torch.Tensor,
    pending: torch.Tensor,
    known: torch.Tensor,
    ok: torch.Tensor,
    keep: torch.Tensor,
    clash: torch.Tensor,
) -> torch.Tensor:
    """The undecided samples among ``rest`` (indices, in order) that clash with no sample kept
    and with no earlier one that may still be kept; the first undecided one always qualifies
    (every sample before it is decided)."""
    undecided = pending[rest] & ~known[rest]
    may_keep = pending[rest] & (~known[rest] | ok[rest])
    earlier = torch.tril(clash[rest][:, rest], diagonal=-1)
    blocked = (earlier & may_keep[None, :]).any(dim=1) | (clash[rest] & keep[None, :]).any(dim=1)
    blocked[0] = False  # the first undecided sample: asking it always moves the loop on
    return rest[undecided & ~blocked]


def residual_problem(problem: LayerProblem, peeled: PeeledSamples) -> tuple[LayerProblem, torch.Tensor]:
    """The SPEAR problem of the samples not yet peeled (step 4), and the basis B (b x (b - f))
    that maps its directions back: a direction q' of the residual problem is ``B q'`` here."""
    b = problem.batch_size
    U = peeled.duals.T  # (b, f): dL/dZ_j = L u_j
    grad_bias_rest = problem.grad_bias - problem.L @ U.sum(dim=1)
    # dL/dW - sum_peeled (L u_j)(R^T r_j)^T = L (I - U C) R, with the rows of C the r_j
    if problem.mode == "output":  # the search is on the q side: the rest is orthogonal to the r_j
        basis = orthogonal_complement(peeled.coefficients, b)
        L_rest = problem.L @ basis
        R_rest = basis.T @ (problem.R - U @ (peeled.coefficients @ problem.R))
    else:  # on the input side (spear.core.input_peeling): the rest is orthogonal to the u_j
        basis = orthogonal_complement(peeled.duals, b)
        L_rest = (problem.L - (problem.L @ U) @ peeled.coefficients) @ basis
        R_rest = basis.T @ problem.R
    next_rest = problem.next_grad_weight
    if next_rest is not None and peeled.next_grad_outputs is not None and len(peeled):
        next_rest = _residual_next_gradient(problem, peeled)
    residual = LayerProblem(
        problem.weight,
        problem.bias,
        grad_bias_rest,
        L_rest,
        R_rest,
        problem.mode,
        next_rest,
        problem.next_weight,
    )
    return residual, basis


def _residual_next_gradient(problem: LayerProblem, peeled: PeeledSamples) -> torch.Tensor:
    """Step 5: the next layer's gradient without the peeled samples' terms ``dZ'_j a_j^T``, its
    rounding errors set to exact zeros.

    An exact zero of dL/dW' (no sample reaches it: a sum of exact zeros) stays one. Elsewhere
    an entry is zero where no unpeeled sample contributes, and what is left there is the error
    of the subtraction: within ``NEXT_ZERO_RTOL`` of the row's size and of the subtracted terms'
    (dZ'_j is solved to a relative error of its largest entry, so even a dead row gets 1e-18s).
    Keeping the exact zeros matters in float32: dZ'_j's inactive entries come out of its solve
    at ~1e-7 of its largest, so subtracting it turned exact zeros of dL/dW' into rounding
    errors far above that bound, and the residual had fewer zero sets than the whole layer
    (MNIST 6 x 500, 200 steps, layer 2, b = 64: the next-layer proposer had none left after the
    first peel)."""
    G = problem.next_grad_weight
    assert G is not None and peeled.next_grad_outputs is not None
    activations = torch.relu(peeled.inputs @ problem.weight.T + problem.bias)  # (f, m)
    terms = peeled.next_grad_outputs  # (f, k)
    scale = G.abs().amax(dim=1, keepdim=True) + terms.abs().amax(dim=1) @ activations
    rest = G - terms.T @ activations
    zero = (G == 0) | (rest.abs() <= NEXT_ZERO_RTOL * scale)
    return torch.where(zero, 0.0, rest)


__all__ = [
    "PeelOutcome",
    "PeeledSamples",
    "SamplePeeler",
    "certified_in_order",
    "mutually_consistent",
    "residual_problem",
]
