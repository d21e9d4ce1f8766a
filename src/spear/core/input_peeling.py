"""Peeling with input sparsity: a found input gives its own dL/dZ column through the layer's ReLU.

With ``sparsity="input"`` the search finds directions ``p`` with ``x = c R^T p`` sparse: the
samples themselves, up to scale. When the layer is also followed by a ReLU (a hidden layer of an
MLP, the first layer of a network on raw images, the classifier head of a CNN), each such
sample can be completed on its own, without the other directions (the mirror image of
:mod:`spear.core.peeling`, which completes a found dL/dZ column through the next layer):

1. Scale. ``dL/dW = L R = sum_j (L u_j) x_j^T`` with ``x_j = R^T r_j`` forces
   ``u_j . r_k = delta_jk`` (peeling step 3), and ``s = L^+ dL/db = sum_k u_k`` (Theorem 3.6),
   so ``r_j . s = 1``: ``r_j = p / (p . s)`` and ``x_j`` is exact, scale included.
   The inputs must be nonnegative (they come out of a ReLU, or are raw pixels in [0, 1]).
   Its zero features must pin ``p`` (a one-dimensional kernel of ``R^T`` on them): a mixture of
   samples generally vanishes only where all of them do, and there its kernel holds all of them.
2. Pattern. The server knows W and the bias, so ``z_j = W x_j + bias`` gives the neurons sample
   j leaves inactive, ``S_j = {z_j < 0}``. Its column ``dL/dZ_j`` vanishes there, so it spans the
   kernel of ``L[S_j]`` (Theorem 3.3's argument). That kernel must be one-dimensional and robust
   (no essential row); a wrong ``p`` usually predicts a pattern no column has, and ``L[S_j]``,
   with about m/2 >= b rows, then has no kernel at all.
3. The kernel vector ``q`` must also be nonzero wherever ``z_j > 0`` (sigma = 1 both ways, for
   this one column), and ``u_j = q / (q . r_j)`` gives ``dL/dZ_j = L u_j``. An active neuron
   whose entry lies within the zero band is *silent* (a gradient the data cannot tell from
   zero, as in trained float32 layers): it is allowed, but such a sample is never robust, and
   only a discriminative model certificate (whose misfit bounds every entry) counts it.
4. The remaining directions satisfy ``p . u_j = 0``; subtracting ``(L u_j) x_j^T`` and ``L u_j``
   leaves the gradients of the other samples (:func:`spear.core.peeling.residual_problem`).

Near duplicates: when a sample's inactive neurons are all inactive for a similar sample too
(their patterns differ in a few rows, one zero set inside the other), ``L[S_j]`` keeps both
columns, and step 2's kernel is two-dimensional. With the model's predicted columns
(``predict_columns``: each label's ``d loss / dZ`` at ``x_j``), the column is the one of that
kernel the model predicts: exactly one label's column must lie in it, and the kernel must have
exactly two dimensions (``SHARED_KERNEL``). Fashion-MNIST's CNN head trained 300 steps,
b = 10: two samples of one class whose patterns differ in 4 of 144 live rows. Such a sample is
never robust: it counts only with a discriminative model certificate.

These checks are necessary but, unlike the two-layer certificate of :mod:`spear.core.peeling`,
not sufficient: when features tie across samples (``x_k = a x_j`` on a few features of
``supp(x_j)``), a mixture dominated by one sample can vanish on that sample's zeros plus the tied
features, be pinned there, and keep that sample's ReLU pattern (found by an adversarial review,
tested). So a sample completed here counts only once the model certifies it
(:mod:`spear.certify`, which ``attack_layer`` supplies): ``needs_model`` says so to the attack.

Only server-side quantities are used: W, bias, dL/dW and dL/db.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spear.core.consistency import ZERO_FLOOR_FRACTION
from spear.core.deadline import NEVER, Deadline
from spear.core.filtering import largest_on, rounding_floor, zero_mask
from spear.core.linalg import lstsq, masked_kernels
from spear.core.peeling import PeelChecks, PeeledSamples, PeelOutcome, peel_chunks
from spear.core.scale import LayerProblem

#: a sample's column is taken from the model only where its inactive neurons leave a kernel of
#: exactly this many dimensions (module doc: near duplicates). Where the loss is affine in the
#: pre-activations over a pattern region (a custom MSE loss), a same-pattern mixture
#: ``sum a_j x_j`` (``sum a_j = 1``, the bias scale) has the mixture of the samples' predicted
#: columns, and its loss weight is one sample's when ``sum a_j^2 = 1``: for two samples only
#: the samples themselves, for three a circle of wrong inputs (found by a review: a custom MSE
#: loss, three samples sharing a pattern and a label, one certified 1.5e-3 off)
SHARED_KERNEL = 2
#: ... and only where the checks' tolerance is at most this (float64 gradients): at float32's
#: 1e-3 a span of a few columns comes that close to other predictions too (a float32 model
#: cascade, MNIST 4 x 200, b = 48, took two samples this way and ended 1.5e-4 off, where the
#: others were within 3e-5)
MODEL_COLUMN_RTOL = 1e-6
#: a pinned input is replaced by its zeros' kernel vector (:meth:`InputSidePeeler._snapped`) when
#: that vector's largest value on those zeros is at most this fraction of the input's (measured
#: on one float32 CNN head: traced candidates 8e-3 and below, exact ones whose zeros hold a small
#: true value 0.3 and above)
TRACE_SHRINK = 0.1
#: inputs (k, n) -> the model's columns (k, C, m) under each label, at unit loss weight
ColumnModel = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Completion:
    """:meth:`InputSidePeeler._complete`'s result for k directions: which are consistent and
    robust (k,), their coefficients r and duals u (k, b), the directions p completed (k, b),
    and where the input's own zeros were read (pin_inputs), those zeros (k, n) and the kernel
    of ``R^T`` on them (k, b)."""

    ok: torch.Tensor
    robust: torch.Tensor
    r: torch.Tensor
    u: torch.Tensor
    p: torch.Tensor
    zeros: torch.Tensor | None = None
    kernel: torch.Tensor | None = None


class _Completions:
    """Completions of k directions (given, (k, b)), filled chunk by chunk."""

    def __init__(self, k: int, b: int, L: torch.Tensor, given: torch.Tensor) -> None:
        self.checks = PeelChecks.empty(k, b, L)
        self.duals = torch.zeros(k, b, dtype=L.dtype, device=L.device)
        self.directions = given.clone()

    def record(self, part: torch.Tensor, done: Completion) -> None:
        self.checks.record(part, done.ok, done.robust, done.r, torch.zeros_like(done.ok))  # refutes nothing
        self.duals[part], self.directions[part] = done.u, done.p

    def outcome(self, R: torch.Tensor) -> PeelOutcome:
        consistent, coefficients = self.checks.consistent, self.checks.coefficients
        samples = PeeledSamples(
            directions=self.directions[consistent],
            coefficients=coefficients[consistent],
            inputs=coefficients[consistent] @ R,
            duals=self.duals[consistent],
        )
        return PeelOutcome(consistent, self.checks.robust, samples)


class InputSidePeeler:
    """Completes samples found on the input side through the attacked layer's own ReLU
    (steps 1-3 of the module doc).

    Args:
        problem: the attacked layer in input-sparsity mode.
        rtol: relative tolerance of the kernel and pattern checks (the verification tolerance
            of the gradient's dtype).
        z_rtol: pre-activations at most this times the largest |z| have no sign and are left
            out of both checks.
        zero_rtol: entries of ``L q`` at most this times its largest count as zero.
        pin_inputs: require the input's own zeros to pin it (step 1). Without (the dense scan
            of :func:`spear.core.singletons.singleton_candidates`: photos, or inputs whose zeros
            other samples share), steps 2-3 still apply, but no sample is robust: only a
            discriminative model certificate counts it.
        predict_columns: the model's columns under each label for inputs in this layer's
            coordinates (module doc: near duplicates); None: none are taken from the model.
        rounding: the rounding map of L's columns (see :meth:`_within_rounding`).
        snap: see :meth:`_snapped`.
    """

    #: the layer alone cannot certify these samples (see the module doc)
    needs_model = True

    def __init__(
        self,
        problem: LayerProblem,
        rtol: float,
        z_rtol: float,
        zero_rtol: float,
        pin_inputs: bool = True,
        predict_columns: ColumnModel | None = None,
        rounding: torch.Tensor | None = None,
        snap: bool = False,
    ) -> None:
        if problem.mode != "input":
            raise ValueError("InputSidePeeler needs a problem in input-sparsity mode")
        self.problem = problem
        self.rtol = rtol
        self.z_rtol = z_rtol
        self.zero_rtol = zero_rtol
        self.pin_inputs = pin_inputs
        self.predict_columns = predict_columns
        #: the rounding map of L's columns at the gradient's measured rounding
        #: (:attr:`~spear.core.reconstruct.AttackSetup.measured_rounding`; None where the batch is
        #: resolvable): a faint column's zeros read up to its floor
        self.rounding = rounding
        #: replace a pinned input carrying a trace by its zeros' kernel vector (:meth:`_snapped`);
        #: the outcome then holds the inputs as read too, for the caller to fall back on where
        #: the model does not certify the snapped one (the singleton cascade)
        self.snap = snap
        self._columns: OrthonormalFactor | None = None  # built on first use (QR of L and of R^T)
        self._inputs: OrthonormalFactor | None = None

    @property
    def column_basis(self) -> OrthonormalFactor:
        """An orthonormal basis of the columns ``L q`` (the kernel tests of step 2)."""
        if self._columns is None:
            self._columns = OrthonormalFactor.of(self.problem.L)
        return self._columns

    @property
    def input_basis(self) -> OrthonormalFactor:
        """An orthonormal basis of the inputs ``R^T r`` (the pin of step 1)."""
        if self._inputs is None:
            self._inputs = OrthonormalFactor.of(self.problem.R.T)
        return self._inputs

    @property
    def usable(self) -> bool:
        """Whether a sample's inactive neurons can pin its column: more live neurons than b."""
        return self.problem.L.shape[0] > self.problem.batch_size

    def peel(self, directions: torch.Tensor, masks: torch.Tensor, deadline: Deadline = NEVER) -> PeelOutcome:
        """Check and complete the samples of k exact input-side directions (k, b); ``masks``
        (their zero sets on the input side) are not needed: the pattern comes from W. Past
        ``deadline`` the remaining directions are left unchecked (not consistent)."""
        L, R = self.problem.L, self.problem.R
        k, b = directions.shape
        m = L.shape[0]
        given = directions.to(L.dtype)
        final, read = _Completions(k, b, L, given), _Completions(k, b, L, given)
        snapped = torch.zeros(k, dtype=torch.bool, device=L.device)
        if k and self.usable:
            rows = max(m, R.shape[1])
            for part in peel_chunks(torch.arange(k, device=L.device), rows, b):
                if deadline.passed():
                    break
                done = self._complete(given[part])
                read.record(part, done)
                if self.snap and done.kernel is not None:
                    done, snapped[part] = self._snapped(done)
                final.record(part, done)
        outcome = final.outcome(R)
        if bool(snapped.any()):
            outcome.snapped, outcome.as_read = snapped[outcome.consistent], read.outcome(R)
        return outcome

    def _complete(self, p: torch.Tensor) -> Completion:
        """Steps 1-3 for directions p (k, b)."""
        problem, L = self.problem, self.problem.L
        b = L.shape[1]
        tiny = torch.finfo(L.dtype).tiny
        r, scaled = problem.input_coefficients(p, self.rtol)
        x = r @ problem.R
        # the inputs come out of a ReLU (or are otherwise nonnegative): negative only by rounding
        nonnegative = x.amin(dim=1) >= -self.rtol * x.abs().amax(dim=1)
        z = r @ problem.R_Wt + problem.bias  # (k, m) pre-activations of the samples
        signless = z.abs() <= self.z_rtol * z.abs().amax(dim=1, keepdim=True)
        inactive = (z < 0) & ~signless
        active = (z > 0) & ~signless
        enough = inactive.sum(dim=1) >= b
        plausible = scaled & nonnegative & enough
        # q: the column's direction
        one_dim, firm, q, wider = self.column_basis.kernel(inactive, self.rtol, plausible)
        if self.predict_columns is not None and self.rtol <= MODEL_COLUMN_RTOL:  # near duplicates
            shared = (plausible & wider).nonzero()[:, 0]
            if shared.numel():
                found, vectors = self._model_columns(inactive[shared], x[shared])
                one_dim[shared[found]] = True
                q[shared[found]] = vectors[found]  # firm stays False: the layer does not pin them
        column = q @ L.T  # (k, m)
        nonzero = ~zero_mask(column, self.zero_rtol)
        # sigma = 1 for this column: zero where inactive (the kernel), nonzero where active, but
        # for silent entries: an active neuron whose gradient the data cannot tell from zero (a
        # trained float32 layer: one such entry each kept 3 of 16 true samples from ever
        # counting). A sample with one is never robust: only a discriminative model
        # certificate, whose misfit bounds every entry, counts it
        pattern = ~(inactive & nonzero).any(dim=1)
        blurred = pattern | self._within_rounding(column, q, inactive)
        quiet = ~(active & ~nonzero).any(dim=1)
        qr = (q * r).sum(dim=1)
        u = q / torch.where(qr.abs() > tiny, qr, torch.ones_like(qr)).unsqueeze(-1)
        dual = qr.abs() > self.rtol * q.norm(dim=1) * r.norm(dim=1)  # u_j must exist
        ok = scaled & nonnegative & enough & one_dim & blurred & dual
        ok &= torch.isfinite(u).all(dim=1) & torch.isfinite(r).all(dim=1)
        if not self.pin_inputs:  # checked on the output side only: never robust
            return Completion(ok, torch.zeros_like(ok), r, u, p)
        # the input's own zeros must pin p (a mixture of samples vanishes only where all do,
        # and there its kernel holds all of them)
        own_zeros = zero_mask(x, self.zero_rtol)
        pinned, firm_input, kernel, _ = self.input_basis.kernel(own_zeros, self.rtol, ok)
        ok &= pinned & (own_zeros.sum(dim=1) >= b - 1)
        robust = ok & firm & firm_input & quiet & pattern
        return Completion(ok, robust, r, u, p, own_zeros, kernel)

    def _snapped(self, done: Completion) -> tuple[Completion, torch.Tensor]:
        """The completed samples ``done`` with each input that carries a trace replaced by the
        vector its own zeros pin (``done.kernel``, the kernel of ``R^T`` on ``done.zeros``),
        completed afresh where that passes steps 1-3; and which were replaced (k,).

        A candidate is pinned when its zeros leave a one-dimensional kernel, but it is kept as
        read: a row of the gradient whose other samples were subtracted slightly off carries
        ``c x_k`` of another input, and where ``x_k`` is small on the sample's zeros the trace
        stays inside the zero band. The kernel vector is then the sample itself: it vanishes
        there to rounding, where the candidate reads the trace. Measured (MNIST CNN head, f32,
        trained 200 steps on one thread, b = 64, seed 4): certified candidates 1.2e-5 to 1.8e-3 off
        read 1.4e-5 to 1e-4 of their max on their zeros, their kernel vectors 1e-10
        to 2.4e-7, within 2e-5 of the truth; an input whose zeros include a small true value
        (truth: one zero fewer) has no kernel vanishing there, and reads 0.3 to 1 of the candidate
        (``TRACE_SHRINK``): there the candidate, exact, is kept. A candidate certainly zero on
        its zeros (within ``ZERO_FLOOR_FRACTION`` of the zero band: rounding) carries no trace
        to take out, and is not solved again (float64 batches, whose candidates read 1e-16).

        The zero band cannot tell which of the two carries a trace: where another input
        nearly vanishes on the sample's zeros and the sample holds a small true value there,
        the kernel vector is the sample plus a trace of that input (found by a review, on a
        synthetic float32 batch). So the caller certifies the snapped input, and falls back on
        the one as read where the model does not (``PeelOutcome.as_read``)."""
        assert done.zeros is not None and done.kernel is not None
        x, x_kernel = done.r @ self.problem.R, done.kernel @ self.problem.R
        on_zeros = largest_on(x, done.zeros)
        traced = done.ok & (on_zeros > ZERO_FLOOR_FRACTION * self.zero_rtol)  # else certainly zero there
        traced &= largest_on(x_kernel, done.zeros) <= TRACE_SHRINK * on_zeros
        index = traced.nonzero()[:, 0]
        replaced = torch.zeros_like(done.ok)
        if not index.numel():
            return done, replaced
        sign = torch.sign((done.kernel[index] * done.p[index]).sum(dim=1, keepdim=True))
        fresh = self._complete(done.kernel[index] * sign)
        take, passed = index[fresh.ok], fresh.ok
        out = Completion(done.ok, done.robust.clone(), done.r.clone(), done.u.clone(), done.p.clone())
        out.robust[take], out.r[take] = fresh.robust[passed], fresh.r[passed]
        out.u[take], out.p[take] = fresh.u[passed], fresh.p[passed]
        replaced[take] = True
        return out, replaced

    def _within_rounding(self, column: torch.Tensor, q: torch.Tensor, inactive: torch.Tensor) -> torch.Tensor:
        """(k,) whether each column (k, m; directions q (k, b)) vanishes on its inactive rows to
        its rounding floor (:func:`~spear.core.filtering.rounding_floor`), up to the kernel
        test's ``rtol`` of its max: the zeros of a faint sample's column read at its rounding.
        The float32 CNN head trained 200 steps (MNIST, b = 64, seed 1) kept 8 exact inputs
        uncounted, their columns 1e-8 from the true ones in angle, with inactive entries at
        1.3e-4 to 9.5e-4 of the column's max, above ``zero_rtol`` (1e-4) and below their
        floors. Such a sample is never robust: only a discriminative model certificate, whose
        misfit bounds every entry, counts it (as with silent entries). The output side's
        mirror is :meth:`spear.core.reconstruct._Attack._within_rounding`."""
        floor = rounding_floor(q, self.rounding, column.shape[1])
        if floor is None:
            return torch.zeros(column.shape[0], dtype=torch.bool, device=column.device)
        nonzero = ~zero_mask(column, self.zero_rtol, floor, cap=self.rtol)
        return ~(inactive & nonzero).any(dim=1)

    def _model_columns(self, inactive: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For k samples (inputs x (k, n)) whose inactive rows (k, m) leave ``L`` a kernel of two
        dimensions or more: whether it has exactly ``SHARED_KERNEL`` and exactly one label's
        predicted column lies in the span of its columns (to ``rtol`` of its norm), and that
        column's direction (k, b)."""
        L = self.problem.L
        k, b = inactive.shape[0], L.shape[1]
        found = torch.zeros(k, dtype=torch.bool, device=L.device)
        vectors = torch.zeros(k, b, dtype=L.dtype, device=L.device)
        tiny = torch.finfo(L.dtype).tiny
        _, S, Vh = torch.linalg.svd(L * inactive.unsqueeze(-1).to(L.dtype), full_matrices=False)
        dims = (S / S[:, :1].clamp_min(tiny) <= self.rtol).sum(dim=1)
        usable = (dims == SHARED_KERNEL).nonzero()[:, 0]
        if not usable.numel():
            return found, vectors
        predicted = self.predict_columns(x[usable]).to(L)  # (k', C, m)
        for i, index in enumerate(usable.tolist()):
            kernel = Vh[index, b - SHARED_KERNEL :].T  # (b, 2)
            span = L @ kernel  # (m, 2): the columns vanishing on the inactive rows
            target = predicted[i].T  # (m, C)
            coefficients = lstsq(span, target)  # (2, C)
            misfit = (span @ coefficients - target).norm(dim=0) / target.norm(dim=0).clamp_min(tiny)
            fits = (misfit <= self.rtol).nonzero()[:, 0]
            if fits.numel() == 1:  # one label only: two or more would not tell the column
                vector = kernel @ coefficients[:, fits[0]]
                found[index] = True
                vectors[index] = vector / vector.norm().clamp_min(tiny)
        return found, vectors


#: the kernel screen's relative singular value: row sets whose smallest singular value is
#: above twice this (and twice the kernel test's tolerance) times the largest have no kernel.
#: Its square must stay far above the rounding of a float64 Gram matrix and its Cholesky
#: factorization (~1e-13 of its trace at m = 1000, b = 256)
SCREEN_RTOL = 1e-6


@dataclass(frozen=True)
class OrthonormalFactor:
    """A factor (rows x b) as ``basis @ triangle``, ``basis`` with orthonormal columns (QR).

    Kernel tests judge a vector by its size on the chosen rows *relative to its own size*,
    which the factor's coordinates do not: ``L = U S^1/2`` gives a faint sample (a confident
    one, whose gradient is 1e-5 of the others') a column of norm ~1e-3 for a unit direction,
    below float32's kernel tolerance on every row. A sample's own column then never had a
    one-dimensional kernel on its inactive rows, the faint directions lying beside it
    (``s_(b-1) / s_1`` ~ 5e-4 where the kernel read 1e-7; the float32 CNN head trained 200
    steps, b = 64). In the orthonormal basis every column of the span has unit size, so
    ``s_b`` and ``s_(b-1)`` measure the kernel and its nearest rival on the same scale."""

    basis: torch.Tensor
    triangle: torch.Tensor

    @staticmethod
    def of(factor: torch.Tensor) -> OrthonormalFactor:
        basis, triangle = torch.linalg.qr(factor)
        return OrthonormalFactor(basis, triangle)

    def kernel(
        self, rows: torch.Tensor, rtol: float, todo: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`_kernel` of the basis, its vectors mapped back to the factor's coordinates
        (unit vectors ``q`` with ``factor @ q`` along the kernel's column)."""
        one_dim, robust, vectors, wider = _kernel(self.basis, rows, rtol, todo)
        solved = vectors.abs().amax(dim=1) > 0
        if bool(solved.any()):
            q = torch.linalg.solve_triangular(self.triangle, vectors[solved].T, upper=True).T
            vectors[solved] = q / q.norm(dim=1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
        return one_dim, robust, vectors, wider


def _kernel(
    factor: torch.Tensor, rows: torch.Tensor, rtol: float, todo: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For k row sets (k, rows) of ``factor`` (rows x b): whether the kernel of those rows is
    one-dimensional, whether it is also robust (no essential row), its unit vector (k, b;
    zero for the sets not solved), and whether it has two dimensions or more. Only the sets
    in ``todo`` (k,) are solved (default: all), and only those :func:`_may_have_kernel` passes
    are solved (:func:`masked_kernels`, an SVD of m x b or an eigendecomposition of b x b: most
    candidate inputs of the singleton cascade predict a pattern no column has, and an SVD each
    made its dense rounds tens of seconds at m = 1000, b = 256)."""
    k, b = rows.shape[0], factor.shape[1]
    one_dim = torch.zeros(k, dtype=torch.bool, device=factor.device)
    robust = torch.zeros_like(one_dim)
    wider = torch.zeros_like(one_dim)
    vectors = torch.zeros(k, b, dtype=factor.dtype, device=factor.device)
    todo = torch.ones_like(one_dim) if todo is None else todo.to(one_dim.device)
    index = todo.nonzero()[:, 0]
    if index.numel():
        index = index[_may_have_kernel(factor, rows[index], rtol)]
    if not index.numel():
        return one_dim, robust, vectors, wider
    solved = masked_kernels(factor, rows[index], degenerate_below=rtol)
    one_dim[index] = solved.one_dimensional(rtol)
    robust[index] = solved.robust
    vectors[index] = solved.kernel.nan_to_num(0.0)
    S = solved.singular_values
    wider[index] = solved.degenerate | (S[:, -2] <= rtol * S[:, 0])
    return one_dim, robust, vectors, wider


def _may_have_kernel(factor: torch.Tensor, rows: torch.Tensor, rtol: float) -> torch.Tensor:
    """(k,) False for row sets whose rows of ``factor`` surely have no kernel at tolerance
    ``rtol``: ``G - tau I`` is positive definite (a Cholesky factorization succeeds) for their
    Gram matrix ``G`` (in float64) and ``tau = (2 max(rtol, SCREEN_RTOL))^2 trace(G)``, so the
    smallest singular value exceeds about twice that tolerance times ``sqrt(trace G)``, which
    is at least the largest singular value. The rounding of G and of its factorization, far
    below tau, cannot turn a kernel into a pass. The Gram matrix and a Cholesky cost about a
    seventh of the SVD."""
    f = factor.to(torch.float64)
    f = f / f.abs().amax().clamp_min(torch.finfo(f.dtype).tiny)  # no underflow in the Gram matrix
    weights = rows.to(f.dtype).unsqueeze(1)  # (k, 1, rows)
    gram = (f.T.unsqueeze(0) * weights) @ f  # (k, b, b)
    trace = torch.diagonal(gram, dim1=1, dim2=2).sum(dim=1)
    tau = (2.0 * max(rtol, SCREEN_RTOL)) ** 2 * trace
    eye = torch.eye(gram.shape[1], dtype=gram.dtype, device=gram.device)
    _, info = torch.linalg.cholesky_ex(gram - tau[:, None, None] * eye)
    return info != 0


__all__ = ["InputSidePeeler"]
