"""Where the proposers search: the whole layer, or the residual problem of the samples that
peeling has not recovered yet (:mod:`spear.core.peeling`, step 4)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from spear.core.anchor import drifted_off_zeros, reanchor
from spear.core.consistency import Tolerances
from spear.core.filtering import (
    CandidatePool,
    SnapResult,
    canonical_sign,
    kernel_of_rows,
    snap_and_filter,
    take_pinned,
)
from spear.core.peeling import PeeledSamples, residual_problem
from spear.core.proposers import DirectionProposer, ProposalBatch, ProposalContext

#: the search moves on to the residual problem of the unrecovered samples once this fraction of
#: them has been peeled since the last move (each move makes the proposers start afresh)
RESIDUAL_STEP = 0.1
#: ... or, with at least one sample peeled since that move, once this many steps in a row have
#: peeled none: the proposers have given what they can on this problem
RESIDUAL_STALL_STEPS = 10


def lift(snapped: SnapResult, basis: torch.Tensor) -> SnapResult:
    """Directions of a residual problem (k x b') as directions of the full one (k x b); the
    zero masks are the same, since ``L B q' = L q``."""
    q = snapped.directions @ basis.T
    return replace(snapped, directions=canonical_sign(q / q.norm(dim=1, keepdim=True)))


def residual_found(pool: CandidatePool, basis: torch.Tensor) -> torch.Tensor:
    """The pool's trusted, not yet peeled directions that belong to the residual problem (they
    lie in the span of ``basis``), in its coordinates."""
    q = pool.directions[pool.trusted_mask & ~pool.certified]
    coords = q @ basis
    inside = coords.norm(dim=1) >= 1.0 - 1e-9
    return coords[inside] / coords[inside].norm(dim=1, keepdim=True)


class ResidualSearch:
    """The proposers' current problem.

    It starts as the whole layer (``root``). Once enough samples were peeled, it becomes the
    residual SPEAR problem of the others, whose directions map back through ``basis``
    (b x b_rest); with one sample left, that sample's direction is the basis itself.

    Attributes:
        root: the whole layer's proposal context (its ``found`` / ``known`` track the pool).
        ctx: the context the proposers work on now.
        basis: None on the whole layer, else the residual problem's basis.
    """

    def __init__(self, root: ProposalContext) -> None:
        self.root = root
        self.ctx = root
        self.basis: torch.Tensor | None = None
        self._peeled_at_move = 0
        self._peeled_seen = 0  # samples peeled at the last update
        self._quiet_steps = 0  # updates in a row since then that peeled none
        #: whether to move to the residual problem at all (only when the search's own directions
        #: are peeled; samples peeled otherwise, e.g. from singleton neurons, only join the pool)
        self.follows_peeling = True
        #: the last :meth:`snap`'s trailing directions that re-anchoring gave
        self.anchored = 0

    @property
    def on_last_sample(self) -> bool:
        return self.basis is not None and self.ctx.batch_size == 1

    def propose(self, proposer: DirectionProposer, remaining: int) -> ProposalBatch:
        if self.on_last_sample:
            assert self.basis is not None
            return ProposalBatch(self.basis.new_ones(1, 1), n_drawn=1)
        return proposer.propose(self.ctx, remaining)

    def snap(self, batch: ProposalBatch, tol: Tolerances, known: torch.Tensor) -> SnapResult:
        """Exact directions of the whole layer from a batch of proposals on the current one.

        On a residual problem the proposals are snapped there (their hints are row sets of its b'
        dimensions) and lifted; the lifted ones that drifted off their own zeros are re-anchored
        on the whole layer and snapped there too (:mod:`spear.core.anchor`, after the lifted
        ones: ``anchored`` counts them, :meth:`settled` keeps those peeling certifies). The
        last sample's direction is forced (no search, so no false acceptance for the threshold
        to bound): it skips the threshold, and where it falls short
        (subtracting the peeled samples leaves ~1e-10 on true zeros) it is solved again exactly
        on the whole layer (``_resolve``)."""
        self.anchored = 0
        threshold: int | torch.Tensor = 0 if self.on_last_sample else self.root.threshold_count
        if batch.confirmed is not None and batch.zero_hint is not None:
            kernel = self.ctx.batch_size - 1  # a confirmed hint needs only its kernel's rows
            threshold = torch.where(batch.confirmed, min(threshold, kernel), threshold)
        snapped = snap_and_filter(
            self.ctx.L,
            batch.directions,
            batch.zero_hint,
            threshold,
            tol.zero_rtol,
            known_masks=known,
            zero_floor=tol.zero_floor,
            rounding=self.ctx.rounding,
            deadline=self.ctx.deadline,
        )
        if batch.pinned is not None and batch.pinned.shape[0] and self.basis is None:
            # pinned on the whole layer only: a residual problem built from float32 peeled
            # samples holds the others' columns only to ~1e-3 (see _reanchored)
            known = torch.cat([known, snapped.zero_masks])
            pinned = take_pinned(self.ctx.L, batch.pinned, tol.zero_rtol, known, tol.zero_floor)
            snapped = SnapResult.concat([snapped, pinned])
        if self.basis is None:
            return snapped
        lifted = lift(snapped, self.basis)
        if not self.on_last_sample:
            if self.ctx.deadline.passed():
                return lifted  # the run ends here: re-anchoring would only overrun the budget
            drifted = lifted.directions[drifted_off_zeros(self.root.L, lifted, tol.zero_rtol)]
            if not drifted.shape[0]:
                return lifted
            known = torch.cat([known, lifted.zero_masks])
            # what the whole layer's threshold dropped says nothing of the residual problem's
            anchored = replace(self._reanchored(drifted, tol, known), dropped_sparsest=0)
            self.anchored = anchored.directions.shape[0]
            return SnapResult.concat([lifted, anchored])
        done = lifted.zero_counts >= self.root.threshold_count
        if bool(done.all()):
            return lifted
        return SnapResult.concat([lifted.select(done), self._resolve(lifted.select(~done), tol, known)])

    def settled(self, snapped: SnapResult) -> SnapResult:
        """The last :meth:`snap` after peeling, without the re-anchored directions peeling did
        not certify (mixtures re-anchor too, and crowd the pool and the greedy swaps). Once
        only: other results that reach peeling (the stall and sparsity probes) hold none."""
        n, k = snapped.directions.shape[0], self.anchored
        self.anchored = 0
        if not k:
            return snapped
        keep = torch.ones(n, dtype=torch.bool, device=snapped.directions.device)
        keep[n - k :] = False if snapped.certified is None else snapped.certified[n - k :]
        return snapped.select(keep)

    def _reanchored(self, directions: torch.Tensor, tol: Tolerances, known: torch.Tensor) -> SnapResult:
        """Directions (k, b) of the whole layer re-anchored there (:mod:`spear.core.anchor`: a
        residual problem built from float32 peeled samples holds the others' directions only
        to ~1e-3, and peeling refutes what it finds of them) and snapped exactly; those whose
        zero set is new."""
        anchored = reanchor(self.root.L, directions, deadline=self.root.deadline)
        return snap_and_filter(
            self.root.L,
            anchored[torch.isfinite(anchored).all(dim=1)],
            None,
            self.root.threshold_count,
            tol.zero_rtol,
            known_masks=known,
            zero_floor=tol.zero_floor,
            rounding=self.root.rounding,
            deadline=self.root.deadline,
        )

    def _resolve(self, lifted: SnapResult, tol: Tolerances, known: torch.Tensor) -> SnapResult:
        """The last sample's lifted direction solved again exactly on its zero set in the whole
        layer, kept when its zeros pin it (``b - 1`` of them at least): peeling or the model
        certifies it next."""
        final = self.root.batch_size - 1
        _, pinned, _ = kernel_of_rows(self.root.L, lifted.zero_masks)
        exact = snap_and_filter(
            self.root.L,
            lifted.directions[pinned],
            lifted.zero_masks[pinned],
            final,
            tol.zero_rtol,
            known_masks=known,
            zero_floor=tol.zero_floor,
            rounding=self.root.rounding,
        )
        # a zero set that a peeled sample shares has a larger kernel in the whole layer: only
        # the residual problem (which excludes the peeled, certified samples) pins that
        # direction, and its robustness there is what counts
        shared = lifted.select(~pinned & (lifted.zero_counts >= final))
        return SnapResult.concat([exact, shared])

    def _should_move(self, peeled: int, dropping: bool) -> bool:
        """Whether to move to the residual problem of the samples not yet peeled: once a tenth
        of them (``RESIDUAL_STEP``) was peeled since the last move, or once the search stalls
        with fewer: ``RESIDUAL_STALL_STEPS`` steps in a row that peeled nothing and dropped no
        ReLU-sparse direction for the threshold (``dropping``).

        The stall rule matters where each residual problem offers the proposers only a few
        columns: the next layer's zero sets of a trained network are intersections over many
        samples, and only subtracting the peeled ones opens new sets. MNIST, 6 x 256, trained
        200 steps, float32, b = 64: five columns of the residual problem of 57 samples, none
        after, 10 of 64 in 30 s. A search that keeps dropping sparse directions stalls on its
        threshold instead, which the stall probe lowers on the problem it probes; moving under
        it there cost the probe its finds (MNIST, 6 x 500, layer 2, trained 200 steps, float64,
        b = 64, seed 4: 1 of 10 attack seeds whole in 400k proposals, against 5 without the
        stall rule and 6 with this exception). Counts the step: call it once per update."""
        if peeled != self._peeled_seen or dropping:
            self._peeled_seen, self._quiet_steps = peeled, 0
        else:
            self._quiet_steps += 1
        moved = peeled - self._peeled_at_move
        step = max(1, math.ceil(RESIDUAL_STEP * (self.root.batch_size - self._peeled_at_move)))
        return moved >= step or (moved >= 1 and self._quiet_steps >= RESIDUAL_STALL_STEPS)

    def update(
        self, pool: CandidatePool, peeled: PeeledSamples, changed: bool, fresh: int, dropping: bool = False
    ) -> bool:
        """After a step: track the pool, and move to (or within) the residual problem.

        Returns False when the last sample's direction did not certify: the search is back on
        the whole layer and peeling should stop."""
        if changed:  # proposers deflate against / guide from the trusted candidates
            self.root.found = pool.trusted
            self.root.known = int(pool.trusted_mask.sum())
        b = self.root.batch_size
        if self.on_last_sample and fresh == 0:
            self.ctx, self.basis = self.root, None
            return False
        if self._should_move(len(peeled), dropping) and self.follows_peeling and len(peeled) < b:
            assert self.root.problem is not None
            rest, self.basis = residual_problem(self.root.problem, peeled)
            self.ctx = ProposalContext(
                L=rest.sparse_factor,
                batch_size=rest.batch_size,
                threshold_count=self.root.threshold_count,
                generator=self.root.generator,
                proposal_dtype=self.root.proposal_dtype,
                found=residual_found(pool, self.basis),
                problem=rest,
                known=self.root.known,
                zero_rtol=self.root.zero_rtol,
                deadline=self.root.deadline,
                noisy=self.root.noisy,
                rounding=None if self.root.rounding is None else self.root.rounding @ self.basis,
                copy_angle=self.root.copy_angle,
            )
            self._peeled_at_move = len(peeled)
        elif self.basis is not None and changed:
            self.ctx.found, self.ctx.known = residual_found(pool, self.basis), self.root.known
        return True
