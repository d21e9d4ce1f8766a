"""What one attack takes and gives: options, progress events, statistics, the result.

These are the public types of :func:`spear.reconstruct` and :func:`spear.attack_layer`; the
attack itself is :mod:`spear.core.reconstruct`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from spear.core.proposers import DirectionProposer
from spear.core.scale import SparsityMode


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
        seed: seed of every random choice (an integer).
        dtype: working dtype of the exact stages (float64 for exact results).
        proposal_dtype: dtype the sampler drafts proposals in (float32 is ~2x faster; survivors
            are re-solved in ``dtype``).
        device: "cpu" or "cuda".
        time_budget: seconds after which the attack stops and returns its best result.
        early_stop: stop as soon as sigma = 1 (Algorithm 1, line 9).
        sparsity: "output" when the layer is followed by a ReLU (dL/dZ sparse, the default),
            "input" when it is preceded by one (X sparse, Section 3.2).
        batch_size: known batch size; overrides the numerical-rank estimate.
        rank_rtol: relative singular-value threshold of the rank estimate, in (0, 1).
        zero_rtol: entries below ``zero_rtol * max`` count as zeros, in (0, 1).
        verify_rtol: relative tolerance of the gradient verification, in (0, 1).
        proposer: a :class:`DirectionProposer`, or a name: "auto" (default: random sampling for
            small batches; for large ones next-layer zero sets, neuron-guided and
            complement-guided sampling and ICA+IRLS, see :class:`AutoProposer`), "sampling" (the
            paper's Algorithm 1), "irls", "guided", "neurons", "next_layer", "subspace" (one strategy only).
        peel: recover samples one at a time through the next layer's weight gradient, when it
            is given, and continue on the residual problem of the others (:mod:`spear.core.peeling`).
        clients: the gradient is the sum of this many clients' updates (secure aggregation):
            the model certificate then expects each sample's weight to be ``1/B_k`` of its own
            client's batch (:func:`spear.core.certificate.infer_aggregate`).
        stop_when: an outside check of a complete batch whose sigma is below 1 (e.g. FedAvg's
            replay, :mod:`spear.fl.replay`): called with the inputs (b, n) and dL/dZ (m, b) of
            each new best selection; when it returns True the attack stops ("accepted").
        progress: called with a :class:`ProgressEvent` after every step.
        client_dtype: the precision the client computed its gradient in (``torch.float16`` or
            ``torch.bfloat16`` for a client under autocast), where its tolerances come from.
            None: read off the gradient's entries (:func:`spear.api.stored_precision`); set it
            where they no longer show it (a residual after certified samples were subtracted,
            as :func:`spear.attack_model` does).
        row_noise: (m,) how large each row of dL/dW may be without a sample in it (its norm):
            the noise that subtracting certified samples leaves in a residual, which
            :func:`spear.attack_model` passes. A live row that no sample of a batch activates
            proves a missing sample (:func:`spear.core.verify.uncovered_rows`) only above it.
            None: every nonzero row counts.
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
    clients: int = 1
    stop_when: Callable[[torch.Tensor, torch.Tensor], bool] | None = field(default=None, compare=False)
    progress: Callable[[ProgressEvent], None] | None = field(default=None, compare=False)
    client_dtype: torch.dtype | None = None
    row_noise: torch.Tensor | None = field(default=None, compare=False)


@dataclass(frozen=True)
class AttackStats:
    proposals: int
    candidates: int
    seconds: float
    seed: int
    proposer: str
    #: "sigma=1", "explained" (a verified batch below sigma = 1 for silent entries the model
    #: explains, or inactive entries within a faint column's rounding), "accepted", "budget",
    #: "time budget", "interrupted", "exhausted", "trivial"
    stop_reason: str
    threshold_count: int
    tau: float
    certified: int = 0  # samples certified one by one (peeled, or model-certified columns)
    dead_neurons: int = 0  # neurons inactive for the whole batch (left out of the search)
    certificate_seconds: float = 0.0  # time spent in the model-level certificate

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Reconstruction:
    """The result of one attack on one layer.

    Attributes:
        inputs: (b, n) reconstructed batch in arbitrary order, or None when fewer than b
            independent directions were found (then ``message`` says so).
        grad_outputs: (m, b) reconstructed dL/dZ (columns in the order of ``inputs``).
        batch_size: b, the numerical rank of dL/dW; None when the time budget ran out before
            it was read (in the setup's SVD, which cannot be cut: ``stats.stop_reason`` is then
            "time budget" and ``singular_values`` empty).
        sigma: sparsity-matching coefficient of the result (Definition 4.1, tolerance-aware);
            1 means every entry of dL/dZ matches the ReLU pattern of the reconstructed
            pre-activations, both ways.
        verified: the batch is proven, at the level ``verified_by`` names: "model" (every sample
            certified on its own through the rest of the network, labels recovered) or "layer"
            (gradients reproduced, ReLU pattern consistent both ways, and every sample pinned by
            its zero set, so no other batch is consistent with this layer's gradient). See
            "What verified means" in the README.
        residual: the relative error of the recomputed gradients.
        consistent_directions: how many of the b columns match the ReLU pattern entry for entry.
        directions: (b, b) unit directions (columns), scales: (b,) Theorem 3.6's scales.
        singular_values: all singular values of dL/dW, to inspect the rank gap.
        stats: proposals, candidates, seconds, seed, stop reason.
        message: a one-line human summary.
        certified_inputs: (f, n) the samples recovered and certified one at a time (through
            the next layer's gradient, or the model), or None. They are exact even when the
            whole batch was not recovered (then ``inputs`` is None). When the batch is
            consistent but not verified as a whole, its columns the model certifies on their
            own (discriminative fit, one sample's weight, not saturated) are among them.
        labels: (b,) the label of each sample, from the model-level certificate (-1 where it
            did not certify one), or None without a model.
        multiplicities: (b,) how many samples each column stands for (its loss weight over one
            sample's: exact duplicates share a column, as do samples whose gradients coincide;
            such a column determines only their mean and the batch is not verified), and
            ``reduction`` ("mean" or "sum"), when the model-level certificate could tell.
        client_batch_size, missing_samples: for a mean loss, the client's batch size B (read off
            the loss weight 1/B) and how many of its samples left no trace in this layer (every
            neuron inactive for them, or gradients below the others' rounding on neurons the
            others activate too: no attack on this layer can see them).
        client_sizes: (b,) under secure aggregation (``clients`` > 1), each sample's own
            client's batch size B_k, read off its loss weight 1/B_k; None for one client.
        consistent: the gradients are reproduced and sigma = 1 (necessary, not sufficient), or
            sigma < 1 only for silent entries the model explains (then ``consistent_directions``
            < b and ``notes`` say so; :func:`spear.core.verdict.model_explains_silent`).
        ambiguous: groups of sample indices (into ``inputs``) that this layer's gradient does
            not determine (e.g. samples sharing an activation pattern: only their span is).
        certified_labels: (f,) labels of ``certified_inputs`` (-1 where unknown), or None.
        certified_weights: (f,) their loss weights as the model certificate fitted them (1/B
            for a batch mean; NaN where unknown), or None with ``certified_labels``.
        notes: further remarks (e.g. that the model's certificate fits no sample, or that the
            columns are too dense for the sparsity filter).
        input_precision: (b,) for a verified batch, how precisely the gradient determines
            each sample of ``inputs``, relative to its size: the rounding (or noise) of the
            gradient carried into its column of dL/dZ and its input, to first order
            (:func:`spear.core.verdict.data_precision`). An estimate, not a bound: over 16
            verified batches (``benchmarks/bench_precision.py``: float32 and float64, MLP and
            CNN feature layers, both sparsity modes, trained and untrained, b = 16-64) every
            input's relative error was at most 1.6 times it. Faint samples (well classified: a
            small gradient) are known less precisely than the others. None when the batch is
            not verified: the estimate assumes the directions are right. It is the precision
            of the batch the update shows: near-duplicates it cannot tell apart read as one
            sample, whose estimate says nothing of its distance to either true one.
        certified_precision: (f,) the same estimate for each of ``certified_inputs``, from the
            consistent batch whose value it reports (NaN for a peeled sample that reports its
            own value: no batch was consistent, or the batch assembles it otherwise), or None
            with ``certified_inputs``. A faint sample is certified at its own precision (its
            misfit and weight checked to it), so its input may be off by about this much: 4e-5
            of its size for a sample with a loss of 1e-9 (float64, MNIST, an untrained shallow
            MLP, b = 23), where the others are known to 1e-13.
    """

    inputs: torch.Tensor | None
    grad_outputs: torch.Tensor | None
    batch_size: int | None
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
    labels: torch.Tensor | None = None
    multiplicities: torch.Tensor | None = None
    reduction: str | None = None
    verified_by: str | None = None
    consistent: bool = False
    ambiguous: tuple[tuple[int, ...], ...] = ()
    certified_labels: torch.Tensor | None = None
    certified_weights: torch.Tensor | None = None
    notes: tuple[str, ...] = ()
    client_batch_size: int | None = None
    missing_samples: int | None = None
    client_sizes: torch.Tensor | None = None
    input_precision: torch.Tensor | None = None
    certified_precision: torch.Tensor | None = None

    @classmethod
    def not_recovered(cls, message: str, **fields: Any) -> Reconstruction:
        """A result without a batch (no b independent directions): nothing verified; ``fields``
        are the rest (``batch_size``, ``singular_values``, ``stats``, ...)."""
        return cls(
            inputs=None,
            grad_outputs=None,
            sigma=float("nan"),
            verified=False,
            residual=float("inf"),
            consistent_directions=0,
            directions=None,
            scales=None,
            message=message,
            **fields,
        )

    def to(self, device: torch.device | str) -> Reconstruction:
        """This result with every tensor on ``device`` (e.g. ``rec.to("cpu")`` after an attack
        run with ``device="cuda"``, to compare with data on the CPU)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def summary(self) -> dict:
        """JSON-ready summary (no tensors)."""

        def listed(t: torch.Tensor | None) -> list | None:
            return None if t is None else [int(v) for v in t.tolist()]

        return {
            "batch_size": self.batch_size,
            "verified": self.verified,
            "verified_by": self.verified_by,
            "consistent": self.consistent,
            "residual": self.residual,
            "sigma": self.sigma,
            "consistent_directions": self.consistent_directions,
            "certified_samples": 0 if self.certified_inputs is None else int(self.certified_inputs.shape[0]),
            "labels": listed(self.labels),
            "multiplicities": listed(self.multiplicities),
            "reduction": self.reduction,
            "client_batch_size": self.client_batch_size,
            "missing_samples": self.missing_samples,
            "client_sizes": listed(self.client_sizes),
            "ambiguous": [list(g) for g in self.ambiguous],
            "input_precision": None
            if self.input_precision is None
            else [float(f"{v:.3g}") for v in self.input_precision.tolist()],
            "certified_precision": None
            if self.certified_precision is None
            else [float(f"{v:.3g}") for v in self.certified_precision.tolist()],
            "mode": self.mode,
            "message": self.message,
            "notes": list(self.notes),
            "stats": self.stats.as_dict(),
        }


__all__ = ["AttackOptions", "AttackStats", "ProgressEvent", "Reconstruction"]
