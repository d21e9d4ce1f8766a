"""Algorithm 1 (SPEAR): propose, filter, select, scale, verify; with budgets and progress.

Tensors in, a :class:`Reconstruction` out. Input validation and conversion live in
:mod:`spear.api`; this module assumes float tensors of consistent shapes on one device.

One attack is an :class:`AttackSetup` (everything fixed before the search: the live neurons,
the low-rank split, tolerances, budget) and an :class:`_Attack` loop over it, whose state is the
candidate pool, the peeled samples, the :class:`~spear.core.search.ResidualSearch` and the best
selection with its :class:`~spear.core.verdict.Verdict`.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from dataclasses import dataclass

import torch

from spear import theory
from spear.core.certificate import SampleCertificates, SampleCertifier
from spear.core.certified_batch import (
    CERTIFIED_BATCH_NOTE,
    JOINT_CERTIFIED_NOTE,
    activation_residuals,
    certified_batch,
    pool_positions,
)
from spear.core.column_inputs import column_input_candidates
from spear.core.consistency import (
    RESOLVABLE_SLACK,
    Tolerances,
    bound_noise,
    contradictions,
    fits_the_layer_above,
    layer_above_applies,
    measured_noise,
    noisy_tolerances,
    resolvable,
    rounding_map,
    zero_set_pins,
)
from spear.core.deadline import Deadline, LateError, finish_by
from spear.core.diagnosis import (
    BELOW_THRESHOLD_NOTE_START,
    DIAGNOSABLE_RATIO,
    PROBE_AFTER_CALLS,
    adapted_threshold,
    below_threshold_note,
    faint_batch_note,
    forced_zeros_note,
    no_sparsity_message,
    probe_sparse_directions,
    relu_sparse,
)
from spear.core.filtering import (
    FLOOR_CAP,
    CandidatePool,
    SnapResult,
    canonical_sign,
    floor_of,
    kernel_of_rows,
    rounding_error,
    rounding_floor,
    sparsest_first,
    zero_mask,
)
from spear.core.greedy import RANK_RTOL, Selection, greedy_filter, score
from spear.core.input_peeling import ColumnModel, InputSidePeeler
from spear.core.lowrank import LOW_PRECISION_EPS, LowRankSplit, equilibrated_split, low_rank_split
from spear.core.peeling import (
    PeeledSamples,
    PeelOutcome,
    Precisions,
    SamplePeeler,
    certified_in_order,
    mutually_consistent,
)
from spear.core.polish import MAX_TURN, Polished, polish_directions, repair_rows
from spear.core.proposers import (
    PROPOSERS,
    AutoProposer,
    DirectionProposer,
    ProposalBatch,
    ProposalContext,
    RandomSubmatrixSampler,
)
from spear.core.released import inconsistent_columns, released_kernels
from spear.core.result import AttackOptions, AttackStats, ProgressEvent, Reconstruction
from spear.core.scale import LayerProblem
from spear.core.search import ResidualSearch, lift
from spear.core.singletons import (
    as_input_problem,
    as_output_samples,
    refine_peeled,
    singleton_candidates,
)
from spear.core.verdict import (
    AUDIT_SLACK,
    TIGHTEST_SAMPLE_RTOL,
    WEIGHT_PRECISION,
    ModelGate,
    Verdict,
    column_precision,
    data_precision,
    explained_misfits,
    judge,
    model_explains_silent,
    sample_tolerances,
    tolerances_of,
    verdict_message,
)
from spear.core.verify import live_rows, verify
from spear.errors import InputError, NoSparsityError, RankError

#: a gradient whose first singular value beyond the batch exceeds this many eps s_max carries
#: more than rounding (unflagged noise): its columns get no rounding floor
ROUNDING_NOISE = 100.0
#: how many times the expected wait for one sparse direction must pass without any candidate
#: before the gradient is declared not ReLU-sparse, and the zero rate that wait assumes
NO_SPARSITY_PATIENCE = 200
NO_SPARSITY_ZERO_RATE = 0.3
#: selections re-made after the model certificate rejected columns, per step at most
MAX_REJECTION_ROUNDS = 4
#: peeled samples whose model weights agree before any of them counts as one sample's weight
WEIGHT_QUORUM = 3
#: proposer calls without a new trusted direction (fewer than b in hand) before the current
#: problem is probed for columns too dense for the filter's threshold
STALL_CALLS = 20
#: non-robust directions (an essential zero row: mostly mixtures, see
#: :func:`~spear.core.filtering.kernel_of_rows`) peeled per step at most, sparsest first. Each
#: costs peeling an SVD and a least-squares solve; a trained network's dense, correlated columns
#: make thousands of mixtures per step once the threshold is lowered (MNIST 6 x 500, 200
#: steps, layer 2, b = 64: 1,874 of 1,900), while the true columns that are non-robust (a
#: similar sample's zero set holds all but one of theirs) are few and among the sparsest. The
#: rest stay in the pool for the selection, whose certificate judges every column.
NONROBUST_PEEL_PER_STEP = 32
#: a refused batch's peeled samples are dropped from the certified ones only where the audit
#: names at most this share of the batch (:func:`_peeled_in_batch`)
MOST_NAMED_SHARE = 0.5
#: columns whose zero sets are inconsistent tried at most by the repair of a batch the precision
#: audit refused (released zeros, :mod:`spear.core.released`), most inconsistent first
MOST_RELEASED_SAMPLES = 4


def worth_peeling(snapped: SnapResult) -> torch.Tensor:
    """Indices of the snapped directions to peel: every robust one, and the
    ``NONROBUST_PEEL_PER_STEP`` sparsest of the others (all of them when robustness is unknown)."""
    every = torch.arange(snapped.directions.shape[0], device=snapped.directions.device)
    if snapped.robust is None:
        return every
    robust = snapped.robust.to(every.device)
    others = sparsest_first(every[~robust], snapped.zero_counts.to(every.device))
    return torch.cat([every[robust], others[:NONROBUST_PEEL_PER_STEP]]).sort().values


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


@dataclass(frozen=True)
class LayerTensors:
    """The attacked layer as the server sees it, full width (for verification)."""

    weight: torch.Tensor
    bias: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor


@dataclass
class AttackSetup:
    """Everything fixed before the search starts.

    Neurons inactive for the whole batch (dead rows: their rows of dL/dW are exactly zero) are
    zero in every column of dL/dZ; they carry no information and would only dilute random row
    subsets, so ``problem`` holds the live rows only and results are mapped back to the full
    width (``expand``). With input sparsity the same holds for input features that are zero in
    every sample (dead columns: the background pixels of raw images, hidden units no sample
    activates): ``problem`` holds the live columns only and inputs come back zero there
    (``expand_inputs``).
    """

    layer: LayerTensors
    live: torch.Tensor  # (m,) bool
    live_inputs: torch.Tensor  # (n,) bool; all True with output sparsity
    split: LowRankSplit
    problem: LayerProblem
    tol: Tolerances
    threshold: int
    budget: int
    options: AttackOptions
    source_dtype: torch.dtype
    start: float

    @classmethod
    def build(
        cls,
        layer: LayerTensors,
        options: AttackOptions,
        source_dtype: torch.dtype,
        next_grad_weight: torch.Tensor | None,
        next_weight: torch.Tensor | None,
        start: float | None = None,
    ) -> AttackSetup:
        """``start``: when the time budget began (``time.perf_counter()``); now by default. The
        API passes the moment it was called, so that checking and casting the inputs count."""
        start = time.perf_counter() if start is None else start
        live = live_rows(layer.grad_weight)
        live_inputs = torch.ones(layer.grad_weight.shape[1], dtype=torch.bool, device=live.device)
        if options.sparsity == "input":
            live_inputs = live_rows(layer.grad_weight.T)  # features some sample has nonzero
        grad_weight = layer.grad_weight[live][:, live_inputs]
        low_precision = torch.finfo(source_dtype).eps > LOW_PRECISION_EPS
        split = (equilibrated_split if low_precision else low_rank_split)(
            grad_weight,
            batch_size=options.batch_size,
            rank_rtol=options.rank_rtol,
            source_dtype=source_dtype,
        )
        if split.batch_size >= int(live.sum()):
            raise RankError(
                f"only {int(live.sum())} of {live.numel()} neurons are active for this batch, and the "
                f"gradient has rank {split.batch_size}: SPEAR needs more active neurons than samples"
            )
        problem = LayerProblem(
            layer.weight[live][:, live_inputs],
            layer.bias[live],
            layer.grad_bias[live],
            split.L,
            split.R,
            options.sparsity,
            None if next_grad_weight is None else next_grad_weight[:, live],
            None if next_weight is None else next_weight[:, live],
        )
        rows_searched = problem.sparse_factor.shape[0]
        b = split.batch_size
        budget = options.max_proposals if options.max_proposals is not None else default_max_proposals(b)
        return cls(
            layer=layer,
            live=live,
            live_inputs=live_inputs,
            split=split,
            problem=problem,
            tol=_tolerances(split, source_dtype, options),
            threshold=theory.sparsity_threshold_count(rows_searched, options.p_fr),
            budget=budget,
            options=options,
            source_dtype=source_dtype,
            start=start,
        )

    @property
    def b(self) -> int:
        return self.split.batch_size

    @property
    def resolvable(self) -> bool:
        """Whether the batch's zero sets can be trusted (:func:`~spear.core.consistency.resolvable`)."""
        eps = torch.finfo(self.source_dtype).eps
        return resolvable(self.split.singular_values, self.b, self.tol.zero_rtol, eps)

    @functools.cached_property
    def rounding(self) -> torch.Tensor | None:
        """The factor's rounding map (:func:`~spear.core.consistency.rounding_map`), where the
        batch is not resolvable for its weakest samples' rounding alone; else None: a resolvable
        batch's zero sets need no floor, and a gradient noisier than its rounding (DP-SGD,
        compression) is not known to rounding precision."""
        eps = torch.finfo(self.source_dtype).eps
        S = self.split.singular_values
        beyond = float(S[self.b]) if self.b < S.numel() else 0.0
        if self.split.noisy or self.resolvable or beyond > ROUNDING_NOISE * eps * float(S[0]):
            return None
        factor = self.problem.sparse_factor
        return rounding_map(S, self.b, eps).to(factor)

    @functools.cached_property
    def measured_rounding(self) -> torch.Tensor | None:
        """:attr:`rounding` with the gradient's rounding as its spectrum measures it
        (:func:`~spear.core.consistency.measured_noise`), where that is smaller: the per-entry
        floor of a column's zero set, for :meth:`trusted_columns`. None with :attr:`rounding`."""
        if self.rounding is None:
            return None
        factor = self.problem.sparse_factor
        S = self.split.singular_values
        noise = measured_noise(S, self.b, (self.problem.L.shape[0], self.problem.R.shape[1]))
        if noise is None:
            return self.rounding
        eps = torch.finfo(self.source_dtype).eps
        return rounding_map(S, self.b, eps, min(noise, bound_noise(S, self.b, eps))).to(factor)

    def trusted_columns(self, directions: torch.Tensor) -> torch.Tensor:
        """(k,) whether the zero sets of the columns of these directions (k x b) can be trusted:
        all where the batch is resolvable; none of a gradient noisier than its rounding. Where
        the batch is not resolvable for its weakest samples' rounding alone (a rounding map),
        the columns that pass, on their own, the test the whole batch failed (their rounding,
        :func:`column_precision`, within ``RESOLVABLE_SLACK * zero_rtol``), and whose zero set
        as read covers their rounding: the rounding floor (:func:`rounding_floor`, at the
        rounding the gradient's spectrum measures, :attr:`measured_rounding`) within the zero
        band, or within ``FLOOR_CAP`` where :meth:`column_zeros` reads zeros up to the floor
        (float64). In float32 the floor never widens the band, and a column trusted by its
        precision alone (up to 1e-3) could have true zeros read as nonzero (a review's concern);
        the floor rules that out (active entries below the band read as zero in any column).
        The faint columns are never trusted."""
        k = directions.shape[0]
        if self.resolvable:
            return torch.ones(k, dtype=torch.bool, device=directions.device)
        if self.rounding is None:
            return torch.zeros(k, dtype=torch.bool, device=directions.device)
        factor = self.problem.sparse_factor
        precise = column_precision(directions, factor, self.rounding) <= RESOLVABLE_SLACK * self.tol.zero_rtol
        values = directions @ factor.T
        floor = rounding_floor(directions, self.measured_rounding, values.shape[1])
        assert floor is not None
        band = max(self.tol.zero_rtol, FLOOR_CAP) * values.abs().amax(dim=1)
        return precise & (floor <= band)

    def column_zeros(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The zero sets of the columns of directions q (k x b): the entries within ``zero_rtol``
        of each column's max or its rounding floor, and the certainly zero ones (k, rows)."""
        values = q @ self.problem.sparse_factor.T
        masks = zero_mask(values, self.tol.zero_rtol, rounding_floor(q, self.rounding, values.shape[1]))
        return masks, zero_mask(values, self.tol.zero_floor)

    def scored(
        self, indices: tuple[int, ...], Qbar: torch.Tensor
    ) -> tuple[Selection | None, torch.Tensor, torch.Tensor]:
        """These directions (b x b, columns) scored as a selection (:func:`~spear.core.greedy.
        score`; None where their scales are not valid), with their columns' zero and certainly
        zero sets (:meth:`column_zeros`)."""
        masks, certain = self.column_zeros(Qbar.T)
        sigma, valid, scales, consistent = score(
            self.problem, Qbar[None], masks[None], certain[None], self.tol.z_rtol
        )
        if not bool(valid[0]):
            return None, masks, certain
        return Selection(indices, Qbar, scales[0], float(sigma[0]), int(consistent[0])), masks, certain

    def sample_rtol(self, directions: torch.Tensor) -> torch.Tensor:
        """(k,) the misfit tolerance of the samples of these directions (k x b):
        :func:`~spear.core.verdict.sample_tolerances` in output mode (the precision of the dL/dZ
        columns the certificate checks), else the verification tolerance."""
        if self.options.sparsity != "output":
            return torch.full((directions.shape[0],), self.tol.verify_rtol, dtype=torch.float64)
        return sample_tolerances(directions, self.problem.sparse_factor, self.rounding, self.tol.verify_rtol)

    def explained_misfits(self, directions: torch.Tensor) -> torch.Tensor | None:
        """(k,) the misfit the rounding of each direction's column explains
        (:func:`~spear.core.verdict.explained_misfits`), in output mode; else None."""
        if self.options.sparsity != "output":
            return None
        return explained_misfits(directions, self.problem.sparse_factor, self.rounding, self.tol.verify_rtol)

    def pairing_precision(self, duals: torch.Tensor, coefficients: torch.Tensor) -> Precisions | None:
        """The relative rounding of the columns ``L u`` of samples (duals u, k x b) and of their
        inputs ``r R`` (coefficients r, k x b): :func:`~spear.core.verdict.column_precision`, and
        its mirror on the input side (``R`` carries the map's errors per unit of each coordinate
        of ``r``), for :func:`~spear.core.peeling.mutually_consistent`. None without a rounding
        map (a resolvable batch: every sample far more precise than the tolerance)."""
        if self.rounding is None:
            return None
        column = column_precision(duals, self.problem.sparse_factor, self.rounding)
        r = coefficients.to(self.rounding)
        size = (r @ self.problem.R.to(r)).norm(dim=1).clamp_min(torch.finfo(r.dtype).tiny)
        return column, (r @ self.rounding).norm(dim=1) / size

    def sample_precision(self, directions: torch.Tensor) -> torch.Tensor:
        """(b,) each sample's rounding in the data, for the batch of these directions (b x b,
        columns): :func:`~spear.core.verdict.data_precision`."""
        eps = torch.finfo(self.source_dtype).eps
        return data_precision(self.split.singular_values, directions, eps)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def deadline(self) -> Deadline:
        """When the time budget runs out (:mod:`spear.core.deadline`)."""
        return Deadline.after(self.options.time_budget, self.start)

    def expand(self, live_rows: torch.Tensor) -> torch.Tensor:
        """(m_live, k) values on the live neurons -> (m, k), zero on the dead ones."""
        out = live_rows.new_zeros(self.live.numel(), live_rows.shape[1])
        out[self.live] = live_rows
        return out

    def column_model(self, certifier: object) -> ColumnModel | None:
        """The certifier's columns under each label (``per_label_columns``) in this problem's
        coordinates: inputs on the live features in, columns on the live neurons out."""
        predict = getattr(certifier, "per_label_columns", None)
        if predict is None or self.source_dtype != torch.float64:  # float64 tolerances only
            return None

        def on_live(inputs: torch.Tensor) -> torch.Tensor:
            columns = predict(self.expand_inputs(inputs))
            return columns[:, :, self.live.to(columns.device)]

        return on_live

    def expand_inputs(self, live_columns: torch.Tensor) -> torch.Tensor:
        """(k, n_live) inputs on the live features -> (k, n), zero on the dead ones."""
        if bool(self.live_inputs.all()):
            return live_columns
        out = live_columns.new_zeros(live_columns.shape[0], self.live_inputs.numel())
        out[:, self.live_inputs] = live_columns
        return out

    def make_peeler(self) -> SamplePeeler | InputSidePeeler | None:
        """How found directions become samples one by one, when peeling is on: with output
        sparsity a :class:`SamplePeeler` when the next layer's gradient can certify samples
        (rank b); with input sparsity an :class:`InputSidePeeler` (the layer's own ReLU)."""
        p = self.problem
        if not self.options.peel:
            return None
        if self.options.sparsity == "input":
            tol = self.tol
            own = InputSidePeeler(p, tol.verify_rtol, tol.z_rtol, tol.zero_rtol)
            return own if own.usable else None
        if p.next_grad_weight is None:
            return None
        tol = self.tol
        peeler = SamplePeeler(p, tol.verify_rtol, source_dtype=self.source_dtype, zero_rtol=tol.zero_rtol)
        return peeler if peeler.usable else None

    def assemble_and_check(self, selection: Selection):
        """Inputs and full-width dL/dZ of a selection, and the recomputed gradients' check."""
        inputs, grad_outputs = self.problem.assemble(selection.Qbar, selection.scales)
        inputs, grad_outputs = self.expand_inputs(inputs), self.expand(grad_outputs)
        lt = self.layer
        check = verify(
            lt.weight,
            lt.bias,
            lt.grad_weight,
            lt.grad_bias,
            inputs,
            grad_outputs,
            self.options.sparsity,
            self.tol.verify_rtol,
            self.tol.z_rtol,
            exact=not self.split.noisy,
            row_noise=self.options.row_noise,
        )
        return (inputs, grad_outputs), check


#: in a noisy gradient, candidates within this many noise ratios of each other (in angle) are
#: copies of one column found through different noisy zero sets; at least 1 - 1e-4 in cosine
NOISY_DUPLICATE_SPREAD = 3.0


def copy_angle(split: LowRankSplit) -> float:
    """The angle within which two candidates can be copies of one column, found through
    different zero sets: about ``s_(b+1) / s_b`` (the errors of ``L``'s columns; the noise of a
    noisy gradient, the rounding of an exact one), times ``NOISY_DUPLICATE_SPREAD``. Negligible
    in float64; 1e-3 for a float16 layer of width 60, where the greedy selection's first stage
    took 7 copies of one sample, each raising the rank by 1e-4, for 7 samples."""
    return NOISY_DUPLICATE_SPREAD * split.noise_ratio


def selection_rank_rtol(split: LowRankSplit) -> float:
    """The rank tolerance of the greedy selection, and the angle within which proposers count
    two found directions as copies of one column: :func:`copy_angle`, at least ``RANK_RTOL``."""
    return max(RANK_RTOL, copy_angle(split))


def noisy_duplicate_cos(split: LowRankSplit) -> float:
    """The cosine above which two candidates of a noisy gradient are one direction: each column
    is found many times through slightly different noisy zero sets, and the greedy selection
    must not take copies of one sample for several. 0 (the pool's default) for exact gradients."""
    if not split.noisy:
        return 0.0
    return 1.0 - max(1e-4, 0.5 * copy_angle(split) ** 2)


def noise_note(setup: AttackSetup) -> str | None:
    """What a noisy gradient (rank above the batch) means for the result, or None."""
    split = setup.split
    if not split.noisy:
        return None
    how = "read off the largest singular-value gap" if split.from_gap else "given"
    return (
        f"the gradient is noisy (numerical rank {split.numerical_rank} > batch size {split.batch_size}, "
        f"{how}; noise at {split.noise_ratio:.1e} of the batch's weakest singular value): the batch "
        f"is recovered only to within the noise (zero band widened to {setup.tol.zero_rtol:.1e}) "
        "and it is verified only if the noise stays below the verification tolerance"
    )


def _tolerances(split: LowRankSplit, source_dtype: torch.dtype, options: AttackOptions) -> Tolerances:
    """The dtype's tolerances, with the zero band widened to the noise of a gradient whose rank
    exceeds the batch (read off the gap, or given as ``batch_size``), unless ``zero_rtol`` is set."""
    tol = Tolerances.for_dtype(source_dtype, options.zero_rtol, options.verify_rtol)
    if split.noisy and options.zero_rtol is None:
        return noisy_tolerances(tol, split.noise_ratio)
    return tol


class SweptSelection:
    """Where the last selection's swaps ended, for the next selection's swaps to start from
    (:func:`spear.core.greedy.greedy_filter`'s ``start``). Stage 1's basis is rebuilt from the
    sparsest candidates at every selection, and the swaps climbed from it again, though the
    pool had grown by a handful of candidates or one certified sample: at MNIST 6 x 500,
    float32, trained 200 steps, layer 2, b = 64, each selection swept eight times (2.5 s
    each) from sigma 0.75 to 0.974."""

    #: ``|cos|`` from which a pool direction is the remembered one (pool directions are unit)
    SAME_COS = 1.0 - 1e-12

    def __init__(self) -> None:
        self.directions: torch.Tensor | None = None

    def remember(self, pool: CandidatePool, selection: Selection) -> None:
        self.directions = pool.directions[list(selection.indices)].clone()

    def find(self, pool: CandidatePool) -> list[int] | None:
        """The pool indices of the remembered directions still in the pool (None: none)."""
        if self.directions is None or not len(pool):
            return None
        at, same = self.in_pool(self.directions, pool)
        return at[same].tolist() or None

    @classmethod
    def in_pool(cls, directions: torch.Tensor, pool: CandidatePool) -> tuple[torch.Tensor, torch.Tensor]:
        """For unit directions (k, b): the index of the pool's most parallel one (up to sign),
        and whether that is the very direction (``SAME_COS``)."""
        best, at = (directions.to(pool.directions.dtype) @ pool.directions.T).abs().max(dim=1)
        return at, best >= cls.SAME_COS


class _Attack:
    """The search loop of one attack and its state."""

    def __init__(self, setup: AttackSetup, certifier: SampleCertifier | None) -> None:
        self.setup = setup
        opts = setup.options
        factor = setup.problem.sparse_factor
        self.proposer = make_proposer(opts.proposer, opts.chunk_size)
        self.pool = CandidatePool(
            setup.b,
            factor.shape[0],
            dtype=factor.dtype,
            device=factor.device,
            duplicate_cos=noisy_duplicate_cos(setup.split),
        )
        # the peeler's own SVD (of the next layer's gradient) cannot be cut either: waited for
        # until the deadline only (review 46b: 3.75 s on a loaded machine, a 3 s budget ran 7.5 s)
        try:
            self.peeler = finish_by(setup.deadline, setup.make_peeler)
        except LateError:
            self.peeler = None
        late = setup.deadline.passed()
        self.peeled = PeeledSamples.empty(
            setup.b,
            setup.problem.R.shape[1],
            factor.dtype,
            factor.device,
            self.peeler.U2.shape[0]
            if isinstance(self.peeler, SamplePeeler) and self.peeler.back is not None
            else None,
        )
        # samples the cascade subtracts without counting them (a sign-only model fit)
        self.provisional = PeeledSamples.empty(setup.b, setup.problem.R.shape[1], factor.dtype, factor.device)
        self.gate = ModelGate(certifier)
        #: the LT cascade, where nothing else peels and the model can certify (output sparsity)
        #: (by ``pin_inputs``: the self-pinning candidates' peeler, and the dense candidates')
        self.singleton_peelers: dict[bool, InputSidePeeler] | None = None
        if opts.peel and opts.sparsity == "output" and self.peeler is None and self.gate.active and not late:
            try:
                peelers = finish_by(setup.deadline, lambda: _singleton_peelers(setup, certifier))
            except LateError:
                peelers = None
            self.singleton_peelers = peelers if peelers is not None and peelers[True].usable else None
        root = ProposalContext(
            L=factor,
            batch_size=setup.b,
            threshold_count=setup.threshold,
            generator=torch.Generator(device="cpu").manual_seed(opts.seed),
            proposal_dtype=opts.proposal_dtype,
            found=self.pool.directions,
            problem=setup.problem,
            zero_rtol=setup.tol.zero_rtol,
            deadline=setup.deadline,
            noisy=setup.split.noisy,
            rounding=setup.rounding,
            copy_angle=selection_rank_rtol(setup.split),
        )
        self.search = ResidualSearch(root)
        self.search.follows_peeling = self.peeler is not None
        self.best: Selection | None = None
        self.verdict: Verdict | None = None
        self.drawn = 0
        self.calls = 0
        self.probed = False
        self.weights_seen: list[float] = []  # loss weights the model certificate fitted
        self.stall_probed_at = -1  # the call of the last stall probe (-1: none yet)
        self.lowered_at: int | None = None  # the call that last lowered the threshold
        self.fruitless_probes = 0  # stall probes in a row, up to the last, that lowered nothing
        self.first_threshold = setup.threshold  # Section 4.1's, which a note names when lowered
        self.trusted_seen, self.last_progress = 0, 0  # for _check_stall
        self.sparse_drop = -1  # the last call whose snapping dropped a ReLU-sparse direction
        self.drop_streak = 0  # consecutive calls, up to the last, that dropped one
        self.probe_found_sparse = False  # the sparsity probe found ReLU-sparse directions
        self.swaps_deferred = False  # the last selection skipped its swaps (peeling progressed)
        self.resolvable = setup.resolvable
        self._offered: Selection | None = None  # the last selection shown to stop_when
        self.swept = SweptSelection()  # where the last selection's swaps ended
        self.silent_tried: set[tuple[int, int, bool]] = set()  # see _explain_silent
        self.certified_judged = False  # the batch of b samples certified one by one was judged
        #: selections (pool indices) whose refused batch released zeros were tried on (:meth:`_released`)
        self.released_tried: set[tuple[int, ...]] = set()
        self.columns_tried: set[bytes] = set()  # zero sets of the found columns' inputs tried
        #: a candidate's fit showed that the known layer above alone takes this layer's output
        self.layer_above_holds = False
        self.pool_purged = False  # candidates left the pool since the last selection
        #: the next layer's row space (peeling's P), which checks certified inputs one by one;
        #: None without output-side peeling (the batch of certified samples is then not judged)
        self.activation_basis = self.peeler.P if isinstance(self.peeler, SamplePeeler) else None
        self.notes: list[str] = [] if (note := noise_note(setup)) is None else [note]

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> ProposalBatch:
        """Propose, snap, peel, pool, select."""
        batch = self.search.propose(self.proposer, self.setup.budget - self.drawn)
        self.drawn += batch.n_drawn
        self.calls += 1
        if self.setup.deadline.passed():
            return batch  # the run ends here: snapping and peeling would overrun the budget
        snapped = self.search.snap(batch, self.setup.tol, self.pool.known_masks)
        ctx = self.search.ctx
        # columns below the threshold, dropped by snapping or by the proposer itself
        dropped = max(snapped.dropped_sparsest, batch.below_threshold)
        if relu_sparse(dropped, ctx.batch_size, ctx.rows):
            self.sparse_drop = self.calls
            self.drop_streak += 1
        else:
            self.drop_streak = 0
        self._absorb(snapped)
        return batch

    def _absorb(self, snapped: SnapResult) -> None:
        snapped = self._samples_only(snapped)
        fresh = self._peel(snapped)
        snapped = self.search.settled(snapped)
        if fresh is not None and len(fresh):
            self.peeled.extend(fresh)  # certified: the result counts them whatever follows
        if self.setup.deadline.passed():
            return  # the run ends here: pooling and selecting would only overrun the budget
        known_before = int(self.pool.trusted_mask.sum())
        added = self.pool.add(snapped)
        changed = bool(added) or int(self.pool.trusted_mask.sum()) != known_before or self.pool_purged
        self.pool_purged = False
        dropping = self.sparse_drop == self.calls  # this step dropped a ReLU-sparse direction
        if not self.search.update(
            self.pool, self.peeled, changed, 0 if fresh is None else len(fresh), dropping
        ):
            self.peeler = None  # the last sample did not certify: peeling has done what it can
        # while peeling certifies samples the pool grows under the search: the swaps wait for
        # the next step that certifies none, changed pool or not (all b certified need none)
        peeling = fresh is not None and len(fresh) > 0
        if len(self.pool) >= self.setup.b and (changed or (self.swaps_deferred and not peeling)):
            self.swaps_deferred = peeling
            self._select(0 if peeling else None)
        if changed:
            self._scan_found_columns()
        self._judge_certified()

    def _samples_only(self, snapped: SnapResult) -> SnapResult:
        """The snapped directions whose columns can be samples' given the known layer above
        (:func:`~spear.core.consistency.fits_the_layer_above`); the others' zero sets are
        rejected for good. The form holds where the update is one gradient of the model and
        that layer alone takes this one's output: the premises of the model's certificate,
        which FedAvg updates switch off (``W'`` moves between local steps) and which needs a
        sequential tail (no second head). So it applies only where the model certifies, and
        starts with the first candidate whose fit tells, then clears the pool of the
        uncertified candidates that do not fit. Until then, and without such a layer (input
        sparsity, a noisy gradient, a next layer too wide: ``layer_above_applies``), all of
        them."""
        fits = self._fit_the_layer_above(snapped.directions)
        if fits is None:
            return snapped
        fits, telling = fits
        if not self.layer_above_holds:
            if not bool((fits & telling).any()):
                return snapped
            self.layer_above_holds = True
            pooled = self._fit_the_layer_above(self.pool.directions)
            assert pooled is not None
            misfits = ~pooled[0] & ~self.pool.certified
            final = self.verdict is not None and self.verdict.verified  # kept as it stands
            if bool(misfits.any()) and not final:  # the pool's indices move: select again
                self.pool.reject(misfits.nonzero()[:, 0].tolist())
                self.best, self.verdict, self.pool_purged = None, None, True
        if bool(fits.all()):
            return snapped
        self.pool.rejected_masks = torch.cat([self.pool.rejected_masks, snapped.zero_masks[~fits]])
        return snapped.select(fits)

    def _fit_the_layer_above(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:func:`~spear.core.consistency.fits_the_layer_above` for directions q (k x b) of the
        whole layer, or None where it does not apply."""
        setup, problem = self.setup, self.setup.problem
        upper = problem.next_weight
        if upper is None or problem.mode != "output" or setup.split.noisy or not self.gate.active:
            return None
        factor = problem.sparse_factor
        if not layer_above_applies(factor.shape[0], upper.shape[0]):
            return None
        columns = q.to(factor.dtype) @ factor.T
        errors = rounding_error(q, setup.rounding)
        floors = floor_of(errors, factor.shape[0])
        return fits_the_layer_above(columns, upper, setup.tol.zero_rtol, floors, errors)

    def _run_deferred_swaps(self) -> None:
        """The swaps the last selection skipped (a step that certified samples), when the run
        ends before a step that certifies none: a perfect selection may be one swap away. Not
        past the deadline (the time budget is a promise)."""
        done = self._settled()
        if self.swaps_deferred and not done and not self.setup.deadline.passed():
            self.swaps_deferred = False
            self._select()

    def _peel(self, snapped: SnapResult) -> PeeledSamples | None:
        """Recover the samples of new directions one by one; mark the certified ones.

        A sample counts when the two layers certify it robustly, or when they are consistent
        with it and the model certifies it (:mod:`spear.core.certificate`). A peeler whose
        layer-level checks do not suffice (``needs_model``: input-side peeling) counts only
        samples the model certifies."""
        if self.peeler is None or not snapped.directions.shape[0]:
            return None
        # the cap is measured on output-side peeling only; input-side peeling takes every one
        chosen = torch.arange(snapped.directions.shape[0], device=snapped.directions.device)
        if isinstance(self.peeler, SamplePeeler):
            chosen = worth_peeling(snapped)
        outcome = self.peeler.peel(
            snapped.directions[chosen], snapped.zero_masks[chosen], self.setup.deadline
        )
        samples = outcome.samples
        # no sample's: not trusted (CandidatePool), once the peeler has shown it fits this
        # client by certifying a sample (a next layer it does not describe refutes every column)
        calibrated = len(self.peeled) > 0 or bool(outcome.consistent.any())
        if outcome.refuted is not None and calibrated:
            snapped.refuted = torch.zeros_like(snapped.zero_counts, dtype=torch.bool)
            snapped.refuted[chosen[outcome.refuted]] = True
        consistent = outcome.consistent.nonzero()[:, 0]
        position = chosen[consistent]
        self._adopt_directions(snapped, position, samples.directions)
        layer_ok = outcome.robust[consistent] & self.resolvable
        keep = torch.zeros_like(layer_ok)
        if len(samples) and not (self.peeler.needs_model and not self.gate.active):
            keep = certified_in_order(
                self.peeled,
                samples,
                torch.ones_like(layer_ok),
                lambda index: self._certify_some(samples, layer_ok, index),
                self.setup.tol.verify_rtol,
            )
        certified = torch.zeros(snapped.directions.shape[0], dtype=torch.bool, device=position.device)
        certified[position[keep]] = True
        snapped.certified = certified
        return samples.select(keep)

    def _adopt_directions(
        self, snapped: SnapResult, position: torch.Tensor, directions: torch.Tensor
    ) -> None:
        """Where peeling replaced a direction by a more exact one (its retry on the clearly zero
        rows, :meth:`SamplePeeler._retry_without_band`), the pool takes that one, with its masks."""
        if not position.numel():
            return
        new = directions.to(snapped.directions.dtype)
        changed = (snapped.directions[position] != new).any(dim=1)
        if not bool(changed.any()):
            return
        rows, q = position[changed], new[changed]
        masks, certain = self.setup.column_zeros(q)
        snapped.directions[rows] = q
        snapped.zero_masks[rows] = masks
        snapped.zero_counts[rows] = masks.sum(dim=1).to(snapped.zero_counts.dtype)
        if snapped.certain_zero is not None:
            snapped.certain_zero[rows] = certain

    def _certify_some(
        self, samples: PeeledSamples, layer_ok: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """Which of the peeled samples ``index`` count, given which the layers certify
        (``layer_ok``); fills in their model certificate's labels, weights and strength where a
        model is known (:meth:`_certify_and_fit`). Past the deadline the model certifies none:
        it checks its deadline only between groups, and a later ask of
        :func:`~spear.core.peeling.certified_in_order` would be one group. Without a model the
        layers' word (free) still counts."""
        if self.gate.active and self.setup.deadline.passed():
            return torch.zeros_like(index, dtype=torch.bool)
        some = samples.select(index)
        counts = self._certify_and_fit(some, layer_ok[index])[0]
        samples.labels[index], samples.weights[index] = some.labels, some.weights
        samples.strong[index] = some.strong
        return counts

    def _certify_and_fit(
        self, samples: PeeledSamples, layer_ok: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Which peeled samples count, given which the layers certify (``layer_ok``), filling in
        the model certificate's labels, weights and strength; and which the model fits as one
        sample's, however weakly (a sign-only fit, unsaturated, with one sample's loss weight)."""
        grads = self.setup.expand(self.setup.problem.L @ samples.duals.T).T
        rtol = self._sample_rtol(samples.duals)
        inputs = self.setup.expand_inputs(samples.inputs)
        cert = self.gate.check(inputs, grads, layer_ok, rtol, self.setup.deadline)
        if cert is None:
            return layer_ok, layer_ok
        ok = cert.ok.to(layer_ok.device)
        single = self._single(cert.weights.to(samples.weights), ok, rtol.to(samples.weights))
        samples.strong = ok & cert.strong.to(ok.device) & single
        # labels only from a discriminative fit (a sign-only one assumes the loss)
        samples.labels = torch.where(samples.strong, cert.labels.to(ok.device), -1)
        samples.weights = torch.where(ok, cert.weights.to(samples.weights), torch.nan)
        # with a model, a sample counts only if it fits it as one sample: a column whose weight
        # is a multiple of one sample's stands for several (only their mean is determined), one
        # no label fits may be a merge of samples the layer cannot separate, and a saturated one
        # may stand for several that share its pattern
        saturated = cert.saturated.to(ok.device)
        fits = ok & single & ~saturated
        return (layer_ok & fits) | samples.strong, fits

    def _scan_singletons(self) -> None:
        """The LT cascade (:mod:`spear.core.singletons`): candidate inputs from the rows of the
        gradient without the peeled samples, completed through this layer's ReLU; a sample
        counts only when the model certifies it. Repeats while it peels samples.

        Candidates with b - 1 zero features pin themselves (the input-side check). Once those
        give nothing new, every candidate (inputs such as photos, with hardly a zero pixel, and
        inputs whose zeros other samples share, such as a black border) is checked through the
        layer's ReLU alone, and counts only with a discriminative model certificate. Samples
        the model fits only by sign and scale are subtracted without counting
        (``provisional``, see :meth:`_singleton_round`); after every round all the subtracted
        samples are re-solved together (:meth:`_refine_peeled`)."""
        s = self.setup
        while self.singleton_peelers is not None and not s.deadline.passed():
            if len(self.peeled) + len(self.provisional) >= s.b:
                return
            found = self._singleton_round(pin_inputs=True) or self._singleton_round(pin_inputs=False)
            if found is None:
                return
            self._take_singletons(*found)

    def _take_singletons(self, samples: PeeledSamples, held: PeeledSamples) -> None:
        """Subtract the samples a singleton round certified (``samples``) or only fits
        (``held``, provisional), re-solve them together, and search and select on."""
        if len(held):
            self.pool.add(self._singleton_entries(held, certified=False))
            self.provisional.extend(held)
        if len(samples):
            self.pool.add(self._singleton_entries(samples))
            self.peeled.extend(samples)
        self._refine_peeled()
        self.search.update(self.pool, self.peeled, True, len(samples))
        if len(self.pool) >= self.setup.b:
            self._select()

    def _scan_found_columns(self) -> None:
        """The inputs of the pool's columns (:mod:`spear.core.column_inputs`): each found
        direction's input read off the independent ones found so far, pinned by its own zeros,
        completed through this layer's ReLU and counted only when the model certifies it, as
        the singleton cascade's candidates are; then that cascade again, with the new samples
        subtracted. Only where the batch is not resolvable: there its faintest columns may
        never be found, or never pass as a selection, and the others' samples are certified
        this way; a resolvable batch's selection assembles every input at once (scanned, the
        LT setting at MNIST b = 256 drew the same 3,023 proposals in 54 s instead of 43 s)."""
        s = self.setup
        if self.singleton_peelers is None or self.resolvable or s.deadline.passed():
            return
        if len(self.peeled) + len(self.provisional) >= s.b or not len(self.pool):
            return
        if self.verdict is not None and self.verdict.verified:
            return
        candidates = column_input_candidates(
            s.problem.R,
            self.pool.directions,
            self.pool.zero_counts,
            self._subtracted(),
            self.singleton_peelers[True].input_basis,
            s.tol,
            selection_rank_rtol(s.split),
            self.columns_tried,
            s.deadline,
        )
        found = self._singleton_round(pin_inputs=True, candidates=candidates)
        if found is not None:
            self._take_singletons(*found)
            self._scan_singletons()

    def _refine_peeled(self) -> None:
        """The cascade's samples re-solved together (:func:`~spear.core.singletons.refine_peeled`):
        each sample takes its refined values only where the model still certifies them as it
        did (the same label where it had one, weight one sample's, strength kept, unsaturated),
        so a row taken for explained that is not cannot make a certified sample worse."""
        s = self.setup
        if s.deadline.passed():  # the samples stand as certified; refining only tightens them
            return
        old = self._subtracted()
        refined = refine_peeled(s.problem, old)
        if refined is None:
            return
        grads = s.expand(s.problem.L @ refined.duals.T).T
        rtol = self._sample_rtol(refined.duals)
        none = torch.zeros(len(refined), dtype=torch.bool, device=refined.directions.device)
        cert = self.gate.check(s.expand_inputs(refined.inputs), grads, none, rtol)
        if cert is None:
            return
        labels = cert.labels.to(old.labels.device)
        keep = cert.ok.to(labels.device) & ((labels == old.labels) | (old.labels < 0))
        keep &= cert.strong.to(keep.device) | ~old.strong
        keep &= ~cert.saturated.to(keep.device)
        keep &= self._weights_agree(cert.weights.to(old.weights), rtol.to(old.weights)).to(keep.device)
        f = len(self.peeled)
        for part, index in ((self.peeled, slice(0, f)), (self.provisional, slice(f, None))):
            mine = keep[index]
            part.coefficients[mine] = refined.coefficients[index][mine]
            part.inputs[mine] = refined.inputs[index][mine]
            part.duals[mine] = refined.duals[index][mine]

    def _subtracted(self) -> PeeledSamples:
        """The samples the cascade subtracts: the peeled ones, then the provisional ones."""
        every = torch.ones(len(self.peeled), dtype=torch.bool, device=self.peeled.directions.device)
        both = self.peeled.select(every)  # a copy
        both.extend(self.provisional)
        return both

    def _singleton_entries(self, samples: PeeledSamples, certified: bool = True) -> SnapResult:
        """The pool's entries for samples the singleton cascade certified: their columns' zero
        sets, robust where that zero set pins the column on its own as for any snapped
        direction (a one-dimensional kernel, no essential row, and the kernel is the column's
        direction). How the sample was found (its input's own zeros, or a model certificate
        alone) says nothing about its column's zero set, which the verdict counts as a pin."""
        s = self.setup
        q = samples.directions
        masks, certain = s.column_zeros(q)
        kernel, one_dim, robust = kernel_of_rows(s.problem.L, masks, s.deadline)
        kernel = kernel.to(q) * torch.sign((kernel.to(q) * q).sum(dim=1, keepdim=True))
        same = (kernel - q).norm(dim=1) <= s.tol.verify_rtol  # an angle within the tolerance
        robust = one_dim & robust & same
        marked = torch.full((len(samples),), certified, dtype=torch.bool, device=masks.device)
        return SnapResult(q, masks, masks.sum(dim=1), robust, marked, certain)

    def _singleton_round(
        self, pin_inputs: bool, candidates: torch.Tensor | None = None
    ) -> tuple[PeeledSamples, PeeledSamples] | None:
        """One scan of the self-pinning (``pin_inputs``) or of all candidates (the gradient's
        rows, :func:`~spear.core.singletons.singleton_candidates`, unless ``candidates`` (k, b)
        are given): the samples it certifies, and those it only subtracts (None when neither).

        A sample the model fits only by sign and scale (a saturated-looking softmax, where every
        label's gradient is parallel) does not count, but its column is exact (a kernel of the
        full L) and it stands in the gradient as one sample's weight: subtracted, it exposes the
        neurons it shares with others, as a certified one does. A wrong one can only spoil the
        candidates after it, which are certified on their own merits."""
        s = self.setup
        assert self.singleton_peelers is not None
        if s.deadline.passed():
            return None
        subtracted = self._subtracted()
        if candidates is None:
            candidates = singleton_candidates(s.problem, subtracted, s.tol.zero_rtol, dense=not pin_inputs)
        if not candidates.shape[0]:
            return None
        outcome = self.singleton_peelers[pin_inputs].peel(candidates, None, s.deadline)
        samples = outcome.samples
        if not len(samples):
            return None
        layer_ok = outcome.robust[outcome.consistent] & self._trusted(samples.duals)
        accept, fits = self._certify_and_fit(samples, layer_ok)
        self._as_read_where_refused(outcome, accept, fits)
        found = as_output_samples(samples)
        certified = found.select(accept)
        certified = certified.select(self._consistent_with(subtracted, certified))
        held = found.select(fits & ~accept)
        if len(held):
            subtracted.extend(certified)
            held = held.select(self._consistent_with(subtracted, held))
        return (certified, held) if len(certified) or len(held) else None

    def _as_read_where_refused(self, outcome: PeelOutcome, accept: torch.Tensor, fits: torch.Tensor) -> None:
        """Where the model neither certifies nor fits a sample the peeler replaced by the kernel
        of its own zeros (``outcome.snapped``), the sample as read takes its place in
        ``outcome.samples`` and is certified in turn (``accept`` and ``fits`` updated in place):
        the zero band cannot tell which of the two carries a trace
        (:meth:`~spear.core.input_peeling.InputSidePeeler._snapped`), the model can."""
        if outcome.snapped is None or outcome.as_read is None:
            return
        retry = (outcome.snapped.to(accept.device) & ~accept & ~fits).nonzero()[:, 0]
        if not retry.numel():
            return
        samples, read = outcome.samples, outcome.as_read.samples.select(retry)
        layer_ok = outcome.as_read.robust[outcome.as_read.consistent][retry] & self._trusted(read.duals)
        accept[retry], fits[retry] = self._certify_and_fit(read, layer_ok)
        for name in ("directions", "coefficients", "inputs", "duals", "labels", "weights", "strong"):
            getattr(samples, name)[retry] = getattr(read, name)

    def _consistent_with(self, subtracted: PeeledSamples, new: PeeledSamples) -> torch.Tensor:
        """:func:`~spear.core.peeling.mutually_consistent` of the new samples with the subtracted
        ones, to the verification tolerance plus the rounding of each pair's data
        (:meth:`AttackSetup.pairing_precision`)."""
        duals = torch.cat([subtracted.duals, new.duals])
        coefficients = torch.cat([subtracted.coefficients, new.coefficients])
        precision = self.setup.pairing_precision(duals, coefficients)
        return mutually_consistent(subtracted, new, self.setup.tol.verify_rtol, precision)

    def _trusted(self, directions: torch.Tensor) -> torch.Tensor:
        """(k,) whether the layer's pin of each column (directions k x b) counts: every column
        of a resolvable batch; of one that is not, the columns whose zero sets can be read on
        their own (:meth:`AttackSetup.trusted_columns`, which decides both), as the verdict
        reads a selection's."""
        return self.setup.trusted_columns(directions).to(directions.device)

    def _single(self, weights: torch.Tensor, ok: torch.Tensor, sample_rtol: torch.Tensor) -> torch.Tensor:
        """Which loss weights are one sample's: equal (within each weight's precision, from the
        samples' misfit tolerances ``sample_rtol``) to the median of those seen so far, which at
        least ``WEIGHT_QUORUM`` samples share. A column standing for several samples has a
        multiple of it (duplicates) or, merged from samples the layer cannot separate, another
        value altogether."""
        self.weights_seen += weights[ok].tolist()
        return self._weights_agree(weights, sample_rtol).to(ok.device)

    def _weights_agree(self, weights: torch.Tensor, sample_rtol: torch.Tensor) -> torch.Tensor:
        """:meth:`_single`'s test against the weights seen so far, recording nothing."""
        if not self.weights_seen:
            return torch.zeros(weights.shape, dtype=torch.bool, device=weights.device)
        reference = statistics.median(self.weights_seen)
        rtol = WEIGHT_PRECISION * self.setup.tol.verify_rtol
        agree = sum(abs(w / reference - 1.0) <= rtol for w in self.weights_seen)
        own = torch.clamp_min(WEIGHT_PRECISION * sample_rtol, rtol)
        return ((weights / reference - 1.0).abs() <= own) & (agree >= WEIGHT_QUORUM)

    def _select(self, max_sweeps: int | None = None) -> None:
        """Greedy selection (Algorithm 3, at most ``max_sweeps`` sweeps of swaps); a perfect one
        is judged, and columns the model shows to be wrong are rejected for good before
        selecting again."""
        s, pool = self.setup, self.pool
        if self.verdict is not None and self.verdict.verified:
            return  # a verified batch is final (early_stop=False searches on, but keeps it)
        for _ in range(MAX_REJECTION_ROUNDS):
            if len(pool) < s.b:
                return
            selection = greedy_filter(
                s.problem,
                pool.directions,
                pool.zero_masks,
                pool.zero_counts,
                max_sweeps=max_sweeps,
                certified=pool.certified,
                certain_zero=pool.certain_zero,
                z_rtol=s.tol.z_rtol,
                deadline=s.deadline,
                rank_rtol=selection_rank_rtol(s.split),
                start=None if max_sweeps == 0 else self.swept.find(pool),
            )
            if selection is None:
                return
            if max_sweeps is None:
                self.swept.remember(pool, selection)
            chosen = list(selection.indices)
            best = self.best
            if best is not None and best.sigma >= 1.0 and selection.sigma < 1.0:
                return  # nothing below sigma = 1 displaces a selection at 1, explained or not
            selection = self._explain_silent(selection, pool.zero_masks[chosen], pool.certain_zero[chosen])
            if best is not None and not selection.perfect and (best.perfect or selection.sigma < best.sigma):
                return
            if not selection.perfect and (repaired := self._repair_input_columns(selection)):
                selection, chosen = repaired, list(repaired.indices)
            # a robust candidate that peeling refuted pins nothing (float32 mixtures can be robust)
            pinned = pool.robust[chosen] & ~pool.refuted[chosen]
            selection, polished = self._polish(selection)
            pinned &= polished.keeps_pin.to(pinned.device)
            certified = pool.certified[chosen]
            verdict = self._judge(selection, certified, pinned, polished.solved)
            if verdict is not None and (released := self._released(selection, verdict, certified, pinned)):
                selection, verdict = released
            if verdict is not None and verdict.reject:
                pool.reject([selection.indices[i] for i in verdict.reject])
                self.best, self.verdict = None, None
                continue
            self.best, self.verdict = selection, verdict
            return

    def _repair_input_columns(self, selection: Selection) -> Selection | None:
        """Input mode: the selection with its columns that have negative entries solved again
        on their clearly zero and negative rows (:func:`~spear.core.polish.repair_rows`), where
        the kernel is one-dimensional; the new directions join the pool. None where nothing
        changes or the score does not rise. What it completes is judged as any selection."""
        s = self.setup
        if s.options.sparsity != "input" or s.split.noisy or s.deadline.passed():
            return None
        L = s.problem.sparse_factor
        values = (L @ selection.Qbar).T * selection.scales[:, None].to(L.dtype)
        masks, _ = s.column_zeros(selection.Qbar.T)
        wrong = (~(masks | (values > 0))).any(dim=1).nonzero()[:, 0]
        if not wrong.numel():
            return None
        q, one_dim, robust = kernel_of_rows(L, repair_rows(values[wrong], s.tol.zero_rtol))
        wrong, q, robust = wrong[one_dim], canonical_sign(q[one_dim]), robust[one_dim]
        if not wrong.numel():
            return None
        zero, certain = s.column_zeros(q)
        self.pool.add(SnapResult(q, zero, zero.sum(dim=1), robust, certain_zero=certain))
        Qbar = selection.Qbar.clone()
        Qbar[:, wrong] = q.T.to(Qbar.dtype)
        # every column's pool index anew: adding may have moved (or dropped) candidates
        at, same = SweptSelection.in_pool(Qbar.T, self.pool)
        if not bool(same.all()):
            return None
        Qbar = self.pool.directions[at].T.to(Qbar.dtype)
        repaired = s.scored(tuple(at.tolist()), Qbar)[0]
        return repaired if repaired is not None and repaired.sigma > selection.sigma else None

    def _explain_silent(
        self, selection: Selection, masks: torch.Tensor, certain: torch.Tensor, polished: bool = False
    ) -> Selection:
        """A selection below sigma = 1 only for entries the data cannot hold against it counts
        as perfect, once its gradients are reproduced; else it is returned as it is. Two kinds
        (:func:`~spear.core.consistency.contradictions`):

        * silent entries (an active neuron whose gradient lies below the data's zero floor),
          each of which the model predicts below the zero band too (``explained``). The true
          batch of a trained float32 MLP (m = 1000, b = 32) had one such entry (6.8e-8 of its
          column's largest; z 0.99) and searched to the end of its budget for a selection with
          sigma = 1 that no batch has;
        * refuting entries of faint columns (an inactive neuron whose dL/dZ reads above the zero
          band) within their column's rounding floor (:meth:`_within_rounding`,
          ``within_rounding``). A faint float32 column's rounding reaches past the band: the
          true batch of a float32 CNN head trained 200 steps (MNIST, m = 500, b = 16, seed 2)
          held three columns at 3e-5 to 9e-5 of the largest whose true zeros read up to 3.6e-4
          of their peak (band 1e-4, measured floor 1.3e-3 to 2.2e-3) and searched its whole
          budget. Such columns are not trusted by their zero sets
          (:meth:`AttackSetup.trusted_columns`): only the model's certificate verifies them.

        Only with a model that certifies samples (the verdict then checks each column).
        ``masks``, ``certain`` (b, rows): its columns' zero and certainly zero entries;
        ``polished``: its directions were polished (:meth:`_polish`), as the unpolished
        selection was explained before."""
        s = self.setup
        if selection.perfect or s.options.sparsity != "output" or not self.gate.active:
            return selection
        # each selection (its directions: the pool's indices move as it changes) is explained
        # once while the peeled samples stand: an explained one that did not verify is not judged
        # again, nor one that failed retried
        key = (hash(selection.Qbar.detach().cpu().numpy().tobytes()), len(self.peeled), polished)
        if key in self.silent_tried:
            return selection
        self.silent_tried.add(key)
        Qbar, scales = selection.Qbar, selection.scales
        z_t = s.problem.pre_activations_t(Qbar[None], scales[None])[0]
        refuting, silent = contradictions(z_t, masks, certain, s.tol.z_rtol)
        rounding = self._within_rounding(Qbar.T, refuting)
        if bool((refuting & ~rounding).any()) or not bool((silent | rounding).any()):
            return selection
        if bool(silent.any()) and not hasattr(self.gate.certifier, "gradients"):
            return selection
        (inputs, grad_outputs), check = s.assemble_and_check(selection)
        if not check.verified:
            return selection
        if bool(silent.any()):
            full = s.expand(silent.T).T  # (b, m) on the layer's full width
            rtol = self._sample_rtol(Qbar.T)
            if not model_explains_silent(self.gate, inputs, grad_outputs, full, s.tol.zero_rtol, rtol):
                return selection
        return dataclasses.replace(
            selection, explained=int(silent.sum()), within_rounding=int(rounding.sum())
        )

    def _within_rounding(self, q: torch.Tensor, refuting: torch.Tensor) -> torch.Tensor:
        """(b, rows) the refuting entries of the columns of directions ``q`` (b x b) that lie
        within their column's rounding floor (:func:`~spear.core.filtering.rounding_floor`, at
        the rounding the gradient's spectrum measures, :attr:`AttackSetup.measured_rounding`);
        none where the batch is resolvable (no rounding map): its zero band covers its rounding."""
        s = self.setup
        floor = rounding_floor(q, s.measured_rounding, refuting.shape[1])
        if floor is None or not bool(refuting.any()):
            return torch.zeros_like(refuting)
        values = (q @ s.problem.sparse_factor.T).abs()
        return refuting & (values <= floor.to(values).unsqueeze(1))

    def _judge_certified(self) -> None:
        """Once b samples are certified one by one and the selection is not verified, the batch
        they form is judged, once; it becomes the result when it is verified (and the run
        stops). Their directions solved jointly come first (:meth:`_judge_jointly`), then the
        samples as peeled (:mod:`spear.core.certified_batch`)."""
        s = self.setup
        input_side = isinstance(self.peeler, InputSidePeeler)
        if self.certified_judged or len(self.peeled) != s.b:
            return
        if self.activation_basis is None and not input_side:
            return
        if self.verdict is not None and self.verdict.verified:
            return
        self.certified_judged = True
        if self._judge_jointly():
            return
        # each input on its own: its activation in the next layer's row space (what peeling
        # checked it by), since the batch's gradient residual weighs it by its share. Input-side
        # peeling counted each sample only with the model's certificate, which the verdict keeps
        if not input_side:
            off = activation_residuals(s, self.peeled.inputs, self.activation_basis)
            if not bool((off <= s.tol.verify_rtol).all()):
                return
        batch = certified_batch(s, self.peeled, self.pool.directions)
        selection = batch.selection
        everyone = torch.ones(s.b, dtype=torch.bool, device=selection.Qbar.device)
        data_precision = s.sample_precision(selection.Qbar)
        # audited at the data's precision in both modes (input mode since its selections are
        # polished too: a peeled mixture passes float32's tolerance, see spear.core.released);
        # input mode reads loss weights at that precision, as _judge does
        weights_at = data_precision if input_side else None
        verdict = judge(
            selection,
            s.problem.sparse_factor,
            everyone,
            (batch.inputs, batch.grad_outputs),
            batch.check,
            s.tol,
            self.gate,
            self.resolvable,
            known=batch.known,
            pinned=everyone,
            clients=s.options.clients,
            sample_rtol=self._sample_rtol(selection.Qbar.T),
            precision=data_precision,
            data_precision=weights_at,
            output_side=s.options.sparsity == "output",
        )
        if verdict.verified:
            verdict.notes.append(CERTIFIED_BATCH_NOTE)
            self.best, self.verdict = selection, verdict

    def _judge_jointly(self) -> bool:
        """Judge the certified samples' directions as a selection of their own, polished and
        assembled from all b at once (:meth:`_polish`, :meth:`_judge`, as any selection); True
        when it is verified (it becomes the result).

        Each sample as peeled carries the rounding of the residual problem it was found in,
        more than the data's: a float32 trained MLP (Fashion-MNIST 6 x 500, first layer, 200
        steps, b = 64, seed 1) certified all 64 samples one by one, the selection of the
        search stopped at 63 of 64 consistent columns, and the batch as peeled held a strong
        sample 2.8e-4 off, which the precision audit refused by its loss weight (3e-4 off 1/B,
        against the data's 1e-6). The same 64 directions, each solved again on its clearly
        zero rows and assembled jointly, put every sample within 2.5e-5, and the audit passes.
        Where the joint batch does not verify (Q^-1 R spreads a faint column's rounding over
        every sample), the samples as peeled are judged next. Nothing is pinned for being
        peeled: a column is pinned as a pool candidate is (its zero rows' kernel one-dimensional
        and robust, and its clearly zero rows still pinning it where polished), and it keeps its
        peeled certificate only where it assembles into the very sample certified
        (:meth:`_certified_as_assembled`)."""
        s = self.setup
        directions = self.peeled.directions / self.peeled.directions.norm(dim=1, keepdim=True)
        positions = pool_positions(directions, self.pool.directions)
        selection, masks, certain = s.scored(positions, directions.T.contiguous())
        if selection is None:
            return False
        selection = self._explain_silent(selection, masks, certain)
        selection, polished = self._polish(selection)
        if not selection.perfect:
            return False
        # pinned as a pool candidate is: its zero rows' kernel one-dimensional and robust, and
        # (polished) its clearly zero rows still pinning it
        L = s.problem.sparse_factor
        zero = zero_mask((L @ selection.Qbar.to(L)).T, s.tol.zero_rtol)
        pinned = zero_set_pins(L, zero, s.deadline)
        pinned &= polished.keeps_pin.to(pinned.device)
        everyone = torch.ones(s.b, dtype=torch.bool, device=pinned.device)
        verdict = self._judge(selection, everyone, pinned, polished.solved)
        if verdict is not None and (released := self._released(selection, verdict, everyone, pinned)):
            selection, verdict = released
        if verdict is None or not verdict.verified:
            return False
        verdict.notes.append(JOINT_CERTIFIED_NOTE)
        self.best, self.verdict = selection, verdict
        return True

    def _polish(self, selection: Selection) -> tuple[Selection, Polished]:
        """A perfect selection with its directions polished on their clearly zero rows
        (:func:`~spear.core.polish.polish_directions`) where it stays perfect. A noisy
        gradient's zero band is the noise, and a faint float64 batch's zero sets hold a rounding
        floor: neither has clearly zero rows to refine on. Where the precision audit can act
        (a tolerance looser than float64's), every column is solved again: the audit trusts
        only columns computed on exactly their clearly zero rows. A peeled column that
        polishing turns is no longer the certified sample's direction: the verdict certifies
        it afresh (:meth:`_certified_as_assembled`)."""
        s = self.setup
        none = Polished.unchanged(selection.Qbar)
        floor_widens = s.rounding is not None and s.tol.zero_rtol <= FLOOR_CAP
        if not selection.perfect or s.split.noisy or floor_widens:
            return selection, none
        everywhere = s.tol.verify_rtol > TIGHTEST_SAMPLE_RTOL
        L, zero_rtol = s.problem.sparse_factor, s.tol.zero_rtol
        result = polish_directions(L, selection.Qbar, zero_rtol, everywhere, s.deadline)
        if not bool(result.solved.any()):
            return selection, none
        polished, masks, certain = s.scored(selection.indices, result.Qbar)
        if polished is None:
            return selection, none
        if not polished.perfect and selection.explained:
            polished = self._explain_silent(polished, masks, certain, polished=True)  # audited as any
        if not polished.perfect:
            return selection, none
        return polished, result

    def _judge(
        self, selection: Selection, certified: torch.Tensor, robust: torch.Tensor, polished: torch.Tensor
    ) -> Verdict | None:
        """The verdict on a perfect selection; ``polished`` (b,): its columns solved again on
        their clearly zero rows, which the precision audit checks at the data's precision."""
        if not selection.perfect:
            return None
        assembled, check = self.setup.assemble_and_check(selection)
        factor = self.setup.problem.sparse_factor
        certified, index = self._certified_as_assembled(selection, certified, assembled[0])
        known = self._peeled_certificates(selection.Qbar.shape[1], certified, index)
        tol, gate, ok = self.setup.tol, self.gate, self.resolvable
        trusted = self.setup.trusted_columns(selection.Qbar.T)
        clients = self.setup.options.clients
        explained = self.setup.explained_misfits(selection.Qbar.T) if gate.takes_rtol else None
        # the tolerances are the explained misfits capped (sample_tolerances): derived, not recomputed
        rtol = (
            self._sample_rtol(selection.Qbar.T)
            if explained is None
            else tolerances_of(explained, tol.verify_rtol)
        )
        data_precision = self.setup.sample_precision(selection.Qbar)
        precision = None  # nothing solved on its clearly zero rows: nothing to audit
        if bool(polished.any()):
            precision = torch.where(polished, data_precision, torch.inf)
        return judge(
            selection,
            factor,
            certified,
            assembled,
            check,
            tol,
            gate,
            ok,
            known=known,
            pinned=robust,
            trusted=trusted,
            data_precision=data_precision,
            clients=clients,
            sample_rtol=rtol,
            precision=precision,
            explained=explained,
            output_side=self.setup.options.sparsity == "output",
        )

    def _released(
        self, selection: Selection, verdict: Verdict, certified: torch.Tensor, pinned: torch.Tensor
    ) -> tuple[Selection, Verdict] | None:
        """Where the precision audit refused the batch, a selection that verifies with one of
        its columns solved again on its zero set less one row
        (:func:`~spear.core.released.released_kernels`: a small true value of the sample's own
        that its direction, solved to vanish there, cancelled with a trace of another sample);
        the pool keeps its candidates. The audit names the sample whose *column* took the
        trace, not the one whose input carries it (the input is the mixture), so the columns
        tried are those whose zero sets are inconsistent
        (:func:`~spear.core.released.inconsistent_columns`), at most ``MOST_RELEASED_SAMPLES``,
        each with its released kernels, judged as any selection (polished, then audited).
        Every candidate is judged: None where none verifies, or where two that verify are
        different batches (the audit, loose for faint samples, let both through)."""
        s = self.setup
        if not verdict.audit_refused or s.deadline.passed() or selection.indices in self.released_tried:
            return None
        self.released_tried.add(selection.indices)  # a search that meets it again does not retry
        L = s.problem.sparse_factor
        verified: list[tuple[Selection, Verdict]] = []
        for j in inconsistent_columns(L, selection.Qbar, s.tol.zero_rtol, MOST_RELEASED_SAMPLES).tolist():
            kernels, _ = released_kernels(L, selection.Qbar[:, j], s.tol.zero_rtol, deadline=s.deadline)
            for kernel in kernels:  # each signed as the column it replaces
                tried = self._with_column(selection, j, kernel, certified, pinned)
                if tried is not None and tried[1].verified:
                    verified.append(tried)
        if not verified:
            return None
        # as far apart as the audit checks them: the samples' rounding in the data, times its slack
        apart = (AUDIT_SLACK * s.sample_precision(verified[0][0].Qbar)).clamp_min(TIGHTEST_SAMPLE_RTOL)
        if not _one_batch([v.inputs for _, v in verified], apart):
            return None  # two batches the data cannot tell apart: neither is proven
        return verified[0]

    def _with_column(
        self,
        selection: Selection,
        j: int,
        direction: torch.Tensor,
        certified: torch.Tensor,
        pinned: torch.Tensor,
    ) -> tuple[Selection, Verdict] | None:
        """``selection`` with its column ``j`` replaced by the released ``direction`` (b,),
        judged as any selection; None where it is not perfect. The other columns are polished;
        column j is not (its clearly zero rows may hold the released row again, where the
        sample's small value lies near their bound, and give back the mixture), but it is
        audited: it was solved on exactly the rows it claims as zero. Its pool index stays the
        column's it replaces (the pool takes directions this close for one: a mixture 6e-4
        of another sample off differs from it by less than the pool's duplicate angle)."""

        def placed(into: Selection) -> Selection | None:  # column j replaced, scored; None if not perfect
            Qbar = into.Qbar.clone()
            Qbar[:, j] = direction.to(Qbar.dtype) * Qbar[:, j].norm()
            scored, _, _ = self.setup.scored(selection.indices, Qbar)
            return scored if scored is not None and scored.perfect else None

        changed = placed(selection)
        if changed is None:
            return None
        changed, polished = self._polish(changed)
        if bool(polished.solved[j]) and (changed := placed(changed)) is None:
            return None
        solved, fresh = polished.solved.clone(), certified.clone()
        kept = pinned & polished.keeps_pin.to(pinned.device)
        solved[j], kept[j], fresh[j] = True, False, False  # its zero set as read pins the mixture
        verdict = self._judge(changed, fresh, kept, solved)
        return None if verdict is None else (changed, verdict)

    def _sample_rtol(self, directions: torch.Tensor) -> torch.Tensor:
        """(k,) the misfit tolerances of these directions' samples: the setup's per-sample ones
        (:meth:`AttackSetup.sample_rtol`) where the certificate takes them, else the
        verification tolerance, so that loss weights are read at the precision checked."""
        if self.gate.takes_rtol:
            return self.setup.sample_rtol(directions)
        return torch.full((directions.shape[0],), self.setup.tol.verify_rtol, dtype=torch.float64)

    def _certified_as_assembled(
        self, selection: Selection, certified: torch.Tensor, inputs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The peeled columns whose certificate still holds in this selection, and for each
        column the index of its peeled sample (None when nothing was peeled): the column must
        be that sample's direction, and the batch must assemble it into the very sample that
        was certified (to ``verify_rtol``).

        Peeling certifies a sample from its direction alone, but ``Q^-1 R`` assembles every
        sample from all the directions: a direction that is slightly off (a trace of another
        sample's column, within float32's zero band) still peels to its own right sample
        while the batch assembles its partner wrong. Such columns lose the peeled certificate
        and are judged afresh."""
        peeled = self.peeled
        if not len(peeled) or not bool(certified.any()):
            return certified, None
        cos = (peeled.directions @ selection.Qbar).abs()  # (f, b)
        best, index = cos.max(dim=0)
        reference = self.setup.expand_inputs(peeled.inputs)[index].to(inputs)
        gap = (inputs - reference).norm(dim=1)
        same = gap <= self.setup.tol.verify_rtol * reference.norm(dim=1)
        return certified & (best > 1 - 1e-9).to(certified.device) & same.to(certified.device), index

    def _peeled_certificates(
        self, b: int, certified: torch.Tensor, index: torch.Tensor | None
    ) -> SampleCertificates:
        """The model certificates peeling already issued for the certified columns, whose peeled
        samples ``index`` names (see :meth:`_certified_as_assembled`)."""
        known = SampleCertificates.none(b, device=certified.device)
        if index is None or not bool(certified.any()):
            return known
        peeled = self.peeled
        labels, weights = peeled.labels[index], peeled.weights[index]
        ok = certified.to(labels.device) & (labels >= 0)
        known.ok[ok] = True
        known.strong[ok] = peeled.strong[index][ok]
        known.labels[ok] = labels[ok]
        known.weights[ok] = weights[ok].to(known.weights)
        known.misfit[ok] = float("nan")  # issued earlier, not recomputed (the audit re-certifies)
        return known

    # --- the loop ---------------------------------------------------------------------------

    def _check_sparsity(self) -> None:
        """Diagnose a gradient without ReLU sparsity instead of searching until the budget ends,
        and columns too dense for the filter's threshold (trained networks). The probe (ICA+IRLS
        and neuron-guided sampling) runs before any verdict of "dense" but on a noisy gradient:
        at b = 5 the sampler's patience can run out in two calls where each column has ~26 zeros
        among 369 live rows (a deep layer on raw inputs: most neurons dead or active for the
        whole batch)."""
        if len(self.pool):
            self._check_stall()
            return
        s, b = self.setup, self.setup.b
        rows = s.problem.sparse_factor.shape[0]
        # Lemma 5.1's q at a conservative 30% zeros per column (trained networks fall below the
        # paper's 50%, Fig. 7): only a gradient with hardly any zeros exhausts this patience
        patience = NO_SPARSITY_PATIENCE / (b * NO_SPARSITY_ZERO_RATE ** (b - 1))
        exhausted = self.drawn >= patience and rows > 2 * b
        # on a noisy gradient the probe's chance zeros (the noise band) read as sparse: there the
        # spent patience decides alone, as it did before the probe came first
        early = exhausted and not s.split.noisy
        if not self.probed and (self.calls >= PROBE_AFTER_CALLS or early):
            self.probed = True
            probe = probe_sparse_directions(self.search.root, s.tol.zero_rtol, s.tol.zero_floor, None)
            counts, dense = probe.snapped.zero_counts, probe.looks_dense(b, rows)
            self.probe_found_sparse = probe.probed and not dense
            if self.probe_found_sparse and not bool((counts >= s.threshold).any()):
                self._adapt_threshold(adapted_threshold(probe.sparsest, b), probe.sparsest, rows)
            self._absorb(probe.snapped.select(counts >= s.threshold))
            if self._looks_dense(dense) and rows >= DIAGNOSABLE_RATIO * b:
                raise NoSparsityError(self._no_sparsity_message(probed=True))
            return
        if exhausted and self._looks_dense(True):
            raise NoSparsityError(self._no_sparsity_message(probed=self.probed))

    def _no_sparsity_message(self, probed: bool) -> str:
        s = self.setup
        rows = s.problem.sparse_factor.shape[0]
        rank = s.split.numerical_rank
        dead = int((~s.live).sum())  # exact zero rows of dL/dW (output side) for the whole batch
        return no_sparsity_message(s.b, rows, s.options.sparsity, self.calls, rank, probed, dead)

    def _looks_dense(self, evidence: bool) -> bool:
        """Whether the search so far, with ``evidence`` (a probe's, or the patience spent),
        says dL/dZ has no ReLU sparsity: nothing pooled, and no exact direction sparse as a
        ReLU's column seen, neither dropped for the filter's threshold alone (by snapping or by
        the next-layer proposer) nor found by the probe. Such a direction shows the columns are
        sparse, only less than the threshold asks (a trained layer with dead neurons: ~100
        zeros of 407 live rows at b = 5, against a threshold of 163), and the probe lowers the
        threshold instead. On a noisy gradient (DP-SGD) chance zeros inside the noise band can
        pass for such a direction, so there only the evidence counts."""
        sparse_seen = (self.sparse_drop >= 0 or self.probe_found_sparse) and not self.setup.split.noisy
        return evidence and len(self.pool) == 0 and not sparse_seen

    def _check_stall(self) -> None:
        """When no new direction came for ``STALL_CALLS`` calls with fewer than b in hand (for
        ``PROBE_AFTER_CALLS`` when snapping dropped a ReLU-sparse direction for the threshold
        alone since then, or in ``PROBE_AFTER_CALLS`` calls in a row, new directions or not),
        probe the current problem (the residual one, after peeling): if its columns are sparse
        but below the threshold, lower it (the columns found first are the sparsest ones). They
        are when the probe finds nothing above the threshold, or finds robust directions below it
        (no essential zero row: true columns, as mixtures have one; a trained float32 MLP's
        columns straddle the threshold, and those above it are found, the others never). It
        probes once, and again only while each probe lowers the threshold
        (:meth:`_may_probe_again`)."""
        s = self.setup
        trusted = int(self.pool.trusted_mask.sum())
        streak = self.drop_streak >= PROBE_AFTER_CALLS
        if trusted != self.trusted_seen:
            self.trusted_seen, self.last_progress = trusted, self.calls
            if not streak:
                return
        # directions sparser than a dense column's but below the threshold, dropped since the
        # last progress: the evidence the probe looks for may be there, so look soon
        patience = PROBE_AFTER_CALLS if self.sparse_drop > self.last_progress else STALL_CALLS
        waited = self.calls - self.last_progress >= patience
        if not self._may_probe_again() or not self._lacks_directions() or not (waited or streak):
            return
        self.stall_probed_at = self.calls
        self.fruitless_probes += 1  # until it lowers the threshold
        ctx = self.search.ctx
        probe = probe_sparse_directions(ctx, s.tol.zero_rtol, s.tol.zero_floor, self.pool.known_masks)
        if not probe.probed or probe.looks_dense(ctx.batch_size, ctx.rows):
            return
        counts, robust = probe.snapped.zero_counts, probe.snapped.robust
        below = counts < s.threshold
        if bool(below.all()) or (robust is not None and bool((robust & below).any())):
            self._adapt_threshold(adapted_threshold(probe.sparsest, s.b), probe.sparsest, ctx.rows)
        snapped = probe.snapped
        if self.search.basis is not None:
            snapped = lift(snapped, self.search.basis)
        self._absorb(snapped.select(snapped.zero_counts >= s.threshold))

    @property
    def adapted(self) -> bool:
        """Whether a stall probe ran or the threshold was lowered (by any probe)."""
        return self.stall_probed_at >= 0 or self.lowered_at is not None

    def _may_probe_again(self) -> bool:
        """Whether a stall probe may run: the first, or one ``STALL_CALLS`` calls after the
        last lowering of the threshold, where the last probe lowered it. A probe that comes
        early (the streak of drops) sees the sparsest columns, and half of the sparsest can
        still lie above the zeros of the densest ones, which a later probe on the residual
        problem sees. Each probe that lowers it lowers it further, to ``b + ADAPTED_SPARE`` at
        least, so the probes are few.

        A probe that lowered nothing may be followed by another only while the search's own
        calls keep dropping ReLU-sparse directions for the threshold alone (a streak of
        ``PROBE_AFTER_CALLS``), ``STALL_CALLS`` calls after it, and twice as long after each
        further such probe (so at most log2 of the calls). One probe's calls can miss the
        columns the search keeps dropping: MNIST 6 x 500 trained 200 steps, float64, layer 2,
        b = 64, seed 4 found nothing sparser than 61 zeros at call 3 on the residual problem, and
        the search then dropped sparse directions at nearly every call for the rest of its 30 s
        (850k proposals, 11 samples); a probe at call 23 finds a robust column with 180 zeros
        under the threshold of 190, and the batch is whole in 5 s."""
        if not self.adapted:
            return True
        lowered = self.lowered_at
        if lowered is not None and lowered >= self.stall_probed_at:
            return self.calls - lowered >= STALL_CALLS
        patience = STALL_CALLS << max(0, self.fruitless_probes - 1)
        return self.drop_streak >= PROBE_AFTER_CALLS and self.calls - self.stall_probed_at >= patience

    def _lacks_directions(self) -> bool:
        """Whether the problem searched now has fewer directions in hand than samples: the pool
        on the whole layer; on a residual problem its own (trusted, unpeeled) directions. The
        pool's size alone would not do there: mixtures and the peeled samples' directions fill
        it past b while the last samples' columns, the densest, are all below the threshold
        (a trained float32 MLP, b = 64: 62 peeled, 67 in the pool, the last two columns with
        198 zeros under a threshold of 202, and no probe for the rest of the budget). On the
        whole layer, the pool's candidates that peeling has not refuted: a trained float64
        hidden layer (Fashion-MNIST, b = 32) held 67, 64 of them refuted, while half its columns
        (162-186 zeros) lay under the threshold of 187, and searched 1.1M proposals for nothing."""
        ctx = self.search.ctx
        if self.search.basis is None:
            return int((~self.pool.refuted).sum()) < self.setup.b
        return (0 if ctx.found is None else int(ctx.found.shape[0])) < ctx.batch_size

    def _adapt_threshold(self, threshold: int, sparsest: int, rows: int) -> None:
        """Lower the sparsity filter's threshold for columns sparser than Section 4.1 assumes
        (:func:`~spear.core.diagnosis.adapted_threshold`)."""
        if threshold >= self.setup.threshold:
            return
        self.lowered_at = self.calls
        self.fruitless_probes = 0
        mode = self.setup.options.sparsity
        note = below_threshold_note(sparsest, rows, self.first_threshold, threshold, mode)
        self.notes = [n for n in self.notes if not n.startswith(BELOW_THRESHOLD_NOTE_START)] + [note]
        self.setup.threshold = threshold
        self.search.root.threshold_count = threshold
        self.search.ctx.threshold_count = threshold

    def _progress(self) -> None:
        if self.setup.options.progress is None:
            return
        best = self.best
        self.setup.options.progress(
            ProgressEvent(
                proposals=self.drawn,
                max_proposals=self.setup.budget,
                candidates=len(self.pool),
                consistent_directions=best.consistent_columns if best else 0,
                batch_size=self.setup.b,
                sigma=best.sigma if best else None,
                seconds=self.setup.elapsed,
                certified=len(self.peeled),
            )
        )

    def _settled(self) -> bool:
        """Whether the best selection ends the search: sigma = 1 (verified or not: no swap can
        raise it; but not unverified while input-side peeling has samples left, whose search can
        still bring their true columns), or its shortfall explained (:meth:`_explain_silent`)
        and the batch verified (an unverified one may yet give way to a selection of sigma = 1)."""
        best = self.best
        if best is None or not best.perfect:
            return False
        verified = self.verdict is not None and self.verdict.verified
        if not verified and self._peeling_on_input_side():
            # input-side peeling certifies samples one by one; a float32 selection with mixtures
            # inside the zero band can reach sigma = 1 while samples are left: search on
            return False
        return best.sigma >= 1.0 or verified

    def _peeling_on_input_side(self) -> bool:
        """Whether input-side peeling (the model certificate) runs and has samples left."""
        peeler = self.peeler
        return isinstance(peeler, InputSidePeeler) and len(self.peeled) < self.setup.b

    def _accepted_outside(self) -> bool:
        """Whether ``stop_when`` accepts a new best selection that is not perfect."""
        check = self.setup.options.stop_when
        best = self.best
        if check is None or best is None or self._settled() or best is self._offered:
            return False
        self._offered = best
        (inputs, grad_outputs), _ = self.setup.assemble_and_check(best)
        return bool(check(inputs, grad_outputs))

    def run(self) -> Reconstruction:
        opts = self.setup.options
        reason = "budget"
        try:
            self._scan_singletons()
            while self.drawn < self.setup.budget:
                if opts.time_budget is not None and self.setup.elapsed >= opts.time_budget:
                    reason = "time budget"
                    break
                batch = self.step()
                self._progress()
                if self._settled() and opts.early_stop:
                    reason = "sigma=1" if self.best.sigma >= 1.0 else "explained"
                    break
                if self._accepted_outside():
                    reason = "accepted"
                    break
                if batch.exhausted:
                    reason = "exhausted"
                    break
                self._check_sparsity()
            if reason != "accepted":  # the selection stop_when accepted is the result
                self._run_deferred_swaps()
        except KeyboardInterrupt:
            reason = "interrupted"
        return finish(self.setup, self.best, self.verdict, self.gate, self.peeled, self, reason)


def finish(
    setup: AttackSetup,
    selection: Selection | None,
    verdict: Verdict | None,
    gate: ModelGate,
    peeled: PeeledSamples,
    attack: _Attack | None,
    reason: str,
) -> Reconstruction:
    """The :class:`Reconstruction` of the best selection (or of what was certified so far)."""
    b, opts = setup.b, setup.options
    rows = setup.problem.sparse_factor.shape[0]
    certified_inputs, certified_labels, certified_weights, certified_precision = _certified_samples(
        setup, peeled, verdict, selection
    )
    stats = AttackStats(
        proposals=0 if attack is None else attack.drawn,
        candidates=1 if attack is None else len(attack.pool),
        seconds=setup.elapsed,
        seed=opts.seed,
        proposer="none" if attack is None else attack.proposer.name,
        stop_reason=reason,
        threshold_count=setup.threshold,
        tau=setup.threshold / rows,
        certified=0 if certified_inputs is None else int(certified_inputs.shape[0]),
        dead_neurons=int((~setup.live).sum()),
        certificate_seconds=gate.seconds,
    )
    faint = None
    if (verdict is None or not verdict.verified) and not setup.split.noisy:
        eps = torch.finfo(setup.source_dtype).eps
        faint = faint_batch_note(setup.split.singular_values, b, eps, setup.tol.verify_rtol)
    forced = None
    if attack is not None and (verdict is None or not verdict.verified):
        forced = forced_zeros_note(attack.pool.zero_counts, b, rows, opts.sparsity, attack.drawn)
    notes = tuple(
        ([] if attack is None else attack.notes)
        + ([] if gate.note is None else [gate.note])
        + ([] if verdict is None else verdict.notes)
        + ([] if faint is None else [faint])
        + ([] if forced is None else [forced])
    )
    common = {
        "batch_size": b,
        "singular_values": setup.split.singular_values,
        "stats": stats,
        "mode": opts.sparsity,
        "certified_inputs": certified_inputs,
        "certified_labels": certified_labels,
        "certified_weights": certified_weights,
        "certified_precision": certified_precision,
        "notes": notes,
    }
    peeled_note = f"; {len(peeled)} sample(s) recovered and certified one by one" if len(peeled) else ""
    more_budget = "a larger budget may not help (notes)" if faint else "raise max_proposals or time_budget"
    drawn = stats.proposals
    if selection is None:
        return Reconstruction.not_recovered(
            f"not recovered: {stats.candidates} exact candidate direction(s) found, "
            f"{_short_of_a_basis(stats.candidates, b)} ({reason} after {drawn:,} proposals)"
            f"{peeled_note}; {more_budget}",
            **common,
        )
    if verdict is None:  # not perfect: the recomputation says how far it is
        (inputs, grad_outputs), check = setup.assemble_and_check(selection)
        message = (
            f"unverified: best selection has sigma={selection.sigma:.4f}, "
            f"{selection.consistent_columns}/{b} directions consistent, residual "
            f"{check.residual:.1e} ({reason} after {drawn:,} proposals){peeled_note}"
        )
        return Reconstruction(
            inputs=inputs,
            grad_outputs=grad_outputs,
            sigma=selection.sigma,
            verified=False,
            residual=check.residual,
            consistent_directions=selection.consistent_columns,
            directions=selection.Qbar,
            scales=selection.scales,
            message=message,
            **common,
        )
    if verdict.consistent:
        message = verdict_message(verdict, b)
        if not verdict.verified and gate.certifier is None and verdict.determinacy.groups:
            message += "; attack_layer with the model can certify samples one by one"
    elif verdict.check.uncovered:
        message = (
            f"unverified: sigma={selection.sigma:.4f} and residual {verdict.check.residual:.1e}, but "
            f"{verdict.check.uncovered} neuron(s) with a nonzero row of dL/dW are inactive for every "
            f"sample of this batch of {b}: the client's batch holds more samples, whose gradients "
            f"lie below the others' rounding ({reason} after {drawn:,} proposals){peeled_note}"
        )
    else:
        message = (
            f"unverified: sigma={selection.sigma:.4f} but the recomputed gradients differ (residual "
            f"{verdict.check.residual:.1e} > {setup.tol.verify_rtol:g}; {reason} after {drawn:,} "
            f"proposals){peeled_note}"
        )
    return Reconstruction(
        inputs=verdict.inputs,
        grad_outputs=verdict.grad_outputs,
        sigma=selection.sigma,
        verified=verdict.verified,
        residual=verdict.check.residual,
        consistent_directions=selection.consistent_columns,
        directions=selection.Qbar,
        scales=selection.scales,
        message=message,
        # how precisely the data give each sample says nothing of a batch not proven right
        input_precision=setup.sample_precision(selection.Qbar) if verdict.verified else None,
        labels=verdict.labels,
        multiplicities=verdict.reduction.multiplicities,
        reduction=verdict.reduction.reduction,
        client_batch_size=verdict.reduction.batch_size,
        missing_samples=verdict.reduction.missing,
        client_sizes=verdict.reduction.client_sizes,
        verified_by=verdict.verified_by,
        consistent=verdict.consistent,
        ambiguous=verdict.determinacy.groups,
        **common,
    )


def _certified_samples(
    setup: AttackSetup, peeled: PeeledSamples, verdict: Verdict | None, selection: Selection | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The samples certified one by one: those peeled, and, in a consistent batch the model does
    not verify as a whole, its columns the model certifies on their own
    (:func:`spear.core.verdict.individually_certified`); with their labels (-1 where unknown)
    and loss weights (NaN where unknown), both None when no label is known, and their
    precision in the data (:meth:`AttackSetup.sample_precision` of the consistent batch whose
    value they report; NaN for a peeled sample that reports its own, read off rows of the
    gradient: no consistent batch, or one that assembles its direction otherwise)."""
    inputs, labels, weights = setup.expand_inputs(peeled.inputs), peeled.labels, peeled.weights
    extra = None if verdict is None or verdict.verified else verdict.individual
    if extra is not None and selection is not None and len(peeled):
        # a peeled sample whose assembled column lost its certificate (or was polished, turning
        # by up to MAX_TURN) must not come twice
        q = selection.Qbar.T / selection.Qbar.T.norm(dim=1, keepdim=True)
        same = (q @ peeled.directions.T.to(q)).abs().amax(dim=1) > 1.0 - MAX_TURN**2
        extra = extra & ~same.to(extra.device)
    precision = torch.full((len(peeled),), torch.nan, dtype=torch.float64)
    consistent = verdict is not None and verdict.consistent and selection is not None
    if consistent and (len(peeled) or (extra is not None and bool(extra.any()))):
        assert verdict is not None and selection is not None
        batch_precision = setup.sample_precision(selection.Qbar)
        if len(peeled):
            inputs, labels, weights, precision = _peeled_in_batch(
                setup, peeled, inputs, verdict, selection, batch_precision
            )
        if extra is not None and bool(extra.any()):  # a consistent batch's own certificates
            assert verdict.certificates is not None
            extra = extra.to(verdict.inputs.device)
            inputs = torch.cat([inputs, verdict.inputs[extra].to(inputs)])
            labels = torch.cat([labels, verdict.certificates.labels.to(extra.device)[extra].to(labels)])
            weights = torch.cat([weights, verdict.certificates.weights.to(extra.device)[extra].to(weights)])
            precision = torch.cat([precision, batch_precision[extra.cpu()]])
    if setup.options.clients == 1:  # one client: every single sample has the same weight
        single = ~stands_for_several(weights)
        inputs, labels = inputs[single.to(inputs.device)], labels[single.to(labels.device)]
        weights, precision = weights[single.to(weights.device)], precision[single.to(precision.device)]
    if inputs.shape[0] == 0:
        return None, None, None, None
    precision = precision.to(inputs.device)
    if not bool((labels >= 0).any()):
        return inputs, None, None, precision
    return inputs, labels, weights, precision


#: a loss weight within this (relative) of k >= 2 times the median stands for k samples
MULTIPLE_RTOL = 0.05


def stands_for_several(weights: torch.Tensor) -> torch.Tensor:
    """(f,) which certified samples carry an integer multiple k >= 2 of the median loss weight
    (NaN: unknown, kept). The median, not the smallest: one faint sample's imprecise weight
    must not make every other sample look merged. With one client every sample's weight is 1/B
    (a mean) or 1 (a sum), so such a column stands for k samples whose gradients coincide at
    the data's precision: near duplicates (float32 digits, b = 13, three same-class pairs 2e-3
    apart: each pair came back as one sample of weight 2/B, its input the pair's mean, 1e-3 off
    either twin, and was certified with a precision of 3e-6, the mean's). The layers certify
    that column, but it is no sample, and only the mean is determined: it stays in ``inputs``,
    not among the certified."""
    w = weights.detach().double().cpu()
    known = torch.isfinite(w) & (w > 0)
    several = torch.zeros(w.shape, dtype=torch.bool)
    if int(known.sum()) < 2:
        return several
    ratio = w / w[known].median()
    k = ratio.round()
    return known & (k >= 2) & ((ratio - k).abs() <= MULTIPLE_RTOL * k)


def _peeled_in_batch(
    setup: AttackSetup,
    peeled: PeeledSamples,
    inputs: torch.Tensor,
    verdict: Verdict,
    selection: Selection,
    batch_precision: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The peeled samples (their ``inputs`` expanded to the layer's width) as the consistent
    batch of ``selection`` reports them (:func:`_as_assembled`): inputs (f', n), labels, loss
    weights and precision (NaN for one the batch does not hold). A verified batch's labels and
    weights replace the peeled ones with its inputs; two peeled samples assembled into one
    column count once; and a sample peeled into a column the precision audit named
    (``Verdict.audit_named``) is dropped: the audit proves that column wrong at the data's
    precision, a mixture or the bearer of its trace (the review's float32 batches, unverified,
    kept a peeled mixture 1.6e-3 off as certified). Only where it names at most
    ``MOST_NAMED_SHARE`` of the batch: a mixture names a pair, while a client that computed in
    less than its gradient's entries show (TF32) has every sample miss, and then the audit
    proves no column wrong (dropping them cost a review's 96 float16 clients 433 of 1,062
    correct certified samples)."""
    inputs, held, column = _as_assembled(setup, peeled, verdict, selection, inputs)
    held, column = held.cpu(), column.cpu()
    labels, weights = peeled.labels.clone(), peeled.weights.clone()
    if verdict.verified and verdict.certificates is not None:
        cert = verdict.certificates
        labels[held.to(labels.device)] = cert.labels[column[held].to(cert.labels.device)].to(labels)
        weights[held.to(weights.device)] = cert.weights[column[held].to(cert.weights.device)].to(weights)
    precision = torch.full((len(peeled),), torch.nan, dtype=torch.float64)
    precision[held] = batch_precision[column[held]]
    named = verdict.audit_named
    few = len(named) <= MOST_NAMED_SHARE * selection.Qbar.shape[1]
    refused = torch.tensor(named if few else [], dtype=torch.long)
    once = ~(held & (_repeated(column) | torch.isin(column, refused)))
    inputs, precision = inputs[once.to(inputs.device)], precision[once]
    return inputs, labels[once.to(labels.device)], weights[once.to(weights.device)], precision


def _one_batch(batches: list[torch.Tensor], rtol: torch.Tensor) -> bool:
    """Whether these batches of inputs (each b x n, columns in one order) are one: every
    sample within ``rtol`` (b,) of its counterpart in the first, relative to its norm."""
    first = batches[0]
    bound = rtol.to(first) * first.norm(dim=1)
    return all(bool(((other.to(first) - first).norm(dim=1) <= bound).all()) for other in batches[1:])


def _repeated(column: torch.Tensor) -> torch.Tensor:
    """(f,) which entries of ``column`` repeat an earlier one."""
    earlier = column[:, None] == column[None, :]
    return torch.tril(earlier, diagonal=-1).any(dim=1)


def _as_assembled(
    setup: AttackSetup, peeled: PeeledSamples, verdict: Verdict, selection: Selection, inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The peeled samples' ``inputs`` (f, n), each replaced by the consistent batch's sample
    where the batch assembles its direction into that same sample (to ``verify_rtol``, the
    rule of :meth:`_Attack._certified_as_assembled`); which were replaced (f,), and each one's
    nearest column of the batch (f,). Solved from all b directions at once, the batch's value
    is the one ``inputs`` reports, and it is the more precise: the cascade reads a sample off
    rows of the gradient (Fashion-MNIST b = 32 with two faint samples: 9.6e-12 off the truth,
    the batch's 1.4e-13). A verified batch replaces every peeled sample by its nearest column:
    it is proven at the data's precision, where a sample peeled at the dtype's tolerance may be
    a mixture the batch's audit refused (:mod:`spear.core.released`: a peeled float32 sample
    1.6e-3 off, the batch's 7.5e-8)."""
    q = selection.Qbar.T / selection.Qbar.T.norm(dim=1, keepdim=True)
    best, column = (peeled.directions.to(q) @ q.T).abs().max(dim=1)  # (f,)
    assembled = verdict.inputs[column.to(verdict.inputs.device)].to(inputs)
    gap = (assembled - inputs).norm(dim=1)
    same = (best > 1.0 - 1e-9).to(gap.device) & (gap <= setup.tol.verify_rtol * inputs.norm(dim=1))
    same |= verdict.verified
    return torch.where(same.unsqueeze(-1), assembled, inputs), same, column


def _single_sample(setup: AttackSetup, gate: ModelGate) -> Reconstruction:
    """b = 1: Q is 1 x 1, Theorem 3.6 alone gives the scale."""
    factor = setup.problem.sparse_factor
    Qbar = torch.ones(1, 1, dtype=factor.dtype, device=factor.device)
    values = (factor @ Qbar).T
    mask = zero_mask(values, setup.tol.zero_rtol)[None]
    certain = zero_mask(values, setup.tol.zero_floor)[None]
    sigma, valid, c, consistent = score(setup.problem, Qbar[None], mask, certain, setup.tol.z_rtol)
    if not bool(valid[0]):
        return finish(setup, None, None, gate, _no_peeled(setup), None, "trivial")
    selection = Selection((0,), Qbar, c[0], float(sigma[0]), int(consistent[0]))
    verdict = None
    if selection.perfect:
        assembled, check = setup.assemble_and_check(selection)
        certified = torch.zeros(1, dtype=torch.bool, device=factor.device)
        output_side = setup.options.sparsity == "output"
        verdict = judge(
            selection,
            factor,
            certified,
            assembled,
            check,
            setup.tol,
            gate,
            setup.resolvable,
            output_side=output_side,
        )
    return finish(setup, selection, verdict, gate, _no_peeled(setup), None, "trivial")


def _cut_in_setup(shape: tuple[int, ...], options: AttackOptions, start: float) -> Reconstruction:
    """The result of an attack whose time budget ran out in its setup (the SVD of dL/dW and the
    problem built on it, :meth:`AttackSetup.build`): the batch size is not read yet."""
    seconds = time.perf_counter() - start
    stats = AttackStats(
        proposals=0,
        candidates=0,
        seconds=seconds,
        seed=options.seed,
        proposer="none",
        stop_reason="time budget",
        threshold_count=0,
        tau=0.0,
    )
    message = (
        f"not recovered: the time budget ({options.time_budget:g} s) ran out in the attack's setup (the "
        f"SVD of the {shape[0]} x {shape[1]} gradient, which cannot be cut), before the batch size was "
        "read or any direction searched; give a larger time_budget"
    )
    return Reconstruction.not_recovered(
        message,
        batch_size=None,
        singular_values=torch.empty(0, dtype=torch.float64),
        stats=stats,
        mode=options.sparsity,
        notes=("the setup's SVD goes on in the background until it ends; its result is dropped",),
    )


def _short_of_a_basis(found: int, b: int) -> str:
    """Why ``found`` candidates gave no selection: too few, or (copies, mixtures of few samples)
    no ``b`` of them independent and well scaled (:func:`spear.core.greedy.greedy_filter`)."""
    if found < b:
        return f"fewer than the b={b} independent ones needed"
    return (
        f"but no b={b} of them form an independent, well-scaled selection (e.g. copies of fewer "
        "samples, or candidates the model refuted)"
    )


def _singleton_peelers(setup: AttackSetup, certifier: SampleCertifier | None) -> dict[bool, InputSidePeeler]:
    """The LT cascade's peelers (self-pinning candidates' and dense ones'), keyed by ``pin``."""
    tol, problem = setup.tol, as_input_problem(setup.problem)
    columns = setup.column_model(certifier)
    return {
        pin: InputSidePeeler(
            problem,
            tol.verify_rtol,
            tol.z_rtol,
            tol.zero_rtol,
            pin,
            predict_columns=columns,
            rounding=setup.measured_rounding,
            snap=True,
        )
        for pin in (True, False)
    }


def _no_peeled(setup: AttackSetup) -> PeeledSamples:
    factor = setup.problem.sparse_factor
    return PeeledSamples.empty(setup.b, setup.problem.R.shape[1], factor.dtype, factor.device)


def run_attack(
    weight: torch.Tensor,
    bias: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor,
    options: AttackOptions,
    source_dtype: torch.dtype,
    next_grad_weight: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
    certifier: SampleCertifier | None = None,
    start: float | None = None,
) -> Reconstruction:
    """Run SPEAR on validated float tensors (all in ``options.dtype`` on ``options.device``).

    ``next_grad_weight`` (the next linear layer's dL/dW', optional) feeds the next-layer
    proposer and peeling; ``next_weight`` (its W', optional) peeling's residual next-layer
    gradient; ``certifier`` (optional) checks samples one by one through the rest of the model
    (:mod:`spear.core.certificate`); ``start`` when the time budget began (now by default)."""
    layer = LayerTensors(weight, bias, grad_weight, grad_bias)
    start = time.perf_counter() if start is None else start
    try:  # the gradient's SVD cannot be cut: the budget ends the wait for it
        setup = finish_by(
            Deadline.after(options.time_budget, start),
            lambda: AttackSetup.build(layer, options, source_dtype, next_grad_weight, next_weight, start),
        )
    except LateError:
        return _cut_in_setup(tuple(grad_weight.shape), options, start)
    if setup.b == 1:
        return _single_sample(setup, ModelGate(certifier))
    return _Attack(setup, certifier).run()


__all__ = [
    "AttackOptions",
    "AttackStats",
    "ProgressEvent",
    "Reconstruction",
    "default_max_proposals",
    "run_attack",
]
