"""Is the gradient ReLU-sparse at all? A short probe instead of an endless search.

Without a ReLU on the sparse side (a layer followed by tanh, say) no direction ``q`` gives
``L q`` more than ``b - 1`` zeros, and the exponential sampler would search until its budget
ends. The probe asks the proposers that find sparse directions fastest where SPEAR can work at
all: ICA + IRLS (small batches), neuron-guided sampling (large ones, output sparsity) and vertex
descent (nonnegative inputs, input sparsity), one call each, snapped exactly. On a ReLU layer
that the attack can recover, one of them finds candidates at once (their directions join the
pool); on a dense one none can. The probe only runs once the attack's own proposers found
nothing, and it is not trusted where the layer is too narrow for its batch
(``rows < DIAGNOSABLE_RATIO * b``): there the attack just goes on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spear import theory
from spear.core.filtering import SnapResult, snap_and_filter
from spear.core.proposers.base import DirectionProposer, ProposalContext, relu_sparse
from spear.core.proposers.neurons import NeuronGuidedSampler
from spear.core.proposers.sparse_recovery import SparseRecoveryProposer
from spear.core.proposers.vertices import VertexProposer
from spear.core.proposers.vertices import applicable as vertices_apply

#: proposer calls that found nothing before the probe runs
PROBE_AFTER_CALLS = 3
#: IRLS finds sparse directions from random starts only in small batches (measured: at b <= 20
#: on MNIST-like data; none at b >= 50, m = 200): beyond this it is left out of the probe
IRLS_PROBE_MAX_BATCH = 32
#: with input sparsity a fruitless IRLS call proves little beyond small batches (a ReLU-sparse
#: hidden layer of width 200 gave it nothing at b = 32): above this only vertex descent probes,
#: where the inputs are nonnegative; with signed inputs the probe then draws no conclusion and
#: the search runs to its budget
INPUT_PROBE_MAX_BATCH = 16
#: an adapted threshold (``adapted_threshold``) is this fraction of the sparsest direction's
#: zeros, and at least b + ADAPTED_SPARE
ADAPTED_FRACTION = 0.5
ADAPTED_SPARE = 8
#: the probe's verdict counts only for layers at least this many times wider than the batch
DIAGNOSABLE_RATIO = 4
#: the hints of one neuron-guided call (512 neurons, 3 zero sets each) ...
PROBE_FULL_CALL = 1536
#: ... and the work's worth of them that one call of the probe snaps at most, at about b^3 each
#: (an SVD of the b - 1 zero rows): all 1,536 up to b = 256, 192 at b = 512. All 1,536 at
#: b = 512 took a whole 240 s budget (MNIST in the LT setting, seed 1, whose first three calls
#: found nothing), a run without a time budget as long
PROBE_SNAP_WORK = PROBE_FULL_CALL * 256**3


def probe_hints(b: int) -> int:
    """The most hints one call of the probe snaps (:data:`PROBE_SNAP_WORK`). Fewer than a full
    call's: its finding nothing sparse is no evidence of a dense layer (the probe concludes
    that only from complete calls)."""
    return max(1, PROBE_SNAP_WORK // b**3)


@dataclass
class ProbeResult:
    """What the probe found.

    Attributes:
        snapped: every exact direction the probe found with more than ``b - 1`` zeros, the
            sparsity filter's threshold aside.
        sparsest: the most exact zeros any probed direction has: a dense gradient gives
            ``b - 1`` (the rows a direction is solved on), a ReLU-sparse one far more, even where
            its columns are too dense for the filter's threshold (trained networks).
    """

    snapped: SnapResult
    sparsest: int
    probed: bool = True  # False when no proposer suits this batch or the deadline cut it short

    def looks_dense(self, b: int, rows: int) -> bool:
        if not self.probed:
            return False
        return not relu_sparse(self.sparsest, b, rows)


def probe_sparse_directions(
    ctx: ProposalContext, zero_rtol: float, zero_floor: float, known: torch.Tensor | None
) -> ProbeResult:
    """Exact directions from one IRLS, one neuron-guided and one vertex-descent call, as they
    apply (see the module doc). Past ``ctx.deadline`` it stops between and within them, and its
    result is not ``probed``. Vertex descent shows sparsity where it finds it, but finding none
    proves nothing (signed inputs have no vertex; a descent can end on vertices that are not
    samples): where it was the only call and found nothing ReLU-sparse, nothing is concluded
    and the search goes on, as it did before it was a probe."""
    calls: list[DirectionProposer] = []
    output_side = ctx.problem is None or ctx.problem.mode == "output"
    if ctx.batch_size <= (IRLS_PROBE_MAX_BATCH if output_side else INPUT_PROBE_MAX_BATCH):
        calls.append(SparseRecoveryProposer(starts_per_call=16, ica_restarts=1))
    if ctx.problem is not None and ctx.problem.mode == "output":
        calls.append(NeuronGuidedSampler())
    if vertices_apply(ctx):
        calls.append(VertexProposer(starts_per_call=16))
    found: list[SnapResult] = []
    sparsest = 0
    conclusive = False  # a call whose failure to find sparse directions means a dense layer
    limit = probe_hints(ctx.batch_size)
    for proposer in calls:
        if ctx.deadline.passed():
            break
        batch = proposer.propose(ctx, limit)
        # a call cut to fewer hints than it has, or vertex descent, finding nothing proves nothing
        conclusive |= not isinstance(proposer, VertexProposer) and limit >= PROBE_FULL_CALL
        # every direction the hints define, whatever its sparsity: the filter comes after
        loose = snap_and_filter(
            ctx.L,
            batch.directions,
            batch.zero_hint,
            ctx.batch_size - 1,
            zero_rtol,
            known_masks=known,
            zero_floor=zero_floor,
            deadline=ctx.deadline,  # one SVD per hint: tens of seconds at m = 1000, b = 256
        )
        if loose.zero_counts.numel():
            sparsest = max(sparsest, int(loose.zero_counts.max()))
        found.append(loose)
    # a probe the time budget cut short keeps the exact directions it finished, but its
    # evidence is incomplete: it concludes nothing (not "dense", not "too sparse for tau")
    complete = (conclusive or relu_sparse(sparsest, ctx.batch_size, ctx.rows)) and not ctx.deadline.passed()
    if not found:
        nothing = ctx.L.new_empty(0, ctx.batch_size)
        empty = snap_and_filter(ctx.L, nothing, None, ctx.threshold_count, zero_rtol)
        return ProbeResult(empty, 0, probed=complete)
    return ProbeResult(SnapResult.concat(found), sparsest, probed=complete)


#: a "dense" output gradient with at least this many, and DEAD_ROWS_FRACTION of its rows, exactly
#: zero for the whole batch has a ReLU after it: its samples share one activation pattern
DEAD_ROWS_MIN = 2
DEAD_ROWS_FRACTION = 0.05


def no_sparsity_message(
    b: int,
    rows: int,
    mode: str,
    calls: int,
    rank: int | None = None,
    probed: bool = True,
    dead: int = 0,
) -> str:
    """``rank``: the gradient's numerical rank when the user forced another batch size;
    ``probed``: whether the sparsity probe ran (not on a noisy gradient whose sampler's
    patience ran out first); ``dead``: the neurons (output side) whose gradient row is exactly
    zero for the whole batch. Many such rows show a ReLU does follow the layer (a Tanh or a
    noised gradient leaves none): then the live neurons are active for nearly every sample,
    the samples share one activation pattern, and the message says that instead of asking
    whether a ReLU follows."""
    side = "output gradient dL/dZ" if mode == "output" else "input X"
    where = "followed" if mode == "output" else "preceded"
    forced = (
        f" Note: batch_size={b} was given but the gradient's numerical rank is {rank}; a wrong batch "
        "size destroys the sparsity as well."
        if rank is not None and rank != b
        else ""
    )
    second = "neuron-guided sampling" if mode == "output" else "vertex descent"
    probe = f" and a probe by ICA+IRLS and {second}"
    found = (
        f"no ReLU-sparse direction: {calls} proposer calls{probe if probed else ''} found no "
        f"direction with the sparsity a ReLU gives (b={b}, {rows} rows)"
    )
    if mode == "output" and dead >= max(DEAD_ROWS_MIN, DEAD_ROWS_FRACTION * (rows + dead)):
        return (
            f"{found}. A ReLU does follow the layer ({dead} of {rows + dead} neurons are zero for the "
            "whole batch), but the live ones are active for nearly every sample: the samples share one "
            "activation pattern, and this layer's gradient does not separate them (information, not "
            "search). Unnormalized inputs do this: a feature of large magnitude decides the sign of "
            f"every neuron (raw UCI Adult's fnlwgt, ~1e5, does). A deeper layer may separate them.{forced}"
        )
    return (
        f"{found}: the {side} is dense. Is the layer {where} by a ReLU? Otherwise try "
        f"sparsity='input'/'output', or check the gradient was not noised.{forced}"
    )


def forced_zeros_note(zero_counts: torch.Tensor, b: int, rows: int, mode: str, drawn: int) -> str | None:
    """For an unverified run: when every candidate has exactly the ``b - 1`` exact zeros its
    proposal chose, the search saw no sparsity it did not force. The sparsity probe raises
    :class:`~spear.errors.NoSparsityError` only for layers ``DIAGNOSABLE_RATIO`` times wider than
    the batch, where the threshold keeps such candidates out; on narrower ones they pass it and
    the run goes on to its budget (a dense m = 30, b = 10 gradient: 1e6 proposals). A ReLU's
    column has about half its rows zero, so this says what the run could not decide; only after
    ``drawn`` proposals reach Lemma 5.2's expected count (a ReLU layer's columns come by then,
    while a run cut short can hold mixtures alone, each with b - 1 zeros)."""
    # exactly b - 1 each: columns pinned by a known head can have fewer zeros than b - 1, but
    # not all exactly that many
    if zero_counts.numel() == 0 or not bool((zero_counts == b - 1).all()):
        return None
    if drawn < theory.expected_proposals(b):
        return None
    side, where = ("output gradient dL/dZ", "followed") if mode == "output" else ("input X", "preceded")
    return (
        f"every candidate direction ({zero_counts.numel()}) vanishes only on the b - 1 = {b - 1} rows its "
        f"proposal chose, of {rows}: the {side} shows no sparsity the search did not force (a ReLU's "
        f"column has about half its rows zero). Is the layer {where} by a ReLU, and was the gradient "
        "not noised?"
    )


def adapted_threshold(sparsest: int, b: int) -> int:
    """The sparsity filter's threshold for columns sparser than Section 4.1 assumes: half the
    zeros of the sparsest direction found, at least ``b + ADAPTED_SPARE``. The threshold only
    bounds false rejections and the pool's size: mixtures are rejected by robustness (an
    essential zero row) and the certificates, at any threshold."""
    return max(b + ADAPTED_SPARE, math.floor(ADAPTED_FRACTION * sparsest))


#: how the note of a lowered threshold begins (a later lowering replaces it)
BELOW_THRESHOLD_NOTE_START = "ReLU-sparse directions were found below the filter's threshold"


def below_threshold_note(sparsest: int, rows: int, threshold: int, adapted: int, mode: str = "output") -> str:
    """Why the filter's threshold was lowered (``mode``: the sparsity side searched)."""
    side = "columns of dL/dZ" if mode == "output" else "inputs"
    return (
        f"{BELOW_THRESHOLD_NOTE_START} tau*m = {threshold} (the "
        f"sparsest has {sparsest} exact zeros of {rows}, {sparsest / rows:.0%}): the {side} are less "
        f"sparse than Section 4.1 assumes (a trained network?), so the threshold was lowered to {adapted}"
    )


