"""Algorithm 1 (SPEAR): propose, filter, select, scale, verify; with budgets and progress.

Tensors in, a :class:`Reconstruction` out. Input validation and conversion live in
:mod:`spear.api`; this module assumes float tensors of consistent shapes on one device.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from spear import theory
from spear.core.filtering import (
    DEFAULT_ZERO_RTOL,
    CandidatePool,
    SnapResult,
    canonical_sign,
    snap_and_filter,
    zero_mask,
)
from spear.core.greedy import Selection, greedy_filter, score
from spear.core.lowrank import default_rank_rtol, low_rank_split
from spear.core.peeling import (
    PeeledSamples,
    SamplePeeler,
    mutually_consistent,
    residual_problem,
)
from spear.core.proposers import (
    PROPOSERS,
    AutoProposer,
    DirectionProposer,
    ProposalBatch,
    ProposalContext,
    RandomSubmatrixSampler,
)
from spear.core.scale import LayerProblem, SparsityMode
from spear.core.verify import DEFAULT_VERIFY_RTOL, verify
from spear.errors import InputError, NoSparsityError

#: how many times the expected wait for one sparse direction must pass without any candidate
#: before the gradient is declared not ReLU-sparse, and the zero rate that wait assumes
NO_SPARSITY_PATIENCE = 200
NO_SPARSITY_ZERO_RATE = 0.3
#: the attack moves on to the residual problem of the unrecovered samples once this fraction of
#: them has been peeled since the last move (each move makes the proposers start afresh)
RESIDUAL_STEP = 0.1


@dataclass(frozen=True)
class ProgressEvent:
    """A snapshot of a running attack, passed to the ``progress`` callback after every step."""

    proposals: int
    max_proposals: int
    candidates: int
    consistent_directions: int
    batch_size: int
    sigma: float | None
    seconds: float
    certified: int = 0  # samples recovered and certified one by one (core.peeling)


@dataclass(frozen=True)
class AttackOptions:
    """Options of one attack. Every field has a default; see ``spear.reconstruct``.

    Attributes:
        max_proposals: proposal budget N (Algorithm 1). None: 20x Lemma 5.2's expectation,
            clipped to [1e6, 2e9].
        chunk_size: proposals per vectorized step.
        p_fr: false-rejection rate; tau follows from the binomial CDF (Section 4.1).
        seed: seed of every random choice.
        dtype: working dtype of the exact stages (float64 for exact results).
        proposal_dtype: dtype the sampler drafts proposals in (float32 is ~2x faster; survivors
            are re-solved in ``dtype``).
        device: "cpu" or "cuda".
        time_budget: seconds after which the attack stops and returns its best result.
        early_stop: stop as soon as sigma = 1 (Algorithm 1, line 9).
        sparsity: "output" when the layer is followed by a ReLU (dL/dZ sparse, the default),
            "input" when it is preceded by one (X sparse, Section 3.2).
        batch_size: known batch size; overrides the numerical-rank estimate.
        rank_rtol: relative singular-value threshold of the rank estimate.
        zero_rtol: entries below ``zero_rtol * max`` count as zeros.
        verify_rtol: relative tolerance of the gradient verification.
        proposer: a :class:`DirectionProposer`, or a name: "auto" (default: random sampling for
            small batches; for large ones next-layer zero sets, neuron-guided and
            complement-guided sampling and ICA+IRLS, see :class:`AutoProposer`), "sampling" (the
            paper's Algorithm 1), "irls", "guided", "neurons", "next_layer" (one strategy only).
        peel: recover samples one at a time through the next layer's weight gradient, when it
            is given, and continue on the residual problem of the others (:mod:`spear.core.peeling`).
        progress: called with a :class:`ProgressEvent` after every step.
    """

    max_proposals: int | None = None
    chunk_size: int = 4096
    p_fr: float = 1e-5
    seed: int = 0
    dtype: torch.dtype = torch.float64
    proposal_dtype: torch.dtype = torch.float32
    device: str = "cpu"
    time_budget: float | None = None
    early_stop: bool = True
    sparsity: SparsityMode = "output"
    batch_size: int | None = None
    rank_rtol: float | None = None
    zero_rtol: float | None = None
    verify_rtol: float | None = None
    proposer: DirectionProposer | str = "auto"
    peel: bool = True
    progress: Callable[[ProgressEvent], None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class AttackStats:
    proposals: int
    candidates: int
    seconds: float
    seed: int
    proposer: str
    stop_reason: str  # "sigma=1", "budget", "time budget", "interrupted", "exhausted", "trivial"
    threshold_count: int
    tau: float
    certified: int = 0  # samples peeled and certified one by one (core.peeling)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Reconstruction:
    """The result of one attack on one layer.

    Attributes:
        inputs: (b, n) reconstructed batch in arbitrary order, or None when fewer than b
            independent directions were found (then ``message`` says so).
        grad_outputs: (m, b) reconstructed dL/dZ (columns in the order of ``inputs``).
        batch_size: b, the numerical rank of dL/dW.
        sigma: sparsity-matching coefficient of the result (Definition 4.1); 1 means every entry
            of dL/dZ matches the ReLU pattern of the reconstructed pre-activations.
        verified: the gradients recomputed through the ReLU from the reconstruction match the
            observed ones within ``verify_rtol`` (see :mod:`spear.core.verify`).
        residual: the relative error of that recomputation.
        consistent_directions: how many of the b columns match the ReLU pattern entry for entry.
        directions: (b, b) unit directions (columns), scales: (b,) Theorem 3.6's scales.
        singular_values: all singular values of dL/dW, to inspect the rank gap.
        stats: proposals, candidates, seconds, seed, stop reason.
        message: a one-line human summary.
        certified_inputs: (f, n) the samples recovered and certified one at a time through the
            next layer's gradient (:mod:`spear.core.peeling`), or None. They are exact even when
            the whole batch was not recovered (then ``inputs`` is None).
    """

    inputs: torch.Tensor | None
    grad_outputs: torch.Tensor | None
    batch_size: int
    sigma: float
    verified: bool
    residual: float
    consistent_directions: int
    directions: torch.Tensor | None
    scales: torch.Tensor | None
    singular_values: torch.Tensor
    stats: AttackStats
    message: str
    mode: SparsityMode = "output"
    certified_inputs: torch.Tensor | None = None

    def summary(self) -> dict:
        """JSON-ready summary (no tensors)."""
        return {
            "batch_size": self.batch_size,
            "verified": self.verified,
            "residual": self.residual,
            "sigma": self.sigma,
            "consistent_directions": self.consistent_directions,
            "certified_samples": 0 if self.certified_inputs is None else int(self.certified_inputs.shape[0]),
            "mode": self.mode,
            "message": self.message,
            "stats": self.stats.as_dict(),
        }


def default_max_proposals(b: int) -> int:
    """20x the expected proposal count of Lemma 5.2, clipped to [1e6, 2e9]."""
    if b < 2:
        return 0
    return int(min(2e9, max(1e6, 20 * theory.expected_proposals(b))))


def make_proposer(spec: DirectionProposer | str, chunk_size: int) -> DirectionProposer:
    """A proposer instance from a name in :data:`PROPOSERS` (or an instance, used as is)."""
    if isinstance(spec, DirectionProposer):
        return spec
    if spec == "sampling":
        return RandomSubmatrixSampler(chunk_size=chunk_size)
    if spec == "auto":
        return AutoProposer(chunk_size=chunk_size)
    if spec in PROPOSERS:
        return PROPOSERS[spec]()
    raise InputError(
        f"unknown proposer {spec!r}; use one of {sorted(PROPOSERS)} or pass a DirectionProposer instance"
    )


def _make_peeler(
    problem: LayerProblem, options: AttackOptions, source_dtype: torch.dtype, rtol: float
) -> SamplePeeler | None:
    """A :class:`SamplePeeler` when peeling is on and the next layer's gradient can certify
    samples (output sparsity, rank b), else None."""
    if not options.peel or options.sparsity != "output" or problem.next_grad_weight is None:
        return None
    rtol_rank = default_rank_rtol(tuple(problem.next_grad_weight.shape), source_dtype)
    peeler = SamplePeeler(problem, rtol, rtol_rank)
    return peeler if peeler.usable else None


def _lift(snapped: SnapResult, basis: torch.Tensor) -> SnapResult:
    """Directions of a residual problem (k x b') as directions of the full one (k x b); the
    zero masks are the same, since ``L B q' = L q``."""
    q = snapped.directions @ basis.T
    return replace(snapped, directions=canonical_sign(q / q.norm(dim=1, keepdim=True)))


def _residual_found(pool: CandidatePool, basis: torch.Tensor) -> torch.Tensor:
    """The pool's trusted, not yet peeled directions that belong to the residual problem (they
    lie in the span of ``basis``), in its coordinates."""
    q = pool.directions[pool.trusted_mask & ~pool.certified]
    coords = q @ basis
    inside = coords.norm(dim=1) >= 1.0 - 1e-9
    return coords[inside] / coords[inside].norm(dim=1, keepdim=True)


def run_attack(
    weight: torch.Tensor,
    bias: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor,
    options: AttackOptions,
    source_dtype: torch.dtype,
    next_grad_weight: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> Reconstruction:
    """Run SPEAR on validated float tensors (all in ``options.dtype`` on ``options.device``);
    ``next_grad_weight`` (the next linear layer's dL/dW', optional) feeds the next-layer proposer
    and peeling; ``next_weight`` (its W', optional) peeling's residual next-layer gradient."""
    start = time.perf_counter()
    split = low_rank_split(
        grad_weight, batch_size=options.batch_size, rank_rtol=options.rank_rtol, source_dtype=source_dtype
    )
    b = split.batch_size
    problem = LayerProblem(
        weight, bias, grad_bias, split.L, split.R, options.sparsity, next_grad_weight, next_weight
    )
    factor = problem.sparse_factor
    rows = factor.shape[0]
    zero_rtol = options.zero_rtol or DEFAULT_ZERO_RTOL.get(source_dtype, 1e-4)
    verify_rtol = options.verify_rtol or DEFAULT_VERIFY_RTOL.get(source_dtype, 1e-3)
    threshold = theory.sparsity_threshold_count(rows, options.p_fr)
    proposer = make_proposer(options.proposer, options.chunk_size)
    budget = options.max_proposals if options.max_proposals is not None else default_max_proposals(b)
    peeler = _make_peeler(problem, options, source_dtype, verify_rtol)
    peeled = PeeledSamples.empty(
        b,
        problem.R.shape[1],
        factor.dtype,
        factor.device,
        None if peeler is None or peeler.back is None else peeler.U2.shape[0],
    )

    def finish(selection: Selection | None, drawn: int, n_cand: int, reason: str) -> Reconstruction:
        stats = AttackStats(
            proposals=drawn,
            candidates=n_cand,
            seconds=time.perf_counter() - start,
            seed=options.seed,
            proposer=proposer.name if b > 1 else "none",
            stop_reason=reason,
            threshold_count=threshold,
            tau=threshold / rows,
            certified=len(peeled),
        )
        certified_inputs = peeled.inputs if len(peeled) else None
        peeled_note = f"; {len(peeled)} sample(s) recovered and certified one by one" if len(peeled) else ""
        if selection is None:
            return Reconstruction(
                inputs=None,
                grad_outputs=None,
                batch_size=b,
                sigma=float("nan"),
                verified=False,
                residual=float("inf"),
                consistent_directions=0,
                directions=None,
                scales=None,
                singular_values=split.singular_values,
                stats=stats,
                mode=options.sparsity,
                message=(
                    f"not recovered: {n_cand} exact candidate direction(s) found, fewer than the "
                    f"b={b} independent ones needed ({reason} after {drawn:,} proposals)"
                    f"{peeled_note}; raise max_proposals or time_budget"
                ),
                certified_inputs=certified_inputs,
            )
        inputs, grad_outputs = problem.assemble(selection.Qbar, selection.scales)
        check = verify(
            weight, bias, grad_weight, grad_bias, inputs, grad_outputs, options.sparsity, verify_rtol
        )
        if check.verified:
            message = f"exact: all {b} inputs recovered and verified (residual {check.residual:.1e})"
        else:
            message = (
                f"unverified: best selection has sigma={selection.sigma:.4f}, "
                f"{selection.consistent_columns}/{b} directions consistent, residual "
                f"{check.residual:.1e} > {verify_rtol:g} ({reason} after {drawn:,} proposals)"
                f"{peeled_note}"
            )
        return Reconstruction(
            inputs=inputs,
            grad_outputs=grad_outputs,
            batch_size=b,
            sigma=selection.sigma,
            verified=check.verified,
            residual=check.residual,
            consistent_directions=selection.consistent_columns,
            directions=selection.Qbar,
            scales=selection.scales,
            singular_values=split.singular_values,
            stats=stats,
            message=message,
            mode=options.sparsity,
            certified_inputs=certified_inputs,
        )

    if b == 1:  # one sample: Q is 1 x 1, Theorem 3.6 alone gives the scale
        Qbar = torch.ones(1, 1, dtype=factor.dtype, device=factor.device)
        mask = zero_mask((factor @ Qbar).T, zero_rtol)
        sigma, valid, c, consistent = score(problem, Qbar[None], mask[None])
        selection = (
            Selection((0,), Qbar, c[0], float(sigma[0]), int(consistent[0])) if bool(valid[0]) else None
        )
        return finish(selection, 0, 1, "trivial")

    generator = torch.Generator(device="cpu").manual_seed(options.seed)
    pool = CandidatePool(b, rows, dtype=factor.dtype, device=factor.device)
    ctx = ProposalContext(
        L=factor,
        batch_size=b,
        threshold_count=threshold,
        generator=generator,
        proposal_dtype=options.proposal_dtype,
        found=pool.directions,
        problem=problem,
    )
    # what the proposers work on: the whole problem, or the residual one of the samples not
    # peeled yet, whose directions map back through ``basis`` (b x b_rest)
    search, basis, peeled_at_move = ctx, None, 0
    best: Selection | None = None
    drawn = 0
    reason = "budget"
    # Lemma 5.1's q at a conservative 30% zeros per column (trained networks fall below the
    # paper's 50%, Fig. 7): only a gradient with hardly any zeros exhausts this patience
    patience = NO_SPARSITY_PATIENCE / (b * NO_SPARSITY_ZERO_RATE ** (b - 1))
    try:
        while drawn < budget:
            if options.time_budget is not None and time.perf_counter() - start >= options.time_budget:
                reason = "time budget"
                break
            if search.batch_size == 1:  # one sample left: its direction is the residual basis
                batch = ProposalBatch(basis.new_ones(1, 1), n_drawn=1)
            else:
                batch = proposer.propose(search, budget - drawn)
            drawn += batch.n_drawn
            snapped = snap_and_filter(
                search.L, batch.directions, batch.zero_hint, threshold, zero_rtol, known_masks=pool.zero_masks
            )
            if basis is not None:
                snapped = _lift(snapped, basis)
            fresh = None
            if peeler is not None and snapped.directions.shape[0]:
                certified, samples = peeler.peel(snapped.directions, snapped.zero_masks)
                consistent = mutually_consistent(peeled, samples, verify_rtol)
                certified[certified.nonzero()[:, 0][~consistent]] = False
                snapped.certified, fresh = certified, samples.select(consistent)
            known_before = int(pool.trusted_mask.sum())
            added = pool.add(snapped)
            if fresh is not None and len(fresh):
                peeled.extend(fresh)
            changed = added or int(pool.trusted_mask.sum()) != known_before
            if changed:
                ctx.found = pool.trusted  # proposers deflate against / guide from trusted candidates
                ctx.known = int(pool.trusted_mask.sum())
            if search.batch_size == 1 and (fresh is None or len(fresh) == 0):
                search, basis = ctx, None  # the last sample did not certify: back to the whole problem
                peeler = None
            elif len(peeled) < b and len(peeled) - peeled_at_move >= max(
                1, math.ceil(RESIDUAL_STEP * (b - peeled_at_move))
            ):
                rest, basis = residual_problem(problem, peeled)
                search = ProposalContext(
                    L=rest.L,
                    batch_size=rest.batch_size,
                    threshold_count=threshold,
                    generator=generator,
                    proposal_dtype=options.proposal_dtype,
                    found=_residual_found(pool, basis),
                    problem=rest,
                    known=ctx.known,
                )
                peeled_at_move = len(peeled)
            elif basis is not None and changed:
                search.found, search.known = _residual_found(pool, basis), ctx.known
            if changed and len(pool) >= b:
                selection = greedy_filter(
                    problem, pool.directions, pool.zero_masks, pool.zero_counts, certified=pool.certified
                )
                if selection is not None and (best is None or selection.sigma >= best.sigma):
                    best = selection
            if options.progress is not None:
                options.progress(
                    ProgressEvent(
                        proposals=drawn,
                        max_proposals=budget,
                        candidates=len(pool),
                        consistent_directions=best.consistent_columns if best else 0,
                        batch_size=b,
                        sigma=best.sigma if best else None,
                        seconds=time.perf_counter() - start,
                        certified=len(peeled),
                    )
                )
            if best is not None and best.perfect and options.early_stop:
                reason = "sigma=1"
                break
            if batch.exhausted:
                reason = "exhausted"
                break
            if len(pool) == 0 and drawn >= patience and rows > 2 * b:
                raise NoSparsityError(
                    f"no ReLU-sparse direction in {drawn:,} proposals, although one is expected "
                    f"every {patience / NO_SPARSITY_PATIENCE:,.0f} for b={b} even at 30% zeros: the "
                    f"{'output gradient dL/dZ' if options.sparsity == 'output' else 'input X'} "
                    "is not sparse. Is the layer "
                    f"{'followed' if options.sparsity == 'output' else 'preceded'} by a ReLU? "
                    "Otherwise try sparsity='input'/'output', or check the gradient was not noised."
                )
    except KeyboardInterrupt:
        reason = "interrupted"
    return finish(best, drawn, len(pool), reason)


__all__ = [
    "AttackOptions",
    "AttackStats",
    "ProgressEvent",
    "Reconstruction",
    "default_max_proposals",
    "run_attack",
]
