"""Direction proposers: every way of proposing candidate columns of the disaggregation matrix.

A proposer yields rough directions ``q`` (length b) for which ``L q`` should be sparse. The core
snaps and checks every proposal exactly (:mod:`spear.core.filtering`), so a proposer never has to
be right, only often right. A new strategy is one new file with one :class:`DirectionProposer`.
"""

from spear.core.proposers.auto import AutoProposer
from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext
from spear.core.proposers.guided import GuidedSampler
from spear.core.proposers.masked_subspace import MaskedSubspaceProposer
from spear.core.proposers.neurons import NeuronGuidedSampler
from spear.core.proposers.next_layer import NextLayerProposer
from spear.core.proposers.noisy import NoisySubmatrixSampler
from spear.core.proposers.prior import PriorGuidedProposer
from spear.core.proposers.sampling import RandomSubmatrixSampler
from spear.core.proposers.sparse_recovery import SparseRecoveryProposer
from spear.core.proposers.vertices import VertexProposer

#: proposers selectable by name (``proposer="..."``)
PROPOSERS = {
    "sampling": RandomSubmatrixSampler,
    "irls": SparseRecoveryProposer,
    "guided": GuidedSampler,
    "neurons": NeuronGuidedSampler,
    "next_layer": NextLayerProposer,
    "subspace": MaskedSubspaceProposer,
    "noisy": NoisySubmatrixSampler,
    "vertices": VertexProposer,
    "auto": AutoProposer,
}

__all__ = [
    "PROPOSERS",
    "AutoProposer",
    "DirectionProposer",
    "GuidedSampler",
    "MaskedSubspaceProposer",
    "NeuronGuidedSampler",
    "NextLayerProposer",
    "NoisySubmatrixSampler",
    "PriorGuidedProposer",
    "ProposalBatch",
    "ProposalContext",
    "RandomSubmatrixSampler",
    "SparseRecoveryProposer",
    "VertexProposer",
]