def faint_batch_note(singular_values: torch.Tensor, b: int, eps: float, verify_rtol: float) -> str | None:
    """Why more budget may not verify a batch: its weakest sample lies near the gradient's
    rounding. The first-order estimate of that sample's relative rounding, ``eps s_1 / s_b``
    (:func:`spear.core.consistency.rounding_map`), is above ``verify_rtol``; None otherwise.
    The estimate is pessimistic (a float32 layer 2 trained 1000 steps, estimate 5.9e-3: a batch
    within 4.5e-5 came back, unverified), hence "may". On the realism matrix's float32 cells
    (seeds 0-2) it separates: every verified batch has an estimate of 1.8e-4 or less, every
    batch not verified whatever the budget (the trained CNN head, 1000 training steps) 1.3e-3
    or more."""
    S = singular_values
    if b < 1 or b > S.numel() or float(S[b - 1]) <= 0.0:
        return None
    ratio = float(S[b - 1] / S[0])
    estimate = eps / ratio
    if estimate <= verify_rtol:
        return None
    known = "not at all" if estimate >= 1.0 else f"only to about {estimate:.0e} of its size"
    return (
        f"the batch's weakest sample lies near the gradient's rounding (s_{b} / s_1 = {ratio:.1e}, "
        f"{ratio / eps:.3g} times the source precision's eps): its input may be determined {known}, "
        f"where verify_rtol is {verify_rtol:g} (well-classified samples of a trained network send such "
        "faint gradients), so a larger budget may not verify the batch; the samples certified one by "
        "one stand"
    )
